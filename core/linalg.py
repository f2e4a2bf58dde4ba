"""Linear algebra: inverse, determinants, solves, factorizations (LU, Cholesky, QR, LDL),
decompositions (eigh, eig, svd), pseudo-inverse, least squares and the matrix exponential.

NOTE [Factorizations as primitives]
torch's linear-algebra kernels (LAPACK underneath) are exact and batched: each accepts any
number of leading batch dims. They stay primitives here, and the rules around them follow
PyTorch's own derivative formulas (derivatives.yaml and FunctionsManual.cpp), re-derived and
written with ``ops`` and this module's ops, so that every backward and every tangent is
itself differentiable (a Hessian through slogdet is a vjp rule differentiated once more).
- Batching: every kernel takes leading batch dims, so one rule serves them all
  (``batch_matrices``): the batch dim goes to the front, the operands' batch dims are
  broadcast together, and one kernel call does the whole batch (functorch's linear-algebra
  batch rules do the same).
- Complex inputs: inv, solve, the triangular solves, det, slogdet, cholesky (and its
  inverse and solve), eigh, eig, svd, qr, lu_factor, lu_solve, pinv, lstsq, matrix_exp,
  householder_product and ormqr have complex derivatives (NOTE [Linear algebra on complex numbers]); the other rules are
  written for real matrices, and a derivative level refuses their primitives on complex
  inputs (NOTE [Complex numbers] in dispatch.py); vmap accepts complex inputs everywhere.
- Where a derivative does not exist (repeated eigenvalues or singular values, a singular
  matrix) the formulas divide by zero exactly where PyTorch's do, so the result has the
  same nan/inf, and the derivative of det at a singular matrix is the adjugate, as in torch.
- A few formulas of torch disagree with the function they differentiate, on purpose: the
  Cholesky factor and eigh read one triangle of their input, but their derivatives are
  those of a symmetric input (a symmetric gradient; a tangent used as given). These are
  kept, so that results equal torch.func's. One is a bug in torch 2.13, and is not kept:
  the jvp of the old ``triangular_solve`` with respect to its matrix; here it is the
  derivative of the function (it agrees with torch's vjp and with finite differences).
  torch has no jvp for ``ormqr`` and for the old ``cholesky``; theirs here agree with the
  vjps (the Jacobian torch.func's jacrev gives).

NOTE [One kernel call, several primitives]
A primitive has one output; a factorization has several (svd: U, S, Vh; eigh: L, Q; qr: Q,
R; lu_factor: LU, pivots, info). So each output is a primitive of its own, whose impl calls
the whole kernel and keeps one output; the integer outputs (pivots, infos, ranks) are
non-differentiable primitives. Asked for all of them, the kernel would run once per
output, and every rule that needs the others (svd's backward needs U, S and Vh) would run
it again. Instead, within one op call (``_shared.scope()``, opened by the ops and by the
rules that bind several outputs) the bottom-level kernel calls are shared: the second
primitive of ``_linalg_svd`` on the same tensor, unchanged since (its version counter), with
the same parameters, takes the outputs the first one computed. The scope holds its inputs
alive while it lasts and forgets everything when the op returns, so no user code (an
in-place update between two calls) ever runs while an entry lives. It changes the speed,
never a value: the cost of one output per primitive is then one kernel call per op call,
as in torch, plus one scan of a short list per primitive.
"""
import contextlib

import torch

from . import aten_api, ops, structural, torch_api
from . import primitives as P
from .autograd import defer_check, sum_to_size, vjp_rules, wants_cotangent
from .batching import BatchedValue, batch_size, batching_rules, move_bdim
from .dispatch import complex_ready
from .errors import (FunctionOutputError, MissingRuleError, ShapeMismatchError,
                     TransformUsageError, UnsupportedOperationError)
from .forward import add_tangents, broadcast_tangent, jvp_rules
from .values import Value, bind

aten = torch.ops.aten


# --- small helpers on values ---------------------------------------------------------------------
def _is_tensor(x):
    return isinstance(x, (torch.Tensor, Value))


def _shape(x):
    return ops.shape_of(x)


def _rank(x):
    return len(ops.shape_of(x))


def _mT(x):
    return ops.transpose(x, -2, -1)


def _mH(x):
    """The conjugate transpose (``x.mH``); the transpose of a real matrix."""
    return _mT(ops.conj(x) if x.dtype.is_complex else x)


def _conj(x):
    return ops.conj(x) if x.dtype.is_complex else x


def _re(x):
    return ops.real(x) if x.dtype.is_complex else x


def _mm(x, y):
    return ops.matmul(x, y)


def _imag_i(x):
    """``i Im(x)``, a complex number."""
    return ops.complex(ops.zeros_like(ops.imag(x)), ops.imag(x))


def _eye(rows, like, cols=None):
    """The identity (``rows`` x ``cols``) as a constant of ``like``'s dtype and device."""
    return torch.eye(rows, rows if cols is None else cols, dtype=like.dtype, device=like.device)


def _zeros(shape, like):
    return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)


def _triangle(x, k, lower):
    rows, cols = _shape(x)[-2:]
    mask = torch.ones(rows, cols, dtype=torch.bool, device=x.device)
    mask = mask.tril(k) if lower else mask.triu(k)
    if bool(mask.all()):
        return x
    return ops.where(mask, x, 0.0)


def _tril(x, k=0):
    return _triangle(x, k, lower=True)


def _triu(x, k=0):
    return _triangle(x, k, lower=False)


def _diagonal(x):
    return ops.diagonal(x, 0, -2, -1)


def _diag_embed(v):
    return ops.diag_embed(v)


def _trace(x):
    return ops.sum(_diagonal(x), -1)


def _cols(x, start, stop):
    return ops.getitem(x, (Ellipsis, slice(start, stop)))


def _rows(x, start, stop):
    return ops.getitem(x, (Ellipsis, slice(start, stop), slice(None)))


def _pad_cols(x, cols):
    """x with zero columns appended, up to ``cols`` columns."""
    shape = _shape(x)
    if shape[-1] == cols:
        return x
    return ops.cat([x, _zeros(shape[:-1] + (cols - shape[-1],), x)], -1)


def _pad_rows(x, rows):
    shape = _shape(x)
    if shape[-2] == rows:
        return x
    return ops.cat([x, _zeros(shape[:-2] + (rows - shape[-2], shape[-1]), x)], -2)


def _skew(x):
    return ops.sub(x, _mT(x))


def _sym(x):
    return ops.add(x, _mT(x))


def _herm(x):
    """``x + x^H`` (``_sym`` on real matrices)."""
    return ops.add(x, _mH(x))


def _scale(x, factor):
    """``factor[..., None, None] * x``: a matrix scaled by one number per matrix."""
    return ops.mul(ops.unsqueeze(ops.unsqueeze(factor, -1), -1), x)


def _sum_to(x, like):
    return sum_to_size(x, _shape(like))


