"""Random operations under vmap: ``randomness='error' | 'same' | 'different'``.

NOTE [Guarding the random functions, not every function]
``torch.rand(3)`` inside a vmapped function receives no wrapped value, so no
``__torch_function__`` of ours sees it. A TorchFunctionMode would, but it would also
intercept every other torch call in the batch (and cost a Python call each). Instead, while
a vmap runs, the few random *creation* functions of the ``torch`` module are swapped for
guarded versions, and put back in ``finally``:
- ``'error'`` raises a RandomnessError that names the function and the fix;
- ``'same'`` draws once, shared by every example;
- ``'different'`` draws one sample per example (a new leading dim, returned as a batched
  value). Under nested vmaps each guard calls the one outside it, so the draw gets every
  batch dim.
``rand_like(x)`` and ``randn_like(x)`` draw for the shape of one example, so they work on a
batched ``x``. Other random functions applied to a wrapped value (``F.dropout(x)``, and
``torch.rand_like(x)`` under grad or jvp) reach ``__torch_function__`` and are refused there.
"""
import contextlib

import torch

from .errors import RandomnessError
from .tensor import as_tensor

CREATION_FUNCTIONS = ("rand", "randn", "randint", "randperm", "normal", "rand_like",
                      "randn_like", "randint_like", "bernoulli", "multinomial")
# the ones that 'different' knows how to batch: name -> how to read the shape of one example
_SIZED = {"rand", "randn"}
_LIKE = {"rand_like": "rand", "randn_like": "randn"}


def _guarded(name, originals, level, randomness, call):
    original = originals[name]

    def guarded(*args, **kwargs):
        if randomness == "error":
            raise RandomnessError(
                f"{call}: torch.{name} was called under vmap with randomness='error'. Fix: pass "
                "randomness='different' (independent draws per example) or 'same' (one draw "
                "shared by the batch) to vmap, or draw the random numbers outside of vmap."
            )
        if name in _LIKE:
            # Draw for the shape of one example (torch's own rand_like cannot take a batched
            # value), with the creation function outside this guard rather than the guarded one.
            example = args[0]
            kwargs.setdefault("dtype", example.dtype)
            kwargs.setdefault("device", example.device)
            create = originals[_LIKE[name]]
            if randomness == "same":
                return create(*example.shape, **kwargs)
            return as_tensor(level.wrap_input(create(level.length, *example.shape, **kwargs), 0))
        if randomness == "same" or name not in _SIZED:
            if randomness == "different":
                raise RandomnessError(
                    f"{call}: torch.{name} cannot draw per-example samples under "
                    "randomness='different'. Fix: use torch.rand or torch.randn, or draw "
                    "outside of vmap."
                )
            return original(*args, **kwargs)
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
            else args
        return as_tensor(level.wrap_input(original(level.length, *size, **kwargs), 0))
    guarded.__name__ = name
    return guarded


@contextlib.contextmanager
def random_guard(level, randomness, call):
    """Guard torch's random creation functions while a vmap runs (see the NOTE above)."""
    originals = {name: getattr(torch, name) for name in CREATION_FUNCTIONS}
    try:
        for name, original in originals.items():
            setattr(torch, name, _guarded(name, originals, level, randomness, call))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)
