"""Grad modes inside transforms: ``torch.no_grad``, ``torch.enable_grad``,
``torch.set_grad_enabled``, ``torch.inference_mode``, and forward mode's
``torch.autograd.forward_ad._set_fwd_grad_enabled``.

NOTE [Grad modes and transform levels]
torch.func's rule, which the engine follows:
- a ``torch.no_grad()`` entered *inside* the function that a grad or vjp level transforms stops
  that level, and every level created outside it, from recording;
- a ``torch.no_grad()`` *outside* the transform call does not stop the transform's own level
  ("grad ignores the outer no_grad"): the result of ``grad(f)(x)`` must not depend on a
  context manager outside ``f``. It does stop the levels (and torch's own autograd) outside
  the transform, so ``with torch.no_grad(): y = grad(f)(x)`` gives a ``y`` that does not
  require grad.
How it is done, as in functorch (``GradInterpreterPtr::prevGradMode`` in
aten/src/ATen/functorch/ADInterpreters.h, ``autogradBasedTransformSendToNext`` in
ADInterpreters.cpp, and NOTE [grad and vjp interaction with no_grad] in
torch/_functorch/eager_transforms.py):
1. When a grad or vjp level starts running the user's function (``level_scope``), it saves the
   grad mode it found (``level.prev_grad_mode``) and switches grad on.
2. An Autograd level records a primitive only while ``torch.is_grad_enabled()``: an inner
   ``no_grad`` (or ``inference_mode``, ``set_grad_enabled(False)``) switches it off; an
   ``enable_grad`` inside that switches it back on.
3. A level that was entered with grad off is a boundary: what it passes down (its rules'
   forward ops) runs with grad off, so the levels below, which were outside that ``no_grad``,
   do not record them. functorch restores the saved mode when an op crosses from that level
   to the next one down. Here an op may skip levels (a value of level 1 used inside level 3
   never visits level 2), so the boundary is also kept as a number, the ``floor``: while a
   level entered with grad off is running its function, levels numbered below it record
   nothing.
The forward-mode counterpart is the same with ``torch._C._is_fwd_grad_enabled()`` and
``_set_fwd_grad_enabled``; ``torch.no_grad`` does not stop jvp, as in torch.func. Like
torch.func, grad's, vjp's and jvp's function runs outside an enclosing ``inference_mode``
(which would also switch both modes off), with the modes that inference mode had.

A backward pass (``tape.backward``, a vjp function) runs under the grad mode of its caller, as
``torch.autograd.grad`` does: a vjp function called under ``no_grad`` gives cotangents that no
enclosing level records.

The cost on the hot path is one C call (``torch.is_grad_enabled``) and one integer comparison
per recorded primitive. A level that no transform entered through ``level_scope`` (a level of
the explicit API, ``Autograd(Torch())``) ignores grad modes, as it did before.
"""
import torch

_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled
_set_fwd_grad_enabled = torch._C._set_fwd_grad_enabled

# floors[REVERSE], floors[FORWARD]: while a level entered with its grad mode off runs its
# function, its level number; levels numbered below it do not record (NOTE, point 3).
REVERSE, FORWARD = 0, 1
floors = [0, 0]


# NOTE [Grad mode inside the back door]
# torch's own Python code that the back door runs (decompositions, refs, the aten versions of
# prims) sometimes switches grad off for its own bookkeeping: ``_convert_element_type_aten``
# copies into a fresh tensor under ``no_grad``. In torch that code runs below autograd, so
# the switch means nothing to differentiation; here it runs above the levels. So the back
# door remembers the grad mode of the code that called into it (``door``: depth of nested
# back-door calls, and that mode), and inside it a grad level goes by that mode, not by
# torch's flag. The engine's own switches (``no_grad`` below) update both.
door = [0, True]


def grad_off():
    """Whether grad levels that obey grad modes record nothing now (grad disabled by the
    user's code, not only by torch's code inside the back door). Called only where
    ``torch.is_grad_enabled()`` has said False, so the hot path pays nothing more."""
    return not _is_grad_enabled() and not (door[0] and door[1])


def reverse_off(level):
    """Whether a grad level that obeys grad modes records nothing now (NOTE, points 2, 3)."""
    return grad_off() or level.level < floors[REVERSE]


class _EngineNoGrad:
    """``with grad_mode.no_grad():`` torch.no_grad for the engine's own work: it also holds
    inside the back door (NOTE [Grad mode inside the back door])."""

    __slots__ = ("saved_mode", "saved_door")

    def __enter__(self):
        self.saved_mode = _is_grad_enabled()
        self.saved_door = door[1]
        _set_grad_enabled(False)
        door[1] = False

    def __exit__(self, *exc_info):
        _set_grad_enabled(self.saved_mode)
        door[1] = self.saved_door


def no_grad():
    return _EngineNoGrad()


class _LevelScope:
    """``with level_scope(level):`` while a grad/vjp (or jvp) level runs the user's function
    (a class: NOTE [Context managers on the hot path] in tensor.py)."""

    __slots__ = ("level", "kind", "saved_mode", "saved_floor", "inference", "saved_door")

    def __init__(self, level, kind):
        self.level = level
        self.kind = kind

    def __enter__(self):
        kind = self.kind
        # torch.func runs grad's and jvp's function outside an enclosing inference_mode
        self.inference = None
        if _is_inference_mode_enabled():
            grad_mode, fwd_grad_mode = _is_grad_enabled(), _is_fwd_grad_enabled()
            self.inference = torch.inference_mode(False)
            self.inference.__enter__()
            # leaving inference mode switched both modes on: keep what inference mode had
            _set_grad_enabled(grad_mode)
            _set_fwd_grad_enabled(fwd_grad_mode)
        if kind == REVERSE:
            mode = _is_grad_enabled()
            self.level.prev_grad_mode = mode
            if not mode:
                _set_grad_enabled(True)
        else:
            mode = _is_fwd_grad_enabled()
            self.level.prev_fwd_grad_mode = mode
            if not mode:
                _set_fwd_grad_enabled(True)
        self.level.obeys_grad_mode = True
        self.saved_mode = mode
        self.saved_door = door[1]
        if kind == REVERSE:
            door[1] = True
        self.saved_floor = floors[kind]
        if not mode:
            floors[kind] = self.level.level
        return self.level

    def __exit__(self, *exc_info):
        kind = self.kind
        floors[kind] = self.saved_floor
        door[1] = self.saved_door
        if kind == REVERSE:
            _set_grad_enabled(self.saved_mode)
        else:
            _set_fwd_grad_enabled(self.saved_mode)
        if self.inference is not None:
            self.inference.__exit__(*exc_info)


def level_scope(level):
    """Enter the grad mode of a grad/vjp level (an ``Autograd``) or a jvp level (a
    ``Forward``) for the time it runs the user's function: saves the mode found (the level's
    ``prev_grad_mode`` / ``prev_fwd_grad_mode``) and switches it on; restored on exit, error or
    not (NOTE [Grad modes and transform levels]).

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> def f(x):
    ...     with torch.no_grad():
    ...         shift = x ** 2          # not recorded: a constant for grad
    ...     return (x ** 2 - shift).sum()
    >>> grad(f)(torch.tensor([1.0, 3.0]))
    tensor([2., 6.])
    >>> with torch.no_grad():        # grad ignores a no_grad around the call
    ...     grad(lambda x: (x ** 2).sum())(torch.tensor([1.0, 3.0]))
    tensor([2., 6.])
    """
    kind = FORWARD if getattr(type(level), "transform_name", None) == "jvp" else REVERSE
    return _LevelScope(level, kind)
