"""Indexing with tensors: advanced indexing, index_put, the scatter family, masked ops, take
and put, as_strided, and the index producers (searchsorted, bucketize, histc, nonzero).

NOTE [A few primitives, many ops]
Every op of this family is written over a handful of primitives, each with its three rules:
- ``index`` (``x[i0, :, i1]``, aten's ``index.Tensor``) and its transpose ``index_put``
  (with ``accumulate``): advanced indexing, ``index_select``, ``take``, ``put``,
  ``index_add``, ``index_copy``, ``index_fill``, ``masked_select``, ``masked_scatter``,
  ``as_strided``, ``embedding``, ``embedding_bag``;
- ``gather`` (course primitive) and the new ``scatter`` and ``scatter_reduce``:
  ``take_along_dim``, ``scatter_add``, ``index_reduce``, ``scatter(..., reduce=)``;
- small non-differentiable helpers (``searchsorted``, ``histc``, ``mask_order``) and two
  identities whose only job is to shape a derivative (``scale_grad`` for embedding's
  backward, ``double_backward_guard`` for scatter_reduce's).
Each op is reachable through both doors: the torch functions (torch_api) and the aten ops
torch lowers to (aten_api). PyTorch does the same: ``index_select``, ``take`` and
``embedding`` decompose to ``index`` in torch._decomp, and derivatives.yaml writes the
backward of each op with ``index_put_``/``scatter``/``gather``.

NOTE [Index tensors are data, not arguments to differentiate]
Integer index tensors and boolean masks are positional arguments (vmap batches them like any
tensor), but they never carry a derivative: every vjp rule returns None for them and every
jvp rule ignores their tangents. A boolean mask is turned into integer indices with
``nonzero`` before it reaches a primitive, so the primitives only ever see integer indices.
That conversion needs the mask's values: under vmap a batched mask would give a different
number of indices per example, and is refused (as torch.func refuses it).
"""
import math

import torch
import torch.nn.functional as F

from . import aten_api, ops, torch_api
from . import primitives as P
from .autograd import refuse_write_to_recorded, sum_to_size, vjp_rules, wants_cotangent
from .batching import (BatchedValue, batch_size, batched_level, batching_rules, move_bdim,
                       same_shape_batch, to_front)
from .elementwise import logical_and
from .dispatch import complex_ready
from . import errors
from .errors import (DimOutOfRangeError, InputDtypeError, InvalidOptionError, MissingRuleError,
                     ShapeMismatchError, TransformUsageError, UnsupportedOperationError)
from .forward import add_tangents, jvp_rules, linear_jvp
from .tensor import call_with_tensors, runner, unwrap
from .tracing import data_shape_error, trace_call_of
from .values import Value, bind, bottom_tensor, top_dispatcher

aten = torch.ops.aten


# --- helpers -------------------------------------------------------------------------------------
def _is_tensor(x):
    return isinstance(x, (torch.Tensor, Value))


def _rank(x):
    return len(ops.shape_of(x))


def _logical_shape(value, bdim):
    """The shape of one example of a payload batched at ``bdim`` (None: unbatched)."""
    shape = ops.shape_of(value)
    return shape if bdim is None else shape[:bdim] + shape[bdim + 1:]


def _constant(value, like, dtype=None):
    """A plain tensor (a constant for every level) with ``like``'s device."""
    return torch.tensor(value, dtype=dtype or like.dtype, device=like.device)


def _refuse_shapes_from_data(what, *values):
    """NOTE [Shapes that depend on the data]
    ``nonzero``, ``unique``, ``x[mask]`` and ``masked_select`` return as many elements as
    the data says. Under vmap every example may want another count, and a batched tensor
    has one shape, so they are refused when the data they count is batched (torch.func
    raises too). The same op on a batched tensor but an unbatched mask is fine: the count
    is the same for every example. A traced value has no data at all, and a program records
    one shape per value (make_fx raises on them too, without symbolic shapes): refused while
    tracing, in words that say so rather than the trace's general "concrete value" ones."""
    _refuse_traced(what, *values)
    for value in values:
        level = batched_level(value)
        if level is not None:
            raise UnsupportedOperationError(
                f"{level.call}: vmap: We do not support batching operators that can output "
                f"dynamic shape. Attempted to vmap over {what}: on a tensor batched by vmap, "
                "its output shape depends on the values of each example, and vmap needs one "
                "shape for the whole batch (torch.func refuses it too). Fix: move it outside "
                "of vmap, or use a fixed-shape formulation (torch.where(mask, x, 0) instead of "
                "x[mask])."
            )


def _refuse_traced(what, *values):
    """The trace's part of NOTE [Shapes that depend on the data]."""
    call = trace_call_of(*values)
    if call is not None:
        raise data_shape_error(call, what)


def _adjacent(dims):
    return dims == tuple(range(dims[0], dims[0] + len(dims)))


def _indexed_shape(x_shape, index_shapes, dims):
    """The shape of ``x[...]`` with index tensors of ``index_shapes`` at ``dims`` (torch's
    rule: adjacent index tensors put their broadcast shape in place, separated ones put it
    in front)."""
    broadcast = ops.broadcast_shapes(*index_shapes, op="indexing with tensors")
    if _adjacent(dims):
        return tuple(x_shape[:dims[0]]) + broadcast + tuple(x_shape[dims[-1] + 1:])
    return broadcast + tuple(s for d, s in enumerate(x_shape) if d not in dims)


def _entries(indices, dims):
    entries = [None] * (dims[-1] + 1)
    for d, index in zip(dims, indices):
        entries[d] = index
    return entries


# --- the primitives of advanced indexing ---------------------------------------------------------
# index: x[..] with integer index tensors at `dims` (a sorted tuple), full slices elsewhere.
index_p = P.primitive(
    "index", lambda x, *indices, dims: aten.index.Tensor(x, _entries(indices, dims)))
# index_put: x with `values` written (accumulate=False) or added (True) at x[indices].
index_put_p = P.primitive(
    "index_put", lambda x, values, *indices, dims, accumulate: aten.index_put.default(
        x, _entries(indices, dims), values, accumulate))


def index_vjp(x, *indices, dims):
    """derivatives.yaml: ``index``'s backward is ``zeros.index_put_(indices, grad, True)``:
    an element read twice receives both cotangents."""
    shape = ops.shape_of(x)
    out = bind(index_p, x, *indices, dims=dims)

    def backward(ct):
        zeros = torch.zeros(shape, dtype=ct.dtype, device=ct.device)
        return ((bind(index_put_p, zeros, ct, *indices, dims=dims, accumulate=True),)
                + (None,) * len(indices))
    return out, backward
vjp_rules[index_p] = index_vjp


def index_jvp(primals, tangents, *, dims):
    x, *indices = primals
    return bind(index_p, x, *indices, dims=dims), bind(index_p, tangents[0], *indices, dims=dims)
jvp_rules[index_p] = index_jvp


def index_put_vjp(x, values, *indices, dims, accumulate):
    """derivatives.yaml: ``self: accumulate ? grad : grad.index_put(indices, 0)`` and
    ``values: grad[indices]`` summed to the values' shape. With accumulate=False and a place
    written twice, torch keeps one write but gives every duplicate the cotangent of that
    place; so does this rule."""
    values_shape = ops.shape_of(values)
    out = bind(index_put_p, x, values, *indices, dims=dims, accumulate=accumulate)

    def backward(ct):
        x_bar = values_bar = None
        if wants_cotangent(0, x):
            x_bar = ct if accumulate else bind(index_put_p, ct, _constant(0, ct), *indices,
                                               dims=dims, accumulate=False)
        if wants_cotangent(1, values):
            values_bar = sum_to_size(bind(index_p, ct, *indices, dims=dims), values_shape)
        return (x_bar, values_bar) + (None,) * len(indices)
    return out, backward
vjp_rules[index_put_p] = index_put_vjp


def index_put_jvp(primals, tangents, *, dims, accumulate):
    """Linear in (x, values) together: the tangents go through the same index_put."""
    x, values, *indices = primals
    x_dot, values_dot = tangents[0], tangents[1]
    out = bind(index_put_p, x, values, *indices, dims=dims, accumulate=accumulate)
    if values_dot is None and accumulate:
        return out, x_dot
    x_dot = ops.zeros_like(x) if x_dot is None else x_dot
    values_dot = _constant(0, x) if values_dot is None else values_dot
    return out, bind(index_put_p, x_dot, values_dot, *indices, dims=dims, accumulate=accumulate)
jvp_rules[index_put_p] = index_put_jvp


def _batched_indices(indices, bdims, rank):
    """Batched index tensors with their batch dim in front and size-1 dims after it, so that
    they broadcast against each other as their examples do (a shorter example is padded on
    the left); unbatched ones are left as they are (they broadcast from the right)."""
    out = []
    for index, bdim in zip(indices, bdims):
        if bdim is None:
            out.append(index)
            continue
        index = move_bdim(index, bdim, 0)
        shape = ops.shape_of(index)
        out.append(ops.reshape(index, shape[0], *([1] * (rank + 1 - len(shape))), *shape[1:]))
    return out


def _batched_layout(x, x_bdim, indices, index_bdims, dims, size):
    """NOTE [A batched advanced index is one index call]
    Under vmap, ``x[i]`` for every example is one call on the payloads:
    - only x is batched: the batch dim is one more sliced dim (in front), the index tensors
      are unchanged and point at dims shifted by one;
    - some index tensor is batched: the batch becomes one more *advanced* index, an
      ``arange(B)`` (shaped ``B, 1, ..., 1``) at x's batch dim, and each batched index tensor
      gets its batch dim in front, so that the index tensors broadcast to ``(B, *shape)`` and
      example b reads ``x[b, i[b]]``. An unbatched x needs no arange: the batched indices
      alone make the result batched.
    Where the batch dim lands follows torch's rule for the result: adjacent index tensors
    (``x[:, i, j]``) put their broadcast dims in place, separated ones (``x[i, :, j]``) put them
    in front. The batch dim is placed at the first indexed dim in the first case, at 0 in
    the second, so the result is batched there without a permute. (functorch's
    ``index.Tensor`` batching rule builds the same arange.)

    Returns (x, indices, dims) for the batched call, the batch dim of its result, and the
    batch dim of x in the call (that of index_put's result)."""
    rank = max(len(_logical_shape(i, b)) for i, b in zip(indices, index_bdims))
    if all(b is None for b in index_bdims):
        x = move_bdim(x, x_bdim, 0)
        return (x, list(indices), tuple(d + 1 for d in dims),
                0 if _adjacent(dims) else rank, 0)
    position = dims[0] if _adjacent(dims) else 0
    indices = _batched_indices(indices, index_bdims, rank)
    if x_bdim is None:
        return x, indices, dims, position, None
    x = move_bdim(x, x_bdim, position)
    arange = torch.arange(size, device=x.device).reshape(size, *([1] * rank))
    return x, [arange] + indices, (position,) + tuple(d + 1 for d in dims), position, position


def index_batch(values, bdims, *, dims):
    x, *indices = values
    x, indices, dims, out_bdim, _ = _batched_layout(x, bdims[0], indices, bdims[1:], dims,
                                                    batch_size(values, bdims))
    return bind(index_p, x, *indices, dims=dims), out_bdim
batching_rules[index_p] = index_batch


# NOTE [index_select and index_add: torch's kernels for one index along one dim]
# x.index_select(dim, i) is x[:, ..., i] with one 1-d index, and index_p computes it with
# aten's advanced-indexing kernel, and its backward with index_put(accumulate=True): at
# (64, 1024) rows those took 3 and 4.7 times what torch's index_select and index_add take
# (index_select's rows are copies of memory; index_add is torch.func's backward of
# index_select, derivatives.yaml's index_select_backward). So the two are primitives of
# their own, each the other's transpose: the vjp of index_select is index_add into zeros,
# and that of index_add is index_select of the cotangent (and the cotangent itself for x).
# They take indices already checked to lie in [0, size) (NOTE [Indices out of range are
# read, not wrapped]): their kernels read no negative index from the end. Under vmap an
# index shared by the examples stays one kernel call along the shifted dim; a batched index
# is advanced indexing (index_batch, index_put_batch), where each example reads its own.
index_select_p = P.primitive(
    "index_select", lambda x, index, *, dim: torch.index_select(x, dim, index))
index_add_p = P.primitive(
    "index_add", lambda x, source, index, *, dim: torch.index_add(x, dim, index, source))


def index_select_vjp(x, index, *, dim):
    shape = ops.shape_of(x)

    def backward(ct):
        zeros = torch.zeros(shape, dtype=ct.dtype, device=ct.device)
        if type(ct) is torch.Tensor:  # (what the primitive computes, without copying the zeros)
            return zeros.index_add_(dim, index, ct), None
        return bind(index_add_p, zeros, ct, index, dim=dim), None
    return bind(index_select_p, x, index, dim=dim), backward
