"""``torch.autograd.Function`` inside the transforms: a custom primitive with user rules.

NOTE [torch.autograd.Function inside a transform]
A Function's ``forward`` is ordinary torch code, so without special care a transform would
trace through it and ignore the hand-written ``backward`` (silently wrong). torch.func
avoids that by making every ``apply`` under a transform a call of the higher-order operator
``custom_function_call`` (torch/_functorch/autograd_function.py), which each functorch level
interprets with its own rule. Here each level does the same, one level at a time
(``_call``), like ``bind`` does for a primitive:
- Autograd: run the call one level down, show the inputs and outputs to ``setup_context``
  with the engine's own ``FunctionCtx``, and record tape entries whose backward closure calls
  the Function's ``backward`` (the vjp rule). Several outputs become one hidden entry for the
  call and one small entry per output that hands its cotangent over (NOTE [Several outputs
  on a tape]).
- Forward: run the call one level down, ``setup_context`` again, and the Function's ``jvp``
  gives the output tangents (the jvp rule).
- Batched: the Function's ``vmap`` staticmethod is the batching rule; with
  ``generate_vmap_rule=True`` the rule is a new Function whose forward, setup_context,
  backward and jvp are the user's, vmapped (``_vmapped_function``), applied one level down.
  That new Function is a real ``torch.autograd.Function``, so the levels below, and plain
  torch at the bottom, treat it as any other.
- Logger: prints the call and passes it down.
- At the bottom (no value left) the call is torch's own ``Function.apply`` on plain tensors,
  so a plain parameter that requires grad still gets the custom backward from torch (an
  outer ``.backward()``, as in MAML).
The forward itself therefore only ever runs on plain tensors, as in functorch.

How the call reaches ``_call``: ``Function.apply`` is a classmethod that torch runs before
any dispatch, and neither ``__torch_function__`` nor a TorchFunctionMode sees it (torch.func
itself needs a hook inside ``apply``: ``_are_functorch_transforms_active``). So this module
wraps ``torch.autograd.Function.apply`` once, at import: when no minifunctorch transform is
running and no argument is a FuncTensor, the wrapper calls torch's own ``apply`` unchanged;
otherwise the call goes to the engine. What torch.func refuses is refused the same way (a
Function without ``setup_context``, a missing ``jvp`` or vmap rule).
"""
import functools
import inspect
import weakref
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import grad_mode, ops, pytree
from .autograd import Autograd, AutogradValue, TapeEntry, sum_to_size
from .batching import Batched, BatchedValue
from .dispatch import Logger, LoggedValue, complex_not_supported, current_dispatcher
from .errors import MissingRuleError, TransformError, UnsupportedOperationError
from .forward import Forward, ForwardValue
from .names import fresh_name
from .primitives import Primitive
from .tensor import (FuncTensor, _write, as_tensor, as_tensors, engine_code, unwrap,
                     unwrap_tree, user_code)
from .values import Value, lower_tree, top_dispatcher


class AutogradFunctionError(TransformError, RuntimeError):
    """A torch.autograd.Function did something torch.func refuses with a RuntimeError (a
    backward with the wrong number of gradients, both vmap rules, ...)."""


_Function = torch.autograd.Function
_BASE_JVP = _Function.jvp
_BASE_VMAP = _Function.vmap
_BASE_SETUP_CONTEXT = torch.autograd.function._SingleLevelFunction.setup_context


class VmapInfo(NamedTuple):
    """The ``info`` argument of a Function's ``vmap`` staticmethod."""
    batch_size: int
    randomness: str


