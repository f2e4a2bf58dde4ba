"""Dispatchers (interpreter levels), the stack of transform levels, and the explicit API.

NOTE [One engine, seen two ways]
A *dispatcher* is one interpreter level: ``Torch`` at the bottom, then any stack of
``Logger``, ``Autograd``, ``Batched``, ``Forward`` and ``Tracing`` levels. Each level has its
own kind of value (values.py), whose ``payload`` is a value of a lower level, and ``bind``
lets the highest level among a primitive's arguments apply it.

The same machinery serves two APIs:
- torch.func style: ``grad(f)(x)`` pushes an Autograd level, gives ``f`` a FuncTensor
  (tensor.py) showing an ``AutogradValue``, and ``torch.sin(x)`` reaches the FuncTensor's
  ``__torch_function__``, which binds ``sin_p``.
- the seed's explicit style: ``d.mul(a, b)`` first *adopts* ``a`` and ``b`` into ``d`` (a
  plain tensor becomes a value of every level of ``d``'s stack, as in the seed, where every
  tensor handed to a dispatcher is its own), then binds ``mul_p``, and shows the result to
  the user as a FuncTensor too.

NOTE [Dynamic dispatch, not a fixed inner]
Rules never name the level they run on: they call ops on payloads, and the payloads' levels
decide. This is what lets a backward closure recorded under ``grad`` run later under a
``vmap`` that did not exist when it was recorded (``jacrev`` is ``vmap`` of a vjp function).
``inner`` is kept for the explicit API (adoption) and for level numbers.
"""
import contextlib
import functools
import gc
import threading
import weakref

import torch

from . import ops
from .errors import (
    BatchedControlFlowError,
    MissingRuleError,
    TransformError,
    UnsupportedOperationError,
)
from .names import label, reset_names
from .tensor import as_tensor, unwrap
from .values import Value, bind, lower_tree, map_tensors


def name_of(value) -> str:
    """The readable name of a value or tensor (labelling a plain tensor if needed)."""
    value = unwrap(value)
    if isinstance(value, Value):
        return value.name
    return label(value).t_name


def rename(value, name):
    """Give a value, and every payload under it, a new name (``d.sum(x, name="L0")``)."""
    value = unwrap(value)
    while isinstance(value, Value):
        old_name = value.name
        value._name = name
        value.dispatcher.renamed(old_name, name)
        value = value.payload
    if isinstance(value, torch.Tensor):
        value.t_name = name


