"""Inputs that lie in memory as views do: every op_db entry on transposed samples.

A value inside a transform has no memory of its own, and the engine reads it in its own
contiguous order. Almost no op cares how its inputs lie in memory; the few that do
(``as_strided`` and its kin) must read as torch does or refuse (NOTE [as_strided reads
memory] in core/tensor.py). Here each op_db entry (float32, CPU) runs its first samples with
every tensor of two or more dims transposed in memory (the same values, reversed strides,
as ``x.t().contiguous().t()`` lays them out), under vjp and jvp. For each sample:
- the engine refuses with a TransformError, or its outputs equal torch's own call on the
  same transposed tensors;
- where torch's outputs do not depend on the layout (its call on contiguous copies gives
  the same), the engine's derivatives equal its derivatives on the contiguous copies, which
  tests/test_opinfo.py checks against torch.func.
The comparison is with torch and with the engine itself, not with torch.func: torch.func's
own results on such inputs are off for a few ops (its jacfwd of nll_loss's weight, its
max_unpool backward, which refuses the layout).
"""
import warnings

import optree
import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (op_db) needs expecttest: "
                    "pip install -e '.[test]'")
import opinfo  # noqa: E402

import minifunctorch.core as mf  # noqa: E402

SAMPLES = 3  # per entry, spread over its list


def transposed_in_memory(x):
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.layout == torch.strided:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    return x


def _run(run, s):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run(mf, s, s.floats)
    except mf.TransformError as error:
        return error


def _torch_call(s):
    torch.manual_seed(opinfo.seed_of(s.key, s.index, "call"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return opinfo._split_outputs(s.sample.output_process_fn_grad(s.call({})))


def _layout_matters(s_contiguous, s_transposed):
    return opinfo.difference(_torch_call(s_transposed), _torch_call(s_contiguous)) is not None


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _entries():
    for op in opinfo.entries():
        yield pytest.param(op, id=opinfo.entry_key(op))


@pytest.mark.parametrize("op", list(_entries()))
def test_transposed_inputs_read_as_torch_reads_them(op):
    try:
        samples = opinfo.load_samples(op)
    except Exception as error:  # noqa: BLE001 - op_db's own sample generator fails
        pytest.skip(f"sample_inputs fails: {opinfo.describe_error(error)}")
    checked = 0
    for index in opinfo.spread(len(samples), SAMPLES):
        transposed = samples[index].transform(transposed_in_memory)
        leaves = optree.tree_leaves((transposed.input, transposed.args, transposed.kwargs))
        if not any(isinstance(t, torch.Tensor) and t.layout == torch.strided
                   and not t.is_contiguous() for t in leaves):
            continue  # nothing of this sample lies differently
        s_contiguous = opinfo.Sample(op, samples[index], index)
        s_transposed = opinfo.Sample(op, transposed, index)
        if opinfo._probe(s_transposed):
            continue
        try:
            expected = _torch_call(s_transposed)
            layout_matters = _layout_matters(s_contiguous, s_transposed)
        except Exception:  # noqa: BLE001 - torch itself refuses the sample
            continue
        for name, run in (("vjp", opinfo.run_vjp), ("jvp", opinfo.run_jvp)):
            ours = _run(run, s_transposed)
            if isinstance(ours, mf.TransformError):
                continue  # refused: never silently wrong
            where = f"{name}, sample {index} ({s_transposed.describe()})"
            floats, others = expected  # (vjp and jvp stand a zero in for no float output)
            problem = opinfo.difference((ours["outputs"] if floats else (), ours["aux"]),
                                        (floats, others),
                                        values=not op.has_nondeterministic_output,
                                        names=("ours", "torch"))
            assert problem is None, f"{where}: the outputs differ from torch's: {problem}"
            if not layout_matters and not op.has_nondeterministic_output:
                contiguous = _run(run, s_contiguous)
                if isinstance(contiguous, mf.TransformError):
                    continue
                derivatives = "grads" if name == "vjp" else "tangents"
                problem = opinfo.difference(ours[derivatives], contiguous[derivatives],
                                            names=("transposed", "contiguous"))
                assert problem is None, (
                    f"{where}: the derivatives depend on the layout: {problem}")
            checked += 1
    if not checked:
        pytest.skip("no sample with a tensor of two or more dims that runs")