# --- the engine's ctx ---------------------------------------------------------------------------
class FunctionCtx:
    """The ``ctx`` a Function's ``setup_context``, ``backward`` and ``jvp`` receive inside a
    transform: saved tensors, ``needs_input_grad``, ``mark_non_differentiable``,
    ``set_materialize_grads``, and any attribute the Function sets."""

    def __init__(self, name, needs_input_grad):
        self._name = name
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._saved = ()
        self._saved_for_forward = ()
        self._non_differentiable = set()
        self._in_jvp = False
        self._inputs_shown = ()

    def _check_saved(self, tensors, method):
        for t in tensors:
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{self._name}: ctx.{method} only accepts tensors or None, "
                                f"got {type(t).__name__}. Fix: store it as a ctx attribute.")
        return tuple(tensors)

    def save_for_backward(self, *tensors):
        self._saved = self._check_saved(tensors, "save_for_backward")

    def save_for_forward(self, *tensors):
        self._saved_for_forward = self._check_saved(tensors, "save_for_forward")

    @property
    def saved_tensors(self):
        # as in torch: jvp sees what save_for_forward saved, backward what save_for_backward did
        return self._saved_for_forward if self._in_jvp else self._saved

    def mark_non_differentiable(self, *outputs):
        self._non_differentiable.update(id(o) for o in outputs)

    def set_materialize_grads(self, value):
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors):
        # the inputs that forward wrote in place, by position (NOTE [mark_dirty])
        shown = self._inputs_shown
        for t in tensors:
            for position, s in enumerate(shown):
                if t is s and _calls:
                    _calls[-1]["dirty"].add(position)

    def mark_shared_storage(self, *pairs):
        pass  # deprecated in torch, and meaningless for values


# --- the way in ---------------------------------------------------------------------------------
_original_apply = getattr(_Function.apply.__func__, "_minifunctorch_original",
                          _Function.apply.__func__)


def _holds_func_tensor(args, kwargs):
    for a in (*args, *kwargs.values()):
        if type(a) is FuncTensor:
            return True
        if isinstance(a, (list, tuple, dict)) and any(
                type(leaf) is FuncTensor for leaf in pytree.tree_leaves(a)):
            return True
    return False


def _apply(cls, *args, **kwargs):
    if current_dispatcher().level == 0 and not _holds_func_tensor(args, kwargs):
        return _original_apply(cls, *args, **kwargs)  # plain torch, untouched
    if _is_torchs_own(cls):
        # torch's own Functions (a prim's BackwardsNotSupported, reached from a decomposition in
        # the back door) are its bookkeeping, below where torch.func looks: their forward runs
        # on the values, op by op, as before this module
        return _original_apply(cls, *args, **kwargs)
    return apply_in_transform(cls, args, kwargs)


def _is_torchs_own(cls):
    module = getattr(cls, "__module__", "") or ""
    # (torch.testing's Functions are examples of user code: PyTorch's autograd_function_db)
    return (module == "torch" or module.startswith("torch.")) and \
        not module.startswith("torch.testing")


_apply._minifunctorch_original = _original_apply
_Function.apply = classmethod(functools.wraps(_original_apply)(_apply))


