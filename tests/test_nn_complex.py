"""Complex tensors in the nn family (core/nn.py) against torch.func: convolution (split into
three real ones, NOTE [A complex convolution is three real ones]), linear (the adjoint's conj
in its vjp), padding in every mode, unfold, fold and l1_loss, on complex64 and complex128,
under vjp, jvp, grad of a real loss and vmap; real inputs promoted to meet a complex weight;
and the refusal of the ops of the family that still take real tensors only."""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core.errors import TransformError
from complex_inputs import complex_tensor as _complex
from complex_inputs import like as _like
from complex_inputs import tolerances as _tol

DTYPES = [torch.complex64, torch.complex128]


# name: (function, the shapes of its complex arguments)
CASES = {
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1),
               [(2, 4, 9), (6, 4, 3), (6,)]),
    "conv1d unbatched": (lambda x, w: F.conv1d(x, w), [(4, 9), (3, 4, 2)]),
    "conv2d groups": (lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2),
                      [(2, 4, 6, 5), (6, 2, 3, 2), (6,)]),
    "conv2d dilation same": (lambda x, w: F.conv2d(x, w, padding="same", dilation=2),
                             [(2, 3, 6, 6), (4, 3, 2, 3)]),
    "conv2d stride": (lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1)),
                      [(1, 2, 7, 5), (3, 2, 3, 3), (3,)]),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b, padding=(1, 0, 1)),
               [(2, 2, 4, 3, 3), (3, 2, 2, 2, 2), (3,)]),
    "conv_transpose1d": (lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, output_padding=1),
                         [(2, 4, 7), (4, 3, 3), (3,)]),
    "conv_transpose2d groups": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, groups=2),
        [(2, 4, 5, 4), (4, 2, 3, 3), (4,)]),
    "conv_transpose3d": (lambda x, w: F.conv_transpose3d(x, w, stride=(1, 2, 1)),
                         [(1, 2, 3, 3, 2), (2, 3, 2, 2, 2)]),
    "linear": (F.linear, [(5, 4), (3, 4), (3,)]),
    "linear 3-D input, no bias": (F.linear, [(2, 5, 4), (3, 4)]),
    "linear vector": (F.linear, [(4,), (3, 4), (3,)]),
    "pad constant": (lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), [(2, 3, 4)]),
    "pad reflect": (lambda x: F.pad(x, (2, 1), mode="reflect"), [(2, 3, 5)]),
    "pad replicate": (lambda x: F.pad(x, (1, 2, 0, 1), mode="replicate"), [(1, 2, 4, 5)]),
    "pad replicate negative": (lambda x: F.pad(x, (-1, 2, 1, -2), mode="replicate"),
                               [(2, 4, 5)]),
    "pad circular": (lambda x: F.pad(x, (1, 1, 2, 0, 1, 1), mode="circular"),
                     [(1, 1, 3, 3, 4)]),
    "unfold": (lambda x: F.unfold(x, (2, 3), padding=1, stride=(2, 1)), [(2, 3, 5, 6)]),
    "unfold dilation, unbatched": (lambda x: F.unfold(x, 2, dilation=2), [(3, 5, 5)]),
    "fold": (lambda x: F.fold(x, (4, 5), (2, 2)), [(2, 12, 12)]),
    "fold stride padding": (lambda x: F.fold(x, (5, 4), (3, 2), padding=1, stride=2),
                            [(1, 12, 9)]),
    "l1_loss": (F.l1_loss, [(3, 4), (3, 4)]),
    "l1_loss sum": (lambda x, t: F.l1_loss(x, t, reduction="sum"), [(3, 4), (3, 4)]),
    "l1_loss none": (lambda x, t: F.l1_loss(x, t, reduction="none"), [(3, 4), (3, 4)]),
    "conv2d then relu of abs": (
        lambda x, w: torch.relu(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w).abs() - 1),
        [(2, 2, 5, 5), (3, 2, 3, 3)]),
}


