"""Vectorization: the Batched level (vmap) and the batching rules.

A value of a Batched level is a payload with one extra dimension, ``bdim``, that runs over
the examples; the level hides it, so user code sees the shape of one example. A rule takes
the payloads and their bdims (``None`` for an unbatched constant) and returns
``(out, out_bdim)``. Every rule issues one batched torch call (plus free views such as
permute or unsqueeze) and never loops over the batch. In JAX this is ``BatchTrace``.
"""
import collections
import contextlib
import math

import torch

from . import diagonals, ops, passes, torch_api
from . import tensor as tensor_module
from . import primitives as P
from .dispatch import Dispatcher, name_of, no_concrete_value
from .errors import (
    TransformUsageError,
    UnsupportedOperationError,
    missing_rule_error,
)
from .values import NUMBERS, Value, bind, map_tensors

batching_rules: dict = {}
# rules for ops on values of several nested vmaps at once (NOTE [Ops on values of several
# vmaps, in one step])
chain_rules: dict = {}
# the rule of random aten ops on batched values, registered by randomness.py
random_op_rule = None


class BatchedValue(Value):
    """A value of a Batched level: ``payload`` holds every example along dim ``bdim``."""

    __slots__ = ("bdim",)

    def __init__(self, dispatcher, payload, bdim, name=None):
        self.dispatcher = dispatcher  # (Value.__init__ written out: this is the hot path)
        self.payload = payload
        self._name = name
        self._metadata = None
        self.bdim = bdim

    def metadata(self):
        # Value.metadata and _own_metadata in one (this is the hot path: every op's result)
        metadata = self._metadata
        if metadata is None:
            payload = self.payload
            if isinstance(payload, Value):
                shape, dtype, device = payload.metadata()
            else:
                shape, dtype, device = payload.shape, payload.dtype, payload.device
            bdim = self.bdim
            shape = shape[1:] if bdim == 0 else shape[:bdim] + shape[bdim + 1:]
            metadata = self._metadata = (shape, dtype, device)
        return metadata


def _elementwise_result(level, out, bdim, metadata, prim):
    """NOTE [An elementwise result's metadata, from its operand's]
    An elementwise kernel on a batched value (and numbers, or a second batched value of the
    same example shape) gives a result of the operand's rank whose example has the operand's
    shape and device; only its dtype may differ (a comparison, a conversion). Where the
    operand's metadata is already known (under grad it is: Autograd.apply reads every
    input's dtype), the result's is written from it, instead of being read back from the
    payload later (torch.Size, slice and device objects made for every op: about a twentieth
    of vmap(grad)'s time per op). ``metadata`` is None where it does not apply: a result of
    another rank (view_as_real keeps the batch dim, and adds one); and a move to another
    device is the one such op that changes the device. (The front door does the same for
    the calls it takes: NOTE [vmap's elementwise ops at the front door] in tensor.py.)"""
    value = BatchedValue(level, out, bdim)
    if metadata is not None:
        value._metadata = (metadata[0], out.dtype,
                           out.device if prim is P.to_device_p else metadata[2])
    return value


def batched_level(value):
    """The innermost vmap level in a value's payload chain (None if it is batched nowhere)."""
    while isinstance(value, Value):
        if isinstance(value, BatchedValue):
            return value.dispatcher
        value = value.payload
    return None


