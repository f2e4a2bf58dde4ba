"""The front door: torch functions, tensor methods and ``torch.nn.functional`` onto ``ops``.

When user code calls a torch function with a FuncTensor among its arguments, torch calls
``FuncTensor.__torch_function__`` (tensor.py), which looks the function up here:
- ``TORCH_FUNCTIONS``: function -> op. The op receives the engine values behind the
  arguments and returns values; tensor.py shows the results to user code as FuncTensors.
- ``VIEWS``: functions whose result is a view of their first argument (a predicate on the
  arguments says when: ``x[0]`` is a view, ``x[index_tensor]`` a copy), so that a later
  write through the view reaches its base.
- ``IN_PLACE``: in-place functions, as the op that computes the new value of the first
  argument (``x.add_(y)`` is ``ops.add(x, y)``, then written into ``x``).
- ``ACTIVATIONS``: ``torch.nn.functional`` activations, whose ``inplace=True`` writes the
  result into the input.
- ``UPDATES``: functions that return a result and may also write new values into some of
  their tensor arguments (batch norm in training mode updates its running statistics).
- ``REFUSED``: functions that would silently bypass the engine, with the reason and the fix.
- ``FACTORIES``: functions that create tensors from nothing (see tensor.py, NOTE [Tensors
  created inside a transform]).
A function missing here still works: torch lowers it to aten ops, and those go through the
back door (aten_api.py). This table is the fast path for what models call most.
"""
import inspect

import torch
import torch.nn.functional as F

from . import ops
from . import primitives as P
from .errors import TransformUsageError
from .values import NUMBERS, Value

TORCH_FUNCTIONS: dict = {}
VIEWS: dict = {}
IN_PLACE: dict = {}
ACTIVATIONS: dict = {}
UPDATES: dict = {}
REFUSED: dict = {}


def register(*functions, view=None):
    """Decorator: the front door sends each of ``functions`` to the decorated op (``view``: a
    predicate on the arguments that says when the result is a view of the first one)."""
    def decorate(op):
        for function in functions:
            TORCH_FUNCTIONS[function] = op
            if view is not None:
                VIEWS[function] = view
        return op
    return decorate


# NOTE [Functions that are one primitive]
# ``torch.sin(x)`` reaches ops.sin, which is ``bind(sin_p, x)``: with one value among the
# arguments, bind hands it to that value's level. The front door does that itself for the
# functions listed here (two Python calls fewer on the commonest calls: sin, exp, tanh, every
# op of the elementwise formula table). Only for a function whose op is exactly
# ``bind(prim, x)``; ``tests/test_tensor_values.py`` checks each entry against its op.
# ``x * 1.1`` likewise: the arithmetic functions, called on a tensor and a number, are the
# primitive bound on the two (``1.1 * x`` too, which torch computes as ``x * 1.1``).
ONE_PRIMITIVE: dict = {}  # torch function -> the primitive its op binds
NUMBER_SECOND: dict = {}  # torch function -> the primitive its op binds with a number second
# ``x - t`` and ``t - x`` for a plain tensor t: an operator of the FuncTensor x -> the primitive
# its op binds, and whether x is its first operand (``t - x`` reaches ``x.__rsub__(t)``)
TENSOR_OPERAND: dict = {}


def register_primitive(prim, *functions):
    """Say that each of ``functions``, called on one tensor, is ``bind(prim, x)``."""
    for function in functions:
        ONE_PRIMITIVE[function] = prim


def register_activation(function):
    """Decorator for a ``torch.nn.functional`` activation with an ``inplace`` argument (its
    last): ``F.silu(x, inplace=True)`` computes the op, then writes the result into ``x``."""
    parameters = list(inspect.signature(function).parameters)
    position = parameters.index("inplace")

    def decorate(op):
        ACTIVATIONS[function] = (op, position)
        return op
    return decorate


def register_updating(*functions, written):
    """Decorator for functions that may also update arguments in place: the op returns
    ``(result, new values)``, and ``written(*args, **kwargs)`` names the arguments that the
    new values go into, in order (tensor.py writes them; no new values, no writes)."""
    def decorate(op):
        for function in functions:
            UPDATES[function] = (op, written)
        return op
    return decorate


def register_in_place(*functions):
    """Decorator: each of ``functions`` is in place; the op computes the new first argument."""
    def decorate(op):
        for function in functions:
            IN_PLACE[function] = op
        return op
    return decorate


def torch_functions(name):
    """``torch.<name>`` and ``Tensor.<name>``, the ones that exist."""
    return tuple(f for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
                 if f is not None)

