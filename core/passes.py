"""Simplification passes on programs. Each is a small function: Program in, Program out.

- ``eliminate_dead_code``: drop equations whose results nothing uses.
- ``eliminate_common_subexpressions``: compute each (primitive, operands, params) once.
- ``fold_symbolic_zeros``: a zero tensor is never materialized to be added or reshaped:
  ``add x zeros`` is ``x``, ``neg zeros`` and ``sum zeros`` are zeros, and so on (but
  ``mul x zeros`` is computed: NOTE [Zero times infinity]).
- ``fold_identities``: an operation that returns its input unchanged is dropped: ``mul x 1``,
  ``div x 1``, ``expand``/``reshape`` to the same shape, a ``permute`` undone by another.
- ``simplify``: all of them, until nothing changes.
- ``fold_identity_bases``: jit's, after ``simplify``: the identity basis of a Jacobian is
  computed with as a diagonal matrix, by its diagonal.
"""
import math
import weakref

import torch

from . import primitives as P
from .ir import Equation, Literal, Var


def eliminate_dead_code(program):
    """Remove equations whose outputs are not used by the outputs (an effectful one, a check
    that may raise, stays: JAX keeps effectful equations the same way).

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
        if equation.out in live or equation.prim.effectful:
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
        if equation.prim is P.draw_p:  # two draws are two sets of numbers
            equations.append(Equation(equation.prim, inputs, equation.params, equation.out))
            continue
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


# NOTE [Zero times infinity]
# ``mul x zeros`` is not zeros where x holds inf or nan: 0 * inf is nan (IEEE 754), and
# eager torch computes it so, as do the engine's own transforms (a zero cotangent the engine
# knows of is None and never multiplied: autograd.py, forward.py). So a product or a matmul
# is folded to zeros only when every operand is a zero or a finite number; folding
# ``exp(x) * torch.zeros_like(x)`` gave 0 under jit where eager gives nan at x = inf.
# (JAX folds only its symbolic zeros, which are never numbers a user wrote; Inductor keeps
# ``x * 0`` for the same reason.)
_ZERO_ABSORBING = {P.mul_p, P.matmul_p}
# linear in their first operand: a zero first operand gives a zero result
_ZERO_PRESERVING = {P.neg_p, P.sum_p, P.mean_p, P.reshape_p, P.expand_p, P.permute_p,
                    P.unsqueeze_p, P.squeeze_p, P.getitem_p, P.convert_p}


def _is_finite_literal(operand):
    return isinstance(operand, Literal) and isinstance(operand.value, (bool, int, float)) \
        and math.isfinite(operand.value)


def fold_symbolic_zeros(program):
    """Never compute with a tensor known to be zero.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> from minifunctorch.core.passes import fold_symbolic_zeros, eliminate_dead_code
    >>> program = trace(lambda x: x + (torch.zeros_like(x) * 2).neg())(torch.ones(2))
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
        elif prim in _ZERO_ABSORBING and any(is_zero(o) for o in inputs) and all(
                is_zero(o) or _is_finite_literal(o) for o in inputs):
            zeros.add(out)  # NOTE [Zero times infinity]
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
        x = inputs[0] if inputs else None  # (a draw of torch.rand has no operands)
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


# NOTE [An identity basis is a diagonal matrix]
# jacrev pulls back the rows of an identity matrix (vmap of the vjp over them) and jacfwd
# pushes its columns forward, so a traced Jacobian starts from an (n, n) identity constant,
# and its first steps are dense matrix arithmetic on a diagonal matrix: ``tanh_backward(I,
# y)`` is diag(1 - y^2), and ``diag(d) @ W`` is n^2 k multiplications where d[:, None] * W
# takes n k. For a tall jacrev or a wide jacfwd that first matmul is most of the work. This
# pass follows the diagonal through the ops that keep a matrix diagonal (an elementwise op
# whose value is 0 where its first operand is 0, with an operand that varies along one dim:
# mul, tanh_backward, threshold_backward, ...), and computes a matmul of it as a broadcast
# product by its diagonal; every dense equation is kept, and dead-code elimination drops
# the ones nothing reads any more. Each product d_i * w is the dense matmul's (which adds
# zeros to it), but the result may have another memory layout (a broadcast product follows
# its operands' strides, a matmul's output is contiguous), so a later elementwise kernel may
# round a last bit differently. NaN and inf differ: in the dense product a NaN in row i of W
# spreads along column i of the diagonal's zeros, and here it stays in its row, as in the
# Jacobian itself. Only identities the engine made for a Jacobian are
# read so (``identity_basis``): a captured tensor that happens to equal an identity at trace
# time may be written later. Eager transforms take the same shortcut as they compute
# (NOTE [An identity basis is a diagonal matrix, eagerly] in diagonals.py). torch.func
# computes the dense products.
_identity_bases = weakref.WeakValueDictionary()  # id -> an identity the engine made
# the primitives p with p(0, y) == 0, elementwise: p(diag(d), y) is diag(p(d, y)) for a y
# that varies along one dim (elementwise.py registers its backward kernels here)
keeps_diagonal = {P.mul_p}


