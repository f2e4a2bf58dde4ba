"""The linear-algebra family (core/linalg.py) under every transform, against torch.func.

Inputs are well conditioned: square matrices are a random matrix plus 3 I, symmetric
positive definite ones X X^T + n I, built inside the case from a random X (so that the
function is one of a general matrix, and torch's symmetric-input derivatives of cholesky
and eigh agree with finite differences). Random matrices have distinct eigenvalues and
singular values. Factorizations with a sign freedom (svd, qr, eigh) are compared output by
output: both engines call the same kernel, so the signs agree.
"""
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core.errors import TransformError
from op_table import DTYPE, OpCase, normal
from oracle import (TRANSFORMS, assert_same, check_finite_differences, check_under_transform,
                    t_hessian, transform_params)

aten = torch.ops.aten


def case(name, fn, make, diff=(0,), hessian=False):
    return OpCase(name, fn, make, tuple(diff), hessian)


def well(g, *shape):
    """A random square matrix (or a batch) plus 3 I: invertible, well conditioned."""
    n = shape[-1]
    return normal(g, *shape) + 3 * torch.eye(n, dtype=DTYPE)


def spd(x):
    """X X^T + n I: symmetric positive definite, from any square X."""
    n = x.shape[-1]
    return x @ x.mT + n * torch.eye(n, dtype=x.dtype)


def triangular(g, *shape, upper=True):
    x = well(g, *shape)
    return x.triu() if upper else x.tril()


def lu_inputs(g, n=3, k=2):
    LU, pivots = torch.linalg.lu_factor(well(g, n, n))
    return LU.contiguous(), pivots, normal(g, n, k)


def householder_inputs(g, m=4, n=3):
    a, tau = torch.geqrf(normal(g, m, n))
    return a.contiguous(), tau


A3 = lambda g: (well(g, 3, 3),)  # noqa: E731
X3 = lambda g: (normal(g, 3, 3),)  # noqa: E731