# --- NOTE [One kernel call, several primitives] -------------------------------------------------
class _SharedKernels:
    """Kernel calls at the bottom level, shared within a scope (the NOTE above)."""

    def __init__(self):
        self.depth = 0
        self.entries = []

    @contextlib.contextmanager
    def scope(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.entries.clear()

    @staticmethod
    def _key(args, params, kernel):
        key = [kernel, tuple(sorted(params.items())), torch.is_grad_enabled()]
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type == "meta" or a.is_inference():
                    return None
                key.append((a.data_ptr(), a.storage_offset(), tuple(a.shape), a.stride(),
                            a.dtype, a.device, a._version, a.requires_grad))
            else:
                key.append(("value", a))
        return tuple(key)

    def call(self, kernel, args, params):
        if self.depth == 0:
            return kernel(*args, **params)
        key = self._key(args, params, kernel)
        if key is None:
            return kernel(*args, **params)
        for entry_key, _, outputs, versions in self.entries:
            if entry_key == key and all(o._version == v for o, v in zip(outputs, versions)):
                return outputs
        outputs = kernel(*args, **params)
        # the inputs are held alive, so that no other tensor takes their memory meanwhile
        self.entries.append((key, args, outputs, tuple(o._version for o in outputs)))
        return outputs


_shared = _SharedKernels()


def _bind_all(prims, *args, **params):
    """The outputs of one kernel, one primitive each, computed by one kernel call."""
    with _shared.scope():
        return [bind(prim, *args, **params) for prim in prims]


# --- batching: one rule for every kernel --------------------------------------------------------
def _to_common_batch(name, values, bdims, cores, broadcast):
    """Operands with the vmap batch dim in front and their own batch dims broadcast together
    (``cores``: how many trailing dims of each operand one matrix, vector or number takes;
    None for an argument that is not a tensor)."""
    size = batch_size(values, bdims)
    batch_shapes = []
    for value, bdim, core in zip(values, bdims, cores):
        if core is None or not _is_tensor(value):
            continue
        shape = list(_shape(value))
        if bdim is not None:
            del shape[bdim]
        if len(shape) < core:  # the payload has the rank, one example does not
            raise ShapeMismatchError(
                f"vmap({name}): {name}: The input tensor must have at least {core} dimensions "
                f"(for each example), got an example of shape {tuple(shape)}. vmap hides the "
                "batch dim, so each example must be a matrix by itself. Fix: vmap over an "
                "input with one more dim, or reshape each example.")
        batch_shapes.append(tuple(shape[:len(shape) - core]))
    if not broadcast and len(set(batch_shapes)) > 1:
        raise ShapeMismatchError(
            f"vmap({name}): expected its tensors to share their batch dims, got batch shapes "
            f"{batch_shapes}. Fix: give every argument the same leading dims (this op does "
            "not broadcast them).")
    common = ops.broadcast_shapes(*batch_shapes, op=f"vmap({name})")
    moved = []
    for value, bdim, core in zip(values, bdims, cores):
        if core is None or not _is_tensor(value):
            moved.append(value)
            continue
        value = ops.unsqueeze(value, 0) if bdim is None else move_bdim(value, bdim, 0)
        shape = _shape(value)
        rank = len(shape) - 1 - core
        if rank < len(common):
            value = ops.reshape(value, shape[0], *([1] * (len(common) - rank)), *shape[1:])
        core_shape = shape[len(shape) - core:] if core else ()
        moved.append(ops.expand(value, size, *common, *core_shape))
    return moved


def batch_matrices(prim, cores, broadcast=True):
    """The batching rule of a kernel that takes leading batch dims: one call for the batch."""
    def rule(values, bdims, **params):
        return bind(prim, *_to_common_batch(prim.name, values, bdims, cores, broadcast),
                    **params), 0
    return rule


def _output_of(name, kernel, index, cores, *, differentiable=True, broadcast=True):
    """A primitive for output ``index`` of ``kernel`` (NOTE [One kernel call, several
    primitives]), with its batching rule."""
    def impl(*args, **params):
        return _shared.call(kernel, args, params)[index]
    impl.__name__ = name
    prim = P.primitive(name, impl, differentiable=differentiable)
    batching_rules[prim] = batch_matrices(prim, cores, broadcast)
    return prim


def _single(name, impl, cores, *, differentiable=True, broadcast=True):
    prim = P.primitive(name, impl, differentiable=differentiable)
    batching_rules[prim] = batch_matrices(prim, cores, broadcast)
    return prim


def _refused_derivative(prim, what):
    """Rules of a primitive that torch does not differentiate either: the vjp raises when the
    backward pass reaches it, the jvp when it runs (where torch raises)."""
    def error():
        return MissingRuleError(
            f"{what}: its derivative is not implemented (torch has none either: "
            "derivatives.yaml marks it not implemented). Fix: keep it out of the "
            "differentiated function, or differentiate a different factorization.")

    def vjp(*args, **params):
        out = bind(prim, *args, **params)

        def backward(ct):
            raise error()
        return out, backward

    def jvp(primals, tangents, **params):
        raise error()

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp


# --- errors: _linalg_check_errors ----------------------------------------------------------------
@aten_api.register(aten._linalg_check_errors.default)
def check_info(info, api_name, *, is_matrix):
    """torch's check of a factorization's ``info`` (a singular matrix, a matrix that is not
    positive definite), which raises torch's own error. It reads the concrete values at the
    bottom of the value; under vmap the check covers the whole batch (as functorch's batch
    rule does, with ``is_matrix=False``); a traced value has none, and is not checked."""
    batched = False
    while isinstance(info, Value):
        batched = batched or isinstance(info, BatchedValue)
        info = info.payload
    if info.device.type == "meta":
        return None
    aten._linalg_check_errors(info, api_name, is_matrix=is_matrix and not batched)
    return None


# --- inverse -------------------------------------------------------------------------------------
def _inv_kernel(A):
    return aten.linalg_inv_ex(A)


inv_p = _output_of("linalg_inv", _inv_kernel, 0, (2,))
inv_info_p = _output_of("linalg_inv_info", _inv_kernel, 1, (2,), differentiable=False)


def inv_vjp(A):
    out = bind(inv_p, A)

    def backward(ct):
        out_H = _mH(out)
        return (ops.neg(_mm(out_H, _mm(ct, out_H))),)
    return out, backward
vjp_rules[inv_p] = inv_vjp


def inv_jvp(primals, tangents):
    (A,), (A_dot,) = primals, tangents
    out = bind(inv_p, A)
    return out, ops.neg(_mm(_mm(out, A_dot), out))
jvp_rules[inv_p] = inv_jvp


@aten_api.register(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    inverse, info = _bind_all((inv_p, inv_info_p), A)
    if check_errors:
        check_info(info, "torch.linalg.inv_ex", is_matrix=_rank(A) == 2)
    return inverse, info


@torch_api.register(torch.linalg.inv_ex)
def _inv_ex_front(A, *, check_errors=False, out=None):
    return torch.return_types.linalg_inv_ex(linalg_inv_ex(A, check_errors=check_errors))


@torch_api.register(torch.linalg.inv, torch.inverse, torch.Tensor.inverse)
def inv(A, *, out=None):
    inverse, info = linalg_inv_ex(A)
    check_info(info, "linalg.inv", is_matrix=_rank(A) == 2)
    return inverse


# --- solve ---------------------------------------------------------------------------------------
def _solve_kernel(A, B, *, left):
    return aten._linalg_solve_ex(A, B, left=left)


solve_p = _output_of("linalg_solve", _solve_kernel, 0, (2, 2))
solve_lu_p = _output_of("linalg_solve_lu", _solve_kernel, 1, (2, 2), differentiable=False)
solve_pivots_p = _output_of("linalg_solve_pivots", _solve_kernel, 2, (2, 2),
                            differentiable=False)
solve_info_p = _output_of("linalg_solve_info", _solve_kernel, 3, (2, 2), differentiable=False)


def _solve(A, B, left=True):
    """A^{-1} B (left) or B A^{-1}, B a matrix (or a batch of them)."""
    return bind(solve_p, A, B, left=left)


def solve_vjp(A, B, *, left):
    """gB = A^{-T} gX (X A = B: gX A^{-T}), gA = -gB X^T (X^T gB): torch's formula for the
    double-backward case, which solves again with A^T (linalg_solve_backward)."""
    X = bind(solve_p, A, B, left=left)

    def backward(ct):
        gB = _solve(_mH(A), ct, left)
        gA = None
        if wants_cotangent(0, A):
            gA = ops.neg(_mm(gB, _mH(X)) if left else _mm(_mH(X), gB))
            gA = _sum_to(gA, A)
        return gA, (_sum_to(gB, B) if wants_cotangent(1, B) else None)
    return X, backward
vjp_rules[solve_p] = solve_vjp


def solve_jvp(primals, tangents, *, left):
    """dX = A^{-1} (dB - dA X) (left), (dB - X dA) A^{-1} (right)."""
    (A, B), (A_dot, B_dot) = primals, tangents
    X = bind(solve_p, A, B, left=left)
    rhs = B_dot
    if A_dot is not None:
        product = _mm(A_dot, X) if left else _mm(X, A_dot)
        rhs = ops.neg(product) if rhs is None else ops.sub(rhs, product)
    return X, broadcast_tangent(_solve(A, rhs, left), _shape(X))
jvp_rules[solve_p] = solve_jvp


def _vector_rhs(A, B):
    """torch's rule: B is a vector (or a batch of them) when it is 1-D, or when it has the
    shape of A without its last dim."""
    return _rank(B) == 1 or (_rank(B) == _rank(A) - 1 and _shape(B) == _shape(A)[:-1])


@aten_api.register(aten._linalg_solve_ex.default)
def linalg_solve_ex_full(A, B, *, left=True, check_errors=False):
    vector = _vector_rhs(A, B)
    if vector and not left:
        raise TransformUsageError(
            "linalg.solve(A, B, left=False): a vector B is not supported with left=False. "
            "Fix: B / A.squeeze(-1) is the same solution.")
    B_ = ops.unsqueeze(B, -1) if vector else B
    X, LU, pivots, info = _bind_all((solve_p, solve_lu_p, solve_pivots_p, solve_info_p),
                                    A, B_, left=left)
    if check_errors:
        check_info(info, "torch.linalg.solve_ex", is_matrix=_rank(A) == 2)
    return (ops.squeeze(X, -1) if vector else X), LU, pivots, info


@torch_api.register(torch.linalg.solve_ex)
def solve_ex(A, B, *, left=True, check_errors=False, out=None):
    X, _, _, info = linalg_solve_ex_full(A, B, left=left, check_errors=check_errors)
    return torch.return_types.linalg_solve_ex((X, info))


@torch_api.register(torch.linalg.solve)
def solve(A, B, *, left=True, out=None):
    X, _, _, info = linalg_solve_ex_full(A, B, left=left)
    check_info(info, "linalg.solve", is_matrix=_rank(A) == 2)
    return X


# --- triangular solves ---------------------------------------------------------------------------
def _solve_triangular_impl(A, B, *, upper, left, unitriangular):
    return aten.linalg_solve_triangular(A, B, upper=upper, left=left, unitriangular=unitriangular)


solve_triangular_p = _single("linalg_solve_triangular", _solve_triangular_impl, (2, 2))


def _solve_triangular(A, B, upper, left=True, unitriangular=False):
    return bind(solve_triangular_p, A, B, upper=upper, left=left, unitriangular=unitriangular)


def _project_triangle(x, upper, unitriangular):
    """The part of a matrix that a triangular kernel reads (without the unit diagonal)."""
    return _triu(x, int(unitriangular)) if upper else _tril(x, -int(unitriangular))


def solve_triangular_vjp(A, B, *, upper, left, unitriangular):
    """gB = A^{-T} gX; gA = -gB X^T projected onto A's triangle (linalg_solve_triangular_
    backward: the triangular matrices are a vector space, so the gradient is the
    projection of the general solver's)."""
    X = bind(solve_triangular_p, A, B, upper=upper, left=left, unitriangular=unitriangular)

    def backward(ct):
        gB = _solve_triangular(_mH(A), ct, not upper, left, unitriangular)
        gA = None
        if wants_cotangent(0, A):
            gA = ops.neg(_mm(gB, _mH(X)) if left else _mm(_mH(X), gB))
            gA = _sum_to(_project_triangle(gA, upper, unitriangular), A)
        return gA, (_sum_to(gB, B) if wants_cotangent(1, B) else None)
    return X, backward
vjp_rules[solve_triangular_p] = solve_triangular_vjp


def solve_triangular_jvp(primals, tangents, *, upper, left, unitriangular):
    """dX = A^{-1} (dB - proj(dA) X) (linalg_solve_triangular_forward_AD)."""
    (A, B), (A_dot, B_dot) = primals, tangents
    X = bind(solve_triangular_p, A, B, upper=upper, left=left, unitriangular=unitriangular)
    rhs = B_dot
    if A_dot is not None:
        projected = _project_triangle(A_dot, upper, unitriangular)
        product = _mm(projected, X) if left else _mm(X, projected)
        rhs = ops.neg(product) if rhs is None else ops.sub(rhs, product)
    out_dot = _solve_triangular(A, rhs, upper, left, unitriangular)
    return X, broadcast_tangent(out_dot, _shape(X))
jvp_rules[solve_triangular_p] = solve_triangular_jvp


@torch_api.register(torch.linalg.solve_triangular)
@aten_api.register(aten.linalg_solve_triangular.default)
def solve_triangular(A, B, *, upper, left=True, unitriangular=False, out=None):
    return _solve_triangular(A, B, upper, left, unitriangular)


def _triangular_solve_impl(B, A, *, upper, transpose, unitriangular):
    return aten.triangular_solve(B, A, upper, transpose, unitriangular)[0]


# the old torch.triangular_solve(B, A): op(A) X = B, op(A) = A or A^T
triangular_solve_p = _single("triangular_solve", _triangular_solve_impl, (2, 2))


def _triangular_solve(B, A, upper, transpose, unitriangular):
    return bind(triangular_solve_p, B, A, upper=upper, transpose=transpose,
                unitriangular=unitriangular)


def triangular_solve_vjp(B, A, *, upper, transpose, unitriangular):
    """triangular_solve_backward: gB = op(A)^{-T} gX, gA = -gB X^T (or -X gB^T when A is
    transposed), projected onto A's triangle."""
    X = _triangular_solve(B, A, upper, transpose, unitriangular)

    def backward(ct):
        # op(A) = A^T, not A^H, when transposed: gB = op(A)^{-H} gX solves with conj(A)
        gB = _triangular_solve(ct, _conj(A), upper, not transpose, unitriangular)
        gA = None
        if wants_cotangent(1, A):
            gA = ops.neg(_mm(_conj(X), _mT(gB)) if transpose else _mm(gB, _mH(X)))
            gA = _sum_to(_project_triangle(gA, upper, unitriangular), A)
        return (_sum_to(gB, B) if wants_cotangent(0, B) else None), gA
    return X, backward
vjp_rules[triangular_solve_p] = triangular_solve_vjp


def triangular_solve_jvp(primals, tangents, *, upper, transpose, unitriangular):
    """dX = op(A)^{-1} (dB - op(proj(dA)) X): the derivative of the function (NOTE
    [Factorizations as primitives]: torch 2.13's formula for dA is off)."""
    (B, A), (B_dot, A_dot) = primals, tangents
    X = _triangular_solve(B, A, upper, transpose, unitriangular)
    rhs = B_dot
    if A_dot is not None:
        projected = _project_triangle(A_dot, upper, unitriangular)
        product = _mm(_mT(projected) if transpose else projected, X)
        rhs = ops.neg(product) if rhs is None else ops.sub(rhs, product)
    out_dot = _triangular_solve(rhs, A, upper, transpose, unitriangular)
    return X, broadcast_tangent(out_dot, _shape(X))
jvp_rules[triangular_solve_p] = triangular_solve_jvp


@aten_api.register(aten.triangular_solve.default)
def triangular_solve_full(B, A, upper=True, transpose=False, unitriangular=False):
    X = _triangular_solve(B, A, upper, transpose, unitriangular)
    return X, ops.clone(A)


@torch_api.register(torch.triangular_solve, torch.Tensor.triangular_solve)
def triangular_solve(B, A, upper=True, transpose=False, unitriangular=False, *, out=None):
    return torch.return_types.triangular_solve(
        triangular_solve_full(B, A, upper, transpose, unitriangular))


# --- LU -----------------------------------------------------------------------------------------
def _lu_factor_kernel(A, *, pivot):
    return aten.linalg_lu_factor_ex(A, pivot=pivot)


lu_p = _output_of("linalg_lu_factor", _lu_factor_kernel, 0, (2,))
lu_pivots_p = _output_of("linalg_lu_pivots", _lu_factor_kernel, 1, (2,), differentiable=False)
lu_info_p = _output_of("linalg_lu_info", _lu_factor_kernel, 2, (2,), differentiable=False)


def _lu_factor(A, pivot=True):
    LU, pivots = _bind_all((lu_p, lu_pivots_p), A, pivot=pivot)
    return LU, pivots


def _permutation_impl(LU, pivots):
    return torch.lu_unpack(LU, pivots, unpack_data=False, unpack_pivots=True)[0]


# the permutation matrix P of A = P L U, read off the pivots (LU gives only its shape)
lu_permutation_p = _single("lu_permutation", _permutation_impl, (2, 1), differentiable=False,
                           broadcast=False)


def _unpack(LU, pivots, unpack_pivots=True):
    """P, L, U of a packed LU factorization: L and U are masks of LU (linear, so their
    derivatives are lu_unpack_backward's), P a non-differentiable primitive."""
    m, n = _shape(LU)[-2:]
    k = min(m, n)
    L = ops.add(_tril(_cols(LU, 0, k), -1), _eye(m, LU, k))
    U = _triu(_rows(LU, 0, k))
    P = bind(lu_permutation_p, LU, pivots) if unpack_pivots else None
    return P, L, U


def _lu_backward(L_grad, U_grad, P, L, U, pivot):
    """linalg_lu_backward, both gradients given: for A = P L U (L unit lower m x k, U upper
    k x n), gA = P L^{-T} [tril(L^T gL, -1) + triu(gU U^T)] U^{-T} when square, with the
    extra block of the wide (m < n) or tall (m > n) case."""
    m, n = _shape(L)[-2], _shape(U)[-1]
    k = min(m, n)
    if m == n:
        gA = ops.add(_tril(_mm(_mH(L), L_grad), -1), _triu(_mm(U_grad, _mH(U))))
        gA = _solve_triangular(_mH(U), gA, upper=False, left=False)
        gA = _solve_triangular(_mH(L), gA, upper=True, left=True, unitriangular=True)
    elif m < n:
        gA = ops.sub(_mm(_mH(L), L_grad), _mm(_triu(U_grad), _mH(U)))
        gA = _solve_triangular(_mH(_cols(U, 0, k)), _tril(gA, -1), upper=False, left=False)
        gA = ops.cat([ops.add(gA, _triu(_cols(U_grad, 0, k))), _cols(U_grad, k, n)], -1)
        gA = _solve_triangular(_mH(L), gA, upper=True, left=True, unitriangular=True)
    else:
        gA = ops.sub(_mm(U_grad, _mH(U)), _mm(_mH(L), _tril(L_grad, -1)))
        gA = _solve_triangular(_mH(_rows(L, 0, k)), _triu(gA), upper=True, left=True,
                               unitriangular=True)
        gA = ops.cat([ops.add(gA, _tril(_rows(L_grad, 0, k), -1)), _rows(L_grad, k, m)], -2)
        gA = _solve_triangular(_mH(U), gA, upper=False, left=False)
    return _mm(P, gA) if pivot else gA


def lu_vjp(A, *, pivot):
    """lu_factor_ex_backward: the gradient of the packed LU is split into its L part (the
    first k columns) and U part (the first k rows), then linalg_lu_backward."""
    LU, pivots = _lu_factor(A, pivot)

    def backward(ct):
        m, n = _shape(LU)[-2:]
        k = min(m, n)
        P, L, U = _unpack(LU, pivots, unpack_pivots=pivot)
        return (_lu_backward(_cols(ct, 0, k), _rows(ct, 0, k), P, L, U, pivot),)
    return LU, backward
vjp_rules[lu_p] = lu_vjp


def lu_jvp(primals, tangents, *, pivot):
    """linalg_lu_jvp: dK = L1^{-1} P^T dA1 U1^{-1}, dL1 = L1 tril(dK, -1), dU1 = triu(dK) U1,
    plus the extra block of a wide or tall matrix; packed back as dL + dU."""
    (A,), (A_dot,) = primals, tangents
    LU, pivots = _lu_factor(A, pivot)
    P, L, U = _unpack(LU, pivots, unpack_pivots=pivot)
    m, n = _shape(LU)[-2:]
    k = min(m, n)
    PdA = _mm(_mT(P), A_dot) if pivot else A_dot
    PdA1 = _cols(_rows(PdA, 0, k), 0, k)
    L1, U1 = _rows(L, 0, k), _cols(U, 0, k)
    dK = _solve_triangular(L1, PdA1, upper=False, left=True, unitriangular=True)
    dK = _solve_triangular(U1, dK, upper=True, left=False)
    dL = _mm(L1, _tril(dK, -1))
    dU = _mm(_triu(dK), U1)
    if m < n:
        dU2 = ops.sub(_solve_triangular(L1, _cols(PdA, k, n), upper=False, left=True,
                                        unitriangular=True),
                      _mm(_tril(dK, -1), _cols(U, k, n)))
        dU = ops.cat([dU, dU2], -1)
    elif m > n:
        dL2 = ops.sub(_solve_triangular(U1, _rows(PdA, k, m), upper=True, left=False),
                      _mm(_rows(L, k, m), _triu(dK)))
        dL = ops.cat([dL, dL2], -2)
    out_dot = ops.add(dL, _pad_rows(dU, m)) if m >= n else ops.add(dU, _pad_cols(dL, n))
    return LU, out_dot
jvp_rules[lu_p] = lu_jvp
complex_ready(lu_p)  # linalg_lu_backward with conjugate transposes; the jvp is holomorphic


@aten_api.register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    LU, pivots, info = _bind_all((lu_p, lu_pivots_p, lu_info_p), A, pivot=pivot)
    if check_errors:
        check_info(info, "torch.linalg.lu_factor_ex", is_matrix=_rank(A) == 2)
    return LU, pivots, info


@torch_api.register(torch.linalg.lu_factor_ex)
def lu_factor_ex(A, *, pivot=True, check_errors=False, out=None):
    return torch.return_types.linalg_lu_factor_ex(
        linalg_lu_factor_ex(A, pivot=pivot, check_errors=check_errors))


@torch_api.register(torch.linalg.lu_factor)
def lu_factor(A, *, pivot=True, out=None):
    LU, pivots, info = linalg_lu_factor_ex(A, pivot=pivot)
    check_info(info, "torch.linalg.lu_factor", is_matrix=_rank(A) == 2)
    return torch.return_types.linalg_lu_factor((LU, pivots))


@aten_api.register(aten.lu_unpack.default)
def lu_unpack_full(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    P, L, U = _unpack(LU_data, LU_pivots, unpack_pivots)
    empty = _zeros((0,), LU_data)
    if not unpack_data:
        L = U = empty
    return (P if unpack_pivots else empty), L, U


@torch_api.register(torch.lu_unpack)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True, *, out=None):
    return torch.return_types.lu_unpack(
        lu_unpack_full(LU_data, LU_pivots, unpack_data, unpack_pivots))


@aten_api.register(aten.linalg_lu.default)
def linalg_lu_full(A, *, pivot=True):
    """P, L, U: the factorization, unpacked (its derivatives are those of lu_factor and of
    the masks, the same as linalg_lu_backward's)."""
    LU, pivots = _lu_factor(A, pivot)
    P, L, U = _unpack(LU, pivots, unpack_pivots=pivot)
    return (P if pivot else _zeros((0,), LU)), L, U


@torch_api.register(torch.linalg.lu)
def lu(A, *, pivot=True, out=None):
    return torch.return_types.linalg_lu(linalg_lu_full(A, pivot=pivot))


def _lu_solve_impl(LU, pivots, B, *, left, adjoint):
    return aten.linalg_lu_solve(LU, pivots, B, left=left, adjoint=adjoint)


lu_solve_p = _single("linalg_lu_solve", _lu_solve_impl, (2, 1, 2))


def _lu_solve(LU, pivots, B, left=True, adjoint=False):
    return bind(lu_solve_p, LU, pivots, B, left=left, adjoint=adjoint)


def _lu_solve_LU(gX, LU, pivots, X, left, adjoint):
    """linalg_lu_solve_LU: the gradient with respect to the packed LU. With op_1, op_2 the
    transposes that left and adjoint imply:
    left != adjoint: gR = U^{-T} (-gX X^T), gLU = tril(L^{-T} gR U^T, -1) + triu(gR);
    left == adjoint: gR = -P^T X gX^T P L^{-T}, gLU = tril(gR, -1) + triu(U^{-T} L^T gR)
    (with X, gX transposed when not left)."""
    P, L, U = _unpack(LU, pivots, unpack_pivots=left == adjoint)
    if left != adjoint:
        product = _mm(gX, _mH(X)) if left else _mm(_mH(gX), X)
        gR = _solve_triangular(_mH(U), ops.neg(product), upper=False)
        gL = _tril(_solve_triangular(_mH(L), _mm(gR, _mH(U)), upper=True, left=True,
                                     unitriangular=True), -1)
        return ops.add(gL, _triu(gR))
    product = _mm(X, _mH(gX)) if left else _mm(_mH(X), gX)
    gR = ops.neg(_mm(_mm(_mT(P), product), P))
    gR = _solve_triangular(_mH(L), gR, upper=True, left=False, unitriangular=True)
    gU = _triu(_solve_triangular(_mH(U), _mm(_mH(L), gR), upper=False, left=False))
    return ops.add(_tril(gR, -1), gU)


def lu_solve_vjp(LU, pivots, B, *, left, adjoint):
    X = _lu_solve(LU, pivots, B, left, adjoint)

    def backward(ct):
        gLU = gB = None
        if wants_cotangent(0, LU):
            gLU = _sum_to(_lu_solve_LU(ct, LU, pivots, X, left, adjoint), LU)
        if wants_cotangent(2, B):
            gB = _sum_to(_lu_solve(LU, pivots, ct, left, not adjoint), B)
        return gLU, None, gB
    return X, backward
vjp_rules[lu_solve_p] = lu_solve_vjp


def lu_solve_jvp(primals, tangents, *, left, adjoint):
    """linalg_lu_solve_jvp: S = lu_solve(dB), plus the part of dLU, written with X."""
    (LU, pivots, B), (LU_dot, _, B_dot) = primals, tangents
    X = _lu_solve(LU, pivots, B, left, adjoint)
    out_dot = None if B_dot is None else _lu_solve(LU, pivots, B_dot, left, adjoint)
    if LU_dot is not None:
        if left != adjoint:
            R = _solve_triangular(LU, _tril(LU_dot, -1), upper=False, left=True,
                                  unitriangular=True)
            U = _triu(LU)
            R = ops.neg(_solve_triangular(U, ops.add(_triu(LU_dot), _mm(R, U)), upper=True))
            dX = _mm(R, X) if left else _mm(X, _mH(R))
        else:
            P, L, U = _unpack(LU, pivots)
            V = _mH(X) if left else X
            R = ops.add(_solve_triangular(U, _mm(L, _triu(LU_dot)), upper=True, left=False),
                        _tril(LU_dot, -1))
            R = _mm(_solve_triangular(L, ops.neg(_mm(_mm(V, P), R)), upper=False, left=False,
                                      unitriangular=True), _mT(P))
            dX = _mH(R) if left else R
        out_dot = add_tangents(out_dot, dX)
    return X, broadcast_tangent(out_dot, _shape(X))
jvp_rules[lu_solve_p] = lu_solve_jvp
# linalg_lu_solve_LU and linalg_lu_solve_jvp with conjugate transposes (adjoint=True solves
# with A^H, as torch's)
complex_ready(lu_solve_p)


@torch_api.register(torch.linalg.lu_solve)
@aten_api.register(aten.linalg_lu_solve.default)
def lu_solve(LU, pivots, B, *, left=True, adjoint=False, out=None):
    return _lu_solve(LU, pivots, B, left, adjoint)


# --- determinants --------------------------------------------------------------------------------
def _det_kernel(A):
    return aten._linalg_det(A)


det_p = _output_of("linalg_det", _det_kernel, 0, (2,))
det_lu_p = _output_of("linalg_det_lu", _det_kernel, 1, (2,), differentiable=False)
det_pivots_p = _output_of("linalg_det_pivots", _det_kernel, 2, (2,), differentiable=False)


def _det(A):
    return bind(det_p, A)


def _products_of_the_others(S):
    """prod_{j != i} S_j for each i (zeros included): the products of the rows of S with the
    diagonal replaced by ones."""
    k = _shape(S)[-1]
    eye = torch.eye(k, dtype=torch.bool, device=S.device)
    rows = ops.where(eye, 1.0, ops.expand(ops.unsqueeze(S, -2), *_shape(S)[:-1], k, k))
    return structural.prod(rows, -1)


def det_vjp(A):
    """NOTE [The derivative of det]
    d det(A) = tr(adj(A) dA), so the gradient is adj(A)^T, which is det(A) A^{-T} when A is
    invertible and exists for a singular A too. torch computes it from the SVD A = U S Vh
    whenever its inputs are tensor subclasses, which is always the case under torch.func
    (the tensor-subclass branch of linalg_det_backward): adj(A)^T = det(U) det(Vh) U
    diag(prod_{j != i} S_j) Vh. So does this rule, so that gradients at singular matrices
    are torch's adjugate, and second derivatives (through the SVD) are torch.func's,
    including its nan where singular values repeat (the Hessian at an orthogonal matrix)."""
    out = _det(A)

    def backward(ct):
        U, S, Vh = _svd(A, full_matrices=True)
        alpha = ops.mul(_conj(ops.mul(_det(U), _det(Vh))), ct)
        D = ops.mul(ops.unsqueeze(alpha, -1), _products_of_the_others(S))
        return (_mm(ops.mul(U, ops.unsqueeze(D, -2)), Vh),)
    return out, backward
vjp_rules[det_p] = det_vjp


def det_jvp(primals, tangents):
    """linalg_det_jvp: det(A) tr(A^{-1} dA), with A^{-1} dA solved from the LU factors, a
    zero pivot replaced by eps (det is C^1, so this approximates the derivative at a
    singular matrix as torch does)."""
    (A,), (A_dot,) = primals, tangents
    out = _det(A)
    LU, pivots = _lu_factor(A)
    zero_pivot = ops.convert(ops.eq(_diagonal(LU), 0.0), LU.dtype)
    LU_ = ops.add(LU, _diag_embed(ops.mul(zero_pivot, torch.finfo(LU.dtype).eps)))
    return out, ops.mul(_trace(_lu_solve(LU_, pivots, A_dot)), out)
jvp_rules[det_p] = det_jvp


@aten_api.register(aten._linalg_det.default)
def linalg_det_full(A):
    return tuple(_bind_all((det_p, det_lu_p, det_pivots_p), A))


@torch_api.register(torch.linalg.det, torch.det, torch.Tensor.det)
def det(A, *, out=None):
    return _det(A)


def _slogdet_kernel(A):
    return aten._linalg_slogdet(A)


# the sign of a real determinant has derivative zero; that of a complex one, det / |det|, has
# one (slogdet_sign_vjp below)
slogdet_sign_p = _output_of("linalg_slogdet_sign", _slogdet_kernel, 0, (2,))
logabsdet_p = _output_of("linalg_logabsdet", _slogdet_kernel, 1, (2,))
slogdet_lu_p = _output_of("linalg_slogdet_lu", _slogdet_kernel, 2, (2,), differentiable=False)
slogdet_pivots_p = _output_of("linalg_slogdet_pivots", _slogdet_kernel, 3, (2,),
                              differentiable=False)


def logabsdet_vjp(A):
    """slogdet_backward (real case): g A^{-T}, solved from A^T (torch's double-backward
    branch), so that it is differentiable again."""
    out = bind(logabsdet_p, A)

    return out, lambda ct: (_times_inverse_h(A, ct),)
vjp_rules[logabsdet_p] = logabsdet_vjp


def _times_inverse_h(A, g):
    """g A^{-H} for one number g per matrix, solved from A^H (differentiable again)."""
    return _solve(_mH(A), _scale(_eye(_shape(A)[-1], A), g))


def logabsdet_jvp(primals, tangents):
    """slogdet_jvp (real case): tr(A^{-1} dA), from the LU factors."""
    (A,), (A_dot,) = primals, tangents
    out = bind(logabsdet_p, A)
    LU, pivots = _lu_factor(A)
    return out, _re(_trace(_lu_solve(LU, pivots, A_dot)))
jvp_rules[logabsdet_p] = logabsdet_jvp


def slogdet_sign_vjp(A):
    """NOTE [slogdet of a complex matrix]
    With t = tr(A^{-1} dA), d logabsdet = Re(t) and d sign = i Im(t) sign (sign = det / |det|
    has modulus one). So the vjp of (g_sign, g_logabsdet) is g A^{-H} with
    g = g_logabsdet - i Im(conj(g_sign) sign), torch's slogdet_backward: the sign's share is
    this rule's, the logabsdet's logabsdet_vjp's. A real sign has derivative zero."""
    out = bind(slogdet_sign_p, A)
    if not A.dtype.is_complex:
        return out, lambda ct: (None,)

    def backward(ct):  # g = -i Im(conj(ct) sign)
        return (_times_inverse_h(A, ops.neg(_imag_i(ops.mul(ops.conj(ct), out)))),)
    return out, backward
vjp_rules[slogdet_sign_p] = slogdet_sign_vjp


def slogdet_sign_jvp(primals, tangents):
    (A,), (A_dot,) = primals, tangents
    out = bind(slogdet_sign_p, A)
    if not A.dtype.is_complex:
        return out, None
    LU, pivots = _lu_factor(A)
    t = _trace(_lu_solve(LU, pivots, A_dot))
    return out, ops.mul(_imag_i(t), out)
jvp_rules[slogdet_sign_p] = slogdet_sign_jvp


@aten_api.register(aten._linalg_slogdet.default)
def linalg_slogdet_full(A):
    return tuple(_bind_all((slogdet_sign_p, logabsdet_p, slogdet_lu_p, slogdet_pivots_p), A))


@torch_api.register(torch.linalg.slogdet)
def slogdet(A, *, out=None):
    sign, logabsdet = _bind_all((slogdet_sign_p, logabsdet_p), A)
    return torch.return_types.linalg_slogdet((sign, logabsdet))


@torch_api.register(torch.slogdet, torch.Tensor.slogdet)
def slogdet_old(A, *, out=None):
    sign, logabsdet = _bind_all((slogdet_sign_p, logabsdet_p), A)
    return torch.return_types.slogdet((sign, logabsdet))


@torch_api.register(torch.logdet, torch.Tensor.logdet)
def logdet(A):
    """log det(A): nan for a negative determinant, as torch's (a where over slogdet); for a
    complex A, the complex logarithm log|det| + i angle(det), whose sign is a unit number."""
    sign, logabsdet = _bind_all((slogdet_sign_p, logabsdet_p), A)
    if sign.dtype.is_complex:
        return ops.add(ops.log(sign), logabsdet)
    return ops.where(ops.eq(sign, -1.0), float("nan"), logabsdet)


# --- Cholesky -----------------------------------------------------------------------------------
def _cholesky_kernel(A, *, upper):
    return aten.linalg_cholesky_ex(A, upper=upper)


cholesky_p = _output_of("linalg_cholesky", _cholesky_kernel, 0, (2,))
cholesky_info_p = _output_of("linalg_cholesky_info", _cholesky_kernel, 1, (2,),
                             differentiable=False)


def _cholesky_backward(ct, factor, upper):
    """cholesky_backward: with L the lower factor, gA = L^{-T} phi(tril(L^T gL)) L^{-1}, where
    phi(X) = (X + X^T - diag(X)) / 2 (a symmetric gradient)."""
    L, gL = (_mH(factor), _mH(ct)) if upper else (factor, ct)
    gA = _tril(_mm(_mH(L), gL))
    gA = ops.mul(ops.add(gA, _mH(_tril(gA, -1))), 0.5)
    gA = _solve_triangular(_mH(L), gA, upper=True, left=True)
    return _solve_triangular(L, gA, upper=False, left=False)


def _cholesky_tangent(A_dot, factor, upper):
    """cholesky_jvp: dL = L pi(L^{-1} dA L^{-T}), pi(X) = tril(X) - diag(X) / 2."""
    L = _mH(factor) if upper else factor
    dL = _solve_triangular(L, A_dot, upper=False, left=True)
    dL = _solve_triangular(_mH(L), dL, upper=True, left=False)
    dL = _mm(L, ops.sub(_tril(dL), _diag_embed(ops.mul(_diagonal(dL), 0.5))))
    return _mH(dL) if upper else dL


def cholesky_vjp(A, *, upper):
    out = bind(cholesky_p, A, upper=upper)
    return out, lambda ct: (_cholesky_backward(ct, out, upper),)
vjp_rules[cholesky_p] = cholesky_vjp


def cholesky_jvp(primals, tangents, *, upper):
    """The tangent is used as given, as torch does (exact for a symmetric tangent)."""
    (A,), (A_dot,) = primals, tangents
    out = bind(cholesky_p, A, upper=upper)
    return out, _cholesky_tangent(A_dot, out, upper)
jvp_rules[cholesky_p] = cholesky_jvp


@aten_api.register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(A, *, upper=False, check_errors=False):
    L, info = _bind_all((cholesky_p, cholesky_info_p), A, upper=upper)
    if check_errors:
        check_info(info, "torch.linalg.cholesky_ex", is_matrix=_rank(A) == 2)
    return L, info


@torch_api.register(torch.linalg.cholesky_ex)
def cholesky_ex(A, *, upper=False, check_errors=False, out=None):
    return torch.return_types.linalg_cholesky_ex(
        linalg_cholesky_ex(A, upper=upper, check_errors=check_errors))


@torch_api.register(torch.linalg.cholesky)
def cholesky(A, *, upper=False, out=None):
    L, info = linalg_cholesky_ex(A, upper=upper)
    check_info(info, "linalg.cholesky", is_matrix=_rank(A) == 2)
    return L


# the old torch.cholesky: its own kernel (which raises for a matrix that is not positive
# definite), linalg.cholesky's backward; torch has no forward formula for it (below)
cholesky_old_p = _single("cholesky", lambda A, *, upper: aten.cholesky(A, upper), (2,))


def cholesky_old_vjp(A, *, upper):
    out = bind(cholesky_old_p, A, upper=upper)
    return out, lambda ct: (_cholesky_backward(ct, out, upper),)
vjp_rules[cholesky_old_p] = cholesky_old_vjp


def cholesky_old_jvp(primals, tangents, *, upper):
    """torch has no jvp for the old cholesky, so torch.func's Jacobian of it is the one its
    reverse mode defines: the backward is symmetric, the adjoint of cholesky_jvp on
    symmetric tangents, so that Jacobian sees the symmetric part of a tangent. The jvp here
    takes that part first, and agrees with the vjp (and with torch.func's jacrev)."""
    (A,), (A_dot,) = primals, tangents
    out = bind(cholesky_old_p, A, upper=upper)
    return out, _cholesky_tangent(ops.mul(ops.add(A_dot, _mH(A_dot)), 0.5), out, upper)
jvp_rules[cholesky_old_p] = cholesky_old_jvp


@torch_api.register(torch.cholesky, torch.Tensor.cholesky)
@aten_api.register(aten.cholesky.default)
def cholesky_old(A, upper=False, *, out=None):
    return bind(cholesky_old_p, A, upper=upper)


cholesky_inverse_p = _single("cholesky_inverse",
                             lambda L, *, upper: aten.cholesky_inverse(L, upper), (2,))


def cholesky_inverse_vjp(L, *, upper):
    """cholesky_inverse_backward: with X = (L L^T)^{-1}, gL = -X (g + g^T) X L (the upper
    factor: -U X (g + g^T) X)."""
    X = bind(cholesky_inverse_p, L, upper=upper)

    def backward(ct):
        common = _mm(X, _mm(_herm(ct), X))
        return (ops.neg(_mm(L, common) if upper else _mm(common, L)),)
    return X, backward
vjp_rules[cholesky_inverse_p] = cholesky_inverse_vjp


def cholesky_inverse_jvp(primals, tangents, *, upper):
    """cholesky_inverse_jvp: dX = K + K^T, K = -X dL X L^T (upper: -X dU^T X U)."""
    (L,), (L_dot,) = primals, tangents
    X = bind(cholesky_inverse_p, L, upper=upper)
    factor, factor_dot = (L, _mH(L_dot)) if upper else (_mH(L), L_dot)
    partial = ops.neg(_mm(_mm(_mm(X, factor_dot), X), factor))
    return X, _herm(partial)
jvp_rules[cholesky_inverse_p] = cholesky_inverse_jvp


@torch_api.register(torch.cholesky_inverse, torch.Tensor.cholesky_inverse)
@aten_api.register(aten.cholesky_inverse.default)
def cholesky_inverse(L, upper=False, *, out=None):
    return bind(cholesky_inverse_p, L, upper=upper)


cholesky_solve_p = _single("cholesky_solve",
                           lambda B, L, *, upper: aten.cholesky_solve(B, L, upper), (2, 2))


def _cholesky_solve(B, L, upper):
    return bind(cholesky_solve_p, B, L, upper=upper)


def cholesky_solve_vjp(B, L, *, upper):
    """cholesky_solve_backward: gB = cholesky_solve(g), gL = -(C + C^T) L with C = gB X^T
    (upper: -U (C + C^T))."""
    X = _cholesky_solve(B, L, upper)

    def backward(ct):
        gB = _cholesky_solve(ct, L, upper)
        gL = None
        if wants_cotangent(1, L):
            common = _herm(_mm(gB, _mH(X)))
            gL = _sum_to(ops.neg(_mm(L, common) if upper else _mm(common, L)), L)
        return (_sum_to(gB, B) if wants_cotangent(0, B) else None), gL
    return X, backward
vjp_rules[cholesky_solve_p] = cholesky_solve_vjp


def cholesky_solve_jvp(primals, tangents, *, upper):
    """cholesky_solve_jvp: dA = dK + dK^T with dK = dL L^T (upper: dU^T U), then
    dX = cholesky_solve(dB - dA X)."""
    (B, L), (B_dot, L_dot) = primals, tangents
    X = _cholesky_solve(B, L, upper)
    rhs = B_dot
    if L_dot is not None:
        dK = _mm(_mH(L_dot), L) if upper else _mm(L_dot, _mH(L))
        product = _mm(_herm(dK), X)
        rhs = ops.neg(product) if rhs is None else ops.sub(rhs, product)
    return X, broadcast_tangent(_cholesky_solve(rhs, L, upper), _shape(X))
jvp_rules[cholesky_solve_p] = cholesky_solve_jvp


@torch_api.register(torch.cholesky_solve, torch.Tensor.cholesky_solve)
@aten_api.register(aten.cholesky_solve.default)
def cholesky_solve(B, L, upper=False, *, out=None):
    return _cholesky_solve(B, L, upper)


# --- symmetric eigendecomposition ----------------------------------------------------------------
def _eigh_kernel(A, *, UPLO):
    return aten._linalg_eigh(A, UPLO, True)


eigvalsh_p = _output_of("linalg_eigvalsh", _eigh_kernel, 0, (2,))
eigvecsh_p = _output_of("linalg_eigh_vectors", _eigh_kernel, 1, (2,))


def _gaps(L):
    """E_ij = L_j - L_i off the diagonal, 1 on it (a safe divisor: the diagonal's quotient is
    not used)."""
    k = _shape(L)[-1]
    eye = torch.eye(k, dtype=torch.bool, device=L.device)
    return eye, ops.where(eye, 1.0, ops.sub(ops.unsqueeze(L, -2), ops.unsqueeze(L, -1)))


def _check_phase_invariance(VhgV, name):
    """Complex eigenvectors are defined up to a phase e^{i phi} each: a loss that depends on
    it has no gradient, and torch raises when diag(V^H gV) is not real (linalg_eig_backward).
    Checked where the numbers are concrete (as torch, which skips the check for tensor
    subclasses)."""
    if not VhgV.dtype.is_complex or not isinstance(VhgV, torch.Tensor):
        return
    im = torch.imag(torch.diagonal(VhgV, 0, -2, -1))
    if not torch.allclose(im, torch.zeros_like(im), rtol=1e-2, atol=1e-2):
        raise FunctionOutputError(
            f"{name}: The eigenvectors in the complex case are specified up to multiplication "
            "by e^{i phi}. The specified loss function depends on this quantity, so it is "
            "ill-defined. Fix: differentiate a function of the eigenvectors that does not "
            "depend on their phases (|V|, V V^H, ...).")


def eigvalsh_vjp(A, *, UPLO):
    """linalg_eig_backward (hermitian, eigenvalues only): gA = V diag(gL) V^T."""
    L, V = _bind_all((eigvalsh_p, eigvecsh_p), A, UPLO=UPLO)

    def backward(ct):
        return (_mm(ops.mul(V, ops.unsqueeze(ct, -2)), _mH(V)),)
    return L, backward
vjp_rules[eigvalsh_p] = eigvalsh_vjp


def eigvecsh_vjp(A, *, UPLO):
    """linalg_eig_backward (hermitian, eigenvectors): gA = V (skew(V^T gV) / 2 / E) V^T with
    E_ij = L_j - L_i (repeated eigenvalues divide by zero, as in torch)."""
    L, V = _bind_all((eigvalsh_p, eigvecsh_p), A, UPLO=UPLO)

    def backward(ct):
        VhgV = _mm(_mH(V), ct)
        _check_phase_invariance(VhgV, "linalg_eigh_backward")
        VhgV = ops.mul(ops.sub(VhgV, _mH(VhgV)), 0.5)
        _, E = _gaps(L)
        return (_mm(V, _mm(ops.div(VhgV, E), _mH(V))),)
    return V, backward
vjp_rules[eigvecsh_p] = eigvecsh_vjp


def eigvalsh_jvp(primals, tangents, *, UPLO):
    """linalg_eig_jvp (hermitian): dL = diag(V^T dA V)."""
    (A,), (A_dot,) = primals, tangents
    L, V = _bind_all((eigvalsh_p, eigvecsh_p), A, UPLO=UPLO)
    return L, _re(_diagonal(_mm(_mm(_mH(V), A_dot), V)))
jvp_rules[eigvalsh_p] = eigvalsh_jvp


def eigvecsh_jvp(primals, tangents, *, UPLO):
    """linalg_eig_jvp (hermitian): dV = V ((V^T dA V) / E, zero diagonal)."""
    (A,), (A_dot,) = primals, tangents
    L, V = _bind_all((eigvalsh_p, eigvecsh_p), A, UPLO=UPLO)
    dP = _mm(_mm(_mH(V), A_dot), V)
    eye, E = _gaps(L)
    return V, _mm(V, ops.where(eye, 0.0, ops.div(dP, E)))
jvp_rules[eigvecsh_p] = eigvecsh_jvp


@aten_api.register(aten._linalg_eigh.default)
def linalg_eigh_full(A, UPLO="L", compute_v=True):
    if not compute_v:
        return bind(eigvalsh_p, A, UPLO=UPLO), _zeros((0,), A)
    return tuple(_bind_all((eigvalsh_p, eigvecsh_p), A, UPLO=UPLO))


@torch_api.register(torch.linalg.eigh)
def eigh(A, UPLO="L", *, out=None):
    return torch.return_types.linalg_eigh(linalg_eigh_full(A, UPLO))


@torch_api.register(torch.linalg.eigvalsh)
def eigvalsh(A, UPLO="L", *, out=None):
    return bind(eigvalsh_p, A, UPLO=UPLO)


# --- general eigendecomposition -------------------------------------------------------------------
# NOTE [The derivative of eig]
# A = V diag(L) V^{-1} with complex L and V, the columns of V of norm 1 (as LAPACK returns them).
# The formulas are the ones PyTorch states in FunctionsManual.cpp (linalg_eig_backward and
# linalg_eig_jvp), from the derivation of an eigendecomposition as a function on matrices whose
# eigenvectors are fixed up to a phase and normalized:
#   jvp:  dP = V^{-1} dA V,  dL = diag(dP),  dV = V (dP / E, zero diagonal) - V Re(diag(V^H dV))
#   vjp:  gA = V^{-H} (diag(gL) + (V^H gV - V^H V Re(diag(V^H gV))) / conj(E)) V^H
# with E_ij = L_j - L_i. Only a loss that does not depend on the eigenvectors' phases has a
# gradient (the check shared with eigh). The two outputs are two primitives of one kernel call
# (NOTE [One kernel call, several primitives]), so the vjp above is the sum of the gL part and
# the gV part; where torch gets both at once it replaces the diagonal of the gV part by gL,
# which differs from the sum only by i Im(diag(V^H gV)): zero for a loss with a gradient.
def _eig_kernel(A):
    return aten.linalg_eig(A)


eigvals_p = _output_of("linalg_eigvals", _eig_kernel, 0, (2,))
eigvecs_p = _output_of("linalg_eig_vectors", _eig_kernel, 1, (2,))


def eigvals_vjp(A):
    """gA = V^{-H} diag(gL) V^H, as one solve with V^H."""
    L, V = _bind_all((eigvals_p, eigvecs_p), A)

    def backward(ct):
        Vh = _mH(V)
        return (_solve(Vh, ops.mul(ops.unsqueeze(ct, -1), Vh)),)
    return L, backward
vjp_rules[eigvals_p] = eigvals_vjp


def eigvecs_vjp(A):
    """gA = V^{-H} ((V^H gV - V^H V Re(diag(V^H gV))) / conj(E)) V^H."""
    L, V = _bind_all((eigvals_p, eigvecs_p), A)

    def backward(ct):
        Vh = _mH(V)
        VhgV = _mm(Vh, ct)
        _check_phase_invariance(VhgV, "linalg_eig_backward")
        # project onto the tangent space of matrices whose columns have norm 1
        VhgV = ops.sub(VhgV, _mm(Vh, ops.mul(V, ops.unsqueeze(_re(_diagonal(VhgV)), -2))))
        _, E = _gaps(_conj(L))
        return (_solve(Vh, _mm(ops.div(VhgV, E), Vh)),)
    return V, backward
vjp_rules[eigvecs_p] = eigvecs_vjp


def _eig_dP(A_dot, V):
    """V^{-1} dA V (a real tangent of a real matrix made complex, as V is)."""
    return _solve(V, _mm(ops.convert(A_dot, V.dtype), V))


def eigvals_jvp(primals, tangents):
    """dL = diag(V^{-1} dA V)."""
    (A,), (A_dot,) = primals, tangents
    L, V = _bind_all((eigvals_p, eigvecs_p), A)
    return L, _diagonal(_eig_dP(A_dot, V))
jvp_rules[eigvals_p] = eigvals_jvp


def eigvecs_jvp(primals, tangents):
    """dV = V (dP / E, zero diagonal), then normalized: dV - V Re(diag(V^H dV))."""
    (A,), (A_dot,) = primals, tangents
    L, V = _bind_all((eigvals_p, eigvecs_p), A)
    eye, E = _gaps(L)
    V_dot = _mm(V, ops.where(eye, 0.0, ops.div(_eig_dP(A_dot, V), E)))
    norm_dot = _re(_diagonal(_mm(_mH(V), V_dot)))
    return V, ops.sub(V_dot, ops.mul(V, ops.unsqueeze(norm_dot, -2)))
jvp_rules[eigvecs_p] = eigvecs_jvp
complex_ready(eigvals_p, eigvecs_p)


@aten_api.register(aten.linalg_eig.default)
def linalg_eig_full(A):
    return tuple(_bind_all((eigvals_p, eigvecs_p), A))


@torch_api.register(torch.linalg.eig)
def eig(A, *, out=None):
    return torch.return_types.linalg_eig(linalg_eig_full(A))


@torch_api.register(torch.linalg.eigvals)
def eigvals(A, *, out=None):
    return bind(eigvals_p, A)


# --- singular value decomposition ----------------------------------------------------------------
def _svd_kernel(A, *, full_matrices, driver):
    return aten._linalg_svd(A, full_matrices, True, driver=driver)


svd_u_p = _output_of("linalg_svd_u", _svd_kernel, 0, (2,))
svd_s_p = _output_of("linalg_svd_s", _svd_kernel, 1, (2,))
svd_vh_p = _output_of("linalg_svd_vh", _svd_kernel, 2, (2,))
_SVD = (svd_u_p, svd_s_p, svd_vh_p)


def _svd(A, full_matrices=False, driver=None):
    return _bind_all(_SVD, A, full_matrices=full_matrices, driver=driver)


def _reduced(U, S, Vh):
    """U and Vh cut to the k = min(m, n) singular vectors that S has (full_matrices)."""
    k = _shape(S)[-1]
    return _cols(U, 0, k), _rows(Vh, 0, k)


def _skewh(x):
    """``x - x^H`` (``_skew`` on real matrices)."""
    return ops.sub(x, _mH(x))


# NOTE [The SVD of a complex matrix]
# Each singular pair (u_i, v_i) is defined up to a common phase e^{i phi}. With
# dP = U^H dA V, the jvp picks the gauge where V^H dV has a zero diagonal and U^H dU the
# diagonal i Im(diag(dP)) / S (then dA = dU S V^H + U dS V^H + U S dV^H holds); the vjp is
# its adjoint: off the diagonal the real formula with conjugate transposes, on it
# i Im(diag(U^H gU)) / S from gU and nothing from gVh. A loss that does not depend on the
# phases (torch refuses the others) has one gradient, and this is it; U and Vh are separate
# primitives here, so torch's check of that invariance, which needs both cotangents, runs
# once the backward pass has both (NOTE [A check over several outputs of one kernel] in
# autograd.py).
def _check_svd_phases(im_sum):
    """torch's svd_backward check: Im diag(U^H gU) + Im diag(V^H gV) = 0 (the loss does not
    depend on the phase shared by u_i and v_i)."""
    if not torch.allclose(im_sum, torch.zeros_like(im_sum), rtol=1e-2, atol=1e-2):
        raise FunctionOutputError(
            "linalg_svd_backward: svd_backward: The singular vectors in the complex case are "
            "specified up to multiplication by e^{i phi}. The specified loss function depends "
            "on this phase term, making it ill-defined. Fix: differentiate a function of the "
            "singular vectors that does not depend on their phases (|U|, U V^H, ...).")


def _file_svd_phases(S, diagonal):
    """File this output's share of the phase check, Im of ``diagonal``, where the numbers are
    concrete (torch skips the check for tensor subclasses too)."""
    if type(diagonal) is torch.Tensor:
        defer_check(("svd phases", id(S)), diagonal.imag, _check_svd_phases)


def _svd_backward(gU, gS, gVh, U, S, Vh):
    """svd_backward (real case), U, Vh reduced; any of the gradients may be None. With
    E_jk = S_k^2 - S_j^2 (1 on the diagonal) and skew(X) = X - X^T:
    gA = U [skew(U^T gU) S / E + S skew(V^T gV) / E + diag(gS)] V^T, plus (I - U U^T) gU S^{-1}
    V^T when m > n, or U S^{-1} gV^T (I - V V^T) when m < n."""
    m, n = _shape(U)[-2], _shape(Vh)[-1]
    if gU is None and gVh is None:
        if m >= n:
            return _mm(U, ops.mul(ops.unsqueeze(gS, -1), Vh))
        return _mm(ops.mul(U, ops.unsqueeze(gS, -2)), Vh)
    S2 = ops.mul(S, S)
    k = _shape(S)[-1]
    eye = torch.eye(k, dtype=torch.bool, device=S.device)
    E = ops.where(eye, 1.0, ops.sub(ops.unsqueeze(S2, -2), ops.unsqueeze(S2, -1)))
    inner = None
    complex_ = U.dtype.is_complex
    if gU is not None:
        UhgU = _mm(_mH(U), gU)
        term = ops.mul(ops.div(_skewh(UhgU), E), ops.unsqueeze(S, -2))
        if complex_:  # NOTE [The SVD of a complex matrix]
            _file_svd_phases(S, _diagonal(UhgU))
            phases = ops.div(_imag_i(_diagonal(UhgU)), S)
            term = ops.add(ops.where(eye, 0.0, term), _diag_embed(phases))
        inner = term
    if gVh is not None:
        VhgV = _mm(Vh, _mH(gVh))  # V^H gV, with gV = gVh^H
        term = ops.mul(ops.unsqueeze(S, -1), ops.div(_skewh(VhgV), E))
        if complex_:
            _file_svd_phases(S, _diagonal(VhgV))
            term = ops.where(eye, 0.0, term)
        inner = add_tangents(inner, term)
    if gS is not None:
        inner = ops.add(inner, _diag_embed(ops.convert(gS, U.dtype) if complex_ else gS))
    if m > n and gU is not None:
        gA = _mm(U, inner)
        gUSinv = ops.div(gU, ops.unsqueeze(S, -2))
        gA = ops.sub(ops.add(gA, gUSinv), _mm(U, _mm(_mH(U), gUSinv)))
        return _mm(gA, Vh)
    if m < n and gVh is not None:
        gA = _mm(inner, Vh)
        SinvgVh = ops.div(gVh, ops.unsqueeze(S, -1))
        gA = ops.sub(ops.add(gA, SinvgVh), _mm(_mm(SinvgVh, _mH(Vh)), Vh))
        return _mm(U, gA)
    return _mm(U, _mm(inner, Vh)) if m >= n else _mm(_mm(U, inner), Vh)


def _svd_vjp(which):
    def vjp(A, *, full_matrices, driver):
        U, S, Vh = _svd(A, full_matrices, driver)
        out = (U, S, Vh)[which]

        def backward(ct):
            Ur, Vhr = _reduced(U, S, Vh) if full_matrices else (U, Vh)
            grads = [None, None, None]
            if which == 0 and full_matrices:
                ct = _cols(ct, 0, _shape(S)[-1])
            elif which == 2 and full_matrices:
                ct = _rows(ct, 0, _shape(S)[-1])
            grads[which] = ct
            return (_svd_backward(*grads, Ur, S, Vhr),)
        return out, backward
    return vjp


def _svd_jvp(which):
    """linalg_svd_jvp: with dP = U^T dA V, dS = diag(dP), dX = dP - diag(dS):
    dU = U sym(dX S) / E (+ (I - U U^T) dA V S^{-1} when m > n),
    dVh = -sym(S dX) / E Vh (+ S^{-1} U^T dA (I - V V^T) when m < n),
    zero columns (rows) appended for the full matrices."""
    def jvp(primals, tangents, *, full_matrices, driver):
        (A,), (A_dot,) = primals, tangents
        U_full, S, Vh_full = _svd(A, full_matrices, driver)
        U, Vh = _reduced(U_full, S, Vh_full) if full_matrices else (U_full, Vh_full)
        m, n = _shape(A)[-2:]
        V = _mH(Vh)
        dP = _mm(_mH(U), _mm(A_dot, V)) if m < n else _mm(_mm(_mH(U), A_dot), V)
        dS = _re(_diagonal(dP))
        if which == 1:
            return S, dS
        complex_ = dP.dtype.is_complex
        dX = ops.sub(dP, _diag_embed(ops.convert(dS, dP.dtype) if complex_ else dS))
        S2 = ops.mul(S, S)
        k = _shape(S)[-1]
        eye = torch.eye(k, dtype=torch.bool, device=S.device)
        E = ops.where(eye, 1.0, ops.sub(ops.unsqueeze(S2, -2), ops.unsqueeze(S2, -1)))
        if which == 0:
            omega = ops.div(_herm(ops.mul(dX, ops.unsqueeze(S, -2))), E)
            if complex_:  # NOTE [The SVD of a complex matrix]
                omega = ops.add(omega, _diag_embed(ops.div(_imag_i(_diagonal(dP)), S)))
            dU = _mm(U, omega)
            if m > n:
                dAVSinv = _mm(A_dot, ops.div(V, ops.unsqueeze(S, -2)))
                dU = ops.sub(ops.add(dU, dAVSinv), _mm(U, _mm(_mH(U), dAVSinv)))
                if full_matrices:
                    dU = _pad_cols(dU, m)
            return U_full, dU
        dVh = _mm(ops.div(_herm(ops.mul(dX, ops.unsqueeze(ops.neg(S), -1))), E), Vh)
        if m < n:
            UtdASinv = _mm(ops.div(_mH(U), ops.unsqueeze(S, -1)), A_dot)
            dVh = ops.sub(ops.add(dVh, UtdASinv), _mm(_mm(UtdASinv, V), Vh))
            if full_matrices:
                dVh = _pad_rows(dVh, n)
        return Vh_full, dVh
    return jvp


for _which, _prim in enumerate(_SVD):
    vjp_rules[_prim] = _svd_vjp(_which)
    jvp_rules[_prim] = _svd_jvp(_which)
complex_ready(*_SVD)  # NOTE [The SVD of a complex matrix]


@aten_api.register(aten._linalg_svd.default)
def linalg_svd_full(A, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        empty = _zeros((0,), A)
        return empty, bind(svd_s_p, A, full_matrices=False, driver=driver), empty
    return tuple(_svd(A, full_matrices, driver))


@torch_api.register(torch.linalg.svd)
def svd(A, full_matrices=True, *, driver=None, out=None):
    return torch.return_types.linalg_svd(_svd(A, full_matrices, driver))


@torch_api.register(torch.linalg.svdvals)
def svdvals(A, *, driver=None, out=None):
    return bind(svd_s_p, A, full_matrices=False, driver=driver)


@torch_api.register(torch.svd, torch.Tensor.svd)
def svd_old(A, some=True, compute_uv=True, *, out=None):
    """The old torch.svd: V rather than Vh; without compute_uv, zero U (m x m) and V (n x n),
    as torch returns."""
    if compute_uv:
        U, S, Vh = _svd(A, full_matrices=not some)
        return torch.return_types.svd((U, S, _mH(Vh)))  # A = U diag(S) V^H
    shape = _shape(A)
    m, n = shape[-2:]
    S = svdvals(A)
    return torch.return_types.svd((_zeros(shape[:-1] + (m,), A), S,
                                   _zeros(shape[:-2] + (n, n), A)))


# --- QR ------------------------------------------------------------------------------------------
def _qr_kernel(A, *, mode):
    return aten.linalg_qr(A, mode)


qr_q_p = _output_of("linalg_qr_q", _qr_kernel, 0, (2,))
qr_r_p = _output_of("linalg_qr_r", _qr_kernel, 1, (2,))


def _qr_derivable(A, mode, what):
    m, n = _shape(A)[-2:]
    if mode == "r":
        raise UnsupportedOperationError(
            f"linalg.qr(A, mode='r') under {what}: the derivative of linalg.qr depends on Q, "
            "which is not computed when mode='r' (torch refuses too). Fix: use "
            "linalg.qr(A, mode='reduced').")
    if mode == "complete" and m > n:
        raise UnsupportedOperationError(
            f"linalg.qr(A, mode='complete') under {what}: the QR decomposition is not "
            f"differentiable when mode='complete' and A has more rows than columns ({m} > {n}) "
            "(torch refuses too). Fix: use mode='reduced'.")


# NOTE [The QR of a complex matrix]
# Q^H dQ is skew-hermitian, and dR R^{-1} upper triangular; on complex matrices their split of
# the diagonal of X = Q^H dA R^{-1} is a convention, torch's: dR R^{-1} has a real diagonal,
# so Q^H dQ takes i Im(diag(X)) (the jvp for m < n adds it; for m >= n the hermitian part
# X + X^H already has a real diagonal). The vjps are the adjoints: the real part of the
# diagonal for m >= n, and half the (imaginary) diagonal of tril(M^H - M) for m < n. Every
# transpose is a conjugate transpose. Checked against torch.func on Q, R and both, square,
# tall and wide, reduced and complete.
def _qr_backward(gQ, gR, Q, R):
    """linalg_qr_backward. With M = gR R^T - Q^T gQ: for m >= n, gA = (gQ + Q copyltu(M))
    R^{-T}, copyltu(M) = triu(M) + triu(M, 1)^T; for m < n, gA = [Q tril(-M + M^T) R1^{-T},
    0] + Q gR (R1 the leading m x m block of R)."""
    m, n = _shape(Q)[-2], _shape(R)[-1]
    if gQ is None:
        gA = _mm(gR, _mH(R))
    elif gR is None:
        gA = ops.neg(_mm(_mH(Q), gQ))
    else:
        gA = ops.sub(_mm(gR, _mH(R)), _mm(_mH(Q), gQ))
    if m >= n:
        upper = _triu(gA)
        gA = _mm(Q, ops.sub(_herm(upper), _diag_embed(_re(_diagonal(upper)))))
        if gQ is not None:
            gA = ops.add(gA, gQ)
        return _solve_triangular(_mH(R), gA, upper=False, left=False)
    lower = _tril(ops.neg(_skewh(gA)))
    if lower.dtype.is_complex:  # NOTE [The QR of a complex matrix]
        lower = ops.sub(lower, _diag_embed(ops.mul(_diagonal(lower), 0.5)))
    gA = _mm(Q, lower)
    gA = _solve_triangular(_mH(_cols(R, 0, m)), gA, upper=False, left=False)
    gA = _pad_cols(gA, n)
    if gR is not None:
        gA = ops.add(gA, _mm(Q, gR))
    return gA


def _qr_vjp(which):
    def vjp(A, *, mode):
        Q, R = _bind_all((qr_q_p, qr_r_p), A, mode=mode)

        def backward(ct):
            _qr_derivable(A, mode, "grad")
            return (_qr_backward(ct if which == 0 else None, ct if which == 1 else None, Q, R),)
        return (Q, R)[which], backward
    return vjp


def _qr_jvp(which):
    """linalg_qr_jvp. m >= n: dR = syminv(sym(Q^T dA R^{-1})) R with syminv(X) = triu(X) -
    diag(X) / 2, dQ = dA R^{-1} - Q syminv(...). m < n: dQ = Q (X - X^T) with X =
    tril(Q^T dA1 R1^{-1}, -1), dR = Q^T dA - (Q^T dQ) R."""
    def jvp(primals, tangents, *, mode):
        (A,), (A_dot,) = primals, tangents
        _qr_derivable(A, mode, "jvp")
        Q, R = _bind_all((qr_q_p, qr_r_p), A, mode=mode)
        m, n = _shape(A)[-2:]
        if m >= n:
            dARinv = _solve_triangular(R, A_dot, upper=True, left=False)
            X = _herm(_mm(_mH(Q), dARinv))
            dR = ops.sub(_triu(X), _diag_embed(ops.mul(_diagonal(X), 0.5)))
            if which == 0:
                return Q, ops.sub(dARinv, _mm(Q, dR))
            return R, _mm(dR, R)
        QtdA = _mm(_mH(Q), A_dot)
        X = _solve_triangular(_cols(R, 0, m), _cols(QtdA, 0, m), upper=True, left=False)
        dQ = _skewh(_tril(X, -1))
        if X.dtype.is_complex:  # NOTE [The QR of a complex matrix]
            dQ = ops.add(dQ, _diag_embed(_imag_i(_diagonal(X))))
        if which == 0:
            return Q, _mm(Q, dQ)
        return R, ops.sub(QtdA, _mm(dQ, R))
    return jvp


for _which, _prim in enumerate((qr_q_p, qr_r_p)):
    vjp_rules[_prim] = _qr_vjp(_which)
    jvp_rules[_prim] = _qr_jvp(_which)
complex_ready(qr_q_p, qr_r_p)  # NOTE [The QR of a complex matrix]


@aten_api.register(aten.linalg_qr.default)
def linalg_qr_full(A, mode="reduced"):
    if mode == "r":
        return _zeros((0,), A), bind(qr_r_p, A, mode=mode)
    return tuple(_bind_all((qr_q_p, qr_r_p), A, mode=mode))


@torch_api.register(torch.linalg.qr)
def qr(A, mode="reduced", *, out=None):
    return torch.return_types.linalg_qr(linalg_qr_full(A, mode))


@torch_api.register(torch.qr, torch.Tensor.qr)
def qr_old(A, some=True, *, out=None):
    return torch.return_types.qr(linalg_qr_full(A, "reduced" if some else "complete"))


# --- pseudo-inverse ------------------------------------------------------------------------------
def _pinv_impl(A, atol, rtol, *, hermitian):
    return aten.linalg_pinv.atol_rtol_tensor(A, atol=atol, rtol=rtol, hermitian=hermitian)


# atol and rtol: None, or tensors that broadcast against A's batch dims (not differentiable)
pinv_p = _single("linalg_pinv", _pinv_impl, (2, 0, 0))


def _pinv(A, atol=None, rtol=None, hermitian=False):
    return bind(pinv_p, A, atol, rtol, hermitian=hermitian)


def _pinv_backward(g, Ap, A):
    """pinv_backward (conjugate transposes), products ordered for the smaller of m and n."""
    m, n = _shape(A)[-2:]
    Ap_t, g_t = _mH(Ap), _mH(g)
    if m <= n:
        K = _mm(g_t, Ap)
        KAp_t = _mm(K, Ap_t)
        out = ops.add(ops.neg(_mH(_mm(Ap, K))), KAp_t)
        out = ops.sub(out, _mm(_mm(A, Ap), KAp_t))
        return ops.add(out, _mm(_mm(Ap_t, Ap), ops.sub(g_t, _mm(K, A))))
    K = _mm(Ap, g_t)
    Ap_tK = _mm(Ap_t, K)
    out = ops.add(ops.neg(_mH(_mm(K, Ap))), _mm(_mm(ops.sub(g_t, _mm(A, K)), Ap), Ap_t))
    return ops.sub(ops.add(out, Ap_tK), _mm(_mm(Ap_tK, Ap), A))


def _pinv_jvp(A, Ap, dA):
    """pinv_jvp (Golub and Pereyra): dAp = -Ap dA Ap + (I - Ap A) dA^T Ap^T Ap
    + Ap Ap^T dA^T (I - A Ap)."""
    m, n = _shape(A)[-2:]
    dA_t, Ap_t = _mH(dA), _mH(Ap)
    if m <= n:
        K = _mm(Ap_t, dA_t)
        first = _mm(Ap, ops.sub(ops.sub(K, _mH(K)), _mm(K, _mm(A, Ap))))
        return ops.add(first, _mm(ops.sub(dA_t, _mm(Ap, _mm(A, dA_t))), _mm(Ap_t, Ap)))
    K = _mm(Ap, dA)
    K_t = _mH(K)
    first = _mm(ops.sub(ops.sub(K_t, K), _mm(_mm(Ap, A), K_t)), Ap)
    return ops.add(first, _mm(_mm(Ap, Ap_t), ops.sub(dA_t, _mm(_mm(dA_t, A), Ap))))


def pinv_vjp(A, atol, rtol, *, hermitian):
    Ap = _pinv(A, atol, rtol, hermitian)

    def backward(ct):
        return _sum_to(_pinv_backward(ct, Ap, A), A), None, None
    return Ap, backward
vjp_rules[pinv_p] = pinv_vjp


def pinv_jvp(primals, tangents, *, hermitian):
    (A, atol, rtol), (A_dot, _, _) = primals, tangents
    Ap = _pinv(A, atol, rtol, hermitian)
    if A_dot is None:  # only a tolerance has a tangent: torch does not differentiate those
        return Ap, None
    return Ap, broadcast_tangent(_pinv_jvp(A, Ap, A_dot), _shape(Ap))
jvp_rules[pinv_p] = pinv_jvp
complex_ready(pinv_p)  # NOTE [Linear algebra on complex numbers]


def _tolerance(value, A):
    """A float tolerance as torch passes it on: a 0-d float64 tensor."""
    if value is None or _is_tensor(value):
        return value
    return torch.full((), float(value), dtype=torch.float64, device=A.device)


@aten_api.register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv_tensor(A, *, atol=None, rtol=None, hermitian=False):
    return _pinv(A, atol, rtol, hermitian)


@torch_api.register(torch.linalg.pinv)
def pinv(A, rcond=None, hermitian=False, *, atol=None, rtol=None, out=None):
    """torch.linalg.pinv with atol/rtol (numbers or tensors), or the older rcond (a relative
    tolerance, with atol 0)."""
    if rcond is not None:
        atol, rtol = torch.zeros((), dtype=torch.float64, device=A.device), rcond
    return _pinv(A, _tolerance(atol, A), _tolerance(rtol, A), hermitian)


@torch_api.register(torch.pinverse, torch.Tensor.pinverse)
def pinverse(A, rcond=1e-15):
    return pinv(A, rcond)


# --- least squares -------------------------------------------------------------------------------
def _lstsq_kernel(A, B, *, rcond, driver):
    if A.device.type == "meta":  # torch has no meta kernel: the shapes, worked out here
        return _lstsq_meta(A, B, driver)
    return aten.linalg_lstsq(A, B, rcond, driver=driver)


def _lstsq_meta(A, B, driver):
    m, n = A.shape[-2:]
    batch = ops.broadcast_shapes(A.shape[:-2], B.shape[:-2], op="linalg.lstsq")
    k = B.shape[-1]
    driver = driver or "gelsy"
    new = lambda *shape, dtype=A.dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa
    # residuals depend on the data (a full-rank A with m > n): assumed so, for the shape
    residuals = new(*batch, k) if m > n and driver != "gelsy" else new(0)
    rank = new(*batch, dtype=torch.int64) if driver != "gels" else new(0, dtype=torch.int64)
    values = new(*batch, min(m, n)) if driver in ("gelsd", "gelss") else new(0)
    return new(*batch, n, k), residuals, rank, values


_LSTSQ_CORES = (2, 2)
lstsq_solution_p = _output_of("linalg_lstsq_solution", _lstsq_kernel, 0, _LSTSQ_CORES,
                              broadcast=False)
lstsq_residuals_p = _output_of("linalg_lstsq_residuals", _lstsq_kernel, 1, _LSTSQ_CORES,
                               broadcast=False)
# rank and singular values: not differentiable (derivatives.yaml)
lstsq_rank_p = _output_of("linalg_lstsq_rank", _lstsq_kernel, 2, _LSTSQ_CORES,
                          differentiable=False, broadcast=False)
lstsq_values_p = _output_of("linalg_lstsq_singular_values", _lstsq_kernel, 3, _LSTSQ_CORES,
                            differentiable=False, broadcast=False)


def _lstsq_batch(prim):
    """NOTE [Outputs a driver does not compute]
    A driver that does not compute the residuals, the rank or the singular values returns
    an empty tensor of shape (0,) for them, whatever the batch dims. Under vmap each example
    then has its own empty output, so the batch of them has shape (batch, 0), as
    torch.func's is."""
    rule = batch_matrices(prim, _LSTSQ_CORES, broadcast=False)

    def batched(values, bdims, **params):
        out, out_bdim = rule(values, bdims, **params)
        may_be_empty = prim is not lstsq_rank_p or params["driver"] == "gels"
        if may_be_empty and _shape(out) == (0,):
            out = ops.reshape(out, batch_size(values, bdims), 0)
        return out, out_bdim
    return batched


for _prim in (lstsq_residuals_p, lstsq_rank_p, lstsq_values_p):
    batching_rules[_prim] = _lstsq_batch(_prim)


def lstsq_solution_vjp(A, B, *, rcond, driver):
    """linalg_lstsq_backward, the solution's part: X = pinv(A) B, so gA = pinv_backward(gX B^T)
    and gB = pinv(A)^T gX."""
    X = bind(lstsq_solution_p, A, B, rcond=rcond, driver=driver)

    def backward(ct):
        Ap = _pinv(A)
        gA = _pinv_backward(_mm(ct, _mH(B)), Ap, A) if wants_cotangent(0, A) else None
        gB = _mm(_mH(Ap), ct) if wants_cotangent(1, B) else None
        return gA, gB
    return X, backward
vjp_rules[lstsq_solution_p] = lstsq_solution_vjp


def lstsq_solution_jvp(primals, tangents, *, rcond, driver):
    """linalg_lstsq_solution_jvp: dX = dpinv(A) B + pinv(A) dB."""
    (A, B), (A_dot, B_dot) = primals, tangents
    X = bind(lstsq_solution_p, A, B, rcond=rcond, driver=driver)
    Ap = _pinv(A)
    out_dot = None if A_dot is None else _mm(_pinv_jvp(A, Ap, A_dot), B)
    out_dot = add_tangents(out_dot, None if B_dot is None else _mm(Ap, B_dot))
    return X, out_dot
jvp_rules[lstsq_solution_p] = lstsq_solution_jvp


def lstsq_residuals_vjp(A, B, *, rcond, driver):
    """The residuals' part: with r = A X - B, gA = 2 (gL r) X^T, gB = -2 gL r (Danskin's
    theorem: X is optimal, so its own change does not count). No residuals, no gradient."""
    residuals, X = _bind_all((lstsq_residuals_p, lstsq_solution_p), A, B, rcond=rcond,
                             driver=driver)

    def backward(ct):
        if 0 in _shape(residuals):  # no residuals were computed
            return None, None
        r = ops.sub(_mm(A, X), B)
        gLr = ops.mul(ops.unsqueeze(ct, -2), r)
        gA = ops.mul(_mm(gLr, _mH(X)), 2.0) if wants_cotangent(0, A) else None
        gB = ops.mul(gLr, -2.0) if wants_cotangent(1, B) else None
        return gA, gB
    return residuals, backward
vjp_rules[lstsq_residuals_p] = lstsq_residuals_vjp


def lstsq_residuals_jvp(primals, tangents, *, rcond, driver):
    """linalg_lstsq_residuals_jvp: dL = 2 sum(r * dr, -2), dr = dA X - dB."""
    (A, B), (A_dot, B_dot) = primals, tangents
    residuals, X = _bind_all((lstsq_residuals_p, lstsq_solution_p), A, B, rcond=rcond,
                             driver=driver)
    if 0 in _shape(residuals):
        return residuals, ops.clone(residuals)
    r = ops.sub(_mm(A, X), B)
    dr = None if A_dot is None else _mm(A_dot, X)
    if B_dot is not None:
        dr = ops.neg(B_dot) if dr is None else ops.sub(dr, B_dot)
    return residuals, ops.mul(_re(ops.sum(ops.mul(_conj(r), dr), -2)), 2.0)
jvp_rules[lstsq_residuals_p] = lstsq_residuals_jvp
# the solution is holomorphic in A and B (conjugate transposes in its backward), the residuals
# |A X - B|^2 a real function (Re(conj(r) dr) in the jvp): NOTE [Linear algebra on complex
# numbers]
complex_ready(lstsq_solution_p, lstsq_residuals_p)


@aten_api.register(aten.linalg_lstsq.default)
def linalg_lstsq_full(A, B, rcond=None, *, driver=None):
    vector = _vector_rhs(A, B)
    B_ = ops.unsqueeze(B, -1) if vector else B
    X, residuals, rank, values = _bind_all(
        (lstsq_solution_p, lstsq_residuals_p, lstsq_rank_p, lstsq_values_p), A, B_,
        rcond=rcond, driver=driver)
    return (ops.squeeze(X, -1) if vector else X), residuals, rank, values


@torch_api.register(torch.linalg.lstsq)
def lstsq(A, B, rcond=None, *, driver=None):
    return torch.return_types.linalg_lstsq(linalg_lstsq_full(A, B, rcond, driver=driver))


# --- matrix exponential --------------------------------------------------------------------------
# (torch's kernel views its input as a batch of matrices: a batch moved to the front by vmap
# needs a copy first)
matrix_exp_p = _single("linalg_matrix_exp", lambda A: aten.linalg_matrix_exp(A.contiguous()),
                       (2,))


def _matrix_exp(A):
    return bind(matrix_exp_p, A)


def _matrix_exp_differential(A, G, adjoint):
    """NOTE [The derivative of a matrix function is a block of it]
    For an analytic f, f([[A, G], [0, A]]) = [[f(A), Df(A)[G]], [0, f(A)]] (Mathias 1996):
    the upper right block of exp of the 2n x 2n block matrix is the derivative of exp at A
    in the direction G, and with A^T in place of A its adjoint (the vjp). This is torch's
    differential_analytic_matrix_function; it calls matrix_exp itself, so it is
    differentiable to any order."""
    A = _mH(A) if adjoint else A
    n = _shape(A)[-1]
    block = ops.cat([ops.cat([A, G], -1), ops.cat([ops.zeros_like(A), A], -1)], -2)
    return _cols(_rows(_matrix_exp(block), 0, n), n, 2 * n)


def matrix_exp_vjp(A):
    out = _matrix_exp(A)
    return out, lambda ct: (_matrix_exp_differential(A, ct, adjoint=True),)
vjp_rules[matrix_exp_p] = matrix_exp_vjp


def matrix_exp_jvp(primals, tangents):
    (A,), (A_dot,) = primals, tangents
    return _matrix_exp(A), _matrix_exp_differential(A, A_dot, adjoint=False)
jvp_rules[matrix_exp_p] = matrix_exp_jvp


# NOTE [Linear algebra on complex numbers]
# The functions above are holomorphic (inv, solve, the triangular solves, det, cholesky,
# matrix_exp) or real functions of complex matrices (logabsdet), and their formulas, as in
# FunctionsManual.cpp, become the complex ones when every transpose of a backward is a
# conjugate transpose (_mH, the transpose on real matrices): the jvps are unchanged, and a
# real part is taken where the result is real (logabsdet), and a symmetric part
# x + x^T becomes a hermitian one x + x^H (cholesky_inverse, cholesky_solve). eigh's
# eigenvalues are real (their jvp takes the real part of diag(V^H dA V)), and its eigenvectors'
# backward projects V^H gV onto the skew-hermitian matrices; a loss that depends on their
# phases is refused, as torch does (_check_phase_invariance). The old triangular_solve's
# transposed op(A) is A^T, not A^H, so its backward solves with conj(A). slogdet's sign is
# differentiable on complex matrices (NOTE [slogdet of a complex matrix]). Checked against
# torch.func on complex64 and complex128 (tests/test_complex.py, LINALG).
complex_ready(inv_p, solve_p, solve_triangular_p, triangular_solve_p, det_p, logabsdet_p,
              slogdet_sign_p, cholesky_p, cholesky_old_p, cholesky_inverse_p, cholesky_solve_p,
              eigvalsh_p, eigvecsh_p, matrix_exp_p)


@torch_api.register(torch.linalg.matrix_exp, torch.matrix_exp, torch.Tensor.matrix_exp)
@aten_api.register(aten.linalg_matrix_exp.default)
def matrix_exp(A, *, out=None):
    return _matrix_exp(A)


# --- Householder products ------------------------------------------------------------------------
householder_p = _single("linalg_householder_product",
                        lambda A, tau: aten.linalg_householder_product(A, tau), (2, 1),
                        broadcast=False)


def _reflectors(A, tau):
    """The vectors v_i (columns of V: A's strict lower part, ones on the diagonal) and the
    number k of reflectors H_i = I - tau_i v_i v_i^H."""
    m, n = _shape(A)[-2:]
    V = ops.add(_tril(A, -1), _eye(m, A, n))
    return V, _shape(tau)[-1]


def _column(V, i):
    return ops.getitem(V, (Ellipsis, slice(None), slice(i, i + 1)))


def _tau(tau, i):
    return ops.unsqueeze(ops.getitem(tau, (Ellipsis, slice(i, i + 1))), -1)


def _reflect(X, v, t, left=True):
    """H X = X - t v (v^H X) (left), or X H = X - (X v) t v^H; v a column, t (..., 1, 1)."""
    if left:
        return ops.sub(X, ops.mul(t, _mm(v, _mm(_mH(v), X))))
    return ops.sub(X, ops.mul(t, _mm(_mm(X, v), _mH(v))))


def _partial_products(V, tau, k, cols):
    """prefix_i = H_0 ... H_{i-1} (m x m) and suffix_i = H_{i+1} ... H_{k-1} E (m x cols, E
    the first cols columns of I), for each reflector i."""
    m = _shape(V)[-2]
    batch = _shape(V)[:-2]
    prefixes = [ops.expand(_eye(m, V), *batch, m, m)]
    for i in range(k - 1):
        prefixes.append(_reflect(prefixes[-1], _column(V, i), _tau(tau, i), left=False))
    suffixes = [None] * k
    suffix = ops.expand(_eye(m, V, cols), *batch, m, cols)
    for i in range(k - 1, -1, -1):
        suffixes[i] = suffix
        suffix = _reflect(suffix, _column(V, i), _tau(tau, i), left=True)
    return prefixes, suffixes


def _householder_cotangents(G, V, tau, k, cols):
    """The cotangents of the reflectors' vectors (as the first k columns of an m x k
    matrix) and of tau, for the product (H_0 ... H_{k-1})[:, :cols] with cotangent G."""
    prefixes, suffixes = _partial_products(V, tau, k, cols)
    v_grads, tau_grads = [], []
    for i in range(k):
        v, t = _column(V, i), _tau(tau, i)
        K = _mm(_mm(_mH(prefixes[i]), G), _mH(suffixes[i]))
        Kv, KHv = _mm(K, v), _mm(_mH(K), v)
        tau_grads.append(ops.neg(ops.squeeze(_mm(_mH(v), Kv), -1)))
        v_grads.append(ops.neg(ops.add(ops.mul(_conj(t), Kv), ops.mul(t, KHv))))
    return ops.cat(v_grads, -1), ops.cat(tau_grads, -1)


def _householder_tangent(V_dot, tau_dot, V, tau, k, cols):
    """The tangent of (H_0 ... H_{k-1})[:, :cols]; V_dot (the strict lower part of the
    input's tangent) or tau_dot may be None."""
    prefixes, suffixes = _partial_products(V, tau, k, cols)
    out_dot = None
    for i in range(k):
        v, t = _column(V, i), _tau(tau, i)
        vS = _mm(_mH(v), suffixes[i])
        dH_S = None  # dH_i suffix_i, without its sign
        if tau_dot is not None:
            dH_S = ops.mul(_tau(tau_dot, i), _mm(v, vS))
        if V_dot is not None:
            dv = _column(V_dot, i)
            term = ops.mul(t, ops.add(_mm(dv, vS), _mm(v, _mm(_mH(dv), suffixes[i]))))
            dH_S = add_tangents(dH_S, term)
        out_dot = add_tangents(out_dot, ops.neg(_mm(prefixes[i], dH_S)))
    return out_dot


def householder_vjp(A, tau):
    """NOTE [Householder products]
    Q = (H_0 ... H_{k-1})[:, :n] with H_i = I - tau_i v_i v_i^H, so dQ = sum_i prefix_i dH_i
    suffix_i with dH_i = -(dtau_i v v^H + tau_i (dv v^H + v dv^H)) (householder_product's
    forward formula in FunctionsManual.cpp). Its adjoint under Re<a, b>, with K_i =
    prefix_i^H G suffix_i^H: g_tau_i = -v^H K_i v, g_v_i = -(conj(tau_i) K_i + tau_i K_i^H) v,
    of which A's strict lower part is kept. On real matrices ^H is ^T and conj the identity;
    on complex ones this is torch's householder_product_backward and _jvp (conjugate
    Wirtinger convention, NOTE [Complex numbers] in dispatch.py): the v^H makes Q a
    non-holomorphic function of A, and the tangent carries dv^H as it is. torch updates K_i
    in place with inverted reflectors; here the partial products are formed explicitly, k
    rank-one updates each way, all with ops, so that the rule is differentiable again. ormqr,
    a product of the same reflectors with another matrix, reuses both formulas."""
    Q = bind(householder_p, A, tau)

    def backward(ct):
        n = _shape(A)[-1]
        V, k = _reflectors(A, tau)
        if k == 0:
            return ops.zeros_like(A), ops.zeros_like(tau)
        V_grad, tau_grad = _householder_cotangents(ct, V, tau, k, n)
        return _tril(_pad_cols(V_grad, n), -1), tau_grad
    return Q, backward
vjp_rules[householder_p] = householder_vjp


def householder_jvp(primals, tangents):
    (A, tau), (A_dot, tau_dot) = primals, tangents
    Q = bind(householder_p, A, tau)
    V, k = _reflectors(A, tau)
    if k == 0:
        return Q, ops.zeros_like(Q)
    V_dot = None if A_dot is None else _tril(A_dot, -1)
    return Q, _householder_tangent(V_dot, tau_dot, V, tau, k, _shape(A)[-1])
jvp_rules[householder_p] = householder_jvp


@torch_api.register(torch.linalg.householder_product, torch.orgqr, torch.Tensor.orgqr)
@aten_api.register(aten.linalg_householder_product.default, aten.orgqr.default)
def householder_product(A, tau, *, out=None):
    return bind(householder_p, A, tau)


ormqr_p = _single("ormqr", lambda A, tau, C, *, left, transpose: aten.ormqr(A, tau, C, left,
                                                                            transpose),
                  (2, 1, 2), broadcast=False)


def _ormqr(A, tau, C, left, transpose):
    return bind(ormqr_p, A, tau, C, left=left, transpose=transpose)


def ormqr_vjp(A, tau, C, *, left, transpose):
    """ormqr computes op(Q) C (left) or C op(Q), Q = H_0 ... H_{k-1} the full product of
    the reflectors, op(Q) = Q or Q^H (``transpose``): gC = op(Q)^H gR, another ormqr; the
    cotangent of Q is gR C^H, C gR^H, C^H gR or gR^H C, from which NOTE [Householder
    products] gives A's and tau's (PyTorch's ormqr_backward)."""
    R = _ormqr(A, tau, C, left, transpose)

    def backward(ct):
        gC = _sum_to(_ormqr(A, tau, ct, left, not transpose), C) \
            if wants_cotangent(2, C) else None
        gA = g_tau = None
        if wants_cotangent(0, A) or wants_cotangent(1, tau):
            if left:
                G = _mm(C, _mH(ct)) if transpose else _mm(ct, _mH(C))
            else:
                G = _mm(_mH(ct), C) if transpose else _mm(_mH(C), ct)
            V, k = _reflectors(A, tau)
            if k == 0:
                return ops.zeros_like(A), ops.zeros_like(tau), gC
            V_grad, g_tau = _householder_cotangents(G, V, tau, k, _shape(V)[-2])
            gA = _tril(_pad_cols(V_grad, _shape(A)[-1]), -1)
        return gA, g_tau, gC
    return R, backward
vjp_rules[ormqr_p] = ormqr_vjp


def ormqr_jvp(primals, tangents, *, left, transpose):
    """dR = op(dQ) C + op(Q) dC, dQ from NOTE [Householder products] (torch has no jvp for
    ormqr: this one is the vjp's adjoint)."""
    (A, tau, C), (A_dot, tau_dot, C_dot) = primals, tangents
    R = _ormqr(A, tau, C, left, transpose)
    out_dot = None if C_dot is None else _ormqr(A, tau, C_dot, left, transpose)
    V, k = _reflectors(A, tau)
    if k and (A_dot is not None or tau_dot is not None):
        V_dot = None if A_dot is None else _tril(A_dot, -1)
        Q_dot = _householder_tangent(V_dot, tau_dot, V, tau, k, _shape(V)[-2])
        Q_dot = _mH(Q_dot) if transpose else Q_dot
        out_dot = add_tangents(out_dot, _mm(Q_dot, C) if left else _mm(C, Q_dot))
    if out_dot is None:
        out_dot = ops.zeros_like(R)
    return R, broadcast_tangent(out_dot, _shape(R))
jvp_rules[ormqr_p] = ormqr_jvp
complex_ready(householder_p, ormqr_p)  # NOTE [Householder products]


@torch_api.register(torch.ormqr, torch.Tensor.ormqr)
@aten_api.register(aten.ormqr.default)
def ormqr(A, tau, C, left=True, transpose=False, *, out=None):
    return _ormqr(A, tau, C, left, transpose)


# --- factorizations torch does not differentiate: LDL, geqrf -------------------------------------
def _ldl_kernel(A, *, hermitian):
    return aten.linalg_ldl_factor_ex(A, hermitian=hermitian)


ldl_p = _output_of("linalg_ldl_factor", _ldl_kernel, 0, (2,))
ldl_pivots_p = _output_of("linalg_ldl_pivots", _ldl_kernel, 1, (2,), differentiable=False)
ldl_info_p = _output_of("linalg_ldl_info", _ldl_kernel, 2, (2,), differentiable=False)
_refused_derivative(ldl_p, "linalg.ldl_factor")


@aten_api.register(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(A, *, hermitian=False, check_errors=False):
    LD, pivots, info = _bind_all((ldl_p, ldl_pivots_p, ldl_info_p), A, hermitian=hermitian)
    if check_errors:
        check_info(info, "torch.linalg.ldl_factor_ex", is_matrix=_rank(A) == 2)
    return LD, pivots, info


ldl_solve_p = _single(
    "linalg_ldl_solve",
    lambda LD, pivots, B, *, hermitian: aten.linalg_ldl_solve(LD, pivots, B, hermitian=hermitian),
    (2, 1, 2))
_refused_derivative(ldl_solve_p, "linalg.ldl_solve")
aten_api.register(aten.linalg_ldl_solve.default)(
    lambda LD, pivots, B, *, hermitian=False: bind(ldl_solve_p, LD, pivots, B,
                                                    hermitian=hermitian))


def _geqrf_kernel(A):
    if A.device.type == "meta":  # no meta kernel in torch: a has A's shape, tau min(m, n)
        return torch.empty_like(A), A.new_empty(A.shape[:-2] + (min(A.shape[-2:]),))
    return aten.geqrf(A)


geqrf_a_p = _output_of("geqrf_a", _geqrf_kernel, 0, (2,))
geqrf_tau_p = _output_of("geqrf_tau", _geqrf_kernel, 1, (2,))
_refused_derivative(geqrf_a_p, "geqrf")
_refused_derivative(geqrf_tau_p, "geqrf")
aten_api.register(aten.geqrf.default)(lambda A: tuple(_bind_all((geqrf_a_p, geqrf_tau_p), A)))
