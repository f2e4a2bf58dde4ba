"""Every course notebook runs top to bottom without an error (executed with nbclient).

nbval (``make test``) compares the stored outputs; this test only says that each notebook
still runs, and names the failing cell when it does not.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
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
    names = {p.name for p in NOTEBOOKS}
    expected = {"00_tour.ipynb", "01_dispatchers.ipynb", "02_interpreters.ipynb",
                "03_programs.ipynb", "04_source_to_source.ipynb", "05_differentiators.ipynb",
                "06_whirlwind.ipynb"}
    assert expected <= names, f"missing notebooks: {sorted(expected - names)}"
