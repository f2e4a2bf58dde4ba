"""torch.einsum as one primitive.

NOTE [einsum is one primitive]
torch.einsum is a composite: torch's C++ turns it into permutes, reshapes and one batched
matrix product per pair of operands (``sumproduct_pair`` in aten/src/ATen/native/Linear.cpp),
and each of those reached the aten door: grad of ``einsum('ij,kj->ik', x, x)`` recorded 12
engine ops and took 1.8 times torch.func's time. Here it is one primitive whose kernel is
torch.einsum itself, and whose rules are einsums again:
- vjp: the cotangent of operand k is the einsum of ct and the other operands into k's
  subscripts; an index that only operand k has (summed away by the forward) comes back as
  an expand along it;
- jvp: einsum is linear in each operand, so the tangent is the sum over k of the einsum with
  operand k replaced by its tangent;
- vmap: a letter that the equation does not use names the batch dim, in every batched
  operand and first in the output; torch's kernel contracts the rest as before.
JAX writes jnp.einsum as a sequence of dot_general contractions, each with its own rules;
here the kernel keeps torch's choice of contraction order. An ellipsis becomes letters of
its own. Forms outside these rules keep torch's composite, as before: an index repeated
within one operand (a diagonal), a dim of size 1 that broadcasts against a larger one (in
the ellipsis too), the sublist format, mixed or complex dtypes.
"""
import collections
import string

import torch

from . import ops, torch_api
from . import primitives as P
from .autograd import expand_back, vjp_rules, wants_cotangent
from .batching import batching_rules, move_bdim
from .errors import UnsupportedOperationError
from .forward import add_tangents, jvp_rules
from .values import Value, bind

einsum_p = P.primitive("einsum", lambda *operands, equation: torch.einsum(equation, *operands))


def _subscripts(equation):
    """An explicit equation ('ij,kj->ik') as its inputs' subscripts and the output's."""
    inputs, out = equation.split("->")
    return inputs.split(","), out


def explicit_equation(equation, shapes):
    """The equation with its output written out ('ij,jk' -> 'ij,jk->ik'), or None where the
    rules here do not apply (NOTE [einsum is one primitive])."""
    equation = equation.replace(" ", "")
    if equation.count("->") > 1:
        return None
    lhs, arrow, out = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(shapes):
        return None
    ellipsis = ""
    if "..." in equation:  # its dims get letters of their own, right-aligned as torch does
        inputs, out, ellipsis = _name_the_ellipsis(inputs, out, shapes)
        if inputs is None:
            return None
    letters = set(string.ascii_letters)
    if not set("".join(inputs) + out) <= letters:
        return None
    sizes = {}
    for subscripts, shape in zip(inputs, shapes):
        if len(set(subscripts)) != len(subscripts) or len(subscripts) != len(shape):
            return None
        for letter, size in zip(subscripts, shape):
            if sizes.setdefault(letter, size) != size:
                return None
    if not arrow:  # torch's implicit output: the ellipsis, then the letters used once, A-Z
        # then a-z
        counts = collections.Counter("".join(inputs))
        out = ellipsis + "".join(sorted(letter for letter, count in counts.items()
                                        if count == 1 and letter not in ellipsis))
    if len(set(out)) != len(out) or not set(out) <= set(sizes):
        return None
    return f"{','.join(inputs)}->{out}"


def _name_the_ellipsis(inputs, out, shapes):
    """The subscripts with each '...' written as letters the equation does not use, one per
    dim it covers, right-aligned across the operands (their sizes must then agree: a
    broadcast is left to torch's composite); (None, None, None) if it cannot be."""
    dims = []
    for subscripts, shape in zip(inputs, shapes):
        if subscripts.count("...") > 1 or (subscripts.count("...") == 0 and "." in subscripts):
            return None, None, None
        dims.append(len(shape) - len(subscripts.replace("...", "")) if "..." in subscripts
                    else 0)
    used = set("".join(inputs) + out)
    free = [letter for letter in string.ascii_letters if letter not in used]
    if min(dims) < 0 or max(dims) > len(free) or out.count("...") > 1:
        return None, None, None
    ellipsis = "".join(free[:max(dims)])
    named = [s.replace("...", ellipsis[len(ellipsis) - n:] if n else "")
             for s, n in zip(inputs, dims)]
    return named, out.replace("...", ellipsis), ellipsis


@torch_api.register(torch.einsum)
def einsum(*args):
    if not args or not isinstance(args[0], str):
        return NotImplemented  # the sublist format: torch's composite
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands or not all(isinstance(x, (torch.Tensor, Value)) for x in operands):
        return NotImplemented
    dtype = operands[0].dtype
    if not dtype.is_floating_point or any(x.dtype != dtype for x in operands):
        return NotImplemented
    explicit = explicit_equation(equation, [ops.shape_of(x) for x in operands])
    if explicit is None:
        return NotImplemented
    return bind(einsum_p, *operands, equation=explicit)


def einsum_vjp(*operands, equation):
    inputs, out = _subscripts(equation)

    def backward(ct):
        cts = []
        for k, (x, subscripts) in enumerate(zip(operands, inputs)):
            if not wants_cotangent(k, x):
                cts.append(None)
                continue
            others = [o for j, o in enumerate(operands) if j != k]
            other_subscripts = [s for j, s in enumerate(inputs) if j != k]
            present = set(out).union(*other_subscripts)
            kept = "".join(letter for letter in subscripts if letter in present)
            ct_x = bind(einsum_p, ct, *others,
                        equation=f"{','.join([out, *other_subscripts])}->{kept}")
            summed = tuple(d for d, letter in enumerate(subscripts) if letter not in kept)
            cts.append(expand_back(ct_x, ops.shape_of(x), summed, keepdim=False))
        return tuple(cts)
    return bind(einsum_p, *operands, equation=equation), backward


vjp_rules[einsum_p] = einsum_vjp


def einsum_jvp(primals, tangents, *, equation):
    out_dot = None
    for k, x_dot in enumerate(tangents):
        if x_dot is not None:
            operands = list(primals)
            operands[k] = x_dot
            out_dot = add_tangents(out_dot, bind(einsum_p, *operands, equation=equation))
    return bind(einsum_p, *primals, equation=equation), out_dot


jvp_rules[einsum_p] = einsum_jvp


def einsum_batch(values, bdims, *, equation):
    inputs, out = _subscripts(equation)
    free = [letter for letter in string.ascii_letters if letter not in equation]
    if not free:
        raise UnsupportedOperationError(
            f"einsum('{equation}', ...) under vmap: the equation uses all 52 letters, and "
            "vmap needs one more for its batch dim. Fix: contract in two einsums.")
    batch_letter = free[0]
    moved, batched_inputs = [], []
    for value, bdim, subscripts in zip(values, bdims, inputs):
        if bdim is None:
            moved.append(value)
            batched_inputs.append(subscripts)
        else:
            moved.append(move_bdim(value, bdim, 0))
            batched_inputs.append(batch_letter + subscripts)
    return bind(einsum_p, *moved,
                equation=f"{','.join(batched_inputs)}->{batch_letter}{out}"), 0


batching_rules[einsum_p] = einsum_batch