CASES = [
    # --- inverse and determinants -------------------------------------------------------------
    case("inv", torch.linalg.inv, A3, hessian=True),
    case("inv_batched", torch.linalg.inv, lambda g: (well(g, 2, 3, 3),)),
    case("inverse_method", lambda a: a.inverse() @ a.sin(), A3),
    case("inv_ex", lambda a: torch.linalg.inv_ex(a).inverse, A3),
    case("det", torch.linalg.det, A3, hessian=True),
    case("det_batched", torch.det, lambda g: (well(g, 2, 3, 3),)),
    case("det_method", lambda a: a.det() * a.sum(), A3),
    case("slogdet", lambda a: torch.linalg.slogdet(a).logabsdet, A3, hessian=True),
    case("slogdet_sign", lambda a: torch.slogdet(-a).sign * a.slogdet()[1],
         lambda g: (well(g, 2, 3, 3),)),
    case("logdet", lambda x: torch.logdet(spd(x)), X3, hessian=True),
    case("logdet_negative", lambda a: a.logdet().nan_to_num(-1.0)[..., None, None] * a,
         lambda g: (well(g, 2, 3, 3) * torch.tensor([-1.0, 1.0], dtype=DTYPE)[:, None, None],)),
    # --- solves -------------------------------------------------------------------------------
    case("solve", torch.linalg.solve, lambda g: (well(g, 3, 3), normal(g, 3, 2)), diff=(0, 1),
         hessian=True),
    case("solve_vector", torch.linalg.solve, lambda g: (well(g, 3, 3), normal(g, 3)),
         diff=(0, 1)),
    case("solve_broadcast", torch.linalg.solve, lambda g: (well(g, 3, 3), normal(g, 2, 3, 2)),
         diff=(0, 1)),
    case("solve_batched_a", torch.linalg.solve, lambda g: (well(g, 2, 3, 3), normal(g, 3, 1)),
         diff=(0, 1)),
    case("solve_right", lambda a, b: torch.linalg.solve(a, b, left=False),
         lambda g: (well(g, 3, 3), normal(g, 2, 3)), diff=(0, 1)),
    case("solve_ex", lambda a, b: torch.linalg.solve_ex(a, b).result,
         lambda g: (well(g, 3, 3), normal(g, 3, 2)), diff=(0, 1)),
    case("solve_triangular", lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
         lambda g: (triangular(g, 3, 3), normal(g, 3, 2)), diff=(0, 1), hessian=True),
    case("solve_triangular_lower_right",
         lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=False),
         lambda g: (triangular(g, 3, 3, upper=False), normal(g, 2, 3)), diff=(0, 1)),
    case("solve_triangular_unit",
         lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, unitriangular=True),
         lambda g: (normal(g, 3, 3), normal(g, 2, 3, 2)), diff=(0, 1)),
    case("triangular_solve", lambda b, a: torch.triangular_solve(b, a).solution,
         lambda g: (normal(g, 3, 2), triangular(g, 3, 3)), diff=(0, 1)),
    case("triangular_solve_transpose",
         lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=True)[0],
         lambda g: (normal(g, 3, 2), triangular(g, 3, 3, upper=False)), diff=(0, 1)),
    case("triangular_solve_coefficient",
         lambda b, a: torch.triangular_solve(b, a, unitriangular=True).cloned_coefficient,
         lambda g: (normal(g, 3, 2), triangular(g, 3, 3)), diff=(0, 1)),
    # --- LU -----------------------------------------------------------------------------------
    case("lu_factor", lambda a: torch.linalg.lu_factor(a).LU, A3, hessian=True),
    case("lu_factor_wide", lambda a: torch.linalg.lu_factor_ex(a).LU,
         lambda g: (normal(g, 3, 4),)),
    case("lu_factor_tall", lambda a: torch.linalg.lu_factor(a)[0], lambda g: (normal(g, 4, 3),)),
    case("lu_L", lambda a: torch.linalg.lu(a).L, lambda g: (normal(g, 4, 3),)),
    case("lu_PLU", lambda a: torch.stack(torch.linalg.lu(a)).sum(0),
         lambda g: (normal(g, 3, 3),)),
    case("lu_solve", lambda lu, p, b: torch.linalg.lu_solve(lu, p, b), lu_inputs, diff=(0, 2),
         hessian=True),
    case("lu_solve_adjoint", lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, adjoint=True),
         lu_inputs, diff=(0, 2)),
    case("lu_solve_right", lambda lu, p, b: torch.linalg.lu_solve(lu, p, b.mT, left=False),
         lu_inputs, diff=(0, 2)),
    case("lu_solve_right_adjoint",
         lambda lu, p, b: torch.linalg.lu_solve(lu, p, b.mT, left=False, adjoint=True),
         lu_inputs, diff=(0, 2)),
    case("lu_unpack", lambda lu, p: torch.lu_unpack(lu, p).U @ torch.lu_unpack(lu, p)[1],
         lambda g: lu_inputs(g)[:2]),
    case("lu_unpack_wide", lambda lu, p: torch.lu_unpack(lu, p).L.sum() * lu,
         lambda g: [t.contiguous() for t in torch.linalg.lu_factor(normal(g, 3, 5))]),
    # --- Cholesky -----------------------------------------------------------------------------
    case("cholesky", lambda x: torch.linalg.cholesky(spd(x)), X3, hessian=True),
    case("cholesky_upper", lambda x: torch.linalg.cholesky(spd(x), upper=True),
         lambda g: (normal(g, 2, 3, 3),)),
    case("cholesky_old", lambda x: torch.cholesky(spd(x), True), X3),
    case("cholesky_ex", lambda x: torch.linalg.cholesky_ex(spd(x)).L, X3),
    case("cholesky_direct", torch.linalg.cholesky, lambda g: (spd(normal(g, 3, 3)),)),
    case("cholesky_inverse", lambda x: torch.cholesky_inverse(torch.linalg.cholesky(spd(x))),
         X3, hessian=True),
    case("cholesky_inverse_upper", lambda l: torch.cholesky_inverse(l, upper=True),
         lambda g: (triangular(g, 3, 3),)),
    case("cholesky_solve", lambda b, l: torch.cholesky_solve(b, l),
         lambda g: (normal(g, 3, 2), triangular(g, 3, 3, upper=False)), diff=(0, 1)),
    case("cholesky_solve_upper", lambda b, l: torch.cholesky_solve(b, l, upper=True),
         lambda g: (normal(g, 2, 3, 2), triangular(g, 3, 3)), diff=(0, 1)),
    # --- eigh, eig, svd, qr ---------------------------------------------------------------------
    case("eigvalsh", lambda x: torch.linalg.eigvalsh(spd(x)), X3, hessian=True),
    case("eigh_values", lambda x: torch.linalg.eigh(spd(x)).eigenvalues, X3),
    case("eigh_vectors", lambda x: torch.linalg.eigh(spd(x)).eigenvectors, X3, hessian=True),
    case("eigh_upper", lambda x: torch.linalg.eigh(spd(x), UPLO="U")[1],
         lambda g: (normal(g, 2, 3, 3),)),
    case("eigh_direct", lambda a: torch.linalg.eigh(a)[1], lambda g: (spd(normal(g, 3, 3)),)),
    # eig of a real matrix is complex: these cases look at real functions of it
    case("eigvals", lambda a: torch.view_as_real(torch.linalg.eigvals(a)), A3, hessian=True),
    case("eig_vectors", lambda a: torch.linalg.eig(a).eigenvectors.abs(), A3, hessian=True),
    case("eig_both", lambda a: (lambda L, V: L.real[..., None] * V.abs())(*torch.linalg.eig(a)),
         lambda g: (well(g, 2, 3, 3),)),
    case("svdvals", torch.linalg.svdvals, lambda g: (normal(g, 4, 3),), hessian=True),
    case("svd_u", lambda a: torch.linalg.svd(a, full_matrices=False).U,
         lambda g: (normal(g, 4, 3),), hessian=True),
    case("svd_s", lambda a: torch.linalg.svd(a)[1], lambda g: (normal(g, 3, 4),)),
    case("svd_vh", lambda a: torch.linalg.svd(a, full_matrices=False).Vh,
         lambda g: (normal(g, 3, 4),)),
    case("svd_square", lambda a: torch.stack(torch.linalg.svd(a)[::2]), X3),
    case("svd_reconstruct", lambda a: (lambda u, s, vh: (u * s[..., None, :]) @ vh)(
        *torch.linalg.svd(a, full_matrices=False)), lambda g: (normal(g, 2, 4, 3),)),
    case("svd_old", lambda a: torch.svd(a).V, lambda g: (normal(g, 4, 3),)),
    case("qr_q", lambda a: torch.linalg.qr(a).Q, lambda g: (normal(g, 4, 3),), hessian=True),
    case("qr_r", lambda a: torch.linalg.qr(a)[1], lambda g: (normal(g, 4, 3),)),
    case("qr_wide_q", lambda a: torch.linalg.qr(a)[0], lambda g: (normal(g, 3, 4),)),
    case("qr_wide_r", lambda a: torch.linalg.qr(a).R, lambda g: (normal(g, 3, 4),)),
    case("qr_complete_wide", lambda a: torch.linalg.qr(a, mode="complete").R,
         lambda g: (normal(g, 2, 3, 4),)),
    case("qr_old", lambda a: torch.qr(a).Q, lambda g: (normal(g, 3, 3),)),
    # --- pseudo-inverse, least squares, matrix exponential, Householder -------------------------
    case("pinv_wide", torch.linalg.pinv, lambda g: (normal(g, 3, 4),), hessian=True),
    case("pinv_tall", torch.linalg.pinv, lambda g: (normal(g, 4, 3),)),
    case("pinv_hermitian", lambda x: torch.linalg.pinv(spd(x), hermitian=True), X3),
    case("pinv_rtol", lambda a: torch.linalg.pinv(a, rtol=1e-6), lambda g: (normal(g, 2, 3, 4),)),
    case("pinverse", lambda a: torch.pinverse(a), lambda g: (normal(g, 4, 3),)),
    case("lstsq", lambda a, b: torch.linalg.lstsq(a, b).solution,
         lambda g: (normal(g, 4, 3), normal(g, 4, 2)), diff=(0, 1), hessian=True),
    case("lstsq_vector", lambda a, b: torch.linalg.lstsq(a, b)[0],
         lambda g: (normal(g, 4, 3), normal(g, 4)), diff=(0, 1)),
    case("lstsq_residuals", lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd").residuals,
         lambda g: (normal(g, 5, 3), normal(g, 5, 2)), diff=(0, 1)),
    case("matrix_exp", torch.linalg.matrix_exp, lambda g: (normal(g, 3, 3) * 0.5,),
         hessian=True),
    case("matrix_exp_method", lambda a: a.matrix_exp(), lambda g: (normal(g, 2, 3, 3) * 0.5,)),
    case("householder_product", torch.linalg.householder_product, householder_inputs,
         diff=(0, 1), hessian=True),
    case("householder_product_square", torch.linalg.householder_product,
         lambda g: householder_inputs(g, 3, 3), diff=(0, 1)),
    case("householder_product_few", lambda a, t: torch.linalg.householder_product(a, t[:2]),
         householder_inputs, diff=(0, 1)),
    case("ormqr", torch.ormqr, lambda g: (*householder_inputs(g), normal(g, 4, 2)),
         diff=(0, 1, 2), hessian=True),
    case("ormqr_transpose", lambda a, t, c: torch.ormqr(a, t, c, transpose=True),
         lambda g: (*householder_inputs(g), normal(g, 4, 2)), diff=(0, 1, 2)),
    case("ormqr_right", lambda a, t, c: a.ormqr(t, c, left=False),
         lambda g: (*householder_inputs(g), normal(g, 2, 4)), diff=(0, 1, 2)),
    case("ormqr_right_transpose", lambda a, t, c: torch.ormqr(a, t, c, False, True),
         lambda g: (*householder_inputs(g), normal(g, 2, 4)), diff=(0, 1, 2)),
    # --- the back door: aten ops, and composites torch lowers to them ----------------------------
    case("aten_inv_ex", lambda a: aten.linalg_inv_ex(a)[0], A3),
    case("aten_svd", lambda a: aten._linalg_svd(a, True)[0], lambda g: (normal(g, 3, 4),)),
    case("aten_solve_ex", lambda a, b: aten._linalg_solve_ex(a, b)[0],
         lambda g: (well(g, 3, 3), normal(g, 3)), diff=(0, 1)),
    case("matrix_norm_nuc", lambda a: torch.linalg.matrix_norm(a, "nuc"),
         lambda g: (normal(g, 4, 3),)),
    case("matrix_norm_2", lambda a: torch.linalg.matrix_norm(a, 2), lambda g: (normal(g, 4, 3),)),
    case("cond", torch.linalg.cond, A3),
    case("tensorinv", lambda a: torch.linalg.tensorinv(a.reshape(3, 3, 1), ind=1),
         lambda g: (well(g, 3, 3),)),
    case("matrix_power_neg", lambda a: torch.linalg.matrix_power(a, -2), A3),
]


