"""Tracing: a level that records every primitive it sees into a Program.

NOTE [Tracing with abstract values]
A traced value carries no numbers: its payload is a "meta" tensor, with a shape and a dtype
but no storage, and each primitive's result type comes from its shape rule. This is JAX's
``make_jaxpr`` with ShapedArrays. Tracing costs no arithmetic, the program works for any
input of the same types, and Python control flow that needs a concrete value fails loudly
instead of silently baking one branch into the program.

Tracing composes like any level: in ``trace(grad(f))(x)`` the Autograd level sits above
the Tracing level, so the program records the forward ops and then the backward ops that
grad issued. Constants that the function captured become constant inputs of the program
(Python numbers stay literals).
"""
import functools
import threading

import torch

from . import grad_mode, pytree
from . import primitives as P
from . import tensor as tensor_module
from .dispatch import Dispatcher, new_level, transform_scope
from .errors import TransformError, TransformUsageError, UnsupportedOperationError
from .ir import Equation, Literal, Var
from .program import Program
from .tensor import (FuncTensor, as_tensor, engine_code, is_plain_strided, unwrap, unwrap_tree,
                     user_code, value_of)
from .values import NUMBERS, Value

_is_grad_enabled = torch.is_grad_enabled


class TracerValue(Value):
    """A value of a Tracing level: a program variable, with a meta payload for its type."""

    __slots__ = ("var",)

    def __init__(self, dispatcher, var, name=None):
        super().__init__(dispatcher, torch.empty(var.shape, dtype=var.dtype, device="meta"), name)
        self.var = var

    @property
    def device(self):
        return self.dispatcher.device

    def _own_metadata(self):
        payload = self.payload  # a meta tensor: the device is the program's
        return payload.shape, payload.dtype, self.dispatcher.device


