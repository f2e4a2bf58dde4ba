"""The IPython side: the ``TransformMagics`` class, its flags, and running a cell.

``load_ipython_extension`` (in ``__init__``) registers :class:`TransformMagics`. Each cell
magic parses its flags with ``IPython.core.magic_arguments`` (so ``%%grad?`` shows the usage
line and every flag), reads the stacked magic lines below it, and hands the rest to
:mod:`.stack` and :mod:`.cell`. This module is the only one of the package that needs IPython.

NOTE [Bind only after success]
A magic computes everything first (the stack's results, the torch.func check of ``--check``,
the tape stepper of ``--tape``, a program's generated code) and only then binds names in the
notebook, with one ``shell.push``. A cell that fails, at any point, leaves the notebook's
namespace as it was, and the cell's own assignments never reach it (a cell is a function
body, see NOTE [A cell is a function body] in cell.py).

NOTE [Names stand for the notebook's tensors]
Tapes, steppers and programs show the notebook's names: the inputs and the notebook tensors
a cell reads are passed in as labelled views, and the cell's own variables name the values
they are assigned (NOTE [Names the notebook gave] in names.py). So a tape over an MLP reads
``v0:f32[6,4] = matmul X W1`` and ``h:f32[6,4] = tanh v0`` rather than ``matmul c0 W1`` and
``v1:f32[6,4] = tanh v0``.

NOTE [One line per mistake]
A mistake in a magic's flags is one line that names the magic as written, says what is wrong
and how to fix it (``%%grad --wtr w: unknown flag --wtr; did you mean --wrt?``); ``%%grad?``
shows every flag. An engine error raised while the cell runs keeps its type and is shown
short (NOTE [Short tracebacks for engine errors] in errors.py). A cell magic has to be the
first line of its cell; comments and blank lines above it are moved below the magic lines
(which keeps the body's line numbers), and a magic line below code is refused in one line
(:func:`comments_below_magics`).
"""
import contextlib
import difflib
import keyword
import re

import torch
from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import display
from IPython.utils.process import arg_split

from minifunctorch import core

from .cell import CellError, CellFunction, split_headers, traceback_from
from .display import Heading, NamedProgram, Results, Source
from .errors import cell_traceback, engine_call_function, magic_traceback, renamed_message
from .names import CellNamer, labelled
from .stack import (
    STACKABLE,
    GradStage,
    HessianStage,
    JacobianStage,
    JvpStage,
    Stack,
    StackError,
    TraceStage,
    VmapStage,
    leaves,
    max_abs_difference,
)

# --- flag values ---------------------------------------------------------------------------
def _names(values, flag) -> tuple:
    """``["x,", "w"]`` or ``["x,w"]`` -> ``("x", "w")``: names split by spaces or commas."""
    names = []
    for value in values or ():
        for piece in value.split(","):
            piece = piece.strip()
            if not piece:
                continue
            if not piece.isidentifier() or keyword.iskeyword(piece):
                raise StackError(f"{flag} {piece!r} is not a Python variable name. Fix: name "
                                 f"notebook variables, e.g. {flag} x w.")
            names.append(piece)
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise StackError(f"{flag} names {', '.join(repeated)} twice. Fix: list each name once.")
    return tuple(names)


def _name(value, flag):
    return _names([value], flag)[0] if value is not None else None


def _dims(values, flag) -> tuple:
    """``["0", "None", "-1"]`` -> ``(0, None, -1)``."""
    dims = []
    for value in values:
        for piece in value.split(","):
            piece = piece.strip()
            if not piece:
                continue
            if piece == "None":
                dims.append(None)
                continue
            try:
                dims.append(int(piece))
            except ValueError:
                raise StackError(f"{flag} {piece!r} is not a dim: expected an int or None. Fix: "
                                 f"e.g. {flag} 0 None.") from None
    return tuple(dims)


def _positive(value, flag):
    if value is not None and value < 1:
        raise StackError(f"{flag} {value} must be a positive number. Fix: e.g. {flag} 8.")
    return value