class Batched(Dispatcher):
    """Vectorizing level: every value has a hidden batch dim of size ``length``.

    >>> import torch
    >>> from minifunctorch.core import Batched, Torch
    >>> d = Batched(Torch(), length=3)
    >>> xs = torch.arange(6.0).reshape(3, 2)   # explicit API: dim 0 is the batch
    >>> d.sum(xs).payload                      # one sum per example
    tensor([1., 5., 9.])
    """

    transform_name = "vmap"

    def __init__(self, inner, *, length, name="Batched", call=None, randomness="error"):
        super().__init__(inner, name=name, call=call or f"{name}(length={length})")
        self.length = length
        self.randomness = randomness

    def apply(self, prim, *args, **params):
        # NOTE [The commonest cases, written out]
        # An elementwise op on one batched value, or on a batched value and a number, keeps
        # the batch dim where it is; so does one on two batched values whose batch dims sit
        # at the same place in payloads of the same rank (a backward pass's ``ct * cos(x)``:
        # the examples then have the same rank, so the payloads broadcast and promote as the
        # examples do). That is what elementwise_batch and broadcasting_batch would compute,
        # without the lists and the call of a rule (this is the hot path).
        n = len(args)
        if n == 1 or (n == 2 and type(args[1]) in NUMBERS):
            x = args[0]
            if type(x) is not BatchedValue or x.dispatcher is not self:
                return bind(prim, *args, **params)
            if prim in _KEEPS_BDIM:
                payload = x.payload
                if type(payload) is torch.Tensor:  # the bottom level: torch computes it
                    out = prim.impl(payload, *args[1:], **params)
                    return _elementwise_result(self, out, x.bdim,
                                               x._metadata if out.dim() == payload.dim()
                                               else None, prim)
                return self._keeping_bdim(prim, x, args[1:], params)
        elif n == 2 and prim in _KEEPS_BDIM:
            x, y = args
            if type(x) is BatchedValue and type(y) is BatchedValue:
                if x.dispatcher is self and y.dispatcher is self and x.bdim == y.bdim:
                    x_payload, y_payload = x.payload, y.payload
                    if x_payload.dim() == y_payload.dim():
                        if type(x_payload) is torch.Tensor and type(y_payload) is torch.Tensor:
                            out = prim.impl(x_payload, y_payload, **params)
                            x_metadata, y_metadata = x._metadata, y._metadata
                            if (x_metadata is not None and y_metadata is not None
                                    and x_metadata[0] == y_metadata[0]):
                                return _elementwise_result(self, out, x.bdim, x_metadata, prim)
                        else:
                            out = bind(prim, x_payload, y_payload, **params)
                        return BatchedValue(self, out, x.bdim)
            else:  # NOTE [An unbatched tensor beside a batched value]
                out = None
                if type(x) is BatchedValue and x.dispatcher is self:
                    out = beside_a_tensor(prim, x, y, True, params)
                elif type(y) is BatchedValue and y.dispatcher is self:
                    out = beside_a_tensor(prim, y, x, False, params)
                if out is not None:
                    return out
        if len(args) == 1:
            x = args[0]
            if prim in _VIEWS:
                out = _view_of_chain(prim, x, params)
                if out is not None:
                    return out
            rule = batching_rules.get(prim)
            if rule is None:
                raise missing_rule_error(prim, "batching", "vmap")
            out, out_bdim = rule((x.payload,), (x.bdim,), **params)
            return out if out_bdim is None else BatchedValue(self, out, out_bdim)
        chain_rule = chain_rules.get(prim)
        if chain_rule is not None:  # NOTE [Ops on values of several vmaps, in one step]
            out = chain_rule(args, params)
            if out is not None:
                return out
        values, bdims, batched = [], [], False
        for a in args:
            if type(a) is BatchedValue and a.dispatcher is self:
                values.append(a.payload)
                bdims.append(a.bdim)
                batched = True
            else:
                values.append(a)
                bdims.append(None)
        if not batched:
            return bind(prim, *values, **params)
        rule = batching_rules.get(prim)
        if rule is None:
            raise missing_rule_error(prim, "batching", "vmap")
        out, out_bdim = rule(values, bdims, **params)
        if out_bdim is None:
            return out
        return BatchedValue(self, out, out_bdim)

    def _keeping_bdim(self, prim, x, rest, params):
        """An elementwise op on this level's value ``x`` and numbers ``rest``: the result keeps
        x's batch dim. The payload is the only value here, so its level is the top one."""
        payload = x.payload
        if type(payload) is BatchedValue:  # nested vmaps: the level below does the same
            out = payload.dispatcher._keeping_bdim(prim, payload, rest, params)
        elif isinstance(payload, Value):
            out = payload.dispatcher.apply(prim, payload, *rest, **params)
        else:  # the bottom level: torch computes it
            out = prim.impl(payload, *rest, **params)
        return BatchedValue(self, out, x.bdim)

    def wrap_input(self, value, bdim, name=None):
        return BatchedValue(self, value, bdim, name)

    def wrap_adopted(self, payload, original):
        size = ops.shape_of(payload)[0] if ops.shape_of(payload) else None
        if size != self.length:
            raise TransformUsageError(
                f"{self.name}: a tensor given to a Batched level directly is read as a batch "
                f"along dim 0 of size {self.length}, got shape {ops.shape_of(payload)}. "
                "Fix: stack the examples along dim 0."
            )
        return BatchedValue(self, payload, 0, name_of(original))

    def lower(self, value):
        return move_bdim(value.payload, value.bdim, 0)

    def lower_to_dim(self, value, dim):
        """A value seen from the level below, its batch dim at ``dim`` (an unbatched value
        gets a size-1 dim there, to broadcast along the batch)."""
        if isinstance(value, BatchedValue) and value.dispatcher is self:
            return move_bdim(value.payload, value.bdim, dim % (value.payload.dim()))
        return ops.unsqueeze(value, dim % (ops.shape_of(value).__len__() + 1))

    def concrete(self, value):
        # torch.func's words for both cases (it tells .item() from bool(); this level is
        # asked for the concrete value either way)
        raise no_concrete_value(self.call, "It looks like you're calling .item() on a Tensor or "
                                "attempting to use a Tensor in some data-dependent control "
                                "flow: Python asked for a concrete value (bool(), .item(), "
                                "an if statement)")

    draws_random_numbers = True

    def random_op(self, name, run, values, kwargs):
        """A random aten op on batched values: its draws follow vmap's ``randomness``. The
        rule lives in randomness.py (NOTE [Randomness under vmap]), which registers it as
        ``random_op_rule`` (it imports this module, not the other way round)."""
        return random_op_rule(self, name, run, values, kwargs)

    def unknown_op(self, name, run, values, kwargs):
        """NOTE [The per-example fallback]
        An aten op with no batching rule and no decomposition runs once per example, and the
        results are stacked: correct, but a Python loop of ``length`` calls where a rule
        makes one. torch.func has the same slow path. Every use is counted, so that
        ``capture_fallbacks`` (and the coverage report) can name the ops that need a rule."""
        for counts in (fallback_counts, *_active_fallback_captures):
            counts[name] += 1
        if self.length == 0:
            raise UnsupportedOperationError(
                f"{self.call}: The fallback path does not support vmap over dims of size 0: "
                f"{name} has no batching rule, and its per-example fallback needs at least one "
                "example, but the batch is empty. Fix: call it on a non-empty batch."
            )

        def example(i):
            def select(v):
                if isinstance(v, BatchedValue) and v.dispatcher is self:
                    v = ops.getitem(v.payload, (slice(None),) * v.bdim + (i,))
                    # an op that reads the layout (as_strided) must see the example's own
                    # storage, not an offset into the batch's
                    return v.clone().resolve_conj() if isinstance(v, torch.Tensor) else v
                return v
            return map_tensors(select, (values, kwargs))

        # a lazily conjugated plain result (aten._conj) is made concrete before stacking
        outputs = [map_tensors(lambda t: t.resolve_conj() if isinstance(t, torch.Tensor) else t,
                               run(*example(i))) for i in range(self.length)]
        return self._stack_examples(name, outputs)

    def _stack_examples(self, name, outputs):
        first = outputs[0]
        if isinstance(first, (list, tuple)):
            return type(first)(self._stack_examples(name, [o[k] for o in outputs])
                               for k in range(len(first)))
        if isinstance(first, (torch.Tensor, Value)):
            return BatchedValue(self, ops.stack(outputs, 0), 0)
        if any(o != first for o in outputs):
            raise UnsupportedOperationError(
                f"{self.call}: {name} returned a Python value that differs between examples "
                f"({first!r}, ...), which vmap cannot batch. Fix: return tensors."
            )
        return first