def _args(name, dtype):
    return [_complex(shape, seed, dtype) for seed, shape in enumerate(CASES[name][1])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["c64", "c128"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_vjp(name, dtype):
    f, args = CASES[name][0], _args(name, dtype)
    out, vjp_fn = mf.vjp(f, *args)
    ref_out, ref_vjp_fn = tf.vjp(f, *args)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    ct = _like(ref_out, 10)
    torch.testing.assert_close(vjp_fn(ct), ref_vjp_fn(ct), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["c64", "c128"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp(name, dtype):
    f, args = CASES[name][0], _args(name, dtype)
    tangents = tuple(_like(a, 20 + i) for i, a in enumerate(args))
    torch.testing.assert_close(mf.jvp(f, tuple(args), tangents),
                               tf.jvp(f, tuple(args), tangents), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["c64", "c128"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_of_a_real_loss(name, dtype):
    f, args = CASES[name][0], _args(name, dtype)
    loss = lambda *a: f(*a).abs().pow(2).sum()  # noqa: E731
    argnums = tuple(range(len(args)))
    torch.testing.assert_close(mf.grad(loss, argnums=argnums)(*args),
                               tf.grad(loss, argnums=argnums)(*args), **_tol(dtype))


@pytest.mark.parametrize("all_batched", [False, True], ids=["first batched", "all batched"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap(name, all_batched):
    f, shapes = CASES[name]
    dtype = torch.complex64
    args = [_complex((3, *shape) if i == 0 or all_batched else shape, i, dtype)
            for i, shape in enumerate(shapes)]
    in_dims = tuple(0 if i == 0 or all_batched else None for i in range(len(args)))
    torch.testing.assert_close(mf.vmap(f, in_dims)(*args), tf.vmap(f, in_dims)(*args),
                               **_tol(dtype))


@pytest.mark.parametrize("name", ["conv1d", "conv2d groups", "conv_transpose2d groups",
                                  "linear", "pad reflect", "unfold", "l1_loss"])
def test_per_example_gradients(name):
    """vmap of grad, the examples batched and the rest shared: the weight gradient of a
    convolution batches both of its operands (NOTE [Batching a convolution: the groups
    trick])."""
    f, shapes = CASES[name]
    dtype = torch.complex64
    args = [_complex((3, *shape) if i == 0 else shape, i, dtype) for i, shape in enumerate(shapes)]
    in_dims = (0,) + (None,) * (len(args) - 1)
    loss = lambda *a: f(*a).abs().pow(2).sum()  # noqa: E731
    argnums = tuple(range(len(args)))
    torch.testing.assert_close(mf.vmap(mf.grad(loss, argnums=argnums), in_dims)(*args),
                               tf.vmap(tf.grad(loss, argnums=argnums), in_dims)(*args),
                               **_tol(dtype))


@pytest.mark.parametrize("name", ["conv2d groups", "conv_transpose1d", "linear"])
def test_second_order(name):
    """The gradient of a gradient's size: derivatives of the convolution's backward."""
    f, args = CASES[name][0], _args(name, torch.complex128)
    argnums = tuple(range(len(args)))

    def outer(ft):
        loss = lambda *a: f(*a).abs().pow(2).sum()  # noqa: E731
        return lambda *a: sum(g.abs().pow(2).sum() for g in ft.grad(loss, argnums=argnums)(*a))
    torch.testing.assert_close(mf.grad(outer(mf), argnums=argnums)(*args),
                               tf.grad(outer(tf), argnums=argnums)(*args), rtol=1e-9, atol=1e-9)


# --- real inputs meeting complex weights --------------------------------------------------------
# torch takes one dtype per convolution or linear, so a real input is promoted first; its
# gradient is the real part of its cotangent (NOTE [Complex numbers] in dispatch.py)
MIXED = {  # name: (function, shapes, which argument is real)
    "conv2d real input": (lambda x, w: F.conv2d(x.to(w.dtype), w, padding=1),
                          [(2, 3, 4, 4), (3, 3, 3, 3)], 0),
    "conv2d real weight": (lambda x, w: F.conv2d(x, w.to(x.dtype), padding=1),
                           [(2, 3, 4, 4), (3, 3, 3, 3)], 1),
    "conv_transpose1d real input": (lambda x, w: F.conv_transpose1d(x.to(w.dtype), w, stride=2),
                                    [(2, 3, 5), (3, 2, 3)], 0),
    "linear real input": (lambda x, w: F.linear(x.to(w.dtype), w), [(5, 4), (3, 4)], 0),
    "linear real weight": (lambda x, w: F.linear(x, w.to(x.dtype)), [(5, 4), (3, 4)], 1),
    "l1_loss real target": (lambda x, t: F.l1_loss(x, t), [(3, 4), (3, 4)], 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["c64", "c128"])
@pytest.mark.parametrize("name", sorted(MIXED))
def test_a_real_input_with_a_complex_weight(name, dtype):
    f, shapes, real = MIXED[name]
    args = [_complex(shape, i, dtype) for i, shape in enumerate(shapes)]
    args[real] = args[real].real.contiguous()
    out, vjp_fn = mf.vjp(f, *args)
    ref_out, ref_vjp_fn = tf.vjp(f, *args)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    ct = _like(ref_out, 5)
    ours, theirs = vjp_fn(ct), ref_vjp_fn(ct)
    assert ours[real].dtype == args[real].dtype  # the real part of its cotangent
    torch.testing.assert_close(ours, theirs, **_tol(dtype))
    tangents = tuple(_like(a, 6 + i) for i, a in enumerate(args))
    torch.testing.assert_close(mf.jvp(f, tuple(args), tangents),
                               tf.jvp(f, tuple(args), tangents), **_tol(dtype))
    loss = lambda *a: f(*a).abs().pow(2).sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(loss, argnums=(0, 1))(*args),
                               tf.grad(loss, argnums=(0, 1))(*args), **_tol(dtype))


def test_a_complex_input_with_a_real_weight_is_refused_as_in_torch():
    x, w = _complex((1, 2, 4, 4), 0, torch.complex64), torch.randn(3, 2, 2, 2)
    with pytest.raises(RuntimeError):
        F.conv2d(x, w)
    with pytest.raises(TransformError, match=r"conv2d\(input, weight, bias\): Input type "
                                             r"\(torch.complex64\) and weight type"):
        mf.vmap(F.conv2d, (0, None))(x[None], w)


# --- the rest of the family still refuses complex tensors ---------------------------------------
REFUSED = {
    "layer_norm": lambda z: F.layer_norm(z, (4,)),
    "group_norm": lambda z: F.group_norm(z, 1),
    "nll_loss": lambda z: F.nll_loss(z, torch.tensor([0, 3, 1])),
    "mse_loss": lambda z: F.mse_loss(z, z.flip(0)),
    "avg_pool1d": lambda z: F.avg_pool1d(z[None], 2),
    "max_pool1d": lambda z: F.max_pool1d(z[None], 2),
}


@pytest.mark.parametrize("transform", [
    lambda f, z: mf.vjp(f, z),
    lambda f, z: mf.jvp(f, (z,), (z,)),
    lambda f, z: mf.grad(lambda a: f(a).abs().sum())(z),
], ids=["vjp", "jvp", "grad"])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_other_ops_still_refuse_complex_tensors(name, transform):
    z = _complex((3, 4), 0, torch.complex64)
    with pytest.raises(TransformError, match="complex"):
        transform(REFUSED[name], z)
