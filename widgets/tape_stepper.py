"""TapeStepper: step through the backward pass of one or more tapes in a notebook.

The numbers come from the view model (``tape_view.py``); this module only lays them out as
ipywidgets and HTML.

NOTE [What runs where]
Each panel's Play widget and step slider are joined with ``ipywidgets.jslink``, and so are the
speed slider and the Play interval: while playing, the front end advances the slider itself,
with no kernel round trip per tick. The slider's new value is synced to the kernel, which
renders the panel's HTML for that step (the rows, the cotangent, the gradient map are Python
values, so rendering needs the kernel; it touches only a window of rows, see tape_view.py).
The buttons set the slider's value from Python. With several levels and "step together"
checked, the shared slider drives every panel's slider through a Python observer: a panel
with fewer steps stops at its last one (a jslink cannot clamp to another slider's range).

NOTE [A layout that fits]
A stepper has to stay readable in a narrow notebook (800 px) as in a wide one, with two
levels and a tape of tens of entries:
- text wraps (``pre-wrap`` and ``overflow-wrap: anywhere``) instead of running past its
  panel, so no panel is wider than its box; names, types and row numbers do not break;
- the panels of several levels sit side by side in a wrapping flex row, each at least
  ``PANEL_MIN_WIDTH`` wide: where two do not fit, they stack;
- while the panels step together there is one control bar, the shared one; the panels' own
  bars appear only when "step together" is off (and the shared one goes);
- the gradient map is a bounded box that scrolls, so the controls above it stay in view
  however many names it holds; its rows come in the order of their latest update and the box
  starts scrolled to its end (a ``column-reverse`` flex box), so the names the current step
  updated are in view; the tape shows a window of ``radius`` rows either side of
  the current entry;
- the step slider has a line of its own, the whole width of the bar, so that each step of a
  30-entry tape keeps room to be picked;
- a legend says what the row marks mean.

NOTE [Escaping]
Every name and value reaches the HTML through ``html.escape`` (``_e`` below), so a tensor
labelled ``<b>x</b>`` shows as text. The only things read back from the front end are the
sliders' integers and the checkboxes' booleans (validated by traitlets); nothing sent from
the front end is evaluated.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from minifunctorch.core import Tape, TransformUsageError

from . import tape_view

__all__ = ["TapeStepper", "TapePanel", "render_panel_html"]


def _e(value) -> str:
    return html.escape(str(value), quote=True)


_STYLE = """<style>
.mft-view { font-family: var(--jp-code-font-family, monospace); font-size: 12px;
  line-height: 1.4; color: var(--jp-content-font-color1, #111); }
.mft-view ul { margin: 0; padding-left: 1.5em; }
.mft-view .mft-title { font-weight: bold; margin-bottom: 2px; }
.mft-view .mft-step { margin: 2px 0 4px 0; }
.mft-view table { border-collapse: collapse; margin: 2px 0; }
.mft-view table { max-width: 100%; }
.mft-view td { padding: 1px 6px; white-space: pre-wrap; overflow-wrap: anywhere;
  text-align: left; vertical-align: top; }
.mft-view td.mft-mark, .mft-view td.mft-index, .mft-view td.mft-name,
.mft-view td.mft-type { white-space: nowrap; }
.mft-view td.mft-sources { overflow-wrap: normal; }
.mft-view .mft-step, .mft-view .mft-detail, .mft-view .mft-title { overflow-wrap: anywhere; }
.mft-view .mft-row td.mft-index { color: var(--jp-content-font-color2, #666); }
.mft-view .mft-current { background: var(--jp-warn-color3, #ffe9a8); font-weight: bold;
  outline: 1px solid var(--jp-warn-color1, #e0a000); }
.mft-view .mft-seed { background: var(--jp-info-color3, #d7ecff); }
.mft-view .mft-done { color: var(--jp-content-font-color2, #666); }
.mft-view .mft-skipped { color: var(--jp-content-font-color3, #999); font-style: italic; }
.mft-view .mft-hidden-rows td, .mft-view .mft-more, .mft-view .mft-note {
  color: var(--jp-content-font-color2, #666); font-style: italic; }
.mft-view .mft-detail { border-left: 3px solid var(--jp-warn-color1, #e0a000);
  padding: 2px 6px; margin: 4px 0; }
.mft-view .mft-gradmap { border-top: 1px solid var(--jp-border-color2, #ccc);
  margin-top: 4px; padding-top: 2px; }
.mft-view .mft-gradmap-rows { max-height: 15em; overflow-y: auto; display: flex;
  flex-direction: column-reverse; }
.mft-view .mft-updated { background: var(--jp-success-color3, #d9f2d9); }
.mft-view .mft-fanin td.mft-sources { font-weight: bold; }
</style>"""

_ROW_MARK = {"current": "▶", "seed": "●", "done": "✓", "pending": " ", "skipped": " "}

PANEL_MIN_WIDTH = "460px"  # NOTE [A layout that fits]: below two of these, panels stack

LEGEND_HTML = (
    '<div class="mft-view mft-legend">'
    '<span class="mft-current">▶ being propagated</span> · '
    '<span class="mft-done">✓ done</span> · '
    '<span class="mft-seed">● seed: the loss, dL/dL = 1</span> · '
    '<span class="mft-skipped">grey italic: off the path (no gradient flows back through '
    'it)</span></div>')


def render_panel_html(tape, step: int, *, title: str = "", radius: int = 8,
                      max_names: int = 20, backward_pass: int = -1) -> str:
    """The HTML of one panel at ``step``: the step, the window of forward rows (the entry being
    propagated has class ``mft-current``), the cotangent and contributions, and the gradient map
    (class ``mft-gradmap``). Every name and value is escaped.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> a = label(torch.ones(2), "<b>a</b>")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.sin(a)), [a])
    >>> page = render_panel_html(d.tape, 2)
    >>> page.count('class="mft-row'), "&lt;b&gt;a&lt;/b&gt;" in page, "<b>a</b>" in page
    (2, True, False)
    """
    steps = tape_view.steps_of(tape, backward_pass)
    parts = [_STYLE, '<div class="mft-view">']
    heading = title or f"{tape.level_name} tape"
    parts.append(f'<div class="mft-title">{_e(heading)} '
                 f'<span class="mft-note">({len(tape.entries)} entries)</span></div>')
    view = None
    if steps:
        view = tape_view.step_view(tape, step, backward_pass)
        parts.append(f'<div class="mft-step" data-step="{view.step}">{_e(view.title)}</div>')
    else:
        parts.append('<div class="mft-step mft-no-backward" data-step="0">no backward pass '
                     'recorded: this is the forward tape only</div>')

    window = tape_view.row_window(tape, step if steps else None, radius, backward_pass)
    parts.append('<table class="mft-tape">')
    if window.hidden_above:
        parts.append(f'<tr class="mft-hidden-rows"><td colspan="3">… {window.hidden_above} '
                     'earlier entries</td></tr>')
    for row in window.rows:
        parts.append(f'<tr class="mft-row mft-{row.state}" data-index="{row.index}">'
                     f'<td class="mft-mark">{_ROW_MARK[row.state]}</td>'
                     f'<td class="mft-index">{row.index}</td>'
                     f'<td class="mft-eq">{_e(row.text)}</td></tr>')
    if window.hidden_below:
        parts.append(f'<tr class="mft-hidden-rows"><td colspan="3">… {window.hidden_below} '
                     'later entries</td></tr>')
    if not tape.entries:
        parts.append('<tr class="mft-hidden-rows"><td colspan="3">(empty tape)</td></tr>')
    parts.append("</table>")

    if view is not None:
        parts.append('<div class="mft-detail">')
        if view.cotangent is not None:
            parts.append(f'<div class="mft-cotangent">incoming {_e(view.cotangent)}</div>')
        label = "seed" if view.is_seed else "contributions"
        items = "".join(
            f'<li class="mft-contribution{" mft-fanin" if c.fan_in else ""}" '
            f'data-name="{_e(c.name)}">{_e(c.text)}</li>' for c in view.contributions)
        if not items:
            items = '<li class="mft-note">none (every input is a constant)</li>'
        parts.append(f'<div>{label}:</div><ul class="mft-contributions">{items}</ul></div>')

        gradients = tape_view.gradient_map_view(tape, step, max_names, backward_pass)
        final = " (final)" if step == len(steps) - 1 else ""
        parts.append(f'<div class="mft-gradmap"><div>gradient map after step {step}{final}, '
                     'latest updates last:</div><div class="mft-gradmap-rows"><table>')
        # the box scrolls and starts at its end (NOTE [A layout that fits]): the names this
        # step updated come last, so that they are the ones in view
        step_of = {s.index: position for position, s in enumerate(steps)}
        latest = [step_of.get(row.sources[-1], 0) for row in gradients.rows]
        for _, row in sorted(zip(latest, gradients.rows), key=lambda pair: pair[0]):
            classes = "mft-grad-row" + (" mft-updated" if row.updated else "") + (
                " mft-fanin" if row.fan_in else "")
            parts.append(f'<tr class="{classes}" data-name="{_e(row.name)}">'
                         f'<td class="mft-name">{_e(row.name)}</td>'
                         f'<td class="mft-type">{_e(row.value_type)}</td>'
                         f'<td class="mft-value">{_e(row.preview)}</td>'
                         f'<td class="mft-sources">{_e(row.sources_text)}</td></tr>')
        parts.append("</table></div>")
        if gradients.hidden:
            parts.append(f'<div class="mft-more">{_e(gradients.more_text)}</div>')
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


class _Controls:
    """first / back / step / last buttons, Play with a speed setting, and the step slider."""

    def __init__(self, last: int):
        def button(description, icon, tooltip, css):
            b = widgets.Button(description=description, icon=icon, tooltip=tooltip,
                               layout=widgets.Layout(width="auto"))
            b.add_class(css)
            return b

        self.first_button = button("first", "fast-backward", "the seed (step 0)", "mft-first")
        self.back_button = button("back", "step-backward", "one step back", "mft-back")
        self.step_button = button("step", "step-forward", "one step forward", "mft-step-button")
        self.last_button = button("last", "fast-forward", "the final gradients", "mft-last")
        self.play = widgets.Play(value=0, min=0, max=last, interval=400, show_repeat=False,
                                 description="play")
        self.play.add_class("mft-play")
        self.speed = widgets.IntSlider(value=400, min=50, max=2000, step=50,
                                       description="ms/step", continuous_update=False,
                                       layout=widgets.Layout(width="220px"))
        self.speed.add_class("mft-speed")
        self.slider = widgets.IntSlider(value=0, min=0, max=last, description="step",
                                        layout=widgets.Layout(flex="1 1 100%", min_width="240px"))
        self.slider.add_class("mft-slider")
        self.links = [widgets.jslink((self.play, "value"), (self.slider, "value")),
                      widgets.jslink((self.speed, "value"), (self.play, "interval"))]
        self.first_button.on_click(lambda _: self.go(0))
        self.back_button.on_click(lambda _: self.go(self.slider.value - 1))
        self.step_button.on_click(lambda _: self.go(self.slider.value + 1))
        self.last_button.on_click(lambda _: self.go(self.slider.max))
        self.box = widgets.HBox([self.first_button, self.back_button, self.step_button,
                                 self.last_button, self.play, self.speed, self.slider],
                                layout=widgets.Layout(flex_flow="row wrap", width="100%"))
        self.box.add_class("mft-controls")
        self.set_disabled(last == 0)

    def show(self, shown: bool) -> None:
        """Show or hide the whole bar (NOTE [A layout that fits]: one bar at a time)."""
        self.box.layout.display = None if shown else "none"

    def go(self, step: int) -> None:
        self.slider.value = max(self.slider.min, min(self.slider.max, int(step)))

    def set_disabled(self, disabled: bool) -> None:
        for w in (self.first_button, self.back_button, self.step_button, self.last_button,
                  self.play, self.speed, self.slider):
            w.disabled = disabled


class TapePanel(widgets.VBox):
    """One tape: its controls above its rendered view (built by :class:`TapeStepper`).

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> a = label(torch.ones(2), "a")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.sin(a)), [a])
    >>> panel = TapePanel(d.tape)
    >>> panel.controls.step_button.click(); panel.step
    1
    """

    def __init__(self, tape, *, title: str = "", radius: int = 8, max_names: int = 20,
                 backward_pass: int = -1, side_by_side: bool = False):
        self.tape = tape
        self.title = title
        self.radius = radius
        self.max_names = max_names
        self.backward_pass = backward_pass
        self.last = max(tape_view.step_count(tape, backward_pass) - 1, 0)
        self.controls = _Controls(self.last)
        self.view = widgets.HTML()
        self.view.add_class("mft-panel-view")
        # side by side in the stepper's wrapping row, panels share its width; where two
        # would be narrower than PANEL_MIN_WIDTH they stack (NOTE [A layout that fits])
        super().__init__([self.controls.box, self.view],
                         layout=widgets.Layout(flex=f"1 1 {PANEL_MIN_WIDTH}", min_width="0",
                                               padding="0 6px", margin="0 0 8px 0")
                         if side_by_side else widgets.Layout(padding="0 6px"))
        self.add_class("mft-panel")
        self.controls.slider.observe(self._on_step, names="value")
        self.render()

    @property
    def step(self) -> int:
        return self.controls.slider.value

    def _on_step(self, change) -> None:
        self.render()

    def render(self) -> None:
        self.view.value = render_panel_html(self.tape, self.step, title=self.title,
                                            radius=self.radius, max_names=self.max_names,
                                            backward_pass=self.backward_pass)


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _a(type_name: str) -> str:
    return ("an " if type_name[:1].lower() in "aeiou" else "a ") + type_name


def _usage_error(argument, got: str, fix: str) -> TransformUsageError:
    return TransformUsageError(
        f"TapeStepper({_short_repr(argument)}): expected a Tape or a list of Tapes (from "
        f"`with capture_tapes() as tapes:` or an Autograd level's `.tape`), got {got}. "
        f"Fix: {fix}"
    )


def _tapes_from(tape_or_tapes) -> list:
    if isinstance(tape_or_tapes, Tape):
        return [tape_or_tapes]
    if isinstance(getattr(tape_or_tapes, "tape", None), Tape):
        raise _usage_error(tape_or_tapes, f"{_a(type(tape_or_tapes).__name__)} level",
                           "pass its tape, TapeStepper(d.tape).")
    if isinstance(tape_or_tapes, (list, tuple)):
        if not tape_or_tapes:
            raise _usage_error(
                tape_or_tapes, "an empty list", "run the grad (or d.grad) call inside "
                "`with capture_tapes() as tapes:` so that it records a tape, then pass `tapes`.")
        for position, item in enumerate(tape_or_tapes):
            if not isinstance(item, Tape):
                raise _usage_error(
                    tape_or_tapes, f"a list whose item {position} is {_a(type(item).__name__)}",
                    "pass only Tape objects, e.g. the list from capture_tapes().")
        return list(tape_or_tapes)
    raise _usage_error(tape_or_tapes, _a(type(tape_or_tapes).__name__),
                       "pass the list from `with capture_tapes() as tapes:` or `d.tape`.")


class TapeStepper(widgets.VBox):
    """Step through the backward pass of a tape, or of several levels' tapes side by side.

    Each panel shows the forward tape (a window of rows around the entry being propagated,
    highlighted), the incoming cotangent, the contribution to each input, and the gradient
    map so far with the entries that accumulated into each name (``b ← entry 1 + entry 0``).
    Step 0 is the seed; the last step shows the final gradients. Given several tapes (one per
    Autograd level, outermost first, as ``capture_tapes`` lists them) there is one panel per
    level, stepping together through a shared slider or separately ("step together").

    >>> import torch
    >>> from minifunctorch.core import capture_tapes, grad
    >>> with capture_tapes() as tapes:
    ...     g = grad(lambda x: (x.sin() * x).sum())(torch.ones(3))
    >>> stepper = TapeStepper(tapes)
    >>> stepper.last_button.click()
    >>> stepper.panels[0].step, stepper.panels[0].last
    (3, 3)
    >>> print(stepper.text().splitlines()[0])
    Autograd tape: 3 entries, backward pass 1 of 1 (4 steps)

    Parameters: ``radius`` rows shown either side of the current entry, ``max_names`` names in
    the gradient-map preview, ``backward_pass`` which pass of each tape (the last by default).
    """

    def __init__(self, tape_or_tapes, *, radius: int = 8, max_names: int = 20,
                 backward_pass: int = -1):
        tapes = _tapes_from(tape_or_tapes)
        if not isinstance(radius, int) or radius < 0:
            raise TransformUsageError(
                f"TapeStepper(tapes, radius={radius!r}): expected a whole number of rows >= 0, "
                f"got {radius!r}. Fix: e.g. radius=15.")
        if not isinstance(max_names, int) or max_names < 1:
            raise TransformUsageError(
                f"TapeStepper(tapes, max_names={max_names!r}): expected a whole number >= 1, "
                f"got {max_names!r}. Fix: e.g. max_names=20.")
        for position, tape in enumerate(tapes):
            count = len(tape.passes)
            if count and not (isinstance(backward_pass, int) and -count <= backward_pass < count):
                raise TransformUsageError(
                    f"TapeStepper(tapes, backward_pass={backward_pass!r}): expected the index "
                    f"of a recorded backward pass, got {backward_pass!r}, but tape {position} "
                    f"has {count} pass{'es' if count != 1 else ''}. Fix: pass an index from "
                    f"{-count} to {count - 1}, or leave it out for the most recent pass.")
        self.tapes = tapes
        self.backward_pass = backward_pass
        several = len(tapes) > 1
        self.panels = [
            TapePanel(tape, title=self._title(position, tape) if several else "",
                      radius=radius, max_names=max_names, backward_pass=backward_pass,
                      side_by_side=several)
            for position, tape in enumerate(tapes)
        ]
        legend = widgets.HTML(_STYLE + LEGEND_HTML)
        if not several:
            self.controls = self.panels[0].controls
            self.together = None
            super().__init__([legend, self.panels[0]])
        else:
            self.controls = _Controls(max(panel.last for panel in self.panels))
            self.controls.box.add_class("mft-shared-controls")
            self.together = widgets.Checkbox(value=True, description="step together",
                                             indent=False, layout=widgets.Layout(width="auto"))
            self.together.add_class("mft-together")
            self.controls.slider.observe(self._on_shared_step, names="value")
            self.together.observe(self._on_together, names="value")
            panels = widgets.HBox(self.panels, layout=widgets.Layout(width="100%",
                                                                     flex_flow="row wrap"))
            panels.add_class("mft-panels")
            super().__init__([legend, self.together, self.controls.box, panels])
            self._apply_together(True)
        self.add_class("mft-stepper")

    def _title(self, position, tape):
        """``Autograd1 tape · outer``: the tapes come outermost first (capture_tapes' order).
        The convention of the course: levels are numbered up from Torch (level 0), so an outer
        transform has a lower level number than the ones nested inside it."""
        count = len(self.tapes)
        where = "outer" if position == 0 else "inner" if position == count - 1 else (
            f"middle {position} of {count - 2}" if count > 3 else "middle")
        return f"{tape.level_name} tape · {where}"

    # --- the shared controls (several levels) ---------------------------------------------------
    def _on_shared_step(self, change) -> None:
        if self.together is not None and self.together.value:
            for panel in self.panels:
                panel.controls.go(change["new"])

    def _on_together(self, change) -> None:
        self._apply_together(bool(change["new"]))

    def _apply_together(self, together: bool) -> None:
        """One control bar at a time (NOTE [A layout that fits]): the shared one while the
        panels step together, each panel's own otherwise."""
        self.controls.set_disabled(not together)
        self.controls.show(together)
        for panel in self.panels:
            panel.controls.set_disabled(together or panel.last == 0)
            panel.controls.show(not together)
            if together:
                panel.controls.go(self.controls.slider.value)

    # --- shortcuts to the controls that drive every panel ----------------------------------------
    @property
    def first_button(self):
        return self.controls.first_button

    @property
    def back_button(self):
        return self.controls.back_button

    @property
    def step_button(self):
        return self.controls.step_button

    @property
    def last_button(self):
        return self.controls.last_button

    @property
    def play(self):
        return self.controls.play

    @property
    def speed(self):
        return self.controls.speed

    @property
    def slider(self):
        return self.controls.slider

    # --- static forms ---------------------------------------------------------------------------
    def text(self) -> str:
        """The static plain-text form: each tape's forward entries and final gradient map."""
        several = len(self.tapes) > 1
        return "\n\n".join(
            tape_view.tape_text(tape, title=self._title(position, tape) if several else None,
                                backward_pass=self.backward_pass)
            for position, tape in enumerate(self.tapes))

    def _repr_mimebundle_(self, **kwargs):
        # NOTE [A readable form without a kernel]: ipywidgets' bundle (the widget view) plus a
        # deterministic text/plain, which nbval and GitHub show where no kernel runs.
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self.text()
        return data

    def __repr__(self):
        return f"<TapeStepper: {len(self.tapes)} tape{'s' if len(self.tapes) != 1 else ''}>"
