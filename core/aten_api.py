"""The back door: aten ops onto ``ops``, and what torch knows about each aten op.

A torch function that the front door (torch_api.py) does not know is handed back to torch,
whose C++ composite kernels lower it to aten ops; each aten op that receives a FuncTensor
reaches ``FuncTensor.__torch_dispatch__`` (tensor.py), which looks it up here:
- ``ATEN_OPS``: aten op (an overload, or a whole overload packet) -> op on engine values.
  Families of primitives register their own aten ops next to their rules.
- ``decomposition(op)``: torch's own Python decomposition of an aten op into other aten ops
  (``torch._decomp``), for the ops with no entry.
- ``functional_variant(op)``, ``is_view(op)``, ``changes_metadata(op)``: read off the op's
  schema, for functionalization and views.

NOTE [The aten vocabulary is a second vocabulary]
The course teaches the front door: the functions users write. The aten ops are torch's own
lower-level names for the same computations (``aten.var.correction``, ``aten._softmax``),
with every argument normalized. Mapping them onto the same ops, rather than onto new
primitives, keeps one set of rules: the back door adds breadth, not a second engine.
"""
import torch
import torch._decomp
import torch._refs  # noqa: F401  (registers torch.ops.prims, which the refs decompose to)

from . import ops
from . import primitives as P
from .errors import UnsupportedOperationError
from .values import batched_by_vmap, bind

aten = torch.ops.aten

ATEN_OPS: dict = {}


def register(*aten_ops):
    """Decorator: ``@register(aten.sin.default)`` maps aten ops onto the decorated function."""
    def decorate(function):
        for op in aten_ops:
            ATEN_OPS[op] = function
        return function
    return decorate


# --- what the schema says ------------------------------------------------------------------------
_VIEW_CACHE: dict = {}
_FUNCTIONAL_CACHE: dict = {}
# in-place ops that change the tensor's own shape (a view op applied in place)
_METADATA_OPS = {"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
                 "as_strided_"}


def is_view(op) -> bool:
    """Whether ``op`` returns a view of its first argument (its schema says ``Tensor(a)``)."""
    answer = _VIEW_CACHE.get(op)
    if answer is None:
        schema = op._schema
        answer = not schema.is_mutable and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        _VIEW_CACHE[op] = answer
    return answer


def _arguments(op):
    return [(a.name, str(a.type)) for a in op._schema.arguments]


def functional_variant(op):
    """The out-of-place overload of an in-place aten op (``add_.Tensor`` -> ``add.Tensor``).

    NOTE [Finding the out-of-place form by its schema]
    An in-place op and its out-of-place form take the same arguments, but their overload names
    need not agree (``pow_.Scalar`` is ``pow.Tensor_Scalar``; ``pow.Scalar`` takes a number as
    its base) and neither need the argument order (``polygamma_(self, n)`` against
    ``polygamma(n, self)``). So the form is the overload of the packet without ``_`` whose
    arguments have the same names and types, looked up once per op; when only the order
    differs, the call passes them by name. In PyTorch, functionalization pairs them in its
    code generator the same way, by the schema's "signature" (torchgen's ``FunctionSchema``)."""
    if op in _FUNCTIONAL_CACHE:
        return _FUNCTIONAL_CACHE[op]
    name = op.overloadpacket.__name__
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    functional = None
    if packet is not None:
        wanted = _arguments(op)
        candidates = [getattr(packet, o) for o in packet.overloads()]
        in_order = [c for c in candidates if _arguments(c) == wanted]
        if in_order:
            functional = in_order[0]
        else:
            reordered = [c for c in candidates if sorted(_arguments(c)) == sorted(wanted)]
            if reordered:
                functional = _by_name(reordered[0], [n for n, _ in wanted])
    _FUNCTIONAL_CACHE[op] = functional
    return functional