def _aux_flags(args):
    if args.aux_out is not None and not args.has_aux:
        raise StackError("--aux-out names the aux output of --has-aux. Fix: add --has-aux.")
    return {"has_aux": args.has_aux, "aux_out": _name(args.aux_out, "--aux-out") or "aux"}


def _grad_stage(line, args):
    return GradStage(
        line=line, check=args.check, quiet=args.quiet, wrt=_names(args.wrt, "--wrt"),
        argnums=tuple(args.argnums or ()), out=_names(args.out, "--out"), **_aux_flags(args),
        value=args.value or args.value_out is not None,
        value_out=_name(args.value_out, "--value-out") or "value", tape=args.tape)


def _vmap_stage(line, args):
    over = _names(args.over, "--over")
    in_dims = _dims(args.in_dims or ["0"], "--in-dims")
    if len(in_dims) == 1:
        in_dims = in_dims * len(over)
    if len(in_dims) != len(over):
        raise StackError(
            f"--in-dims gives {len(in_dims)} dims for {len(over)} input(s) "
            f"({', '.join(over)}). Fix: give one dim for all, or one per --over name.")
    if all(d is None for d in in_dims):
        raise StackError("--in-dims is None for every input: nothing would be batched. Fix: "
                         "give at least one --over input a batch dim, e.g. 0.")
    out_dims = _dims(args.out_dims or ["0"], "--out-dims")
    return VmapStage(
        line=line, check=args.check, quiet=args.quiet, over=over,
        in_dims=dict(zip(over, in_dims)), out_dims=out_dims,
        chunk_size=_positive(args.chunk_size, "--chunk-size"), randomness=args.randomness,
        reduce=args.reduce, out=_names(args.out, "--out"))


def _jvp_stage(line, args):
    return JvpStage(
        line=line, check=args.check, quiet=args.quiet, wrt=_names(args.wrt, "--wrt"),
        tangent=_names(args.tangent, "--tangent"), out=_names(args.out, "--out"),
        value_out=_names(args.value_out, "--value-out"), **_aux_flags(args))


def _jacobian_stage(line, args):
    if args.chunk_size is not None and args.mode == "fwd":
        raise StackError("--chunk-size applies to --mode rev only. Fix: drop --chunk-size, or "
                         "use --mode rev.")
    return JacobianStage(
        line=line, check=args.check, quiet=args.quiet, wrt=_names(args.wrt, "--wrt"),
        argnums=tuple(args.argnums or ()), mode=args.mode,
        chunk_size=_positive(args.chunk_size, "--chunk-size"), out=_names(args.out, "--out"))


def _hessian_stage(line, args):
    return HessianStage(
        line=line, check=args.check, quiet=args.quiet, wrt=_names(args.wrt, "--wrt"),
        argnums=tuple(args.argnums or ()), out=_names(args.out, "--out"))


def _trace_stage(line, args):
    return TraceStage(line=line, fx=args.fx, split=args.split, out=_name(args.out, "--out"),
                      inputs=_names(args.inputs, "--inputs"))


_STAGE_BUILDERS = {
    "grad": _grad_stage, "vmap": _vmap_stage, "jvp": _jvp_stage,
    "jacobian": _jacobian_stage, "hessian": _hessian_stage, "trace": _trace_stage,
}


def _check_input(name, value, call):
    bad = [leaf for leaf in leaves(value) if not isinstance(leaf, torch.Tensor)]
    if isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list, dict))
                                           and leaves(value) and not bad):
        return
    what = type(value).__name__
    if isinstance(value, (tuple, list, dict)):
        what += f" holding a {type(bad[0]).__name__}" if bad else " with no tensors"
    raise UsageError(
        f"{call}: the input {name} is a {what}, expected a torch.Tensor (or a tuple, list or "
        f"dict of tensors). Fix: convert it, e.g. {name} = torch.as_tensor({name}, "
        "dtype=torch.float32).")


_NUMBER = re.compile(r"-\d|-\.\d")  # "-1" is a dim (--in-dims 0 -1), not a flag