# Where torch.func cannot be the oracle, (case, transform) -> why; these are checked against
# PlainTorch (below) instead.
_BROADCAST = ("torch.func's batching of linalg.solve fails when the operands' batch dims "
              "differ (a size mismatch)")
TORCH_FUNC_OFF = {
    **{("solve_broadcast", t): _BROADCAST
       for t in ("vmap_rest", "jacrev", "jacfwd_jacrev", "vmap_jacrev")},
    **{("solve_batched_a", t): _BROADCAST
       for t in ("vmap_0", "vmap_first", "vmap_rest", "vmap_dim1", "vmap_grad", "vmap_jacrev")},
    **{("lstsq_vector", t): "torch.func's batching of linalg.lstsq misreads a vector B"
       for t in ("vmap_0", "vmap_rest", "vmap_dim1", "vmap_grad", "vmap_jacrev")},
    **{(name, t): "torch 2.13's jvp of triangular_solve with respect to A is not its "
                  "derivative (it disagrees with its own vjp and with finite differences)"
       for name in ("triangular_solve", "triangular_solve_transpose")
       for t in ("jvp", "jacfwd", "jvp_grad")},
    **{("cholesky_old", t): "torch has no forward-mode formula for the old torch.cholesky"
       for t in ("jvp", "jacfwd", "jacfwd_jacrev", "jvp_grad")},
    **{(name, t): "torch has no forward-mode formula for ormqr"
       for name in ("ormqr", "ormqr_transpose", "ormqr_right", "ormqr_right_transpose")
       for t in ("jvp", "jacfwd", "jacfwd_jacrev", "jvp_grad", "hessian")},
}
# Cases whose derivative follows torch's convention for a structured input (a symmetric
# gradient for cholesky and eigh, a full one for a triangular factor), which finite
# differences of the unstructured function do not see.
FD_OFF = {"cholesky_direct", "eigh_direct", "cholesky_inverse_upper", "cholesky_solve",
          "cholesky_solve_upper"}


