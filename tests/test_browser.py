"""The tape stepper in a real browser: JupyterLab in a subprocess, headless Chromium (Debian's
/usr/bin/chromium, no Playwright browser download) driven by Playwright.

The test writes a notebook, runs it, and checks three steppers in the DOM:
- a one-tape stepper: step, back and Play, the highlighted entry and the gradient map;
- a two-level stepper whose outer tape has 21 entries, at 1400 px and at 800 px wide: no
  panel's content is wider than the panel, exactly one control bar is shown (and enabled)
  while the panels step together, the panels sit side by side at 1400 px and stack at 800 px,
  and the controls stay in view when the gradient map is full;
- a 30-entry tape at 800 px: each step of the slider keeps room to be picked.
Screenshots go to test-artifacts/ (tape_stepper.png, tape_stepper_two_levels_{1400,800}.png).
Without Chromium the test is skipped, except under CI=true, where that is a failure.
"""
import json
import os
import re
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
WIDTHS = (1400, 800)
MIN_STEP_PX = 12  # the slider's room per step on a 30-entry tape, at 800 px

# The notebook the browser runs uses the magics, as a student would.
CELLS = [
    """\
%load_ext minifunctorch.magics
import torch
from minifunctorch.core import grad
a = torch.tensor([1.0, 2.0, 3.0, 4.0])
b = torch.tensor([0.5, -1.0, 2.0, 0.25])
torch.manual_seed(0)
X, Y = torch.randn(8, 3), torch.randn(8, 1)
W1, W2 = torch.randn(3, 4), torch.randn(4, 1)
v = torch.linspace(0.1, 1.0, 6)

def loss_of(W1, W2):
    h = torch.tanh(X @ W1)
    return ((h @ W2 - Y) ** 2).mean()""",
    # one tape: v0 = add a b, v1 = mul v0 b, v2 = sum v1
    """\
%%grad --wrt a b --tape
((a + b) * b).sum()""",
    # two levels: the outer tape records the inner grad's forward and backward (21 entries)
    """\
%%grad --wrt W1 W2 --tape -q
dW1 = grad(loss_of)(W1, W2)
penalty = (dW1 ** 2).sum()
loss_of(W1, W2) + penalty""",
    # 30 entries
    """\
%%grad --wrt v --tape -q
h = v
for _ in range(29):
    h = torch.sin(h)
h.sum()""",
]


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
                expect(page.locator(".mft-stepper")).to_have_count(3)
                expect(page.locator(".jp-OutputArea-output[data-mime-type="
                                    "'application/vnd.jupyter.stderr']")).to_have_count(0)
                one_tape, two_levels, long_tape = (page.locator(".mft-stepper").nth(i)
                                                   for i in range(3))
                _check_stepper(page, expect, one_tape)
                one_tape.scroll_into_view_if_needed()
                one_tape.screenshot(path=str(ARTIFACTS / "tape_stepper.png"))
                for width in WIDTHS:
                    page.set_viewport_size({"width": width, "height": 900})
                    _check_two_levels(page, expect, two_levels, width)
                _check_slider_room(page, expect, long_tape)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "tape_stepper_failure.png"))
                raise
        finally:
            browser.close()


# Measured in the page: the right edge of everything a panel shows, against the panel's own.
_OVERFLOW_JS = """panel => {
    const box = panel.getBoundingClientRect();
    let right = box.right;
    for (const el of panel.querySelectorAll('*')) {
        const r = el.getBoundingClientRect();
        if (r.width > 0 && r.height > 0) right = Math.max(right, r.right);
    }
    return {overflow: right - box.right, scroll: panel.scrollWidth - panel.clientWidth,
            width: box.width, top: box.top, bottom: box.bottom, left: box.left};
}"""

_BARS_JS = """stepper => [...stepper.querySelectorAll('.mft-controls')]
    .filter(bar => bar.getClientRects().length > 0 && bar.getBoundingClientRect().height > 0)
    .map(bar => !bar.querySelector('button.mft-step-button').disabled)"""


def _check_two_levels(page, expect, stepper, width):
    panels = stepper.locator(".mft-panel")
    expect(panels).to_have_count(2)
    expect(panels.nth(0)).to_contain_text("Autograd tape · outer")
    expect(panels.nth(1)).to_contain_text("Autograd tape · inner")
    expect(stepper.locator(".mft-legend")).to_contain_text("off the path")
    stepper.locator(".mft-shared-controls").scroll_into_view_if_needed()
    page.wait_for_timeout(300)  # the layout settles after the resize

    bars = stepper.evaluate(_BARS_JS)
    assert bars == [True], f"{width}px: visible control bars (enabled?) {bars}"

    shared = stepper.locator(".mft-shared-controls")
    shared.locator("button.mft-last").click()  # the fullest gradient maps
    for position in range(2):  # each panel on its own last step
        expect(panels.nth(position).locator(".mft-step")).to_contain_text(
            re.compile(r"step (\d+) of \1\b"))
    page.wait_for_timeout(300)
    boxes = [panels.nth(i).evaluate(_OVERFLOW_JS) for i in range(2)]
    for position, box in enumerate(boxes):
        assert box["overflow"] <= 1 and box["scroll"] <= 1, (
            f"{width}px: panel {position} content is wider than the panel: {box}")
    first, second = boxes
    if width >= 1400:
        assert abs(first["top"] - second["top"]) < 2, f"{width}px: panels not side by side"
    else:
        assert second["top"] >= first["bottom"] - 1, f"{width}px: panels not stacked"
        assert second["width"] > width * 0.6, f"{width}px: a stacked panel is narrow: {second}"
    for map_rows in stepper.locator(".mft-gradmap-rows").all():
        assert map_rows.evaluate("e => e.clientHeight <= parseFloat(getComputedStyle(e)"
                                 ".maxHeight) + 1")  # bounded: it scrolls
    step_button = shared.locator("button.mft-step-button").bounding_box()
    assert 0 <= step_button["y"] and step_button["y"] + step_button["height"] <= 900, (
        f"{width}px: the controls left the view: {step_button}")
    # the screenshot: the whole stepper in view (a taller window, the same width)
    page.set_viewport_size({"width": width, "height": 2000})
    page.wait_for_timeout(300)
    stepper.scroll_into_view_if_needed()
    stepper.screenshot(path=str(ARTIFACTS / f"tape_stepper_two_levels_{width}.png"))
    page.set_viewport_size({"width": width, "height": 900})
    shared.locator("button.mft-first").click()


def _check_slider_room(page, expect, stepper):
    page.set_viewport_size({"width": 800, "height": 900})
    stepper.scroll_into_view_if_needed()
    expect(stepper.locator(".mft-panel-view .mft-title")).to_contain_text("30 entries")
    track = stepper.locator(".mft-slider .slider-container")
    steps = 30
    room = track.bounding_box()["width"] / steps
    assert room >= MIN_STEP_PX, f"the slider gives each of {steps} steps {room:.1f} px"
    stepper.locator("button.mft-last").click()
    expect(stepper.locator(".mft-slider .widget-readout")).to_have_text(str(steps))


def _check_stepper(page, expect, stepper):
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
