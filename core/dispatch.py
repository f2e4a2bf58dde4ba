"""Dispatchers (interpreter levels), the wrapper value, and ``bind``.

NOTE [One engine, seen two ways]
A *dispatcher* is one interpreter level: ``Torch`` at the bottom, then any stack of
``Logger``, ``Autograd``, ``Batched``, ``Forward`` and ``Tracing`` levels. Values that belong
to a level are wrapped in that level's ``FuncTensor`` subclass, whose ``payload`` is a value
of a lower level (the seed's FuncTensor; a Tracer in Autodidax).

``bind(prim, *args)`` finds the highest level among its arguments and lets that level
``apply`` the primitive (Autodidax's ``find_top_trace``). The level runs its rule for the
primitive, and the rule calls ordinary ops on the payloads, which ``bind`` again, one level
down. Values that belong to no level (plain tensors, Python numbers) are constants for every
level; with no wrapped argument at all, ``bind`` is a direct torch call.

The same machinery serves two APIs:
- torch.func style: ``grad(f)(x)`` pushes an Autograd level, wraps ``x``, and ``torch.sin(x)``
  reaches ``FuncTensor.__torch_function__``, which binds ``sin_p``.
- the seed's explicit style: ``d.mul(a, b)`` first *adopts* ``a`` and ``b`` into ``d`` (a
  plain tensor becomes a value of every level of ``d``'s stack, as in the seed, where every
  tensor handed to a dispatcher is its own), then binds ``mul_p``.

NOTE [Dynamic dispatch, not a fixed inner]
Rules never name the level they run on: they call ops on payloads, and the payloads' levels
decide. This is what lets a backward closure recorded under ``grad`` run later under a
``vmap`` that did not exist when it was recorded (``jacrev`` is ``vmap`` of a vjp function).
``inner`` is kept for the explicit API (adoption) and for level numbers.
"""
import contextlib
import gc

import torch

from .errors import (
    BatchedControlFlowError,
    InPlaceError,
    TransformError,
    UnsupportedOperationError,
)
from .names import fresh_name, label, reset_names


class FuncTensor:
    """A value that belongs to one dispatcher level; its payload lives one level down.

    Inside a transform, user code sees FuncTensors where it passed tensors. They support the
    torch functions, tensor methods and operators that minifunctorch has primitives for.
    """

    __slots__ = ("dispatcher", "payload", "_name")
    __torch_function_priority__ = 1000

    def __init__(self, dispatcher, payload, name=None):
        self.dispatcher = dispatcher
        self.payload = payload
        self._name = name

    # --- identity and metadata ------------------------------------------------------------
    @property
    def name(self) -> str:
        if self._name is None:
            payload = self.payload
            if isinstance(payload, FuncTensor):
                self._name = payload.name
            else:
                self._name = getattr(payload, "t_name", None) or fresh_name()
        return self._name

    @property
    def shape(self) -> torch.Size:
        return self.payload.shape

    @property
    def dtype(self):
        return self.payload.dtype

    @property
    def device(self):
        return self.payload.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim=None):
        shape = self.shape
        return shape if dim is None else shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def requires_grad(self):
        return False

    # --- concrete values (Python control flow) ---------------------------------------------
    def concrete(self):
        """The concrete tensor behind this value, for Python control flow.

        Autograd and Forward values have one (their primal); a batched value does not.
        """
        return self.dispatcher.concrete(self)

    def __bool__(self):
        return bool(self.concrete())

    def item(self):
        return self.concrete().item()

    def __float__(self):
        return float(self.concrete())

    def __int__(self):
        return int(self.concrete())

    def __index__(self):
        return int(self.concrete())

    def tolist(self):
        return self.concrete().tolist()

    def __repr__(self):
        return f"{type(self).__name__}({self.name}, level={self.dispatcher.level}, {self.payload!r})"

    __hash__ = object.__hash__

    # --- torch functions and tensor methods -------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_api().handle(func, args, kwargs or {})

    def __getattr__(self, attribute):
        # Only reached when normal lookup fails: tensor methods come from the torch_api table.
        return _torch_api().tensor_method(self, attribute)

    def __setitem__(self, index, value):
        raise InPlaceError(
            f"x[{index!r}] = ...: in-place assignment to a value inside a transform is not "
            "supported. Fix: build a new tensor instead, e.g. with torch.where or torch.cat."
        )

    # operators: arrays positional, reflected forms swap the arguments
    def __add__(self, other): return ops.add(self, other)
    def __radd__(self, other): return ops.add(other, self)
    def __sub__(self, other): return ops.sub(self, other)
    def __rsub__(self, other): return ops.sub(other, self)
    def __mul__(self, other): return ops.mul(self, other)
    def __rmul__(self, other): return ops.mul(other, self)
    def __truediv__(self, other): return ops.div(self, other)
    def __rtruediv__(self, other): return ops.div(other, self)
    def __pow__(self, other): return ops.pow(self, other)
    def __rpow__(self, other): return ops.pow(other, self)
    def __matmul__(self, other): return ops.matmul(self, other)
    def __rmatmul__(self, other): return ops.matmul(other, self)
    def __neg__(self): return ops.neg(self)
    def __pos__(self): return self
    def __abs__(self): return ops.abs(self)
    def __eq__(self, other): return ops.eq(self, other)
    def __ne__(self, other): return ops.ne(self, other)
    def __lt__(self, other): return ops.lt(self, other)
    def __le__(self, other): return ops.le(self, other)
    def __gt__(self, other): return ops.gt(self, other)
    def __ge__(self, other): return ops.ge(self, other)
    def __getitem__(self, index): return ops.getitem(self, index)

    @property
    def T(self):
        return ops.permute(self, *reversed(range(self.ndim)))

    @property
    def mT(self):
        return ops.transpose(self, -2, -1)


