"""Reverse mode as a program transformation: ``vjp_program`` and ``split_vjp``.

NOTE [Same rules, different interpreter]
Neither function has derivative rules of its own. ``vjp_program`` evaluates a program under
an Autograd level sitting on a Tracing level: the differentiator closures of the tape run on
traced values, so the backward ops they issue become equations. The result is then
simplified (zeros folded, common subexpressions shared, dead code dropped), which is what
makes the exported code read like a hand-written backward. In the torch.fx world this is
the ``fx_vjp`` of source-to-source AD; in JAX it is ``vjp`` traced by ``make_jaxpr``.

``split_vjp`` splits the same computation where TorchScript splits a differentiator closure:
the forward program returns the outputs and the values the backward closures captured (the
saved context); the backward program receives exactly those values and the cotangents.
"""
import torch

from . import pytree
from .autograd import AutogradValue
from .dispatch import new_level, transform_scope
from .errors import TransformUsageError
from .passes import simplify
from .program import Program, Var
from .tensor import as_tensors, engine_code, unwrap
from .tracing import TracedUserCode, TracerValue, Tracing, trace_flat
from .transforms import _run_reverse, vjp


def _examples(variables, device):
    return [torch.empty(v.shape, dtype=v.dtype, device="meta") for v in variables]


def vjp_program(program: Program) -> Program:
    """Source-to-source reverse mode: a program from ``(*inputs, *output_cotangents)`` to
    ``(*outputs, *input_cotangents)``.

    >>> import torch
    >>> from minifunctorch.core import trace, vjp_program
    >>> print(vjp_program(trace(torch.sin)(torch.ones(3))))
    { lambda ; a:f32[3] b:f32[3] .
      let c:f32[3] = sin a
          d:f32[3] = cos a
          e:f32[3] = mul b d
      in (c, e) }
    """
    count = len(program.inputs)
    for position, output in enumerate(program.outputs):
        if not isinstance(output, Var):
            raise TransformUsageError(
                f"vjp_program(program): expected every output of program {program.name} to be "
                f"a tensor, got the number {output.value!r} as output {position} (a number has "
                "no cotangent). Fix: return only tensors from the traced function."
            )

    def forward_and_backward(*inputs_and_cotangents):
        inputs, cotangents = inputs_and_cotangents[:count], inputs_and_cotangents[count:]
        outputs, pull_back = vjp(
            lambda *xs: as_tensors(tuple(program.evaluate_flat([unwrap(x) for x in xs]))), *inputs)
        return (*outputs, *pull_back(tuple(cotangents)))

    examples = _examples([*program.inputs, *program.outputs], program.device)
    joint = trace_flat(forward_and_backward, examples, device=program.device,
                       name=f"{program.name}_vjp")
    return simplify(joint)


def _saved_values(tape, level):
    """The traced values the backward closures captured, in tape order, without repeats."""
    saved, seen = [], set()
    for entry in tape.entries:
        for value in entry.saved.values():
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, TracerValue) and leaf.dispatcher is level \
                        and id(leaf) not in seen:
                    seen.add(id(leaf))
                    saved.append(leaf)
    return saved


def split_vjp(f):
    """Split reverse mode into a forward program and a backward program.

    ``fwd(*inputs)`` returns ``(outputs, saved)``, where ``saved`` is the tuple of values the
    backward closures captured; ``bwd(saved, cotangents)`` returns the input cotangents.

    >>> import torch
    >>> from minifunctorch.core import split_vjp
    >>> fwd, bwd = split_vjp(torch.sin)(torch.ones(3))
    >>> print(fwd)
    { lambda ; a:f32[3] .
      let b:f32[3] = sin a
      in (b, a) }
    >>> print(bwd)
    { lambda ; a:f32[3] b:f32[3] .
      let c:f32[3] = cos a
          d:f32[3] = mul b c
      in (d,) }
    """
    def split(*args):
        with engine_code():
            return _split(f, args)
    return split