def _select(x, dim, i):
    return x if dim is None else x.select(dim, i)


class PlainTorch:
    """The transforms written with torch.autograd (create_graph=True, so that they nest)
    and Python loops over the batch: the second oracle, for TORCH_FUNC_OFF."""

    @staticmethod
    def vmap(f, in_dims=0):
        def batched(*args):
            dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
            size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
            outs = [f(*[_select(a, d, i) for a, d in zip(args, dims)]) for i in range(size)]
            return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *outs)
        return batched

    @staticmethod
    def _diff(args, nums):
        return [args[n] if args[n].requires_grad else args[n].detach().requires_grad_()
                for n in nums]

    @staticmethod
    def _with(args, nums, diff):
        full = list(args)
        for n, d in zip(nums, diff):
            full[n] = d
        return full

    @classmethod
    def grad(cls, f, argnums=0):
        nums = argnums if isinstance(argnums, tuple) else (argnums,)

        def gradient(*args):
            with torch.enable_grad():
                diff = cls._diff(args, nums)
                out = f(*cls._with(args, nums, diff))
                grads = torch.autograd.grad(out, diff, create_graph=True)
            return grads if isinstance(argnums, tuple) else grads[0]
        return gradient

    @classmethod
    def vjp(cls, f, *primals):
        with torch.enable_grad():
            diff = cls._diff(primals, range(len(primals)))
            out = f(*diff)
        return out, lambda ct: torch.autograd.grad(out, diff, ct, create_graph=True)

    @classmethod
    def jacrev(cls, f, argnums=0):
        nums = argnums if isinstance(argnums, tuple) else (argnums,)

        def jacobian(*args):
            def g(*diff):
                return f(*cls._with(args, nums, diff))
            J = torch.autograd.functional.jacobian(g, tuple(args[n] for n in nums),
                                                   create_graph=True)
            return J if isinstance(argnums, tuple) else J[0]
        return jacobian

    jacfwd = jacrev

    @classmethod
    def jvp(cls, f, primals, tangents):
        J = cls.jacrev(f, tuple(range(len(primals))))(*primals)
        out_dot = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(J, tangents))
        return f(*primals), out_dot

    @classmethod
    def hessian(cls, f, argnums=0):
        return cls.jacrev(cls.jacrev(f, argnums), argnums)