class Tracing(Dispatcher):
    """The level that builds a Program: one equation per primitive that reaches it."""

    transform_name = "trace"
    records_a_program = True  # (randomness.py refuses to draw while one runs)

    def __init__(self, inner, *, device=None, name="Tracing", call="trace(f)(<inputs>)"):
        super().__init__(inner, name=name, call=call)
        self.device = device or torch.device("cpu")
        self.inputs: list[Var] = []
        self.constants: list[tuple[Var, object]] = []
        self._constant_vars: dict[int, Var] = {}
        self.equations: list[Equation] = []

    def new_input(self, shape, dtype):
        var = Var(tuple(shape), dtype)
        self.inputs.append(var)
        return TracerValue(self, var)

    def _operand(self, value):
        if isinstance(value, TracerValue) and value.dispatcher is self:
            return value.var
        if isinstance(value, NUMBERS) or value is None:
            # (None: an optional array left out, such as a convolution's bias)
            return Literal(value)
        if isinstance(value, (torch.Tensor, Value)):
            return self._constant(value)
        raise TransformUsageError(
            f"{self.call}: an operation received a {type(value).__name__}; expected tensors or "
            "numbers. Fix: pass only tensors and numbers to torch operations."
        )

    def _constant(self, value):
        var = self._constant_vars.get(id(value))
        if var is None:
            var = Var(tuple(value.shape), value.dtype)
            self._constant_vars[id(value)] = var
            self.constants.append((var, value))
        return var

    def apply(self, prim, *args, **params):
        if prim is P.draw_p:  # a program that draws, traced again (trace of a jit function)
            return self._append_draw(list(args), params)
        operands = [self._operand(a) for a in args]
        meta_args = [a.payload if isinstance(a, TracerValue) and a.dispatcher is self
                     else (o.value if isinstance(o, Literal) else _meta_of(a))
                     for a, o in zip(args, operands)]
        out_meta = prim.impl(*meta_args, **params)
        out = Var(tuple(out_meta.shape), out_meta.dtype)
        self.equations.append(Equation(prim, operands, params, out))
        if not _is_grad_enabled() and prim.differentiable and grad_mode.grad_off() and \
                (out.dtype.is_floating_point or out.dtype.is_complex):
            # NOTE [A no_grad region in a traced function]
            # ``with torch.no_grad(): shift = x * 2`` inside f: for reverse mode, f's caller
            # (torch's autograd over the replay) and a transform of the program
            # (grad(jit(f))) must see ``shift`` as a constant, while forward mode goes on
            # through it (torch.no_grad does not stop jvp; hessian = jacfwd(jacrev) needs
            # both). The program records the op, then ``no_grad`` of its result: an identity
            # whose vjp is zero and whose jvp is itself (primitives.py). The trace starts
            # with grad on (``TracedUserCode``): what f does under an outer no_grad is the
            # replay's business, not the program's. Before, the program differentiated
            # through the region, silently.
            stopped = Var(out.shape, out.dtype)
            self.equations.append(Equation(P.no_grad_p, [out], {}, stopped))
            out = stopped
        return TracerValue(self, out)

    def random_op(self, name, run, values, kwargs):
        """A random aten op on traced values (``torch.ops.aten.bernoulli.p(x, 0.5)``)."""
        return self.record_draw(name, tuple(values), kwargs)

    def record_draw(self, call, args, kwargs):
        """NOTE [Random numbers in a traced program]
        A program replays the equations it recorded, so a random function's numbers, drawn
        once while tracing, would come back as the same constant at every call. Instead the
        call itself is recorded, as one ``draw`` equation (primitives.py) that makes the same
        torch call anew each time the program runs, from torch's generator: ``F.dropout(x,
        0.5)`` in a jitted training step draws a new mask at each step, and with the same
        seed the same numbers as eager torch (make_fx records the random aten op the same
        way). It is recorded here from randomness.py (torch's random functions, dropout's
        mask, in-place fills) and from the back door (random aten ops), and nothing is drawn
        while tracing: the shape of the result comes from the call on the meta device. The
        passes keep every draw, in order, and never share two (passes.py). A vmap inside
        the traced function rewrites the call for its ``randomness`` first, as in eager mode
        (randomness.py); a program run under a vmap outside it hands each draw to the random
        function's rule again (NOTE [A program's draw under an outer vmap] in randomness.py).
        A draw from an explicit generator, which a program cannot hold, is refused.
        ``args`` are the call's positional arguments (the tensors among them become the
        equation's operands), ``kwargs`` its static keywords."""
        if any(isinstance(v, torch.Generator) for v in pytree.tree_leaves((args, kwargs))):
            raise UnsupportedOperationError(
                f"{self.call}: {call}(..., generator=...) draws from a generator of its own, "
                "which a traced program cannot hold. Fix: draw from torch's default generator "
                "(seeded with torch.manual_seed), or pass the numbers in as an argument.")
        if any(_is_array(v) for v in pytree.tree_leaves(kwargs)):
            raise UnsupportedOperationError(
                f"{self.call}: {call}(...) with a tensor given by keyword cannot be recorded "
                "in a traced program. Fix: pass the tensor positionally.")
        arrays_at = tuple(i for i, a in enumerate(args) if _is_array(a))
        params = {"call": call,
                  "args": tuple(None if i in arrays_at else _static(a)
                                for i, a in enumerate(args)),
                  "kwargs": tuple(sorted((k, _static(v)) for k, v in kwargs.items())),
                  "arrays_at": arrays_at}
        return self._append_draw([unwrap(args[i]) for i in arrays_at], params)

    def _append_draw(self, arrays, params):
        operands = [self._operand(a) for a in arrays]
        meta_arrays = [a.payload if isinstance(a, TracerValue) and a.dispatcher is self
                       else _meta_of(a) for a in arrays]
        on_meta = dict(params, kwargs=tuple((k, "meta" if k == "device" else v)
                                            for k, v in params["kwargs"]))
        with torch.device("meta"):  # (nothing is drawn while tracing)
            out_meta = P.draw_p.impl(*meta_arrays, **on_meta)
        out = Var(tuple(out_meta.shape), out_meta.dtype)
        self.equations.append(Equation(P.draw_p, operands, params, out))
        return TracerValue(self, out)

    def unknown_op(self, name, run, values, kwargs):
        op = P.aten_op_named(name)
        if op is not None and torch.Tag.dynamic_output_shape in op.tags:
            raise data_shape_error(self.call, name)
        return super().unknown_op(name, run, values, kwargs)

    def concrete(self, value):
        raise TransformError(
            f"{self.call}: Python needed the concrete value of a traced tensor (bool(), .item(), an "
            "if statement or a loop bound), but a traced value has only a shape and a dtype. "
            "Fix: use torch.where for data-dependent choices, or keep the Python logic outside "
            "the traced function."
        )

    def wrap_adopted(self, payload, original):
        raise TransformUsageError(
            "The Tracing level is used through trace(f)(*args), not through the explicit API."
        )


def _static(value):
    """A static argument of a recorded draw, as a program holds it (a device by its name, so
    that generated code can write it)."""
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (list, torch.Size)):
        return tuple(value)
    return value


