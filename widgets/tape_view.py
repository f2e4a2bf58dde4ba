"""The view model of the tape stepper: what to show at each step of a backward pass.

Pure Python over :class:`~minifunctorch.core.Tape` (no ipywidgets, no HTML), so that every
number the widget shows can be checked without a front end. ``tape_stepper.py`` renders it.

A *step* is a position in ``tape.steps`` (the most recent backward pass by default): step 0
is the seed ``dL/dL = 1``; step ``k`` propagates the cotangent of entry ``tape.steps[k].index``
to that entry's inputs. The gradient map after step ``k`` is ``tape.gradient_map(k)``.

NOTE [Windows and caps keep large tapes cheap]
A 1,000-entry tape must open and step without lag. A step's cost is one pass over the steps
so far (``tape.gradient_map``) plus the formatting of what is shown, and what is shown is
bounded: :func:`row_window` returns only the rows within ``radius`` of the current entry (with
counts of the hidden ones), and :func:`gradient_map_view` previews at most ``max_names``
gradients (the ones updated at this step first, then the most recent), with the number left
out. Tensor values are previewed only for what is shown.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minifunctorch.core import TransformUsageError
from minifunctorch.core.printing import type_string

__all__ = [
    "Contribution", "GradientMapView", "GradientRow", "Row", "RowWindow", "StepView",
    "as_tensor", "gradient_map_view", "preview", "row_window", "sources_text", "step_count",
    "step_view", "steps_of", "tape_text", "value_type",
]


# --- values ----------------------------------------------------------------------------------
def as_tensor(value):
    """The plain torch tensor behind ``value``: engine values and FuncTensors are unwrapped
    through ``.payload``.

    Python numbers (and ``None``) are returned unchanged.

    >>> import torch
    >>> from minifunctorch.core import Autograd, AutogradValue, Torch
    >>> d = Autograd(Torch())
    >>> as_tensor(AutogradValue(d, torch.ones(2)))
    tensor([1., 1.])
    """
    while hasattr(value, "payload"):
        value = value.payload
    return value


def value_type(value) -> str:
    """The type of ``value`` in the notation of programs: ``f32[4]``, ``f32[]``.

    A wrapper value reports the shape its level sees (a batched value hides its batch dims).

    >>> import torch
    >>> value_type(torch.ones(4)), value_type(torch.tensor(1.0)), value_type(2.0)
    ('f32[4]', 'f32[]', 'float')
    """
    if isinstance(value, (bool, int, float, complex)):
        return type(value).__name__
    try:
        return type_string(value.dtype, tuple(value.shape))
    except (AttributeError, TypeError):
        return type(value).__name__


def _format_number(number) -> str:
    if isinstance(number, bool):
        return str(number)
    if isinstance(number, float):
        if math.isnan(number) or math.isinf(number):
            return str(number)
        return f"{number:.4g}"
    if isinstance(number, complex):
        return f"{number.real:.4g}{number.imag:+.4g}j"
    return str(number)


def _nested(values) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(_nested(v) for v in values) + "]"
    return _format_number(values)


def preview(value, max_items: int = 6) -> str:
    """A short, deterministic text of ``value``: 4 significant digits, at most ``max_items``
    numbers (then ``… N more``). Wrapper values are unwrapped first.

    >>> import torch
    >>> preview(torch.tensor([0.5, 1.0, 2.0])), preview(torch.tensor(1.0))
    ('[0.5, 1, 2]', '1')
    >>> preview(torch.arange(10.0), max_items=3)
    '[0, 1, 2, … 7 more]'
    """
    tensor = as_tensor(value)
    if tensor is None:
        return "0 (no gradient)"
    if not isinstance(tensor, torch.Tensor):
        return _format_number(tensor) if isinstance(tensor, (int, float, complex)) else str(tensor)
    tensor = tensor.detach().cpu()
    count = tensor.numel()
    batched = ""
    logical = getattr(value, "shape", None)
    if logical is not None and not isinstance(value, torch.Tensor):
        if math.prod(tuple(logical)) != count:
            batched = "batched "  # the payload carries batch dims the level hides
    if count <= max_items:
        return batched + _nested(tensor.tolist())
    head = tensor.reshape(-1)[:max_items].tolist()
    flat = "flat " if tensor.dim() > 1 else ""
    return (f"{batched}{flat}[" + ", ".join(_format_number(v) for v in head)
            + f", … {count - max_items} more]")


# --- steps -----------------------------------------------------------------------------------
def steps_of(tape, backward_pass: int = -1) -> list:
    """The steps of one backward pass of ``tape`` (the most recent by default; [] if none).

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> d = Autograd(Torch())
    >>> a = label(torch.ones(2), "a")
    >>> _ = d.grad(d.sum(d.sin(a)), [a])
    >>> len(steps_of(d.tape))
    3
    """
    return tape.passes[backward_pass] if tape.passes else []


def step_count(tape, backward_pass: int = -1) -> int:
    """How many steps the stepper has for ``tape``: the seed plus one per propagated entry
    (0 when no backward pass was recorded).

    >>> from minifunctorch.core import Tape
    >>> step_count(Tape())
    0
    """
    return len(steps_of(tape, backward_pass))


def _check_step(tape, step, backward_pass, caller):
    steps = steps_of(tape, backward_pass)
    if not (isinstance(step, int) and 0 <= step < len(steps)):
        if not steps:
            fix = ("run the backward pass inside `with capture_tapes():` (or on an Autograd level "
                   "with record_steps=True) so that its steps are recorded")
        else:
            fix = f"pass a step from 0 (the seed) to {len(steps) - 1} (the final gradients)"
        raise TransformUsageError(
            f"{caller}(tape, {step!r}): expected a step of the tape's backward pass "
            f"({len(steps)} steps recorded), got {step!r}. Fix: {fix}."
        )
    return steps


def _loss_names(steps) -> list:
    return [name for name, _, _ in steps[0].contributions] if steps else []


def _entry_producing(tape, name):
    for index in range(len(tape.entries) - 1, -1, -1):
        if tape.entries[index].output == name:
            return index
    return None


def _is_ones(value) -> bool:
    tensor = as_tensor(value)
    if isinstance(tensor, torch.Tensor):
        return bool(torch.all(tensor.detach() == 1))
    return tensor == 1


@dataclass(frozen=True)
class Contribution:
    """What one step added to one input: ``name += contribution`` giving ``total``."""
    name: str
    value_type: str
    contribution: str
    total: str
    fan_in: bool  # the name already had a gradient: this contribution was summed into it

    @property
    def text(self) -> str:
        summed = f" (fan-in: summed, now {self.total})" if self.fan_in else ""
        return f"{self.name} += {self.contribution}{summed}"


@dataclass(frozen=True)
class StepView:
    """What step ``step`` of ``last + 1`` does (see :func:`step_view`)."""
    step: int
    last: int
    index: int | None          # the entry propagated; None for the seed
    title: str                 # 'step 2 of 3: propagating entry 1' or, for the seed,
                               # 'step 0 of 3: seed dL/dL = 1'
    entry_text: str | None     # the entry in program notation
    cotangent: str | None      # 'ct(v3): f32[4] = [1, 1, 1, 1]'
    contributions: tuple

    @property
    def is_seed(self) -> bool:
        return self.index is None


def step_view(tape, step: int, backward_pass: int = -1) -> StepView:
    """The entry propagated at ``step``, its incoming cotangent, and its contribution to each
    input.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label, reset_names
    >>> reset_names()  # names restart at v0
    >>> a, b = label(torch.ones(2), "a"), label(torch.tensor([2.0, 3.0]), "b")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.mul(a, b), name="L"), [a, b])
    >>> step_view(d.tape, 0).title
    'step 0 of 2: seed dL/dL = 1'
    >>> view = step_view(d.tape, 2)
    >>> view.entry_text, view.cotangent
    ('v0:f32[2] = mul a b', 'ct(v0): f32[2] = [1, 1]')
    >>> [c.text for c in view.contributions]
    ['a += [2, 3]', 'b += [1, 1]']
    """
    steps = _check_step(tape, step, backward_pass, "step_view")
    last = len(steps) - 1
    current = steps[step]
    if current.index is None:
        names = [name for name, _, _ in current.contributions]
        seeds = [value for _, value, _ in current.contributions]
        if len(names) == 1 and _is_ones(seeds[0]):
            what = f"seed d{names[0]}/d{names[0]} = 1"
        else:
            what = "seed " + ", ".join(f"ct({n}) = {preview(v)}" for n, v in zip(names, seeds))
        contributions = tuple(Contribution(n, value_type(v), preview(v), preview(v), False)
                              for n, v in zip(names, seeds))
        return StepView(step, last, None, f"step {step} of {last}: {what}", None, None,
                        contributions)
    entry = current.entry
    seen = set()
    for position in range(step):
        seen.update(name for name, _, _ in steps[position].contributions)
    contributions = []
    for name, contribution, total in current.contributions:
        contributions.append(Contribution(name, value_type(contribution), preview(contribution),
                                          preview(total), name in seen))
        seen.add(name)
    incoming = current.cotangent
    cotangent = f"ct({entry.output}): {value_type(incoming)} = {preview(incoming)}"
    title = f"step {step} of {last}: propagating entry {current.index}"
    return StepView(step, last, current.index, title, entry.format(), cotangent,
                    tuple(contributions))


# --- the forward tape, as a window of rows ------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One forward entry: ``state`` is 'current' (being propagated), 'seed' (the loss, at step
    0), 'done' (already propagated), 'pending' (will be), or 'skipped' (no cotangent reaches it
    in this pass)."""
    index: int
    text: str
    state: str