# --- the per-example fallback, counted -------------------------------------------------------
fallback_counts: collections.Counter = collections.Counter()
_active_fallback_captures: list = []


@contextlib.contextmanager
def capture_fallbacks():
    """Count the aten ops that vmap ran example by example inside the block.

    >>> import torch
    >>> from minifunctorch.core import capture_fallbacks, vmap
    >>> with capture_fallbacks() as used:
    ...     _ = vmap(torch.sin)(torch.ones(3, 2))
    >>> dict(used)   # sin has a batching rule: no fallback
    {}
    """
    counts: collections.Counter = collections.Counter()
    _active_fallback_captures.append(counts)
    try:
        yield counts
    finally:
        _active_fallback_captures.remove(counts)


# --- helpers -----------------------------------------------------------------------------------
def move_bdim(x, bdim, destination):
    """Move the batch dim of ``x`` from ``bdim`` to ``destination`` (a permute)."""
    if bdim == destination:
        return x
    if type(x) is torch.Tensor:  # no level below: torch's own view (no checks, no bind)
        return x.movedim(bdim, destination)
    rank = len(ops.shape_of(x))
    dims = [d for d in range(rank) if d != bdim]
    dims.insert(destination, bdim)
    return ops.permute(x, *dims)


def batch_size(values, bdims):
    for value, bdim in zip(values, bdims):
        if bdim is not None:  # (a batched argument is a tensor or a value: it has .shape)
            return value.shape[bdim]
    raise AssertionError("a batching rule was called with no batched argument")


def to_front(values, bdims, *, expand_unbatched=False, size=None):
    """Move every batch dim to the front; optionally broadcast unbatched values along it (to
    ``size``, where none of ``values`` is batched to tell it)."""
    if expand_unbatched and size is None:
        size = batch_size(values, bdims)
    moved = []
    for value, bdim in zip(values, bdims):
        if bdim is not None:
            moved.append(move_bdim(value, bdim, 0))
        elif expand_unbatched and not isinstance(value, NUMBERS):
            moved.append(ops.expand(ops.unsqueeze(value, 0), size, *ops.shape_of(value)))
        else:
            moved.append(value)
    return moved


def same_shape_batch(prim):
    """Rule of a primitive whose tensor arguments have one shape (an identity-like op with a
    side tensor of its input's rank; a kernel that does not broadcast, as gelu_backward):
    every argument gets the batch dim in front, and an unbatched one is expanded along it."""
    def rule(values, bdims, **params):
        return bind(prim, *to_front(values, bdims, expand_unbatched=True), **params), 0
    return rule


def physical_dim(dim, bdim):
    """Where logical dim ``dim`` of one example lives in a payload batched at ``bdim``."""
    return dim if dim < bdim else dim + 1


# elementwise primitives, whose rule keeps the batch dim in place when the operands line up
# (one batched value and a number, or two batched values with the same bdim and rank):
# Batched.apply applies them directly then (NOTE [The commonest cases, written out])
_KEEPS_BDIM: set = set()
# (the front door does the commonest of these cases itself: NOTE [vmap's elementwise ops at
# the front door] in tensor.py)


def chain_to_bottom(x):
    """``(links, bottom)`` for a chain of BatchedValues of running levels over a plain tensor
    (the values of the chain, innermost level first, and the tensor); None for any other
    value (a level of grad or jvp in the chain, a traced tensor at the bottom, a level whose
    transform has returned)."""
    links = []
    while type(x) is BatchedValue:
        if x.dispatcher.exited:
            return None
        links.append(x)
        x = x.payload
    if type(x) is not torch.Tensor:
        return None
    return links, x


tensor_module.batched_value_type = BatchedValue
tensor_module.keeps_batch_dim = _KEEPS_BDIM
tensor_module.chain_to_bottom = chain_to_bottom


def elementwise_batch(prim):
    """Rule of a one-input op that acts element by element: the batch dim stays in place."""
    def rule(values, bdims, **params):
        return bind(prim, *values, **params), bdims[0]
    _KEEPS_BDIM.add(prim)
    return rule


for _prim in (P.neg_p, P.exp_p, P.log_p, P.sin_p, P.cos_p, P.tanh_p, P.sigmoid_p, P.relu_p,
              P.abs_p, P.sqrt_p, P.sign_p, P.full_like_p, P.convert_p, P.detach_p, P.clone_p,
              P.to_device_p, P.no_grad_p):
    batching_rules[_prim] = elementwise_batch(_prim)


# the rules that broadcasting_batch made (a primitive may have its rule replaced after:
# gelu_backward's kernel does not broadcast)
_BROADCASTING_RULES: set = set()