def apply_in_transform(cls, args, kwargs):
    """``cls.apply(*args, **kwargs)`` called inside a transform (or on FuncTensors).

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> class Cube(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x):
    ...         return x ** 3
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         ctx.save_for_backward(inputs[0])
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 3 * g * x ** 2
    >>> grad(lambda x: Cube.apply(x))(torch.tensor(2.0))
    tensor(12.)
    """
    name = f"{cls.__name__}.apply(...)"
    if cls.setup_context is _BASE_SETUP_CONTEXT:
        raise UnsupportedOperationError(
            f"{name}: in order to use an autograd.Function with transforms (grad, vjp, jvp, "
            "vmap, ...) it must override the setup_context staticmethod, as torch.func "
            "requires too; this one has forward(ctx, ...) only. Fix: write forward(*args) "
            "without ctx, and setup_context(ctx, inputs, output) to save what backward needs "
            "(https://pytorch.org/docs/main/notes/extending.func.html)."
        )
    bound = inspect.signature(cls.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args, bound.kwargs
    for k, v in kwargs.items():
        if type(v) is FuncTensor:
            raise UnsupportedOperationError(
                f"{name}: the keyword-only argument {k!r} is a tensor of the transform, which "
                "torch.func refuses too (kwarg-only Tensor args). Fix: make it a positional "
                "argument of forward."
            )
    values = tuple(unwrap_tree(a) if isinstance(a, (list, tuple, dict)) else unwrap(a)
                   for a in args)
    record = {"dirty": set(), "as_is": {},
              "constants": {id(v) for v in values if isinstance(v, torch.Tensor)}}
    _calls.append(record)
    try:
        with engine_code():
            outs, single = _call(cls, values, kwargs)
    finally:
        _calls.pop()
    results = [as_tensors(o) if isinstance(o, (list, tuple, dict)) else as_tensor(o)
               for o in outs]
    # NOTE [mark_dirty]
    # A Function that writes an input in place returns that input, marked dirty, and torch
    # hands back the very same tensor. The forward ran on plain tensors at the bottom, where
    # torch did exactly that; above it, the engine is functional: the input's tensor takes
    # the output's value (as any in-place op does, tensor.py's _write) and is returned.
    # At the bottom, forward gets copies of the tensors behind the values (``_call``): the
    # originals may be saved by other tape entries (``y = x.exp()`` saves y), and a write
    # into them would change those gradients silently. (torch.func raises there, from its
    # version counters; a copy makes the in-place Function simply work.)
    for i, j in record["as_is"].items():
        if j in record["dirty"] and type(args[j]) is FuncTensor:
            with engine_code():
                _write(args[j], unwrap(results[i]), name)
            results[i] = args[j]
    return results[0] if single else tuple(results)


# one record per Function.apply being computed: the inputs marked dirty, and which outputs
# were inputs returned as they are (seen at the bottom, where forward runs)
_calls: list = []


def _call(cls, args, kwargs):
    """Apply ``cls`` at the highest level among ``args`` (values or constants); returns the
    outputs as a tuple and whether forward returned a single output."""
    top = top_dispatcher(pytree.tree_leaves(args))
    if top is None:
        if _calls:  # NOTE [mark_dirty]: copies of the tensors that were values
            constants = _calls[-1]["constants"]
            args = tuple(a.clone() if isinstance(a, torch.Tensor) and id(a) not in constants
                         else a for a in args)
        outs, single = _as_outputs(_original_apply(cls, *args, **kwargs))
        if _calls:
            _calls[-1]["as_is"] = {i: j for i, o in enumerate(outs) for j, a in enumerate(args)
                                   if o is a and isinstance(o, torch.Tensor)}
        return outs, single
    if isinstance(top, Autograd):
        return _autograd_call(top, cls, args, kwargs)
    if isinstance(top, Forward):
        return _forward_call(top, cls, args, kwargs)
    if isinstance(top, Batched):
        return _batched_call(top, cls, args, kwargs)
    if isinstance(top, Logger):
        return _logger_call(top, cls, args, kwargs)
    raise UnsupportedOperationError(
        f"{top.call}: the autograd.Function {cls.__name__} cannot run under the "
        f"{top.transform_name} level: it has no rule for custom Functions, and tracing "
        "through forward would lose the custom backward. Fix: call it outside this "
        "transform, or write it with ordinary torch operations."
    )


def _as_outputs(out):
    return (out, False) if isinstance(out, tuple) else ((out,), True)


def _is_tensor(x):
    return isinstance(x, (torch.Tensor, Value))


def _run_user(method, *args):
    if current_dispatcher().level == 0:  # a vjp_fn called after its transform returned
        return method(*args)
    with user_code():
        return method(*args)


def _lower(level, value_type, args):
    """The arguments one level down, and which were this level's values (nested values in
    lists are lowered too, but not differentiated, as autograd.Function does)."""
    own = [type(a) is value_type and a.dispatcher is level for a in args]
    lowered = tuple(a.payload if o else lower_tree(level, a) if isinstance(a, (list, tuple, dict))
                    else a for a, o in zip(args, own))
    return own, lowered


def _setup(cls, ctx, inputs, outs, single):
    """Run ``setup_context`` on tensors showing ``inputs`` and ``outs``; returns the output
    tensors it saw (their identity is what mark_non_differentiable names)."""
    in_tensors = tuple(as_tensors(v) if isinstance(v, (list, tuple, dict)) else as_tensor(v)
                       for v in inputs)
    out_tensors = tuple(as_tensors(v) if isinstance(v, (list, tuple, dict)) else as_tensor(v)
                        for v in outs)
    ctx._inputs_shown = in_tensors
    _run_user(cls.setup_context, ctx, in_tensors, out_tensors[0] if single else out_tensors)
    return out_tensors


def _differentiable(level, cls, ctx, outs, out_tensors):
    """Which outputs carry a derivative: float tensors not marked non-differentiable."""
    result = [_is_tensor(o) and (o.dtype.is_floating_point or o.dtype.is_complex)
              and id(t) not in ctx._non_differentiable for o, t in zip(outs, out_tensors)]
    if any(d and o.dtype.is_complex for d, o in zip(result, outs)):
        raise complex_not_supported(level, _prim_of(cls))
    return result


# --- Autograd: backward is the vjp rule ---------------------------------------------------------
_PRIMS = weakref.WeakKeyDictionary()  # class -> {output index or None: Primitive}


def _prim_of(cls, index=None):
    """A primitive that names the Function on tapes (it is never bound)."""
    prims = _PRIMS.setdefault(cls, {})
    prim = prims.get(index)
    if prim is None:
        prim = prims[index] = Primitive(cls.__name__ if index is None
                                        else f"{cls.__name__}[{index}]", None)
    return prim


def _autograd_call(level, cls, args, kwargs):
    own, payloads = _lower(level, AutogradValue, args)
    if level._paused:  # inside a rule's forward under create_graph: no entry (autograd.py)
        outs, single = _call(cls, payloads, kwargs)
        return tuple(AutogradValue(level, o) if _is_tensor(o) else o for o in outs), single
    if level.obeys_grad_mode and grad_mode.reverse_off(level):
        # a grad level switched off by an inner torch.no_grad() (or one below a level entered
        # under no_grad) records nothing, as Autograd.apply (NOTE [Grad modes and transform
        # levels] in grad_mode.py)
        return _call(cls, payloads, kwargs)
    if level.create_graph:
        # NOTE [Two ways to higher order] in autograd.py: the backward runs on this level
        level._paused += 1
        try:
            outs, single = _call(cls, args, kwargs)
        finally:
            level._paused -= 1
        inputs = args
    else:
        outs, single = _call(cls, payloads, kwargs)
        inputs = payloads
    ctx = FunctionCtx(f"{cls.__name__}.apply(...)", tuple(own))
    out_tensors = _setup(cls, ctx, inputs, outs, single)
    differentiable = _differentiable(level, cls, ctx, outs, out_tensors)
    if not any(differentiable):
        return outs, single
    results = list(outs)
    for i, d in enumerate(differentiable):
        if d and not (type(outs[i]) is AutogradValue and outs[i].dispatcher is level):
            results[i] = AutogradValue(level, outs[i])
        if d and results[i].name in (a.name for a, o in zip(args, own) if o):
            results[i]._name = fresh_name()  # an input returned as is: a new name
    _record(level, cls, ctx, args, own, outs, results, differentiable)
    return tuple(results), single


def _record(level, cls, ctx, args, own, outs, results, differentiable):
    """NOTE [Several outputs on a tape]
    A tape entry has one output and receives one cotangent, but ``backward`` wants the
    cotangents of all outputs at once. With one differentiable output, one entry does it.
    With several, a hidden entry ``h = Cls inputs`` stands for the call, and each output
    gets an entry ``out_k = Cls[k] h`` that only hands its cotangent over and gives ``h`` a
    marker cotangent; every such entry comes after the hidden one on the tape, so by the time
    the backward pass reaches ``h`` all of the outputs' cotangents are in."""
    inputs = [a.name if o else None for a, o in zip(args, own)]
    labels = [a.name if o else level.tape.label_of_constant(a) if _is_tensor(a) else repr(a)
              for a, o in zip(args, own)]
    indices = [i for i, d in enumerate(differentiable) if d]

    def run_backward(cts):
        return _backward(cls, ctx, args, own, outs, cts)

    if len(indices) == 1:
        k = indices[0]
        out = results[k]
        level.tape.record(TapeEntry(_prim_of(cls), {}, inputs, labels, args, out.name,
                                    out.shape, out.dtype, lambda ct: run_backward({k: ct})))
        return
    hidden = fresh_name()
    handed_over = {}

    def backward_of_call(marker):
        cts = dict(handed_over)
        handed_over.clear()
        return run_backward(cts)

    first = results[indices[0]]
    level.tape.record(TapeEntry(_prim_of(cls), {}, inputs, labels, args, hidden, (),
                                first.dtype, backward_of_call))
    marker = torch.zeros(())
    for k in indices:
        def hand_over(ct, k=k):
            handed_over[k] = ct
            return (marker,)
        out = results[k]
        level.tape.record(TapeEntry(_prim_of(cls, k), {}, [hidden], [hidden], (hidden,),
                                    out.name, out.shape, out.dtype, hand_over))


def _backward(cls, ctx, args, own, outs, cts):
    """Call the Function's backward with one gradient per output; one cotangent per input."""
    grads = []
    for i, o in enumerate(outs):
        ct = cts.get(i)
        if ct is None and _is_tensor(o) and ctx.materialize_grads:
            ct = ops.zeros_like(o)
        grads.append(as_tensor(ct))
    if getattr(cls.backward, "__code__", None) is _ONCE_DIFFERENTIABLE:
        grads = [_without_autograd(g) for g in grads]
        saved = ctx._saved
        ctx._saved = tuple(_without_autograd(t) for t in saved)
        try:
            result = _run_user(cls.backward, ctx, *grads)
        finally:
            ctx._saved = saved
    else:
        result = _run_user(cls.backward, ctx, *grads)
    result = result if isinstance(result, tuple) else (result,)
    n = len(args)
    if len(result) < n or any(r is not None for r in result[n:]):
        raise AutogradFunctionError(
            f"{cls.__name__}.backward: expected one gradient per input of forward ({n}), got "
            f"{len(result)}. Fix: return a tuple with a gradient (or None) for each input."
        )
    cotangents = []
    for i, (g, a, o) in enumerate(zip(result, args, own)):
        if g is None:
            cotangents.append(None)
            continue
        if not _is_tensor(a):
            raise AutogradFunctionError(
                f"{cls.__name__}.backward: returned a gradient for input {i}, which is not a "
                f"tensor ({type(a).__name__}). Fix: return None for it."
            )
        if not o:
            cotangents.append(None)  # no gradient wanted at this level
            continue
        g = unwrap(g)
        cotangents.append(_conform_gradient(cls, i, g, a))
    return cotangents


# NOTE [once_differentiable]
# torch's ``once_differentiable`` runs the backward under ``torch.no_grad()``, and under
# torch.func no grad level records what runs there: differentiating the gradient again
# treats it as a constant (``grad(grad(f))`` gives zero through it, with no error). Here
# the backward is shown its gradients and saved tensors without their Autograd levels, so
# no tape records its ops; vmap and jvp levels, which no_grad does not switch off, stay.
_ONCE_DIFFERENTIABLE = once_differentiable(lambda ctx: None).__code__


def _without_autograd(t):
    """A tensor showing ``t``'s value with every Autograd level taken out of it."""
    if type(t) is not FuncTensor:
        return t
    return as_tensor(_strip_autograd(unwrap(t)))


def _strip_autograd(value):
    if not isinstance(value, Value):
        return value
    if isinstance(value, AutogradValue):
        return _strip_autograd(value.payload)
    inner = _strip_autograd(value.payload)
    if isinstance(value, ForwardValue):
        tangent = _strip_autograd(value.tangent)
        if inner is value.payload and tangent is value.tangent:
            return value
        return ForwardValue(value.dispatcher, inner, tangent)
    if inner is value.payload:
        return value
    if isinstance(value, BatchedValue):
        return BatchedValue(value.dispatcher, inner, value.bdim)
    return type(value)(value.dispatcher, inner)


def _conform_gradient(cls, i, g, a):
    """torch's autograd reduces a broadcast gradient to its input's shape, and casts it."""
    shape, g_shape = tuple(a.shape), tuple(g.shape)
    if g_shape != shape:
        if not _expandable(shape, g_shape):
            raise AutogradFunctionError(
                f"{cls.__name__}.backward: the gradient of input {i} has shape {g_shape}, "
                f"which cannot be reduced to the input's shape {shape}. Fix: return a "
                "gradient of the input's shape."
            )
        g = sum_to_size(g, shape)
    if g.dtype != a.dtype:
        g = ops.convert(g, a.dtype)
    return g


def _expandable(shape, to):
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == t for s, t in zip(shape[::-1], to[::-1]))


