"""Re-execute the course notebooks in place (``make notebooks``), so that stored outputs
match the engine. Uses nbclient with the current environment's Python kernel."""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


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
    sys.exit(main(sys.argv[1:] or sorted(str(p) for p in Path(__file__).parent.glob("*.ipynb"))))