def traced_value(value):
    """The traced value under ``value``, looking down its chain (a value of grad or vmap over
    a traced one too); None if it is not traced."""
    while isinstance(value, Value):
        if isinstance(value, TracerValue):
            return value
        value = value.payload
    return None


def trace_call_of(*values):
    """The call of the trace that one of ``values`` belongs to; None if none is traced."""
    return next((traced.dispatcher.call for traced in map(traced_value, values)
                 if traced is not None), None)


def data_shape_error(call, what):
    """NOTE [Shapes that depend on the data] (indexing.py), under a trace."""
    return UnsupportedOperationError(
        f"{call}: {what} returns as many elements as the data says, and a traced program has "
        "one fixed shape per value, known before any data. Fix: use a fixed-shape formulation "
        "(torch.where(mask, x, 0) instead of x[mask], a sum over a mask instead of a count of "
        "nonzero, bincount's minlength no smaller than the largest value), or call it outside "
        "jit.")


def _meta_of(value):
    return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")


def _is_array(value):
    return isinstance(value, (torch.Tensor, Value))


def trace_flat(f, args, kwargs=None, *, device=None, name=None):
    """Trace ``f(*args, **kwargs)``; tensor leaves of args become program inputs.

    Non-tensor leaves are static: they are passed to ``f`` as they are. Only the shapes and
    dtypes of the tensor leaves matter (meta tensors are fine examples).
    """
    leaves, treedef = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    leaves = [unwrap(leaf) for leaf in leaves]
    arrays = [leaf for leaf in leaves if _is_array(leaf)]
    if device is None:
        device = arrays[0].device if arrays else torch.device("cpu")
    name = name or getattr(f, "__name__", "f")
    level = new_level(Tracing, device=device, call=f"trace({name})(<inputs>)")
    with transform_scope(level):
        traced_leaves = [as_tensor(level.new_input(leaf.shape, leaf.dtype)) if _is_array(leaf)
                         else leaf for leaf in leaves]
        traced_args, traced_kwargs = pytree.tree_unflatten(treedef, traced_leaves)
        with TracedUserCode(level.call):
            out = f(*traced_args, **traced_kwargs)
        out = unwrap_tree(out)  # while the level runs (NOTE [Outputs are read while their
        # level runs] in transforms.py)
        written = _written_inputs(
            [leaf for leaf in traced_leaves if type(leaf) is FuncTensor], level.inputs, name)
    out_leaves, out_treedef = pytree.tree_flatten(out)
    outputs = []
    for leaf in [*out_leaves, *(value for _, value in written)]:
        if isinstance(leaf, TracerValue) and leaf.dispatcher is level:
            outputs.append(leaf.var)
        elif isinstance(leaf, (bool, int, float)):
            outputs.append(Literal(leaf))
        elif _is_array(leaf):
            outputs.append(level._constant(leaf))
        else:
            raise TransformUsageError(
                f"trace({name})(<inputs>): expected the function to "
                f"return tensors, got a leaf of type {type(leaf).__name__}."
            )
    static = [None if _is_array(leaf) else leaf for leaf in leaves]
    writes = [(index, len(out_leaves) + k) for k, (index, _) in enumerate(written)]
    return Program(level.inputs, level.constants, level.equations, outputs,
                   in_treedef=treedef, out_treedef=out_treedef, static_leaves=static,
                   device=device, name=name, writes=writes)


# NOTE [A traced function that writes a tensor it closes over]
# ``counter.add_(1)``, ``cache.copy_(x.detach())`` on a tensor that f closes over, with plain
# values: the write runs while f is traced, once, and a program has no step for it, so every
# later call of the jit function would skip it, silently. Such a write is refused while a
# trace runs (a write of a traced value into it is refused anyway: tensor.py's ``_write``).
# The tensors f creates during the trace (``t = W * 2; t[0] = 0``) may be written: the
# storages of the plain results of torch functions called while the trace runs are
# remembered, and a write into one of them is a write into a temporary, baked into the
# program as its constant is. (JAX has no writes; torch.compile records them as graph
# mutations of globals, and here an argument does that: NOTE [A traced function that writes
# its inputs] in program.py.)
# The sets are per thread (transforms run in several threads); tensor.py's hook is on while
# a trace runs in any thread.
_traces = threading.local()  # .fresh: per trace running here, (its call, storage addresses)
_tracing_threads = [0]
_tracing_lock = threading.Lock()


