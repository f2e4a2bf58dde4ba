"""The operations, as functions: torch-like signatures in, normalized primitives out.

This is the layer that user code reaches (through ``torch_api``, which maps ``torch.sum``,
``Tensor.sum`` and ``F.softmax`` here) and that rules are written in. Each function checks and
normalizes its arguments (negative dims, ``dim=None``, ``-1`` in shapes) once, then calls
``bind``. Composite operations (``cross_entropy``, ``stack``, ``trace``, ...) are
written in terms of the others, so every transform handles them for free.

Arrays are positional; static parameters are keywords.
"""
import builtins
import math

import torch

from . import primitives as P
from .errors import (DimOutOfRangeError, InvalidOptionError, ShapeMismatchError,
                     TransformUsageError, UnsupportedOperationError)
from .values import Value, batched_by_vmap, bind

_builtin_sum = builtins.sum
_builtin_abs = builtins.abs


def shape_of(value) -> tuple:
    """The shape of a tensor or wrapped value as its own level sees it; () for numbers."""
    if isinstance(value, Value):  # (its kept metadata, without the property's call: rules
        return tuple(value.metadata()[0])  # ask for shapes on every op)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return ()


def _rank(value) -> int:
    return len(shape_of(value))


def result_dtype(*operands):
    """torch's type promotion of tensors (each by its rank as its level sees it: a 0-d tensor
    does not raise the dtype of one with dims) and Python numbers (which promote only across
    kinds: an int tensor with a float number is float)."""
    return promoted_dtype([(v.dtype, _rank(v)) if isinstance(v, (torch.Tensor, Value)) else v
                           for v in operands])


def promoted_dtype(operands):
    """The dtype torch promotes ``operands`` to: each a (dtype, rank) pair for a tensor, or a
    Python number. The ranks are given, so that a rule can pass the ranks of one example
    rather than of a batched payload (batching.promote_logically)."""
    tensors = [o for o in operands if isinstance(o, tuple)]
    if len(tensors) == len(operands) and len({dtype for dtype, _ in tensors}) == 1:
        return tensors[0][0]  # one dtype, nothing to promote (the common case)
    common = None
    for operand in operands:
        if isinstance(operand, tuple):
            dtype, rank = operand
            example = torch.empty((1,) * rank, dtype=dtype, device="meta")
        else:
            example = operand
        if common is None:
            common = example
            continue
        dtype = torch.result_type(common, example)
        rank = builtins.max(common.dim() if isinstance(common, torch.Tensor) else 0,
                            example.dim() if isinstance(example, torch.Tensor) else 0)
        common = torch.empty((1,) * rank, dtype=dtype, device="meta")
    return common.dtype if isinstance(common, torch.Tensor) else torch.result_type(
        torch.empty((), device="meta"), common)


def normalize_dim(dim: int, rank: int, *, op: str) -> int:
    """A dim in [-rank, rank) as a non-negative int (a 0-d tensor accepts 0 and -1)."""
    if type(dim) is int and 0 <= dim < rank:  # (the common case, first: views and reductions)
        return dim
    bound = builtins.max(rank, 1)
    if not -bound <= dim < bound:
        raise DimOutOfRangeError(
            f"{op}(..., dim={dim}): Dimension out of range (expected to be in range of "
            f"[{-bound}, {bound - 1}], but got {dim}): the tensor has {rank} dims. Fix: pass a "
            "dim that exists."
        )
    return dim % bound if rank else 0


def normalize_dims(dim, rank: int, *, op: str) -> tuple:
    """None -> all dims; an int or a sequence -> a sorted tuple of non-negative dims."""
    if dim is None:
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = (dim,)
    dims = [normalize_dim(d, rank, op=op) for d in dim]
    if rank == 0:
        return ()
    if len(set(dims)) < len(dims):
        repeated = next(d for d in dims if dims.count(d) > 1)
        raise InvalidOptionError(
            f"{op}(..., dim={tuple(dim)}): dim {repeated} appears multiple times in the list of "
            "dims (as in torch). Fix: name each dim once.")
    return tuple(sorted(dims))


def reduction_dims(dim, rank: int, *, op: str) -> tuple:
    """The dims a reduction (sum, mean, amax, amin) reduces: like ``normalize_dims``, except
    that an empty list means every dim, as in torch (``x.sum(dim=())`` is ``x.sum()``)."""
    if dim is not None and not isinstance(dim, int) and len(dim) == 0:
        dim = None
    return normalize_dims(dim, rank, op=op)