vjp_rules[index_select_p] = index_select_vjp


def index_select_jvp(primals, tangents, *, dim):
    (x, index), x_dot = primals, tangents[0]
    return bind(index_select_p, x, index, dim=dim), bind(index_select_p, x_dot, index, dim=dim)
jvp_rules[index_select_p] = index_select_jvp


def index_select_batch(values, bdims, *, dim):
    (x, index), (x_bdim, index_bdim) = values, bdims
    if index_bdim is not None:
        return index_batch(values, bdims, dims=(dim,))
    return bind(index_select_p, move_bdim(x, x_bdim, 0), index, dim=dim + 1), 0
batching_rules[index_select_p] = index_select_batch


def index_add_vjp(x, source, index, *, dim):
    def backward(ct):
        return (ct if wants_cotangent(0, x) else None,
                bind(index_select_p, ct, index, dim=dim) if wants_cotangent(1, source) else None,
                None)
    return bind(index_add_p, x, source, index, dim=dim), backward
vjp_rules[index_add_p] = index_add_vjp


def index_add_jvp(primals, tangents, *, dim):
    """Linear in (x, source) together."""
    (x, source, index), (x_dot, source_dot, _) = primals, tangents
    out = bind(index_add_p, x, source, index, dim=dim)
    if source_dot is None:
        return out, x_dot
    x_dot = ops.zeros_like(x) if x_dot is None else x_dot
    return out, bind(index_add_p, x_dot, source_dot, index, dim=dim)
jvp_rules[index_add_p] = index_add_jvp


def index_add_batch(values, bdims, *, dim):
    (x, source, index), (x_bdim, source_bdim, index_bdim) = values, bdims
    if index_bdim is not None:
        return index_put_batch(values, bdims, dims=(dim,), accumulate=True)
    x, source = to_front((x, source), (x_bdim, source_bdim), expand_unbatched=True)
    return bind(index_add_p, x, source, index, dim=dim + 1), 0
batching_rules[index_add_p] = index_add_batch


def _align_values(values, bdim, region, out_bdim):
    """The values of a batched index_put, laid out to broadcast against the batched region
    (the region's logical shape with the batch dim inserted at ``out_bdim``)."""
    rank = len(region)
    if bdim is None:
        shape = ops.shape_of(values)
        if len(shape) <= rank - out_bdim:
            return values  # every dim of values sits right of the batch dim already
        values = ops.reshape(values, *([1] * (rank - len(shape))), *shape)
        return ops.unsqueeze(values, out_bdim)
    values = move_bdim(values, bdim, 0)
    shape = ops.shape_of(values)
    values = ops.reshape(values, shape[0], *([1] * (rank + 1 - len(shape))), *shape[1:])
    return move_bdim(values, 0, out_bdim)


def index_put_batch(values, bdims, *, dims, accumulate):
    x, v, *indices = values
    x_bdim, v_bdim, index_bdims = bdims[0], bdims[1], bdims[2:]
    size = batch_size(values, bdims)
    region = _indexed_shape(_logical_shape(x, x_bdim),
                            [_logical_shape(i, b) for i, b in zip(indices, index_bdims)], dims)
    if x_bdim is None:  # every example starts from the same x
        x = ops.expand(ops.unsqueeze(x, 0), size, *ops.shape_of(x))
        x_bdim = 0
    x, indices, dims, region_bdim, x_bdim = _batched_layout(x, x_bdim, indices, index_bdims,
                                                            dims, size)
    v = _align_values(v, v_bdim, region, region_bdim)
    return bind(index_put_p, x, v, *indices, dims=dims, accumulate=accumulate), x_bdim
batching_rules[index_put_p] = index_put_batch


# --- from torch's index lists to the primitives --------------------------------------------------
def _mask_indices(mask, what):
    """The integer indices of a boolean mask's True elements, one tensor per mask dim."""
    _refuse_shapes_from_data(what, mask)
    if isinstance(mask, Value):
        mask = mask.concrete()
    return mask.nonzero().unbind(1)


def _long(index):
    if index.dtype == torch.int64:
        return index
    if isinstance(index, Value):
        return ops.convert(index, torch.int64)
    return index.long()


def _normalize_entries(x, entries, op):
    """aten's index list (a tensor or None per leading dim) as (index tensors, dims): masks
    become the integer indices of their True elements, other indices become int64."""
    shape = ops.shape_of(x)
    tensors, dims, dim = [], [], 0
    for entry in entries:
        if entry is None:
            dim += 1
            continue
        if entry.dtype in (torch.bool, torch.uint8):
            mask_shape = ops.shape_of(entry)
            if not mask_shape or mask_shape != tuple(shape[dim:dim + len(mask_shape)]):
                raise TransformUsageError(
                    f"{op}: the boolean mask of shape {mask_shape} at dim {dim} does not match "
                    f"the indexed tensor's shape {tuple(shape)} there. Fix: give a mask with the "
                    "shape of the dims it selects from."
                )
            for offset, index in enumerate(_mask_indices(entry, f"{op} with a boolean mask")):
                tensors.append(index)
                dims.append(dim + offset)
            dim += len(mask_shape)
            continue
        if entry.dtype.is_floating_point or entry.dtype.is_complex:
            raise TransformUsageError(
                f"{op}: tensors used as indices must be integer or boolean, got {entry.dtype}. "
                "Fix: convert the index with .long()."
            )
        tensors.append(_long(entry))
        dims.append(dim)
        dim += 1
    if dim > len(shape):
        raise TransformUsageError(
            f"{op}: too many indices for a tensor of shape {tuple(shape)}. Fix: index at most "
            f"{len(shape)} dims."
        )
    return tensors, tuple(dims)


@aten_api.register(aten.index.Tensor, aten._unsafe_index.Tensor)
def advanced_index(x, indices):
    """``aten.index.Tensor(x, [i0, None, i1])``: advanced indexing."""
    tensors, dims = _normalize_entries(x, indices, "index(x, indices)")
    if not tensors:
        return x
    return bind(index_p, x, *tensors, dims=dims)


def _values_for(x, values, region, op):
    """Values to write into ``x``: its dtype, and a shape that broadcasts to ``region``."""
    if not _is_tensor(values):
        return _constant(values, x)
    values = ops.convert(values, x.dtype)
    shape = ops.shape_of(values)
    try:
        fits = ops.broadcast_shapes(shape, region) == tuple(region)
    except RuntimeError:
        fits = False
    if not fits:
        raise TransformUsageError(
            f"{op}: values of shape {shape} cannot be broadcast to the indexed shape {region}. "
            "Fix: give values of the indexed shape (or one that broadcasts to it)."
        )
    return values


def _index_put(x, tensors, dims, values, accumulate, op):
    if not tensors:  # no index tensor: the whole of x
        values = _values_for(x, values, ops.shape_of(x), op)
        return ops.add(x, values) if accumulate else ops.expand(values, *ops.shape_of(x))
    region = _indexed_shape(ops.shape_of(x), [ops.shape_of(t) for t in tensors], dims)
    values = _values_for(x, values, region, op)
    return bind(index_put_p, x, values, *tensors, dims=dims, accumulate=accumulate)


@torch_api.register(torch.index_put, torch.Tensor.index_put)
@aten_api.register(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate=False):
    tensors, dims = _normalize_entries(x, indices, "index_put(x, indices, values)")
    return _index_put(x, tensors, dims, values, accumulate, "index_put(x, indices, values)")


torch_api.register_in_place(torch.Tensor.index_put_)(index_put)
aten_api.register(aten._index_put_impl.default)(
    lambda x, indices, values, accumulate=False, unsafe=False: index_put(x, indices, values,
                                                                         accumulate))


# --- the front door: x[index] and x[index] = value -----------------------------------------------
def _is_basic(item):
    return item is Ellipsis or item is None or (
        isinstance(item, (int, slice)) and not isinstance(item, bool))


def _sequence_as_tuple(index):
    """torch's (and NumPy's old) rule: a short list holding a tensor, a sequence, a slice,
    None or ... is read as a tuple of indices (``x[[0, slice(None)]]``); otherwise a list is
    one index tensor (``x[[0, 2]]``)."""
    if len(index) >= 32:
        return False
    return any(_is_tensor(item) or isinstance(item, (list, tuple, slice)) or item is None
               or item is Ellipsis for item in index)


def _list_index(items, device, op):
    items = [unwrap(i) for i in items]
    if any(isinstance(i, Value) for i in _flatten(items)):
        raise TransformUsageError(
            f"{op}: a list holding tensors of a transform cannot be used as an index. Fix: "
            "stack them into one tensor (torch.stack) and index with it."
        )
    return torch.tensor(items, device=device)


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _split_index(x, index, op):
    """``x[index]`` as ``index(getitem(x, basic), entries)``: the ints, slices, None and ...
    of ``index`` (a basic index, which ``ops.getitem`` handles and programs print as such),
    and a list of tensor indices (or None) per dim of the basic result. torch's Python
    indexing does the same: it applies the basic items first as views, and collects the
    tensors for one ``index`` call."""
    shape = ops.shape_of(x)
    if isinstance(index, list) and _sequence_as_tuple(index):
        index = tuple(index)
    if not isinstance(index, tuple):
        index = (index,)
    items = []
    for item in index:
        item = unwrap(item)
        if isinstance(item, list):
            item = _list_index(item, x.device, op)
        if isinstance(item, torch.Tensor) and item.dim() == 0 and not item.dtype.is_floating_point \
                and item.dtype not in (torch.bool, torch.uint8):
            item = int(item)  # a plain 0-d integer tensor selects, as in torch
        items.append(item)
    consumed = 0
    for item in items:
        if isinstance(item, bool) or item is None or item is Ellipsis:
            continue
        if _is_tensor(item) and item.dtype in (torch.bool, torch.uint8):
            consumed += _rank(item)
        else:
            consumed += 1
    if consumed > len(shape):
        raise TransformUsageError(
            f"{op}: too many indices for a tensor of shape {tuple(shape)}. Fix: index at most "
            f"{len(shape)} dims."
        )
    # entries follow aten's convention: one per dim of the basic result, except that a k-d
    # mask is one entry for its k dims
    basic, entries = [], []
    for item in items:
        if item is Ellipsis:
            fill = len(shape) - consumed
            basic.extend([slice(None)] * fill)
            entries.extend([None] * fill)
            consumed = len(shape)  # a second ... adds nothing (torch refuses it anyway)
        elif isinstance(item, bool):  # x[True] adds a dim of size 1, x[False] one of size 0
            basic.append(None)
            entries.append(None if item else torch.zeros(0, dtype=torch.int64, device=x.device))
        elif _is_basic(item):
            basic.append(item)
            if not isinstance(item, int):
                entries.append(None)
        elif _is_tensor(item):
            if item.dtype in (torch.bool, torch.uint8) and _rank(item) == 0:
                basic.append(None)  # a 0-d mask: a new dim, selected by a 1-element mask
                entries.append(ops.reshape(item, 1))
            elif item.dtype in (torch.bool, torch.uint8):
                basic.extend([slice(None)] * _rank(item))
                entries.append(item)
            else:
                basic.append(slice(None))
                entries.append(item)
        else:
            raise TransformUsageError(
                f"{op}: cannot index with an object of type {type(item).__name__}. Fix: index "
                "with ints, slices, None, ..., lists or tensors."
            )
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(basic), entries


def _all_basic(index):
    if isinstance(index, tuple):
        return all(_is_basic(i) for i in index)
    return _is_basic(index)


@torch_api.register(torch.Tensor.__getitem__)
def getitem(x, index):
    """``x[index]``: basic indexing goes to ``ops.getitem`` (a view), tensors to ``index``."""
    if _all_basic(index):
        return ops.getitem(x, index)
    basic, entries = _split_index(x, index, "x[index]")
    return advanced_index(ops.getitem(x, basic), entries)


@torch_api.register_in_place(torch.Tensor.__setitem__)
def setitem(x, index, value):
    """The new value of ``x`` after ``x[index] = value``. With tensors in the index, the basic
    part selects a region (a view in torch), and the tensors write into it with
    ``index_put``; the region is then written back with ``ops.setitem``."""
    if _all_basic(index):
        return ops.setitem(x, index, value)
    op = "x[index] = value"
    basic, entries = _split_index(x, index, op)
    region = ops.getitem(x, basic)
    tensors, dims = _normalize_entries(region, entries, op)
    if _is_tensor(value):
        # torch drops leading size-1 dims of the value that the indexed shape does not have
        shape = ops.shape_of(value)
        target = (_indexed_shape(ops.shape_of(region), [ops.shape_of(t) for t in tensors], dims)
                  if tensors else ops.shape_of(region))
        lead = 0
        while len(shape) - lead > len(target) and shape[lead] == 1:
            lead += 1
        if lead:
            value = ops.reshape(value, *shape[lead:])
    written = _index_put(region, tensors, dims, value, False, op)
    return written if region is x else ops.setitem(x, basic, written)


