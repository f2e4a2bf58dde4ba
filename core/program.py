"""Programs: a typed, first-order IR (like a jaxpr), its printer, typechecker, evaluator
and exports.

A Program has input binders, constant inputs (tensors the traced function captured),
equations ``c:f32[4] = mul a b`` and outputs, and, for a function that wrote into its
arguments, which outputs are their new values (``writes``). Names are given when printing,
in order of appearance (a, b, ..., z, ba, bb, ...), so the text is the same whatever the
value counter said while tracing.

``program(*args)`` evaluates it with ``bind``, so a program runs under any transform:
``grad(program)``, ``vmap(program)`` and ``trace(program)`` all work, and tracing a traced
program gives the same program back.
"""
import html
import keyword
import operator

import torch

from . import primitives as P
from . import pytree
from .fast_code import INPLACE_METHODS, number_operand_tensor, reusable_equations
from .errors import TransformUsageError, TypecheckError, UnsupportedOperationError
from .ir import Literal, Var, emit_call, identifier, literal_source
from .printing import format_param, type_string
from .tensor import as_tensor, engine_code, share_memory, unwrap
from .values import bind


def _letters(index: int) -> str:
    """a, b, ..., z, ba, bb, ... (a base-26 numeral with letters as digits)."""
    name = ""
    while True:
        name = chr(ord("a") + index % 26) + name
        index //= 26
        if index == 0:
            return name


def _global_name(prefix, globals_, reserved):
    """The first of prefix0, prefix1, ... that names nothing yet."""
    index = 0
    while f"{prefix}{index}" in globals_ or f"{prefix}{index}" in reserved:
        index += 1
    return f"{prefix}{index}"


