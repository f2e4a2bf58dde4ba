"""Readable value names (v0, v1, ...) for tapes, logs and programs.

NOTE [Names restart per transform call]
The counter restarts whenever a top-level transform call begins (see ``transform_scope`` in
dispatch.py), so that the same notebook cell prints the same names on every run. Names only
need to be unique inside one top-level call: that is the scope of every tape and program.
"""
import itertools
import re
import threading
import weakref


class _PerThread(threading.local):
    """Each thread numbers its own values (NOTE [One stack of levels per thread] in
    dispatch.py): a transform starting in one thread must not restart another's names."""

    def __init__(self):
        self.counter = itertools.count()


_per_thread = _PerThread()


# NOTE [A label that looks like an engine name]
# Tapes key their values by name, so a user's label ``v2`` must never meet an engine's ``v2``
# in one call: the gradient of one would be added into the other. Labels of that shape are
# counted while a tensor that carries one is alive, and the engine's counter skips them.
_ENGINE_LIKE = re.compile(r"[vc]\d+$")
_labels_in_use: dict = {}  # label -> how many live tensors carry it


def _forget_label(name):
    count = _labels_in_use.get(name, 0) - 1
    if count > 0:
        _labels_in_use[name] = count
    else:
        _labels_in_use.pop(name, None)


def fresh_name() -> str:
    name = f"v{next(_per_thread.counter)}"
    while _labels_in_use and name in _labels_in_use:
        name = f"v{next(_per_thread.counter)}"
    return name


def reset_names() -> None:
    """Restart value names at v0. Called at the start of each top-level transform."""
    _per_thread.counter = itertools.count()


def label(tensor, name: str | None = None):
    """Give a tensor a readable name, used by the explicit dispatcher API and by tapes.

    >>> import torch
    >>> from minifunctorch.core import label
    >>> a = label(torch.ones(2), "a")
    >>> a.t_name
    'a'

    A tensor keeps the first name it is given, as in the seed: labelling it again is a no-op.
    """
    if getattr(tensor, "t_name", None) is None:
        if name and _ENGINE_LIKE.match(name):
            _labels_in_use[name] = _labels_in_use.get(name, 0) + 1
            weakref.finalize(tensor, _forget_label, name)
        tensor.t_name = name or fresh_name()
    return tensor