def _torch_api():
    """The torch_api module. It is built on ops, which is built on this module, so it is
    imported on first use rather than at import time."""
    global _torch_api_module
    if _torch_api_module is None:
        from . import torch_api
        _torch_api_module = torch_api
    return _torch_api_module


_torch_api_module = None


def name_of(value) -> str:
    """The readable name of a wrapped value or tensor (labelling a plain tensor if needed)."""
    if isinstance(value, FuncTensor):
        return value.name
    return label(value).t_name


def rename(value, name):
    """Give a value, and every payload under it, a new name (``d.sum(x, name="L0")``)."""
    while isinstance(value, FuncTensor):
        old_name = value.name
        value._name = name
        value.dispatcher.renamed(old_name, name)
        value = value.payload
    if isinstance(value, torch.Tensor):
        value.t_name = name


def bind(prim, *args, **params):
    """Apply a primitive at the highest level among its arguments (a torch call if none)."""
    top = None
    top_level = 0
    for arg in args:
        if isinstance(arg, FuncTensor):
            level = arg.dispatcher.level
            if level > top_level:
                top, top_level = arg.dispatcher, level
    if top is None:
        return prim.impl(*args, **params)
    return top.apply(prim, *args, **params)


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

    def __init__(self, inner=None, *, name=None):
        self.inner = inner
        self.level = 0 if inner is None else inner.level + 1
        self.name = name or type(self).__name__

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

    def concrete(self, value):
        """The concrete tensor behind a value of this level, for Python control flow."""
        payload = value.payload
        return payload.concrete() if isinstance(payload, FuncTensor) else payload

    # --- explicit API -----------------------------------------------------------------------
    def adopt(self, value):
        """Make ``value`` a value of this level, the way the seed's dispatchers see tensors.

        A value of a higher level is lowered down to this one; a plain tensor or a value of
        a lower level becomes a value of every level from its own up to this one.
        """
        if not isinstance(value, (torch.Tensor, FuncTensor)):
            return value  # a Python number stays a constant
        while isinstance(value, FuncTensor) and value.dispatcher.level > self.level:
            value = value.dispatcher.lower(value)
        if isinstance(value, FuncTensor) and value.dispatcher is self:
            return value
        if self.inner is None:
            if isinstance(value, FuncTensor):
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
            return out

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
        while isinstance(value, FuncTensor):
            value = value.payload
        return value


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


class LoggedTensor(FuncTensor):
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
        payloads = [a.payload if isinstance(a, FuncTensor) and a.dispatcher is self else a
                    for a in args]
        out = LoggedTensor(self, bind(prim, *payloads, **params))
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
        return LoggedTensor(self, payload, name_of(original))


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
_transform_stack: list[Dispatcher] = [TORCH]


def current_dispatcher() -> Dispatcher:
    """The innermost active level: a new transform level is pushed on top of it."""
    return _transform_stack[-1]


@contextlib.contextmanager
def transform_scope(level: Dispatcher):
    """Make ``level`` the current level while a transform runs its function.

    The stack is restored in ``finally``, so an error inside a transform leaves no level
    behind and the next call starts clean. Value names restart at each top-level call.
    """
    if len(_transform_stack) == 1:
        reset_names()
    _transform_stack.append(level)
    try:
        with cyclic_gc_paused():
            yield level
    finally:
        popped = _transform_stack.pop()
        assert popped is level, "transform levels must be popped in the order they were pushed"


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause Python's cyclic garbage collector while a transform runs (then resume it).

    NOTE [Garbage collection during a transform]
    A transform allocates many small objects per op (wrappers, closures, tape entries), and
    every few hundred allocations the cyclic collector would walk the young objects, and now
    and then the whole heap, torch's modules included: a quarter of the time of a small
    grad. Reference counting still frees everything that is not in a cycle at once; the few
    cycles a transform makes are collected when the collector resumes.
    """
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


from . import ops  # noqa: E402  (ops binds primitives through this module)