# --- Forward: jvp is the jvp rule ---------------------------------------------------------------
def _forward_call(level, cls, args, kwargs):
    own, primals = _lower(level, ForwardValue, args)
    tangents = [a.tangent if o else None for a, o in zip(args, own)]
    if all(t is None for t in tangents):
        return _call(cls, primals, kwargs)
    if cls.jvp is _BASE_JVP:
        raise MissingRuleError(
            f"{level.call}: the autograd.Function {cls.__name__} has no jvp staticmethod, "
            "so forward-mode AD (jvp, jacfwd) cannot differentiate it; torch.func refuses it "
            "too. Fix: define jvp(ctx, *input_tangents), saving what it needs with "
            "ctx.save_for_forward in setup_context."
        )
    outs, single = _call(cls, primals, kwargs)
    ctx = FunctionCtx(f"{cls.__name__}.apply(...)", (False,) * len(args))
    out_tensors = _setup(cls, ctx, primals, outs, single)
    shown = []
    for p, t in zip(primals, tangents):
        if t is None and _is_tensor(p):
            t = ops.zeros_like(p)  # torch materializes the zero tangents
        shown.append(as_tensor(t))
    ctx._in_jvp = True
    result = _run_user(cls.jvp, ctx, *shown)
    result = result if isinstance(result, tuple) else (result,)
    if len(result) != len(outs):
        raise AutogradFunctionError(
            f"{cls.__name__}.jvp: expected one tangent per output of forward ({len(outs)}), "
            f"got {len(result)}. Fix: return a tangent for each output."
        )
    differentiable = _differentiable(level, cls, ctx, outs, out_tensors)
    for i, (t, d) in enumerate(zip(result, differentiable)):
        if t is not None and not d:
            raise AutogradFunctionError(
                f"{cls.__name__}.jvp: returned a tangent for output {i}, which is not "
                "differentiable (marked non-differentiable, or not a float tensor), as "
                "torch.func refuses too. Fix: return None at that position."
            )
    results = tuple(ForwardValue(level, o, unwrap(t)) if d and t is not None else o
                    for o, t, d in zip(outs, result, differentiable))
    return results, single


