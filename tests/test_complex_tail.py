"""Complex derivatives of scatter_add (scatter_reduce's sum and mean), logcumsumexp,
householder_product and ormqr against torch.func, on complex64 and complex128: vjp with a
complex cotangent, jvp with complex tangents, grad of a real loss and vmap of that grad
(NOTE [Complex numbers] in core/dispatch.py). ormqr has no jvp in torch: its jvp is checked
against the vjp, as its adjoint under Re<a, b>."""
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core.errors import TransformError, TransformUsageError
from complex_inputs import complex_tensor as _complex
from complex_inputs import like as _like
from complex_inputs import tolerances as _tol

DTYPES = [torch.complex64, torch.complex128]
IDS = ["c64", "c128"]


def _real_loss(f, w):
    return lambda *args: (f(*args) * w).sum().real


def _inputs(shapes, dtype):
    return tuple(_complex(shape, seed, dtype) for seed, shape in enumerate(shapes))


def _check_like_torch_func(f, inputs, dtype, ref=None):
    """vjp, jvp and grad of a real loss of ``f`` equal torch.func's of ``ref`` (``f`` itself
    unless torch.func refuses it and an equal function stands in)."""
    ref = f if ref is None else ref
    argnums = tuple(range(len(inputs)))
    out, vjp_fn = mf.vjp(f, *inputs)
    ref_out, ref_vjp_fn = tf.vjp(ref, *inputs)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    ct = _like(ref_out, 10)
    torch.testing.assert_close(vjp_fn(ct), ref_vjp_fn(ct), **_tol(dtype))
    tangents = tuple(_like(x, 20 + i) for i, x in enumerate(inputs))
    torch.testing.assert_close(mf.jvp(f, inputs, tangents), tf.jvp(ref, inputs, tangents),
                               **_tol(dtype))
    w = _like(ref_out, 30)
    torch.testing.assert_close(mf.grad(_real_loss(f, w), argnums=argnums)(*inputs),
                               tf.grad(_real_loss(ref, w), argnums=argnums)(*inputs),
                               **_tol(dtype))


def _check_vmap_of_grad(f, inputs, ref=None):
    """vmap of grad of a real loss, over a batch of three examples of every input."""
    ref = f if ref is None else ref
    argnums = tuple(range(len(inputs)))
    batch = tuple(torch.stack([x, x * (0.5 + 0.5j), x.conj()]) for x in inputs)
    w = _like(f(*inputs), 40)
    ours = mf.vmap(mf.grad(_real_loss(f, w), argnums=argnums))(*batch)
    theirs = tf.vmap(tf.grad(_real_loss(ref, w), argnums=argnums))(*batch)
    torch.testing.assert_close(ours, theirs, **_tol(inputs[0].dtype))


def _check_jvp_is_the_vjps_adjoint(f, inputs, dtype):
    """Re<ct, J t> = Re<J^H ct, t>, summed over the inputs."""
    out, vjp_fn = mf.vjp(f, *inputs)
    ct = _like(out, 10)
    tangents = tuple(_like(x, 20 + i) for i, x in enumerate(inputs))
    out_dot = mf.jvp(f, inputs, tangents)[1]
    lhs = torch.vdot(ct.flatten(), out_dot.flatten()).real
    rhs = sum(torch.vdot(bar.flatten(), t.flatten()).real
              for bar, t in zip(vjp_fn(ct), tangents))
    torch.testing.assert_close(lhs, rhs, **_tol(dtype))


# --- scatter_add: scatter_reduce's sum -------------------------------------------------------
INDEX = torch.tensor([[0, 2], [3, 3], [1, 0]])  # repeats along dim 1: sums of two


def _scatter_add(x, src):
    return torch.scatter_add(x, 1, INDEX, src)