@dataclass(frozen=True)
class RowWindow:
    rows: tuple
    hidden_above: int
    hidden_below: int


def _window_bounds(center, count, radius):
    start, stop = max(0, center - radius), min(count, center + radius + 1)
    missing = 2 * radius + 1 - (stop - start)  # keep the window's size near either end
    if start == 0:
        stop = min(count, stop + missing)
    elif stop == count:
        start = max(0, start - missing)
    return start, stop


def row_window(tape, step: int | None, radius: int = 15, backward_pass: int = -1) -> RowWindow:
    """The forward entries within ``radius`` rows of the entry propagated at ``step``.

    ``step=None`` (or a tape without a backward pass) centres on the last entry and marks
    nothing.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> a = label(torch.ones(2), "a")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.sin(d.exp(a))), [a])
    >>> [(r.index, r.state) for r in row_window(d.tape, 2).rows]
    [(0, 'pending'), (1, 'current'), (2, 'done')]
    """
    steps = steps_of(tape, backward_pass)
    count = len(tape.entries)
    position_of = {s.index: p for p, s in enumerate(steps) if s.index is not None}
    current = seed_entry = None
    if steps and step is not None:
        _check_step(tape, step, backward_pass, "row_window")
        current = steps[step].index
        if step == 0:
            losses = _loss_names(steps)
            seed_entry = _entry_producing(tape, losses[0]) if len(losses) == 1 else None
    center = current if current is not None else seed_entry
    if center is None:
        center = count - 1
    start, stop = _window_bounds(center, count, radius)
    rows = []
    for index in range(start, stop):
        position = position_of.get(index)
        if step is None or not steps:
            state = "pending" if position is not None else "skipped"
        elif index == current:
            state = "current"
        elif index == seed_entry:
            state = "seed"
        elif position is None:
            state = "skipped"
        else:
            state = "done" if position < step else "pending"
        rows.append(Row(index, tape.entries[index].format(), state))
    return RowWindow(tuple(rows), start, count - stop)