# --- Batched: the vmap staticmethod, or a generated rule ----------------------------------------
def _batched_call(level, cls, args, kwargs):
    def own(v):
        return type(v) is BatchedValue and v.dispatcher is level

    def structure(a, leaf):  # lists, tuples and dicts of arguments, as torch.func allows
        if isinstance(a, (list, tuple)):
            return type(a)(structure(i, leaf) for i in a)
        if isinstance(a, dict):
            return {k: structure(v, leaf) for k, v in a.items()}
        return leaf(a)

    values = tuple(structure(a, lambda v: v.payload if own(v) else v) for a in args)
    in_dims = tuple(structure(a, lambda v: v.bdim if own(v) else None) for a in args)
    if all(d is None for d in pytree.tree_leaves(in_dims, none_is_leaf=True)):
        return _call(cls, values, kwargs)
    if any(_is_tensor(v) for v in pytree.tree_leaves(kwargs)):
        raise UnsupportedOperationError(
            f"{level.call}: {cls.__name__}.apply(...) got kwarg-only Tensor args, which "
            "torch.func refuses under vmap too. Fix: pass the tensors positionally."
        )
    has_vmap = cls.vmap is not _BASE_VMAP
    if cls.generate_vmap_rule:
        if has_vmap:
            raise AutogradFunctionError(
                f"{level.call}: the autograd.Function {cls.__name__} has both "
                "generate_vmap_rule=True and an overridden vmap staticmethod, which is "
                "ambiguous (torch.func refuses it too). Fix: keep only one of them."
            )
        generated = _vmapped_function(cls, in_dims, level.length, level.randomness)
        outs, single = _call(generated, values, kwargs)
        return tuple(BatchedValue(level, o, 0) if _is_tensor(o) else o for o in outs), single
    if not has_vmap:
        raise MissingRuleError(
            f"{level.call}: you tried to vmap over the autograd.Function {cls.__name__}, but "
            "it does not have vmap support, which torch.func refuses too. Fix: set "
            "generate_vmap_rule=True (forward, setup_context and backward written with torch "
            "operations), or override the vmap staticmethod."
        )
    info = VmapInfo(level.length, level.randomness)
    shown = tuple(as_tensors(v) if isinstance(v, (list, tuple, dict)) else as_tensor(v)
                  for v in values)
    result = _run_user(cls.vmap, info, in_dims, *shown)
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"{len(result)} returns" if isinstance(result, tuple) else type(result).__name__
        raise AutogradFunctionError(
            f"{cls.__name__}.vmap: expected the vmap staticmethod to have two returns, an "
            f"output and out_dims, got {got}. Fix: return (output, out_dims)."
        )
    out, out_dims = result
    outs, single = _as_outputs(out)
    try:
        results = _batch_outputs(level, outs, out_dims, single)
    except _Mismatch:
        raise AutogradFunctionError(
            f"{cls.__name__}.vmap: the vmap staticmethod returned an incompatible (output, "
            f"out_dims) tuple: out_dims={out_dims!r} does not match the structure of the "
            "output. Fix: one out_dim (int or None) per output tensor, in the output's "
            "structure."
        ) from None
    return results, single