def unknown_flag(parser, tokens):
    """The first token that looks like a flag but is none of ``parser``'s (argparse's own
    abbreviations, ``--val`` for ``--value``, are flags), with the closest flag, or ``None``.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--wrt"); _ = parser.add_argument("--value")
    >>> unknown_flag(parser, ["--wtr", "w"]), unknown_flag(parser, ["--val", "--wrt=w", "-1"])
    (('--wtr', '--wrt'), None)
    """
    known = [option for action in parser._actions for option in action.option_strings]
    for token in tokens:
        if not token.startswith("-") or token in ("-", "--") or _NUMBER.match(token):
            continue
        flag = token.split("=", 1)[0]
        if flag in known or (flag.startswith("--") and any(k.startswith(flag) for k in known)):
            continue
        close = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1,
                                            cutoff=0.75)
        return flag, (close[0] if close else None)
    return None


# --- the magics ----------------------------------------------------------------------------
_check_flag = magic_arguments.argument(
    "--check", action="store_true",
    help="Recompute with torch.func and print the largest absolute difference per output.")
_quiet_flag = magic_arguments.argument(
    "-q", "--quiet", action="store_true", help="Bind the results without displaying them.")
_wrt_flag = magic_arguments.argument(
    "--wrt", nargs="+", required=True, metavar="NAME",
    help="Notebook variables that are the function's inputs, in order (spaces or commas).")
_argnums_flag = magic_arguments.argument(
    "--argnums", nargs="+", type=int, metavar="I",
    help="Positions in --wrt to differentiate, like torch.func's argnums (default: all).")