# --- the gradient map ----------------------------------------------------------------------------
def sources_text(sources) -> str:
    """``entry 3 + entry 5`` for the entries that accumulated into a name (``seed`` for the
    seed): a fan-in sum made visible.

    >>> sources_text([3, 5]), sources_text(["seed"])
    ('entry 3 + entry 5', 'seed')
    """
    return " + ".join("seed" if s == "seed" else f"entry {s}" for s in sources)


@dataclass(frozen=True)
class GradientRow:
    """One name of the gradient map: its gradient so far and where it came from."""
    name: str
    value_type: str
    preview: str
    sources: tuple   # entry indices in arrival order, or 'seed'
    updated: bool    # this step contributed to it

    @property
    def fan_in(self) -> bool:
        return len(self.sources) > 1

    @property
    def sources_text(self) -> str:
        """``v2 ← entry 3 + entry 5``"""
        return f"{self.name} ← {sources_text(self.sources)}"


@dataclass(frozen=True)
class GradientMapView:
    rows: tuple
    hidden: int      # names left out of the preview
    total: int

    @property
    def more_text(self) -> str:
        return f"... and {self.hidden} more" if self.hidden else ""


def gradient_map_view(tape, step: int | None = None, max_names: int = 20,
                      backward_pass: int = -1) -> GradientMapView:
    """The gradient map after ``step`` (the last step by default): at most ``max_names``
    names, in order of first arrival; when some must be left out, the names this step updated
    are kept, then the most recent.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label, reset_names
    >>> reset_names()  # names restart at v0
    >>> a, b = label(torch.ones(2), "a"), label(torch.ones(2), "b")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.mul(d.add(a, b), b), name="L"), [a, b])
    >>> [row.sources_text for row in gradient_map_view(d.tape).rows]
    ['L ← seed', 'v1 ← entry 2', 'v0 ← entry 1', 'b ← entry 1 + entry 0', 'a ← entry 0']
    """
    steps = steps_of(tape, backward_pass)
    if not steps:
        return GradientMapView((), 0, 0)
    step = len(steps) - 1 if step is None else step
    _check_step(tape, step, backward_pass, "gradient_map_view")
    gradients = tape.gradient_map(step, backward_pass)
    updated = {name for name, _, _ in steps[step].contributions}
    names = list(gradients)
    if len(names) > max_names:
        keep = [n for n in names if n in updated][:max_names]
        room = max_names - len(keep)
        kept = set(keep)
        if room:
            kept.update([n for n in names if n not in kept][-room:])
        names = [n for n in names if n in kept]
    rows = tuple(GradientRow(name, value_type(gradients[name][0]), preview(gradients[name][0]),
                             tuple(gradients[name][1]), name in updated)
                 for name in names)
    return GradientMapView(rows, len(gradients) - len(rows), len(gradients))