def _by_name(op, names):
    """``op`` called with the positional arguments of another schema, passed by name."""
    def call(*args, **kwargs):
        return op(**dict(zip(names, args)), **kwargs)
    call._schema = op._schema
    return call


def changes_metadata(op) -> bool:
    """Whether an in-place op changes its tensor's shape (``squeeze_``, ``t_``, ...)."""
    return op.overloadpacket.__name__ in _METADATA_OPS


# NOTE [Random ops that are constants]
# A random op whose numbers torch does not differentiate is a constant for grad and jvp:
# rand_like reads only a shape, and torch declares the derivatives of bernoulli's
# probabilities and of normal's mean and std zero (no reparameterization). A random op whose
# result does depend on its input (dropout multiplies it) is differentiable: it goes through
# its decomposition like any other op.
RANDOM_GENERATORS = {"rand_like", "randn_like", "randint_like", "bernoulli", "multinomial",
                     "normal", "uniform", "random", "exponential", "geometric", "log_normal",
                     "cauchy"}


def is_random_generator(op) -> bool:
    """Whether ``op`` draws random numbers that do not depend on its arguments' values."""
    return op.overloadpacket.__name__.rstrip("_") in RANDOM_GENERATORS


def decomposition(op):
    """torch's Python decomposition of ``op`` into other aten ops, if it has one."""
    return torch._decomp.decomposition_table.get(op)


# --- the table -----------------------------------------------------------------------------------
def concrete(x):
    """The concrete tensor behind a value (for ``.item()``, ``bool()``)."""
    return x.concrete() if hasattr(x, "concrete") else x


register(aten._local_scalar_dense.default)(lambda x: concrete(x).item())
register(aten.is_nonzero.default)(lambda x: bool(concrete(x)))


@register(aten.equal.default)
def _equal(x, y):
    if batched_by_vmap(x) or batched_by_vmap(y):  # (one bool for the whole batch)
        raise UnsupportedOperationError(
            "torch.equal(...): Batching rule not implemented for aten::equal. We could not "
            "generate a fallback (as in torch.func): equal answers with one Python bool, and "
            "under vmap each example has its own answer. Fix: compare per example, e.g. "
            "(x == y).all() returns a batched boolean tensor.")
    return bool(torch.equal(concrete(x), concrete(y)))


# elementwise, one input
for _name in ("neg", "exp", "log", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "sqrt",
              "sign"):
    register(getattr(aten, _name).default)(getattr(ops, _name))
register(aten.detach.default)(ops.detach)
register(aten.alias.default, aten.lift_fresh.default)(lambda x: x)


# elementwise, two inputs (scalars arrive as Python numbers)
def _binary(op):
    def with_alpha(x, y, alpha=1):
        return op(x, y, alpha=alpha)
    return with_alpha


register(aten.add.Tensor, aten.add.Scalar)(_binary(ops.add))
register(aten.sub.Tensor, aten.sub.Scalar)(_binary(ops.sub))
register(aten.rsub.Tensor, aten.rsub.Scalar)(lambda x, y, alpha=1: ops.sub(y, x, alpha=alpha))
register(aten.mul.Tensor, aten.mul.Scalar)(ops.mul)
register(aten.div.Tensor, aten.div.Scalar)(ops.div)
register(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)(ops.pow)
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(getattr(ops, _name))
register(aten.where.self)(ops.where)


# reductions
@register(aten.sum.default, aten.sum.dim_IntList)
def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return ops.sum(x, dim, keepdim, dtype=dtype)


@register(aten.mean.default, aten.mean.dim)
def _mean(x, dim=None, keepdim=False, *, dtype=None):
    return ops.mean(x, dim, keepdim, dtype=dtype)


register(aten.amax.default)(lambda x, dim=(), keepdim=False: ops.amax(x, dim, keepdim))
register(aten.amin.default)(lambda x, dim=(), keepdim=False: ops.amin(x, dim, keepdim))
register(aten.logsumexp.default)(lambda x, dim, keepdim=False: ops.logsumexp(x, dim, keepdim))
register(aten._softmax.default)(lambda x, dim, half_to_float: ops.softmax(x, dim))
register(aten._log_softmax.default)(lambda x, dim, half_to_float: ops.log_softmax(x, dim))