def beside_a_tensor(prim, batched, tensor, batched_first, params):
    """NOTE [An unbatched tensor beside a batched value]
    ``params[k] - lr * grads[k]`` in a MAML step, or ``x * mask``: a vmap value over a plain
    tensor, and an unbatched tensor with no more dims than an example. When the unbatched
    tensor has at least one dim and the batch dim lies left of every dim it broadcasts
    against, torch's broadcasting of the payload with it is the examples' broadcasting, and
    its type promotion is theirs (both operands have dims in either view; a 0-d tensor
    promotes as a number beside a tensor, so it takes broadcasting_batch's path). The kernel
    then runs on the payload as it is, and the result keeps the batch dim: what
    broadcasting_batch computes, without the general path's lists and second bind (a (40,)
    tensor minus 8 examples at the front door: 8.6 us, against 14.4 through the rule and 3.7
    for torch.func, in C++). A 2-d payload of an op that keeps a diagonal goes to the rule,
    which may have a cheaper kernel for it (NOTE [An identity basis is a diagonal matrix,
    eagerly]), and so does an op whose rule is not broadcasting_batch's (gelu_backward's
    kernel does not broadcast). Returns the result's value, or None where the rule decides."""
    payload = batched.payload
    if (type(payload) is not torch.Tensor or not isinstance(tensor, torch.Tensor)
            or batching_rules.get(prim) not in _BROADCASTING_RULES):
        return None
    rank = payload.dim()
    if not 0 < tensor.dim() < rank - batched.bdim or (
            rank == 2 and prim in passes.keeps_diagonal):
        return None
    out = (prim.impl(payload, tensor, **params) if batched_first
           else prim.impl(tensor, payload, **params))
    return BatchedValue(batched.dispatcher, out, batched.bdim)


tensor_module.beside_a_tensor = beside_a_tensor


def broadcasting_batch(prim):
    """Rule of an op whose tensor arguments broadcast together (add, mul, where, ...).
    (With one batched tensor and a number, Batched.apply computes it directly.)

    When every batched argument has the same bdim and the full rank, and the batch dim sits
    left of every dim an unbatched argument broadcasts against, the payloads already line
    up. Otherwise batch dims move to the front and batched arguments get size-1 dims after
    it, so that broadcasting from the right never meets the batch dim.
    """
    _KEEPS_BDIM.add(prim)

    def rule(values, bdims, **params):
        if prim in passes.keeps_diagonal and len(values) == 2 and bdims[0] == 0 and (
                bdims[1] is None):  # NOTE [An identity basis is a diagonal matrix, eagerly]
            out = diagonals.elementwise_of_diagonal(prim, values[0], values[1], params)
            if out is not None:
                return out, 0
        # fast path: the batched operands share one bdim and rank; the rest are numbers, or
        # (with the batch dim in front) tensors of 1 to rank - 1 dims, which broadcast against
        # the logical dims only and promote dtypes as they would unbatched (no 0-d operand)
        shared_bdim, shared_rank, aligned, unbatched_ranks = None, None, True, []
        for value, bdim in zip(values, bdims):
            if bdim is None:
                if not isinstance(value, NUMBERS):
                    unbatched_ranks.append(value.dim())
            elif shared_bdim is None:
                shared_bdim, shared_rank = bdim, value.dim()
            else:
                aligned = aligned and bdim == shared_bdim and value.dim() == shared_rank
        if aligned and unbatched_ranks:
            aligned = shared_bdim == 0 and all(0 < r < shared_rank for r in unbatched_ranks)
        if aligned:
            return bind(prim, *values, **params), shared_bdim
        ranks = [len(ops.shape_of(v)) - (b is not None) for v, b in zip(values, bdims)]
        values = promote_logically(prim, values, ranks, bdims)
        out_rank = max(ranks)
        batched = {b for b in bdims if b is not None}
        if len(batched) == 1:
            bdim = next(iter(batched))
            aligned = True
            for value, b, rank in zip(values, bdims, ranks):
                if b is not None:
                    aligned = aligned and rank == out_rank
                elif not isinstance(value, NUMBERS):
                    aligned = aligned and bdim < out_rank + 1 - rank
            if aligned:
                return bind(prim, *values, **params), bdim
        return bind(prim, *in_front_and_lined_up(values, bdims, ranks), **params), 0
    _BROADCASTING_RULES.add(rule)
    return rule


def in_front_and_lined_up(values, bdims, ranks):
    """Batch dims in front, and a batched value of fewer logical dims (``ranks``) than the
    most given size-1 dims after its batch dim, so that broadcasting from the right lines up
    the logical dims and never meets the batch dim. Unbatched values stay as they are."""
    out_rank = max(ranks)
    moved = []
    for value, bdim, rank in zip(values, bdims, ranks):
        if bdim is None:
            moved.append(value)
            continue
        value = move_bdim(value, bdim, 0)
        if rank < out_rank:
            shape = ops.shape_of(value)
            value = ops.reshape(value, shape[0], *([1] * (out_rank - rank)), *shape[1:])
        moved.append(value)
    return moved


for _prim in (P.add_p, P.sub_p, P.mul_p, P.div_p, P.div_rounding_p, P.pow_p, P.eq_p, P.ne_p,
              P.lt_p, P.le_p, P.gt_p, P.ge_p, P.where_p):
    batching_rules[_prim] = broadcasting_batch(_prim)


def promote_logically(prim, values, ranks, bdims):
    """NOTE [Type promotion sees one example]
    torch promotes dtypes by rank: a 0-d tensor does not raise the dtype of a tensor with
    dims (``f32[3] + f64[]`` is f32), but two 0-d tensors promote (``f32[] + f64[]`` is f64).
    Under vmap a 0-d example has a batched payload with one dim, so the payloads would
    promote differently from the examples. When the tensor operands' dtypes differ, the
    result dtype is worked out for the examples' ranks, and the operands converted to it."""
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, (torch.Tensor, Value))]
    if prim is P.where_p:
        tensors = tensors[1:] if tensors and tensors[0][0] == 0 else tensors
    dtypes = {v.dtype for _, v in tensors}
    if len(dtypes) <= 1:
        return values
    if prim is P.sub_p and torch.bool in dtypes and all(
            ranks[i] for i, _ in tensors if bdims[i] is not None):
        # torch refuses a bool operand of a subtraction, and so does torch.func unless an
        # example is a number (which it converts first, as here): the kernel says so
        return values
    dtype = ops.promoted_dtype([(v.dtype, ranks[i]) for i, v in tensors])
    values = list(values)
    for i, v in tensors:
        values[i] = ops.convert(v, dtype)
    return values


