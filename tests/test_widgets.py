"""The tape stepper widget, without a browser: buttons, the slider, the gradient map, several
levels, escaping, large tapes, and the static text form."""
import html
import re
import subprocess
import sys
import time

import pytest
import torch

from minifunctorch.core import (
    Autograd,
    Tape,
    Torch,
    TransformError,
    TransformUsageError,
    capture_tapes,
    grad,
    label,
)
from minifunctorch.widgets import TapeStepper, tape_stepper, tape_view

ROW = re.compile(r'<tr class="mft-row ([^"]*)" data-index="(\d+)">')
GRAD_ROW = re.compile(r'<tr class="mft-grad-row[^"]*" data-name="([^"]*)">.*?'
                      r'<td class="mft-sources">([^<]*)</td>')


def simple(a, b):
    return ((a + b) * b).sum()


def inputs():
    return (label(torch.tensor([1.0, 2.0, 3.0, 4.0]), "a"),
            label(torch.tensor([0.5, -1.0, 2.0, 0.25]), "b"))


def simple_stepper():
    a, b = inputs()
    with capture_tapes() as tapes:
        grads = grad(simple, argnums=(0, 1))(a, b)
    return TapeStepper(tapes), tapes, grads, (a, b)


def highlighted(page):
    """Entry indices rendered with class mft-current."""
    return [int(index) for classes, index in ROW.findall(page) if "mft-current" in classes.split()]


def rendered_gradient_map(page):
    """name -> 'name ← entry i + entry j' as rendered."""
    return {html.unescape(name): html.unescape(sources) for name, sources in GRAD_ROW.findall(page)}


def expected_gradient_map(tape, step):
    """The same text, computed straight from tape.gradient_map."""
    expected = {}
    for name, (_, sources) in tape.gradient_map(step).items():
        parts = ["seed" if s == "seed" else f"entry {s}" for s in sources]
        expected[name] = f"{name} ← " + " + ".join(parts)
    return expected


def check_panel_at(panel, tape, step):
    page = panel.view.value
    assert panel.step == step
    assert f'data-step="{step}"' in page
    index = tape.steps[step].index
    assert highlighted(page) == ([] if index is None else [index])
    assert rendered_gradient_map(page) == expected_gradient_map(tape, step)


def as_tensor(value):
    while not isinstance(value, torch.Tensor):
        value = value.payload
    return value


# --- buttons and the slider ---------------------------------------------------------------------
def test_buttons_step_through_the_tape_steps():
    stepper, (tape,), _, _ = simple_stepper()
    panel = stepper.panels[0]
    assert len(stepper.panels) == 1 and len(tape.steps) == 4
    check_panel_at(panel, tape, 0)
    assert "seed dv2/dv2 = 1" in panel.view.value
    for step in range(1, 4):
        stepper.step_button.click()
        check_panel_at(panel, tape, step)
    stepper.step_button.click()  # past the end: stays on the last step
    check_panel_at(panel, tape, 3)
    stepper.back_button.click()
    check_panel_at(panel, tape, 2)
    stepper.first_button.click()
    check_panel_at(panel, tape, 0)
    stepper.back_button.click()  # before the seed: stays on it
    check_panel_at(panel, tape, 0)
    stepper.last_button.click()
    check_panel_at(panel, tape, 3)


def test_slider_set_state_from_the_front_end():
    stepper, (tape,), _, _ = simple_stepper()
    panel = stepper.panels[0]
    for step in (2, 0, 3, 1):
        stepper.slider.set_state({"value": step})
        check_panel_at(panel, tape, step)


def test_step_shows_cotangent_contributions_and_fan_in():
    stepper, (tape,), _, _ = simple_stepper()
    stepper.slider.set_state({"value": 3})  # entry 0: v0 = add a b, b already has a gradient
    page = stepper.panels[0].view.value
    step = tape.steps[3]
    assert step.entry.format() == "v0:f32[4] = add a b"
    assert "incoming ct(v0): f32[4] = [0.5, -1, 2, 0.25]" in page
    assert 'class="mft-contribution" data-name="a">a += [0.5, -1, 2, 0.25]</li>' in page
    assert 'class="mft-contribution mft-fanin" data-name="b"' in page
    assert "b ← entry 1 + entry 0" in page
    assert "(final)" in page


