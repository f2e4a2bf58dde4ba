"""Stages and stacks: what each magic does to a function, and how stacked magics compose.

A *stage* is one transform magic with its flags parsed (``%%grad --wrt w`` is a
:class:`GradStage`). A :class:`Stack` is the stages of one cell, outermost first, over the
cell's body. This module holds no transform logic: every stage calls one function of an
*engine* (``minifunctorch.core``, or ``torch.func`` for ``--check``) and only chooses the
arguments, selects its outputs and names them. It does not import IPython.

NOTE [Stacked magics compose]
Stacked magics read as function composition, outermost first::

    %%vmap --over x y        vmap(grad(cell, argnums=2), in_dims=(0, 0, None))(x, y, w)
    %%grad --wrt w
    ((x @ w - y) ** 2).mean()

Every level of the stack is a function of the *same* parameters: the union of all the names
the stack's flags list, in order of first appearance, outermost magic first (here
``(x, y, w)``). The body becomes ``def cell(x, y, w)``; each stage, innermost first, wraps the
function below it into a new function of the same parameters and selects its own ones: grad
by ``argnums`` (the positions of its ``--wrt`` names), vmap by ``in_dims`` (an int for its
``--over`` names, ``None`` for the others), jvp by splitting the parameters into primals,
tangents and constants. A name a level does not select is a constant for that level, which
is exactly what the same Python written with torch.func would do. So any order and depth of
grad, vmap, jvp, jacobian and hessian composes, and only the outermost magic binds names in
the notebook. ``%%trace`` on top traces the function of the whole stack.

NOTE [Outputs: parts and extras]
A stage function returns ``(parts, extras)``. ``parts`` is a tuple: the stage's result, one
entry per output name (``dx``, ``dw`` for ``--wrt x w``); ``extras`` is a dict of side
results with their names (the value under ``--value``, the aux of ``--has-aux``, the primal
output of jvp). An outer transform transforms the parts and carries the extras along as its
*aux* output (``has_aux=True``, which every torch.func-style transform accepts), so that a
``--value`` asked for on an inner ``%%grad`` comes out of an outer ``%%vmap`` batched, as a
per-example loss. The names of both are fixed before anything runs
(:attr:`Stack.outputs`), so name clashes are reported as usage errors, up front.

NOTE [One stack, two engines]
A stage receives its engine as an argument (``api``) and calls ``api.grad_and_value``,
``api.vmap``, ``api.jvp``, ``api.jacrev`` or ``api.jacfwd``, whose signatures are torch.func's.
``--check`` builds the same stack over ``torch.func`` and compares the results, leaf by leaf.
"""
import dataclasses

import torch

from .cell import FUNCTION_NAME

# The magics that can be stacked at the top of a cell.
STACKABLE = ("grad", "vmap", "jvp", "jacobian", "hessian", "trace")


class StackError(ValueError):
    """The flags of a magic, or the way magics are stacked, cannot work.

    ``stage`` is the stage whose flags are at fault, when there is one.
    """

    def __init__(self, message, stage=None):
        super().__init__(message)
        self.stage = stage


@dataclasses.dataclass(frozen=True)
class Outputs:
    """The names a function of the stack returns: ``parts`` (the result), then ``extras``."""

    parts: tuple
    extras: tuple = ()

    @property
    def all(self) -> tuple:
        return self.parts + self.extras


def _named(function, name=FUNCTION_NAME):
    """Name a function of the stack. A stage names the function it hands to its transform
    with its :attr:`Stage.marker` (``cell0``, ``cell1``, ...), so that an engine error message,
    which begins with the call (``grad(cell1, argnums=(0,))(<inputs>): ...``), says which
    magic of the stack it is about (the magics then write that magic's line instead)."""
    function.__name__ = function.__qualname__ = name
    return function


def _is_array(value) -> bool:
    # FuncTensor is imported lazily: core must stay importable without the magics, and this
    # check is the only place the magics look at a wrapped value.
    from minifunctorch.core import FuncTensor
    return isinstance(value, (torch.Tensor, FuncTensor))


