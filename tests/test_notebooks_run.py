"""Every course chapter runs top to bottom without an error (executed with nbclient).

nbval (``make test``) compares the stored outputs; this test only says that each chapter
still runs, and names the failing cell when it does not. Only the chapters are run
(``notebooks/NN_name.ipynb``, the Makefile's CHAPTERS): a notebook of a student's own saved
beside them is not part of the course.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_notebook_runs_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}")
    # a cell tagged raises-exception (nbclient's tag; nbval also reads it) fails on purpose
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.get("output_type") == "error"
              and "raises-exception" not in cell.get("metadata", {}).get("tags", [])]
    assert not errors, f"{path.name} has error outputs: {errors}"
    stderr = [output.get("text", "") for cell in notebook.cells
              for output in cell.get("outputs", [])
              if output.get("output_type") == "stream" and output.get("name") == "stderr"]
    assert not stderr, f"{path.name} wrote to stderr (warnings?): {stderr}"


def test_there_are_notebooks():
    names = {p.name for p in CHAPTERS}
    expected = {"00_tour.ipynb", "01_dispatchers.ipynb", "02_levels.ipynb",
                "03_interpreters.ipynb", "04_programs.ipynb", "05_source_to_source.ipynb",
                "06_differentiators.ipynb", "07_learning.ipynb", "08_whirlwind.ipynb"}
    assert expected <= names, f"missing notebooks: {sorted(expected - names)}"