def test_play_and_speed_are_jslinked_to_the_slider():
    stepper, _, _, _ = simple_stepper()
    controls = stepper.controls
    links = {(link.source[0], link.source[1], link.target[0], link.target[1])
             for link in controls.links}
    assert (controls.play, "value", controls.slider, "value") in links
    assert (controls.speed, "value", controls.play, "interval") in links
    assert controls.play.max == controls.slider.max == 3


# --- final gradients -----------------------------------------------------------------------------
def test_final_gradient_map_equals_grad_and_torch_func():
    stepper, (tape,), (grad_a, grad_b), (a, b) = simple_stepper()
    final = tape.gradient_map()
    reference = torch.func.grad(simple, argnums=(0, 1))(a, b)
    torch.testing.assert_close(as_tensor(final["a"][0]), grad_a)
    torch.testing.assert_close(as_tensor(final["b"][0]), grad_b)
    torch.testing.assert_close(grad_a, reference[0])
    torch.testing.assert_close(grad_b, reference[1])
    stepper.last_button.click()
    page = stepper.panels[0].view.value
    gradient_rows = dict(re.findall(
        r'data-name="([^"]*)"><td class="mft-name">[^<]*</td><td class="mft-type">[^<]*</td>'
        r'<td class="mft-value">([^<]*)</td>', page))
    assert gradient_rows["a"] == tape_view.preview(reference[0])
    assert gradient_rows["b"] == tape_view.preview(reference[1])


def test_explicit_api_tape():
    a, b = inputs()
    d = Autograd(Torch())
    loss = d.sum(d.mul(d.add(a, b), b), name="L")
    da, db = d.grad(loss, [a, b])
    stepper = TapeStepper(d.tape)
    assert "seed dL/dL = 1" in stepper.panels[0].view.value
    for step in range(len(d.tape.steps)):
        stepper.slider.set_state({"value": step})
        check_panel_at(stepper.panels[0], d.tape, step)
    torch.testing.assert_close(d.tape.gradient_map()["b"][0], db)


def test_no_backward_pass_shows_the_forward_tape():
    a, _ = inputs()
    d = Autograd(Torch(), record_steps=False)
    d.sum(d.sin(a))
    stepper = TapeStepper(d.tape)
    page = stepper.panels[0].view.value
    assert "no backward pass recorded" in page
    assert len(ROW.findall(page)) == 2 and highlighted(page) == []
    assert stepper.slider.max == 0 and stepper.step_button.disabled
    stepper.step_button.click()
    assert stepper.panels[0].step == 0
    assert "no backward pass recorded" in stepper.text()


# --- escaping ------------------------------------------------------------------------------------
def test_names_are_escaped():
    x = label(torch.tensor([1.0, 2.0]), "<b>x</b>")
    y = label(torch.tensor([3.0, 4.0]), 'y" onmouseover="alert(1)')
    with capture_tapes() as tapes:
        grad(lambda x, y: (x * y).sum(), argnums=(0, 1))(x, y)
    stepper = TapeStepper(tapes)
    for step in range(len(tapes[0].steps)):
        stepper.slider.set_state({"value": step})
        page = stepper.panels[0].view.value
        assert "<b>" not in page
        assert 'onmouseover="' not in page
        assert "&lt;b&gt;x&lt;/b&gt;" in page
    assert 'data-name="y&quot; onmouseover=&quot;alert(1)"' in page
    assert rendered_gradient_map(page)["<b>x</b>"] == "<b>x</b> ← entry 0"
    assert "<b>x</b>" in stepper.text()  # plain text stays as written


