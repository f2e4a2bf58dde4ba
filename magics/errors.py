"""What a student sees when the engine refuses something: the call, what went wrong, the
fix, and the student's own line; no engine source, no absolute paths.

NOTE [Short tracebacks for engine errors]
An engine error (a ``TransformError``: a non-scalar result under grad, an ``if`` on a
batched value, a random op under vmap, an op without a rule) already says what went wrong
and how to fix it. What IPython adds by default, the frames of the engine with their source
and absolute paths, tells a student nothing and hides the one frame that matters, their own
line. IPython shows an exception through its ``_render_traceback_`` method when it has one
(``InteractiveShell.showtraceback``), so:
- in a magic cell, the magic rewrites the error's message to begin with the magic as written
  (``%%grad --wrt w: expected ...`` rather than ``grad(cell0, argnums=(0,))(<inputs>): ...``)
  and gives the error a ``_render_traceback_`` that shows the cell's line
  (:func:`magic_traceback`);
- for an engine call written out in a cell (``vmap(g)(x)``), loading the extension gives
  ``TransformError`` a ``_render_traceback_`` that keeps the frames that run notebook cells
  and drops the others (:func:`cell_traceback`). Unloading the extension takes it away; core
  itself knows nothing of IPython.
``%xmode verbose`` still shows every frame. The error keeps its type, so ``except
NonScalarOutputError`` and ``%debug`` work as before.

This module does not import IPython: a traceback here is a list of text lines, which is what
``_render_traceback_`` returns.
"""
import linecache
import re

# How the engine names a transform call at the start of a message:
# "grad(cell0, argnums=(0,))(<inputs>): ..." (core/transforms.py, describe_call).
_ENGINE_CALL = re.compile(r"(?P<transform>\w+)\((?P<function>[^,()]+)(?:, .*?)?\)\(<inputs>\): ",
                          re.DOTALL)


def engine_call_function(message: str):
    """The name of the function in the engine call a message begins with, or ``None``.

    >>> engine_call_function("grad(cell0, argnums=(0,))(<inputs>): expected a scalar")
    'cell0'
    >>> engine_call_function("torch.foo is not supported") is None
    True
    """
    match = _ENGINE_CALL.match(message)
    return match.group("function") if match else None


def renamed_message(message: str, call: str) -> str:
    """``message`` beginning with ``call`` (the magic as written) instead of the engine call.

    >>> renamed_message("grad(cell0)(<inputs>): expected a scalar. Fix: sum it.",
    ...                 "%%grad --wrt w")
    '%%grad --wrt w: expected a scalar. Fix: sum it.'
    >>> renamed_message("torch.foo is not supported. Fix: ...", "%%vmap --over x")
    '%%vmap --over x: torch.foo is not supported. Fix: ...'
    >>> renamed_message("vmap: called random operation. vmap(cell0)(<inputs>): torch.rand ...",
    ...                 "%%vmap --over x")
    'vmap: called random operation. %%vmap --over x: torch.rand ...'
    """
    match = _ENGINE_CALL.search(message)  # (after torch.func's own words, if it has them)
    if match is None:
        return f"{call}: {message}"
    return f"{message[:match.start()]}{call}: {message[match.end():]}"


def frame_lines(label: str, lineno: int, filename: str, function: str | None = None) -> list:
    """One frame as IPython writes it: ``Cell In[4], line 2`` and the marked source line.

    >>> import linecache
    >>> linecache.cache["<demo>"] = (10, None, ["x = 1\\n", "y = x @ w\\n"], "<demo>")
    >>> print("\\n".join(frame_lines("Cell In[4]", 2, "<demo>")))
    Cell In[4], line 2
    ----> 2 y = x @ w
    """
    where = f"{label}, line {lineno}" + (f", in {function}" if function else "")
    source = linecache.getline(filename, lineno).rstrip()
    return [where, f"----> {lineno} {source.strip()}"] if source else [where]


def error_line(error) -> str:
    return f"{type(error).__name__}: {error}"


def cell_frames(tb, cell_number):
    """``(number, lineno, filename, function)`` for each frame of traceback ``tb`` that runs
    a notebook cell; ``cell_number(filename)`` is the cell's number, or ``None`` for code
    that is not a cell's."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        number = cell_number(code.co_filename)
        if number is not None:
            function = None if code.co_name == "<module>" else code.co_name
            frames.append((number, tb.tb_lineno, code.co_filename, function))
        tb = tb.tb_next
    return frames


def cell_traceback(error, cell_number) -> list:
    """The short traceback of an engine error: the frames of notebook cells, then the error.

    >>> import linecache, sys
    >>> linecache.cache["<cell 3>"] = (9, None, ["1 / 0\\n"], "<cell 3>")
    >>> try:
    ...     exec(compile("1 / 0", "<cell 3>", "exec"))
    ... except ZeroDivisionError as error:
    ...     print("\\n".join(cell_traceback(error, {"<cell 3>": 3}.get)))
    Cell In[3], line 1
    ----> 1 1 / 0
    ZeroDivisionError: division by zero
    """
    lines = []
    for number, lineno, filename, function in cell_frames(error.__traceback__, cell_number):
        lines += frame_lines(f"Cell In[{number}]", lineno, filename, function)
    return lines + [error_line(error)]


def magic_traceback(error, cell_filename, cell_label, result_line, cell_number) -> list:
    """The short traceback of an engine error raised while a magic ran its cell: the cell's
    line that raised it (and the notebook functions it called), or, when the error came
    after the cell returned (a non-scalar result), the line that gives the result."""
    frames = [frame for frame in cell_frames(error.__traceback__, cell_number)]
    own = [i for i, frame in enumerate(frames) if frame[2] == cell_filename]
    lines = []
    if own:
        for number, lineno, filename, function in frames[own[0]:]:
            label = cell_label if filename == cell_filename else f"Cell In[{number}]"
            lines += frame_lines(label, lineno, filename,
                                 function if filename != cell_filename else None)
    else:
        lines += frame_lines(cell_label, result_line, cell_filename)
    return lines + [error_line(error)]
