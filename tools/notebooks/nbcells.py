"""Helpers shared by the notebook generators: make cells, write them as a notebook.

A generator writes the notebook's cells only; outputs come from executing it
(``make notebooks``). The target is ``notebooks/<name>`` at the top of the repository, or
the path given as the generator's first command-line argument.
"""
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def md(text):
    """A markdown cell; the text may be indented as a whole (it is dedented)."""
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text, tags=None):
    """A code cell; ``tags`` (e.g. ``["raises-exception"]``) go into its metadata."""
    cell = new_code_cell(textwrap.dedent(text).strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def hidden(cell):
    """A cell of an exercise's solution, shown collapsed by JupyterLab (``source_hidden``)
    until the student opens it; tagged ``solution``. nbval and ``make notebooks`` run a hidden
    code cell like any other, which proves that the reference solution passes its check."""
    cell.metadata.setdefault("tags", []).append("solution")
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


def solution(text):
    """The reference solution's code, collapsed (see :func:`hidden`)."""
    return hidden(code(text))


def solution_md(text):
    """The explanation of a solution, collapsed (see :func:`hidden`)."""
    return hidden(md(text))


SOLUTION_HEADING = """### Solution

Try the exercise before you open the solution: it is in the collapsed cells below (click a
collapsed cell's bar, or its "⋯", to show it). Running it replaces your code, and the check
after it runs on the solution."""


def _target(name):
    return Path(sys.argv[1]) if len(sys.argv) > 1 else NOTEBOOKS / name


def _save(notebook, path):
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    notebook.metadata["language_info"] = {"name": "python"}
    nbformat.validate(notebook)
    nbformat.write(notebook, path)
    code_cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    print(f"wrote {path}: {len(notebook.cells)} cells ({code_cells} code)")


def write(cells, name):
    """Write ``cells`` as notebook ``name``. When the notebook already exists with as many
    cells, each cell keeps the id of the cell at its position, so that regenerating a
    notebook changes its cell ids only where cells were added or removed."""
    path = _target(name)
    if path.exists():
        old = nbformat.read(path, as_version=4).cells
        if len(old) == len(cells):
            for cell, old_cell in zip(cells, old):
                if "id" in old_cell:
                    cell.id = old_cell.id
        else:
            print(f"{path}: {len(old)} cells before, {len(cells)} now: new cell ids")
    _save(new_notebook(cells=cells), path)


def build(pairs, name, prefix):
    """Write ``pairs`` of ``(kind, source)`` as notebook ``name`` (kind: "md", "code",
    "raises" for a code cell that fails on purpose, "trained" for a code cell that prints the
    outcome of a long training run, "solution" / "solution-md" for the collapsed cells of a
    solution), with the cell ids
    ``<prefix>-00``, ``<prefix>-01``, ..."""
    makers = {"md": md, "code": code, "solution": solution, "solution-md": solution_md,
              "raises": lambda source: code(source, ["raises-exception"]),
              # A long training run's printed losses move in their last digit with the
              # CPU's floating-point summation order (vector width, BLAS): nbval does not
              # compare them (the tag is metadata, so the reader sees nothing), and the
              # cell's own asserts check every claim it prints.
              "trained": lambda source: code(source, ["nbval-ignore-output"])}
    cells = []
    for index, (kind, source) in enumerate(pairs):
        cell = makers[kind](source)
        cell.id = f"{prefix}-{index:02d}"
        cells.append(cell)
    _save(new_notebook(cells=cells), _target(name))