def _softmax_backward_data(prim):
    """aten's softmax kernels' vjps (torch's own backward graphs call them): the primitive, in
    the dtype of the forward's input."""
    def rule(ct, out, dim, input_dtype):
        dim = ops.normalize_dim(dim, len(ops.shape_of(out)), op=prim.name)
        result = bind(prim, ct, out, dim=dim)
        return result if input_dtype == result.dtype else ops.convert(result, input_dtype)
    return rule


register(aten._softmax_backward_data.default)(_softmax_backward_data(P.softmax_backward_p))
register(aten._log_softmax_backward_data.default)(
    _softmax_backward_data(P.log_softmax_backward_p))

# linear algebra
register(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default,
         aten.matmul.default)(ops.matmul)

# shape
register(aten.permute.default)(lambda x, dims: ops.permute(x, *dims))
register(aten.transpose.int)(ops.transpose)
register(aten.t.default)(ops.t)
register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)(
    lambda x, shape: ops.reshape(x, *shape))
register(aten.unsqueeze.default)(ops.unsqueeze)
register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)(ops.squeeze)
register(aten.expand.default)(lambda x, size, *, implicit=False: ops.expand(x, *size))
register(aten.cat.default)(ops.cat)
register(aten.diagonal.default)(ops.diagonal)
register(aten.diag_embed.default)(ops.diag_embed)
register(aten.gather.default)(ops.gather)
register(aten.scatter.src)(ops.scatter)


