"""Random operations under vmap: ``randomness='error' | 'same' | 'different'``.

NOTE [Why a torch function mode]
``torch.rand(3)`` inside a vmapped function receives no wrapped value, so no
``__torch_function__`` of ours sees it. While a vmap runs, a ``TorchFunctionMode`` watches
for the random functions only: with ``'error'`` it raises, with ``'same'`` it lets one draw
be shared by every example, and with ``'different'`` it draws one sample per example (an
extra leading dim, returned as a batched value).
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from .errors import RandomnessError

_CREATION = {torch.rand: torch.rand, torch.randn: torch.randn}
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn}
_OTHER = {torch.randint, torch.randint_like, torch.bernoulli, torch.normal, torch.multinomial,
          torch.nn.functional.dropout, torch.dropout, torch.randperm,
          torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_,
          torch.Tensor.random_}
RANDOM_FUNCTIONS = set(_CREATION) | set(_LIKE) | _OTHER


class _RandomnessMode(TorchFunctionMode):
    def __init__(self, level, randomness, call):
        super().__init__()
        self.level = level
        self.randomness = randomness
        self.call = call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in RANDOM_FUNCTIONS:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if self.randomness == "error":
            raise RandomnessError(
                f"{self.call}: {name} was called under vmap with randomness='error'. Fix: pass "
                "randomness='different' (independent draws per example) or 'same' (one draw "
                "shared by the batch) to vmap, or draw outside of vmap."
            )
        if self.randomness == "same" or (func not in _CREATION and func not in _LIKE):
            if func in _LIKE or func in _OTHER:
                # draw once for one example's shape; the batch shares it
                return func(*[_unbatched(a) for a in args], **kwargs)
            return func(*args, **kwargs)
        # 'different': one draw per example, batched along a new leading dim
        if func in _CREATION:
            size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
                else args
            draw = func(self.level.length, *size, **kwargs)
        else:
            example = args[0]
            draw = _LIKE[func](self.level.length, *example.shape, dtype=example.dtype,
                               device=example.device)
        return self.level.wrap_input(draw, 0)


def _unbatched(value):
    from .dispatch import FuncTensor
    if isinstance(value, FuncTensor):
        raise RandomnessError(
            "randomness='same' cannot draw from the distribution of a batched value. Fix: "
            "draw with a shape (torch.rand(shape)) instead."
        )
    return value


@contextlib.contextmanager
def random_guard(level, randomness, call):
    """Watch random functions while a vmap runs (see the NOTE above)."""
    with _RandomnessMode(level, randomness, call):
        yield