def reduction_batch(prim):
    """Rule of a reduction over ``dim``: reduce the matching physical dims in place.

    NOTE [An empty dim tuple under vmap]
    torch reads ``dim=()`` as "every dim", so passing it on to the payload would reduce the
    batch dim too. The ops give ``dim=()`` for a 0-d example: the op then reduces a size-1
    dim added beside the batch dim, which is the op on each number. (That is not always the
    number itself: sum promotes integers, and the logsumexp of a complex z is log(exp(z)),
    whose imaginary part wraps into (-pi, pi].) For an example with dims, ``()`` means all
    of them.
    """
    def rule(values, bdims, *, dim, keepdim):
        (x,), (bdim,) = values, bdims
        if not dim:
            rank = len(ops.shape_of(x)) - 1
            if rank == 0:  # (the payload is (B,): its one dim is the batch dim)
                out = bind(prim, ops.unsqueeze(x, 1), dim=(1,), keepdim=False)
                return out, 0
            dim = tuple(range(rank))
        out = bind(prim, x, dim=tuple(physical_dim(d, bdim) for d in dim), keepdim=keepdim)
        out_bdim = bdim if keepdim else bdim - sum(1 for d in dim if d < bdim)
        return out, out_bdim
    return rule


for _prim in (P.sum_p, P.mean_p, P.amax_p, P.amin_p, P.logsumexp_p):
    batching_rules[_prim] = reduction_batch(_prim)


def softmax_like_batch(prim):
    def rule(values, bdims, *, dim):
        (x,), (bdim,) = values, bdims
        if len(ops.shape_of(x)) == 1:
            # 0-d examples: the softmax of one number, over a size-1 dim given to it
            return ops.squeeze(bind(prim, ops.unsqueeze(x, 1), dim=1), 1), 0
        return bind(prim, x, dim=physical_dim(dim, bdim)), bdim
    return rule


batching_rules[P.softmax_p] = softmax_like_batch(P.softmax_p)
batching_rules[P.log_softmax_p] = softmax_like_batch(P.log_softmax_p)


def softmax_backward_batch(prim):
    """The kernel takes a cotangent and an output of one shape: as in torch.func, both batch
    dims move to the front and an unbatched operand is expanded along the batch."""
    def rule(values, bdims, *, dim):
        ct, out = to_front(values, bdims, expand_unbatched=True)
        if len(ops.shape_of(ct)) == 1:  # 0-d examples, as in softmax_like_batch
            return ops.squeeze(bind(prim, ops.unsqueeze(ct, 1), ops.unsqueeze(out, 1), dim=1),
                               1), 0
        return bind(prim, ct, out, dim=dim + 1), 0
    return rule


batching_rules[P.softmax_backward_p] = softmax_backward_batch(P.softmax_backward_p)
batching_rules[P.log_softmax_backward_p] = softmax_backward_batch(P.log_softmax_backward_p)


# --- linear algebra ----------------------------------------------------------------------------
def matmul_batch(values, bdims):
    """Batched matmul with torch.matmul's vector and broadcasting semantics.

    Vectors are viewed as matrices (x: 1 x k, y: k x 1), batched operands get their batch
    dim in front and size-1 dims so that the logical batch dims line up, and the added dims
    are dropped afterwards. Per-example outer products (an inner size of 1) and dot products
    use a broadcast multiply rather than a matmul with an inner dimension of 1.
    """
    (x, y), (x_bdim, y_bdim) = values, bdims
    x_rank = len(ops.shape_of(x)) - (x_bdim is not None)
    y_rank = len(ops.shape_of(y)) - (y_bdim is not None)
    x, y = to_front([x, y], [x_bdim, y_bdim])
    if x_rank == 1 and y_rank == 1:
        # a dot product per example
        return ops.sum(ops.mul(x, y), -1), 0
    if x_bdim is None and x_rank == 2 and y_rank == 1:
        # (n, k) @ (B, k): one matrix product (B, k) @ (k, n)
        out = diagonals.times_columns(x, y)  # NOTE [An identity basis is a diagonal matrix,
        if out is not None:                  # eagerly] (diagonals.py)
            return out, 0
        return ops.matmul(y, ops.transpose(x, 0, 1)), 0
    if x_bdim is None and x_rank == 2 and y_rank >= 2 and ops.shape_of(y)[-1] == 1:
        # (n, k) @ (B, ..., k, 1), a batch of column vectors, would broadcast x into a batched
        # matmul that reads it once per example. Transposed, the batch sits on the left,
        # (B, ..., 1, k) @ (k, n), which torch folds into one matrix product. (For full
        # matrices, m > 1, the broadcast matmul is the better kernel: its result is
        # contiguous.)
        return ops.transpose(ops.matmul(ops.transpose(y, -1, -2), ops.transpose(x, 0, 1)),
                             -1, -2), 0
    if (y_bdim is None and x_rank == 1 and y_rank == 2 and type(x) is torch.Tensor
            and x.is_contiguous()):
        # (B, k) @ (k, n), the examples' rows contiguous: one matrix product as it stands,
        # the one that the vector-as-matrix path below makes through an unsqueeze and a
        # squeeze (a jacrev's pullback of every ``matrix @ vector``). Of any other layout,
        # torch.matmul folds the (B, 1, k) view differently, so that keeps the path below,
        # whose bits are torch.func's.
        out = diagonals.rows_times(x, y)  # NOTE [An identity basis is a diagonal matrix,
        if out is not None:               # eagerly] (diagonals.py)
            return out, 0
        return ops.matmul(x, y), 0
    if x_rank == 1:
        x = ops.unsqueeze(x, -2)
    if y_rank == 1:
        y = ops.unsqueeze(y, -1)
    # logical batch dims (all but the last two) must line up for the batched operands
    x_batch_rank, y_batch_rank = max(x_rank, 2) - 2, max(y_rank, 2) - 2
    batch_rank = max(x_batch_rank, y_batch_rank)
    if x_bdim is not None and x_batch_rank < batch_rank:
        shape = ops.shape_of(x)
        x = ops.reshape(x, shape[0], *([1] * (batch_rank - x_batch_rank)), *shape[1:])
    if y_bdim is not None and y_batch_rank < batch_rank:
        shape = ops.shape_of(y)
        y = ops.reshape(y, shape[0], *([1] * (batch_rank - y_batch_rank)), *shape[1:])
    if ops.shape_of(x)[-1] == 1 and not _large_outer_product(x, y):
        out = ops.mul(x, y)  # an outer product: broadcast, not a matmul with inner size 1
    else:
        out = ops.matmul(x, y)
    if x_rank == 1:
        out = ops.squeeze(out, -2)
    if y_rank == 1:
        out = ops.squeeze(out, -1)
    return out, 0