class Dispatcher:
    """One interpreter level. Subclasses implement ``apply`` and the value conversions.

    The explicit API of the seed: every op of ``minifunctorch.core.ops`` is a method,
    ``d.mul(a, b)``, ``d.sum(x, dim=None, name=None)``, ``d.unsqueeze(x, 0)``, ...; its tensor
    arguments are first adopted into this level.

    >>> import torch
    >>> from minifunctorch.core import Torch, label
    >>> d = Torch()
    >>> d.mul(label(torch.ones(2)), 3.0)
    tensor([3., 3.])
    """

    transform_name = "dispatch"
    exited = False  # its transform has returned (NOTE [Values that escape a transform])
    differentiates = False  # a derivative level (grad's, jvp's): its values carry derivatives
    obeys_grad_mode = False  # torch's grad mode applies to it (Autograd, Forward: grad_mode.py)
    records_a_program = False  # a Tracing level (randomness.py asks every running level)
    over_nested = False  # a vmap level over a nested tensor (transforms.py asks any level)
    # (defaults here, not getattr(level, name, False): __getattr__ below serves the explicit
    # API's ops, and a missing attribute costs it an AttributeError on every question)

    def __init__(self, inner=None, *, name=None, call=None):
        self.inner = inner
        self.level = 0 if inner is None else inner.level + 1
        self.name = name or type(self).__name__
        # how error messages name the transform call (``grad(f)(<inputs>)``)
        self.call = call or f"{self.name} (level {self.level})"

    def __repr__(self):
        inner = "" if self.inner is None else repr(self.inner)
        return f"{self.name}({inner})"

    # --- to be provided by each level -------------------------------------------------------
    def apply(self, prim, *args, **params):
        """Run ``prim`` on arguments that are values of this level or constants below it."""
        raise NotImplementedError

    def wrap_adopted(self, payload, original):
        """Make an (already adopted) inner value a value of this level (explicit API)."""
        raise NotImplementedError

    def renamed(self, old_name, new_name):
        """Hook: a value of this level was renamed (Autograd updates its tape)."""

    def lower(self, value):
        """A value of this level, seen from the level below (the seed's unlift)."""
        return value.payload

    def lower_own(self, value):
        """``lower`` for a value of this level; anything else is already below it."""
        if isinstance(value, Value) and value.dispatcher is self:
            return self.lower(value)
        return value

    def concrete(self, value):
        """The concrete tensor behind a value of this level, for Python control flow."""
        payload = value.payload
        return payload.concrete() if isinstance(payload, Value) else payload

    # --- explicit API -----------------------------------------------------------------------
    def adopt(self, value):
        """Make ``value`` a value of this level, the way the seed's dispatchers see tensors.

        A value of a higher level is lowered down to this one; a plain tensor or a value of
        a lower level becomes a value of every level from its own up to this one.
        """
        value = unwrap(value)
        if not isinstance(value, (torch.Tensor, Value)):
            return value  # a Python number stays a constant
        while isinstance(value, Value) and value.dispatcher.level > self.level:
            value = value.dispatcher.lower(value)
        if isinstance(value, Value) and value.dispatcher is self:
            return value
        if self.inner is None:
            if isinstance(value, Value):
                raise TransformError(
                    f"{self!r}: got a value of another dispatcher stack ({value!r}). "
                    "Fix: use values created by this stack or plain tensors."
                )
            return value
        return self.wrap_adopted(self.inner.adopt(value), value)

    def __getattr__(self, op_name):
        op = getattr(ops, op_name, None)
        if op is None or op_name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no operation {op_name!r}")

        def explicit_op(*args, name=None, **kwargs):
            adopted = [self._adopt_argument(a) for a in args]
            with _explicit_call():
                out = op(*adopted, **kwargs)
                if name is not None:
                    rename(out, name)
            return as_tensor(out)

        explicit_op.__name__ = op_name
        explicit_op.__doc__ = op.__doc__
        return explicit_op

    def _adopt_argument(self, arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._adopt_argument(a) for a in arg)
        return self.adopt(arg)

    def size(self, value):
        """The shape of ``value`` as this level sees it (batch dims hidden by Batched)."""
        return tuple(self.adopt(value).shape)

    def dim(self, value):
        return len(self.size(value))

    def ones(self, size, *, like):
        """Ones of ``size`` at this level, with the dtype and device of ``like``."""
        base = like if isinstance(like, torch.Tensor) else self.concrete_base(like)
        return self.adopt_constant(torch.ones(size, dtype=base.dtype, device=base.device))

    def adopt_constant(self, tensor):
        return tensor

    def concrete_base(self, value):
        value = unwrap(value)
        while isinstance(value, Value):
            value = value.payload
        return value

    # vmap draws random numbers itself (its randomness= modes), even for a random op that has
    # no decomposition; other levels can only differentiate what decomposes
    draws_random_numbers = False

    def random_op(self, name, run, values, kwargs):
        """A random aten op (dropout's bernoulli, rand_like, ...). Its numbers do not depend on
        the values, so by default it runs on the values one level down and its results are
        constants for this level, as torch's autograd treats them. vmap has its own rules."""
        return run(*lower_tree(self, (values, kwargs)))

    def unknown_op(self, name, run, values, kwargs):
        """An aten op this level has no rule for (tensor.py, NOTE [Two doors], step d).
        ``run(values, kwargs)`` runs it on values of a lower level."""
        raise UnsupportedOperationError(
            f"{self.call}: {name} is not supported: the {self.transform_name} level has no rule "
            "for this aten op, and torch has no decomposition of it. Fix: write the "
            "computation with other torch operations, or wrap it in a custom_vjp function."
        )


class Torch(Dispatcher):
    """The bottom level: runs primitives with torch."""

    transform_name = "torch"

    def __init__(self, *, name="Torch"):
        super().__init__(None, name=name)

    def apply(self, prim, *args, **params):
        return prim.impl(*args, **params)

    def __repr__(self):
        return f"{self.name}()"


TORCH = Torch()


class LoggedValue(Value):
    __slots__ = ()


class Logger(Dispatcher):
    """A level that prints every operation that reaches it, then forwards it unchanged.

    >>> import torch
    >>> from minifunctorch.core import Logger, Torch, label
    >>> d = Logger(Torch())
    >>> out = d.mul(label(torch.ones(4), "a"), label(torch.ones(4), "b"), name="c")
    c: (4,) = a * b

    NOTE [The only printer]
    The core prints nothing except here: a Logger is how a student watches the ops that
    reach a level, for instance the backward ops that a Batched level below an Autograd
    level receives.
    """

    transform_name = "log"
    INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "matmul": "@",
             "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}

    def __init__(self, inner, *, name=None, file=None):
        super().__init__(inner, name=name)
        self.prefix = name
        self.file = file

    def apply(self, prim, *args, **params):
        payloads = [a.payload if isinstance(a, Value) and a.dispatcher is self else a
                    for a in args]
        out = LoggedValue(self, bind(prim, *payloads, **params))
        if _explicit_depth:
            _deferred_lines.append(lambda: self._print(out, prim, args, params))
        else:
            self._print(out, prim, args, params)
        return out

    def _print(self, out, prim, args, params):
        names = [repr(a) if isinstance(a, (int, float)) else name_of(a) for a in args]
        if prim.name in self.INFIX and len(names) == 2:
            expr = f"{names[0]} {self.INFIX[prim.name]} {names[1]}"
        else:
            parts = names + [f"{k}={v!r}" for k, v in params.items()]
            expr = f"{prim.name}({', '.join(parts)})"
        line = f"{out.name}: {tuple(out.shape)} = {expr}"
        print(f"{self.prefix} {line}" if self.prefix else line, file=self.file)

    def wrap_adopted(self, payload, original):
        return LoggedValue(self, payload, name_of(original))

    def unknown_op(self, name, run, values, kwargs):
        lowered = lower_tree(self, (values, kwargs))
        print(f"{self.prefix} {name}" if self.prefix else name, file=self.file)
        return map_tensors(lambda v: LoggedValue(self, v), run(*lowered))


