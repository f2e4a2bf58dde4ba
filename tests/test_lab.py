"""`make lab` serves JupyterLab on the course, also as root (the usual user in containers),
and passes LAB_ARGS on; `make test` and `make notebooks` take the chapters only.

The tests run make on this checkout with the environment that runs them (VENV=sys.prefix;
``-o`` keeps make from re-running the set-up).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = re.compile(r"\d\d_\w+\.ipynb$")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make(*arguments, **kwargs):
    """``make -C <repo> VENV=<this environment> -o <its stamp> ...`` as a command line."""
    return ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={sys.prefix}",
            "-o", f"{sys.prefix}/.installed", *arguments]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_the_course_and_the_token_url_answers(tmp_path):
    pytest.importorskip("jupyterlab")
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), IPYTHONDIR=str(tmp_path / "ipython"))
    lab_args = (f"--no-browser --port {port} --ServerApp.port_retries=0 "
                "--LabApp.news_url=None --LabApp.extension_manager=readonly "
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
    log_path = tmp_path / "lab.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(make("lab", f"LAB_ARGS={lab_args}"), stdout=log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            found = re.search(rf"http://(?:127\.0\.0\.1|localhost):{port}/lab\?token=\w+",
                              log_path.read_text())
            if found:
                url = found.group(0)
            elif server.poll() is not None:
                pytest.fail(f"make lab exited ({server.returncode}):\n{log_path.read_text()}")
            elif time.monotonic() > deadline:
                pytest.fail(f"no token URL in 60 s:\n{log_path.read_text()}")
            else:
                time.sleep(0.3)
        while True:  # (the URL can be logged a moment before a loaded machine accepts on it)
            try:
                response = urllib.request.urlopen(url, timeout=10)  # the URL README points at
                break
            except urllib.error.URLError as error:
                if not isinstance(error.reason, ConnectionRefusedError) or \
                        time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        with response:
            assert response.status == 200
            assert "JupyterLab" in response.read().decode()
        token = url.rpartition("token=")[2]
        listing = f"http://127.0.0.1:{port}/api/contents?token={token}"
        with urllib.request.urlopen(listing, timeout=10) as response:
            names = {item["name"] for item in json.load(response)["content"]}
        assert "00_tour.ipynb" in names  # the root is the course
        assert not any("Running as root" in line for line in log_path.read_text().splitlines())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the group make started: make and jupyter
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=5)


def dry_run(*arguments) -> str:
    return subprocess.run(make("-n", *arguments), capture_output=True, text=True,
                          check=True).stdout


def test_make_lab_adds_allow_root_only_as_root_and_passes_lab_args():
    command = dry_run("lab", "LAB_ARGS=--port 8890 --no-browser")
    assert re.search(r"jupyter lab .*--port 8890 --no-browser notebooks/", command)
    assert ("--allow-root" in command) == (os.geteuid() == 0)


def test_make_test_and_make_notebooks_take_the_chapters_only():
    # a student's own notebook, with a mistake (another name than Untitled.ipynb, which a
    # student may well have there)
    student = ROOT / "notebooks" / f"Untitled-{os.getpid()}.ipynb"
    import nbformat
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    nbformat.write(notebook, student)
    try:
        for target in ("test", "notebooks"):
            command = dry_run(target)
            listed = set(re.findall(r"notebooks/[\w.]+\.ipynb", command))
            chapters = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")
                        if CHAPTER.match(p.name)}
            assert listed == chapters, (target, command)
            assert student.name not in command
    finally:
        student.unlink()


def test_the_course_folder_holds_only_the_course():
    """What a clone shows in notebooks/: the chapters, a README, images or data."""
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "notebooks"],
                             capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    names = [Path(line).relative_to("notebooks") for line in tracked.stdout.splitlines()]
    assert len([n for n in names if CHAPTER.match(str(n))]) >= 7
    allowed = re.compile(r"(\d\d_\w+\.ipynb|README\.md|(images|data)/.+)$")
    assert [str(n) for n in names if not allowed.match(str(n))] == []