batching_rules[P.matmul_p] = matmul_batch


# NOTE [Outer products: a broadcast multiply, or a matmul when they are large]
# A per-example outer product ((B, m, 1) @ (B, 1, n): the weight gradient of a linear layer
# under vmap(grad)) is a broadcast multiply: for small operands it costs a fraction of a
# batched matmul's call (1.5 us against 4.7 us at (8, 40, 1), 55 against 81 us at
# (256, 10, 128), one thread). A large one is bound by writing its result, and on a CPU the
# multiply writes it as fast as torch.func's batched matmul or faster, measured in the
# program that makes it (S2's per-sample gradients; the table in NOTE [Kernel choices that
# depend on the CPU], kernels.py): so on a CPU it is the multiply at every size. On a GPU,
# from 4M elements of result on, it is torch.func's batched matmul. Both compute one product
# per element, so the bits are the same either way.
_LARGE_OUTER_PRODUCT = 1 << 22


def _large_outer_product(x, y):
    if x.device.type == "cpu":
        return False
    shape = ops.broadcast_shapes(ops.shape_of(x)[:-2], ops.shape_of(y)[:-2])
    return math.prod(shape) * ops.shape_of(x)[-2] * ops.shape_of(y)[-1] >= _LARGE_OUTER_PRODUCT


# --- shape -------------------------------------------------------------------------------------
# NOTE [A view of nested batched values in one step]
# Under nested vmaps (vmap(jacrev(f)) is two, the NTK's vmap(vmap(vjp ... vmap)) three) a
# value is a chain of BatchedValues, one per level that batches it, over one tensor. A view
# op on it, level by level, runs each level's rule, which moves that level's batch dim in
# front with a permute bound one level down, then binds the view there: k levels make about
# 2k applies for one reshape, and the batching rules of convolutions make many reshapes.
# What the levels compute in the end is plain: the bottom tensor with every batch dim in
# front, outermost first, then the view with its dims shifted past them, and batch dim 0 at
# every level. So a chain of only BatchedValues over a plain tensor is viewed in one step,
# with that very layout (so the values and strides are those of the level-by-level path).
# Any other chain (a level of grad or jvp inside it, a traced tensor at the bottom, a level
# whose transform has returned) takes the rules. functorch's first BatchedTensor did the
# same with one wrapper of several batch dims (its ``BatchDims``); torch.func now keeps
# one wrapper per level and pays the walk in C++.
def _view_of_chain(prim, x, params):
    """A view primitive on this level's value ``x``, computed on the bottom tensor if ``x``
    is a chain of BatchedValues; None where the rules must run."""
    chain = chain_to_bottom(x)
    if chain is None:
        return None
    links, x = chain  # innermost level first
    k = len(links)
    x = _batch_dims_in_front(x, links)
    if prim is P.reshape_p:
        out = x.reshape((*x.shape[:k], *params["shape"]))
    elif prim is P.permute_p:
        out = x.permute(*range(k), *[d + k for d in params["dims"]])
    elif prim is P.unsqueeze_p:
        out = x.unsqueeze(params["dim"] + k)
    elif prim is P.squeeze_p:
        out = x.squeeze(tuple([d + k for d in params["dim"]]))
    else:  # expand: missing leading dims are new dims of size 1, after the batch dims
        shape = params["shape"]
        missing = len(shape) - (x.dim() - k)
        if missing:
            x = x.reshape((*x.shape[:k], *(1,) * missing, *x.shape[k:]))
        out = x.expand((*x.shape[:k], *shape))
    for link in reversed(links):
        out = BatchedValue(link.dispatcher, out, 0)
    return out


_VIEWS = frozenset((P.reshape_p, P.permute_p, P.unsqueeze_p, P.squeeze_p, P.expand_p))


