"""Re-execute the course chapters in place (``make notebooks``), so that stored outputs match
the engine. Uses nbclient with the current environment's Python kernel.

Only the chapters are executed: ``notebooks/NN_name.ipynb`` (two digits, an underscore). A
notebook of a student's own in ``notebooks/`` (``Untitled.ipynb``) is left alone, here and by
``make test``.
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"  # the same rule as the Makefile's CHAPTERS


def chapters() -> list:
    return sorted(NOTEBOOKS.glob(CHAPTER_GLOB))


def execute(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(notebook, path)


def main(paths):
    for name in paths:
        path = Path(name)
        print(f"executing {path} ...", flush=True)
        execute(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or [str(p) for p in chapters()]))
