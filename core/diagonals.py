"""A Jacobian's identity basis, computed with by its diagonal under vmap.

NOTE [An identity basis is a diagonal matrix, eagerly]
jacfwd pushes the rows of an identity matrix forward and jacrev pulls them back, each row an
example of a vmap; so the first ops of either see the identity I as a value batched at dim 0
whose payload is the (n, n) matrix itself. Two kinds of op keep such a matrix diagonal, and
on a diagonal one they need only its diagonal d:
- an elementwise op p with p(0, y) == 0 (``passes.keeps_diagonal``: mul, tanh_backward,
  threshold_backward, ...) of diag(d) and an unbatched y that varies along the example's one
  dim is diag(p(d, y)): n values computed, where the dense op computes n^2;
- a matmul of diag(d) with an unbatched matrix W (the examples' rows times W, or W times the
  examples' columns) is d[:, None] * W (or d[:, None] * W^T): n k products, where the dense
  product takes n^2 k. For a wide jacfwd or a tall jacrev that product is most of the work.
The results are the dense computation's: each entry of a product is one product plus exact
zeros, and an elementwise op is the same formula on the same numbers (its kernel may round
the last bit differently where it vectorizes differently, as any change of layout may). The
shortcut is taken only where that holds: the operands' dtypes and devices alike, no inf or
NaN in the other operand (0 * inf is NaN in the dense computation), and a diagonal matrix
that nothing wrote into since the engine made it (its version counter). It is taken on a
CPU only: the check for inf and NaN is a sum the host reads, which on an accelerator would
make the host wait for the device at every op, and the dense kernels there were never
measured against the shortcut (jit's pass reads nothing and runs anywhere). A diagonal matrix
made here is a dense tensor like any other, kept with its diagonal: every other op sees it as
what it is. jit's programs take the same shortcut as a pass over the program (NOTE [An
identity basis is a diagonal matrix] in passes.py); torch.func computes the dense products.
"""
import math

import torch

from . import passes

_DIAGONAL = "_minifunctorch_diagonal"  # the attribute of a made matrix: (d, its version)
# Below this many rows the dense kernels take less time than the shortcut's checks and calls
# (about 20 us a Jacobian on the 2-core CPU of benchmarks/RESULTS.md: at n = 64 the shortcut
# made S3's Jacobians 20% slower, at n = 256 it is even, at 2048 four times faster).
MIN_ROWS = 256


def known_diagonal(t):
    """The diagonal d of a plain (n, n) tensor ``t`` that the engine made as diag(d) (an
    identity basis, or a result of this module) and nothing has written into; else None."""
    if (type(t) is not torch.Tensor or t.dim() != 2 or t.shape[0] != t.shape[1]
            or t.shape[0] < MIN_ROWS or t.device.type != "cpu"):
        return None
    kept = getattr(t, _DIAGONAL, None)
    if kept is not None:
        d, version = kept
        return d if t._version == version else None
    if passes._is_identity_basis(t) and t._version == 0:
        return torch.ones(t.shape[0], dtype=t.dtype, device=t.device)
    return None


def diagonal_matrix(d):
    """diag(d), a dense (n, n) tensor kept with its diagonal (``known_diagonal``)."""
    matrix = torch.diag(d)
    setattr(matrix, _DIAGONAL, (d, matrix._version))
    return matrix


def _finite_like(y, t):
    """Whether ``y`` (a number or a plain tensor) is finite and computes with ``t`` as the
    dense op would: a tensor of t's dtype and device."""
    if isinstance(y, bool) or not isinstance(y, (int, float, torch.Tensor)):
        return False
    if isinstance(y, (int, float)):
        return math.isfinite(y)
    # (a finite sum has finite terms; a sum that overflows only turns the shortcut down)
    return (type(y) is torch.Tensor and y.dtype == t.dtype and y.device == t.device
            and math.isfinite(y.sum()))


def elementwise_of_diagonal(prim, x, y, params):
    """``prim(x, y)`` for an op in ``passes.keeps_diagonal``, x the payload of a value
    batched at dim 0 and y unbatched, as diag(prim(d, y)) where x is diag(d) and y varies
    along the example's dim only; None where the shortcut does not apply."""
    d = known_diagonal(x)
    if d is None or (isinstance(y, torch.Tensor)
                     and (y.dim() > 1 or y.numel() not in (1, d.numel()))):
        return None
    if not _finite_like(y, x):
        return None
    return diagonal_matrix(prim.impl(d, y, **params))


def rows_times(x, w):
    """``x @ w`` for x the (n, n) payload of the examples (rows) of a value batched at dim 0
    and w an unbatched (n, k) matrix, as d[:, None] * w where x is diag(d); else None."""
    d = known_diagonal(x)
    if d is None or type(w) is not torch.Tensor or w.dim() != 2 or w.shape[0] != d.numel():
        return None
    if not _finite_like(w, x):
        return None
    return d[:, None] * w


def times_columns(w, x):
    """The examples' ``w @ x_b`` for x the (n, n) payload of the examples (vectors) of a
    value batched at dim 0 and w an unbatched (m, n) matrix, batched at dim 0: (n, m), as
    d[:, None] * w^T where x is diag(d); else None."""
    d = known_diagonal(x)
    if d is None or type(w) is not torch.Tensor or w.dim() != 2 or w.shape[1] != d.numel():
        return None
    if not _finite_like(w, x):
        return None
    return (d[:, None] * w.t()).contiguous()  # (the layout, and so the bits, of a matmul)
