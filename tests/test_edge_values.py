"""Gradients at 0, -0, +-inf and NaN for every op of the table (tests/op_table.py), against
torch.func: the first argument is filled with those values, the others are the table's
samples. Where torch.func raises, we raise a TransformError; otherwise the gradients agree,
NaNs in the same places."""
import itertools

import pytest
import torch
import torch.func as tf
from op_table import OPS

import minifunctorch.core as mf

SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 0.5]
CASES = [case for case in OPS
         if (args := case.sample()) and isinstance(args[0], torch.Tensor)
         and args[0].is_floating_point() and args[0].numel() > 0]
# torch routes the gradient of x.max() (all elements) to a NaN element, but gives NaN for
# amax; the engine computes both with amax's rule
KNOWN = {"max_all": "x.max() with a NaN: torch's evenly_distribute_backward is NaN-aware",
         "min_all": "x.min() with a NaN: torch's evenly_distribute_backward is NaN-aware"}


def special_values(like):
    values = itertools.islice(itertools.cycle(SPECIAL), like.numel())
    return torch.tensor(list(values), dtype=like.dtype).reshape(like.shape)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_gradient_at_special_values_as_torch_func(case):
    if case.name in KNOWN:
        pytest.xfail(KNOWN[case.name])
    args = case.sample()
    rest = args[1:]

    def f(a):
        out = case.fn(a, *rest)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.sum() if out.is_floating_point() else out.float().sum() * 0

    x = special_values(args[0])
    try:
        theirs = tf.grad(f)(x)
    except Exception as error:  # noqa: BLE001 - torch.func refuses: so must we
        with pytest.raises(Exception) as ours:
            mf.grad(f)(x)
        assert isinstance(ours.value, (mf.TransformError, type(error))), ours.value
        return
    ours = mf.grad(f)(x)
    assert type(ours) is torch.Tensor and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, equal_nan=True)
