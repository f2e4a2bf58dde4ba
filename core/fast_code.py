"""What jit's generated code does for speed: buffer reuse, and number operands as tensors.

NOTE [Buffer reuse in generated code]
A program run by ``jit`` is straight-line Python, one torch call per equation. For a chain of
elementwise ops on small tensors, a good part of each call is allocating its result: on a
10x10 tensor ``torch.sin(b)`` takes about 1.8 µs here and ``b.sin_()`` about 1.0 µs. When an
equation's first operand is an intermediate that nothing reads afterwards, the result may go
into that operand's buffer instead: ``c = b.sin_()`` in place of ``c = torch.sin(b)``. The
values are the same bits (torch runs the same kernel, only the output pointer differs).

An equation qualifies when
- its primitive is elementwise and torch has an in-place method for it (``INPLACE_METHODS``:
  the basic ops below, and every formula-table op that ``register_inplace`` finds one for),
  and it has no static parameters;
- its first operand is an intermediate that memory of its own was made for (by an op of
  ``INPLACE_METHODS`` or ``FRESH_RESULTS``): never a program input (the caller's tensor), a
  captured constant, or what may be a view of something;
- every other reader of that operand is such an op too (none of them made a view that could
  still be read), it comes before this equation, and the operand is no program output;
- the result has the operand's shape and dtype (no broadcasting up, no type promotion).

The rewritten code must not run where torch's autograd records the call: autograd keeps
intermediates for its backward, and writing over them would break it (it refuses, with
"modified by an inplace operation"). ``jit`` therefore keeps both versions and runs the
rewritten one only when autograd is off or no input requires grad (``unless_recorded``).

This is what compilers call buffer assignment or reinplacing: XLA's ``BufferAssignment``,
``torch.fx.passes.reinplace`` (on functionalized aten graphs) and inductor's in-place buffer
reuse do the same with their own IRs.

NOTE [Number operands as tensors] is in primitives.py: the eager primitives pass a number
operand as a kept 0-d tensor, and the generated code binds each literal once the same way
(``number_tensors``), where the bits are the same.
"""
import collections

import torch

from . import primitives as P
from .ir import Literal, Var

# primitive -> the torch.Tensor method that computes it into its first operand
INPLACE_METHODS = {
    P.add_p: "add_", P.sub_p: "sub_", P.mul_p: "mul_", P.div_p: "div_", P.pow_p: "pow_",
    P.neg_p: "neg_", P.exp_p: "exp_", P.log_p: "log_", P.sin_p: "sin_", P.cos_p: "cos_",
    P.tanh_p: "tanh_", P.sigmoid_p: "sigmoid_", P.relu_p: "relu_", P.abs_p: "abs_",
    P.sqrt_p: "sqrt_", P.sign_p: "sign_",
}


def register_inplace(prim):
    """Give an elementwise primitive computed by ``torch.<name>`` its in-place method, if torch
    has one (``atan`` -> ``atan_``; ``maximum`` has none)."""
    method = f"{prim.name}_"
    if prim.impl is getattr(torch, prim.name, None) and hasattr(torch.Tensor, method):
        INPLACE_METHODS[prim] = method


# primitives beside INPLACE_METHODS' whose result is memory of their own, never a view or an
# operand returned as it is (convert to the same dtype, detach and the shape ops are not)
FRESH_RESULTS = {P.where_p, P.sum_p, P.mean_p, P.amax_p, P.amin_p, P.logsumexp_p,
                 P.softmax_p, P.log_softmax_p, P.softmax_backward_p, P.log_softmax_backward_p,
                 P.matmul_p, P.full_like_p, P.clone_p}


def register_fresh(*prims):
    """Say that each of ``prims`` returns memory of its own (a fused kernel, a linear layer)."""
    FRESH_RESULTS.update(prims)


def reusable_equations(program) -> frozenset:
    """The indices of the equations whose result may overwrite their first operand.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> program = trace(lambda x: (x.sin() * 2).exp())(torch.ones(3))
    >>> sorted(reusable_equations(program))   # mul and exp reuse sin's buffer; sin keeps x
    [1, 2]
    """
    readers = collections.defaultdict(list)  # var -> indices of the equations that read it
    for index, equation in enumerate(program.equations):
        for operand in equation.inputs:
            if isinstance(operand, Var):
                readers[operand].append(index)
    outputs = {o for o in program.outputs if isinstance(o, Var)}

    def makes_no_view(index):
        prim = program.equations[index].prim
        return prim in INPLACE_METHODS or prim in FRESH_RESULTS

    fresh = set()  # results that are memory of their own
    reusable = set()
    for index, equation in enumerate(program.equations):
        if equation.prim in FRESH_RESULTS:
            fresh.add(equation.out)
        if equation.prim not in INPLACE_METHODS:
            continue
        fresh.add(equation.out)
        first = equation.inputs[0]
        if (equation.params or first not in fresh or first in outputs
                or first.shape != equation.out.shape or first.dtype != equation.out.dtype):
            continue
        read_by = readers[first]
        if read_by[-1] == index and read_by.count(index) == 1 and all(
                makes_no_view(i) for i in read_by):
            reusable.add(index)
    return frozenset(reusable)


def unless_recorded(reusing, plain, constants):
    """Run ``reusing`` unless torch's autograd records the call, and ``plain`` then."""
    if any(isinstance(c, torch.Tensor) and c.requires_grad for _, c in constants):
        def run(*tensors):
            return plain(*tensors) if torch.is_grad_enabled() else reusing(*tensors)
        return run

    def run(*tensors):
        if torch.is_grad_enabled():
            for tensor in tensors:
                if tensor.requires_grad:
                    return plain(*tensors)
        return reusing(*tensors)
    return run


def number_operand_tensor(equation):
    """The 0-d tensor that may stand for the equation's number operand, or None (NOTE [Number
    operands as tensors] in primitives.py)."""
    if equation.prim not in P.NUMBER_OPERAND_PRIMS or equation.params:
        return None
    first, second = equation.inputs
    dtype = equation.out.dtype
    if not (isinstance(first, Var) and isinstance(second, Literal) and first.dtype == dtype):
        return None
    return P.number_tensor(second.value, dtype)