def _fresh_storages() -> list:
    return getattr(_traces, "fresh", ())


class TracedUserCode:
    """``user_code()`` for a trace: remembers the storages f creates (see the NOTE above),
    and runs f with grad on (NOTE [A no_grad region in a traced function]). For trace and
    jit, and for split_vjp's forward trace."""

    def __init__(self, call):
        self.call = call  # the trace's, for its errors

    def __enter__(self):
        if not hasattr(_traces, "fresh"):
            _traces.fresh = []
        _traces.fresh.append((self.call, set()))
        with _tracing_lock:
            _tracing_threads[0] += 1
            tensor_module.plain_results_hook = _remember_fresh
        self.grad_mode = torch.enable_grad()  # NOTE [A no_grad region in a traced function]
        self.grad_mode.__enter__()
        self.user_code = user_code()
        self.user_code.__enter__()

    def __exit__(self, *exc_info):
        try:
            self.user_code.__exit__(*exc_info)
        finally:
            self.grad_mode.__exit__(*exc_info)
            _traces.fresh.pop()
            with _tracing_lock:
                _tracing_threads[0] -= 1
                if not _tracing_threads[0]:
                    tensor_module.plain_results_hook = None


def _remember_fresh(result, args, kwargs):
    """The storages of a plain torch function's results, except those of its tensor
    arguments (a view of a tensor f closes over, or an ``out=`` tensor, is not new)."""
    results = [r for r in (result if isinstance(result, (tuple, list)) else (result,))
               if _has_storage(r)]
    if not results:
        return
    known = {_storage(a) for a in pytree.tree_leaves((args, kwargs)) if _has_storage(a)}
    for _, storages in _fresh_storages():
        storages.update(_storage(r) for r in results if _storage(r) not in known)


def _has_storage(value) -> bool:
    """A strided tensor with memory of its own: a plain one, a Parameter, or a subclass made
    with ``as_subclass`` or ``_make_subclass`` (not a FuncTensor, a meta or a sparse tensor,
    or a wrapper subclass, whose data lives in tensors it holds)."""
    if is_plain_strided(value):
        return not value.is_meta
    if not isinstance(value, torch.Tensor) or type(value) is FuncTensor:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return (value.layout is torch.strided and not value.is_meta
                and value.untyped_storage().data_ptr() != 0)


def _storage(tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage().data_ptr()


def refuse_write_to_captured(target, call):
    fresh = _fresh_storages()
    if not fresh or not _has_storage(target):
        return
    trace_call, storages = fresh[-1]
    if target.numel() == 0 or _storage(target) in storages:
        return
    raise UnsupportedOperationError(
        f"{trace_call}: {call} writes in place into a tensor that the traced function closes "
        "over (or a view of one): the write would run once, while the function is traced, and "
        "never at a later call of the program or the jit function. Fix: pass the tensor as an "
        "argument (a program writes its arguments at every call), or write into a copy made "
        "inside the function (t = t.clone())."
    )


tensor_module.plain_write_guards.append(refuse_write_to_captured)


def _written_inputs(shown, inputs, name):
    """(input index, new value) for each input that f wrote in place: NOTE [A traced
    function that writes its inputs] (program.py)."""
    written = []
    for index, (tensor, var) in enumerate(zip(shown, inputs)):
        if tensor._generation:
            value = value_of(tensor)
            if tuple(value.shape) != var.shape:
                raise UnsupportedOperationError(
                    f"trace({name})(<inputs>): an in-place op that changes an input's shape "
                    f"(squeeze_, unsqueeze_, t_, ...) is not supported in a traced program: "
                    f"input {index} of shape {var.shape} would become {tuple(value.shape)}. "
                    "Fix: use the out-of-place op (x = x.squeeze()) and return the result.")
            written.append((index, value))
    return written


def trace(f):
    """Trace ``f`` (or any composition of transforms of it) into a :class:`Program`.

    >>> import torch
    >>> from minifunctorch.core import trace, grad
    >>> print(trace(lambda x: torch.sin(x) * 2)(torch.ones(3)))
    { lambda ; a:f32[3] .
      let b:f32[3] = sin a
          c:f32[3] = mul b 2
      in (c,) }
    >>> program = trace(grad(lambda x: torch.sin(x).sum()))(torch.ones(3))
    >>> program(torch.zeros(3))
    tensor([1., 1., 1.])
    """
    @functools.wraps(f)
    def traced(*args, **kwargs):
        with engine_code():
            return trace_flat(f, args, kwargs)
    return traced