@magics_class
class TransformMagics(Magics):
    """The cell magics ``%%grad``, ``%%vmap``, ``%%jvp``, ``%%jacobian``, ``%%hessian``,
    ``%%trace`` and the line magic ``%tape``.

    Load them with ``%load_ext minifunctorch.magics``. A magic cell is the body of a function
    of the names its flags list; magics stacked at the top of a cell compose, outermost
    first (see the package docstring).

    ``last_tapes`` holds the tapes of the last cell with a ``%%grad`` (for ``%tape``) and
    ``last_check`` the differences printed by the last ``--check``.
    """

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.last_tapes = None
        self.last_check = None

    # --- %%grad --------------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%grad")
    @_wrt_flag
    @_argnums_flag
    @magic_arguments.argument(
        "--out", nargs="+", metavar="NAME",
        help="Names for the gradients (default: d<name>, e.g. dx dw).")
    @magic_arguments.argument(
        "--has-aux", action="store_true",
        help="The cell returns (loss, aux): differentiate loss, bind aux.")
    @magic_arguments.argument("--aux-out", metavar="NAME",
                              help="Name for the aux of --has-aux (default: aux).")
    @magic_arguments.argument("--value", action="store_true",
                              help="Also bind the cell's value (default name: value).")
    @magic_arguments.argument("--value-out", metavar="NAME",
                              help="Name for the value (implies --value).")
    @magic_arguments.argument("--tape", action="store_true",
                              help="Show the tape stepper for the recorded tapes.")
    @_check_flag
    @_quiet_flag
    @cell_magic
    def grad(self, line, cell):
        """Gradient of the cell's scalar result with respect to the named inputs.

        The cell is the body of a function of the --wrt names (read from the notebook); its
        last expression is the result. The gradients are bound as dx, dw, ... and shown::

            %%grad --wrt x w
            ((x @ w - y) ** 2).mean()

        Put other magics above it to compose, e.g. per-example gradients::

            %%vmap --over x y
            %%grad --wrt w
            ((x @ w - y) ** 2).mean()
        """
        __tracebackhide__ = True
        return self._run("grad", line, cell)

    # --- %%vmap --------------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%vmap")
    @magic_arguments.argument(
        "--over", nargs="+", required=True, metavar="NAME",
        help="Notebook variables to batch over; inside the cell each stands for one example.")
    @magic_arguments.argument(
        "--in-dims", nargs="+", metavar="DIM",
        help="Batch dim of each --over input (an int or None; one for all, or one each; "
             "default 0).")
    @magic_arguments.argument(
        "--out-dims", nargs="+", metavar="DIM",
        help="Where the batch dim goes in the outputs (one for all, or one per output; "
             "default 0).")
    @magic_arguments.argument("--chunk-size", type=int, metavar="N",
                              help="Run the batch N examples at a time.")
    @magic_arguments.argument("--randomness", choices=("error", "same", "different"),
                              default="error", help="Random operations under vmap (as "
                              "torch.func; default error).")
    @magic_arguments.argument(
        "--reduce", choices=("sum", "mean"),
        help="Reduce the stacked outputs over the batch dim (e.g. for a gradient of it).")
    @magic_arguments.argument(
        "--out", nargs="+", metavar="NAME",
        help="Names for the outputs (default: out, or the names of the magic below).")
    @_check_flag
    @_quiet_flag
    @cell_magic
    def vmap(self, line, cell):
        """Run the cell as one batched computation over the named inputs.

        Inside the cell, each --over name stands for one example; the results, stacked along
        the batch dim, are bound as out (or under the names of the magic below)::

            %%vmap --over x
            x @ w          # one example: x is a row
        """
        __tracebackhide__ = True
        return self._run("vmap", line, cell)

    # --- %%jvp ---------------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%jvp")
    @_wrt_flag
    @magic_arguments.argument(
        "--tangent", nargs="+", required=True, metavar="NAME",
        help="Notebook variables holding the tangents, one per --wrt input.")
    @magic_arguments.argument(
        "--out", nargs="+", metavar="NAME",
        help="Names for the tangent outputs (default: out_dot, or <name>_dot).")
    @magic_arguments.argument(
        "--value-out", nargs="+", metavar="NAME",
        help="Names for the primal outputs (default: out, or the names of the magic below).")
    @magic_arguments.argument("--has-aux", action="store_true",
                              help="The cell returns (output, aux): push forward output, "
                                   "bind aux.")
    @magic_arguments.argument("--aux-out", metavar="NAME",
                              help="Name for the aux of --has-aux (default: aux).")
    @_check_flag
    @_quiet_flag
    @cell_magic
    def jvp(self, line, cell):
        """Forward mode: the cell's output and its directional derivative along the tangents.

        Binds out (the output) and out_dot (the Jacobian times the tangents)::

            %%jvp --wrt x --tangent t
            torch.sin(x) * 2
        """
        __tracebackhide__ = True
        return self._run("jvp", line, cell)

    # --- %%jacobian ----------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%jacobian")
    @_wrt_flag
    @_argnums_flag
    @magic_arguments.argument("--mode", choices=("rev", "fwd"), default="rev",
                              help="rev: jacrev (default); fwd: jacfwd.")
    @magic_arguments.argument("--chunk-size", type=int, metavar="N",
                              help="jacrev's chunk_size (--mode rev).")
    @magic_arguments.argument(
        "--out", nargs="+", metavar="NAME",
        help="Names for the Jacobians (default: jac_<name>, or jac_<output>_<name>).")
    @_check_flag
    @_quiet_flag
    @cell_magic
    def jacobian(self, line, cell):
        """The Jacobian of the cell's result with respect to the named inputs.

        Binds jac_x, of shape (*out.shape, *x.shape)::

            %%jacobian --wrt x
            torch.sin(x) * x
        """
        __tracebackhide__ = True
        return self._run("jacobian", line, cell)

    # --- %%hessian -----------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%hessian")
    @_wrt_flag
    @_argnums_flag
    @magic_arguments.argument(
        "--out", nargs="+", metavar="NAME",
        help="Names for the Hessian blocks (default: hess_<name>, or hess_<a>_<b>).")
    @_check_flag
    @_quiet_flag
    @cell_magic
    def hessian(self, line, cell):
        """The Hessian of the cell's scalar result (forward-over-reverse).

        Binds hess_x, of shape (*x.shape, *x.shape)::

            %%hessian --wrt x
            (x ** 3).sum()
        """
        __tracebackhide__ = True
        return self._run("hessian", line, cell)

    # --- %%trace -------------------------------------------------------------------------
    @magic_arguments.magic_arguments(name="%trace")
    @magic_arguments.argument(
        "--inputs", nargs="+", metavar="NAME",
        help="Notebook variables that are the program's inputs (besides those the magics "
             "below name); other tensors the cell reads are constants.")
    @magic_arguments.argument("--fx", action="store_true",
                              help="Also show the generated Python (program.to_fx().code).")
    @magic_arguments.argument("--split", action="store_true",
                              help="Show the forward/backward pair of split_vjp instead.")
    @magic_arguments.argument("--out", metavar="NAME",
                              help="Bind the Program (with --split, the pair (fwd, bwd)).")
    @cell_magic
    def trace(self, line, cell):
        """Show the program of the cell, or of the magics stacked below, as rich output.

        Put it on top of a stack to see what the transforms compute::

            %%trace
            %%grad --wrt w
            ((x @ w - y) ** 2).mean()

        The program's inputs are the names the magics below list, and those of --inputs;
        every other tensor the cell reads is a constant of the program::

            %%trace --inputs x --fx
            torch.sin(x) * 2
        """
        __tracebackhide__ = True
        return self._run("trace", line, cell)

    # --- %tape ---------------------------------------------------------------------------
    @line_magic
    def tape(self, line):
        """Show the tape stepper for the tapes of the last cell with a %%grad.

        Usage: ``%tape`` (no arguments).
        """
        if line.strip():
            raise UsageError(f"%tape {line.strip()}: %tape takes no arguments.\nusage: %tape")
        if not self.last_tapes:
            raise UsageError("%tape: there are no tapes yet. Fix: run a %%grad cell first.")
        stepper = self._tape_stepper("%tape")
        display(stepper(self.last_tapes))

    # --- running a cell ------------------------------------------------------------------
    def _tape_stepper(self, call):
        try:
            from minifunctorch.widgets import TapeStepper
        except ImportError as error:
            raise UsageError(f"{call}: the tape stepper (minifunctorch.widgets.TapeStepper) "
                             f"cannot be imported: {error}") from None
        return TapeStepper

    def _stage(self, magic, flags):
        """Parse one magic line into its stage; a mistake is a one-line UsageError (NOTE [One
        line per mistake])."""
        call = f"%%{magic} {flags}".rstrip()
        if magic not in STACKABLE:
            raise UsageError(
                f"{call}: only {', '.join('%%' + m for m in STACKABLE)} can be stacked. Fix: "
                f"put %%{magic} in a cell of its own.")
        method = getattr(self, magic)
        help_hint = f"%%{magic}? lists its flags"
        try:
            tokens = arg_split(flags, strict=True)
        except ValueError as error:  # an unclosed quote
            raise UsageError(f"{call}: {error}. Fix: close the quote.") from None
        unknown = unknown_flag(method.parser, tokens)
        if unknown is not None:
            flag, close = unknown
            guess = f"; did you mean {close}?" if close else ""
            raise UsageError(f"{call}: unknown flag {flag}{guess} ({help_hint})")
        try:
            args = method.parser.parse_args(tokens)
        except UsageError as error:  # argparse's own message: a missing flag, a bad choice
            raise UsageError(f"{call}: {error} ({help_hint})") from None
        try:
            return _STAGE_BUILDERS[magic](flags, args)
        except StackError as error:
            raise UsageError(f"{call}: {error}") from None

    def _inputs(self, stack, stages):
        """The notebook values of the stack's parameters, checked."""
        values = []
        for name in stack.params:
            owner = next(s for s in stages if name in s.input_names())
            if name not in self.shell.user_ns:
                raise UsageError(
                    f"{owner.call}: the name {name!r} is not defined in the notebook. Fix: "
                    f"define {name} in a cell above, or correct the name.")
            value = self.shell.user_ns[name]
            _check_input(name, value, owner.call)
            values.append(value)
        return values

    def _cell_number(self) -> int:
        """The number of the cell running now (its ``In[n]``), for traceback headers."""
        # IPython >= 9 counts the cell before running it; the result object it fills knows
        # the number the cell was given.
        running = getattr(self.shell.displayhook, "exec_result", None)
        number = getattr(running, "execution_count", None)
        return number if number is not None else self.shell.execution_count

    def _call(self, thunk, body_function, stages):
        """Run ``thunk``. An engine error is re-raised with the magic's line in its message and
        a short traceback (NOTE [Short tracebacks for engine errors] in errors.py); any other
        error keeps only the traceback frames from the cell's own frame down (NOTE
        [Tracebacks point at the cell] in cell.py)."""
        __tracebackhide__ = True
        filename = body_function.filename
        try:
            return thunk()
        except StackError as error:  # a cell result the magic cannot use (e.g. --has-aux)
            raise UsageError(str(error)) from None
        except core.TransformError as error:
            function = engine_call_function(str(error))
            stage = next((s for s in stages if s.marker == function), stages[0])
            error.args = (renamed_message(str(error), stage.call),)
            lines = magic_traceback(error, filename, f"Cell In[{body_function.number}]",
                                    body_function.result_line, _cell_numbers(self.shell))
            error._render_traceback_ = lambda: lines
            tb = traceback_from(error.__traceback__, filename)
            raise error.with_traceback(tb) from None
        except Exception as error:
            tb = traceback_from(error.__traceback__, filename)
            if tb is not None:
                raise error.with_traceback(tb)
            raise

    def _run(self, magic, line, cell):
        """Parse the stack of magics, build the function, run it, check, bind, show."""
        __tracebackhide__ = True
        shell = self.shell
        first_line = f"%%{magic} {line}".rstrip()
        try:
            headers, body, header_lines = split_headers(cell)
        except CellError as error:
            raise UsageError(f"{first_line}: {error}") from None
        stages = [self._stage(name, flags) for name, flags in [(magic, line)] + headers]
        header_lines = [first_line] + header_lines
        trace = stages[0] if isinstance(stages[0], TraceStage) else None
        transforms = stages[1:] if trace else stages
        for stage in transforms:
            if isinstance(stage, TraceStage):
                raise UsageError(f"{stage.call}: %%trace must be the outermost (first) magic "
                                 "of a cell. Fix: move it to the top.")
        try:
            stack = Stack(stages)
        except StackError as error:
            raise UsageError(str(error)) from None
        values = self._inputs(stack, stages)
        args = [labelled(name, value) for name, value in zip(stack.params, values)]

        def capture(names):  # NOTE [Names the notebook gave] in names.py
            return {name: labelled(name, shell.user_ns[name]) for name in sorted(names)
                    if type(shell.user_ns.get(name)) is torch.Tensor}
        try:
            body_function = CellFunction(
                shell.transform_cell(body), stack.params, shell.user_ns,
                header_lines=header_lines, compiler=shell.compile,
                number=self._cell_number(), transform_ast=shell.transform_ast,
                capture=capture, namer=CellNamer(taken=stack.params))
        except CellError as error:
            raise UsageError(f"{first_line}: {error}") from None
        body_function.namer.reserve(body_function.captured)
        title = " ∘ ".join(header_lines)
        if trace is not None:
            return self._trace(trace, stack, body_function, args, values, title)

        grads = [s for s in transforms if isinstance(s, GradStage)]
        stepper = self._tape_stepper(grads[0].call) if any(s.tape for s in grads) else None
        capture_tapes = core.capture_tapes() if grads else contextlib.nullcontext([])
        with capture_tapes as tapes:
            results = self._call(lambda: stack.results(body_function, core, *args),
                                 body_function, stages)
        check = None
        if any(s.check for s in transforms):
            from torch import func as torch_func
            expected = self._call(lambda: stack.results(body_function, torch_func, *values),
                                  body_function, stages)
            check = {name: max_abs_difference(results[name], expected[name])
                     for name in results}
        for name, value in results.items():
            for leaf in leaves(value):
                assert not isinstance(leaf, core.FuncTensor), (
                    f"{first_line}: the result {name} holds a wrapped value ({leaf!r}); the "
                    "transforms must return plain tensors")
        tape_view = stepper(list(tapes)) if stepper is not None else None

        shell.push(results)  # NOTE [Bind only after success]
        if grads:
            self.last_tapes = list(tapes)
        if check is not None:
            self.last_check = check
            print("check against torch.func, largest absolute difference: "
                  + ", ".join(f"{name} {difference:.3g}" for name, difference in check.items()))
        if not stages[0].quiet:
            display(Results(title, results))
        if tape_view is not None:
            display(tape_view)

    def _trace(self, stage, stack, body_function, args, values, title):
        __tracebackhide__ = True
        if not (hasattr(core, "trace") and hasattr(core, "split_vjp")):
            raise UsageError(f"{stage.call}: this version of minifunctorch.core has no trace "
                             "(the program tracer) yet.")
        f = stack.flat_function(body_function, core)
        stages = stack.stages
        if stage.split:
            if not args:
                raise UsageError(f"{stage.call}: --split needs inputs to differentiate. Fix: "
                                 "name them with --inputs, or in a magic below.")
            forward, backward = self._call(lambda: core.split_vjp(f)(*args), body_function,
                                           stages)
            programs = {"forward": forward, "backward": backward}
            bound = (forward, backward)
        else:
            program = self._call(lambda: core.trace(f)(*args), body_function, stages)
            programs = {"program": program}
            bound = program
        # shown with the notebook's names: the forward program's inputs are the stack's, the
        # backward one's are its own (the saved values and the cotangent)
        input_names = dict(zip(stack.params, values))
        shown = {label: NamedProgram.of(program, input_names if label != "backward" else {})
                 for label, program in programs.items()}
        sources = {}
        if stage.fx:
            sources = {label: self._call(lambda p=p: p.to_fx().code, body_function, stages)
                       for label, p in shown.items()}
        if stage.out:
            self.shell.push({stage.out: bound})
        for label, program in shown.items():
            display(Heading(f"{title}: {label}" if label != "program" else title))
            display(program)
            if label in sources:
                display(Source(sources[label]))


