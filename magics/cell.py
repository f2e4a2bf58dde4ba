"""A magic cell as a Python function: headers, body, compilation and tracebacks.

This module knows nothing about transforms and does not import IPython: it turns the text
of a cell into a function ``cell(<inputs>)`` and keeps tracebacks pointing at the cell.

NOTE [A cell is a function body]
A transform needs a *function*, and a notebook cell is a piece of code that reads notebook
variables. The magics make the cell the body of a function whose parameters are the names the
magic's flags list (``--wrt x w`` gives ``def cell(x, w): ...``). Everything else follows
from Python's own rules for functions:
- a parameter holds the value the transform passes (a wrapped value while ``grad`` runs);
- every other name is a global of the function, and the function's globals are the
  notebook's namespace, so other notebook variables are seen as a closure would see them
  (and a notebook function called from the cell sees the notebook's values, not the
  transform's: only the parameters are inputs);
- assignments make local variables and never leak into the notebook (``global`` is the
  explicit way out, as in any function);
- the last expression is the result: it is turned into ``return <expression>``; a cell may
  also ``return`` explicitly.
We compile a real ``def`` rather than ``exec`` the statements in a copied namespace: nested
scopes (lambdas, comprehensions, inner functions) then see the parameters through ordinary
closures, ``return`` works, and nothing is copied per call. The price is Python's usual
function rule that a name assigned anywhere in the body is local everywhere in it
(``w = w * 2`` with ``w`` not an input raises UnboundLocalError, as in a function).

NOTE [Tracebacks point at the cell]
The function is compiled from an AST whose line numbers are those of the whole cell (the
``%%`` header lines included), under a file name registered with the shell's compiler
(``shell.compile.cache``), so a traceback shows ``Cell In[5], line 3`` and the cell's own
line, exactly like an ordinary cell. When the cell fails inside a transform, the frames of
the magics and of the transforms above the cell's frame tell the user nothing;
:func:`traceback_from` cuts them off (the magic methods that re-raise carry
``__tracebackhide__``, which IPython honours).
"""
import ast
import hashlib
import linecache

FUNCTION_NAME = "cell"


class CellError(ValueError):
    """The cell's text cannot become a function (no body, no result, bad header line)."""


def split_headers(cell: str):
    """Split the ``%%name flags`` lines at the top of a cell body from the code below them.

    Returns ``(headers, body, header_lines)``: ``headers`` a list of ``(name, flags)`` pairs,
    outermost first; ``body`` the code with the header lines removed; ``header_lines`` the raw
    header lines (used to keep line numbers).

    >>> split_headers("%%grad --wrt w\\n((x @ w) ** 2).sum()\\n")
    ([('grad', '--wrt w')], '((x @ w) ** 2).sum()\\n', ['%%grad --wrt w'])
    """
    lines = cell.split("\n")
    headers, header_lines = [], []
    while lines and lines[0].lstrip().startswith("%%"):
        raw = lines.pop(0)
        name, _, flags = raw.lstrip()[2:].partition(" ")
        if not name:
            raise CellError(f"the line {raw!r} names no magic after '%%'.")
        headers.append((name, flags.strip()))
        header_lines.append(raw)
    return headers, "\n".join(lines), header_lines


def _has_return(statements) -> bool:
    """Whether ``statements`` return at the function's own scope (nested scopes excluded)."""
    pending = list(statements)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        pending.extend(ast.iter_child_nodes(node))
    return False


def _function_def(statements, params):
    arguments = ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=name) for name in params], vararg=None,
        kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    definition = ast.FunctionDef(name=FUNCTION_NAME, args=arguments, body=statements,
                                 decorator_list=[], returns=None, type_comment=None)
    if "type_params" in ast.FunctionDef._fields:  # Python >= 3.12
        definition.type_params = []
    definition.lineno, definition.col_offset = 1, 0
    return definition


class CellFunction:
    """The body of a magic cell compiled as ``def cell(<params>): <body>``.

    ``namespace`` is the function's globals (the notebook's ``user_ns``). ``header_lines``
    are the ``%%`` lines above the body: they are not run, but they count for line numbers.
    ``compiler`` is the shell's ``CachingCompiler`` (``shell.compile``); without one the
    builtin ``compile`` is used and the source is registered in ``linecache`` under a name
    of our own, so tracebacks still show the cell's lines.

    >>> import torch
    >>> f = CellFunction("y = x * 2\\ny + 1", ("x",), {"torch": torch})
    >>> f(torch.tensor(1.0))
    tensor(3.)
    >>> f.function.__name__, f.params
    ('cell', ('x',))
    """

    def __init__(self, body: str, params, namespace: dict, *, header_lines=(), compiler=None,
                 number: int = 0, transform_ast=None):
        self.params = tuple(params)
        self.namespace = namespace
        header_lines = list(header_lines)
        self.source = "\n".join(header_lines + [body])
        self.filename = self._register_source(compiler, number)
        padded = "\n" * len(header_lines) + body  # line numbers of the whole cell
        if compiler is not None:
            module = compiler.ast_parse(padded, filename=self.filename)
        else:
            module = ast.parse(padded, filename=self.filename)
        if transform_ast is not None:
            module = transform_ast(module)
        statements = list(module.body)
        if not statements:
            raise CellError("the cell has no code below the magic line(s). Fix: write the "
                            "function's body, ending with the expression to transform.")
        last = statements[-1]
        if isinstance(last, ast.Expr):
            statements[-1] = ast.copy_location(ast.Return(value=last.value), last)
        elif not _has_return(statements):
            raise CellError(
                "the cell must end with an expression: a magic cell is the body of a function "
                "and its last expression is the result. Fix: end the cell with the value to "
                "transform (e.g. `loss`), or `return` it.")
        definition = _function_def(statements, self.params)
        wrapper = ast.fix_missing_locations(ast.Module(body=[definition], type_ignores=[]))
        if compiler is not None:
            code = compiler(wrapper, self.filename, "exec")
        else:
            code = compile(wrapper, self.filename, "exec")
        defined: dict = {}
        exec(code, namespace, defined)  # defines the function only: nothing runs, nothing leaks
        self.function = defined[FUNCTION_NAME]

    def _register_source(self, compiler, number) -> str:
        if compiler is not None and hasattr(compiler, "cache"):
            return compiler.cache(self.source, number)
        digest = hashlib.sha1(self.source.encode()).hexdigest()[:12]
        filename = f"<magic-cell-{digest}>"
        lines = [line + "\n" for line in self.source.splitlines()]
        linecache.cache[filename] = (len(self.source), None, lines, filename)
        return filename

    def __call__(self, *args):
        return self.function(*args)

    def __repr__(self):
        return f"<CellFunction {FUNCTION_NAME}({', '.join(self.params)}) from {self.filename}>"


def traceback_from(tb, filename):
    """The part of traceback ``tb`` that starts at the first frame running ``filename``.

    Returns ``None`` when no frame of ``tb`` runs code from ``filename``.

    >>> import sys
    >>> f = CellFunction("1 / 0", (), {})
    >>> try:
    ...     f()
    ... except ZeroDivisionError:
    ...     tb = traceback_from(sys.exc_info()[2], f.filename)
    >>> tb.tb_frame.f_code.co_name, tb.tb_lineno
    ('cell', 1)
    """
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            return tb
        tb = tb.tb_next
    return None