class Program:
    """A traced function. Build one with ``trace(f)(*example_args)``.

    >>> import torch
    >>> from minifunctorch.core import trace
    >>> program = trace(lambda x, y: (x * y).sum())(torch.ones(3), torch.ones(3))
    >>> print(program)
    { lambda ; a:f32[3] b:f32[3] .
      let c:f32[3] = mul a b
          d:f32[] = sum c dim=(0,) keepdim=False
      in (d,) }
    >>> program(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
    tensor(6.)
    """

    def __init__(self, inputs, constants, equations, outputs, *, in_treedef=None,
                 out_treedef=None, static_leaves=None, device=None, name="f", writes=()):
        self.inputs = list(inputs)
        self.constants = list(constants)  # (Var, tensor) pairs
        self.equations = list(equations)
        self.outputs = list(outputs)
        # (input index, output index) pairs: NOTE [A traced function that writes its inputs]
        self.writes = tuple(writes)
        self.in_treedef = in_treedef
        self.out_treedef = out_treedef
        self.static_leaves = static_leaves
        self.device = device
        self.name = name

    def replace(self, *, equations=None, outputs=None, constants=None, inputs=None):
        """A copy with some parts replaced (passes build new programs, never mutate)."""
        return Program(self.inputs if inputs is None else inputs,
                       self.constants if constants is None else constants,
                       self.equations if equations is None else equations,
                       self.outputs if outputs is None else outputs,
                       in_treedef=self.in_treedef, out_treedef=self.out_treedef,
                       static_leaves=self.static_leaves, device=self.device, name=self.name,
                       writes=self.writes)

    # --- names and text ------------------------------------------------------------------------
    def names(self) -> dict:
        """Var -> printed name, in order of appearance."""
        names = {}
        for var in [*self.inputs, *(v for v, _ in self.constants),
                    *(eq.out for eq in self.equations)]:
            if var not in names:
                name = _letters(len(names))
                # the 214th value would be `if`: exported code needs identifiers
                names[var] = f"{name}_" if keyword.iskeyword(name) else name
        return names

    def _operand_text(self, operand, names):
        # "?" names a var that nothing defines, so that typecheck can show the equation
        return repr(operand.value) if isinstance(operand, Literal) else names.get(operand, "?")

    def equation_text(self, equation, names=None) -> str:
        names = names or self.names()
        parts = [equation.prim.name] + [self._operand_text(o, names) for o in equation.inputs]
        parts += [f"{k}={format_param(v)}" for k, v in equation.params.items()]
        return f"{names[equation.out]}:{equation.out.type} = {' '.join(parts)}"

    def __str__(self):
        names = self.names()
        constants = " ".join(f"{names[v]}:{v.type}" for v, _ in self.constants)
        inputs = " ".join(f"{names[v]}:{v.type}" for v in self.inputs)
        header = f"{{ lambda {constants + ' ' if constants else ''}; {inputs} ."
        lines = [header]
        for i, equation in enumerate(self.equations):
            lines.append(("  let " if i == 0 else "      ") + self.equation_text(equation, names))
        outputs = ", ".join(self._operand_text(o, names) for o in self.outputs)
        lines.append(f"  in ({outputs}{',' if len(self.outputs) == 1 else ''})"
                     f"{self._writes_text(lambda o: self._operand_text(o, names), names)} }}")
        return "\n".join(lines)

    def _writes_text(self, operand_text, names) -> str:
        """`` writes a <- e`` for the inputs the program writes (empty without any)."""
        if not self.writes:
            return ""
        return " writes " + ", ".join(
            f"{names[self.inputs[i]]} <- {operand_text(self.outputs[o])}" for i, o in self.writes)

    def __repr__(self):
        return (f"<Program {self.name}: {len(self.inputs)} inputs, {len(self.constants)} "
                f"constants, {len(self.equations)} equations>")

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """The program text with primitives and types highlighted; everything escaped."""
        names = self.names()

        def var_html(v):
            return (f'<span class="mft-var">{html.escape(names[v])}</span>'
                    f'<span class="mft-type">:{html.escape(v.type)}</span>')

        def operand_html(o):
            if isinstance(o, Literal):
                return f'<span class="mft-literal">{html.escape(repr(o.value))}</span>'
            return f'<span class="mft-var">{html.escape(names[o])}</span>'

        constants = " ".join(var_html(v) for v, _ in self.constants)
        inputs = " ".join(var_html(v) for v in self.inputs)
        lines = [f"{{ lambda {constants + ' ' if constants else ''}; {inputs} ."]
        for i, eq in enumerate(self.equations):
            params = " ".join(f'<span class="mft-param">{html.escape(k)}='
                              f'{html.escape(format_param(v))}</span>' for k, v in eq.params.items())
            body = " ".join([f'<span class="mft-prim">{html.escape(eq.prim.name)}</span>',
                             *(operand_html(o) for o in eq.inputs)] + ([params] if params else []))
            lines.append(("  let " if i == 0 else "      ") + f"{var_html(eq.out)} = {body}")
        outputs = ", ".join(operand_html(o) for o in self.outputs)
        writes = html.escape(self._writes_text(lambda o: repr(o.value) if isinstance(o, Literal)
                                               else names[o], names))
        lines.append(f"  in ({outputs}{',' if len(self.outputs) == 1 else ''}){writes} }}")
        style = ("<style>.mft-program .mft-prim{color:#0550ae;font-weight:bold}"
                 ".mft-program .mft-type{color:#6e7781}.mft-program .mft-literal{color:#953800}"
                 ".mft-program .mft-param{color:#8250df}</style>")
        return style + '<pre class="mft-program">' + "\n".join(lines) + "</pre>"

    # --- checking --------------------------------------------------------------------------
    def typecheck(self) -> "Program":
        """Re-derive every equation's type from the shape rules; raise on a mismatch."""
        names = self.names()
        defined = set(self.inputs) | {v for v, _ in self.constants}
        for index, equation in enumerate(self.equations):
            text = self.equation_text(equation, names)
            for operand in equation.inputs:
                if isinstance(operand, Var) and operand not in defined:
                    raise TypecheckError(
                        f"program.typecheck(): equation {index} `{text}` uses "
                        f"{names.get(operand, '?')} before it is defined. Fix: build programs "
                        "with trace, or keep equations in dependency order."
                    )
            meta = [o.value if isinstance(o, Literal) else
                    torch.empty(o.shape, dtype=o.dtype, device="meta") for o in equation.inputs]
            try:
                shape, dtype = equation.prim.shape_rule(*meta, **equation.params)
            except Exception as error:
                raise TypecheckError(
                    f"program.typecheck(): equation {index} `{text}` is ill-typed: its shape "
                    f"rule rejects the operand types ({error}). Fix: make the operand types "
                    "agree."
                ) from None
            derived = type_string(dtype, shape)
            if derived != equation.out.type:
                raise TypecheckError(
                    f"program.typecheck(): equation {index} `{text}` declares "
                    f"{equation.out.type}, but the shape rule of {equation.prim.name} derives "
                    f"{derived}. Fix: the declared type must be the derived one."
                )
            defined.add(equation.out)
        for output in self.outputs:
            if isinstance(output, Var) and output not in defined:
                raise TypecheckError(
                    f"program.typecheck(): output {names.get(output, '?')} is never defined."
                )
        return self

    # --- evaluation ------------------------------------------------------------------------
    def flatten_inputs(self, args, kwargs):
        """The tensor inputs of a call, checked against the traced structure."""
        leaves, treedef = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self.in_treedef is not None and treedef != self.in_treedef:
            raise TransformUsageError(
                f"program {self.name}(<inputs>): expected inputs with the traced structure "
                f"{self.in_treedef}, got {treedef}. Fix: call it like the traced function."
            )
        if self.static_leaves is None:
            tensors = leaves
        else:
            tensors = [leaf for leaf, static in zip(leaves, self.static_leaves) if static is None]
        if len(tensors) != len(self.inputs):
            raise TransformUsageError(
                f"program {self.name}(<inputs>): expected {len(self.inputs)} tensor inputs, got "
                f"{len(tensors)}."
            )
        for position, (value, var) in enumerate(zip(tensors, self.inputs)):
            if tuple(value.shape) != var.shape:
                raise TransformUsageError(
                    f"program {self.name}(<inputs>): input {position} should have type "
                    f"{var.type}, got shape {tuple(value.shape)}. Fix: trace again for new "
                    "shapes (jit does this for you)."
                )
        return tensors

    def evaluate_flat(self, tensors):
        """Run the equations with ``bind`` on flat tensor inputs; return flat outputs."""
        env = dict(zip(self.inputs, tensors))
        env.update(self.constants)
        names = None
        for equation in self.equations:
            values = [o.value if isinstance(o, Literal) else env[o] for o in equation.inputs]
            try:
                if equation.prim is P.draw_p and P.draw_in_a_program is not None:
                    env[equation.out] = P.draw_in_a_program(values, equation.params)
                else:
                    env[equation.out] = bind(equation.prim, *values, **equation.params)
            except Exception as error:
                names = names or self.names()
                # as torch.fx's Interpreter does: say which equation failed
                error.add_note(f"while evaluating `{self.equation_text(equation, names)}` "
                               f"of program {self.name}")
                raise
        return [o.value if isinstance(o, Literal) else env[o] for o in self.outputs]

    def __call__(self, *args, **kwargs):
        with engine_code():
            callers = self.flatten_inputs(args, kwargs)
            outputs = [as_tensor(o) for o in self.evaluate_flat([unwrap(t) for t in callers])]
        outputs = write_inputs(self, callers, outputs)
        if self.out_treedef is None:
            return tuple(outputs)
        return pytree.tree_unflatten(self.out_treedef, outputs)

    # --- exports ---------------------------------------------------------------------------
    def python_source(self, function_name=None, *, reuse_buffers=False,
                      number_tensors=False) -> tuple[str, dict]:
        """Straight-line Python for the program, and the globals it needs.

        Constants are globals of the generated function: bound once, not looked up per call.
        jit asks for two rewrites that give the same bits faster (fast_code.py):
        ``reuse_buffers``: an elementwise equation whose first operand is a dead intermediate
        writes into it (``c = b.sin_()``), code that must not run where torch's autograd
        records; ``number_tensors``: a number operand is a 0-d tensor bound once
        (``c = b * _number0``).
        """
        reusable = reusable_equations(self) if reuse_buffers else ()
        names = self.names()
        globals_ = {"torch": torch, "operator": operator}
        for var, value in self.constants:
            globals_[names[var]] = value
        args = ", ".join(names[v] for v in self.inputs)
        function_name = function_name or identifier(self.name)
        lines = [f"def {function_name}({args}):"]
        # the generated function's own name and its locals are never reused for a callable
        # (a custom function called `b` would be shadowed by the local `b`)
        reserved = {function_name, *names.values()}
        for index, equation in enumerate(self.equations):
            operands = [literal_source(o.value) if isinstance(o, Literal) else names[o]
                        for o in equation.inputs]
            number = number_operand_tensor(equation) if number_tensors else None
            if number is not None:
                operands[1] = _global_name("_number", globals_, reserved)
                globals_[operands[1]] = number
            if index in reusable:
                method = INPLACE_METHODS[equation.prim]
                expression = f"{operands[0]}.{method}({', '.join(operands[1:])})"
            else:
                expression = emit_call(equation.prim, operands, equation.params, globals_,
                                       reserved=reserved)
            lines.append(f"    {names[equation.out]} = {expression}")
        outputs = ", ".join(literal_source(o.value) if isinstance(o, Literal) else names[o]
                            for o in self.outputs)
        lines.append(f"    return ({outputs}{',' if len(self.outputs) == 1 else ''})")
        return "\n".join(lines) + "\n", globals_

    def compile_python(self, *, reuse_buffers=False, number_tensors=False):
        """The program as a Python function of its flat inputs, returning flat outputs
        (the keywords: as in ``python_source``)."""
        source, globals_ = self.python_source("compiled_program", reuse_buffers=reuse_buffers,
                                              number_tensors=number_tensors)
        code = compile(source, f"<minifunctorch program {self.name}>", "exec")
        exec(code, globals_)
        return globals_["compiled_program"]

    def to_fx(self) -> torch.fx.GraphModule:
        """Export to a ``torch.fx.GraphModule`` whose ``.code`` reads as plain Python.

        >>> import torch
        >>> from minifunctorch.core import trace
        >>> gm = trace(lambda x: torch.sin(x) * 2)(torch.ones(3)).to_fx()
        >>> print(gm.code.strip())
        def forward(self, a):
            sin = torch.sin(a);  a = None
            mul = sin * 2;  sin = None
            return (mul,)
        """
        from .export import program_to_fx
        return program_to_fx(self)