# name -> op, for names that exist both as torch.<name> and Tensor.<name>
_SHARED = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "relu", "abs", "sqrt", "sign", "square", "eq", "ne", "lt", "le", "gt", "ge",
    "sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax",
    "matmul", "mm", "mv", "bmm", "dot", "permute", "transpose", "t", "reshape", "flatten",
    "unsqueeze", "squeeze", "broadcast_to", "diagonal", "diag", "diag_embed", "trace",
    "gather", "clone", "detach", "scatter",
]
_TENSOR_ONLY = {
    "view": ops.view, "expand": ops.expand, "expand_as": ops.expand_as, "to": ops.to,
    "contiguous": ops.contiguous,
    "float": lambda x, memory_format=None: ops.convert(x, torch.float32),
    "double": lambda x, memory_format=None: ops.convert(x, torch.float64),
    "type_as": lambda x, other: ops.convert(x, other.dtype),
    "__getitem__": ops.getitem, "multiply": ops.mul, "divide": ops.div, "subtract": ops.sub,
    "negative": ops.neg,
    # x.where(condition, y) is torch.where(condition, x, y): the tensor is the first choice
    "where": lambda x, condition, y: ops.where(condition, x, y),
}
_TORCH_ONLY = {  # (torch.where, which may take the condition alone: indexing.py)
    "cat": ops.cat, "concat": ops.cat, "concatenate": ops.cat, "stack": ops.stack,
    "zeros_like": ops.zeros_like, "ones_like": ops.ones_like, "full_like": ops.full_like,
    "multiply": ops.mul, "divide": ops.div, "subtract": ops.sub, "negative": ops.neg,
    "true_divide": ops.div,
}
_FUNCTIONAL = {
    "tanh": ops.tanh, "sigmoid": ops.sigmoid,
    "softmax": ops.softmax, "log_softmax": ops.log_softmax, "cross_entropy": ops.cross_entropy,
    "nll_loss": ops.nll_loss, "mse_loss": ops.mse_loss,
}
# Operators reached when a plain tensor or a number is on the left: ``plain - wrapped`` and
# ``2.0 - wrapped`` call ``wrapped.__rsub__`` (Python asks the subclass first).
def reflected(name, op, *, number_last=False):
    """``Tensor.__rsub__(self, other)`` is ``other - self``; ``self`` is the tensor (called
    unbound with a number as ``self``, torch fails on it, and so does this; not __rpow__,
    whose body torch runs as it is). With ``number_last`` (__radd__, __rmul__), a number
    ``other`` goes second: torch computes ``2.0 * t`` as ``t * 2.0`` (its __rmul__ is
    ``mul(self, other)``), and of complex operands the order changes the bits."""
    def reflected(x, y):
        if not isinstance(x, (torch.Tensor, Value)):
            # (not a TypeError: torch's operator wrapper turns those into NotImplemented)
            raise TransformUsageError(
                f"Tensor.{name}(self, other): self must be a tensor, got {type(x).__name__} "
                "(torch fails here too). Fix: write the operator (other - tensor, ...), or "
                "call the function form (torch.sub(other, tensor), ...).")
        if number_last and type(y) in NUMBERS:
            return op(x, y)
        return op(y, x)
    return reflected


_OPERATORS = {
    "__add__": ops.add, "__radd__": reflected("__radd__", ops.add, number_last=True),
    "__sub__": ops.sub, "__rsub__": reflected("__rsub__", ops.sub),
    "__mul__": ops.mul, "__rmul__": reflected("__rmul__", ops.mul, number_last=True),
    "__truediv__": ops.div, "__div__": ops.div,  # (__rtruediv__: in elementwise.py)
    # (torch's __rpow__ is pow(other, self) whatever self is: Tensor.__rpow__(2.0, t) is t**2)
    "__pow__": ops.pow, "__rpow__": lambda x, y: ops.pow(y, x),
    "__matmul__": ops.matmul, "__rmatmul__": reflected("__rmatmul__", ops.matmul),
    "__neg__": ops.neg, "__eq__": ops.eq, "__ne__": ops.ne, "__lt__": ops.lt,
    "__le__": ops.le, "__gt__": ops.gt, "__ge__": ops.ge,
}

for _name in _SHARED:
    TORCH_FUNCTIONS[getattr(torch, _name)] = getattr(ops, _name)
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = getattr(ops, _name)
for _name, _op in _TENSOR_ONLY.items():
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _op
for _name, _op in _TORCH_ONLY.items():
    TORCH_FUNCTIONS[getattr(torch, _name)] = _op
for _name, _op in _FUNCTIONAL.items():
    TORCH_FUNCTIONS[getattr(F, _name)] = _op
for _name, _op in _OPERATORS.items():
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _op
ACTIVATIONS[F.relu] = (ops.relu, 1)
for _name, _prim in (("add", P.add_p), ("sub", P.sub_p), ("mul", P.mul_p), ("div", P.div_p)):
    _operator_name = "truediv" if _name == "div" else _name
    for _function in (getattr(torch, _name), getattr(torch.Tensor, _name),
                      getattr(torch.Tensor, f"__{_operator_name}__")):
        NUMBER_SECOND[_function] = _prim
    TENSOR_OPERAND[getattr(torch.Tensor, f"__{_operator_name}__")] = (_prim, True)
    TENSOR_OPERAND[getattr(torch.Tensor, f"__r{_operator_name}__")] = (_prim, False)
