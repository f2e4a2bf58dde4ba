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


def _rows():  # (called once per test: a row's sample holds tensors that an op may write)
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


def _torchs_refusal(op, sample):
    """What torch raises for the row, on a copy of its input (the row is skipped if torch
    accepts it with a float input)."""
    try:
        op(sample.input.detach().clone(), *sample.args, **sample.kwargs)
    except Exception as error:  # noqa: BLE001 - whatever torch raises is the oracle
        return error
    pytest.skip("torch accepts this row with a float input")


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
    torchs = _torchs_refusal(op, sample)
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


def _rows_with_tensor_arguments():
    return [row for row in _rows()
            if any(isinstance(a, torch.Tensor) for a in (*row.values[1].args,
                                                          *row.values[1].kwargs.values()))]


# torch's F.gaussian_nll_loss checks its var's shape after reading whether any of its values
# is negative (a Python if on a tensor): under vmap that read is data-dependent control flow,
# which torch.func refuses with a RuntimeError before the ValueError of the shape, as here
CONTROL_FLOW_FIRST = {"nn.functional.gaussian_nll_loss"}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op, sample", _rows_with_tensor_arguments())
@pytest.mark.parametrize("input_batched", [True, False], ids=["input batched", "input shared"])
def test_what_torch_refuses_is_refused_with_batched_tensor_arguments(op, sample, input_batched):
    """The same rows with every tensor argument batched too (weights of an ensemble: the
    batching rules fold them into channels or groups before any kernel sees them)."""
    positions = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor)]
    names = [k for k, a in sample.kwargs.items() if isinstance(a, torch.Tensor)]

    def f(x, tensor_args, tensor_kwargs):
        args = list(sample.args)
        for i, value in zip(positions, tensor_args):
            args[i] = value
        return op(x, *args, **{**sample.kwargs, **tensor_kwargs})
    x = sample.input.detach().clone()
    torchs = _torchs_refusal(op, sample)
    expected = RuntimeError if op.name in CONTROL_FLOW_FIRST else type(torchs)
    tensor_args = [torch.stack([sample.args[i]] * 2) for i in positions]
    tensor_kwargs = {k: torch.stack([sample.kwargs[k]] * 2) for k in names}
    with pytest.raises(Exception) as ours:
        mf.vmap(f, in_dims=(0 if input_batched else None, 0, 0))(
            torch.stack([x, x]) if input_batched else x, tensor_args, tensor_kwargs)
    assert isinstance(ours.value, expected), (
        f"torch raises {type(torchs).__name__}: {torchs}; the engine raised "
        f"{type(ours.value).__mro__[:3]}: {ours.value}")