@pytest.mark.parametrize("case, transform", list(transform_params(CASES)))
def test_under_transform(case, transform):
    if (case.name, transform) in TORCH_FUNC_OFF:
        build = TRANSFORMS.get(transform, t_hessian)
        assert_same(build(mf, case), build(PlainTorch, case))
    else:
        check_under_transform(case, transform)


@pytest.mark.parametrize("case", [c for c in CASES if c.name not in FD_OFF],
                         ids=[c.name for c in CASES if c.name not in FD_OFF])
def test_finite_differences(case):
    check_finite_differences(case)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_no_fallback_under_vmap(case):
    """Every op here has a batching rule: vmap makes one kernel call for the batch."""
    batch = case.batch()
    with mf.capture_fallbacks() as used:
        mf.vmap(case.fn)(*batch)
        mf.vmap(mf.grad(lambda *a: case.fn(*a).sum(), argnums=case.diff))(*batch)
    assert not used, f"{case.name}: per-example fallback for {dict(used)}"


# --- non-neural examples -------------------------------------------------------------------------
def _gaussian_log_likelihood(theta, points, y):
    """The log-likelihood of y under a Gaussian process with an RBF kernel of length scale
    exp(theta[0]) and noise exp(theta[1]): it goes through slogdet and solve."""
    distances = (points[:, None, :] - points[None, :, :]).pow(2).sum(-1)
    K = torch.exp(-0.5 * distances / torch.exp(2 * theta[0]))
    K = K + torch.exp(theta[1]) * torch.eye(len(points), dtype=DTYPE)
    logdet = torch.linalg.slogdet(K).logabsdet
    return -0.5 * (y @ torch.linalg.solve(K, y)) - 0.5 * logdet


def test_hessian_through_slogdet():
    g = torch.Generator().manual_seed(0)
    points, y = normal(g, 6, 2), normal(g, 6)
    theta = torch.tensor([0.3, -1.0], dtype=DTYPE)
    f = lambda t: _gaussian_log_likelihood(t, points, y)  # noqa: E731
    expected = tf.hessian(f)(theta)
    torch.testing.assert_close(mf.hessian(f)(theta), expected)
    torch.testing.assert_close(mf.jacfwd(mf.jacrev(f))(theta), expected)


def test_jacobian_of_solve():
    """The Jacobian of x -> A(x)^{-1} b, A a tridiagonal matrix with x on its diagonal."""
    g = torch.Generator().manual_seed(1)
    b, x = normal(g, 5), normal(g, 5).abs() + 3

    def f(x):
        A = torch.diag(x) + torch.diag(torch.ones(4, dtype=DTYPE), 1) + \
            torch.diag(torch.ones(4, dtype=DTYPE), -1)
        return torch.linalg.solve(A, b)
    expected = tf.jacrev(f)(x)
    torch.testing.assert_close(mf.jacrev(f)(x), expected)
    torch.testing.assert_close(mf.jacfwd(f)(x), expected)
    # the closed form: d x_i / d diag_j = -A^{-1}_ij x_j
    A = torch.diag(x) + torch.diag(torch.ones(4, dtype=DTYPE), 1) + \
        torch.diag(torch.ones(4, dtype=DTYPE), -1)
    torch.testing.assert_close(expected, -torch.linalg.inv(A) * torch.linalg.solve(A, b))


