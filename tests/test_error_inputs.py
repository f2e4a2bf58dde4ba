"""PyTorch's OpInfo error inputs under the transforms: what torch refuses, the engine refuses.

Each OpInfo row of ``error_inputs`` (CPU, a floating-point input) is a call that torch
refuses. Run under ``vmap`` (the input batched along its first or its last dim), ``grad`` and
``jvp``, the engine must refuse it too, with an exception of the built-in type torch raises (RuntimeError, IndexError,
ValueError, ...), so that code catching torch's errors still works: never a value (a batching
rule that reshapes before the kernel can read a wrong shape as another), never an unrelated
crash (a ZeroDivisionError or an IndexError from inside a rule).
"""
import warnings

import pytest
import torch

import minifunctorch.core as mf

pytest.importorskip("expecttest", reason="torch.testing._internal (op_db) needs expecttest: "
                    "pip install -e '.[test]'")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

# torch's own ops disagree here: torch.narrow_copy raises a RuntimeError for a dim out of
# range where torch.narrow (and the engine, which computes narrow_copy as a copy of narrow)
# raises an IndexError
DIFFERENCES = {("narrow_copy", "Expected dim < static_cast<int64_t>(self_sizes.size())")}


def _rows():
    rows = []
    for op in op_db:
        if op.error_inputs_func is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                error_inputs = list(op.error_inputs(torch.device("cpu")))
            except Exception:  # noqa: BLE001 - a row generator that needs another device
                continue
        for number, error_input in enumerate(error_inputs):
            sample = error_input.sample_input
            if isinstance(sample.input, torch.Tensor) and sample.input.dtype.is_floating_point:
                rows.append(pytest.param(op, sample, id=f"{op.name}-{number}"))
    return rows


def _loss(outputs):
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return sum(o.sum() for o in outputs
               if isinstance(o, torch.Tensor) and o.dtype.is_floating_point)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op, sample", _rows())
def test_what_torch_refuses_the_transforms_refuse(op, sample):
    def f(x):
        return op(x, *sample.args, **sample.kwargs)
    x = sample.input.detach().clone()
    try:
        f(x.clone())
    except Exception as error:  # noqa: BLE001 - whatever torch raises is the oracle
        torchs = error
    else:
        pytest.skip("torch accepts this row with a float input")
    if any(op.name == name and words in str(torchs) for name, words in DIFFERENCES):
        pytest.skip("torch's own ops disagree on this row (DIFFERENCES)")
    for transform, call in (
            ("vmap", lambda: mf.vmap(f)(torch.stack([x, x]))),
            ("vmap over the last dim", lambda: mf.vmap(f, in_dims=-1)(torch.stack([x, x], -1))),
            ("grad", lambda: mf.grad(lambda x: _loss(f(x)))(x)),
            ("jvp", lambda: mf.jvp(f, (x,), (torch.ones_like(x),)))):
        with pytest.raises(Exception) as ours:
            call()
        assert isinstance(ours.value, type(torchs)), (
            f"{transform}: torch raises {type(torchs).__name__}: {torchs}; the engine raised "
            f"{type(ours.value).__mro__[:3]}: {ours.value}")