class _Mismatch(Exception):
    pass


def _batch_outputs(level, outs, out_dims, single):
    """The outputs of a vmap staticmethod as values of ``level``: each tensor whose out_dim
    is an int is batched along it (``out_dims`` broadcasts over the output's structure)."""
    def batch(o, d):
        if not (d is None or isinstance(d, (int, list, tuple, dict))):
            raise _Mismatch
        if isinstance(o, (list, tuple)):
            if isinstance(d, (list, tuple)):
                if len(d) != len(o) or isinstance(d, list) != isinstance(o, list):
                    raise _Mismatch  # a list and a tuple are different structures
                return type(o)(batch(i, j) for i, j in zip(o, d))
            if isinstance(d, dict):
                raise _Mismatch
            return type(o)(batch(i, d) for i in o)
        if isinstance(o, dict):
            if isinstance(d, dict):
                return {k: batch(v, d[k]) for k, v in o.items()}
            if isinstance(d, (list, tuple)):
                raise _Mismatch
            return {k: batch(v, d) for k, v in o.items()}
        if isinstance(d, (list, tuple, dict)):
            raise _Mismatch
        o = unwrap(o)
        if d is None or not _is_tensor(o):
            return o
        return BatchedValue(level, o, d % len(o.shape))
    return (batch(outs[0], out_dims),) if single else tuple(batch(tuple(outs), out_dims))