def identity_basis(n, dtype, device):
    """``torch.eye(n)``, made for a Jacobian's basis (``fold_identity_bases`` reads it as a
    diagonal matrix)."""
    eye = torch.eye(n, dtype=dtype, device=device)
    _identity_bases[id(eye)] = eye
    return eye


def _is_identity_basis(value):
    return _identity_bases.get(id(value)) is value


def fold_identity_bases(program):
    """Compute with a Jacobian's identity basis by its diagonal (NOTE [An identity basis is a
    diagonal matrix]).

    >>> import torch
    >>> from minifunctorch.core import jacfwd, trace
    >>> from minifunctorch.core.passes import fold_identity_bases, simplify
    >>> a = torch.ones(2, 3)
    >>> print(simplify(fold_identity_bases(simplify(trace(jacfwd(lambda x: a @ x.sin()))(
    ...     torch.zeros(3))))))
    { lambda b:f32[3,3] c:f32[3,2] ; a:f32[3] .
      let d:f32[3] = diagonal b offset=0 dim1=0 dim2=1
          e:f32[3] = cos a
          f:f32[3] = mul d e
          g:f32[3,1] = unsqueeze f dim=1
          h:f32[3,2] = mul g c
          i:f32[2,3] = permute h dims=(1,0)
      in (i,) }
    """
    diagonal = {}  # var -> the var of its diagonal, for a var that is a diagonal matrix
    rows = {}  # var -> the var of its diagonal, for a diagonal matrix unsqueezed at dim 1
    equations = []

    def vector(operand, n):
        """``operand`` as what it is along one dim of an (n, n) matrix, or None."""
        if isinstance(operand, Literal):
            return operand
        if not isinstance(operand, Var) or operand in diagonal or operand in rows:
            return None
        if operand.shape == (n,):
            return operand
        if operand.shape in ((1, n), (n, 1)):
            flat = Var((n,), operand.dtype)
            equations.append(Equation(P.reshape_p, [operand], {"shape": (n,)}, flat))
            return flat
        return None

    def diagonal_of(var):
        n = var.shape[0]
        d = Var((n,), var.dtype)
        equations.append(Equation(P.diagonal_p, [var], {"offset": 0, "dim1": 0, "dim2": 1}, d))
        return d

    for var, value in program.constants:
        if len(var.shape) == 2 and var.shape[0] == var.shape[1] and _is_identity_basis(value):
            diagonal[var] = diagonal_of(var)
    for equation in program.equations:
        prim, inputs, out = equation.prim, equation.inputs, equation.out
        square = len(out.shape) == 2 and out.shape[0] == out.shape[1]
        if prim in keeps_diagonal and square and len(inputs) == 2:
            first, second = inputs
            n = out.shape[0]
            if first in diagonal and first.shape == out.shape:
                other = vector(second, n)
                operands = [diagonal[first], other]
            elif prim is P.mul_p and second in diagonal and second.shape == out.shape:
                other = vector(first, n)
                operands = [other, diagonal[second]]
            else:
                other = None
            if other is not None:
                d = Var((n,), out.dtype)
                equations.append(Equation(prim, operands, equation.params, d))
                diagonal[out] = d
        elif prim is P.unsqueeze_p and equation.params["dim"] == 1 and inputs[0] in diagonal:
            rows[out] = diagonal[inputs[0]]
        elif prim is P.matmul_p and isinstance(inputs[1], Var) and (
                inputs[0] in diagonal or inputs[0] in rows):
            m = inputs[1]
            d = diagonal.get(inputs[0]) or rows[inputs[0]]
            if len(m.shape) == 2 and m.shape[0] == d.shape[0] and m.dtype == d.dtype:
                column = Var((d.shape[0], 1), d.dtype)  # diag(d) @ m is d[:, None] * m
                equations.append(Equation(P.unsqueeze_p, [d], {"dim": 1}, column))
                if inputs[0] in diagonal:
                    equations.append(Equation(P.mul_p, [column, m], {}, out))
                else:  # (n, 1, n) @ (n, k): each row of the diagonal times m, (n, 1, k)
                    scaled = Var((d.shape[0], m.shape[1]), out.dtype)
                    equations.append(Equation(P.mul_p, [column, m], {}, scaled))
                    equations.append(Equation(P.unsqueeze_p, [scaled], {"dim": 1}, out))
                continue
        elif prim is P.matmul_p and inputs[1] in diagonal and isinstance(inputs[0], Var):
            m, d = inputs[0], diagonal[inputs[1]]
            if len(m.shape) == 2 and m.shape[1] == d.shape[0] and m.dtype == d.dtype:
                equations.append(Equation(P.mul_p, [m, d], {}, out))  # m @ diag(d)
                continue
        equations.append(equation)
    return program.replace(equations=equations)