def write_inputs(program, callers, outputs, call=None):
    """NOTE [A traced function that writes its inputs]
    ``p.sub_(lr * g)`` on a parameter, ``stats.mul_(0.9).add_(...)``: the traced function
    wrote into tensors its caller passed. Inside the trace the write swaps a new value into
    the input's FuncTensor (tensor.py, ``_write``), as it does under any transform, so the
    equations compute the new value out of place; the program then has it as an extra
    output, at the end, and ``writes`` pairs the input's index with that output's. This is
    torch.func's functionalization, and AOTAutograd's input mutations: the graph stays pure
    (to_fx, the generated code and torch.compile see outputs only), and a call of the
    program copies each such output into the caller's tensor, which ``jit`` and
    ``program(...)`` do here. Without it the replay would return the right outputs and
    silently leave the caller's tensors as they were.
    Copies the written outputs into ``callers`` (the call's flat tensor arguments) and
    returns the other outputs (``call``: the call as the user wrote it, for errors)."""
    if not program.writes:
        return outputs
    _refuse_aliased_writes(program, callers, call)
    outputs = list(outputs)
    for input_index, output_index in program.writes:
        target, new_value = callers[input_index], outputs[output_index]
        if type(target) is torch.Tensor and not isinstance(new_value, torch.Tensor):
            new_value = torch.as_tensor(new_value, dtype=target.dtype, device=target.device)
        if type(target) is torch.Tensor and target.is_leaf and target.requires_grad:
            with torch.no_grad():  # the only way f could write into it: ``with no_grad():``
                target.copy_(new_value)
        else:  # recorded as f's own write was (by torch's autograd, or by an enclosing
            target.copy_(new_value)  # transform when the caller passed one of its values)
    return outputs[:len(outputs) - len(program.writes)]


