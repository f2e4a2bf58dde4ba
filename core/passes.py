"""Simplification passes on programs. Each is a small function: Program in, Program out.

- ``eliminate_dead_code``: drop equations whose results nothing uses.
- ``eliminate_common_subexpressions``: compute each (primitive, operands, params) once.
- ``fold_symbolic_zeros``: a zero tensor is never materialized to be added or multiplied:
  ``add x zeros`` is ``x``, ``mul x zeros`` is zeros, ``neg zeros`` is zeros, and so on.
- ``fold_identities``: an operation that returns its input unchanged is dropped: ``mul x 1``,
  ``div x 1``, ``expand``/``reshape`` to the same shape, a ``permute`` undone by another.
- ``simplify``: all of them, until nothing changes.
"""
from . import primitives as P
from .ir import Equation, Literal, Var


def eliminate_dead_code(program):
    """Remove equations whose outputs are not used by the outputs.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> from minifunctorch.core.passes import eliminate_dead_code
    >>> def f(x):
    ...     unused = torch.cos(x)
    ...     return torch.sin(x)
    >>> print(eliminate_dead_code(trace(f)(torch.ones(2))))
    { lambda ; a:f32[2] .
      let b:f32[2] = sin a
      in (b,) }
    """
    live = {o for o in program.outputs if isinstance(o, Var)}
    kept = []
    for equation in reversed(program.equations):
        if equation.out in live:
            kept.append(equation)
            live.update(o for o in equation.inputs if isinstance(o, Var))
    constants = [(v, value) for v, value in program.constants if v in live]
    return program.replace(equations=kept[::-1], constants=constants)


def _hashable(value):
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    if isinstance(value, tuple):
        return tuple(_hashable(v) for v in value)
    return value


def eliminate_common_subexpressions(program):
    """Reuse the result of an equation already computed with the same operands and params.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> from minifunctorch.core.passes import eliminate_common_subexpressions
    >>> print(eliminate_common_subexpressions(trace(lambda x: x.sin() + x.sin())(torch.ones(2))))
    { lambda ; a:f32[2] .
      let b:f32[2] = sin a
          c:f32[2] = add b b
      in (c,) }
    """
    replacement = {}
    seen = {}
    equations = []

    def resolve(operand):
        return replacement.get(operand, operand) if isinstance(operand, Var) else operand

    # NOTE [Literal keys carry their type]
    # 2 == 2.0 == True in Python, with one hash, but `mul a 2` and `mul a 2.0` differ for an
    # integer `a` (i64 vs f32 results), so a literal's key is its type and its repr.
    def key_of(operand):
        if isinstance(operand, Literal):
            return ("literal", type(operand.value), repr(operand.value))
        return id(operand)

    for equation in program.equations:
        inputs = [resolve(o) for o in equation.inputs]
        key = (equation.prim, tuple(key_of(o) for o in inputs),
               tuple((k, _hashable(v)) for k, v in equation.params.items()))
        if key in seen:
            replacement[equation.out] = seen[key]
            continue
        seen[key] = equation.out
        equations.append(Equation(equation.prim, inputs, equation.params, equation.out))
    outputs = [resolve(o) for o in program.outputs]
    return program.replace(equations=equations, outputs=outputs)


def _is_zero_literal(operand):
    return isinstance(operand, Literal) and operand.value == 0


# a zero operand makes the result zero
_ZERO_ABSORBING = {P.mul_p, P.matmul_p}
# linear in their first operand: a zero first operand gives a zero result
_ZERO_PRESERVING = {P.neg_p, P.sum_p, P.mean_p, P.reshape_p, P.expand_p, P.permute_p,
                    P.unsqueeze_p, P.squeeze_p, P.getitem_p, P.convert_p}


