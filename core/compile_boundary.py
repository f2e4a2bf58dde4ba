"""Where torch.compile meets the engine: a transform called while dynamo traces runs eagerly.

NOTE [Transforms under torch.compile]
torch.compile's dynamo traces Python bytecode into a graph of torch ops. torch.func's
transforms are traced into that graph (dynamo knows them, as higher-order ops: in PyTorch
``torch/_dynamo/variables/higher_order_ops.py``); the engine's are plain Python, and dynamo
cannot follow them through: it breaks the graph wherever the engine makes a FuncTensor
(``_make_wrapper_subclass`` is not traceable), and with ``dynamic=True`` the shapes that a
backward closure recorded in one piece become symbols unrelated to the next piece's tensors,
so a reshape fails under fake tensors. So each entry to the engine (a transformed function,
a vjp_fn) asks whether dynamo is tracing it, and if so runs as one call outside the graph,
the way dynamo runs any function it is told not to trace (``torch.compiler.disable``): the
code around it is compiled, and the transform runs eagerly and computes what it computes
without torch.compile. Compiling vmap(grad(f)) of a small MLP took 9.8 s, and each call then
took 4.4 times its eager time, one graph break per op; now it takes 0.19 s and 1.26 times
(the break and the guards). torch.func's own transforms, traced into the graph, gain from
torch.compile and these do not; jit is this engine's way to a compiled program. (Programs
and jit's calls are plain torch ops on plain tensors, which dynamo traces as they are.) The
question is ``torch.compiler.is_dynamo_compiling()``: False when Python runs it, True when
dynamo traces it. (Not ``is_compiling()``, which is True for the whole compile session:
eager code that dynamo runs meanwhile, such as a function put in the graph with
``allow_in_graph`` and run on fake tensors, would take the detour again inside the detour,
for ever.)
"""
import functools

import torch

dynamo_traces = torch.compiler.is_dynamo_compiling  # (dynamo folds it to True as it traces)


@functools.partial(torch.compiler.disable, reason=(
    "minifunctorch's transforms run outside torch.compile's graph (NOTE [Transforms under "
    "torch.compile] in minifunctorch.core.compile_boundary). Fix: drop fullgraph=True, or "
    "compile the transformed function with minifunctorch.core.jit(..., backend='inductor')"))
def outside_the_graph(entry, args, kwargs):
    """``entry(*args, **kwargs)``, run eagerly: called instead of it while dynamo traces."""
    return entry(*args, **kwargs)