# --- the static text form ------------------------------------------------------------------------
def tape_text(tape, *, title: str | None = None, max_entries: int = 200, max_names: int = 20,
              backward_pass: int = -1) -> str:
    """A deterministic plain-text form of ``tape``: its forward entries, then its final
    gradient map (what a notebook shows without a kernel).

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label, reset_names
    >>> reset_names()  # names restart at v0
    >>> a = label(torch.tensor([0.0, 1.0]), "a")
    >>> d = Autograd(Torch())
    >>> _ = d.grad(d.sum(d.exp(a), name="L"), [a])
    >>> print(tape_text(d.tape))
    Autograd tape: 2 entries, backward pass 1 of 1 (3 steps)
      [0] v0:f32[2] = exp a
      [1] L:f32[] = sum v0 dim=(0,) keepdim=False
    final gradient map:
      L   f32[]   1           ← seed
      v0  f32[2]  [1, 1]      ← entry 1
      a   f32[2]  [1, 2.718]  ← entry 0
    """
    entries = tape.entries
    heading = title or f"{tape.level_name} tape"
    if tape.passes:
        number = len(tape.passes) + backward_pass + 1 if backward_pass < 0 else backward_pass + 1
        about = (f"backward pass {number} of {len(tape.passes)} "
                 f"({step_count(tape, backward_pass)} steps)")
    else:
        about = "no backward pass recorded"
    lines = [f"{heading}: {len(entries)} entries, {about}"]
    width = len(str(max(len(entries) - 1, 0)))
    for index, entry in enumerate(entries[:max_entries]):
        lines.append(f"  [{index:>{width}}] {entry.format()}")
    if len(entries) > max_entries:
        lines.append(f"  ... and {len(entries) - max_entries} more entries")
    if tape.passes:
        view = gradient_map_view(tape, None, max_names, backward_pass)
        lines.append("final gradient map:")
        table = [(r.name, r.value_type, r.preview, "← " + sources_text(r.sources))
                 for r in view.rows]
        widths = [max(len(row[i]) for row in table) for i in range(3)] if table else []
        for row in table:
            cells = [row[i].ljust(widths[i]) for i in range(3)]
            lines.append(("  " + "  ".join(cells) + "  " + row[3]).rstrip())
        if view.hidden:
            lines.append(f"  {view.more_text}")
    return "\n".join(lines)
