"""How user code written for torch reaches minifunctorch: the ``__torch_function__`` table.

When a torch function, a tensor method or a ``torch.nn.functional`` function receives a
wrapped value, torch calls ``FuncTensor.__torch_function__``, which looks the function up in
``TORCH_FUNCTIONS`` and runs the matching function of ``ops``. Plain tensors never come here:
outside of transforms, torch runs at full speed.
"""
import torch
import torch.nn.functional as F

from . import ops
from .dispatch import unsupported
from .errors import InPlaceError, RandomnessError

# name -> op, for names that exist both as torch.<name> and Tensor.<name>
_SHARED = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "relu", "abs", "sqrt", "sign", "square", "eq", "ne", "lt", "le", "gt", "ge",
    "sum", "mean", "amax", "amin", "max", "min", "logsumexp", "softmax", "log_softmax",
    "matmul", "mm", "mv", "bmm", "dot", "permute", "transpose", "t", "reshape", "flatten",
    "unsqueeze", "squeeze", "broadcast_to", "diagonal", "diag", "diag_embed", "trace",
    "gather", "clone", "detach",
]
_TENSOR_ONLY = {
    "view": ops.view, "expand": ops.expand, "expand_as": ops.expand_as, "to": ops.to,
    "contiguous": ops.contiguous, "float": lambda x: ops.convert(x, torch.float32),
    "double": lambda x: ops.convert(x, torch.float64), "type_as": lambda x, o: ops.convert(x, o.dtype),
    "__getitem__": ops.getitem, "multiply": ops.mul, "divide": ops.div, "subtract": ops.sub,
    "negative": ops.neg,
    # x.where(condition, y) is torch.where(condition, x, y): the tensor is the first choice
    "where": lambda x, condition, y: ops.where(condition, x, y),
}
_TORCH_ONLY = {
    "where": ops.where,
    "cat": ops.cat, "concat": ops.cat, "concatenate": ops.cat, "stack": ops.stack,
    "zeros_like": ops.zeros_like, "ones_like": ops.ones_like, "full_like": ops.full_like,
    "multiply": ops.mul, "divide": ops.div, "subtract": ops.sub, "negative": ops.neg,
    "true_divide": ops.div,
}
_FUNCTIONAL = {
    "linear": ops.linear, "relu": ops.relu, "tanh": ops.tanh, "sigmoid": ops.sigmoid,
    "softmax": ops.softmax, "log_softmax": ops.log_softmax, "cross_entropy": ops.cross_entropy,
    "nll_loss": ops.nll_loss, "mse_loss": ops.mse_loss,
}
# Operators reached when a plain tensor is on the left: Tensor.__sub__(plain, wrapped).
_OPERATORS = {
    "__add__": ops.add, "__radd__": lambda x, y: ops.add(y, x),
    "__sub__": ops.sub, "__rsub__": lambda x, y: ops.sub(y, x),
    "__mul__": ops.mul, "__rmul__": lambda x, y: ops.mul(y, x),
    "__truediv__": ops.div, "__rtruediv__": lambda x, y: ops.div(y, x),
    "__div__": ops.div, "__rdiv__": lambda x, y: ops.div(y, x),
    "__pow__": ops.pow, "__rpow__": lambda x, y: ops.pow(y, x),
    "__matmul__": ops.matmul, "__rmatmul__": lambda x, y: ops.matmul(y, x),
    "__neg__": ops.neg, "__eq__": ops.eq, "__ne__": ops.ne, "__lt__": ops.lt,
    "__le__": ops.le, "__gt__": ops.gt, "__ge__": ops.ge,
}

RANDOM_FUNCTIONS = {
    torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, torch.normal,
    torch.multinomial, F.dropout, torch.dropout, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.bernoulli_, torch.Tensor.random_,
}

TORCH_FUNCTIONS: dict = {}
TENSOR_METHODS: dict = {}

for _name in _SHARED:
    TORCH_FUNCTIONS[getattr(torch, _name)] = getattr(ops, _name)
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = getattr(ops, _name)
    TENSOR_METHODS[_name] = getattr(ops, _name)
for _name, _op in _TENSOR_ONLY.items():
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _op
    TENSOR_METHODS[_name] = _op
for _name, _op in _TORCH_ONLY.items():
    TORCH_FUNCTIONS[getattr(torch, _name)] = _op
for _name, _op in _FUNCTIONAL.items():
    TORCH_FUNCTIONS[getattr(F, _name)] = _op
for _name, _op in _OPERATORS.items():
    TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _op


def handle(func, args, kwargs):
    """Run a torch function that received a wrapped value (``__torch_function__``)."""
    op = TORCH_FUNCTIONS.get(func)
    if op is None:
        raise _not_supported(func)
    if not kwargs:
        return op(*args)
    if kwargs.get("out") is not None:
        raise InPlaceError(
            f"{_qualified_name(func)}(..., out=...): writing into an out= tensor inside a "
            "transform is not supported. Fix: use the returned value."
        )
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    return op(*args, **kwargs)


def tensor_method(value, attribute):
    """``value.<attribute>`` for a tensor method minifunctorch supports, as a bound function."""
    op = TENSOR_METHODS.get(attribute)
    if op is not None:
        return lambda *args, **kwargs: op(value, *args, **kwargs)
    if attribute.startswith("__"):
        raise AttributeError(attribute)
    if attribute.endswith("_") and hasattr(torch.Tensor, attribute):
        raise InPlaceError(
            f"x.{attribute}(...): in-place operations on a value inside a transform are not "
            f"supported. Fix: use the out-of-place x.{attribute[:-1]}(...) and the result."
        )
    if hasattr(torch.Tensor, attribute):
        raise unsupported(f"The tensor method x.{attribute}")
    raise AttributeError(f"{type(value).__name__} has no attribute {attribute!r}")


def _qualified_name(func):
    # the public name: torch.fft.fft, not its binding torch._C._fft.fft_fft
    public = torch.overrides.resolve_name(func)
    if public is not None:
        return public.replace("torch.Tensor.", "Tensor.", 1)
    module = getattr(func, "__module__", None) or "torch"
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is torch._C.TensorBase or module == "torch._tensor":
        return f"Tensor.{name}"
    return f"{module}.{name}"


def _not_supported(func):
    if func in RANDOM_FUNCTIONS:
        return RandomnessError(
            f"{_qualified_name(func)}: random operations on values inside a transform are not "
            "supported. Fix: draw the random numbers outside the transform and pass them in."
        )
    return unsupported(_qualified_name(func))
