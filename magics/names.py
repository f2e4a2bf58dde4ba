"""The notebook's names on the values of a magic cell: its inputs, the notebook tensors it
reads, and its own variables.

NOTE [Names the notebook gave]
A tape or a program is easier to read when its values carry the names the student wrote.
Three kinds of names reach the engine, each on values the magic owns, never on the student's
tensors:
- *inputs* (``--wrt w``) and *captured tensors* (a notebook tensor ``X`` that the cell reads
  without listing it) are passed in as views labelled with their notebook names
  (:func:`labelled`): a view shares the storage, so the cell computes exactly what it would
  with the tensor itself, while the label rides on an object of our own. Captured tensors
  reach the cell as closure variables (NOTE [A cell is a function body] in cell.py);
- a *local variable* names the value it is assigned: ``h = torch.tanh(X @ W1)`` is followed
  by ``__mft_name__(h, "h")`` (:class:`CellNamer`), which renames the value with
  ``core.dispatch.rename``, as ``d.sum(x, name="L")`` does in the explicit API.

A tape refers to values by name, so a rename must never make two values share one, nor
change a name that an entry has already used as an input. The namer therefore only names a
value that still has an engine name (``v3``: made up when it was created, so the variable is
its first name), only when no entry has read it yet, and makes a name unique with a suffix
(``h``, then ``h_1`` for the next value assigned to ``h``, as in a loop). Names restart at
every call of the cell, as the engine's ``v0, v1, ...`` do, so stored outputs are stable.
Names of the engine's own form (``v3``, ``c0``) are never given: they would read as the
engine's.
"""
import re

import torch

from minifunctorch import core
from minifunctorch.core.dispatch import rename
from minifunctorch.core.tensor import unwrap
from minifunctorch.core.values import Value

ENGINE_NAME = re.compile(r"[vc]\d+$")


def labelled(name, value):
    """A view of ``value`` labelled ``name``; other values (and engine-like names) are
    returned as they are. A dict of tensors (a model's parameters) gets a dict of views, each
    labelled with its key, so a tape reads ``hidden.weight`` rather than ``v0``.

    >>> import torch
    >>> x = torch.ones(2)
    >>> view = labelled("x", x)
    >>> view.t_name, hasattr(x, "t_name"), view.data_ptr() == x.data_ptr()
    ('x', False, True)
    >>> labelled("params", {"w": x, "b": torch.zeros(())})["w"].t_name
    'w'
    """
    if type(value) is dict and all(type(key) is str for key in value):
        return {key: labelled(key, entry) for key, entry in value.items()}
    if not isinstance(value, torch.Tensor) or type(value) is core.FuncTensor:
        return value
    if ENGINE_NAME.match(name):
        return value
    try:
        alias = value.view_as(value)
    except RuntimeError:  # tensors without views (some layouts): unlabelled is fine
        return value
    return core.label(alias, name)


def _chain(value):
    """The values of every level behind ``value``, outermost first."""
    while isinstance(value, Value):
        yield value
        value = value.payload


def _read_by_an_entry(value) -> bool:
    for level_value in _chain(value):
        tape = getattr(level_value.dispatcher, "tape", None)
        if tape is not None and any(level_value.name in entry.inputs for entry in tape.entries):
            return True
    return False


class CellNamer:
    """Gives the values a cell assigns the names of its variables (NOTE [Names the notebook
    gave]). ``taken`` are names already in use (the inputs and captured tensors).

    >>> import torch
    >>> from minifunctorch.core import capture_tapes, grad
    >>> namer = CellNamer(taken={"x"})
    >>> def f(x):
    ...     namer.restart()
    ...     y = torch.sin(x); namer(y, "y")
    ...     y = y * 2; namer(y, "y")
    ...     return y.sum()
    >>> with capture_tapes() as tapes:
    ...     _ = grad(f)(labelled("x", torch.ones(2)))
    >>> print(tapes[0])
    y:f32[2] = sin x
    y_1:f32[2] = mul y 2
    v2:f32[] = sum y_1 dim=(0,) keepdim=False
    """

    def __init__(self, taken=()):
        self._reserved = set(taken)
        self.restart()

    def reserve(self, names) -> None:
        """Never give ``names`` (the notebook names already on the cell's values)."""
        self._reserved.update(names)
        self.taken.update(names)

    def restart(self) -> None:
        """Forget the names given so far (the cell is called again)."""
        self.taken = set(self._reserved)

    def _unique(self, name) -> str:
        candidate, suffix = name, 0
        while candidate in self.taken:
            suffix += 1
            candidate = f"{name}_{suffix}"
        return candidate

    def __call__(self, value, name) -> None:
        if type(value) is not core.FuncTensor or ENGINE_NAME.match(name):
            return
        inner = unwrap(value)
        if not isinstance(inner, Value) or not ENGINE_NAME.match(inner.name):
            return  # a value that already has a name: an input, or one assigned before
        if _read_by_an_entry(inner):
            return
        unique = self._unique(name)
        self.taken.add(unique)
        rename(inner, unique)