def _split(f, args):
    name = getattr(f, "__name__", "f")
    example_leaves, example_treedef = pytree.tree_flatten(args)
    for leaf in example_leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TransformUsageError(
                f"split_vjp({name})(<inputs>): expected every argument to be a tensor (or a "
                f"pytree of tensors), got a leaf of type {type(leaf).__name__}. Fix: bind "
                "the other values first, e.g. split_vjp(functools.partial(f, k=2))(x)."
            )
    device = example_leaves[0].device if example_leaves else torch.device("cpu")
    forward_level = new_level(Tracing, device=device)
    with transform_scope(forward_level):
        traced_args = pytree.tree_unflatten(
            example_treedef,
            [forward_level.new_input(x.shape, x.dtype) for x in example_leaves])
        call = f"split_vjp({name})(<inputs>)"
        autograd, out, _, inputs, _ = _run_reverse(
            f, traced_args, {}, tuple(range(len(args))), call,
            user_scope=lambda: TracedUserCode(call))
    out_leaves, out_treedef = pytree.tree_flatten(out)
    if not all(isinstance(o, AutogradValue) and o.dispatcher is autograd for o in out_leaves):
        raise TransformUsageError(
            f"split_vjp({name})(<inputs>): every output must depend on the inputs. Fix: "
            "return only values computed from the inputs."
        )
    saved = _saved_values(autograd.tape, forward_level)
    bwd = _backward_program(name, autograd, saved, out_leaves, inputs, device)
    bwd, saved = _drop_unread_saved(bwd, saved)
    outputs = [o.payload.var for o in out_leaves] + [s.var for s in saved]
    fwd = simplify(Program(forward_level.inputs, forward_level.constants,
                           forward_level.equations, outputs, device=device,
                           name=f"{name}_fwd"))
    fwd.out_treedef = pytree.tree_structure(
        (pytree.tree_unflatten(out_treedef, [0] * len(out_leaves)), tuple([0] * len(saved))))
    return fwd, bwd


def _drop_unread_saved(bwd, saved):
    """Keep only the saved values that the (simplified) backward program reads.

    NOTE [A closure captures more than its backward reads]
    The saved context is read off the closures' cells, and a cell can hold a value that the
    backward never computes with: in ``(x * W).sum() + x.exp().sum()`` with a constant ``W``,
    add's closure holds both summands (to undo broadcasting) and mul's holds ``x`` for the
    cotangent of ``W``, which nobody asked for and simplify drops. Saving those would keep
    them alive between the passes for nothing (here ``x`` and both sums, besides ``exp x``),
    so they are dropped from both programs, and the forward loses what only computed them.
    """
    read = {o for eq in bwd.equations for o in eq.inputs} | set(bwd.outputs)
    kept = [i for i, var in enumerate(bwd.inputs[:len(saved)]) if var in read]
    inputs = [bwd.inputs[i] for i in kept] + bwd.inputs[len(saved):]
    return bwd.replace(inputs=inputs), [saved[i] for i in kept]


def _backward_program(name, autograd, saved, out_leaves, inputs, device):
    """Re-run the recorded backward closures, with the saved values as program inputs.

    The closures hold the forward's traced values. For the backward trace they are made
    inputs of a new Tracing level (their level is switched for the duration, then restored),
    so the backward program takes exactly the saved context, nothing else.
    """
    level = new_level(Tracing, device=device)
    original_levels = [(value, value.dispatcher, value.var) for value in saved]
    with transform_scope(level):
        try:
            for value in saved:
                fresh = level.new_input(value.var.shape, value.var.dtype)
                value.dispatcher, value.var = level, fresh.var
            cotangents = [level.new_input(o.shape, o.dtype) for o in out_leaves]
            seeds = {}
            for o, ct in zip(out_leaves, cotangents):
                seeds[o.name] = ct
            gradients = autograd.tape.backward(seeds, record_steps=False)
            results = []
            for leaves, wrapped, _ in inputs:
                for leaf, value in zip(leaves, wrapped):
                    g = gradients.get(value.name)
                    results.append(g if g is not None else
                                   torch.zeros(tuple(leaf.shape), dtype=leaf.dtype, device=device))
        finally:
            for value, dispatcher, var in original_levels:
                value.dispatcher, value.var = dispatcher, var
    outputs = [level._operand(r) for r in results]
    bwd = simplify(Program(level.inputs, level.constants, level.equations, outputs,
                           device=device, name=f"{name}_bwd"))
    treedefs = [treedef for _, _, treedef in inputs]
    bwd.out_treedef = pytree.tree_structure(
        tuple(pytree.tree_unflatten(t, [0] * t.num_leaves) for t in treedefs))
    return bwd