def fold_symbolic_zeros(program):
    """Never compute with a tensor known to be zero.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> from minifunctorch.core.passes import fold_symbolic_zeros, eliminate_dead_code
    >>> program = trace(lambda x: x + torch.zeros_like(x) * x)(torch.ones(2))
    >>> print(eliminate_dead_code(fold_symbolic_zeros(program)))
    { lambda ; a:f32[2] .
      in (a,) }
    """
    zeros = set()  # vars known to hold zeros
    replacement = {}
    equations = []

    def resolve(operand):
        return replacement.get(operand, operand) if isinstance(operand, Var) else operand

    def is_zero(operand):
        return operand in zeros or _is_zero_literal(operand)

    for equation in program.equations:
        prim, out = equation.prim, equation.out
        inputs = [resolve(o) for o in equation.inputs]
        if prim is P.full_like_p and equation.params["fill_value"] == 0:
            zeros.add(out)
        elif prim in _ZERO_ABSORBING and any(is_zero(o) for o in inputs):
            zeros.add(out)
        elif prim in _ZERO_PRESERVING and is_zero(inputs[0]):
            zeros.add(out)
        elif prim in (P.add_p, P.sub_p) and any(is_zero(o) for o in inputs):
            x, y = inputs
            if is_zero(x) and is_zero(y):
                zeros.add(out)
            elif is_zero(y) and isinstance(x, Var) and (x.shape, x.dtype) == (out.shape, out.dtype):
                replacement[out] = x  # x + 0 and x - 0 are x
                continue
            # (x must be the zero: `1 + zeros` is not zeros, nor is `x + zeros` when the
            # zeros broadcast x to a larger shape)
            elif is_zero(x) and prim is P.add_p and isinstance(y, Var) \
                    and (y.shape, y.dtype) == (out.shape, out.dtype):
                replacement[out] = y  # 0 + y is y
                continue
            elif is_zero(x) and prim is P.sub_p and isinstance(y, Var) \
                    and (y.shape, y.dtype) == (out.shape, out.dtype):
                equations.append(Equation(P.neg_p, [y], {}, out))  # 0 - y is -y
                continue
        equations.append(Equation(prim, inputs, equation.params, out))
    # A zero that is still used is made directly, from a var of the same type, instead of by
    # arithmetic on other zeros (which dead-code elimination then removes).
    for position, equation in enumerate(equations):
        if equation.out in zeros and equation.prim is not P.full_like_p:
            source = next((o for o in equation.inputs if isinstance(o, Var)
                           and (o.shape, o.dtype) == (equation.out.shape, equation.out.dtype)),
                          None)
            if source is not None:
                equations[position] = Equation(P.full_like_p, [source], {"fill_value": 0},
                                               equation.out)
    return program.replace(equations=equations, outputs=[resolve(o) for o in program.outputs])


def _is_literal(operand, value):
    return isinstance(operand, Literal) and type(operand.value) is not bool \
        and operand.value == value


def fold_identities(program):
    """Drop operations that give back their input: ``mul x 1``, a permute of a permute that
    undoes it, an expand or reshape to the same shape.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> from minifunctorch.core.passes import fold_identities, eliminate_dead_code
    >>> program = trace(lambda x: (x.T.T * 1).reshape(2, 3))(torch.ones(2, 3))
    >>> print(eliminate_dead_code(fold_identities(program)))
    { lambda ; a:f32[2,3] .
      in (a,) }
    """
    replacement = {}
    producer = {}  # var -> the equation that computed it (after replacement)
    equations = []

    def resolve(operand):
        return replacement.get(operand, operand) if isinstance(operand, Var) else operand

    for equation in program.equations:
        prim, out, params = equation.prim, equation.out, equation.params
        inputs = [resolve(o) for o in equation.inputs]
        x = inputs[0]
        same_type = isinstance(x, Var) and (x.shape, x.dtype) == (out.shape, out.dtype)
        identity = None
        if prim is P.mul_p and same_type and _is_literal(inputs[1], 1):
            identity = x
        elif prim is P.mul_p and _is_literal(x, 1) and isinstance(inputs[1], Var) \
                and (inputs[1].shape, inputs[1].dtype) == (out.shape, out.dtype):
            identity = inputs[1]
        elif prim is P.div_p and same_type and _is_literal(inputs[1], 1):
            identity = x
        elif prim in (P.expand_p, P.reshape_p) and same_type:
            identity = x
        elif prim is P.permute_p and isinstance(x, Var) and x in producer \
                and producer[x].prim is P.permute_p:
            first = producer[x].params["dims"]
            if tuple(first[d] for d in params["dims"]) == tuple(range(len(first))):
                identity = producer[x].inputs[0]
        if identity is not None:
            replacement[out] = identity
            continue
        kept = Equation(prim, inputs, params, out)
        producer[out] = kept
        equations.append(kept)
    return program.replace(equations=equations, outputs=[resolve(o) for o in program.outputs])


def simplify(program):
    """Fold zeros, share common subexpressions and drop dead code, until nothing changes."""
    while True:
        before = len(program.equations)
        program = eliminate_dead_code(eliminate_common_subexpressions(
            fold_identities(fold_symbolic_zeros(program))))
        if len(program.equations) == before:
            return program