class _CtxView:
    """A ctx seen from inside a vmapped setup_context/backward/jvp: attributes go to the
    real ctx; saved tensors are per-example (``saved``) or recorded (``record``)."""

    def __init__(self, ctx, saved=None, record=None):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_saved", saved)
        object.__setattr__(self, "_record", record)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)

    @property
    def saved_tensors(self):
        return self._saved

    def save_for_backward(self, *tensors):
        self._record["saved"] = tensors

    def save_for_forward(self, *tensors):
        self._record["saved_for_forward"] = tensors

    def mark_non_differentiable(self, *outputs):
        self._record["non_differentiable"] = outputs


def _vmapped_function(cls, in_dims, size, randomness):
    """``generate_vmap_rule=True``: a Function whose methods are ``cls``'s, vmapped over
    ``in_dims``, with every tensor output and saved tensor batched at dim 0 (torch.func's
    ``vmapify_autograd_function``). setup_context runs under vmap too, so that what it
    stores (shapes, ...) is per example. A new class per call, as torch.func makes one: a
    cache would keep every user class alive."""
    from .transforms import vmap
    key = object()  # this class's entry in the ctx it shares with nested generated ones

    def vmapped(f, dims):
        return vmap(f, in_dims=dims, out_dims=0, randomness=randomness)

    def forward(*args):
        return vmapped(cls.forward, in_dims)(*args)

    def setup_context(ctx, inputs, output):
        single = not isinstance(output, tuple)
        outputs = (output,) if single else output
        record = {}

        def inner(inputs, outputs):
            view = _CtxView(ctx, record=record)
            cls.setup_context(view, inputs, outputs[0] if single else outputs)
            marked = {id(o) for o in record.get("non_differentiable", ())}
            record["marked"] = [i for i, o in enumerate(outputs) if id(o) in marked]
            saved = record.get("saved", ())
            forward_saved = record.get("saved_for_forward", ())
            record["saved_none"] = [t is None for t in saved]
            record["forward_none"] = [t is None for t in forward_saved]
            return (tuple(t for t in saved if t is not None),
                    tuple(t for t in forward_saved if t is not None))

        saved, forward_saved = vmapped(inner, (in_dims, 0))(inputs, outputs)
        state = getattr(ctx, "_minifunctorch_vmap", None)
        if state is None:
            state = {}
            ctx._minifunctorch_vmap = state
        state[key] = (record, tuple(tuple(i.shape) if isinstance(i, torch.Tensor) else None
                                    for i in inputs))
        if record["marked"]:
            ctx.mark_non_differentiable(*(outputs[i] for i in record["marked"]))
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*forward_saved)

    def with_nones(tensors, nones):
        it = iter(tensors)
        return tuple(None if n else next(it) for n in nones)

    def backward(ctx, *grads):
        record, input_shapes = ctx._minifunctorch_vmap[key]
        grad_dims = tuple(None if g is None else 0 for g in grads)
        nones = []

        def inner(saved, grads):
            view = _CtxView(ctx, saved=with_nones(saved, record["saved_none"]))
            result = cls.backward(view, *grads)
            result = result if isinstance(result, tuple) else (result,)
            nones[:] = [g is None for g in result]
            out = []
            for g, d, shape in zip(result, in_dims, _example_shapes(input_shapes, in_dims)):
                if g is not None and shape is not None:
                    g = g.sum_to_size(shape) if tuple(g.shape) != shape else g
                out.append(g)
            return tuple(g for g in out if g is not None) + tuple(
                g for g in result[len(in_dims):] if g is not None)

        flat = vmapped(inner, (0, grad_dims))(ctx.saved_tensors, grads)
        result = with_nones(flat, nones)
        return tuple(_unbatch_gradient(g, d) for g, d in
                     zip(result, in_dims + (None,) * (len(result) - len(in_dims))))

    def jvp(ctx, *tangents):
        record, _ = ctx._minifunctorch_vmap[key]
        tangent_dims = tuple(None if t is None else d for t, d in zip(tangents, in_dims))

        def inner(saved, tangents):
            view = _CtxView(ctx, saved=with_nones(saved, record["forward_none"]))
            return cls.jvp(view, *tangents)

        return vmapped(inner, (0, tangent_dims))(ctx.saved_tensors, tangents)

    generated = type(f"Vmapped{cls.__name__}", (_Function,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
        "generate_vmap_rule": True,
    })
    return generated


def _example_shapes(input_shapes, in_dims):
    """The shape of one example of each input (None for a non-tensor)."""
    shapes = []
    for shape, d in zip(input_shapes, in_dims):
        if shape is not None and d is not None:
            shape = shape[:d] + shape[d + 1:]
        shapes.append(shape)
    return shapes


def _unbatch_gradient(g, in_dim):
    """A per-example gradient (batch at dim 0) for an input batched at ``in_dim`` (or not
    batched: the examples' gradients add up)."""
    if g is None:
        return None
    if in_dim is None:
        return g.sum(0)
    return g.movedim(0, in_dim) if in_dim != 0 else g


# --- Logger: print, and pass the call down ------------------------------------------------------
def _logger_call(level, cls, args, kwargs):
    own, payloads = _lower(level, LoggedValue, args)
    outs, single = _call(cls, payloads, kwargs)
    results = tuple(LoggedValue(level, o) if _is_tensor(o) else o for o in outs)
    names = ", ".join(r.name for r in results if isinstance(r, Value))
    line = f"{names}: {cls.__name__}.apply"
    print(f"{level.prefix} {line}" if level.prefix else line, file=level.file)
    return results, single