# --- several levels ------------------------------------------------------------------------------
def stacked_levels():
    x = label(torch.tensor([0.5, 1.5]), "x")
    with capture_tapes() as tapes:
        inner = Autograd(Torch(), name="inner")
        outer = Autograd(inner, name="outer")
        loss = outer.sum(outer.mul(outer.sin(x), x), name="L")
        (gx,) = outer.grad(loss, [x])
        (ggx,) = inner.grad(inner.sum(gx, name="L2"), [x])
    return tapes, ggx, x


def test_two_stacked_levels_give_two_panels_create_graph_one():
    tapes, ggx, x = stacked_levels()
    assert len(TapeStepper(tapes).panels) == 2

    d = Autograd(Torch(), create_graph=True)
    (gx,) = d.grad(d.sum(d.mul(d.sin(x), x), name="L"), [x])
    (ggx_one_tape,) = d.grad(d.sum(gx, name="L2"), [x])
    stepper = TapeStepper([d.tape])
    assert len(stepper.panels) == 1 and stepper.together is None
    stepper.last_button.click()  # values there are AutogradTensors: previews unwrap them
    assert "x ← entry" in stepper.panels[0].view.value

    expected = torch.func.grad(lambda v: torch.func.grad(lambda u: (u.sin() * u).sum())(v).sum())(x)
    torch.testing.assert_close(as_tensor(ggx), expected)
    torch.testing.assert_close(as_tensor(ggx_one_tape), expected)
    torch.testing.assert_close(as_tensor(tapes[0].gradient_map()["x"][0]), expected)


def test_nested_grad_panels_step_together_and_separately():
    with capture_tapes() as tapes:
        grad(grad(lambda x: (x.sin() * x).sum()))(torch.tensor(0.5))
    stepper = TapeStepper(tapes)
    outer, inner = stepper.panels
    assert (outer.last, inner.last) == (6, 3)
    assert stepper.slider.max == 6 and stepper.together.value
    assert "Autograd tape · outer" in outer.view.value
    assert "Autograd tape · inner" in inner.view.value
    assert outer.controls.step_button.disabled and not stepper.step_button.disabled
    assert visible_bars(stepper) == [stepper.controls]  # one bar while stepping together

    stepper.step_button.click()
    stepper.step_button.click()
    check_panel_at(outer, tapes[0], 2)
    check_panel_at(inner, tapes[1], 2)
    stepper.slider.set_state({"value": 5})  # the inner tape stops at its last step
    check_panel_at(outer, tapes[0], 5)
    check_panel_at(inner, tapes[1], 3)

    stepper.together.set_state({"value": False})
    assert stepper.step_button.disabled and not inner.controls.step_button.disabled
    assert visible_bars(stepper) == [outer.controls, inner.controls]
    inner.controls.first_button.click()
    check_panel_at(inner, tapes[1], 0)
    check_panel_at(outer, tapes[0], 5)
    outer.controls.step_button.click()
    check_panel_at(outer, tapes[0], 6)
    check_panel_at(inner, tapes[1], 0)

    stepper.together.set_state({"value": True})  # back in step with the shared slider
    check_panel_at(outer, tapes[0], 5)
    check_panel_at(inner, tapes[1], 3)
    text = stepper.text()
    assert text.count("final gradient map:") == 2 and "Autograd tape · inner" in text
    assert visible_bars(stepper) == [stepper.controls]


def visible_bars(stepper):
    """The control bars shown (a hidden one has display none)."""
    bars = [stepper.controls] + [panel.controls for panel in stepper.panels]
    unique = list(dict.fromkeys(bars))
    return [bar for bar in unique if bar.box.layout.display != "none"]


def test_three_levels_are_labelled_outer_middle_inner():
    with capture_tapes() as tapes:
        grad(grad(grad(lambda x: (x.sin() * x).sum())))(torch.tensor(0.5))
    titles = [panel.title for panel in TapeStepper(tapes).panels]
    assert titles == ["Autograd tape · outer", "Autograd tape · middle", "Autograd tape · inner"]