# --- where torch has something to say ------------------------------------------------------------
def test_singular_matrices_raise_as_in_torch():
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=DTYPE)
    for transform in (lambda f: mf.grad(lambda a: f(a).sum()), mf.vmap):
        x = singular if transform is not mf.vmap else singular.expand(2, 2, 2)
        with pytest.raises(RuntimeError, match="singular"):
            transform(torch.linalg.inv)(x)
        with pytest.raises(RuntimeError, match="singular"):
            transform(lambda a: torch.linalg.solve(a, a[..., 0]))(x)
    with pytest.raises(RuntimeError, match="positive-definite"):
        mf.grad(lambda a: torch.linalg.cholesky(a).sum())(-torch.eye(2, dtype=DTYPE))


@pytest.mark.parametrize("name, f", [
    ("qr", lambda a: torch.linalg.qr(a)[0]), ("svd", lambda a: torch.linalg.svd(a)[1]),
    ("pinv", torch.linalg.pinv), ("lu", lambda a: torch.linalg.lu(a)[1]),
    ("cholesky", torch.linalg.cholesky), ("det", torch.linalg.det),
])
def test_a_vector_per_example_is_refused_as_torch_func_does(name, f):
    """vmap over the rows of a matrix gives each example a vector: torch.func raises, and so
    does this (before, some kernels ran on the whole (batch, n) payload as one matrix)."""
    rows = torch.randn(3, 4, dtype=DTYPE)
    with pytest.raises(RuntimeError):
        tf.vmap(f)(rows)
    with pytest.raises(TransformError, match="dimensions"):
        mf.vmap(f)(rows)


def test_det_at_a_singular_matrix_is_torchs():
    """The gradient of det at a singular matrix is the adjugate (NOTE [The derivative of
    det]); its Hessian at an orthogonal matrix is torch.func's nan."""
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=DTYPE)
    torch.testing.assert_close(mf.grad(torch.linalg.det)(singular),
                               tf.grad(torch.linalg.det)(singular))
    torch.testing.assert_close(mf.grad(torch.linalg.det)(singular),
                               torch.tensor([[4.0, -2.0], [-2.0, 1.0]], dtype=DTYPE))
    ones = torch.ones(2, 2, dtype=DTYPE)
    torch.testing.assert_close(mf.jvp(torch.linalg.det, (singular,), (ones,)),
                               tf.jvp(torch.linalg.det, (singular,), (ones,)))
    eye = torch.eye(2, dtype=DTYPE)
    torch.testing.assert_close(mf.hessian(torch.linalg.det)(eye),
                               tf.hessian(torch.linalg.det)(eye), equal_nan=True)


