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
The ``def`` sits inside a scope function whose variables are the *captured* notebook values
(a notebook tensor ``X`` the cell reads, passed in as a labelled view: NOTE [Names the
notebook gave] in names.py) and the namer ``__mft_name__``; the body sees them through
ordinary closures, which shadow the globals of the same name.

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
SCOPE_NAME = "__mft_scope__"
NAMER_NAME = "__mft_name__"


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


def _function_def(name, statements, params):
    arguments = ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=param) for param in params], vararg=None,
        kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    definition = ast.FunctionDef(name=name, args=arguments, body=statements,
                                 decorator_list=[], returns=None, type_comment=None)
    if "type_params" in ast.FunctionDef._fields:  # Python >= 3.12
        definition.type_params = []
    definition.lineno, definition.col_offset = 1, 0
    return definition


def names_read(statements) -> set:
    """Every name the statements read (nested scopes included): the candidates for capture.

    >>> sorted(names_read(ast.parse("h = X @ w\\n[h * s for s in S]").body))
    ['S', 'X', 'h', 's', 'w']
    """
    return {node.id for statement in statements for node in ast.walk(statement)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


# The statement-list fields of compound statements (if/for/while/with/try/match bodies).
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _assigned_names(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _assigned_names(element)
    elif isinstance(target, ast.Starred):
        yield from _assigned_names(target.value)


def _name_call(name, location):
    call = ast.Expr(ast.Call(func=ast.Name(NAMER_NAME, ast.Load()),
                             args=[ast.Name(name, ast.Load()), ast.Constant(name)], keywords=[]))
    return ast.copy_location(call, location)


def with_namer_calls(statements) -> list:
    """``statements`` with ``__mft_name__(h, "h")`` after each assignment to a variable ``h``,
    in the function's own scope (nested functions, lambdas and classes are left alone).

    >>> tree = ast.parse("h = f(x)\\nif h:\\n    a, b = h\\nh")
    >>> print(ast.unparse(with_namer_calls(tree.body)))
    h = f(x)
    __mft_name__(h, 'h')
    if h:
        a, b = h
        __mft_name__(a, 'a')
        __mft_name__(b, 'b')
    h
    """
    result = []
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            result.append(statement)
            continue
        for field in _BLOCKS:
            block = getattr(statement, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                setattr(statement, field, with_namer_calls(block))
            elif isinstance(block, list):  # except handlers, match cases: their bodies
                for clause in block:
                    clause.body = with_namer_calls(clause.body)
        result.append(statement)
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        for target in targets:
            result.extend(_name_call(name, statement) for name in _assigned_names(target))
    return result


def _no_namer(value, name):
    """The namer of a cell compiled without one: nothing to do."""


class CellFunction:
    """The body of a magic cell compiled as ``def cell(<params>): <body>``.

    ``namespace`` is the function's globals (the notebook's ``user_ns``). ``header_lines``
    are the ``%%`` lines above the body: they are not run, but they count for line numbers.
    ``compiler`` is the shell's ``CachingCompiler`` (``shell.compile``); without one the
    builtin ``compile`` is used and the source is registered in ``linecache`` under a name
    of our own, so tracebacks still show the cell's lines.

    ``capture(names)`` (optional) receives the names the body reads and returns the values
    to pass in as closure variables (``{"X": <labelled view of X>}``); ``namer`` (optional)
    is called as ``namer(value, "h")`` after each assignment ``h = ...`` of the body's own
    scope, and its ``restart()`` before each call. ``result_line`` is the line of the last
    statement, the one that gives the result (for errors raised after the body returned).

    >>> import torch
    >>> f = CellFunction("y = x * 2\\ny + 1", ("x",), {"torch": torch})
    >>> f(torch.tensor(1.0))
    tensor(3.)
    >>> f.function.__name__, f.params
    ('cell', ('x',))
    """

    def __init__(self, body: str, params, namespace: dict, *, header_lines=(), compiler=None,
                 number: int = 0, transform_ast=None, capture=None, namer=None):
        self.params = tuple(params)
        self.number = number
        self.namer = namer
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
        self.result_line = statements[-1].lineno
        self.captured = dict(capture(names_read(statements) - set(self.params))) \
            if capture is not None else {}
        if namer is not None:
            statements = with_namer_calls(statements)
        # NOTE [A cell is a function body]: def __mft_scope__(<captured>, __mft_name__):
        #     def cell(<params>): <body>
        #     return cell
        definition = _function_def(FUNCTION_NAME, statements, self.params)
        give_back = ast.Return(value=ast.Name(FUNCTION_NAME, ast.Load()), lineno=1, col_offset=0)
        scope = _function_def(SCOPE_NAME, [definition, give_back],
                              [*self.captured, NAMER_NAME])
        wrapper = ast.fix_missing_locations(ast.Module(body=[scope], type_ignores=[]))
        if compiler is not None:
            code = compiler(wrapper, self.filename, "exec")
        else:
            code = compile(wrapper, self.filename, "exec")
        defined: dict = {}
        exec(code, namespace, defined)  # defines the function only: nothing runs, nothing leaks
        self.function = defined[SCOPE_NAME](*self.captured.values(), namer or _no_namer)

    def _register_source(self, compiler, number) -> str:
        if compiler is not None and hasattr(compiler, "cache"):
            return compiler.cache(self.source, number)
        digest = hashlib.sha1(self.source.encode()).hexdigest()[:12]
        filename = f"<magic-cell-{digest}>"
        lines = [line + "\n" for line in self.source.splitlines()]
        linecache.cache[filename] = (len(self.source), None, lines, filename)
        return filename

    def __call__(self, *args):
        if self.namer is not None:
            self.namer.restart()  # names restart per call, as the engine's do
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