def _refuse_aliased_writes(program, callers, call):
    """NOTE [A write into an argument that another argument aliases]
    ``jit(f)(x, x)``, or ``jit(f)(x[:2], x)``, where f writes into its first argument and
    reads the second: in eager torch the second sees the write, through the memory they
    share. A program is traced with one input per argument, so its equations compute the
    second from the caller's old numbers: the outputs would be silently wrong. Before
    anything is written, such a call is refused, when an input that f wrote shares memory
    with another input that the program reads. (AOTAutograd checks its inputs for aliasing
    at each call too, and retraces with the aliases merged.)"""
    for input_index, _ in program.writes:
        target = callers[input_index]
        for index, other in enumerate(callers):
            if index != input_index and share_memory(target, other) and \
                    _reads(program, program.inputs[index]):
                raise UnsupportedOperationError(
                    f"{call or program.name + '(...)'}: the function writes in place into its "
                    f"tensor argument {input_index}, which shares memory with argument {index}, "
                    "and the program, traced with one input per argument, would read "
                    f"argument {index} as it was before the write (eager torch sees the "
                    "write through the shared memory). Fix: pass a copy as one of them "
                    "(x.clone()), or call the function outside jit.")


def _reads(program, var):
    """Whether an equation or an output of ``program`` reads ``var``."""
    return var in program.outputs or any(var in equation.inputs
                                         for equation in program.equations)