def map_leaves(fn, tree):
    """Apply ``fn`` to every leaf of a tuple/list/dict tree (the only containers we build).

    >>> map_leaves(lambda v: v * 10, {"a": (1, 2), "b": [3]})
    {'a': (10, 20), 'b': [30]}
    """
    if isinstance(tree, dict):
        return {key: map_leaves(fn, value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_leaves(fn, value) for value in tree)
    return fn(tree)


def leaves(tree) -> list:
    """The leaves of a tuple/list/dict tree, in order.

    >>> leaves({"a": (1, 2), "b": [3]})
    [1, 2, 3]
    """
    found = []
    map_leaves(found.append, tree)
    return found


def _select(names, argnums):
    """The names ``argnums`` picks out of ``names`` (all of them without ``argnums``)."""
    if not argnums:
        return tuple(names)
    chosen = []
    for a in argnums:
        if not -len(names) <= a < len(names):
            raise StackError(
                f"--argnums {a} is out of range: --wrt names {len(names)} input(s) "
                f"({', '.join(names)}). Fix: use --argnums between 0 and {len(names) - 1}.")
        chosen.append(names[a])
    if len(set(chosen)) != len(chosen):
        raise StackError(f"--argnums {' '.join(map(str, argnums))} names an input twice. Fix: "
                         "list each position once.")
    return tuple(chosen)


def _check_out(out, default, what):
    if not out:
        return tuple(default)
    if len(out) != len(default):
        raise StackError(
            f"--out gives {len(out)} name(s) ({', '.join(out)}) for {len(default)} {what} "
            f"({', '.join(default)}). Fix: give one name per output, in that order.")
    return tuple(out)


def _split_aux_pair(out, magic):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise StackError(
            f"{magic} --has-aux: expected the cell to return a pair (output, aux), got "
            f"{type(out).__name__}. Fix: end the cell with `loss, aux`, or drop --has-aux.")
    return out[0], out[1]


def _require_one_part(inner: Outputs):
    if len(inner.parts) != 1:
        raise StackError(
            f"this magic needs a single output from the magic below it, which produces "
            f"{len(inner.parts)} ({', '.join(inner.parts)}). Fix: differentiate one output, "
            "e.g. by naming a single input in the inner magic's --wrt.")


def _require_tensor_parts(parts, magic):
    for part in parts:
        if not _is_array(part):
            raise StackError(
                f"{magic}: expected the cell to return a tensor, got {type(part).__name__}. "
                "Fix: return one tensor (stack one magic per output if you need several).")


# --- stages --------------------------------------------------------------------------------
@dataclasses.dataclass
class Stage:
    """One magic of a stack. ``line`` is its flags as the user wrote them."""

    line: str = ""
    check: bool = False
    quiet: bool = False
    marker: str = FUNCTION_NAME  # set by Stack: cell<position>, outermost first

    magic = "stage"

    @property
    def call(self) -> str:
        """``%%grad --wrt w``: how messages name the magic."""
        return f"%%{self.magic} {self.line}".rstrip()

    def input_names(self) -> tuple:
        """The notebook names this magic makes parameters of the function."""
        return ()

    def outputs(self, inner: Outputs) -> Outputs:
        raise NotImplementedError

    def apply(self, f, params, inner, api):
        """Wrap ``f`` (a function of ``params`` returning ``(parts, extras)`` named as
        ``inner`` says) with this stage's transform of ``api``; the result is a function of
        the same ``params``."""
        raise NotImplementedError


@dataclasses.dataclass
class DifferentiatingStage(Stage):
    """A stage that differentiates with respect to ``--wrt`` inputs, some of them picked by
    ``--argnums`` (grad, jacobian, hessian)."""

    wrt: tuple = ()
    argnums: tuple = ()

    def __post_init__(self):
        _select(self.wrt, self.argnums)  # raises StackError on a bad --argnums

    @property
    def selected(self) -> tuple:
        return _select(self.wrt, self.argnums)

    def input_names(self):
        return tuple(self.wrt)


@dataclasses.dataclass
class GradStage(DifferentiatingStage):
    """``%%grad``: the gradient of the cell's scalar result w.r.t. the ``--wrt`` inputs.

    ``--wrt`` lists the function's differentiable inputs in order; ``--argnums`` picks some of
    them by position, as torch.func's ``argnums`` picks arguments (default: all of them).

    >>> import torch
    >>> from minifunctorch import core
    >>> stage = GradStage(wrt=("x",))
    >>> f = stage.apply(lambda x: (((x ** 2).sum(),), {}), ("x",), Outputs(("out",)), core)
    >>> f(torch.tensor([1.0, 2.0]))
    ((tensor([2., 4.]),), {})
    >>> stage.outputs(Outputs(("out",)))
    Outputs(parts=('dx',), extras=())
    """

    out: tuple = ()
    has_aux: bool = False
    aux_out: str = "aux"
    value: bool = False
    value_out: str = "value"
    tape: bool = False

    magic = "grad"


    def outputs(self, inner):
        _require_one_part(inner)
        parts = _check_out(self.out, [f"d{name}" for name in self.selected], "gradient(s)")
        extras = inner.extras + ((self.aux_out,) if self.has_aux else ()) \
            + ((self.value_out,) if self.value else ())
        return Outputs(parts, extras)

    def apply(self, f, params, inner, api):
        argnums = tuple(params.index(name) for name in self.selected)

        def scalar_and_extras(*args):
            parts, extras = f(*args)
            out = parts[0]
            if self.has_aux:
                out, aux = _split_aux_pair(out, self.call)
                extras = {**extras, self.aux_out: aux}
            return out, extras

        grad_and_value = api.grad_and_value(_named(scalar_and_extras, self.marker),
                                            argnums=argnums, has_aux=True)

        def gradients(*args):
            grads, (value, extras) = grad_and_value(*args)
            if self.value:
                extras = {**extras, self.value_out: value}
            return tuple(grads), extras
        return _named(gradients)


@dataclasses.dataclass
class VmapStage(Stage):
    """``%%vmap``: the cell run once over a batch of the ``--over`` inputs.

    ``in_dims`` maps each ``--over`` name to its batch dim (``None``: not batched); every other
    parameter of the stack is not batched. ``reduce`` ('sum' or 'mean') reduces the stacked
    outputs over the batch dim.

    >>> import torch
    >>> from minifunctorch import core
    >>> stage = VmapStage(over=("x",), in_dims={"x": 0})
    >>> f = stage.apply(lambda x, w: ((x @ w,), {}), ("x", "w"), Outputs(("out",)), core)
    >>> f(torch.ones(4, 3), torch.ones(3))
    ((tensor([3., 3., 3., 3.]),), {})
    """

    over: tuple = ()
    in_dims: dict = dataclasses.field(default_factory=dict)
    out_dims: tuple = (0,)
    chunk_size: int | None = None
    randomness: str = "error"
    reduce: str | None = None
    out: tuple = ()

    magic = "vmap"

    def input_names(self):
        return tuple(self.over)

    def outputs(self, inner):
        if len(self.out_dims) not in (1, len(inner.parts)):
            raise StackError(
                f"--out-dims gives {len(self.out_dims)} dims for {len(inner.parts)} output(s) "
                f"({', '.join(inner.parts)}). Fix: give one dim for all, or one per output.")
        if self.reduce and None in self.out_dims:
            raise StackError("--reduce needs a batch dim in every output; --out-dims has None. "
                             "Fix: drop --reduce, or give every output a batch dim.")
        return Outputs(_check_out(self.out, inner.parts, "output(s)"), inner.extras)

    def _dims(self, n_parts):
        """(dims of the parts, dim of the extras): out_dims as a prefix of (parts, extras)."""
        if len(self.out_dims) == 1:
            return (self.out_dims[0],) * n_parts, self.out_dims[0]
        return tuple(self.out_dims), 0

    def apply(self, f, params, inner, api):
        in_dims = tuple(self.in_dims.get(name) for name in params)
        part_dims, extra_dims = self._dims(len(inner.parts))
        if len(set(part_dims)) == 1 and part_dims[0] == extra_dims:
            out_dims = extra_dims
        else:
            out_dims = (part_dims, extra_dims)  # a prefix of the output (parts, extras)
        options = {"chunk_size": self.chunk_size} if self.chunk_size is not None else {}
        vmapped = api.vmap(_named(f, self.marker), in_dims=in_dims, out_dims=out_dims,
                           randomness=self.randomness, **options)
        if not self.reduce:
            return _named(vmapped)
        reduce = torch.sum if self.reduce == "sum" else torch.mean

        def reduced(*args):
            parts, extras = vmapped(*args)
            parts = tuple(map_leaves(lambda v, d=d: reduce(v, dim=d), part)
                          for part, d in zip(parts, part_dims))
            extras = map_leaves(lambda v: reduce(v, dim=extra_dims), extras)
            return parts, extras
        return _named(reduced)


@dataclasses.dataclass
class JvpStage(Stage):
    """``%%jvp``: forward mode, ``(f(primals), J @ tangents)``.

    The ``--wrt`` inputs are the primals; the ``--tangent`` inputs (notebook variables, one
    per primal) their tangents. The result is the tangent output (``out_dot``); the primal
    output is bound too (``out``).

    >>> import torch
    >>> from minifunctorch import core
    >>> stage = JvpStage(wrt=("x",), tangent=("t",))
    >>> inner = Outputs(("out",))  # the names of the function below: the cell's result
    >>> f = stage.apply(lambda x, t: ((torch.sin(x),), {}), ("x", "t"), inner, core)
    >>> f(torch.tensor(0.0), torch.tensor(2.0))
    ((tensor(2.),), {'out': tensor(0.)})
    """

    wrt: tuple = ()
    tangent: tuple = ()
    out: tuple = ()
    value_out: tuple = ()
    has_aux: bool = False
    aux_out: str = "aux"

    magic = "jvp"

    def __post_init__(self):
        if len(self.wrt) != len(self.tangent):
            raise StackError(
                f"--wrt names {len(self.wrt)} input(s) but --tangent names "
                f"{len(self.tangent)}. Fix: give one tangent per input, in the same order.")
        shared = set(self.wrt) & set(self.tangent)
        if shared:
            raise StackError(f"{', '.join(sorted(shared))} is both a primal (--wrt) and a "
                             "tangent (--tangent). Fix: hold the tangent in its own variable.")

    def input_names(self):
        return tuple(self.wrt) + tuple(self.tangent)

    def outputs(self, inner):
        if self.has_aux:
            _require_one_part(inner)
        default = [f"{name}_dot" for name in inner.parts]
        parts = _check_out(self.out, default, "tangent output(s)")
        values = tuple(self.value_out) if self.value_out else inner.parts
        if len(values) != len(inner.parts):
            raise StackError(f"--value-out gives {len(values)} name(s) for {len(inner.parts)} "
                             f"output(s) ({', '.join(inner.parts)}). Fix: give one name per "
                             "output, in that order.")
        return Outputs(parts, inner.extras + ((self.aux_out,) if self.has_aux else ()) + values)

    def apply(self, f, params, inner, api):
        wrt_positions = [params.index(name) for name in self.wrt]
        tangent_positions = [params.index(name) for name in self.tangent]
        value_names = tuple(self.value_out) or inner.parts

        def pushed(*args):
            primals = tuple(args[i] for i in wrt_positions)
            tangents = tuple(args[i] for i in tangent_positions)

            def of_primals(*values):  # f with the primals as its only inputs
                full = list(args)
                for position, value in zip(wrt_positions, values):
                    full[position] = value
                parts, extras = f(*full)
                if self.has_aux:
                    out, aux = _split_aux_pair(parts[0], self.call)
                    parts, extras = (out,), {**extras, self.aux_out: aux}
                return parts, extras

            primal_parts, tangent_parts, extras = api.jvp(_named(of_primals, self.marker),
                                                          primals, tangents, has_aux=True)
            return tuple(tangent_parts), {**extras, **dict(zip(value_names, primal_parts))}
        return _named(pushed)


def _jacobian_names(prefix, part_names, arg_names):
    """``jac_x`` (one output), or ``jac_dw_x`` (one name per output and input)."""
    if len(part_names) == 1:
        return [f"{prefix}_{a}" for a in arg_names]
    return [f"{prefix}_{p}_{a}" for p in part_names for a in arg_names]


@dataclasses.dataclass
class JacobianStage(DifferentiatingStage):
    """``%%jacobian``: the Jacobian w.r.t. the ``--wrt`` inputs, by ``jacrev`` or ``jacfwd``.

    >>> import torch
    >>> from minifunctorch import core
    >>> stage = JacobianStage(wrt=("x",))
    >>> f = stage.apply(lambda x: ((x ** 2,), {}), ("x",), Outputs(("out",)), core)
    >>> f(torch.tensor([1.0, 2.0]))[0][0]
    tensor([[2., 0.],
            [0., 4.]])
    """

    mode: str = "rev"
    chunk_size: int | None = None
    out: tuple = ()

    magic = "jacobian"


    def outputs(self, inner):
        default = _jacobian_names("jac", inner.parts, self.selected)
        return Outputs(_check_out(self.out, default, "Jacobian(s)"), inner.extras)

    def apply(self, f, params, inner, api):
        argnums = tuple(params.index(name) for name in self.selected)

        def checked(*args):
            parts, extras = f(*args)
            _require_tensor_parts(parts, self.call)
            return parts, extras

        if self.mode == "rev":
            options = {"chunk_size": self.chunk_size} if self.chunk_size is not None else {}
            jacobian = api.jacrev(_named(checked, self.marker), argnums=argnums, has_aux=True,
                                  **options)
        else:
            jacobian = api.jacfwd(_named(checked, self.marker), argnums=argnums, has_aux=True)

        def jacobians(*args):
            per_part, extras = jacobian(*args)  # per_part[output][input]
            return tuple(j for row in per_part for j in row), extras
        return _named(jacobians)


@dataclasses.dataclass
class HessianStage(DifferentiatingStage):
    """``%%hessian``: the Hessian of the scalar result, forward-over-reverse.

    >>> import torch
    >>> from minifunctorch import core
    >>> stage = HessianStage(wrt=("x",))
    >>> f = stage.apply(lambda x: (((x ** 3).sum(),), {}), ("x",), Outputs(("out",)), core)
    >>> f(torch.tensor([1.0, 2.0]))[0][0]
    tensor([[ 6.,  0.],
            [ 0., 12.]])
    """

    out: tuple = ()

    magic = "hessian"


    def outputs(self, inner):
        _require_one_part(inner)
        selected = self.selected
        if len(selected) == 1:
            default = [f"hess_{selected[0]}"]
        else:
            default = [f"hess_{a}_{b}" for a in selected for b in selected]
        return Outputs(_check_out(self.out, default, "Hessian block(s)"), inner.extras)

    def apply(self, f, params, inner, api):
        argnums = tuple(params.index(name) for name in self.selected)

        def scalar_and_extras(*args):
            parts, extras = f(*args)
            _require_tensor_parts(parts, self.call)
            return parts[0], extras

        # NOTE [Hessian with extras]: core.hessian(f) is jacfwd(jacrev(f)) and, like
        # torch.func.hessian, takes no has_aux; the same composition with has_aux=True at
        # both levels carries the inner magics' extras through.
        hessian = api.jacfwd(api.jacrev(_named(scalar_and_extras, self.marker),
                                        argnums=argnums, has_aux=True),
                             argnums=argnums, has_aux=True)

        def hessians(*args):
            blocks, extras = hessian(*args)  # blocks[i][j] = d2 f / d arg_i d arg_j
            return tuple(b for row in blocks for b in row), extras
        return _named(hessians)


@dataclasses.dataclass
class TraceStage(Stage):
    """``%%trace``: show the program of the stack below it (only as the outermost magic)."""

    fx: bool = False
    split: bool = False
    out: str | None = None
    inputs: tuple = ()

    magic = "trace"

    def input_names(self):
        return tuple(self.inputs)

    def outputs(self, inner):
        return inner

    def apply(self, f, params, inner, api):
        return f  # tracing happens around the whole stack: see Stack.flat_function


# --- the stack -----------------------------------------------------------------------------
class Stack:
    """The transform stages of one cell, outermost first, over the cell's body.

    >>> import torch
    >>> from minifunctorch import core
    >>> stack = Stack([VmapStage(over=("x",), in_dims={"x": 0}), GradStage(wrt=("w",))])
    >>> stack.params, stack.outputs
    (('x', 'w'), Outputs(parts=('dw',), extras=()))
    >>> body = lambda x, w: (x * w).sum()
    >>> stack.results(body, core, torch.ones(2, 3), torch.ones(3))
    {'dw': tensor([[1., 1., 1.],
            [1., 1., 1.]])}
    """

    def __init__(self, stages):
        self.stages = list(stages)
        for position, stage in enumerate(self.stages):
            stage.marker = f"{FUNCTION_NAME}{position}"
        params = []
        for stage in self.stages:
            for name in stage.input_names():
                if name not in params:
                    params.append(name)
        self.params = tuple(params)
        outputs = Outputs(("out",))
        self._inner_outputs = []
        for stage in reversed(self.stages):  # innermost first
            self._inner_outputs.append(outputs)
            try:
                outputs = stage.outputs(outputs)
            except StackError as error:
                raise StackError(f"{stage.call}: {error}", stage) from None
        self._inner_outputs.reverse()  # one per stage: the outputs of the stage below it
        names = outputs.all
        clashes = sorted({name for name in names if names.count(name) > 1})
        if clashes:
            raise StackError(
                f"{self.stages[0].call}: the stack would bind {', '.join(clashes)} twice. Fix: "
                "rename an output with --out, --value-out or --aux-out.")
        self.outputs = outputs

    def function(self, body, api):
        """The function of the whole stack over ``body``, built with the engine ``api``.

        It takes the stack's :attr:`params` and returns ``(parts, extras)``.
        """
        def cell(*args):
            return (body(*args),), {}
        f = _named(cell)
        for stage, inner in zip(reversed(self.stages), reversed(self._inner_outputs)):
            f = stage.apply(f, self.params, inner, api)
        return f

    def flat_function(self, body, api):
        """The stack's function returning its outputs as one flat tuple (one tensor alone),
        for tracing."""
        f = self.function(body, api)

        def cell(*args):
            parts, extras = f(*args)
            outputs = tuple(parts) + tuple(extras[name] for name in self.outputs.extras)
            return outputs[0] if len(outputs) == 1 else outputs
        return _named(cell)

    def name_results(self, parts, extras) -> dict:
        """``{name: value}`` for every output, in the order of :attr:`outputs`."""
        named = dict(zip(self.outputs.parts, parts))
        named.update((name, extras[name]) for name in self.outputs.extras)
        return named

    def results(self, body, api, *args) -> dict:
        """Run the stack over ``body`` with ``api`` on ``args``; ``{name: value}``."""
        parts, extras = self.function(body, api)(*args)
        return self.name_results(parts, extras)


def max_abs_difference(a, b) -> float:
    """The largest absolute difference between the tensor leaves of two results.

    >>> import torch
    >>> max_abs_difference((torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.ones(1)))
    1.0
    """
    worst = 0.0
    for x, y in zip(leaves(a), leaves(b)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return float("inf")
            if x.numel():
                difference = (x.detach().double() - y.detach().double()).abs().max().item()
                worst = max(worst, difference)
    return worst
