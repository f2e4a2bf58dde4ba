"""The data of programs (variables, literals, equations), and how an equation is written as
Python: the vocabulary that programs (program.py) and their torch.fx export (export.py) share.
"""
import cmath
import math
import operator

import torch

from . import primitives as P
from .printing import format_param, type_string


class Var:
    """A program variable: a shape and a dtype; its name is given by the printer."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype

    @property
    def type(self) -> str:
        return type_string(self.dtype, self.shape)

    def __repr__(self):
        return f"Var({self.type})"


class Literal:
    """A Python number used directly as an operand (``mul b 2``)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return repr(self.value)


class Equation:
    """``out = prim(*inputs, **params)``."""

    __slots__ = ("prim", "inputs", "params", "out")

    def __init__(self, prim, inputs, params, out):
        self.prim = prim
        self.inputs = list(inputs)
        self.params = dict(params)
        self.out = out

    def __repr__(self):
        operands = " ".join(repr(o.value) if isinstance(o, Literal) else o.type
                            for o in self.inputs)
        params = "".join(f" {k}={format_param(v)}" for k, v in self.params.items())
        return f"Equation({self.out.type} = {self.prim.name} {operands}{params})"


def identifier(name):
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"f_{cleaned}"


# --- how each primitive is written in exported code ------------------------------------------
INFIX = {P.add_p: "+", P.sub_p: "-", P.mul_p: "*", P.div_p: "/", P.pow_p: "**",
         P.matmul_p: "@", P.eq_p: "==", P.ne_p: "!=", P.lt_p: "<", P.le_p: "<=",
         P.gt_p: ">", P.ge_p: ">="}
INFIX_FUNCTIONS = {P.add_p: operator.add, P.sub_p: operator.sub, P.mul_p: operator.mul,
                   P.div_p: operator.truediv, P.pow_p: operator.pow, P.matmul_p: operator.matmul,
                   P.eq_p: operator.eq, P.ne_p: operator.ne, P.lt_p: operator.lt,
                   P.le_p: operator.le, P.gt_p: operator.gt, P.ge_p: operator.ge}
# primitive -> (torch function, its keyword names for our params)
TORCH_FUNCTIONS = {
    P.neg_p: (torch.neg, {}), P.exp_p: (torch.exp, {}), P.log_p: (torch.log, {}),
    P.sin_p: (torch.sin, {}), P.cos_p: (torch.cos, {}), P.tanh_p: (torch.tanh, {}),
    P.sigmoid_p: (torch.sigmoid, {}), P.relu_p: (torch.relu, {}), P.abs_p: (torch.abs, {}),
    P.sqrt_p: (torch.sqrt, {}), P.sign_p: (torch.sign, {}), P.where_p: (torch.where, {}),
    P.sum_p: (torch.sum, {}), P.mean_p: (torch.mean, {}), P.amax_p: (torch.amax, {}),
    P.amin_p: (torch.amin, {}), P.logsumexp_p: (torch.logsumexp, {}),
    P.softmax_p: (torch.softmax, {}), P.log_softmax_p: (torch.log_softmax, {}),
    P.permute_p: (torch.permute, {}), P.reshape_p: (torch.reshape, {}),
    P.unsqueeze_p: (torch.unsqueeze, {}), P.squeeze_p: (torch.squeeze, {}),
    P.expand_p: (torch.broadcast_to, {"shape": "size"}),
    P.diagonal_p: (torch.diagonal, {}), P.diag_embed_p: (torch.diag_embed, {}),
    P.gather_p: (torch.gather, {}), P.full_like_p: (torch.full_like, {}),
    P.detach_p: (torch.detach, {}), P.convert_p: (torch.Tensor.to, {}),
    P.no_grad_p: (torch.detach, {}),
}


def export_target(prim):
    """The callable that exported code uses for ``prim``, and the keyword renames."""
    if prim in INFIX_FUNCTIONS:
        return INFIX_FUNCTIONS[prim], {}
    if prim in TORCH_FUNCTIONS:
        return TORCH_FUNCTIONS[prim]
    return prim.impl, {}  # scatter_index, scatter_add, diagonal_scatter, custom functions


def _callable_name(target, globals_, reserved=()):
    if getattr(target, "__module__", None) == "torch" and hasattr(torch, target.__name__):
        return f"torch.{target.__name__}"
    if target is torch.Tensor.to:
        return "torch.Tensor.to"
    name = identifier(getattr(target, "__name__", "function"))
    while name in reserved or (name in globals_ and globals_[name] is not target):
        name += "_"
    globals_[name] = target
    return name


def emit_call(prim, operands, params, globals_, *, reserved=()) -> str:
    """One equation's right-hand side as Python source (``reserved``: names not to use for
    callables)."""
    if prim is P.pow_p and operands[0].startswith("-"):
        operands = [f"({operands[0]})", operands[1]]  # -2 ** a is -(2 ** a)
    if prim is P.div_p and not operands[0].isidentifier():
        # a number over a tensor: Python would run Tensor.__rtruediv__, reciprocal(a) * 2,
        # whose bits differ from div's (the primitive's own torch call)
        return f"torch.div({operands[0]}, {operands[1]})"
    if prim in INFIX:
        return f"{operands[0]} {INFIX[prim]} {operands[1]}"
    if prim is P.getitem_p:
        return f"{operands[0]}[{_index_source(params['index'])}]"
    if prim is P.cat_p:
        return f"torch.cat([{', '.join(operands)}], dim={params['dim']})"
    target, renames = export_target(prim)
    if prim is P.gather_p:
        return f"torch.gather({operands[0]}, {params['dim']}, {operands[1]})"
    keywords = [f"{renames.get(k, k)}={_param_source(v)}" for k, v in params.items()]
    return f"{_callable_name(target, globals_, reserved)}({', '.join(operands + keywords)})"


def literal_source(value):
    """A number as Python source: ``repr``, except that inf and nan are not names."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"float('{value!r}')"
    if isinstance(value, complex) and not cmath.isfinite(value):  # repr gives (1+infj)
        return f"complex({literal_source(value.real)}, {literal_source(value.imag)})"
    return repr(value)


def _param_source(value):
    # A parameter is a keyword argument, not a subscript: scatter_index's index=(slice(0, 2,
    # 1),) keeps its slice objects (only getitem is written with the a[0:2] syntax).
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, float):
        return literal_source(value)
    return repr(value)


def _index_source(index):
    parts = []
    for item in index:
        if item is None:
            parts.append("None")
        elif isinstance(item, slice):
            start = "" if item.start in (None, 0) else str(item.start)
            stop = "" if item.stop is None else str(item.stop)
            step = "" if item.step in (None, 1) else f":{item.step}"
            parts.append(f"{start}:{stop}{step}")
        else:
            parts.append(repr(item))
    return ", ".join(parts)