# --- gather, under vmap --------------------------------------------------------------------------
def _along_dim_batch(prim, values, bdims, dim, out_rank, target_rank=None, **params):
    """NOTE [gather and scatter under vmap]
    gather, scatter and scatter_reduce pair each element of ``index`` with one of ``x`` (and
    ``src``) at the same position in every dim but ``dim``. Under vmap every operand gets
    the batch dim in front (unbatched ones are expanded, which is a view), and ``dim`` moves
    by one: one call serves every example. torch reads a 0-d tensor as a 1-d one of size 1
    in these ops (``gather(x_1d, 0, index_0d)`` is allowed), which a batch dim in front would
    break: such operands get that size-1 dim explicitly, and the result loses it again.
    (gather_batch and scatter_add_batch in batching.py do the same for the course's two.)"""
    ranks = [len(_logical_shape(v, b)) if _is_tensor(v) else None for v, b in zip(values, bdims)]
    moved = to_front(values, bdims, expand_unbatched=True)
    lift = any(r == 0 for r in ranks) or target_rank == 0
    if lift:
        moved = [ops.unsqueeze(v, 1) if r == 0 else v for v, r in zip(moved, ranks)]
        dim = 0
    out = bind(prim, *moved, dim=dim + 1, **params)
    if lift and out_rank == 0:
        out = ops.squeeze(out, 1)
    return out, 0


# --- scatter and scatter_reduce ------------------------------------------------------------------
def _scatter_impl(x, index, src, *, dim):
    return torch.scatter(x, dim, index, src)


def _scatter_reduce_impl(x, index, src, *, dim, reduce, include_self):
    return torch.scatter_reduce(x, dim, index, src, reduce, include_self=include_self)


# scatter: x with src (a tensor, or a number) written at the places index names along dim
scatter_p = P.primitive("scatter", _scatter_impl)
# scatter_reduce: x with src combined into it (sum, prod, mean, amax, amin)
scatter_reduce_p = P.primitive("scatter_reduce", _scatter_reduce_impl)


def _crop(value, shape):
    """The leading ``shape`` block of ``value`` (a src larger than its index is read there)."""
    if ops.shape_of(value) == tuple(shape):
        return value
    return ops.getitem(value, tuple(slice(0, n, 1) for n in shape))


def _pad(value, shape):
    """``value`` in the leading block of zeros of ``shape`` (the transpose of ``_crop``)."""
    if ops.shape_of(value) == tuple(shape):
        return value
    block = tuple(slice(0, n, 1) for n in ops.shape_of(value))
    return bind(P.scatter_index_p, value, index=block, shape=tuple(shape))


def scatter_vjp(x, index, src, *, dim):
    """derivatives.yaml: ``self: grad.scatter(dim, index, 0)``, ``src: grad.gather(dim,
    index)``. (A src larger than the index gets zeros outside it; torch raises there.)"""
    out = bind(scatter_p, x, index, src, dim=dim)

    def backward(ct):
        x_bar = bind(scatter_p, ct, index, 0.0, dim=dim) if wants_cotangent(0, x) else None
        src_bar = None
        if wants_cotangent(2, src):
            src_bar = _pad(bind(P.gather_p, ct, index, dim=dim), ops.shape_of(src))
        return x_bar, None, src_bar
    return out, backward
vjp_rules[scatter_p] = scatter_vjp


def scatter_jvp(primals, tangents, *, dim):
    (x, index, src), (x_dot, _, src_dot) = primals, tangents
    out = bind(scatter_p, x, index, src, dim=dim)
    x_dot = ops.zeros_like(x) if x_dot is None else x_dot
    return out, bind(scatter_p, x_dot, index, 0.0 if src_dot is None else src_dot, dim=dim)
jvp_rules[scatter_p] = scatter_jvp
# linear in the indexed values: checked on complex numbers (NOTE [Complex numbers])
complex_ready(index_p, index_put_p, scatter_p, index_select_p, index_add_p)


def scatter_batch(values, bdims, *, dim):
    return _along_dim_batch(scatter_p, values, bdims, dim, len(_logical_shape(values[0], bdims[0])))
batching_rules[scatter_p] = scatter_batch


def scatter_reduce_batch(values, bdims, *, dim, reduce, include_self):
    return _along_dim_batch(scatter_reduce_p, values, bdims, dim,
                            len(_logical_shape(values[0], bdims[0])), reduce=reduce,
                            include_self=include_self)
batching_rules[scatter_reduce_p] = scatter_reduce_batch


# guard: the identity, whose derivatives refuse to exist where `flag` is True
def _guard_impl(x, flag, *, message, check):
    if check and bool(flag.any()):
        raise UnsupportedOperationError(message)
    return x.view_as(x)


guard_p = P.primitive("double_backward_guard", _guard_impl)


def guard_vjp(x, flag, *, message, check):
    out = bind(guard_p, x, flag, message=message, check=check)
    return out, lambda ct: (bind(guard_p, ct, flag, message=message, check=True), None)
vjp_rules[guard_p] = guard_vjp


def guard_jvp(primals, tangents, *, message, check):
    (x, flag), (x_dot, _) = primals, tangents
    out = bind(guard_p, x, flag, message=message, check=check)
    return out, bind(guard_p, x_dot, flag, message=message, check=True)
jvp_rules[guard_p] = guard_jvp


batching_rules[guard_p] = same_shape_batch(guard_p)


def _scatter_reduce_partials(x, index, src, out, dim, reduce, include_self):
    """The partial derivatives of scatter_reduce's output with respect to each element of x
    (x-shaped) and of src (index-shaped): FunctionsManual's ``scatter_reduce_backward``,
    written as weights so that the vjp (``ct * d_x``, ``gather(ct) * d_src``) and the jvp
    (``x_dot * d_x + scatter_add(src_dot * d_src)``) are transposes of each other.

    NOTE [scatter_reduce's derivatives]
    - sum: 1 and 1.   mean: 1/N for both, N the number of values averaged at each place.
    - amax, amin: the winners share the derivative evenly: 1/N for each x or src that equals
      the result, N their number (as torch's amax does).
    - prod: the product of the other factors. derivatives.yaml computes it without dividing
      by a zero: x's partial is ``prod(x masked to 1 where 0, src) / masked x``; a src
      element that is the only zero at its place gets the product of the others (a second
      scatter_reduce with that zero replaced by 1), any other gets ``result / src``. With two
      or more zeros at one place every partial is 0, which is right, but the derivative of
      that 0 is not: torch refuses the double backward there, and so does
      ``double_backward_guard`` here (an identity whose derivatives raise where flagged).
    (torch.func's forward mode returns 0 for prod, and not_implemented for index_reduce; the
    jvp here is the transpose of the vjp.)"""
    x_shape, dtype = ops.shape_of(x), x.dtype

    def gather(t):
        return bind(P.gather_p, t, index, dim=dim)

    def scatter_add(t):
        return bind(P.scatter_add_p, t, index, dim=dim, shape=x_shape)

    if reduce == "sum":
        return None, None  # both partials are 1
    if reduce == "mean":
        counts = scatter_add(ops.full_like(index, 1.0, dtype=dtype))
        if include_self:
            counts = ops.add(counts, 1.0)
        inverse = ops.div(1.0, ops.where(ops.eq(counts, 0), 1.0, counts))
        return inverse, gather(inverse)
    if reduce in ("amax", "amin"):
        x_wins = ops.convert(ops.eq(x, out), dtype)
        src_wins = ops.convert(ops.eq(src, gather(out)), dtype)
        share = ops.div(1.0, ops.add(x_wins, scatter_add(src_wins)))
        return ops.mul(x_wins, share), ops.mul(src_wins, gather(share))
    assert reduce == "prod", f"unknown reduction {reduce!r}"
    masked_x = ops.where(ops.eq(x, 0), 1.0, x)
    masked_x_result = bind(scatter_reduce_p, masked_x, index, src, dim=dim, reduce="prod",
                           include_self=include_self)
    d_x = ops.div(masked_x_result, masked_x)
    src_zero = ops.eq(src, 0)
    zeros_here = gather(scatter_add(ops.convert(src_zero, dtype)))
    single_zero = logical_and(src_zero, ops.eq(zeros_here, 1))
    masked_src_result = bind(scatter_reduce_p, x, index, ops.where(single_zero, 1.0, src),
                             dim=dim, reduce="prod", include_self=include_self)
    d_src = ops.where(single_zero, gather(masked_src_result),
                      ops.div(gather(out), ops.where(src_zero, 1.0, src)))
    d_src = bind(guard_p, d_src, ops.gt(zeros_here, 1), check=False, message=(
        "scatter_reduce(..., reduce='prod'): the second derivative with respect to src is not "
        "defined here when two or more zeros of src are reduced into the same place (torch "
        "refuses this double backward too). Fix: avoid exact zeros in src, or differentiate "
        "once."))
    return d_x, d_src


# NOTE [scatter_reduce on complex numbers]
# scatter_add is scatter_reduce's sum: one primitive serves the five reductions (and
# index_reduce). It is marked complex-ready, and its rules refuse the reductions they do not
# cover: a primitive of its own for the sum would repeat the three rules for no gain. sum
# and mean are linear with real weights (1 and 1/N): the rules above hold as written (a real
# weight is its own adjoint), checked against torch.func's scatter_add
# (tests/test_complex_tail.py). amax and amin have no meaning on complex numbers (torch's
# kernels refuse them), and prod, holomorphic, would need conj in its vjp and is not
# checked: they raise. torch differentiates scatter_add on complex tensors and refuses every
# scatter_reduce there; the mean comes along here for free. On real tensors the cost is one
# tuple lookup per rule call.
_COMPLEX_REDUCTIONS = ("sum", "mean")


def _refuse_complex_reduction(x, reduce):
    if reduce not in _COMPLEX_REDUCTIONS and x.dtype.is_complex:
        raise UnsupportedOperationError(
            f"scatter_reduce(..., reduce={reduce!r}): derivatives of complex tensors are "
            f"supported for reduce='sum' and 'mean' only (torch has none for {reduce!r} "
            "either). Fix: differentiate real and imaginary parts separately "
            "(torch.view_as_real), or use a real tensor."
        )


def scatter_reduce_vjp(x, index, src, *, dim, reduce, include_self):
    _refuse_complex_reduction(x, reduce)
    out = bind(scatter_reduce_p, x, index, src, dim=dim, reduce=reduce, include_self=include_self)
    src_shape, index_shape = ops.shape_of(src), ops.shape_of(index)

    def backward(ct):
        used_src = _crop(src, index_shape)
        d_x, d_src = _scatter_reduce_partials(x, index, used_src, out, dim, reduce, include_self)
        x_bar = src_bar = None
        if wants_cotangent(0, x):
            x_bar = ct if d_x is None else ops.mul(ct, d_x)
            if not include_self:  # the places src writes to forget x
                x_bar = bind(scatter_p, x_bar, index, 0.0, dim=dim)
        if wants_cotangent(2, src):
            src_bar = bind(P.gather_p, ct, index, dim=dim)
            src_bar = _pad(src_bar if d_src is None else ops.mul(src_bar, d_src), src_shape)
        return x_bar, None, src_bar
    return out, backward
vjp_rules[scatter_reduce_p] = scatter_reduce_vjp


def scatter_reduce_jvp(primals, tangents, *, dim, reduce, include_self):
    (x, index, src), (x_dot, _, src_dot) = primals, tangents
    _refuse_complex_reduction(x, reduce)
    out = bind(scatter_reduce_p, x, index, src, dim=dim, reduce=reduce, include_self=include_self)
    used_src = _crop(src, ops.shape_of(index))
    d_x, d_src = _scatter_reduce_partials(x, index, used_src, out, dim, reduce, include_self)
    out_dot = None
    if x_dot is not None:
        out_dot = x_dot if d_x is None else ops.mul(x_dot, d_x)
        if not include_self:
            out_dot = bind(scatter_p, out_dot, index, 0.0, dim=dim)
    if src_dot is not None:
        src_dot = _crop(src_dot, ops.shape_of(index))
        src_dot = src_dot if d_src is None else ops.mul(src_dot, d_src)
        out_dot = add_tangents(out_dot, bind(P.scatter_add_p, src_dot, index, dim=dim,
                                             shape=ops.shape_of(x)))
    return out, out_dot
jvp_rules[scatter_reduce_p] = scatter_reduce_jvp
complex_ready(scatter_reduce_p)  # sum and mean: NOTE [scatter_reduce on complex numbers]


_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _same_dtype(x, src, op, words):
    """torch's scatter, index_add/index_copy and masked_scatter take a source of the tensor's
    own dtype (converting one would round it, or drop an imaginary part): ``words`` are
    torch's for the op."""
    if src.dtype != x.dtype:
        raise InvalidOptionError(
            f"{op}: {words} (the tensor is {x.dtype}, the source {src.dtype}). Fix: convert "
            f"the source (src.to({x.dtype})), or the tensor.")
    return src