SCATTER = {
    "scatter_add": (_scatter_add, None),
    "Tensor.scatter_add": (lambda x, src: x.scatter_add(1, INDEX, src.exp()), None),
    # torch refuses scatter_reduce on complex tensors: scatter_add, which it differentiates,
    # stands in for the sum and the mean
    "scatter_reduce sum": (
        lambda x, src: torch.scatter_reduce(x, 1, INDEX, src, "sum"), _scatter_add),
    "scatter_reduce sum exclude self": (
        lambda x, src: torch.scatter_reduce(x, 1, INDEX, src, "sum", include_self=False),
        lambda x, src: _scatter_add(x.scatter(1, INDEX, 0.0), src)),
    "scatter_reduce mean": (
        lambda x, src: torch.scatter_reduce(x, 1, INDEX, src, "mean"),
        lambda x, src: _scatter_add(x, src) / _scatter_add(torch.ones(3, 4), torch.ones(3, 2))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", sorted(SCATTER))
def test_scatter_add(name, dtype):
    f, ref = SCATTER[name]
    inputs = _inputs([(3, 4), (3, 2)], dtype)
    _check_like_torch_func(f, inputs, dtype, ref)
    _check_vmap_of_grad(f, inputs, ref)


def test_scatter_add_of_one_input():
    z = _complex((3, 4), 0, torch.complex64)
    f = lambda z: torch.scatter_add(z, 1, INDEX, z[:, 1:3].sin())  # noqa: E731
    _check_like_torch_func(f, (z,), z.dtype)


@pytest.mark.parametrize("reduce", ["prod", "amax", "amin"])
def test_other_reductions_are_refused_on_complex_tensors(reduce):
    # amax and amin have no meaning on complex numbers, prod is not checked; torch refuses
    # all three (every scatter_reduce on complex tensors)
    x, src = _inputs([(3, 4), (3, 2)], torch.complex64)
    f = lambda x: torch.scatter_reduce(x, 1, INDEX, src, reduce)  # noqa: E731
    words = f"scatter_reduce\\(..., reduce='{reduce}'\\): derivatives of complex tensors"
    with pytest.raises(TransformError, match=words):
        mf.vjp(f, x)
    with pytest.raises(TransformError, match=words):
        mf.jvp(f, (x,), (x,))
    if reduce == "prod":  # vmap needs no derivative
        torch.testing.assert_close(mf.vmap(f)(torch.stack([x, x])), torch.stack([f(x), f(x)]))


def test_index_reduce_prod_is_refused_on_complex_tensors():
    x, src = _inputs([(3, 4), (2, 4)], torch.complex64)
    with pytest.raises(TransformError, match="reduce='prod'"):
        mf.vjp(lambda x: x.index_reduce(0, torch.tensor([0, 2]), src, "prod"), x)


@pytest.mark.parametrize("op", [
    lambda x, src: torch.scatter_add(x, 1, INDEX, src),
    lambda x, src: torch.scatter(x, 1, INDEX, src),
    lambda x, src: torch.scatter_reduce(x, 1, INDEX, src, "sum"),
], ids=["scatter_add", "scatter", "scatter_reduce"])
def test_a_src_of_another_dtype_is_refused(op):
    # torch refuses it ("Expected self.dtype to be equal to src.dtype"); converting it would
    # drop an imaginary part (complex into real) or round it, and the other way round torch
    # refuses too
    x, src = torch.randn(3, 4), _complex((3, 2), 0, torch.complex64)
    with pytest.raises(RuntimeError, match="self.dtype to be equal to src.dtype"):
        tf.vmap(op, in_dims=(None, 0))(x, src[None])
    for call in (lambda: mf.vmap(op, in_dims=(None, 0))(x, src[None]),
                 lambda: mf.grad(lambda s: op(x, s).sum())(src.real.to(torch.complex64)),
                 lambda: mf.grad(lambda s: op(x.to(torch.complex64), s).abs().sum())(src.real),
                 lambda: mf.vmap(op, in_dims=(None, 0))(x, src.real.double()[None])):
        with pytest.raises(RuntimeError, match="self.dtype to be equal to src.dtype") as e:
            call()
        assert isinstance(e.value, TransformUsageError)


# --- logcumsumexp ------------------------------------------------------------------------------
LOGCUMSUMEXP = {
    "dim 1": (lambda z: torch.logcumsumexp(z, 1), (3, 4)),
    "dim 0": (lambda z: torch.logcumsumexp(z, 0), (3, 4)),
    "dim -1 of 3d": (lambda z: torch.logcumsumexp(z, -1), (2, 2, 5)),
    "1d": (lambda z: torch.logcumsumexp(z, 0), (6,)),
    "Tensor method, times z": (lambda z: z.logcumsumexp(1) * z, (3, 4)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", sorted(LOGCUMSUMEXP))
def test_logcumsumexp(name, dtype):
    f, shape = LOGCUMSUMEXP[name]
    inputs = _inputs([shape], dtype)
    _check_like_torch_func(f, inputs, dtype)
    _check_vmap_of_grad(f, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_logcumsumexp_vjp_of_a_cotangent_with_zeros(dtype):
    z = _complex((3, 4), 0, dtype)
    ct = _complex((3, 4), 1, dtype) * torch.tensor([1.0, 0.0, 1.0, 0.0])
    f = lambda z: torch.logcumsumexp(z, 1)  # noqa: E731
    torch.testing.assert_close(mf.vjp(f, z)[1](ct), tf.vjp(f, z)[1](ct), **_tol(dtype))


def test_logcumsumexp_of_large_real_parts():
    # torch's complex jvp sums exp(x) without subtracting the largest real part, and
    # overflows (nan); the jvp here stays the vjp's adjoint, which equals torch.func's
    z = _complex((3, 5), 3, torch.complex128) * 1000
    f = lambda z: torch.logcumsumexp(z, 1)  # noqa: E731
    ct = _like(z, 4)
    torch.testing.assert_close(mf.vjp(f, z)[1](ct), tf.vjp(f, z)[1](ct))
    assert torch.isnan(tf.jvp(f, (z,), (ct,))[1]).any()
    assert torch.isfinite(mf.jvp(f, (z,), (ct,))[1]).all()
    _check_jvp_is_the_vjps_adjoint(f, (z,), z.dtype)


def test_logcumsumexp_second_order():
    z = _complex((2, 4), 0, torch.complex128)
    w = _like(z, 1)
    loss = _real_loss(lambda z: torch.logcumsumexp(z, 1), w)
    t = _like(z, 2)
    hvp = lambda ft: ft.jvp(ft.grad(loss), (z,), (t,))[1]  # noqa: E731
    torch.testing.assert_close(hvp(mf), hvp(tf))


# --- householder_product -----------------------------------------------------------------------
def _reflectors(shape, dtype, seed=0):
    """geqrf's reflectors of a random matrix (their tau are those of a QR), and tau."""
    A, tau = torch.geqrf(_complex(shape, seed, dtype))
    return A, tau


HOUSEHOLDER = {
    "square": ((4, 4), 4, torch.linalg.householder_product),
    "tall": ((5, 3), 3, torch.linalg.householder_product),
    "fewer reflectors": ((5, 3), 2, torch.linalg.householder_product),
    "batched": ((2, 4, 3), 3, torch.linalg.householder_product),
    "orgqr": ((4, 3), 3, torch.orgqr),
    "times A": ((4, 3), 3, lambda A, tau: torch.linalg.householder_product(A, tau) * A.sin()),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", sorted(HOUSEHOLDER))
def test_householder_product(name, dtype):
    shape, k, f = HOUSEHOLDER[name]
    A, tau = _reflectors(shape, dtype)
    inputs = (A, tau[..., :k].contiguous())
    _check_like_torch_func(f, inputs, dtype)
    if len(shape) == 2:
        _check_vmap_of_grad(f, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_householder_product_of_random_tau(dtype):
    # tau need not make Q unitary
    inputs = _inputs([(4, 3), (3,)], dtype)
    _check_like_torch_func(torch.linalg.householder_product, inputs, dtype)


# --- ormqr: vjp against torch.func, jvp against the vjp ----------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("transpose", [False, True], ids=["Q", "QH"])
def test_ormqr(left, transpose, dtype):
    A, tau = _reflectors((4, 3), dtype)
    C = _complex((4, 2) if left else (2, 4), 5, dtype)
    f = lambda A, tau, C: torch.ormqr(A, tau, C, left, transpose)  # noqa: E731
    inputs = (A, tau, C)
    out, vjp_fn = mf.vjp(f, *inputs)
    ref_out, ref_vjp_fn = tf.vjp(f, *inputs)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    ct = _like(ref_out, 10)
    torch.testing.assert_close(vjp_fn(ct), ref_vjp_fn(ct), **_tol(dtype))
    _check_jvp_is_the_vjps_adjoint(f, inputs, dtype)
    w = _like(ref_out, 30)
    argnums = (0, 1, 2)
    torch.testing.assert_close(
        mf.vmap(mf.grad(_real_loss(f, w), argnums=argnums))(*(torch.stack([x, 2 * x])
                                                               for x in inputs)),
        tf.vmap(tf.grad(_real_loss(f, w), argnums=argnums))(*(torch.stack([x, 2 * x])
                                                               for x in inputs)),
        **_tol(dtype))


def test_ormqr_jvp_by_finite_differences():
    A, tau = _reflectors((4, 3), torch.complex128)
    C = _complex((4, 2), 5, torch.complex128)
    f = lambda A, tau, C: torch.ormqr(A, tau, C, True, True)  # noqa: E731
    tangents = (_like(A, 1), _like(tau, 2), _like(C, 3))
    eps = 1e-6
    plus = f(*(x + eps * t for x, t in zip((A, tau, C), tangents)))
    minus = f(*(x - eps * t for x, t in zip((A, tau, C), tangents)))
    torch.testing.assert_close(mf.jvp(f, (A, tau, C), tangents)[1], (plus - minus) / (2 * eps),
                               rtol=1e-6, atol=1e-6)


def test_householder_product_and_ormqr_second_order():
    # the rules are written with ops, so they differentiate again: forward-over-reverse for
    # householder_product, reverse-over-reverse for ormqr (torch's vjp is differentiable)
    A, tau = _reflectors((4, 3), torch.complex128)
    loss = _real_loss(torch.linalg.householder_product, _like(A, 3))
    t = (_like(A, 4), _like(tau, 5))
    hvp = lambda ft: ft.jvp(ft.grad(loss, argnums=(0, 1)), (A, tau), t)[1]  # noqa: E731
    torch.testing.assert_close(hvp(mf), hvp(tf))
    C = _complex((4, 2), 6, torch.complex128)
    f = lambda A, tau, C: torch.ormqr(A, tau, C, True, True)  # noqa: E731
    loss = _real_loss(f, _like(C, 7))
    vhp = lambda ft: ft.vjp(lambda *a: ft.grad(loss, argnums=(0, 1, 2))(*a)[0],  # noqa: E731
                            A, tau, C)[1](_like(A, 8))
    torch.testing.assert_close(vhp(mf), vhp(tf))
