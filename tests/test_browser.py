"""The tape stepper in a real browser: JupyterLab in a subprocess, headless Chromium (Debian's
/usr/bin/chromium, no Playwright browser download) driven by Playwright.

The test writes a notebook, runs it, clicks step, back and Play, checks the highlighted entry
and the gradient map in the DOM, and saves a screenshot to test-artifacts/tape_stepper.png.
Without Chromium it is skipped, except under CI=true, where that is a failure.
"""
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TIMEOUT_MS = 30_000

# The seed's simple(a, b) = sum((a + b) * b), built straight from core + widgets.
DIRECT_CELLS = ["""\
import torch
from minifunctorch.core import capture_tapes, grad, label
from minifunctorch.widgets import TapeStepper

def simple(a, b):
    return ((a + b) * b).sum()

a = label(torch.tensor([1.0, 2.0, 3.0, 4.0]), "a")
b = label(torch.tensor([0.5, -1.0, 2.0, 0.25]), "b")
with capture_tapes() as tapes:
    grads = grad(simple, argnums=(0, 1))(a, b)
TapeStepper(tapes)"""]

# The notebook the browser runs uses the magics, as a student would. DIRECT_CELLS builds the
# same tape (v0 = add a b, v1 = mul v0 b, v2 = sum v1) from core and widgets directly.
MAGIC_CELLS = [
    """\
%load_ext minifunctorch.magics
import torch
a = torch.tensor([1.0, 2.0, 3.0, 4.0])
b = torch.tensor([0.5, -1.0, 2.0, 0.25])""",
    """\
%%grad --wrt a b --tape
((a + b) * b).sum()""",
]
CELLS = MAGIC_CELLS


def _require(condition: bool, reason: str) -> None:
    """Skip when the browser stack is missing, but fail under CI=true."""
    if condition:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the browser test must run; .ci/run installs chromium)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a random port and token, isolated in tmp_path,
    stopped by its PID at teardown. Yields (base_url, token, root_dir)."""
    _require(Path(CHROMIUM).exists(), f"{CHROMIUM} is missing (apt-get install chromium)")
    for module in ("playwright", "jupyterlab", "ipywidgets", "nbformat"):
        try:
            __import__(module)
        except ImportError:
            _require(False, f"{module} is not installed (make setup installs it)")

    root = tmp_path / "root"
    root.mkdir()
    config = tmp_path / "config"
    (config / "labconfig").mkdir(parents=True)
    # no build check on page load: nothing is built here, and it costs seconds of CPU
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"buildCheck": False, "buildAvailable": False}))
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), IPYTHONDIR=str(tmp_path / "ipython"))
    port, token = _free_port(), secrets.token_hex(16)
    log_path = tmp_path / "jupyterlab.log"
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        # IdentityProvider.token is jupyter_server 2's name for the deprecated ServerApp.token
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--ServerApp.allow_root=True",  # CI runs as root
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",  # no PyPI queries
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=root)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45
        while True:
            try:
                with urllib.request.urlopen(f"{base_url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"JupyterLab exited ({server.returncode}):\n{log_path.read_text()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in 45 s:\n{log_path.read_text()}")
                time.sleep(0.3)
        yield base_url, token, root
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)  # it shuts its kernels down, then exits
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(server.pid, signal.SIGKILL)
                server.wait(timeout=5)


def _write_notebook(path: Path, cells) -> None:
    import nbformat
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(notebook, path)


def test_tape_stepper_in_jupyterlab(jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    base_url, token, root = jupyterlab
    _write_notebook(root / "stepper.ipynb", CELLS)
    ARTIFACTS.mkdir(exist_ok=True)
    expect.set_options(timeout=TIMEOUT_MS)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            try:
                # /doc: the single-document view, no file browser beside the notebook
                page.goto(f"{base_url}/doc/tree/stepper.ipynb?token={token}")
                page.locator(".jp-Notebook .jp-Cell .cm-content").first.wait_for()
                page.get_by_text("| Idle").wait_for()  # the kernel is up and connected
                page.locator(".jp-Notebook .jp-Cell .cm-content").first.click()
                for _ in CELLS:
                    page.keyboard.press("Shift+Enter")
                _check_stepper(page, expect)
                page.locator(".mft-stepper").scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / "tape_stepper.png"))
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "tape_stepper_failure.png"))
                raise
        finally:
            browser.close()


def _check_stepper(page, expect):
    stepper = page.locator(".mft-stepper")
    step = stepper.locator(".mft-panel-view .mft-step")
    current = stepper.locator(".mft-row.mft-current")
    gradmap = stepper.locator(".mft-gradmap")

    # step 0: the seed dv2/dv2 = 1, no entry propagated yet, the loss row marked
    expect(stepper.locator(".mft-row")).to_have_count(3)
    expect(step).to_have_attribute("data-step", "0")
    expect(step).to_contain_text("seed dv2/dv2 = 1")
    expect(current).to_have_count(0)
    expect(stepper.locator(".mft-row.mft-seed")).to_contain_text("v2:f32[] = sum v1")
    expect(gradmap).to_contain_text("v2 ← seed")

    stepper.locator("button.mft-step-button").click()
    expect(step).to_have_attribute("data-step", "1")
    expect(current).to_have_attribute("data-index", "2")
    expect(current).to_contain_text("v2:f32[] = sum v1 dim=(0,) keepdim=False")
    expect(gradmap).to_contain_text("v1 ← entry 2")

    stepper.locator("button.mft-step-button").click()
    expect(step).to_have_attribute("data-step", "2")
    expect(current).to_contain_text("v1:f32[4] = mul v0 b")
    expect(gradmap.locator('.mft-grad-row[data-name="b"]')).to_contain_text("b ← entry 1")

    stepper.locator("button.mft-back").click()
    expect(step).to_have_attribute("data-step", "1")
    expect(current).to_contain_text("v2:f32[] = sum v1")
    expect(gradmap.locator('.mft-grad-row[data-name="b"]')).to_have_count(0)

    # Play runs in the front end (jslinked to the slider) until the last step
    stepper.locator(".mft-play button").first.click()
    expect(step).to_have_attribute("data-step", "3")
    expect(stepper.locator(".mft-slider .widget-readout")).to_have_text("3")
    expect(current).to_contain_text("v0:f32[4] = add a b")
    expect(stepper.locator(".mft-row.mft-done")).to_have_count(2)
    expect(gradmap).to_contain_text("gradient map after step 3 (final)")
    b_row = gradmap.locator('.mft-grad-row[data-name="b"]')
    expect(b_row).to_contain_text("b ← entry 1 + entry 0")
    expect(b_row).to_contain_text("[2, 0, 7, 4.5]")  # d/db sum((a + b) * b) = a + 2b
    expect(gradmap.locator('.mft-grad-row[data-name="a"]')).to_contain_text("[0.5, -1, 2, 0.25]")