def _same_dtype_as_scatter(x, src, op):
    return _same_dtype(x, src, op, "scatter(): Expected self.dtype to be equal to src.dtype")


def _scatter_args(x, dim, index, op):
    if max(_rank(index), 1) != max(_rank(x), 1):  # torch reads 0-d as 1-d here
        raise ShapeMismatchError(
            f"{op}: Index tensor must have the same number of dimensions as self tensor (as in "
            f"torch; shapes {ops.shape_of(index)} and {ops.shape_of(x)}). Fix: give an index of "
            "the tensor's rank."
        )
    return ops.normalize_dim(dim, _rank(x), op=op), _long(index)


def _src_for(x, index, src, op):
    if _is_tensor(src):
        return _same_dtype_as_scatter(x, src, op)
    return ops.full_like(index, src, dtype=x.dtype)


@torch_api.register(*torch_api.torch_functions("scatter"))
@aten_api.register(aten.scatter.src, aten.scatter.value, aten.scatter.reduce,
                   aten.scatter.value_reduce)
def scatter(x, dim, index, src=None, *, value=None, reduce=None):
    """``x.scatter(dim, index, src)``, with ``src`` a tensor or a number, and the deprecated
    ``reduce='add' | 'multiply'`` (a scatter_reduce that includes x).

    NOTE [scatter with reduce=]
    torch has no derivative for ``scatter(..., reduce=)`` (it raises); its values are those
    of ``scatter_reduce(..., 'sum' | 'prod', include_self=True)``, so it is written as that,
    and gets that op's derivatives."""
    src = value if src is None else src
    op = "scatter(x, dim, index, src)"
    dim, index = _scatter_args(x, dim, index, op)
    if reduce is not None:
        names = {"add": "sum", "multiply": "prod"}
        if reduce not in names:
            raise TransformUsageError(
                f"scatter(..., reduce={reduce!r}): expected 'add' or 'multiply'. Fix: use "
                "scatter_reduce for the other reductions."
            )
        return bind(scatter_reduce_p, x, index, _src_for(x, index, src, op), dim=dim,
                    reduce=names[reduce], include_self=True)
    if _is_tensor(src):
        src = _same_dtype_as_scatter(x, src, op)
    return bind(scatter_p, x, index, src, dim=dim)


@torch_api.register(*torch_api.torch_functions("scatter_add"))
@aten_api.register(aten.scatter_add.default)
def scatter_add(x, dim, index, src):
    op = "scatter_add(x, dim, index, src)"
    dim, index = _scatter_args(x, dim, index, op)
    return bind(scatter_reduce_p, x, index, _src_for(x, index, src, op), dim=dim, reduce="sum",
                include_self=True)


@torch_api.register(*torch_api.torch_functions("scatter_reduce"))
@aten_api.register(aten.scatter_reduce.two)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if reduce not in _REDUCTIONS:
        raise TransformUsageError(
            f"scatter_reduce(..., reduce={reduce!r}): expected one of {_REDUCTIONS}."
        )
    op = "scatter_reduce(x, dim, index, src, reduce)"
    dim, index = _scatter_args(x, dim, index, op)
    return bind(scatter_reduce_p, x, index, _src_for(x, index, src, op), dim=dim, reduce=reduce,
                include_self=include_self)


torch_api.register_in_place(torch.Tensor.scatter_)(scatter)
torch_api.register_in_place(torch.Tensor.scatter_add_)(scatter_add)
torch_api.register_in_place(torch.Tensor.scatter_reduce_)(scatter_reduce)


@torch_api.register(*torch_api.torch_functions("take_along_dim"))
@aten_api.register(aten.take_along_dim.default)
def take_along_dim(x, indices, dim=None):
    """``gather`` after broadcasting x and indices in every dim but ``dim`` (torch's rule)."""
    if dim is None:  # x and indices flattened
        return take(x, ops.reshape(indices, -1))
    rank = _rank(x)
    if _rank(indices) != rank:
        raise TransformUsageError(
            f"take_along_dim(x, indices, dim={dim}): x and indices must have the same number of "
            f"dims, got shapes {ops.shape_of(x)} and {ops.shape_of(indices)}."
        )
    dim = ops.normalize_dim(dim, rank, op="take_along_dim")
    x_shape, i_shape = list(ops.shape_of(x)), list(ops.shape_of(indices))
    common = list(ops.broadcast_shapes(x_shape[:dim] + [1] + x_shape[dim + 1:],
                                       i_shape[:dim] + [1] + i_shape[dim + 1:],
                                       op="take_along_dim"))
    x = ops.expand(x, *(common[:dim] + [x_shape[dim]] + common[dim + 1:]))
    indices = ops.expand(_long(indices), *(common[:dim] + [i_shape[dim]] + common[dim + 1:]))
    # unlike gather, take_along_dim counts negative indices from the end
    indices = ops.where(ops.lt(indices, 0), ops.add(indices, x_shape[dim]), indices)
    return ops.gather(x, dim, indices)


# --- index_select, take, put and the index_* family ----------------------------------------------
def _index_vector(index, op):
    if _rank(index) > 1:
        raise TransformUsageError(
            f"{op}: index must be 0-d or 1-d, got shape {ops.shape_of(index)}. Fix: flatten it."
        )
    return ops.reshape(_long(index), -1)


@torch_api.register(*torch_api.torch_functions("index_select"))
@aten_api.register(aten.index_select.default)
def index_select(x, dim, index):
    op = "index_select(x, dim, index)"
    index = _index_vector(index, op)
    if _rank(x) == 0:
        index = _refuse_out_of_range(op, index, 1, DimOutOfRangeError,
                                     "index out of range in self")
        return ops.reshape(bind(index_p, ops.reshape(x, 1), index, dims=(0,)))
    dim = ops.normalize_dim(dim, _rank(x), op="index_select")
    index = _refuse_out_of_range(op, index, ops.shape_of(x)[dim], DimOutOfRangeError,
                                 "index out of range in self")
    # NOTE [index_select and index_add: torch's kernels for one index along one dim]
    return bind(index_select_p, x, index, dim=dim)


@torch_api.register(*torch_api.torch_functions("take"))
@aten_api.register(aten.take.default)
def take(x, index):
    """``x.flatten()[index]``: the result has the index's shape."""
    return bind(index_p, ops.reshape(x, -1), _long(index), dims=(0,))


@torch_api.register(*torch_api.torch_functions("put"))
@aten_api.register(aten.put.default)
def put(x, index, source, accumulate=False):
    """x with ``source`` written (or added) at the flat positions ``index``."""
    if math.prod(ops.shape_of(index)) != math.prod(ops.shape_of(source)):
        raise TransformUsageError(
            f"put(x, index, source): index and source need the same number of elements, got "
            f"{math.prod(ops.shape_of(index))} and {math.prod(ops.shape_of(source))}."
        )
    flat = bind(index_put_p, ops.reshape(x, -1), ops.reshape(ops.convert(source, x.dtype), -1),
                ops.reshape(_long(index), -1), dims=(0,), accumulate=accumulate)
    return ops.reshape(flat, *ops.shape_of(x))


torch_api.register_in_place(torch.Tensor.put_)(put)


def _along(x, dim, index, op):
    dim = ops.normalize_dim(dim, _rank(x), op=op)
    return dim, _index_vector(index, f"{op}(x, dim, index, ...)")


def _check_source(x, dim, index, source, op):
    """torch's checks of index_add/index_copy: the source has the tensor's dtype, one slice
    per index along ``dim``, and the tensor's shape in every other dim."""
    _same_dtype(x, source, f"{op}(x, dim, index, source)",
                f"{op}_(): self and source expected to have the same dtype")
    shape, source_shape = list(ops.shape_of(x)), list(ops.shape_of(source))
    count = math.prod(ops.shape_of(index))
    if count != (source_shape[dim] if source_shape else 1):
        raise ShapeMismatchError(
            f"{op}(x, dim={dim}, index, source): Number of indices ({count}) should be equal "
            f"to source.size(dim) (source shape {tuple(source_shape)}). Fix: one index per "
            "slice of the source.")
    if source_shape:  # (a 0-d source fills one place of a 0-d or 1-d tensor)
        del shape[dim], source_shape[dim]
        if shape != source_shape:
            raise ShapeMismatchError(
                f"{op}(x, dim={dim}, index, source): source tensor shape must match self "
                f"tensor shape, excluding the specified dimension. Got self.shape = "
                f"{list(ops.shape_of(x))} source.shape = {list(ops.shape_of(source))}. Fix: "
                "give the source the tensor's sizes in the other dims.")


@torch_api.register(*torch_api.torch_functions("index_add"))
@aten_api.register(aten.index_add.default)
def index_add(x, dim, index, source, *, alpha=1):
    if _rank(x) == 0:  # torch reads 0-d tensors as 1-d ones of size 1 here
        return ops.reshape(index_add(ops.reshape(x, 1), 0, index, ops.reshape(source, -1),
                                     alpha=alpha))
    dim, index = _along(x, dim, index, "index_add")
    _check_source(x, dim, index, source, "index_add")
    size = ops.shape_of(x)[dim]
    index = _refuse_out_of_range(
        "index_add(x, dim, index, source)", index, size, InvalidOptionError,
        f"index {{value}} is out of bounds for dimension {dim} with size {size}")
    if alpha != 1:
        source = ops.mul(source, alpha)
    if _rank(source) != _rank(x):  # (a 0-d source for one place of a 1-d tensor)
        return bind(index_put_p, x, source, index, dims=(dim,), accumulate=True)
    # NOTE [index_select and index_add: torch's kernels for one index along one dim]
    return bind(index_add_p, x, source, index, dim=dim)


@torch_api.register(*torch_api.torch_functions("index_copy"))
@aten_api.register(aten.index_copy.default)
def index_copy(x, dim, index, source):
    if _rank(x) == 0:
        return ops.reshape(index_copy(ops.reshape(x, 1), 0, index, ops.reshape(source, -1)))
    dim, index = _along(x, dim, index, "index_copy")
    _check_source(x, dim, index, source, "index_copy")
    size = ops.shape_of(x)[dim]
    index = _refuse_out_of_range(
        "index_copy(x, dim, index, source)", index, size, DimOutOfRangeError,
        f"index_copy_(): index {{value}} is out of bounds for dimension {dim} with size {size}")
    return bind(index_put_p, x, source, index, dims=(dim,), accumulate=False)


def _written(x, dims, indices):
    """A boolean mask of x's shape, True at the places ``index_put`` at ``indices`` writes."""
    mask = torch.zeros(ops.shape_of(x), dtype=torch.bool, device=x.device)
    return bind(index_put_p, mask, torch.ones((), dtype=torch.bool, device=x.device), *indices,
                dims=dims,
                accumulate=False)


def _fill_value(x, value, op):
    value_is_complex = value.dtype.is_complex if _is_tensor(value) else \
        isinstance(value, complex)
    if value_is_complex and not x.dtype.is_complex:
        raise InvalidOptionError(
            f"{op}: value cannot be converted to type {x.dtype} without overflow: it is "
            "complex and the tensor is not (as in torch). Fix: fill a complex tensor, or pass "
            "value.real.")
    if not _is_tensor(value):
        return _constant(value, x)
    if _rank(value) != 0:
        raise ShapeMismatchError(
            f"{op}: masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
            f"with {_rank(value)} dimension(s). (as in torch; shape {ops.shape_of(value)}). "
            "Fix: pass a number or a single element."
        )
    return ops.convert(value, x.dtype)


@torch_api.register(*torch_api.torch_functions("index_fill"))
@aten_api.register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    """NOTE [index_fill is a where]
    derivatives.yaml gives a tensor ``value`` the sum of the cotangents at the filled places,
    each place once however often the index names it (it takes ``unique(index)``). A where
    over the mask of filled places has exactly that derivative, and needs no unique (which
    vmap could not batch)."""
    if _rank(x) == 0:
        return ops.reshape(index_fill(ops.reshape(x, 1), 0, index, value))
    dim, index = _along(x, dim, index, "index_fill")
    return ops.where(_written(x, (dim,), [index]), _fill_value(x, value, "index_fill"), x)


torch_api.register_in_place(torch.Tensor.index_fill_)(index_fill)
torch_api.register_in_place(torch.Tensor.index_add_)(index_add)
torch_api.register_in_place(torch.Tensor.index_copy_)(index_copy)