NUMBER_SECOND[torch.Tensor.__radd__] = P.add_p  # (2.0 + t is t + 2.0: reflected's number_last)
NUMBER_SECOND[torch.Tensor.__rmul__] = P.mul_p
for _name in ("neg", "exp", "log", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "sqrt"):
    register_primitive(getattr(P, f"{_name}_p"), getattr(torch, _name),
                       getattr(torch.Tensor, _name))


# --- views -------------------------------------------------------------------------------------
def _always(args):
    return True


def _basic_index(args):
    """``x[0]``, ``x[1:]``, ``x[..., None]`` are views; an index with tensors makes a copy."""
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(isinstance(i, (int, slice, type(None))) or i is Ellipsis for i in index)


for _function in (torch.Tensor.view, torch.Tensor.expand, torch.Tensor.expand_as,
                  torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__):
    VIEWS[_function] = _always
for _name in ("permute", "transpose", "t", "reshape", "flatten", "unsqueeze", "squeeze",
              "broadcast_to", "diagonal", "as_strided"):
    VIEWS[getattr(torch, _name)] = _always
    VIEWS[getattr(torch.Tensor, _name)] = _always
VIEWS[torch.Tensor.__getitem__] = _basic_index


# --- in-place ----------------------------------------------------------------------------------
for _name in ("add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh",
              "sigmoid", "relu", "abs", "sqrt", "clamp_min"):
    _out_of_place = getattr(ops, _name, None)
    if _out_of_place is not None:
        IN_PLACE[getattr(torch.Tensor, _name + "_")] = _out_of_place
for _name, _op in (("__iadd__", ops.add), ("__isub__", ops.sub), ("__imul__", ops.mul),
                   ("__itruediv__", ops.div)):
    IN_PLACE[getattr(torch.Tensor, _name)] = _op
IN_PLACE[torch.relu_] = ops.relu
IN_PLACE[torch.Tensor.__setitem__] = ops.setitem
IN_PLACE[torch.Tensor.zero_] = lambda x: ops.zeros_like(x)
IN_PLACE[torch.Tensor.fill_] = ops.filled
IN_PLACE[torch.Tensor.copy_] = lambda x, source, non_blocking=False: source


# --- calls that would bypass the engine --------------------------------------------------------
_AUTOGRAD_FIX = ("differentiate with the transforms themselves (grad, vjp, jacrev) rather "
                 "than with torch.autograd inside them.")
# torch.autograd.grad is supported (autograd.py, NOTE [torch.autograd.grad inside transforms]);
# backward() is refused inside a transform even on plain tensors, as torch.func does: it would
# accumulate into .grad outside the transform's control.
_BACKWARD = ("backward() called inside a functorch transform (torch.func's words): "
             "Tensor.backward() and torch.autograd.backward",
             "use grad or vjp instead (torch.autograd.grad works inside transforms), or call "
             "backward() outside of the transform.")
REFUSED_IN_TRANSFORMS = {torch.Tensor.backward: _BACKWARD, torch.autograd.backward: _BACKWARD}
REFUSED.update(REFUSED_IN_TRANSFORMS)
REFUSED[torch.Tensor.retain_grad] = (
    "You are attempting to call Tensor.retain_grad() inside of a function being transformed "
    "by a functorch transform (torch.func's words): retain_grad on a value of a transform",
    "read the gradient with the transforms themselves (grad or vjp with respect to that "
    "value), or a gradient hook (Tensor.register_hook).")

# (Tensor.requires_grad_: autograd.py, NOTE [requires_grad_ inside a transform])

# Torch functions that write into one of their plain tensor arguments only inside their own
# Python code (the transform mode does not see that inner call): the written argument, or
# None. NOTE [A tape has no version counter] (autograd.py)
def _max_norm_weight(input, weight, *args, max_norm=None, **kwargs):
    # F.embedding(input, weight, padding_idx, max_norm, ...); F.embedding_bag(input, weight,
    # offsets, max_norm, ...): max_norm is the fourth argument of both
    max_norm = args[1] if len(args) > 1 else max_norm
    return weight if max_norm is not None else None


WRITES_AN_ARGUMENT = {F.embedding: _max_norm_weight, F.embedding_bag: _max_norm_weight}

# --- factories ---------------------------------------------------------------------------------
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange,
    torch.linspace, torch.logspace, torch.eye, torch.zeros_like, torch.ones_like,
    torch.empty_like, torch.full_like, torch.scalar_tensor, torch.empty_strided,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor, torch.Tensor.clone,
}


# Random creation functions -> how to draw under the transforms running now (filled by
# randomness.py; the transform mode consults it before anything else).
RANDOM_FUNCTIONS: dict = {}


def qualified_name(func):
    """The public name of a torch function: ``torch.fft.fft``, not its binding."""
    public = torch.overrides.resolve_name(func)
    if public is not None:
        return public.replace("torch.Tensor.", "Tensor.", 1)
    module = getattr(func, "__module__", None) or "torch"
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is torch._C.TensorBase or module == "torch._tensor":
        return f"Tensor.{name}"
    return f"{module}.{name}"

