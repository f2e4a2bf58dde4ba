"""Programs: a typed, first-order IR (like a jaxpr), its printer, typechecker, evaluator
and exports.

A Program has input binders, constant inputs (tensors the traced function captured),
equations ``c:f32[4] = mul a b`` and outputs. Names are given when printing, in order of
appearance (a, b, ..., z, ba, bb, ...), so the text is the same whatever the value counter
said while tracing.

``program(*args)`` evaluates it with ``bind``, so a program runs under any transform:
``grad(program)``, ``vmap(program)`` and ``trace(program)`` all work, and tracing a traced
program gives the same program back.
"""
import html
import keyword
import math
import operator

import optree
import torch

from . import primitives as P
from .tensor import as_tensor, engine_code, unwrap
from .values import bind
from .errors import TransformUsageError, TypecheckError
from .printing import format_param, type_string


class Var:
    """A program variable: a shape and a dtype; its name is given by the printer."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype

    @property
    def type(self) -> str:
        return type_string(self.dtype, self.shape)

    def __repr__(self):
        return f"Var({self.type})"


class Literal:
    """A Python number used directly as an operand (``mul b 2``)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return repr(self.value)


class Equation:
    """``out = prim(*inputs, **params)``."""

    __slots__ = ("prim", "inputs", "params", "out")

    def __init__(self, prim, inputs, params, out):
        self.prim = prim
        self.inputs = list(inputs)
        self.params = dict(params)
        self.out = out

    def __repr__(self):
        operands = " ".join(repr(o.value) if isinstance(o, Literal) else o.type
                            for o in self.inputs)
        params = "".join(f" {k}={format_param(v)}" for k, v in self.params.items())
        return f"Equation({self.out.type} = {self.prim.name} {operands}{params})"


def _letters(index: int) -> str:
    """a, b, ..., z, ba, bb, ... (a base-26 numeral with letters as digits)."""
    name = ""
    while True:
        name = chr(ord("a") + index % 26) + name
        index //= 26
        if index == 0:
            return name


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
                 out_treedef=None, static_leaves=None, device=None, name="f"):
        self.inputs = list(inputs)
        self.constants = list(constants)  # (Var, tensor) pairs
        self.equations = list(equations)
        self.outputs = list(outputs)
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
                       static_leaves=self.static_leaves, device=self.device, name=self.name)

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
        lines.append(f"  in ({outputs}{',' if len(self.outputs) == 1 else ''}) }}")
        return "\n".join(lines)

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
        lines.append(f"  in ({outputs}{',' if len(self.outputs) == 1 else ''}) }}")
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
        leaves, treedef = optree.tree_flatten((tuple(args), dict(kwargs)))
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
            inputs = [unwrap(t) for t in self.flatten_inputs(args, kwargs)]
            outputs = [as_tensor(o) for o in self.evaluate_flat(inputs)]
        if self.out_treedef is None:
            return tuple(outputs)
        return optree.tree_unflatten(self.out_treedef, outputs)

    # --- exports ---------------------------------------------------------------------------
    def python_source(self, function_name=None) -> tuple[str, dict]:
        """Straight-line Python for the program, and the globals it needs.

        Constants are globals of the generated function: bound once, not looked up per call.
        """
        names = self.names()
        globals_ = {"torch": torch, "operator": operator}
        for var, value in self.constants:
            globals_[names[var]] = value
        args = ", ".join(names[v] for v in self.inputs)
        function_name = function_name or _identifier(self.name)
        lines = [f"def {function_name}({args}):"]
        # the generated function's own name and its locals are never reused for a callable
        # (a custom function called `b` would be shadowed by the local `b`)
        reserved = {function_name, *names.values()}
        for equation in self.equations:
            operands = [_literal_source(o.value) if isinstance(o, Literal) else names[o]
                        for o in equation.inputs]
            expression = emit_call(equation.prim, operands, equation.params, globals_,
                                   reserved=reserved)
            lines.append(f"    {names[equation.out]} = {expression}")
        outputs = ", ".join(_literal_source(o.value) if isinstance(o, Literal) else names[o]
                            for o in self.outputs)
        lines.append(f"    return ({outputs}{',' if len(self.outputs) == 1 else ''})")
        return "\n".join(lines) + "\n", globals_

    def compile_python(self):
        """The program as a Python function of its flat inputs, returning flat outputs."""
        source, globals_ = self.python_source("compiled_program")
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


def _identifier(name):
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"f_{cleaned}"


# --- how each primitive is written in exported code ------------------------------------------
INFIX = {P.add_p: "+", P.sub_p: "-", P.mul_p: "*", P.div_p: "/", P.pow_p: "**",
         P.matmul_p: "@", P.eq_p: "==", P.ne_p: "!=", P.lt_p: "<", P.le_p: "<=",
         P.gt_p: ">", P.ge_p: ">="}