# NOTE [Ops on values of several vmaps, in one step]
# The reasoning of NOTE [A view of nested batched values in one step] extends to ops whose
# rules fold batch dims into a kernel's call. The NTK's jvp convolves an input batched by
# one vmap with a weight tangent batched by two others: level by level, each rule folds its
# own batch dim (a reshape bound one level down), binds the convolution one level down and
# unfolds the result, so three levels make about ten applies around one kernel call. Where
# all the levels can be folded at once, a "chain rule" does it on the bottom tensors: each
# operand with its batch dims in front, outermost level first, one kernel call, and the
# result batched at dim 0 of every level, as the level-by-level path leaves it.
# ``chain_rules[prim](args, params)`` returns that value, or None where the one-level rules
# must run (a chain rule takes only the cases it is written for). The convolutions have
# them (nn.py). Elementwise ops do not: measured on the tutorial programs, folding their
# levels at once was no faster than the rules' fast paths. functorch's first BatchedTensor
# held several batch dims in one wrapper (``BatchDims``) and its rules saw them all; here
# the rules stay per level and a few take the shortcut.
def _batch_dims_in_front(x, links):
    """The bottom tensor ``x`` of a chain of BatchedValues (``links``, innermost level first)
    with every batch dim in front, outermost level first, then the example's dims."""
    k = len(links)
    if k == 1:  # (the common case, written out)
        bdim = links[0].bdim
        return x.movedim(bdim, 0) if bdim else x
    dims = list(range(x.dim()))
    order = [dims.pop(link.bdim) for link in reversed(links)]  # outermost first
    order += dims
    return x if order == sorted(order) else x.permute(order)


def bottom_operands(args):
    """For a chain rule: each argument as (the numbers of the levels that batch it, outermost
    first; its bottom tensor with those batch dims in front, in that order), or None for an
    argument that is not a tensor; and the levels by number. None where an argument is not a
    chain of BatchedValues of running levels over a plain tensor, or where only one level
    batches anything (its own rule is as cheap)."""
    operands, levels = [], {}
    for a in args:
        if a is None or type(a) in NUMBERS:
            operands.append(None)
            continue
        chain = chain_to_bottom(a)
        if chain is None:
            return None
        links, a = chain
        for link in links:
            levels[link.dispatcher.level] = link.dispatcher
        own = tuple(link.dispatcher.level for link in reversed(links))
        operands.append((own, _batch_dims_in_front(a, links) if links else a))
    if len(levels) < 2:
        return None
    return operands, levels


def level_sizes(operands):
    """The batch size of every level that batches one of the ``bottom_operands``."""
    sizes = {}
    for operand in operands:
        if operand is not None:
            own, t = operand
            sizes.update(zip(own, t.shape))
    return sizes


def fold_levels(t, own, groups):
    """A bottom tensor ``t`` (batch dims of the levels ``own`` in front, then the example's
    dims) with the batch dims of each list of levels in ``groups`` merged into one of the
    example's dims: ``groups`` maps a dim of the example (0, 1, ...) to the levels whose batch
    dims are put right before it, in the order listed, and merged with it. Returns the folded
    tensor (a permute and a reshape)."""
    k = len(own)
    sizes = t.shape  # (read once: each read makes a torch.Size)
    position = {number: i for i, number in enumerate(own)}
    order, shape = [], []
    for d in range(len(sizes) - k):
        size = sizes[k + d]
        merged = groups.get(d)
        if merged:
            for number in merged:
                order.append(position[number])
                size *= sizes[position[number]]
        order.append(k + d)
        shape.append(size)
    assert len(order) == len(sizes), "every batch dim of a folded operand must be merged somewhere"
    if order != list(range(len(order))):
        t = t.permute(order)
    return t.reshape(shape)


def unfold_levels(out, groups, sizes, order):
    """The inverse of ``fold_levels`` for a kernel's result: the levels merged into each dim
    of ``out`` (``groups``, as there; ``sizes`` their batch sizes) are split off and moved in
    front in level order (``order``, outermost first), every level in ``order`` being merged
    somewhere."""
    out_sizes = out.shape  # (read once: each read makes a torch.Size)
    shape, where, own_dims = [], {}, []
    for d, size in enumerate(out_sizes):
        merged = groups.get(d)
        if merged:
            for number in merged:
                where[number] = len(shape)
                shape.append(sizes[number])
                size //= sizes[number]
        own_dims.append(len(shape))
        shape.append(size)
    permutation = [where[number] for number in order] + own_dims
    return out.reshape(shape).permute(permutation)


def batched_by_every_level(out, levels):
    """A plain tensor with one batch dim per level in front (outermost first) as the value of
    the innermost of ``levels`` (a dict by level number), batched at dim 0 at every level."""
    for number in sorted(levels):
        out = BatchedValue(levels[number], out, 0)
    return out




def permute_batch(values, bdims, *, dims):
    (x,), (bdim,) = values, bdims
    physical = (bdim,) + tuple(physical_dim(d, bdim) for d in dims)
    return bind(P.permute_p, x, dims=physical), 0
batching_rules[P.permute_p] = permute_batch


def reshape_batch(values, bdims, *, shape):
    (x,), (bdim,) = values, bdims
    x = move_bdim(x, bdim, 0)
    return bind(P.reshape_p, x, shape=(ops.shape_of(x)[0],) + shape), 0
batching_rules[P.reshape_p] = reshape_batch


def unsqueeze_batch(values, bdims, *, dim):
    (x,), (bdim,) = values, bdims
    return bind(P.unsqueeze_p, move_bdim(x, bdim, 0), dim=dim + 1), 0
batching_rules[P.unsqueeze_p] = unsqueeze_batch


def squeeze_batch(values, bdims, *, dim):
    (x,), (bdim,) = values, bdims
    return bind(P.squeeze_p, move_bdim(x, bdim, 0), dim=tuple(d + 1 for d in dim)), 0
batching_rules[P.squeeze_p] = squeeze_batch