@register(aten.slice.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    index = (slice(None),) * (dim % max(x.dim(), 1)) + (slice(start, end, step),)
    return ops.getitem(x, index)


@register(aten.select.int)
def _select(x, dim, index):
    return ops.getitem(x, (slice(None),) * (dim % max(x.dim(), 1)) + (index,))


# creation and conversion
@register(aten.clone.default)
def _clone(x, *, memory_format=None):
    return ops.clone(x)


@register(aten._to_copy.default)
def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    return ops.to(x, dtype=dtype, device=device)


@register(aten.full_like.default)
def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return ops.full_like(x, fill_value, dtype=dtype)


register(aten.zeros_like.default)(
    lambda x, *, dtype=None, **ignored: ops.full_like(x, 0, dtype=dtype))
register(aten.ones_like.default)(
    lambda x, *, dtype=None, **ignored: ops.full_like(x, 1, dtype=dtype))
register(aten.empty_like.default)(
    lambda x, *, dtype=None, **ignored: ops.full_like(x, 0, dtype=dtype))


@register(aten.copy.default)
def _copy(x, source, non_blocking=False):
    """``x.copy_(source)`` computed out of place: source with x's shape, dtype and device."""
    out = ops.to(source, dtype=x.dtype, device=x.device)
    if ops.shape_of(out) != ops.shape_of(x):
        out = ops.expand(out, *ops.shape_of(x))
    return out


register(aten.fill.Scalar, aten.fill.Tensor)(ops.filled)
register(aten.zero.default)(lambda x: ops.zeros_like(x))
register(aten.lift_fresh_copy.default)(ops.clone)
register(aten.contiguous.default)(lambda x, memory_format=None: x)


def _new_tensor(creator):
    """``x.new_zeros(size)`` and its kin: a plain tensor, x's dtype and device by default."""
    def new(x, size, *fill, dtype=None, layout=None, device=None, pin_memory=None):
        return creator(size, *fill, dtype=dtype or x.dtype, device=device or x.device)
    return new


register(aten.new_zeros.default)(_new_tensor(torch.zeros))
register(aten.new_ones.default)(_new_tensor(torch.ones))
register(aten.new_empty.default)(_new_tensor(torch.zeros))
register(aten.new_full.default)(_new_tensor(torch.full))


# --- torch.ops.prims: the primitives of torch's own reference decompositions --------------------
# torch._refs writes many aten ops in terms of these; mapping them here lets those
# decompositions run on the engine. Their arguments are already normalized.
prims = torch.ops.prims

register(prims.convert_element_type.default)(ops.convert)
register(prims.reshape.default)(lambda x, shape: ops.reshape(x, *shape))
register(prims.squeeze.default)(lambda x, dimensions: ops.squeeze(x, tuple(dimensions)))
register(prims.transpose.default)(lambda x, permutation: ops.permute(x, *permutation))
register(prims.view_of.default)(lambda x: x)
register(prims.where.default)(ops.where)
register(prims.clone.default)(lambda x, *, memory_format=None: ops.clone(x))
register(prims.cat.default)(ops.cat)
register(prims.full_like.default)(
    lambda x, fill_value, *, dtype=None, device=None, requires_grad=False:
    ops.full_like(x, fill_value, dtype=dtype))
register(prims.fill.default)(lambda x, value: ops.full_like(x, value))
register(prims.item.default)(lambda x: concrete(x).item())
register(prims.device_put.default)(lambda x, device, non_blocking=False: ops.to(x, device=device))


@register(prims.broadcast_in_dim.default)
def _broadcast_in_dim(x, shape, broadcast_dimensions):
    """x's dims placed at ``broadcast_dimensions`` of ``shape``, then broadcast to it."""
    placed = [1] * len(shape)
    for source, target in enumerate(broadcast_dimensions):
        placed[target] = ops.shape_of(x)[source]
    return ops.expand(ops.reshape(x, *placed), *shape)


@register(prims.collapse_view.default, prims.collapse.default)
def _collapse(x, start, end):
    """Dims ``start`` up to (not including) ``end`` merged into one."""
    shape = ops.shape_of(x)
    merged = 1
    for size in shape[start:end]:
        merged *= size
    return ops.reshape(x, *shape[:start], merged, *shape[end:])


@register(prims.split_dim.default)
def _split_dim(x, dim, outer_length):
    shape = ops.shape_of(x)
    return ops.reshape(x, *shape[:dim], outer_length, shape[dim] // outer_length, *shape[dim + 1:])


def functional_write(op, x, source):
    """The new value of ``x`` for an in-place op with no out-of-place overload in aten (the
    prims' ``copy_to``): the same as ``x.copy_(source)``."""
    return _copy(x, source)


# in-place aten ops whose new value is computed by a function of their own, rather than by
# their out-of-place overload: ``write(op, *values, **kwargs)`` gives the written value, or
# NotImplemented to leave the op to its out-of-place overload (randomness.py adds the random
# fills, whose draws under vmap follow its randomness)
IN_PLACE_ONLY = {prims.copy_to.default: functional_write}


# --- composites that torch has no Python decomposition of -----------------------------------
@register(aten.addbmm.default)
def _addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """beta * x + alpha * (sum over the batch of batch1 @ batch2)."""
    product = ops.sum(ops.matmul(batch1, batch2), 0)
    product = product if alpha == 1 else ops.mul(product, alpha)
    if beta == 0:  # torch ignores x then (even nan)
        return ops.expand(product, *ops.shape_of(x)) if ops.shape_of(product) != ops.shape_of(x) \
            else product
    return ops.add(x if beta == 1 else ops.mul(x, beta), product)


@register(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    """softmax, with 0 (and a zero derivative) on the slices that are all -inf. The -inf
    slices are replaced by zeros before the softmax, so that no nan reaches its derivative."""
    if dtype is not None:
        x = ops.convert(x, dtype)
    empty = ops.all_true(ops.eq(x, float("-inf")), dim)
    safe = ops.where(empty, 0.0, x)
    return ops.where(empty, 0.0, ops.softmax(safe, dim))