INFIX_FUNCTIONS = {P.add_p: operator.add, P.sub_p: operator.sub, P.mul_p: operator.mul,
                   P.div_p: operator.truediv, P.pow_p: operator.pow, P.matmul_p: operator.matmul,
                   P.eq_p: operator.eq, P.ne_p: operator.ne, P.lt_p: operator.lt,
                   P.le_p: operator.le, P.gt_p: operator.gt, P.ge_p: operator.ge}
# primitive -> (torch function, its keyword names for our params)
TORCH_FUNCTIONS = {
    P.neg_p: (torch.neg, {}), P.exp_p: (torch.exp, {}), P.log_p: (torch.log, {}),
    P.sin_p: (torch.sin, {}), P.cos_p: (torch.cos, {}), P.tanh_p: (torch.tanh, {}),
    P.sigmoid_p: (torch.sigmoid, {}), P.relu_p: (torch.relu, {}), P.abs_p: (torch.abs, {}),
    P.sqrt_p: (torch.sqrt, {}), P.sign_p: (torch.sign, {}), P.where_p: (torch.where, {}),
    P.sum_p: (torch.sum, {}), P.mean_p: (torch.mean, {}), P.amax_p: (torch.amax, {}),
    P.amin_p: (torch.amin, {}), P.logsumexp_p: (torch.logsumexp, {}),
    P.softmax_p: (torch.softmax, {}), P.log_softmax_p: (torch.log_softmax, {}),
    P.permute_p: (torch.permute, {}), P.reshape_p: (torch.reshape, {}),
    P.unsqueeze_p: (torch.unsqueeze, {}), P.squeeze_p: (torch.squeeze, {}),
    P.expand_p: (torch.broadcast_to, {"shape": "size"}),
    P.diagonal_p: (torch.diagonal, {}), P.diag_embed_p: (torch.diag_embed, {}),
    P.gather_p: (torch.gather, {}), P.full_like_p: (torch.full_like, {}),
    P.detach_p: (torch.detach, {}), P.convert_p: (torch.Tensor.to, {}),
}


def export_target(prim):
    """The callable that exported code uses for ``prim``, and the keyword renames."""
    if prim in INFIX_FUNCTIONS:
        return INFIX_FUNCTIONS[prim], {}
    if prim in TORCH_FUNCTIONS:
        return TORCH_FUNCTIONS[prim]
    return prim.impl, {}  # scatter_index, scatter_add, diagonal_scatter, custom functions


def _callable_name(target, globals_, reserved=()):
    if getattr(target, "__module__", None) == "torch" and hasattr(torch, target.__name__):
        return f"torch.{target.__name__}"
    if target is torch.Tensor.to:
        return "torch.Tensor.to"
    name = _identifier(getattr(target, "__name__", "function"))
    while name in reserved or (name in globals_ and globals_[name] is not target):
        name += "_"
    globals_[name] = target
    return name


def emit_call(prim, operands, params, globals_, *, reserved=()) -> str:
    """One equation's right-hand side as Python source (``reserved``: names not to use for
    callables)."""
    if prim is P.pow_p and operands[0].startswith("-"):
        operands = [f"({operands[0]})", operands[1]]  # -2 ** a is -(2 ** a)
    if prim in INFIX:
        return f"{operands[0]} {INFIX[prim]} {operands[1]}"
    if prim is P.getitem_p:
        return f"{operands[0]}[{_index_source(params['index'])}]"
    if prim is P.cat_p:
        return f"torch.cat([{', '.join(operands)}], dim={params['dim']})"
    target, renames = export_target(prim)
    if prim is P.gather_p:
        return f"torch.gather({operands[0]}, {params['dim']}, {operands[1]})"
    keywords = [f"{renames.get(k, k)}={_param_source(v)}" for k, v in params.items()]
    return f"{_callable_name(target, globals_, reserved)}({', '.join(operands + keywords)})"


def _literal_source(value):
    """A number as Python source: ``repr``, except that inf and nan are not names."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"float('{value!r}')"
    return repr(value)


def _param_source(value):
    # A parameter is a keyword argument, not a subscript: scatter_index's index=(slice(0, 2,
    # 1),) keeps its slice objects (only getitem is written with the a[0:2] syntax).
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, float):
        return _literal_source(value)
    return repr(value)


def _index_source(index):
    parts = []
    for item in index:
        if item is None:
            parts.append("None")
        elif isinstance(item, slice):
            start = "" if item.start in (None, 0) else str(item.start)
            stop = "" if item.stop is None else str(item.stop)
            step = "" if item.step in (None, 1) else f":{item.step}"
            parts.append(f"{start}:{stop}{step}")
        else:
            parts.append(repr(item))
    return ", ".join(parts)