# --- explicit calls: Logger lines wait until the result has its final name -----------------
_explicit_depth = 0
_deferred_lines: list = []


@contextlib.contextmanager
def _explicit_call():
    """While an explicit op runs, Loggers defer their lines; they print once the op has
    returned and ``name=`` has been applied, so a line shows the name the user chose."""
    global _explicit_depth
    _explicit_depth += 1
    try:
        yield
    finally:
        _explicit_depth -= 1
        if _explicit_depth == 0:
            lines = list(_deferred_lines)
            _deferred_lines.clear()
            for print_line in lines:
                print_line()


# --- the stack of transform levels -------------------------------------------------------------
# NOTE [One stack of levels per thread]
# Two threads that each run transforms must not see each other's levels: a level pushed by
# one thread would become the other's current level, and a torch.rand on a plain tensor in
# one thread would look like a random call inside the other's vmap. So the stack lives in a
# threading.local, as functorch keeps its DynamicLayer stack in thread-local state (and JAX
# its trace state).
class _PerThread(threading.local):
    def __init__(self):
        self.transform_stack = [TORCH]  # the bottom level is shared: it has no state


_per_thread = _PerThread()


def transform_levels() -> tuple:
    """The levels of the transforms running now in this thread, outermost first (without the
    Torch level)."""
    return tuple(_per_thread.transform_stack[1:])


def current_dispatcher() -> Dispatcher:
    """The innermost active level: a new transform level is pushed on top of it."""
    return _per_thread.transform_stack[-1]


class _TransformScope:
    """``with transform_scope(level):`` (a class: NOTE [Context managers on the hot path] in
    tensor.py)."""
    __slots__ = ("level", "gc_paused")

    def __init__(self, level):
        self.level = level

    def __enter__(self):
        stack = _per_thread.transform_stack
        if len(stack) == 1:
            reset_names()
        stack.append(self.level)
        # NOTE [Garbage collection during a transform]
        # A transform allocates many small objects per op (wrappers, closures, tape entries),
        # and every few hundred allocations the cyclic collector would walk the young
        # objects, and now and then the whole heap, torch's modules included: a quarter of
        # the time of a small grad. Reference counting still frees everything that is not
        # in a cycle at once; the few cycles a transform makes are collected when the
        # collector resumes.
        self.gc_paused = gc.isenabled()
        if self.gc_paused:
            gc.disable()
        return self.level

    def __exit__(self, *exc_info):
        if self.gc_paused:
            gc.enable()
        popped = _per_thread.transform_stack.pop()
        assert popped is self.level, "transform levels must be popped in the order they were pushed"
        # NOTE [Values that escape a transform]
        # A value the user kept (appended to a list, stored on self) outlives its transform.
        # torch.func unwraps such an "escaped" tensor to what it wraps. Here the level's
        # apply is replaced, on this level object only, by one that does the same: its own
        # values are lowered to their payloads and the op is bound again below it. Live
        # levels keep the class's apply, so the hot path pays nothing.
        # (through a weak reference: the level holding a partial that holds the level would
        # be a cycle, and keep its tape alive until the cyclic collector runs)
        self.level.apply = functools.partial(_apply_after_exit, weakref.ref(self.level))
        self.level.exited = True


def _apply_after_exit(level_ref, prim, *args, **params):
    """``level.apply`` once its transform has returned (NOTE [Values that escape a
    transform])."""
    level = level_ref()  # alive: this is called through it
    if getattr(level, "length", None) is not None:  # a vmap level: no single value to use
        raise UnsupportedOperationError(
            f"{level.call}: your tensor may have escaped from inside a function being "
            "vmapped (torch.func's words): a value batched by this vmap was used after the "
            "vmap returned (it escaped, e.g. appended to a list inside the function), and it "
            "has no value outside the vmap. Fix: return it from the function instead."
        )
    lowered = [arg.payload if isinstance(arg, Value) and arg.dispatcher is level else arg
               for arg in args]
    return bind(prim, *lowered, **params)