def keepdim_shape(shape, dim) -> tuple:
    """The shape a reduction over ``dim`` keeps with keepdim=True (reduced dims become 1)."""
    return tuple(1 if i in dim else size for i, size in enumerate(shape))


def power(x, exponent):
    """``x ** exponent`` for a Python number exponent, for rules: ``x ** 1`` is ``x`` itself,
    so derivative rules do not emit a no-op ``pow x 1``."""
    return x if exponent == 1 else pow(x, exponent)


def pow_base_derivative(x, y):
    """d(x ** y)/dx = y * x ** (y - 1) for a tensor exponent ``y``, and 0 where y == 0 (so
    that 0 ** 0 has derivative 0, not 0 * inf). PyTorch's pow_backward_self says the same."""
    return where(eq(y, 0), 0.0, mul(y, pow(x, sub(y, 1))))


def pow_exponent_derivative(x, y, out):
    """d(x ** y)/dy = x ** y * log(x), and 0 where x == 0 and y >= 0: there x ** y is 0 or 1
    and log(x) is -inf, and PyTorch's pow_backward_exponent takes the derivative to be 0. A
    number base gets its log here too (log 0 = -inf, log of a negative number = nan)."""
    if isinstance(x, (int, float)):
        log_x = math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)
        d = mul(out, log_x)
        return where(ge(y, 0), 0.0, d) if x == 0 else d
    d = mul(out, log(x))
    if isinstance(y, (torch.Tensor, Value)) and y.dtype.is_complex:  # y >= 0: a real y >= 0
        return where(eq(x, 0), where(eq(imag(y), 0), where(ge(real(y), 0), 0.0, d), d), d)
    return where(eq(x, 0), where(ge(y, 0), 0.0, d), d)