def expand_batch(values, bdims, *, shape):
    (x,), (bdim,) = values, bdims
    x = move_bdim(x, bdim, 0)
    x_shape = ops.shape_of(x)
    missing = len(shape) - (len(x_shape) - 1)
    if missing:
        x = ops.reshape(x, x_shape[0], *([1] * missing), *x_shape[1:])
    return bind(P.expand_p, x, shape=(x_shape[0],) + shape), 0
batching_rules[P.expand_p] = expand_batch


def cat_batch(values, bdims, *, dim):
    moved = to_front(values, bdims, expand_unbatched=True)
    return bind(P.cat_p, *moved, dim=dim + 1), 0
batching_rules[P.cat_p] = cat_batch


def getitem_batch(values, bdims, *, index):
    (x,), (bdim,) = values, bdims
    return bind(P.getitem_p, move_bdim(x, bdim, 0), index=(slice(None),) + index), 0
batching_rules[P.getitem_p] = getitem_batch


def scatter_index_batch(values, bdims, *, index, shape):
    (x,), (bdim,) = values, bdims
    x = move_bdim(x, bdim, 0)
    return bind(P.scatter_index_p, x, index=(slice(None),) + index,
                shape=(ops.shape_of(x)[0],) + shape), 0
batching_rules[P.scatter_index_p] = scatter_index_batch


def diagonal_batch(values, bdims, *, offset, dim1, dim2):
    (x,), (bdim,) = values, bdims
    return bind(P.diagonal_p, move_bdim(x, bdim, 0), offset=offset, dim1=dim1 + 1,
                dim2=dim2 + 1), 0
batching_rules[P.diagonal_p] = diagonal_batch


def diagonal_scatter_batch(values, bdims, *, offset, dim1, dim2, shape):
    (x,), (bdim,) = values, bdims
    x = move_bdim(x, bdim, 0)
    return bind(P.diagonal_scatter_p, x, offset=offset, dim1=dim1 + 1, dim2=dim2 + 1,
                shape=(ops.shape_of(x)[0],) + shape), 0
batching_rules[P.diagonal_scatter_p] = diagonal_scatter_batch


def diag_embed_batch(values, bdims, *, offset, dim1, dim2):
    (x,), (bdim,) = values, bdims
    return bind(P.diag_embed_p, move_bdim(x, bdim, 0), offset=offset, dim1=dim1 + 1,
                dim2=dim2 + 1), 0
batching_rules[P.diag_embed_p] = diag_embed_batch


def _lift_0d(values, bdims):
    """gather and scatter_add read a 0-d operand as a 1-d one of size 1 (``gather(x_1d, 0,
    index_0d)`` is allowed), which a batch dim in front would break: every operand gets the
    batch dim in front, and the 0-d ones that size-1 dim explicitly after it."""
    ranks = [len(ops.shape_of(v)) - (b is not None) for v, b in zip(values, bdims)]
    moved = to_front(values, bdims, expand_unbatched=True)
    return [v if r else ops.unsqueeze(v, 1) for v, r in zip(moved, ranks)], ranks


def gather_batch(values, bdims, *, dim):
    (x, index), (x_rank, index_rank) = _lift_0d(values, bdims)
    if x_rank and index_rank:
        return bind(P.gather_p, x, index, dim=dim + 1), 0
    out = bind(P.gather_p, x, index, dim=1)
    return (out if index_rank else ops.squeeze(out, 1)), 0
batching_rules[P.gather_p] = gather_batch


def scatter_add_batch(values, bdims, *, dim, shape):
    (x, index), ranks = _lift_0d(values, bdims)
    size = ops.shape_of(x)[0]
    if all(ranks) and shape:
        return bind(P.scatter_add_p, x, index, dim=dim + 1, shape=(size,) + shape), 0
    out = bind(P.scatter_add_p, x, index, dim=1, shape=(size,) + (shape or (1,)))
    return (out if shape else ops.squeeze(out, 1)), 0
batching_rules[P.scatter_add_p] = scatter_add_batch


# --- .data ---------------------------------------------------------------------------------------
@torch_api.register(torch.Tensor.data.__get__)
def data(x):
    """NOTE [x.data under nested transforms]
    ``x.data`` is x without the history of x's own innermost level, while the levels outside
    it still see through it: under ``jacfwd(grad(f))``, ``x.data`` is a constant for grad
    and not for jacfwd (``x.detach()`` is a constant for both). In functorch, ``.data`` is a
    shallow copy of the tensor's wrapper detached at the wrapper's own level
    (``TensorWrapper::shallow_copy_and_detach``), whose inner tensor the outer levels still
    track. Here that is the value one level down, when x's innermost level is grad's or
    jvp's. Under vmap torch.func refuses it (a batched value has no single ``data`` to
    show), and so do we."""
    if isinstance(x, BatchedValue):
        raise UnsupportedOperationError(
            f"{x.dispatcher.call}: Tensor.data: accessing `data` under vmap transform is not "
            "allowed: the value holds every example of the batch. Fix: use x.detach().")
    if isinstance(x, Value) and x.dispatcher.differentiates:
        return x.payload
    return ops.detach(x)


@torch_api.register(torch.Tensor.data.__set__)
def set_data(x, new_data):
    """``x.data = t`` would swap the tensor under a transform's value: torch.func refuses it."""
    level = batched_level(x)
    where = "under vmap transform" if level is not None else "inside functorch transform"
    level = level or getattr(x, "dispatcher", None)
    call = f"{level.call}: " if level is not None else ""
    raise UnsupportedOperationError(
        f"{call}Tensor.data = ...: mutating directly with `.data` {where} is not allowed. Fix: "
        "compute the new value out of place and use it (or x.copy_(t) to write in place).")
