"""Export a Program to torch.fx, for reading the code and for compilers (torch.compile).

Each equation becomes one ``call_function`` node whose target is the plain torch function
(``torch.sin``, ``operator.mul``, ...), so ``GraphModule.code`` reads like hand-written code.
The transposes of gather and diagonal are written as torch's own scatters into fresh zeros.
"""
import cmath
import operator

import torch
import torch.fx

from . import primitives as P
from .values import Value
from .errors import TransformUsageError
from .ir import INFIX_FUNCTIONS, Literal, export_target


def program_to_fx(program) -> torch.fx.GraphModule:
    """Build a GraphModule computing ``program`` on its flat inputs (a tuple of outputs)."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    names = program.names()
    nodes = {}
    for var in program.inputs:
        nodes[var] = graph.placeholder(names[var])
    for var, value in program.constants:
        if isinstance(value, Value):
            raise TransformUsageError(
                f"{program.name} program.to_fx(): the program captured a value of an enclosing "
                "transform, which cannot be exported. Fix: trace the whole computation, "
                "transforms included, from the outside."
            )
        root.register_buffer(names[var], value)
        nodes[var] = graph.get_attr(names[var])

    def operand(o):
        if not isinstance(o, Literal):
            return nodes[o]
        if isinstance(o.value, complex) and not cmath.isfinite(o.value):
            # FX writes such a literal as (1+infj), which is no Python: build it at run time
            return graph.call_function(complex, (o.value.real, o.value.imag))
        return o.value

    for equation in program.equations:
        args = [operand(o) for o in equation.inputs]
        prim, params = equation.prim, equation.params
        if prim is P.div_p and isinstance(equation.inputs[0], Literal):
            node = graph.call_function(torch.div, tuple(args))  # (as emit_call says)
        elif prim in INFIX_FUNCTIONS:
            node = graph.call_function(INFIX_FUNCTIONS[prim], tuple(args))
        elif prim is P.getitem_p:
            node = graph.call_function(operator.getitem, (args[0], params["index"]))
        elif prim is P.cat_p:
            node = graph.call_function(torch.cat, (args,), {"dim": params["dim"]})
        elif prim is P.gather_p:
            node = graph.call_function(torch.gather, (args[0], params["dim"], args[1]))
        elif prim is P.scatter_add_p:
            zeros = graph.call_method("new_zeros", (args[0], params["shape"]))
            node = graph.call_function(torch.scatter_add, (zeros, params["dim"], args[1], args[0]))
        elif prim is P.diagonal_scatter_p:
            zeros = graph.call_method("new_zeros", (args[0], params["shape"]))
            node = graph.call_function(torch.diagonal_scatter, (zeros, args[0]), {
                "offset": params["offset"], "dim1": params["dim1"], "dim2": params["dim2"]})
        else:
            target, renames = export_target(prim)
            kwargs = {renames.get(k, k): v for k, v in params.items()}
            node = graph.call_function(target, tuple(args), kwargs)
        nodes[equation.out] = node
    graph.output(tuple(operand(o) for o in program.outputs))
    graph.lint()
    class_name = "".join(ch if ch.isalnum() else "_" for ch in program.name) or "Program"
    return torch.fx.GraphModule(root, graph, class_name=class_name)