# --- layout: what keeps the stepper readable at 800 px and at 1400 px (tests/test_browser.py
# checks it in a browser) -------------------------------------------------------------------------
def test_panels_wrap_and_stack_below_their_minimum_width():
    with capture_tapes() as tapes:
        grad(grad(lambda x: (x.sin() * x).sum()))(torch.tensor(0.5))
    stepper = TapeStepper(tapes)
    (row,) = [child for child in stepper.children if "mft-panels" in child._dom_classes]
    assert row.layout.flex_flow == "row wrap"
    for panel in stepper.panels:
        assert panel.layout.flex == f"1 1 {tape_stepper.PANEL_MIN_WIDTH}"
        assert panel.layout.min_width == "0"


def test_text_wraps_and_the_gradient_map_scrolls():
    stepper, (tape,), _, _ = simple_stepper()
    page = stepper.panels[0].view.value
    assert "white-space: pre-wrap" in page and "overflow-wrap: anywhere" in page
    assert "white-space: pre;" not in page
    rows = re.search(r'<div class="mft-gradmap-rows"><table>.*?</table></div>', page)
    assert rows and 'data-name="a"' not in rows.group(0)  # step 0: only the seed so far
    style = re.search(r"\.mft-gradmap-rows \{([^}]*)\}", page).group(1)
    assert "max-height" in style and "overflow-y: auto" in style
    assert "column-reverse" in style  # starts scrolled to the newest rows


def test_the_gradient_map_shows_the_latest_updates_last():
    x = label(torch.tensor([0.5, 1.0]), "x")
    with capture_tapes() as tapes:  # y = sin(x); z = x * y: x arrives before y, then again
        grad(lambda x: (x * torch.sin(x)).sum())(x)
    stepper = TapeStepper(tapes)
    stepper.last_button.click()
    page = stepper.panels[0].view.value
    shown = [html.unescape(name) for name, _ in GRAD_ROW.findall(page)]
    arrival = [row.name for row in tape_view.gradient_map_view(tapes[0]).rows]
    assert arrival[-2:] == ["x", "v0"] and shown[-2:] == ["v0", "x"]  # x: updated at the end
    assert "latest updates last" in page


def test_legend_explains_the_row_marks():
    stepper, _, _, _ = simple_stepper()
    legend = stepper.children[0].value
    for mark in ("▶ being propagated", "✓ done", "● seed", "off the path"):
        assert mark in legend
    for state in ("current", "done", "seed", "skipped"):
        assert f'class="mft-{state}"' in legend


def test_the_slider_has_a_line_of_its_own():
    stepper, _, _, _ = simple_stepper()
    assert stepper.slider.layout.flex == "1 1 100%"
    assert stepper.controls.box.layout.flex_flow == "row wrap"


# --- large tapes ---------------------------------------------------------------------------------
def test_thousand_entry_tape_opens_and_steps_quickly_in_a_window():
    def chain(x):
        for _ in range(999):
            x = torch.sin(x)
        return x.sum()

    x = torch.linspace(0.1, 1.0, 8)
    with capture_tapes() as tapes:
        g = grad(chain)(x)
    (tape,) = tapes
    assert len(tape) == 1000 and len(tape.steps) == 1001

    start = time.perf_counter()
    stepper = TapeStepper(tapes)
    opened = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(20):
        stepper.step_button.click()
    for step in (500, 999, 1000, 3):
        stepper.slider.set_state({"value": step})
    stepper.last_button.click()
    stepped = (time.perf_counter() - start) / 25
    assert opened < 2.0, f"opening took {opened:.2f} s"
    assert stepped < 0.2, f"a step took {stepped:.3f} s"

    panel = stepper.panels[0]
    for step in (0, 1, 500, 1000):
        stepper.slider.set_state({"value": step})
        page = panel.view.value
        assert len(ROW.findall(page)) <= 31, "only a window of rows is rendered"
        assert len(GRAD_ROW.findall(page)) <= 20, "the gradient map preview is capped"
        assert highlighted(page) == ([] if step == 0 else [tape.steps[step].index])
    assert "... and 981 more" in page and "earlier entries" not in page
    assert "later entries" in page
    assert rendered_gradient_map(page)["v0"] == "v0 ← entry 0"  # the input, still shown
    torch.testing.assert_close(as_tensor(tape.gradient_map()["v0"][0]), g)
    assert len(page) < 20_000
    text = stepper.text()
    assert "... and 800 more entries" in text and "... and 981 more" in text


