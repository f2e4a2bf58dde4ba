"""Random creation functions under vmap: ``randomness='error' | 'same' | 'different'``.

NOTE [Random functions meet the transform mode]
``torch.rand(3)`` inside a vmapped function receives no wrapped value, so no
``__torch_function__`` of a FuncTensor sees it. The transform mode does (tensor.py, NOTE
[Tensors created inside a transform]): while a transform runs user code it sees every torch
call, and it hands the random creation functions listed here to ``draw``, which follows the
``randomness`` of every vmap level on the transform stack:
- ``'error'`` raises a RandomnessError that names the function and the fix;
- ``'same'`` draws once, shared by every example;
- ``'different'`` draws one sample per example (a new leading dim, returned as a batched
  value). Under nested vmaps each level asks the one outside it for its numbers, so the draw
  gets every batch dim.
``rand_like(x)`` and ``randn_like(x)`` draw for the shape of one example, so they work on a
batched ``x``. Random aten ops applied to a wrapped value (``F.dropout(x)``) reach the back
door, where ``Batched.random_op`` follows the same modes. torch.func does the same in C++: its
vmap level keeps a randomness setting that every random kernel consults
(``functorch/BatchRulesRandomness.cpp``).
"""
import torch

from .batching import Batched
from .dispatch import transform_levels
from .errors import RandomnessError
from .tensor import as_tensor, unwrap
from .torch_api import RANDOM_FUNCTIONS

# the ones that 'different' knows how to batch: the size-taking ones, and the *_like ones
# with the size-taking function that draws for them
_SIZED = {torch.rand, torch.randn}
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn}


def draw(func, args, kwargs):
    """A random creation function called while a transform runs user code; NotImplemented
    when no vmap is running (the transform mode then treats it as any other factory)."""
    levels = [level for level in transform_levels() if isinstance(level, Batched)]
    if not levels:
        return NotImplemented
    return _draw_at(levels, func, args, kwargs)


def _draw_at(levels, func, args, kwargs):
    """Draw for the innermost of ``levels`` (outermost first), the others outside it."""
    if not levels:
        return func(*args, **kwargs)
    level, outer = levels[-1], levels[:-1]
    name = torch.overrides.resolve_name(func) or getattr(func, "__name__", str(func))
    if level.randomness == "error":
        raise RandomnessError(
            f"{level.call}: {name} was called under vmap with randomness='error'. Fix: pass "
            "randomness='different' (independent draws per example) or 'same' (one draw "
            "shared by the batch) to vmap, or draw the random numbers outside of vmap."
        )
    if func in _LIKE:
        # Draw for the shape of one example (torch's own rand_like cannot take a batched
        # value), with the size-taking function, through the levels outside this one.
        example = args[0]
        kwargs = dict(kwargs)
        kwargs.setdefault("dtype", example.dtype)
        kwargs.setdefault("device", example.device)
        sized = _LIKE[func]
        if level.randomness == "same":
            return _draw_at(outer, sized, tuple(example.shape), kwargs)
        drawn = _draw_at(outer, sized, (level.length, *example.shape), kwargs)
        return as_tensor(level.wrap_input(unwrap(drawn), 0))
    if level.randomness == "same" or func not in _SIZED:
        if level.randomness == "different":
            raise RandomnessError(
                f"{level.call}: {name} cannot draw per-example samples under "
                "randomness='different'. Fix: use torch.rand or torch.randn, or draw "
                "outside of vmap."
            )
        return _draw_at(outer, func, args, kwargs)
    size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
        else args
    drawn = _draw_at(outer, func, (level.length, *size), kwargs)
    return as_tensor(level.wrap_input(unwrap(drawn), 0))


for _func in (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
              torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli,
              torch.multinomial):
    RANDOM_FUNCTIONS[_func] = draw