def _shape_arg(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    return tuple(map(int, shape))  # (map, not a generator: rules call this on every view)


# --- elementwise ---------------------------------------------------------------------------
def neg(x): return bind(P.neg_p, x)
def exp(x): return bind(P.exp_p, x)
def log(x): return bind(P.log_p, x)
def sin(x): return bind(P.sin_p, x)
def cos(x): return bind(P.cos_p, x)
def tanh(x): return bind(P.tanh_p, x)
def sigmoid(x): return bind(P.sigmoid_p, x)
def sqrt(x): return bind(P.sqrt_p, x)
def abs(x): return bind(P.abs_p, x)
def sign(x): return bind(P.sign_p, x)
def detach(x): return bind(P.detach_p, x)
def conj(x): return bind(P.conj_physical_p, x)
def real(x): return bind(P.real_p, x)
def imag(x): return bind(P.imag_p, x)
def sgn(x): return bind(P.sgn_p, x)
def angle(x): return bind(P.angle_p, x)
def complex(re, im): return bind(P.complex_p, re, im)
def view_as_real(x): return bind(P.view_as_real_p, x)
def view_as_complex(x): return bind(P.view_as_complex_p, x)


def relu(x):
    return bind(P.relu_p, x)


def add(x, y, *, alpha=1):
    return bind(P.add_p, x, y if alpha == 1 else mul(y, alpha))


def sub(x, y, *, alpha=1):
    return bind(P.sub_p, x, y if alpha == 1 else mul(y, alpha))


def mul(x, y): return bind(P.mul_p, x, y)


def div(x, y, *, rounding_mode=None):
    if rounding_mode is None:
        return bind(P.div_p, x, y)
    if rounding_mode not in ("floor", "trunc"):
        raise TransformUsageError(
            f"div(x, y, rounding_mode={rounding_mode!r}): expected rounding_mode None, "
            "'floor' or 'trunc'."
        )
    return bind(P.div_rounding_p, x, y, rounding_mode=rounding_mode)


def pow(x, y): return bind(P.pow_p, x, y)
def square(x): return bind(P.pow_p, x, 2)  # (torch.square is pow(x, 2): its bits and dtypes)
def eq(x, y): return bind(P.eq_p, x, y)
def ne(x, y): return bind(P.ne_p, x, y)
def lt(x, y): return bind(P.lt_p, x, y)
def le(x, y): return bind(P.le_p, x, y)
def gt(x, y): return bind(P.gt_p, x, y)
def ge(x, y): return bind(P.ge_p, x, y)
def where(condition, x, y): return bind(P.where_p, condition, x, y)


# --- reductions ----------------------------------------------------------------------------
def sum(x, dim=None, keepdim=False, *, dtype=None):
    out = bind(P.sum_p, x, dim=reduction_dims(dim, _rank(x), op="sum"), keepdim=keepdim)
    return out if dtype is None else convert(out, dtype)


def mean(x, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = convert(x, dtype)
    return bind(P.mean_p, x, dim=reduction_dims(dim, _rank(x), op="mean"), keepdim=keepdim)


def _refuse_empty_reduction(op, x, dim):
    """torch's max-like reductions of an empty tensor over every dim (no dim given): no
    identity to return. (Under vmap the dims are spelled out, and the kernel would then
    raise its IndexError of one empty dim instead.)"""
    if (dim is None or dim == () or dim == []) and math.prod(shape_of(x)) == 0:
        raise ShapeMismatchError(
            f"{op}(x): {op}(): Expected reduction dim to be specified for input.numel() == 0. "
            f"Specify the reduction dim with the 'dim' argument. (as in torch; shape "
            f"{shape_of(x)}). Fix: pass the dims to reduce.")


def amax(x, dim=(), keepdim=False):
    _refuse_empty_reduction("amax", x, dim)
    dims = reduction_dims(dim, _rank(x), op="amax")
    return bind(P.amax_p, x, dim=dims, keepdim=keepdim)


def amin(x, dim=(), keepdim=False):
    _refuse_empty_reduction("amin", x, dim)
    dims = reduction_dims(dim, _rank(x), op="amin")
    return bind(P.amin_p, x, dim=dims, keepdim=keepdim)


def all_true(mask, dim):
    """Whether every element of a boolean ``mask`` along ``dim`` is true (keeping ``dim``)."""
    dim = normalize_dim(dim, _rank(mask), op="all")
    count = sum(convert(mask, torch.int64), dim, keepdim=True)
    return eq(count, shape_of(mask)[dim] if shape_of(mask) else 1)


def logsumexp(x, dim, keepdim=False):
    return bind(P.logsumexp_p, x, dim=normalize_dims(dim, _rank(x), op="logsumexp"),
                keepdim=keepdim)


def softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise TransformUsageError("softmax(x): expected an explicit dim, got None. "
                                  "Fix: pass dim=-1 (or the dim to normalize over).")
    if dtype is not None:
        x = convert(x, dtype)
    return bind(P.softmax_p, x, dim=normalize_dim(dim, _rank(x), op="softmax"))


def log_softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise TransformUsageError("log_softmax(x): expected an explicit dim, got None. "
                                  "Fix: pass dim=-1 (or the dim to normalize over).")
    if dtype is not None:
        x = convert(x, dtype)
    return bind(P.log_softmax_p, x, dim=normalize_dim(dim, _rank(x), op="log_softmax"))


# --- linear algebra ------------------------------------------------------------------------
def matmul(x, y):
    if type(x) is torch.Tensor and type(y) is torch.Tensor:
        return torch.matmul(x, y)  # a rule's payloads (NOTE [Plain tensors skip the checks])
    if _rank(x) == 0 or _rank(y) == 0:
        raise TransformUsageError(
            f"matmul(x, y): both arguments need at least 1 dim, got shapes {shape_of(x)} and "
            f"{shape_of(y)}. Fix: use mul for scalars."
        )
    return bind(P.matmul_p, x, y)


def dot(x, y):
    if _rank(x) != 1 or _rank(y) != 1:
        raise ShapeMismatchError(
            f"dot(x, y): 1D tensors expected, but got {_rank(x)}D and {_rank(y)}D tensors "
            f"(shapes {shape_of(x)} and {shape_of(y)}), as torch says. Fix: use matmul."
        )
    if shape_of(x) != shape_of(y):
        raise ShapeMismatchError(
            f"dot(x, y): inconsistent tensor size, expected tensor {list(shape_of(x))} and src "
            f"{list(shape_of(y))} to have the same number of elements (as in torch). Fix: give "
            "two vectors of one length.")
    if x.dtype != y.dtype:
        raise InvalidOptionError(
            f"dot(x, y): dot : expected both vectors to have same dtype, but found {x.dtype} and "
            f"{y.dtype} (as in torch). Fix: convert one (y.to(x.dtype)).")
    return bind(P.matmul_p, x, y)


def _check_matrix_product(name, x, y, ranks):
    """mm, mv and bmm take fixed ranks (matmul is the one that broadcasts), with torch's own
    wording when the shapes do not fit."""
    x_shape, y_shape = shape_of(x), shape_of(y)
    if (len(x_shape), len(y_shape)) != ranks:
        raise ShapeMismatchError(
            f"{name}(x, y): Shape mismatch: Got incorrect dims for {name}(a, b). a has dim "
            f"{len(x_shape)} and b has dim {len(y_shape)}; {name} expects {ranks[0]} and "
            f"{ranks[1]}. Fix: use matmul, which takes any ranks."
        )
    inner = y_shape[-2] if len(y_shape) >= 2 else y_shape[-1]
    if name == "bmm" and (x_shape[0], x_shape[2]) != (y_shape[0], y_shape[1]):
        raise ShapeMismatchError(
            f"bmm(x, y): Expected size for first two dimensions of batch2 tensor to be: "
            f"[{x_shape[0]}, {x_shape[2]}] but got: [{y_shape[0]}, {y_shape[1]}]. Fix: make the "
            "batch sizes and the inner sizes agree."
        )
    if x_shape[-1] != inner:
        raise ShapeMismatchError(
            f"{name}(x, y): mat1 and mat2 shapes cannot be multiplied "
            f"({'x'.join(map(str, x_shape))} and {'x'.join(map(str, y_shape))}). Fix: make "
            "the inner sizes agree."
        )
    return bind(P.matmul_p, x, y)


def mm(x, y):
    return _check_matrix_product("mm", x, y, (2, 2))


def mv(x, y):
    return _check_matrix_product("mv", x, y, (2, 1))


def bmm(x, y):
    return _check_matrix_product("bmm", x, y, (3, 3))


# --- shape ---------------------------------------------------------------------------------
def permute(x, *dims):
    if type(x) is torch.Tensor:  # NOTE [Plain tensors skip the checks]
        return x.permute(_shape_arg(dims))
    dims = _shape_arg(dims)
    rank = _rank(x)
    if len(dims) != rank:
        raise TransformUsageError(
            f"permute(x, {dims}): expected {rank} dims for a tensor of shape {shape_of(x)}, "
            f"got {len(dims)}. Fix: name every dim once."
        )
    normalized = tuple(normalize_dim(d, rank, op="permute") for d in dims)
    if len(set(normalized)) != rank:
        raise InvalidOptionError(
            f"permute(x, {dims}): permute(): duplicate dims are not allowed (as in torch): "
            f"each of the {rank} dims must appear once. Fix: name every dim once.")
    if normalized == tuple(range(rank)):
        return x
    return bind(P.permute_p, x, dims=normalized)


def transpose(x, dim0, dim1):
    rank = _rank(x)
    if rank == 0:
        return x
    d0, d1 = normalize_dim(dim0, rank, op="transpose"), normalize_dim(dim1, rank, op="transpose")
    if type(x) is torch.Tensor:  # NOTE [Plain tensors skip the checks]
        return x.transpose(d0, d1)  # (a view, even of d0 == d1, as permute gave)
    if d0 == d1:
        return x
    dims = list(range(rank))  # (the dims are checked: permute_p directly, not permute)
    dims[d0], dims[d1] = d1, d0
    return bind(P.permute_p, x, dims=tuple(dims))


def t(x):
    rank = _rank(x)
    if rank > 2:
        raise ShapeMismatchError(
            f"t(x): t() expects a tensor with <= 2 dimensions, but self is {rank}D (as in "
            f"torch; shape {shape_of(x)}). Fix: use x.transpose(d0, d1) or x.mT.")
    return transpose(x, 0, 1) if rank == 2 else x


def _infer_shape(shape, numel, op, old_shape):
    requested, shape = list(shape), list(shape)
    if shape.count(-1) > 1:
        raise ShapeMismatchError(
            f"{op}(x, {tuple(shape)}): only one dimension can be inferred (as in torch: at most "
            "one -1). Fix: give every size but one.")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if not known:
            raise ShapeMismatchError(
                f"{op}(x, {tuple(shape)}): cannot reshape tensor of 0 elements into shape "
                f"{list(shape)} because the unspecified dimension size -1 can be any value and "
                "is ambiguous (as in torch). Fix: give every size.")
        shape[shape.index(-1)] = numel // known
    if math.prod(shape) != numel:
        raise ShapeMismatchError(
            f"{op}(x, {tuple(requested)}): shape '{list(requested)}' is invalid for input of "
            f"size {numel} (as in torch; the tensor has shape {old_shape}). Fix: keep the "
            "number of elements."
        )
    return tuple(shape)


# NOTE [Plain tensors skip the checks]
# The batching rules call reshape, permute, unsqueeze and expand on payloads, which are plain
# tensors at the bottom level. There no level records anything and torch checks the
# arguments itself, so these ops call torch's own method: the checks and bind here cost
# three times the view they make. A value of a level (what user code reaches through the
# transforms) always takes the checked path.
def reshape(x, *shape):
    if type(x) is torch.Tensor:
        return x.reshape(_shape_arg(shape))
    old = shape_of(x)
    new = _infer_shape(_shape_arg(shape), math.prod(old), "reshape", old)
    if new == old:
        return x
    return bind(P.reshape_p, x, shape=new)


view = reshape


def flatten(x, start_dim=0, end_dim=-1):
    old = shape_of(x)
    if not old:
        return reshape(x, 1)
    start = normalize_dim(start_dim, len(old), op="flatten")
    end = normalize_dim(end_dim, len(old), op="flatten")
    if start > end:
        raise ShapeMismatchError(
            f"flatten(x, {start_dim}, {end_dim}): flatten() has invalid args: start_dim cannot "
            f"come after end_dim (as in torch; the tensor has shape {old}). Fix: give "
            "start_dim <= end_dim.")
    return reshape(x, *old[:start], math.prod(old[start:end + 1]), *old[end + 1:])


def unsqueeze(x, dim):
    if type(x) is torch.Tensor:  # NOTE [Plain tensors skip the checks]
        return x.unsqueeze(dim)
    return bind(P.unsqueeze_p, x, dim=normalize_dim(dim, _rank(x) + 1, op="unsqueeze"))


def squeeze(x, dim=None):
    shape = shape_of(x)
    if dim is None:
        dims = tuple(i for i, s in enumerate(shape) if s == 1)
    else:
        dims = tuple(d for d in normalize_dims(dim, len(shape), op="squeeze") if shape[d] == 1)
    if not dims:
        return x
    return bind(P.squeeze_p, x, dim=dims)


def expand(x, *sizes):
    if type(x) is torch.Tensor:  # NOTE [Plain tensors skip the checks]
        return x.expand(_shape_arg(sizes))
    sizes = _shape_arg(sizes)
    old = shape_of(x)
    offset = len(sizes) - len(old)
    if offset < 0:
        raise ShapeMismatchError(
            f"expand(x, {sizes}): the number of sizes provided ({len(sizes)}) must be greater "
            f"or equal to the number of dimensions in the tensor ({len(old)}) (as in torch; the "
            f"tensor has shape {old}). Fix: give at least as many sizes as the tensor has "
            "dims."
        )
    new = tuple(old[i - offset] if s == -1 else s for i, s in enumerate(sizes))
    for i, size in enumerate(old):
        if size != 1 and size != new[i + offset]:
            raise ShapeMismatchError(
                f"expand(x, {sizes}): The expanded size of the tensor ({new[i + offset]}) must "
                f"match the existing size ({size}) at non-singleton dimension {i + offset}.  "
                f"Target sizes: {list(sizes)}.  Tensor sizes: {list(old)} (as in torch). Fix: "
                "only dims of size 1 can grow."
            )
    if new == old:
        return x
    return bind(P.expand_p, x, shape=new)


def broadcast_to(x, shape):
    return expand(x, *shape)


def broadcast_shapes(*shapes, op="broadcast_shapes"):
    """``torch.broadcast_shapes`` of shapes given as tuples of ints, in plain Python.

    torch's own goes through ``torch._refs`` (symbolic sizes, guards) and costs about 60 us a
    call on a CPU, more than the op it sits in front of (a loss, an index); this costs about
    one. Sizes of 1 stretch, equal sizes stay, anything else is a mismatch.
    """
    rank = builtins.max((len(shape) for shape in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        offset = rank - len(shape)
        for i, size in enumerate(shape):
            current = out[offset + i]
            if size == current or size == 1:
                continue
            if current != 1:
                raise ShapeMismatchError(
                    f"{op}: Shape mismatch: objects cannot be broadcast to a single shape. "
                    f"The shapes {[tuple(s) for s in shapes]} disagree at dim {offset + i - rank} "
                    f"(sizes {current} and {size}). Fix: make the sizes equal, or 1 where a "
                    "tensor is shared along that dim.")
            out[offset + i] = size
    return tuple(out)


def expand_as(x, other):
    return expand(x, *shape_of(other))


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise TransformUsageError("cat([], dim): expected at least one tensor, got none.")
    # torch's legacy rule: a 1-D tensor of size 0 is skipped among tensors of another rank
    kept = [t for t in tensors if shape_of(t) != (0,)]
    if kept and len(kept) < len(tensors) and any(_rank(t) != 1 for t in kept):
        tensors = kept
    rank = _rank(tensors[0])
    dim = normalize_dim(dim, rank, op="cat")
    if len(tensors) == 1:
        return tensors[0]
    return bind(P.cat_p, *tensors, dim=dim)


concat = concatenate = cat


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise TransformUsageError("stack([], dim): expected at least one tensor, got none.")
    dim = normalize_dim(dim, _rank(tensors[0]) + 1, op="stack")
    return cat([unsqueeze(t_, dim) for t_ in tensors], dim)


def _normalize_index(index, shape):
    """Basic indexing as a tuple of non-negative ints, canonical slices and None."""
    if not isinstance(index, tuple):
        index = (index,)
    for item in index:
        if isinstance(item, (torch.Tensor, Value, list)) or (
            not isinstance(item, (int, slice, type(None))) and item is not Ellipsis
        ):
            raise TransformUsageError(
                f"getitem(x, {item!r}): this op takes basic indices (integers, slices, None, "
                f"...), got {type(item).__name__}. Fix: index the tensor itself (x[index] "
                "handles tensor and mask indices too), or use torch.index_select."
            )
    consumed = _builtin_sum(1 for item in index if item is not None and item is not Ellipsis)
    if consumed > len(shape):
        raise TransformUsageError(
            f"x[{index!r}]: too many indices for a tensor of shape {tuple(shape)}."
        )
    if Ellipsis in index:
        position = index.index(Ellipsis)
        fill = (slice(None),) * (len(shape) - consumed)
        index = index[:position] + fill + index[position + 1:]
    normalized = []
    dim = 0
    for item in index:
        if item is None:
            normalized.append(None)
            continue
        size = shape[dim]
        if isinstance(item, int):
            if not -size <= item < size:
                raise DimOutOfRangeError(
                    f"x[{item}]: index {item} is out of bounds for dimension {dim} with size "
                    f"{size} (as in torch). Fix: index within the dim."
                )
            normalized.append(item % size)
        else:
            normalized.append(slice(*item.indices(size)))
        dim += 1
    return tuple(normalized)


def getitem(x, index):
    shape = shape_of(x)
    index = _normalize_index(index, shape)
    if all(item == slice(0, size, 1) for item, size in zip(index, shape)) and None not in index:
        return x  # x[()], x[...], x[:]
    return bind(P.getitem_p, x, index=index)


def diagonal(x, offset=0, dim1=0, dim2=1):
    rank = _rank(x)
    return bind(P.diagonal_p, x, offset=offset, dim1=normalize_dim(dim1, rank, op="diagonal"),
                dim2=normalize_dim(dim2, rank, op="diagonal"))


def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    rank = _rank(x) + 1
    return bind(P.diag_embed_p, x, offset=offset,
                dim1=normalize_dim(dim1, rank, op="diag_embed"),
                dim2=normalize_dim(dim2, rank, op="diag_embed"))


def diag(x, diagonal=0):
    rank = _rank(x)
    if rank == 1:
        return diag_embed(x, offset=diagonal, dim1=0, dim2=1)
    if rank == 2:  # a copy, as torch's (torch.diagonal is the view)
        return clone(bind(P.diagonal_p, x, offset=diagonal, dim1=0, dim2=1))
    raise ShapeMismatchError(
        f"diag(x): diag(): Supports 1D or 2D tensors. Got {rank}D (as in torch; shape "
        f"{shape_of(x)}). Fix: use torch.diagonal(x, dim1=..., dim2=...) for a batch of "
        "matrices.")


def trace(x):
    if _rank(x) != 2:
        raise ShapeMismatchError(
            f"trace(x): trace: expected a matrix, but got tensor with dim {_rank(x)} (as in "
            f"torch; shape {shape_of(x)}). Fix: use torch.diagonal(x, dim1=..., "
            "dim2=...).sum(-1) for a batch of matrices.")
    return sum(diagonal(x))


def gather(x, dim, index, *, sparse_grad=False):
    return bind(P.gather_p, x, index, dim=normalize_dim(dim, _rank(x), op="gather"))


def scatter(x, dim, index, src):
    """``torch.scatter(x, dim, index, src)``: x with src written at the places index names
    (the places must be distinct, as for torch's own scatter to be deterministic)."""
    dim = normalize_dim(dim, _rank(x), op="scatter")
    shape = shape_of(x)
    if not isinstance(src, (torch.Tensor, Value)):
        src = full_like(index, src, dtype=x.dtype)
    written = bind(P.scatter_add_p, full_like(src, 1), index, dim=dim, shape=shape)
    # (ne, not gt: a count of complex ones is complex, which gt does not take)
    return where(ne(written, 0), bind(P.scatter_add_p, src, index, dim=dim, shape=shape), x)


def setitem(x, index, value):
    """The value of ``x`` after ``x[index] = value`` (basic indexing)."""
    shape = shape_of(x)
    index = _normalize_index(index, shape)
    region = shape_of(getitem(torch.empty(shape, device="meta"), index))
    if not isinstance(value, (torch.Tensor, Value)):
        value = full_like(x, value)
        value = getitem(value, index)
    value = expand(convert(value, x.dtype), *region) if shape_of(value) != region else \
        convert(value, x.dtype)
    mask = torch.zeros(shape, dtype=torch.bool, device=x.device)
    mask[index] = True
    return where(mask, bind(P.scatter_index_p, value, index=index, shape=shape), x)


# --- creation and conversion ---------------------------------------------------------------
def full_like(x, fill_value, *, dtype=None, **ignored):
    if dtype is None or dtype == x.dtype:
        return bind(P.full_like_p, x, fill_value=fill_value)
    return bind(P.full_like_p, x, fill_value=fill_value, dtype=dtype)


def filled(x, value):
    """What ``x`` holds after ``x.fill_(value)``: a number everywhere, or a 0-dim tensor's
    value (a tensor value stays differentiable and, under vmap, may differ per example)."""
    if not isinstance(value, (torch.Tensor, Value)):
        return full_like(x, value)
    if shape_of(value):
        raise TransformUsageError(
            f"Tensor.fill_(value): fill_ only supports 0-dimension value tensor but got "
            f"tensor with {len(shape_of(value))} dimensions. Fix: pass a number or a 0-dim "
            "tensor (value.squeeze(), or value[i]).")
    return expand(convert(value, x.dtype), *shape_of(x))


def zeros_like(x, *, dtype=None, **ignored):
    return full_like(x, 0, dtype=dtype)


def ones_like(x, *, dtype=None, **ignored):
    return full_like(x, 1, dtype=dtype)


def convert(x, dtype):
    if x.dtype == dtype:
        return x
    return bind(P.convert_p, x, dtype=dtype)


def in_value_dtype(derivative, dtype):
    """A cotangent or tangent cast to the ``dtype`` of the value it is the derivative of
    (NOTE [A cotangent takes its value's dtype] in autograd.py, NOTE [A tangent takes its
    value's dtype] in forward.py): between floating dtypes, or real to complex; never complex
    to real, and a number or None stays as it is."""
    if isinstance(derivative, (torch.Tensor, Value)) and derivative.dtype != dtype and (
            (dtype.is_floating_point and derivative.dtype.is_floating_point)
            or dtype.is_complex):
        return convert(derivative, dtype)
    return derivative


def to(x, *args, dtype=None, device=None, **ignored):
    """``x.to(dtype)``, ``x.to(device)``, ``x.to(device, dtype)``, ``x.to(other)``."""
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device)) or (isinstance(arg, int) and
                                                       not isinstance(arg, bool)):
            device = arg
        elif isinstance(arg, (torch.Tensor, Value)):
            dtype, device = arg.dtype, arg.device
    if dtype is not None:
        x = convert(x, dtype)
    if device is not None and torch.device(device) != x.device:
        x = bind(P.to_device_p, x, device=torch.device(device))
    return x


# NOTE [Memory formats under vmap]
# A value has no memory of its own, and a FuncTensor shows contiguous strides; under grad
# and jvp, contiguous() and clone() in any memory format give the same numbers as torch, and
# only the strides differ. torch.func's vmap does not model memory formats either: for any
# format but the ordinary ones it raises, and so does this engine, in its words, rather than
# answer a layout question about examples whose layout it does not know.
def refuse_memory_format_under_vmap(call, x, memory_format, allowed):
    """Raise torch.func's error if ``x`` is batched by a vmap and ``memory_format`` (a format
    given to ``call``) is not among ``allowed``."""
    if memory_format in allowed or not batched_by_vmap(x):
        return
    if call == "Tensor.clone":
        words = ("NYI: Tensor.clone(memory_format) inside vmap is only supported with "
                 f"memory_format torch.preserve_format or torch.contiguous_format (got "
                 f"{memory_format})")
    else:
        words = ("NYI: querying is_contiguous inside of vmap for memory_format other than "
                 "torch.contiguous_format")
    raise UnsupportedOperationError(
        f"{call}(memory_format={memory_format}): {words}, as in torch.func: vmap does not "
        "model the memory layout of the examples. Fix: leave memory_format out inside vmap "
        "(or call it on the batched result outside).")


def clone(x, memory_format=None):
    refuse_memory_format_under_vmap("Tensor.clone", x, memory_format,
                                    (None, torch.preserve_format, torch.contiguous_format))
    return bind(P.clone_p, x)


def contiguous(x, memory_format=None):
    refuse_memory_format_under_vmap("Tensor.contiguous", x, memory_format,
                                    (None, torch.contiguous_format))
    return x  # a FuncTensor is always laid out contiguously


# --- torch.nn.functional -------------------------------------------------------------------
def _reduce(loss, reduction, op):
    if reduction == "mean":
        return mean(loss)
    if reduction == "sum":
        return sum(loss)
    if reduction == "none":
        return loss
    raise TransformUsageError(
        f"{op}(..., reduction={reduction!r}): expected 'mean', 'sum' or 'none'."
    )


def nll_loss(log_probs, target, weight=None, size_average=None, ignore_index=-100,
             reduce=None, reduction="mean"):
    if weight is not None:
        raise TransformUsageError("nll_loss(..., weight=...): class weights are not supported.")
    class_dim = 1 if _rank(log_probs) > 1 else 0
    kept = ne(target, ignore_index)  # ignored targets: no loss, no weight in the mean
    picked = gather(log_probs, class_dim, unsqueeze(where(kept, target, 0), class_dim))
    weights = convert(kept, log_probs.dtype)
    losses = mul(neg(squeeze(picked, class_dim)), weights)
    if reduction == "mean":
        return div(sum(losses), sum(weights))
    return _reduce(losses, reduction, "nll_loss")


def cross_entropy(logits, target, weight=None, size_average=None, ignore_index=-100,
                  reduce=None, reduction="mean", label_smoothing=0.0):
    """Cross-entropy from class indices (or from class probabilities of the logits' shape)."""
    if label_smoothing:
        raise TransformUsageError("cross_entropy(..., label_smoothing=...): not supported.")
    class_dim = 1 if _rank(logits) > 1 else 0
    log_probs = log_softmax(logits, class_dim)
    if target.dtype.is_floating_point:
        return _reduce(neg(sum(mul(target, log_probs), class_dim)), reduction, "cross_entropy")
    return nll_loss(log_probs, target, weight=weight, ignore_index=ignore_index,
                    reduction=reduction)


def mse_loss(x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    # torch >= 2.13 has a weight parameter and passes weight=None through __torch_function__
    if weight is not None:
        raise TransformUsageError("mse_loss(..., weight=...): element weights are not supported. "
                                  "Fix: compute (weight * (x - target) ** 2) and reduce it.")
    difference = sub(x, target)
    return _reduce(mul(difference, difference), reduction, "mse_loss")


# NOTE [Arithmetic on values]
# Rules compute with values, and ``ops.mul(ct, ops.cos(x))`` is how the engine's own rules
# are written. A rule written by hand (the course's exercises) may read as math instead:
# ``ct * x`` on values means ``ops.mul(ct, x)``. The operators live here, beside the ops
# they call, rather than in values.py, which sits below ops. Comparisons are left out on
# purpose: ``a == b`` must stay a Python comparison in the engine's own code.
def _reflected(op):
    return lambda x, y: op(y, x)


Value.__add__, Value.__radd__ = add, _reflected(add)
Value.__sub__, Value.__rsub__ = sub, _reflected(sub)
Value.__mul__, Value.__rmul__ = mul, _reflected(mul)
Value.__truediv__, Value.__rtruediv__ = div, _reflected(div)
Value.__pow__, Value.__rpow__ = pow, _reflected(pow)
Value.__matmul__, Value.__rmatmul__ = matmul, _reflected(matmul)
Value.__neg__ = neg