def test_repeated_eigenvalues_give_torchs_inf_and_nan():
    eye = torch.eye(3, dtype=DTYPE)
    ct = torch.randn(3, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    f = lambda a: torch.linalg.eigh(a).eigenvectors  # noqa: E731
    ours = mf.vjp(f, eye)[1](ct)[0]
    theirs = tf.vjp(f, eye)[1](ct)[0]
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert not torch.isfinite(ours).all()


def test_complex_inputs():
    # every derivative of this family is complex-ready (tests/test_complex.py and
    # test_complex_tail.py); the factorizations torch does not differentiate are refused on
    # complex inputs as on real ones (NOTE [Complex numbers] in dispatch.py)
    from minifunctorch.core import linalg
    from minifunctorch.core.dispatch import complex_derivatives
    from minifunctorch.core.primitives import Primitive
    prims = {v for v in vars(linalg).values() if isinstance(v, Primitive)}
    unmarked = {p.name for p in prims if p.differentiable and p not in complex_derivatives}
    assert unmarked == {"linalg_ldl_factor", "linalg_ldl_solve", "geqrf_a", "geqrf_tau"}
    a = torch.randn(3, 3, dtype=torch.complex128) + 3 * torch.eye(3)
    with pytest.raises(TransformError, match="complex"):
        mf.grad(lambda x: torch.linalg.ldl_factor(x).LD.abs().sum())(a)
    # vmap needs no derivative: complex matrices are batched as real ones
    batch = a.expand(2, 3, 3)
    torch.testing.assert_close(mf.vmap(torch.linalg.inv)(batch), torch.linalg.inv(batch))


def test_qr_modes_torch_does_not_differentiate():
    a = torch.randn(4, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    with pytest.raises(TransformError, match="mode='r'"):
        mf.grad(lambda x: torch.linalg.qr(x, mode="r").R.sum())(a)
    with pytest.raises(TransformError, match="complete"):
        mf.jvp(lambda x: torch.linalg.qr(x, mode="complete").Q, (a,), (a,))
    # the R of mode='r' is computed, only not differentiated
    torch.testing.assert_close(mf.vmap(lambda x: torch.linalg.qr(x, mode="r").R)(a[None]),
                               torch.linalg.qr(a, mode="r").R[None])


def test_factorizations_without_derivatives():
    """LDL and geqrf: torch has no derivative; vmap batches them, grad refuses them."""
    g = torch.Generator().manual_seed(4)
    a = spd(normal(g, 2, 3, 3))
    b = normal(g, 2, 3, 2)

    def ldl(a, b):
        LD, pivots = torch.linalg.ldl_factor(a)
        return torch.linalg.ldl_solve(LD, pivots, b)
    with mf.capture_fallbacks() as used:
        torch.testing.assert_close(mf.vmap(ldl)(a, b), tf.vmap(ldl)(a, b))
        torch.testing.assert_close(mf.vmap(lambda x: torch.geqrf(x)[1])(a),
                                   tf.vmap(lambda x: torch.geqrf(x)[1])(a))
    assert not used
    with pytest.raises(TransformError, match="not implemented"):
        mf.grad(lambda x: ldl(x, b[0]).sum())(a[0])
    with pytest.raises(TransformError, match="not implemented"):
        mf.jvp(lambda x: torch.geqrf(x)[0], (a[0],), (a[0],))


def test_front_door_return_types():
    g = torch.Generator().manual_seed(5)
    a, b = well(g, 3, 3), normal(g, 3, 2)
    calls = [
        (lambda x: torch.linalg.svd(x), torch.return_types.linalg_svd),
        (lambda x: torch.svd(x), torch.return_types.svd),
        (lambda x: torch.linalg.qr(x), torch.return_types.linalg_qr),
        (lambda x: x.qr(), torch.return_types.qr),
        (lambda x: torch.linalg.eigh(spd(x)), torch.return_types.linalg_eigh),
        (lambda x: torch.linalg.slogdet(x), torch.return_types.linalg_slogdet),
        (lambda x: x.slogdet(), torch.return_types.slogdet),
        (lambda x: torch.linalg.lu_factor(x), torch.return_types.linalg_lu_factor),
        (lambda x: torch.linalg.lu(x), torch.return_types.linalg_lu),
        (lambda x: torch.linalg.inv_ex(x), torch.return_types.linalg_inv_ex),
        (lambda x: torch.linalg.cholesky_ex(spd(x)), torch.return_types.linalg_cholesky_ex),
        (lambda x: torch.linalg.lstsq(x, b), torch.return_types.linalg_lstsq),
        (lambda x: torch.linalg.solve_ex(x, b), torch.return_types.linalg_solve_ex),
        (lambda x: torch.triangular_solve(b, x), torch.return_types.triangular_solve),
    ]
    for call, kind in calls:
        seen = []

        def f(x):
            out = call(x)
            seen.append(type(out))
            return out[0]
        torch.testing.assert_close(mf.vmap(f)(a[None]), tf.vmap(lambda x: call(x)[0])(a[None]))
        assert seen == [kind], (kind, seen)


def test_one_kernel_call_per_op(monkeypatch):
    """NOTE [One kernel call, several primitives]: svd's three outputs, and its backward,
    come from one call of the kernel."""
    from minifunctorch.core import linalg
    calls = []
    kernel = aten._linalg_svd

    class Counting:
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)
    monkeypatch.setattr(linalg, "aten", type("aten", (), {"_linalg_svd": Counting()}))
    a = torch.randn(4, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    torch.linalg.svd(a)
    assert len(calls) == 0  # plain tensors: torch's own kernel, not the engine
    mf.grad(lambda x: sum(o.sum() for o in torch.linalg.svd(x, full_matrices=False)))(a)
    assert len(calls) == 1
    mf.jvp(lambda x: torch.linalg.svd(x, full_matrices=False), (a,), (a,))
    assert len(calls) == 2


# --- programs: shape rules by meta evaluation, and traced linear algebra ----------------------------
def _primitive_samples():
    from minifunctorch.core import linalg as L
    g = torch.Generator().manual_seed(7)
    A = well(g, 2, 3, 3)
    S = spd(A)
    B, T, T_rhs = normal(g, 2, 3, 2), normal(g, 2, 4, 3), normal(g, 2, 4, 2)
    LU, pivots = torch.linalg.lu_factor(A)
    a, tau = torch.geqrf(T)
    LD, ldl_pivots = torch.linalg.ldl_factor(S)
    chol = torch.linalg.cholesky(S)
    left = {"left": True}
    lstsq = lambda driver: ((T, T_rhs), {"rcond": None, "driver": driver})  # noqa: E731
    return {
        L.inv_p: ((A,), {}), L.inv_info_p: ((A,), {}),
        **{p: ((A, B), left) for p in (L.solve_p, L.solve_lu_p, L.solve_pivots_p,
                                       L.solve_info_p)},
        L.solve_triangular_p: ((A, B), {"upper": True, "left": True, "unitriangular": False}),
        L.triangular_solve_p: ((B, A), {"upper": False, "transpose": True,
                                        "unitriangular": False}),
        **{p: ((T,), {"pivot": True}) for p in (L.lu_p, L.lu_pivots_p, L.lu_info_p)},
        L.lu_permutation_p: ((LU, pivots), {}),
        L.lu_solve_p: ((LU, pivots, B), {"left": True, "adjoint": True}),
        **{p: ((A,), {}) for p in (L.det_p, L.det_lu_p, L.det_pivots_p, L.slogdet_sign_p,
                                   L.logabsdet_p, L.slogdet_lu_p, L.slogdet_pivots_p,
                                   L.matrix_exp_p, L.geqrf_a_p, L.geqrf_tau_p)},
        L.cholesky_p: ((S,), {"upper": False}), L.cholesky_info_p: ((S,), {"upper": False}),
        L.cholesky_old_p: ((S,), {"upper": True}),
        L.cholesky_inverse_p: ((chol,), {"upper": False}),
        L.cholesky_solve_p: ((B, chol), {"upper": False}),
        **{p: ((S,), {"UPLO": "L"}) for p in (L.eigvalsh_p, L.eigvecsh_p)},
        **{p: ((S,), {}) for p in (L.eigvals_p, L.eigvecs_p)},
        **{p: ((T,), {"full_matrices": True, "driver": None})
           for p in (L.svd_u_p, L.svd_s_p, L.svd_vh_p)},
        L.qr_q_p: ((T,), {"mode": "reduced"}), L.qr_r_p: ((T,), {"mode": "complete"}),
        L.pinv_p: ((T, None, torch.tensor(1e-5, dtype=DTYPE)), {"hermitian": False}),
        L.lstsq_solution_p: lstsq("gelsy"), L.lstsq_residuals_p: lstsq("gelsd"),
        L.lstsq_rank_p: lstsq("gelsy"), L.lstsq_values_p: lstsq("gelss"),
        L.householder_p: ((a, tau), {}),
        L.ormqr_p: ((a, tau, T_rhs), {"left": True, "transpose": False}),
        **{p: ((S,), {"hermitian": False}) for p in (L.ldl_p, L.ldl_pivots_p, L.ldl_info_p)},
        L.ldl_solve_p: ((LD, ldl_pivots, B), {"hermitian": False}),
    }


def test_every_primitive_has_a_shape_rule():
    """Shape rules run the impls on meta tensors; lstsq and geqrf, which torch has no meta
    kernel for, work theirs out."""
    from minifunctorch.core import linalg as L
    samples = _primitive_samples()
    mine = {p for name, p in vars(L).items() if name.endswith("_p") and isinstance(p, mf.Primitive)}
    assert mine == set(samples), sorted(p.name for p in mine ^ set(samples))
    for prim, (args, params) in samples.items():
        out = prim.impl(*args, **params)
        assert prim.shape_rule(*args, **params) == (out.shape, out.dtype), prim.name


def test_traced_programs():
    g = torch.Generator().manual_seed(8)
    a, b = well(g, 3, 3), normal(g, 3)

    def f(a, b):
        return torch.linalg.solve(a, b) + torch.linalg.slogdet(a).logabsdet * b

    for fn in (f, mf.grad(lambda a, b: f(a, b).sum())):
        program = mf.trace(fn)(a, b)
        torch.testing.assert_close(program(a, b), fn(a, b))
    # a traced check has nothing to check: no error for a singular matrix at trace time
    program = mf.trace(torch.linalg.inv)(torch.empty(3, 3, dtype=DTYPE, device="meta"))
    assert "linalg_inv" in str(program)