# --- the IPython side of loading the extension ----------------------------------------------
def _cell_numbers(shell):
    """``filename -> In[n]`` for the code of notebook cells (IPython's compiler keeps it)."""
    numbers = getattr(shell.compile, "_filename_map", None) or {}
    return numbers.get


def _render_engine_error(error):
    """``TransformError._render_traceback_`` while the extension is loaded (NOTE [Short
    tracebacks for engine errors] in errors.py)."""
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None and shell.InteractiveTB.mode.lower() == "verbose":  # %xmode verbose
        return shell.InteractiveTB.structured_traceback(type(error), error, error.__traceback__)
    return cell_traceback(error, _cell_numbers(shell) if shell is not None else {}.get)


_OUR_MAGICS = re.compile(r"%%(" + "|".join(STACKABLE) + r")(\s|\?|$)")


def comments_below_magics(lines):
    """IPython cleanup transformer: comment and blank lines above a magic of ours move below
    its magic lines (the line numbers of the body stay the same); a magic line of ours below
    code is refused in one line (NOTE [One line per mistake]).

    >>> comments_below_magics(["# per-sample\\n", "%%vmap --over x\\n", "%%grad --wrt w\\n",
    ...                        "f(x, w)\\n"])
    ['%%vmap --over x\\n', '%%grad --wrt w\\n', '# per-sample\\n', 'f(x, w)\\n']
    """
    first = next((i for i, line in enumerate(lines)
                  if line.strip() and not line.lstrip().startswith("#")), None)
    if first is None:
        return lines
    if _OUR_MAGICS.match(lines[first]):
        end = first
        while end < len(lines) and lines[end].startswith("%%"):
            end += 1
        return lines[first:end] + lines[:first] + lines[end:]
    for line in lines[first + 1:]:
        if _OUR_MAGICS.match(line):
            raise UsageError(
                f"{line.strip()}: a cell magic must be the first line of its cell (only "
                "comments and blank lines may go above it). Fix: move the code above it to a "
                "cell of its own.")
    return lines


comments_below_magics.has_side_effects = True  # it may raise: IPython's check_complete skips it


def install(shell) -> None:
    """What loading the extension adds besides the magics: the short tracebacks of engine
    errors and the transformer that lets comments sit above a magic."""
    core.TransformError._render_traceback_ = _render_engine_error
    cleanup = shell.input_transformers_cleanup
    if comments_below_magics not in cleanup:
        cleanup.append(comments_below_magics)


def uninstall(shell) -> None:
    if core.TransformError.__dict__.get("_render_traceback_") is _render_engine_error:
        del core.TransformError._render_traceback_
    cleanup = shell.input_transformers_cleanup
    if comments_below_magics in cleanup:
        cleanup.remove(comments_below_magics)