# --- errors --------------------------------------------------------------------------------------
def test_constructor_errors_say_what_was_expected_and_the_fix():
    with pytest.raises(TransformUsageError, match=r"^TapeStepper\(3\): expected a Tape or a list "
                       r"of Tapes .*got an int\. Fix: pass the list"):
        TapeStepper(3)
    with pytest.raises(TransformUsageError, match=r"^TapeStepper\(\[\]\).*got an empty list\. "
                       r"Fix: run the grad"):
        TapeStepper([])
    with pytest.raises(TransformUsageError, match=r"item 1 is a str\. Fix: pass only Tape"):
        TapeStepper([Tape(), "tape"])
    with pytest.raises(TransformUsageError, match=r"^TapeStepper\(Autograd\(Torch\(\)\)\).*got an "
                       r"Autograd level\. Fix: pass its tape"):
        TapeStepper(Autograd(Torch()))
    with pytest.raises(TransformUsageError, match=r"radius=-1.*Fix"):
        TapeStepper(Tape(), radius=-1)
    with pytest.raises(ValueError):  # TransformUsageError is also a ValueError
        TapeStepper(None)
    assert issubclass(TransformUsageError, TransformError)
    _, (tape,), _, _ = simple_stepper()
    with pytest.raises(TransformUsageError, match=r"backward_pass=3.*has 1 pass\. Fix: pass "
                       r"an index from -1 to 0"):
        TapeStepper(tape, backward_pass=3)
    with pytest.raises(TransformUsageError, match=r"step_view\(tape, 4\): expected a step .*"
                       r"got 4\. Fix: pass a step from 0 \(the seed\) to 3"):
        tape_view.step_view(tape, 4)
    with pytest.raises(TransformUsageError, match=r"gradient_map_view\(tape, -1\).*Fix"):
        tape_view.gradient_map_view(tape, -1)


def test_docstring_examples_run():
    import doctest

    from minifunctorch.widgets import tape_stepper
    for module in (tape_view, tape_stepper):
        failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert tried > 0 and failures == 0, f"{module.__name__}: {failures} of {tried} failed"


# --- static forms --------------------------------------------------------------------------------
EXPECTED_TEXT = """\
Autograd tape: 3 entries, backward pass 1 of 1 (4 steps)
  [0] v0:f32[4] = add a b
  [1] v1:f32[4] = mul v0 b
  [2] v2:f32[] = sum v1 dim=(0,) keepdim=False
final gradient map:
  v2  f32[]   1                   ← seed
  v1  f32[4]  [1, 1, 1, 1]        ← entry 2
  v0  f32[4]  [0.5, -1, 2, 0.25]  ← entry 1
  b   f32[4]  [2, 0, 7, 4.5]      ← entry 1 + entry 0
  a   f32[4]  [0.5, -1, 2, 0.25]  ← entry 0"""


def test_mimebundle_has_widget_view_and_deterministic_text():
    stepper, _, _, _ = simple_stepper()
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == EXPECTED_TEXT
    stepper.step_button.click()  # the text form does not depend on the current step
    again, _, _, _ = simple_stepper()
    assert again._repr_mimebundle_()["text/plain"] == bundle["text/plain"]
    assert "0x" not in bundle["text/plain"]


def test_core_does_not_import_ipywidgets():
    code = ("import sys, minifunctorch.core\n"
            "bad = [m for m in ('ipywidgets', 'IPython') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