def transform_scope(level: Dispatcher):
    """Make ``level`` the current level while a transform runs its function.

    The stack is restored on exit, error or not, so an error inside a transform leaves no
    level behind and the next call starts clean. Value names restart at each top-level call.
    The cyclic garbage collector is paused meanwhile (NOTE [Garbage collection during a
    transform]).
    """
    return _TransformScope(level)


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause Python's cyclic garbage collector (NOTE [Garbage collection during a transform])."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def new_level(cls, **kwargs):
    """Create a transform level on top of the current one (``Autograd(current, ...)``)."""
    return cls(current_dispatcher(), **kwargs)


def nondifferentiable_outputs(level, name, run, values, kwargs):
    """Run an op with no derivative rule one level down, if none of its outputs can carry a
    derivative (integer and boolean results: indices, masks, counts); otherwise refuse.
    Shared by the Autograd and Forward levels."""
    out = run(*lower_tree(level, (values, kwargs)))
    differentiable = []
    map_tensors(lambda v: differentiable.append(v) if v.dtype.is_floating_point or
                v.dtype.is_complex else None, out)
    if differentiable:
        raise MissingRuleError(
            f"{level.call}: {name} is not supported: it has no {level.transform_name} rule "
            "here, and torch has no decomposition of it into ops that have one. Fix: write the "
            "computation with other torch operations, or wrap it in a custom_vjp function."
        )
    return out


# NOTE [Complex numbers]
# Derivatives of complex functions follow PyTorch's convention (the "conjugate Wirtinger"
# one, described in torch's docs, notes/autograd.rst, "Autograd for Complex Numbers", and
# used by every formula of derivatives.yaml and FunctionsManual.cpp):
# - jvp: the tangent of f(z) is ``df = (df/dz) z_dot + (df/dz*) conj(z_dot)``; for a
#   holomorphic f (exp, sin, mul, matmul, ...) the second term is zero: ``z_dot * f'(z)``.
# - vjp: the cotangent of z is ``conj(df/dz) ct + (df/dz*) conj(ct)``; for a holomorphic f,
#   ``ct * conj(f'(z))``. For a real loss L of a complex z it is dL/dRe(z) + i dL/dIm(z),
#   the direction of steepest ascent, which is what torch.func.grad returns.
# - A real input of an op with a complex result (a real tensor promoted by ``x * 1j``) gets
#   the real part of its cotangent, as torch's engine does (``validate_outputs`` in
#   engine.cpp): ``Autograd.apply`` wraps such an entry's backward (real_cotangents_of).
# A rule written for real numbers is often wrong for complex ones, silently (``ct * d``
# without the conj, ``sign`` where ``sgn`` is meant). So complex derivatives are opt-in, per
# primitive: a family adds the primitives whose vjp and jvp rules it has checked on complex
# inputs against torch.func (tests/test_complex.py) to ``complex_derivatives``, right under
# their rules. A derivative level (grad, vjp, jvp and the transforms built on them) refuses
# any other primitive that takes or gives a complex tensor, with the message below: never a
# silently wrong derivative. vmap, which needs no derivative, accepts complex tensors
# everywhere.
complex_derivatives: set = set()


def complex_ready(*prims):
    """Mark primitives whose vjp and jvp rules are checked on complex numbers
    (NOTE [Complex numbers])."""
    complex_derivatives.update(prims)


def has_complex(values) -> bool:
    """Whether any of ``values`` (tensors, engine values, numbers) is complex."""
    for v in values:
        dtype = getattr(v, "dtype", None)
        if dtype is not None and dtype.is_complex:
            return True
    return False


def complex_not_supported(level, prim, *, gives=True) -> UnsupportedOperationError:
    """A derivative level meets a primitive not marked complex-ready (NOTE [Complex numbers])."""
    name = getattr(prim, "name", prim)
    what = "gives a complex result" if gives else "takes a complex input"
    return UnsupportedOperationError(
        f"{level.call}: {name} {what}, and its derivatives of complex numbers are not "
        "supported yet. Fix: differentiate real and imaginary parts separately "
        "(torch.view_as_real), or keep complex numbers out of the differentiated function."
    )


def unsupported(what: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"{what} is not supported inside minifunctorch transforms: there is no primitive for "
        "it. Fix: write it with supported torch operations, or wrap the computation in a "
        "custom_vjp function."
    )


def no_concrete_value(call, what) -> BatchedControlFlowError:
    return BatchedControlFlowError(
        f"{call}: {what} on a value batched by vmap: a batched value has one value per example, so "
        "Python cannot branch on it or read it as a number. Fix: use torch.where(cond, a, b) "
        "instead of an if statement, or move the Python logic outside of vmap."
    )