@torch_api.register(*torch_api.torch_functions("index_reduce"))
@aten_api.register(aten.index_reduce.default)
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """``index_reduce`` is ``scatter_reduce`` with the index repeated along every other dim:
    ``x[.., index[j], ..] (op)= source[.., j, ..]``."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise TransformUsageError(
            f"index_reduce(..., reduce={reduce!r}): expected 'prod', 'mean', 'amax' or 'amin'."
        )
    dim, index = _along(x, dim, index, "index_reduce")
    _check_source(x, dim, index, source, "index_reduce")
    size = ops.shape_of(x)[dim] if _rank(x) else 1  # (a 0-d tensor is read as 1-d here)
    index = _refuse_out_of_range("index_reduce(x, dim, index, source)", index, size,
                                 DimOutOfRangeError, "index out of range in self")
    shape = ops.shape_of(source)
    if _rank(x) == 0:
        return ops.reshape(index_reduce(ops.reshape(x, 1), 0, index, ops.reshape(source, -1),
                                        reduce, include_self=include_self))
    along = ops.reshape(index, *[-1 if d == dim else 1 for d in range(len(shape))])
    return bind(scatter_reduce_p, x, ops.expand(along, *shape), source, dim=dim, reduce=reduce,
                include_self=include_self)


torch_api.register_in_place(torch.Tensor.index_reduce_)(index_reduce)


# --- masks ---------------------------------------------------------------------------------------
def _mask_order_impl(mask, *, batch_dims):
    """For each element, how many True elements precede it (row-major) in its example."""
    shape = mask.shape
    flat = mask.reshape(*shape[:batch_dims], -1).to(torch.int64)
    return (flat.cumsum(-1) - flat).reshape(shape)


mask_order_p = P.primitive("mask_order", _mask_order_impl, differentiable=False)


def mask_order_batch(values, bdims, *, batch_dims):
    (mask,), (bdim,) = values, bdims
    return bind(mask_order_p, move_bdim(mask, bdim, 0), batch_dims=batch_dims + 1), 0
batching_rules[mask_order_p] = mask_order_batch


def _bool_mask(mask, op):
    if mask.dtype != torch.bool:
        raise InvalidOptionError(
            f"{op}: only supports boolean masks, but got mask with dtype {mask.dtype} (torch "
            "refuses uint8 masks too). Fix: pass mask.bool().")
    return mask


def _broadcast_with_mask(x, mask, op):
    """x and its boolean mask, broadcast to their common shape."""
    mask = _bool_mask(mask, op)
    shape = ops.broadcast_shapes(ops.shape_of(x), ops.shape_of(mask), op=op)
    x = ops.expand(x, *shape) if ops.shape_of(x) != shape else x
    return x, (ops.expand(mask, *shape) if ops.shape_of(mask) != shape else mask)


@torch_api.register(*torch_api.torch_functions("masked_fill"))
@aten_api.register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    """A where (x and mask broadcast together, as torch's out-of-place masked_fill does;
    ``masked_fill_`` refuses a result larger than x when it is written back)."""
    op = "masked_fill(x, mask, value)"
    return ops.where(_bool_mask(mask, op), _fill_value(x, value, op), x)


torch_api.register_in_place(torch.Tensor.masked_fill_)(masked_fill)


@torch_api.register(*torch_api.torch_functions("masked_scatter"))
@aten_api.register(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    """NOTE [masked_scatter as a read]
    ``x.masked_scatter(mask, source)`` fills the True places, in row-major order, with the
    leading elements of ``source``. The k-th True place reads ``source.flatten()[k]``, and k
    is the number of True places before it (``mask_order``, a cumulative sum), so the op is
    ``where(mask, take(source, order), x)``: a read, whose derivatives are index's (the
    cotangents of the unused source elements are zero, as in torch's
    ``masked_scatter_backward``). Under vmap the order is computed per example."""
    op = "masked_scatter(x, mask, source)"
    _same_dtype(x, source, op, "masked_scatter: expected self and source to have same dtypes")
    x, mask = _broadcast_with_mask(x, mask, op)
    if math.prod(ops.shape_of(source)) == 0:
        _check_no_true(mask, op)
        return x
    order = ops.where(mask, bind(mask_order_p, mask, batch_dims=0), 0)
    return ops.where(mask, take(source, order), x)


def _check_no_true(mask, op):
    if isinstance(mask, torch.Tensor) and bool(mask.any()):
        raise TransformUsageError(f"{op}: source has no elements for the True places of mask.")


torch_api.register_in_place(torch.Tensor.masked_scatter_)(masked_scatter)


@torch_api.register(*torch_api.torch_functions("masked_select"))
@aten_api.register(aten.masked_select.default)
def masked_select(x, mask):
    """``x[mask]`` after broadcasting the two: a 1-d tensor as long as the mask has True
    elements (NOTE [Shapes that depend on the data])."""
    x, mask = _broadcast_with_mask(x, mask, "masked_select(x, mask)")
    if not ops.shape_of(x):
        x, mask = ops.reshape(x, 1), ops.reshape(mask, 1)
    return advanced_index(x, [mask])


# --- as_strided: a read of chosen elements -------------------------------------------------------
def _strided_positions(x, size, stride, storage_offset, op):
    """NOTE [as_strided on a tensor without storage]
    A FuncTensor's elements are laid out contiguously, so ``as_strided(x, size, stride,
    offset)`` picks the elements whose flat positions are ``as_strided`` applied to
    ``arange(x.numel())``: the positions are computed on a plain tensor, and the op is a
    ``take`` at them (its scatter a ``put``). torch's decompositions of ``unfold`` and
    ``group_norm`` produce such calls. Sizes, strides and offsets are read in x's own layout,
    the one ``x.stride()`` and ``x.storage_offset()`` report inside a transform; positions
    outside x (which torch would read from the storage of a larger tensor that x is a view
    of) are refused, and so is a user's call where torch would read x's memory differently
    (NOTE [as_strided reads memory] in tensor.py). A plain tensor has memory: torch's own
    kernel reads it."""
    numel = math.prod(ops.shape_of(x))
    positions = torch.arange(numel, device=x.device)
    try:
        return positions.as_strided(tuple(size), tuple(stride), storage_offset or 0)
    except RuntimeError as error:
        raise ShapeMismatchError(
            f"{op}: size {tuple(size)}, stride {tuple(stride)} and offset {storage_offset or 0} "
            f"reach outside the tensor's {numel} elements, which a tensor of a transform does "
            f"not have ({error}). Fix: stay within the tensor (or index it explicitly)."
        ) from None


@torch_api.register(*torch_api.torch_functions("as_strided"))
@aten_api.register(aten.as_strided.default)
def as_strided(x, size, stride, storage_offset=None):
    if not isinstance(x, Value):
        return torch.as_strided(x, size, stride, storage_offset)
    positions = _strided_positions(x, size, stride, storage_offset, "as_strided(x, ...)")
    return take(x, positions)


@torch_api.register(*torch_api.torch_functions("as_strided_scatter"))
@aten_api.register(aten.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    if not isinstance(x, Value) and not isinstance(src, Value):
        return torch.as_strided_scatter(x, src, size, stride, storage_offset)
    positions = _strided_positions(x, size, stride, storage_offset, "as_strided_scatter(x, ...)")
    return put(x, positions, src)


# --- quantile's q ------------------------------------------------------------------------------
def _quantile_q_checked(x, q, *args, **kwargs):
    """torch.quantile and nanquantile: torch's composite checks q only on a plain tensor, so
    a q of a transform (batched by vmap) would be read outside [0, 1]; the check is made
    here (NOTE [Checks of values, in eager code and in programs]), then the op declines the
    call and torch lowers it."""
    if isinstance(q, Value):
        refuse_outside("quantile(input, q)", q, 0, 1, InvalidOptionError,
                       "quantile() q values must be in the range [0, 1]",
                       why="q is a fraction of the sorted values; got {value}",
                       fix="keep every q in [0, 1]")
    return NotImplemented


torch_api.register(*torch_api.torch_functions("quantile"),
                   *torch_api.torch_functions("nanquantile"))(_quantile_q_checked)


# --- one_hot: classes compared with every class number ------------------------------------------
@torch_api.register(F.one_hot)
def one_hot(x, num_classes=-1):
    """``F.one_hot(t, C)`` is ``t[..., None] == arange(C)``, as integers. torch checks the
    classes in its C++ composite, which skips the check on a tensor without data (a traced
    program's): here the check is ``_refuse_out_of_range``'s, a step of the program under
    jit (NOTE [Indices out of range are read, not wrapped])."""
    op = "F.one_hot(tensor, num_classes)"
    if x.dtype != torch.int64:
        raise InputDtypeError(
            f"{op}: one_hot is only applicable to index tensor of type LongTensor (as in "
            f"torch; got {x.dtype}). Fix: pass tensor.long().")
    bottom = bottom_tensor(x)
    if num_classes == -1:
        level = batched_level(x)
        if level is not None:  # (each example would count its own classes)
            raise InvalidOptionError(
                f"{level.call}: When vmap-ing torch.nn.functional.one_hot, please provide an "
                "explicit positive num_classes argument (as torch.func says): counted from "
                "the largest value, the examples could have different numbers of classes. "
                "Fix: pass num_classes.")
        if bottom.device.type == "meta":
            raise UnsupportedOperationError(
                f"{op}: without num_classes, one_hot counts the classes from the largest "
                "value, which a traced program does not have. Fix: pass num_classes.")
        if bottom.numel() == 0:
            raise InvalidOptionError(
                f"{op}: Can not infer total number of classes from empty tensor (as in "
                "torch). Fix: pass num_classes.")
        num_classes = int(bottom.max()) + 1
    x = _refuse_out_of_range(op, x, num_classes, InvalidOptionError,
                             "Class values must be non-negative and smaller than num_classes "
                             f"({num_classes}); got {{value}}")
    classes = torch.arange(num_classes, device=x.device)
    return ops.convert(ops.eq(ops.unsqueeze(x, -1), classes), torch.int64)


# --- index producers -----------------------------------------------------------------------------
def _searchsorted_impl(sorted_sequence, values, sorter, *, right, out_int32):
    return torch.searchsorted(sorted_sequence, values, right=right, out_int32=out_int32,
                              sorter=sorter)


searchsorted_p = P.primitive("searchsorted", _searchsorted_impl, differentiable=False)


def searchsorted_batch(values, bdims, *, right, out_int32):
    """A 1-d sequence is searched for values of any shape; an n-d one row by row, for values
    with the same leading dims. With the batch in front of everything, a batched 1-d
    sequence becomes the row-by-row case (values flattened per example, then reshaped)."""
    sequence, searched, sorter = values
    s_bdim, v_bdim, o_bdim = bdims
    if s_bdim is None and o_bdim is None and _rank(sequence) == 1:
        return bind(searchsorted_p, sequence, searched, sorter, right=right,
                    out_int32=out_int32), v_bdim
    size = batch_size(values, bdims)

    def in_front(value, bdim):
        if bdim is not None:
            return move_bdim(value, bdim, 0)
        return ops.expand(ops.unsqueeze(value, 0), size, *ops.shape_of(value))
    sequence, searched = in_front(sequence, s_bdim), in_front(searched, v_bdim)
    if sorter is not None:
        sorter = in_front(sorter, o_bdim)
    if _rank(sequence) == 2:  # 1-d sequences: values of any shape, flattened per example
        shape = ops.shape_of(searched)
        out = bind(searchsorted_p, sequence, ops.reshape(searched, size, -1), sorter, right=right,
                   out_int32=out_int32)
        return ops.reshape(out, *shape), 0
    return bind(searchsorted_p, sequence, searched, sorter, right=right, out_int32=out_int32), 0
batching_rules[searchsorted_p] = searchsorted_batch


@torch_api.register(torch.searchsorted)
@aten_api.register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None,
                 sorter=None):
    if side is not None:
        right = side == "right"
    if not _is_tensor(values):
        values = _constant(values, sorted_sequence)
    if _rank(sorted_sequence) > 1 and ops.shape_of(sorted_sequence)[:-1] != \
            ops.shape_of(values)[:-1]:
        raise TransformUsageError(
            f"searchsorted(sorted_sequence, values): an n-d sequence of shape "
            f"{ops.shape_of(sorted_sequence)} needs values with the same leading dims, got "
            f"{ops.shape_of(values)}."
        )
    return bind(searchsorted_p, sorted_sequence, values, sorter, right=right, out_int32=out_int32)


@torch_api.register(torch.bucketize)
@aten_api.register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(x, boundaries, *, out_int32=False, right=False):
    """The bucket of each element: ``searchsorted(boundaries, x)`` (same side convention)."""
    if _rank(boundaries) != 1:
        raise ShapeMismatchError(
            "bucketize(x, boundaries): boundaries tensor must be 1 dimension, but got "
            f"dim({_rank(boundaries)}) (as in torch; shape {ops.shape_of(boundaries)}). Fix: "
            "use torch.searchsorted for a batch of sorted rows."
        )
    return searchsorted(boundaries, x, out_int32=out_int32, right=right)


def _histc_impl(x, *, bins, min, max):
    return torch.histc(x, bins, min, max)


# torch.func's gradient of histc is zero (derivatives.yaml marks it non-differentiable)
histc_p = P.primitive("histc", _histc_impl, differentiable=False)


def histc_batch(values, bdims, *, bins, min, max):
    """NOTE [histc under vmap]
    One histogram per example in one pass: each element's bin is computed as torch's kernel
    computes it (``(x - left) * bins / (right - left)`` in the input's dtype, truncated, the
    right edge counted in the last bin, elements outside [left, right] skipped), and the
    counts are a scatter_add of ones into a (B, bins) tensor. With min == max the range is
    each example's own [amin, amax] (widened by 1 on each side if they are equal)."""
    (x,), (bdim,) = values, bdims
    size = batch_size(values, bdims)
    x = ops.reshape(move_bdim(x, bdim, 0), size, -1)
    if min == max:
        if ops.shape_of(x)[1] == 0:
            left, right = _constant(min - 1.0, x), _constant(max + 1.0, x)
        else:
            left, right = ops.amin(x, 1, keepdim=True), ops.amax(x, 1, keepdim=True)
            same = ops.eq(left, right)
            left = ops.where(same, ops.sub(left, 1), left)
            right = ops.where(same, ops.add(right, 1), right)
            if isinstance(left, torch.Tensor) and not bool(torch.isfinite(left).all() &
                                                           torch.isfinite(right).all()):
                raise TransformUsageError("histc(x, ...): the range of an example is not finite "
                                          "(it holds inf or nan). Fix: pass min and max.")
    else:
        left, right = _constant(min, x), _constant(max, x)
    inside = logical_and(ops.ge(x, left), ops.le(x, right))
    position = ops.div(ops.mul(ops.sub(x, left), bins), ops.sub(right, left))
    position = ops.convert(ops.where(inside, position, 0.0), torch.int64)
    position = ops.where(ops.eq(position, bins), bins - 1, position)
    ones = ops.convert(inside, x.dtype)
    return bind(P.scatter_add_p, ones, position, dim=1, shape=(size, bins)), 0
batching_rules[histc_p] = histc_batch


@torch_api.register(*torch_api.torch_functions("histc"))
@aten_api.register(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    if min > max or not (math.isfinite(min) and math.isfinite(max)):
        raise TransformUsageError(f"histc(x, bins, min={min}, max={max}): expected a finite "
                                  "range, with max larger than min.")
    return bind(histc_p, x, bins=int(bins), min=min, max=max)


def _data_dependent(func, what):
    """An aten op whose output shape depends on the data (NOTE [Shapes that depend on the
    data]): refused under vmap; elsewhere handed to its level as an op without a rule, which
    runs it one level down when its outputs cannot carry a derivative (nonzero's indices) and
    refuses it otherwise (unique of a float tensor, whose derivative torch does not define)."""
    def op(*values, **kwargs):
        _refuse_shapes_from_data(what, *values)
        top = top_dispatcher([v for v in values if isinstance(v, Value)])
        if top is None:  # (a value no level owns, such as a comparison's mask)
            return call_with_tensors(func, *values, **kwargs)
        return top.unknown_op(str(func), runner(func), list(values), kwargs)
    return op


def _argwhere_of_examples(x):
    """NOTE [argwhere under vmap: one shape or an error]
    torch.func runs argwhere example by example and stacks the results: that works when every
    example has as many nonzero elements, and raises torch.stack's error otherwise. Here one
    call on the whole batch (the batch dim in front) gives every example's indices, sorted by
    example first; when every example has the same count c they are (B, c, rank) (the column
    of example numbers dropped), otherwise the same error. (nonzero itself torch.func refuses
    outright: NOTE [Shapes that depend on the data].)"""
    examples = _plain_of(x.payload).movedim(x.bdim, 0)
    found = torch.argwhere(examples)
    size = examples.shape[0]
    counts = torch.bincount(found[:, 0], minlength=size)
    if size and bool((counts != counts[0]).any()):
        raise ShapeMismatchError(
            f"{x.dispatcher.call}: argwhere finds {counts.tolist()} nonzero elements in the "
            "examples, and vmap needs one shape for the whole batch (torch.func raises "
            "'stack expects each tensor to be equal size'). Expected the same count in every "
            "example. Fix: use torch.nonzero_static(x, size=...) for a fixed count, or move "
            "argwhere outside of vmap.")
    per_example = int(counts[0]) if size else 0
    out = found[:, 1:].reshape(size, per_example, examples.dim() - 1)
    return BatchedValue(x.dispatcher, out, 0)


def _plain_of(value):
    """The plain tensor under a value that no vmap batches (the payload chain of grad and jvp
    levels holds it unchanged), or None."""
    while isinstance(value, Value):
        if isinstance(value, BatchedValue):
            return None
        value = value.payload
    return value


@torch_api.register(torch.argwhere, torch.Tensor.argwhere)
@aten_api.register(aten.argwhere.default)
def argwhere(x):
    if isinstance(x, BatchedValue) and _plain_of(x.payload) is not None:
        return _argwhere_of_examples(x)
    if not isinstance(x, BatchedValue):  # a level that is not vmap's runs it one level down
        _refuse_traced("argwhere", x)  # (vmap's examples come below: one count may do)
        top = top_dispatcher([x] if isinstance(x, Value) else [])
        if top is not None:
            return top.unknown_op(str(aten.argwhere.default), runner(torch.argwhere), [x], {})
        return torch.argwhere(x)
    return _data_dependent(aten.argwhere.default, "argwhere")(x)


for _func in (aten.nonzero.default, aten._unique2.default, aten._unique.default,
              aten.unique_dim.default, aten.unique_consecutive.default,
              aten.unique_dim_consecutive.default):
    aten_api.register(_func)(_data_dependent(_func, f"aten::{_func.overloadpacket.__name__}"))

# NOTE [Checks over the whole batch]
# ``aten._is_all_true`` and ``_is_any_true`` (behind ``torch._assert_async`` and torch's
# ``TORCH_CHECK_TENSOR_ALL``) answer one question for a whole tensor: under vmap torch.func
# asks it of every example at once and returns one unbatched answer, so that Python may read
# it. The same here: the answer comes from the plain tensor at the bottom of the value, all
# batch dims included, and belongs to no level (it has no derivative).
def _over_the_whole_batch(func):
    def op(x):
        return func(bottom_tensor(x))
    return op


for _func in (aten._is_all_true.default, aten._is_any_true.default):
    aten_api.register(_func)(_over_the_whole_batch(_func))


@aten_api.register(aten._test_check_tensor.default)
def _test_check_tensor(x):
    aten._test_check_tensor(bottom_tensor(x))  # torch's check, over every example
    return ops.clone(x)


_where_indices = _data_dependent(aten.nonzero.default, "aten::where")


@torch_api.register(torch.where)
def where(condition, input=None, other=None):
    """``torch.where(condition, input, other)``, or with the condition alone the indices of
    its nonzero elements, one tensor per dim (``nonzero(as_tuple=True)``)."""
    if input is None and other is None:
        indices = _where_indices(condition)
        return tuple(ops.getitem(indices, (slice(None), d)) for d in range(_rank(condition)))
    return ops.where(condition, input, other)


# --- embedding -----------------------------------------------------------------------------------
# scale_grad: the identity, whose cotangent is multiplied by `scale` (its tangent is not)
scale_grad_p = P.primitive("scale_grad", lambda x, scale: x.view_as(x))


def scale_grad_vjp(x, scale):
    return bind(scale_grad_p, x, scale), lambda ct: (ops.mul(ct, scale), None)
vjp_rules[scale_grad_p] = scale_grad_vjp


def scale_grad_jvp(primals, tangents):
    return bind(scale_grad_p, *primals), tangents[0]
jvp_rules[scale_grad_p] = scale_grad_jvp
batching_rules[scale_grad_p] = same_shape_batch(scale_grad_p)


def _refuse_sparse(sparse, op):
    if sparse:
        raise UnsupportedOperationError(
            f"{op}: sparse=True asks for a sparse gradient, which minifunctorch transforms make "
            "only at the end of a backward pass (vjp, grad), not for a cotangent that vmap or "
            "another derivative still holds (torch.func fails there too). Fix: pass "
            "sparse=False; the gradient is then a dense tensor with the same values."
        )


# NOTE [embedding with sparse=True]
# sparse=True changes only the gradient of the weight: torch's backward returns it as an
# uncoalesced sparse_coo tensor, one row of the cotangent per index (the indices equal to
# padding_idx dropped), where the dense backward adds them up. The lookup and its tangent are
# the same (torch.func's jvp and vmap give dense results). So a sparse lookup is a primitive
# with the dense lookup's value, jvp and batching (which binds the dense lookup: a batch is
# never differentiated sparsely below), and a vjp that builds torch's sparse tensor from the
# cotangent. It can do so only from a plain cotangent, the last step of a backward pass
# (vjp, grad); a cotangent that a level still owns (vmap of grad, a second derivative) has no
# sparse form here, and torch.func fails there too ("Could not run 'aten::view' with
# arguments from the 'SparseCPU' backend"), so it is refused. torch refuses
# scale_grad_by_freq with sparse gradients ("embedding_backward: scale_grad_by_freq not
# supported with sparse gradients"), and so do we.
embedding_sparse_p = P.primitive(
    "embedding_sparse",
    lambda weight, indices, *, padding_idx, scale_grad_by_freq: aten.embedding(
        weight, indices, padding_idx, scale_grad_by_freq, True))


def embedding_sparse_vjp(weight, indices, *, padding_idx, scale_grad_by_freq):
    out = bind(embedding_sparse_p, weight, indices, padding_idx=padding_idx,
               scale_grad_by_freq=scale_grad_by_freq)
    rows, features = ops.shape_of(weight)

    def backward(ct):
        if scale_grad_by_freq:
            raise UnsupportedOperationError(
                "embedding(weight, indices, scale_grad_by_freq=True, sparse=True): "
                "scale_grad_by_freq is not supported with sparse gradients (torch raises "
                "the same: 'embedding_backward: scale_grad_by_freq not supported with sparse "
                "gradients'). Fix: pass sparse=False, or scale_grad_by_freq=False.")
        if isinstance(ct, Value) or isinstance(indices, Value):
            _refuse_sparse(True, "embedding(weight, indices, sparse=True)")
        index, values = indices.reshape(-1), ct.reshape(-1, features)
        if padding_idx >= 0:
            keep = index != padding_idx
            index, values = index[keep], values[keep]
        return torch.sparse_coo_tensor(index.reshape(1, -1), values, (rows, features),
                                       is_coalesced=False), None
    return out, backward
vjp_rules[embedding_sparse_p] = embedding_sparse_vjp


def embedding_sparse_jvp(primals, tangents, **params):
    (weight, indices), (weight_dot, _) = primals, tangents
    out = bind(embedding_sparse_p, weight, indices, **params)
    return out, None if weight_dot is None else bind(index_p, weight_dot, indices, dims=(0,))
jvp_rules[embedding_sparse_p] = embedding_sparse_jvp


def embedding_sparse_batch(values, bdims, **params):
    return batching_rules[index_p](values, bdims, dims=(0,))
batching_rules[embedding_sparse_p] = embedding_sparse_batch


def _refuse_out_of_range(op, indices, size, error, words):
    """NOTE [Indices out of range are read, not wrapped]
    torch's kernels of embedding, embedding_bag and index_select/add/copy/reduce refuse any
    index outside [0, size). Here those ops are advanced indexing (index_p, index_put_p),
    which reads a negative index from the end, as Python does: a negative index would give a
    value where torch raises. So the indices are read first (``refuse_outside``). ``words``
    is torch's sentence, with ``{value}`` for the index out of range. Returns the indices to
    use."""
    return refuse_outside(
        op, indices, 0, size - 1, error, words,
        why=f"an index here is in [0, {size}), and a negative one does not count from the end",
        fix="keep every index in range")


def refuse_outside(op, values, low, high, error, words, *, why, fix):
    """NOTE [Checks of values, in eager code and in programs]
    Some of torch's kernels refuse values outside a range (indices, BCE's probabilities,
    quantile's q): the check reads the numbers, on the plain tensor at the bottom of their
    value, every example at once (NOTE [Checks over the whole batch]); NaN is outside any
    range. A traced program's values (jit) have no numbers yet: there the check is a step of
    the program (``check_range_p``, which returns its values), so that every replay reads the
    numbers it is given. On a GPU the read waits for the device, as ``.item()`` does (torch's
    CUDA kernels assert on the device instead). Returns the values to use."""
    bottom = bottom_tensor(values)
    if bottom.numel() == 0:
        return values
    params = dict(low=low, high=high, op=op, error=error.__name__, words=words, why=why,
                  fix=fix)
    if bottom.device.type == "meta":
        return bind(check_range_p, values, **params)
    _check_range(bottom, **params)
    return values


def _check_range(values, *, low, high, op, error, words, why, fix):
    if not values.numel() or values.device.type == "meta":  # (a trace infers shapes on meta)
        return values
    # (the least and greatest value in one pass and two reads: a NaN is neither >= nor <=)
    least, greatest = torch.aminmax(values)
    if not (least.item() >= low and greatest.item() <= high):
        value = values[~((values >= low) & (values <= high))].reshape(-1)[0].item()
        raise getattr(errors, error)(
            f"{op}: {words.format(value=value)} (as in torch: {why.format(value=value)}). "
            f"Fix: {fix}.")
    return values


# the identity on values in range, for every transform (BCE's input carries a derivative)
check_range_p = P.primitive("check_range", _check_range, effectful=True)


def check_range_vjp(x, **params):
    return bind(check_range_p, x, **params), lambda ct: (ct,)
vjp_rules[check_range_p] = check_range_vjp


def check_range_jvp(primals, tangents, **params):
    return bind(check_range_p, primals[0], **params), tangents[0]
jvp_rules[check_range_p] = check_range_jvp


def check_range_batch(values, bdims, **params):
    """Every example's values at once: the check does not care where the batch dim is."""
    (x,), (bdim,) = values, bdims
    return bind(check_range_p, x, **params), bdim
batching_rules[check_range_p] = check_range_batch


def _embedding_weight_error(call, weight):
    return ShapeMismatchError(
        f"{call}: 'weight' must be 2-D (as in torch; got shape {ops.shape_of(weight)}). Fix: "
        "pass the (rows, features) embedding matrix.")


@aten_api.register(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """NOTE [embedding's two derivatives]
    ``embedding(weight, indices)`` is ``weight[indices]``, and its jvp is exactly that
    (derivatives.yaml: ``auto_linear``). Its backward, ``embedding_dense_backward``, differs:
    the row ``padding_idx`` gets no gradient, and with ``scale_grad_by_freq`` each row's
    gradient is divided by how often the indices name it. ``scale_grad`` is the identity with
    that backward and an untouched tangent, so both derivatives match torch.func's."""
    op = "embedding(weight, indices)"
    if _rank(weight) != 2:
        raise _embedding_weight_error(op, weight)
    if indices.dtype.is_floating_point:
        raise InputDtypeError(
            f"{op}: Expected tensor for argument #1 'indices' to have one of the following "
            f"scalar types: Long, Int; but got {indices.dtype} instead (as in torch). Fix: "
            "pass integer indices (indices.long()).")
    rows = ops.shape_of(weight)[0]
    indices = _long(indices)
    indices = _refuse_out_of_range(op, indices, rows, DimOutOfRangeError,
                                   "index out of range in self")
    if sparse:
        return bind(embedding_sparse_p, weight, indices,
                    padding_idx=-1 if padding_idx is None else int(padding_idx),
                    scale_grad_by_freq=bool(scale_grad_by_freq))
    if padding_idx is not None and padding_idx >= 0 or scale_grad_by_freq:
        scale = torch.ones((rows, 1), dtype=weight.dtype, device=weight.device)
        if padding_idx is not None and padding_idx >= 0:
            scale[padding_idx] = 0
        if scale_grad_by_freq:
            flat = ops.reshape(indices, -1)
            counts = bind(P.scatter_add_p, ops.full_like(flat, 1.0, dtype=weight.dtype), flat,
                          dim=0, shape=(rows,))
            counts = ops.where(ops.eq(counts, 0), 1.0, counts)
            scale = ops.div(scale, ops.unsqueeze(counts, 1))
        weight = bind(scale_grad_p, weight, scale)
    # the rows of weight: NOTE [index_select and index_add: torch's kernels for one index
    # along one dim] (torch's embedding is index_select of the flattened indices too)
    index_shape = ops.shape_of(indices)
    if len(index_shape) == 1:
        return bind(index_select_p, weight, indices, dim=0)
    rows_read = bind(index_select_p, weight, ops.reshape(indices, -1), dim=0)
    return ops.reshape(rows_read, *index_shape, ops.shape_of(weight)[1])


# NOTE [embedding with max_norm renormalizes the weight in place]
# F.embedding(..., max_norm=m) first rescales, in place, every row of the weight that the
# indices name and whose norm exceeds m (``torch.embedding_renorm_(weight.detach(), ...)``),
# then looks the rows up. In torch the write goes through ``detach()``, an alias that
# autograd does not track: the caller's weight holds the new numbers, and every derivative
# is that of the lookup alone (gradients flow into the weight as if nothing had been
# written; its tangent is unchanged). torch.func does just that, and so does
# ``embedding_renorm_`` here, called by F.embedding's and F.embedding_bag's front doors, and
# at the back door by torch's own code (``torch.embedding_renorm_(weight.detach(), ...)``,
# whose detached weight has the weight's own storage as its plain tensor at the bottom:
# detach is an alias all the way down). The kernel renormalizes the plain tensor at the
# bottom of the weight in place and no value changes: each level keeps the weight's value,
# name and tangent, and reads the new numbers, exactly as torch.func's wrappers do.
# Under vmap the weight's plain tensor holds every example: its batch dims are moved in
# front (a view), folded into the rows, and each example's indices offset to its own rows,
# so one kernel call renormalizes every example (written back if folding needed a copy).
# Indices batched where the weight is not would renormalize other rows of one weight for
# each example: torch.func refuses that ("vmap: aten::embedding_renorm_(self, *extra_args)
# is not possible"), and so do we. A weight that a recorded op may have saved for its
# backward pass (w = x.exp(), whose vjp reads w; y = x * w, whose vjp for x reads w) would be
# read with the new numbers: torch's version counter makes its backward pass raise
# ("modified by an inplace operation"). This engine has no version counter, so it refuses
# up front when any tape of the transforms running has the weight among the arguments or
# outputs of an op it recorded (NOTE [A tape has no version counter], autograd.py).
def _layout(value):
    """(the plain tensor at the bottom of ``value``, where ``value``'s own dims are in it,
    [(vmap level, where its batch dim is in it)])."""
    dims = list(range(_rank(value)))
    batch = []
    while isinstance(value, Value):
        if isinstance(value, BatchedValue):
            b = value.bdim
            dims = [d if d < b else d + 1 for d in dims]
            batch = [(level, p if p < b else p + 1) for level, p in batch]
            batch.append((value.dispatcher, b))
        value = value.payload
    return value, dims, batch


@aten_api.register(aten.embedding_renorm_.default)
def embedding_renorm_(weight, indices, max_norm, norm_type):
    call = "F.embedding(input, weight, max_norm=...)"
    if _rank(weight) != 2:
        raise _embedding_weight_error(call, weight)
    w_bottom, (rows_dim, features_dim), w_batch = _layout(weight)
    i_bottom, _, i_batch = _layout(indices)
    if w_bottom.device.type == "meta":
        raise UnsupportedOperationError(
            f"{call}: renormalizing the weight in place reads its values, which a traced "
            "program does not have. Fix: call F.embedding without max_norm inside trace, or "
            "renormalize outside it.")
    refuse_write_to_recorded(weight, call)  # NOTE [A tape has no version counter]
    w_levels = [level for level, _ in w_batch]
    for level, _ in i_batch:
        if level not in w_levels:
            raise UnsupportedOperationError(
                f"{level.call}: {call} with indices batched by vmap and a weight that is not: "
                "each example would renormalize other rows of the one weight in place "
                "(torch.func refuses it too: 'vmap: aten::embedding_renorm_(self, *extra_args) "
                "is not possible'). Fix: batch the weight as well, or renormalize outside of "
                "vmap.")
    examples = w_bottom.permute(*(p for _, p in w_batch), rows_dim, features_dim)  # a view
    batch_shape, (rows, features) = tuple(examples.shape[:-2]), tuple(examples.shape[-2:])
    flat_indices = i_bottom.permute(*(p for _, p in i_batch),
                                    *(d for d in range(i_bottom.dim())
                                      if d not in {p for _, p in i_batch}))
    # the indices of every example, (*batch_shape, n): each index batch dim goes where its
    # level's dim is in the weight, the weight's other batch dims broadcast
    per_example = flat_indices.reshape(*flat_indices.shape[:len(i_batch)], -1)
    placed = [w_levels.index(level) for level, _ in i_batch]
    shape = [1] * len(batch_shape) + [per_example.shape[-1]]
    for axis, size in zip(placed, per_example.shape[:-1]):
        shape[axis] = size
    order = sorted(range(len(placed)), key=lambda k: placed[k])
    per_example = per_example.permute(*order, len(placed)).reshape(shape)
    per_example = per_example.expand(*batch_shape, per_example.shape[-1]).to(torch.int64)
    count = math.prod(batch_shape)
    offsets = torch.arange(count, device=w_bottom.device).mul_(rows).reshape(*batch_shape, 1)
    folded = examples.reshape(count * rows, features)  # a view where the layout allows
    with torch.no_grad():
        torch.embedding_renorm_(folded, (per_example + offsets).reshape(-1), float(max_norm),
                                float(norm_type))
        if folded.data_ptr() != examples.data_ptr() or not folded._is_view():
            examples.copy_(folded.reshape(examples.shape))
    return weight


@torch_api.register(F.embedding)
def functional_embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                         scale_grad_by_freq=False, sparse=False):
    if padding_idx is not None and padding_idx < 0:
        padding_idx += ops.shape_of(weight)[0]
    if max_norm is not None:  # NOTE [embedding with max_norm renormalizes the weight in place]
        embedding_renorm_(weight, input, max_norm, norm_type)
    return embedding(weight, input, -1 if padding_idx is None else padding_idx,
                     scale_grad_by_freq, sparse)


torch_api.register(torch.embedding)(embedding)


# NOTE [embedding_bag's scale_grad_by_freq, as torch's kernel computes it]
# With scale_grad_by_freq, torch's CPU backward of embedding_bag (sum and mean) divides the
# gradient of each row of the weight by a count, but not always by how often the indices name
# that row: the k-th distinct row (in increasing order) is divided by the count of the row at
# position k of the sorted indices (indices [2, 2, 4]: row 2 by 2, and row 4 by 2 as well).
# This is what torch.func returns (its vjp runs that kernel), so it is the oracle here: the
# scale is computed the same way, with ops (a count per row, the sorted indices, each
# present row's rank among the distinct ones), and ``scale_derivatives`` multiplies the
# weight's derivatives by it. torch has no forward-mode rule for embedding_bag; the jvp
# here is the one consistent with that vjp (J @ t for the same J), as jacrev would give.
# (F.embedding's own scale_grad_by_freq divides by each row's own count: see
# NOTE [embedding's two derivatives].)
scale_derivatives_p = P.primitive("scale_derivatives", lambda x, scale: x.view_as(x))


def scale_derivatives_vjp(x, scale):
    return bind(scale_derivatives_p, x, scale), lambda ct: (ops.mul(ct, scale), None)
vjp_rules[scale_derivatives_p] = scale_derivatives_vjp


def scale_derivatives_jvp(primals, tangents):
    (x, scale), (x_dot, _) = primals, tangents
    out = bind(scale_derivatives_p, x, scale)
    return out, None if x_dot is None else ops.mul(x_dot, scale)
jvp_rules[scale_derivatives_p] = scale_derivatives_jvp
batching_rules[scale_derivatives_p] = same_shape_batch(scale_derivatives_p)


def _bag_frequency_scale(input, rows, weight):
    """(rows, 1): the factor of each row's gradient (NOTE [embedding_bag's
    scale_grad_by_freq, as torch's kernel computes it])."""
    from . import structural
    flat = ops.reshape(_long(input), -1)
    if ops.shape_of(flat)[0] == 0:
        return torch.ones((rows, 1), dtype=weight.dtype, device=weight.device)
    counts = bind(P.scatter_add_p, ops.full_like(flat, 1.0, dtype=weight.dtype), flat, dim=0,
                  shape=(rows,))
    present = ops.gt(counts, 0)
    rank = ops.sub(bind(structural.cumsum_p, ops.convert(present, torch.int64), dim=0), 1)
    rank = ops.where(ops.lt(rank, 0), 0, rank)
    ordered = structural.sort(flat).values
    divisor = ops.gather(counts, 0, ops.gather(ordered, 0, rank))
    divisor = ops.where(present, divisor, 1.0)
    scale = ops.where(present, ops.div(ops.full_like(divisor, 1.0), divisor), 0.0)
    return ops.unsqueeze(scale, 1)


@torch_api.register(F.embedding_bag)
def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
                  mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
                  padding_idx=None):
    """NOTE [embedding_bag as index and scatter]
    Each bag reduces the rows its indices name: the rows are read with one ``index``, and
    reduced into their bags with ``index_put(accumulate=True)`` (sum, and mean, divided by the
    bag's size) or ``scatter_reduce(amax, include_self=False)`` (max). An element's bag comes
    from ``offsets`` with a searchsorted (vmap may batch the offsets); indices equal to
    ``padding_idx`` go to one extra bag that is dropped, so they count nowhere, as in torch.
    Empty bags are zeros. torch's max backward sends each feature's gradient to one row (the
    first maximum); here exact ties between rows share it, which differs only when two
    different rows hold equal values."""
    op = "F.embedding_bag(input, weight, ...)"
    if mode not in ("sum", "mean", "max"):
        raise TransformUsageError(f"{op}: expected mode 'sum', 'mean' or 'max', got {mode!r}.")
    if mode == "max" and (sparse or scale_grad_by_freq):
        raise TransformUsageError(
            f"{op}: mode='max' takes neither sparse=True nor scale_grad_by_freq=True (torch "
            "raises too: 'max mode does not support sparse weights', 'max mode does not "
            "support scaling the gradient by the frequency'). Fix: use mode='sum' or 'mean', "
            "or drop them.")
    if max_norm is not None:  # NOTE [embedding with max_norm renormalizes the weight in place]
        embedding_renorm_(weight, input, max_norm, norm_type)
    if per_sample_weights is not None and mode != "sum":
        raise TransformUsageError(f"{op}: per_sample_weights needs mode='sum', got {mode!r}.")
    if _rank(weight) != 2:
        raise _embedding_weight_error(op, weight)
    rows, features = ops.shape_of(weight)
    input = _long(input)
    input = _refuse_out_of_range(op, input, rows, InvalidOptionError,
                                 "an index of input takes value {value} which is not in the "
                                 f"valid range [0, {rows})")
    if _rank(input) == 2:
        if offsets is not None:
            raise TransformUsageError(f"{op}: offsets must be None for a 2-d input.")
        bags, length = ops.shape_of(input)
        bag_of = torch.arange(bags, device=weight.device).repeat_interleave(length)
        if per_sample_weights is not None:
            per_sample_weights = ops.reshape(per_sample_weights, -1)
        input = ops.reshape(input, -1)
    elif _rank(input) == 1:
        if offsets is None or _rank(offsets) != 1:
            raise TransformUsageError(f"{op}: a 1-d input needs 1-d offsets.")
        bags = ops.shape_of(offsets)[0] - (1 if include_last_offset else 0)
        positions = torch.arange(ops.shape_of(input)[0], device=weight.device)
        bag_of = ops.sub(bind(searchsorted_p, _long(offsets), positions, None, right=True,
                              out_int32=False), 1)
        if include_last_offset:  # torch's last bag runs to the end of the input
            bag_of = ops.where(ops.lt(bag_of, bags), bag_of, bags - 1)
    else:
        raise TransformUsageError(f"{op}: input must be 1-d or 2-d, got shape "
                                  f"{ops.shape_of(input)}.")
    if padding_idx is not None:
        if padding_idx < 0:
            padding_idx += rows
        bag_of = ops.where(ops.eq(input, padding_idx), bags, bag_of)  # the extra bag
    if scale_grad_by_freq:
        weight = bind(scale_derivatives_p, weight, _bag_frequency_scale(input, rows, weight))
    if sparse:  # NOTE [embedding with sparse=True]
        picked = bind(embedding_sparse_p, weight, input,
                      padding_idx=-1 if padding_idx is None else padding_idx,
                      scale_grad_by_freq=bool(scale_grad_by_freq))
    else:
        picked = bind(index_p, weight, input, dims=(0,))
    if per_sample_weights is not None:
        picked = ops.mul(picked, ops.unsqueeze(ops.convert(per_sample_weights, weight.dtype), 1))
    zeros = torch.zeros((bags + 1, features), dtype=weight.dtype, device=weight.device)
    if mode == "max":
        along = ops.expand(ops.unsqueeze(bag_of, 1), *ops.shape_of(picked))
        out = bind(scatter_reduce_p, zeros, along, picked, dim=0, reduce="amax",
                   include_self=False)
    else:
        out = bind(index_put_p, zeros, picked, bag_of, dims=(0,), accumulate=True)
        if mode == "mean":
            ones = ops.full_like(bag_of, 1.0, dtype=weight.dtype)
            counts = bind(index_put_p, torch.zeros(bags + 1, dtype=weight.dtype,
                                                   device=weight.device),
                          ones, bag_of, dims=(0,), accumulate=True)
            out = ops.div(out, ops.unsqueeze(ops.where(ops.eq(counts, 0), 1.0, counts), 1))
    return ops.getitem(out, (slice(0, bags, 1),))


# --- segment_reduce ------------------------------------------------------------------------------
# NOTE [segment_reduce: torch's kernel and its backward kernel]
# ``segment_reduce(data, reduce, lengths= or offsets=, axis=, initial=)`` reduces consecutive
# runs of ``data`` along ``axis`` (sum, mean, max, min, prod). torch.func differentiates it
# with torch's backward kernel ``_segment_reduce_backward``, which handles what a formula of
# ops would have to repeat (ties of max and min share the gradient, products with zeros,
# ``initial``, empty segments), so both kernels are primitives and the vjp is bit-exact.
# - The backward kernel is linear in the cotangent: element i of segment s gets
#   ``grad[s] * w_i``, with w = the backward kernel on a cotangent of ones. So the Jacobian
#   is J[s, i] = w_i for i in s, and the jvp (torch has none; torch.func's jvp refuses) is
#   a segment sum of ``w * data_dot``; the transpose of the backward kernel in its cotangent
#   is the same segment sum. torch has no derivative of the backward kernel with respect to
#   the data (derivatives.yaml), so a second derivative with respect to the data is refused.
# - vmap: the segments run along ``axis`` and the lengths (offsets) have the shape
#   ``data.shape[:axis] + (segments,)``: with the batch dim in front of both (an unbatched
#   one expanded) it is one more leading dim, and the kernel runs once with ``axis + 1``.
def _segment_kwargs(segments, by, axis, initial):
    return {by: segments, "axis": axis, "initial": initial}


segment_reduce_p = P.primitive(
    "segment_reduce",
    lambda data, segments, *, reduce, by, axis, initial, unsafe: aten.segment_reduce(
        data, reduce, unsafe=unsafe, **_segment_kwargs(segments, by, axis, initial)))
segment_reduce_backward_p = P.primitive(
    "segment_reduce_backward",
    lambda grad, output, data, segments, *, reduce, by, axis, initial:
    aten._segment_reduce_backward(grad, output, data, reduce,
                                  **_segment_kwargs(segments, by, axis, initial)))


def _refuse_segment_second_order(op):
    raise MissingRuleError(
        f"{op}: the derivative of segment_reduce's backward with respect to the data is not "
        "implemented (torch has none either: torch.func raises 'derivative for "
        "aten::_segment_reduce_backward is not implemented'). Expected a first derivative of "
        "segment_reduce, got a second one. Fix: differentiate segment_reduce once.")


def _segment_sum(values, segments, by, axis):
    return bind(segment_reduce_p, values, segments, reduce="sum", by=by, axis=axis,
                initial=None, unsafe=True)


def _segment_weights(output, data, segments, reduce, by, axis, initial):
    """w: each element's derivative of its segment's result (the backward kernel on ones)."""
    return bind(segment_reduce_backward_p, ops.full_like(output, 1.0), output, data, segments,
                reduce=reduce, by=by, axis=axis, initial=initial)


def segment_reduce_vjp(data, segments, *, reduce, by, axis, initial, unsafe):
    out = bind(segment_reduce_p, data, segments, reduce=reduce, by=by, axis=axis,
               initial=initial, unsafe=unsafe)

    def backward(ct):
        return bind(segment_reduce_backward_p, ct, out, data, segments, reduce=reduce, by=by,
                    axis=axis, initial=initial), None
    return out, backward
vjp_rules[segment_reduce_p] = segment_reduce_vjp


def segment_reduce_jvp(primals, tangents, *, reduce, by, axis, initial, unsafe):
    (data, segments), (data_dot, _) = primals, tangents
    out = bind(segment_reduce_p, data, segments, reduce=reduce, by=by, axis=axis,
               initial=initial, unsafe=unsafe)
    if data_dot is None:
        return out, None
    weights = _segment_weights(out, data, segments, reduce, by, axis, initial)
    return out, _segment_sum(ops.mul(weights, data_dot), segments, by, axis)
jvp_rules[segment_reduce_p] = segment_reduce_jvp


def segment_reduce_backward_vjp(grad, output, data, segments, *, reduce, by, axis, initial):
    out = bind(segment_reduce_backward_p, grad, output, data, segments, reduce=reduce, by=by,
               axis=axis, initial=initial)

    def backward(ct):
        if wants_cotangent(1, output) or wants_cotangent(2, data):
            _refuse_segment_second_order("vjp of segment_reduce's backward")
        ct_grad = None
        if wants_cotangent(0, grad):
            weights = _segment_weights(output, data, segments, reduce, by, axis, initial)
            ct_grad = _segment_sum(ops.mul(weights, ct), segments, by, axis)
        return ct_grad, None, None, None
    return out, backward
vjp_rules[segment_reduce_backward_p] = segment_reduce_backward_vjp


# linear in the output's cotangent; torch has no derivative in the output or the data
jvp_rules[segment_reduce_backward_p] = linear_jvp(
    segment_reduce_backward_p,
    refuse_others=lambda: _refuse_segment_second_order("jvp of segment_reduce's backward"))


def _segment_batch(prim):
    def rule(values, bdims, *, axis, **params):
        fronted = to_front(values, bdims, expand_unbatched=True)
        return bind(prim, *fronted, axis=axis + 1, **params), 0
    return rule


batching_rules[segment_reduce_p] = _segment_batch(segment_reduce_p)
batching_rules[segment_reduce_backward_p] = _segment_batch(segment_reduce_backward_p)


@aten_api.register(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                   unsafe=False, initial=None):
    op = f"segment_reduce(data, {reduce!r}, ...)"
    if indices is not None or (lengths is None) == (offsets is None):
        raise TransformUsageError(
            f"{op}: expected exactly one of lengths= and offsets=, got "
            f"{'indices=' if indices is not None else 'both or neither'}. Fix: pass lengths= "
            "or offsets= (torch does not implement indices= either).")
    by, segments = ("lengths", lengths) if lengths is not None else ("offsets", offsets)
    axis = ops.normalize_dim(axis, _rank(data), op=op)
    return bind(segment_reduce_p, data, segments, reduce=reduce, by=by, axis=axis,
                initial=initial, unsafe=bool(unsafe))


@aten_api.register(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    by, segments = ("lengths", lengths) if lengths is not None else ("offsets", offsets)
    axis = ops.normalize_dim(axis, _rank(data), op="_segment_reduce_backward")
    return bind(segment_reduce_backward_p, grad, output, data, segments, reduce=reduce, by=by,
                axis=axis, initial=initial)


# --- nonzero_static ------------------------------------------------------------------------------
# NOTE [nonzero_static under vmap]
# nonzero_static(x, size, fill_value) has a fixed shape (size, rank): the first ``size``
# indices of nonzero elements, padded with fill_value. So it batches: the primitive takes a
# number of leading batch dims, and for them runs argwhere once on all examples (indices
# sorted by example), numbers each index within its example (its position minus where its
# example starts) and writes the first ``size`` of each example into a (examples, size, rank)
# tensor of fill_value. The indices are integers: no derivative.
def _nonzero_static_impl(x, *, size, fill_value, batch_dims):
    if batch_dims == 0:
        return torch.nonzero_static(x, size=size, fill_value=fill_value)
    lead, rank = tuple(x.shape[:batch_dims]), x.dim() - batch_dims
    if x.device.type == "meta":
        return torch.empty((*lead, size, rank), dtype=torch.int64, device="meta")
    count = math.prod(lead)
    found = torch.argwhere(x.reshape(count, *x.shape[batch_dims:]))
    example = found[:, 0]
    per_example = torch.bincount(example, minlength=count)
    starts = per_example.cumsum(0) - per_example
    position = torch.arange(found.shape[0], device=x.device) - starts[example]
    kept = position < size
    out = torch.full((count, size, rank), fill_value, dtype=torch.int64, device=x.device)
    out[example[kept], position[kept]] = found[kept, 1:]
    return out.reshape(*lead, size, rank)


nonzero_static_p = P.primitive("nonzero_static", _nonzero_static_impl, differentiable=False)


def nonzero_static_batch(values, bdims, *, size, fill_value, batch_dims):
    (x,), (bdim,) = values, bdims
    # every batch dim leads; this level's goes in front of the levels below
    return bind(nonzero_static_p, move_bdim(x, bdim, 0), size=size, fill_value=fill_value,
                batch_dims=batch_dims + 1), 0
batching_rules[nonzero_static_p] = nonzero_static_batch


@torch_api.register(torch.nonzero_static, torch.Tensor.nonzero_static)
@aten_api.register(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    return bind(nonzero_static_p, x, size=int(size), fill_value=int(fill_value), batch_dims=0)
