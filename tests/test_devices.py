"""Nothing in the engine is tied to the CPU: the tutorial programs, run on every device this
machine has, give torch.func's results there, on that device.

Each program of ``test_tutorials.py`` runs under ``with torch.device(device):``, torch's
default-device context, so that the tensors a program creates itself (``torch.eye`` for a
basis, ``torch.randn`` for inputs) are made on the device too, for both libraries alike.
On a machine without a GPU only the CPU runs (the programs are also checked, with more,
in ``test_tutorials.py``); with one, ``pytest tests/test_devices.py`` checks CUDA as well:
that is how the device checks of issue 16 are run.
"""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from test_tutorials import (
    MLP,
    SmallCNN,
    TinyCNN,
    batch_jacobians_and_hessians,
    ensemble,
    jacobians_and_hessians,
    ntk_by_jacobian_contraction,
    ntk_by_ntk_vector_products,
    per_sample_gradients,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """A device, with TF32 off on CUDA: torch runs convolutions in TF32 there by default, and
    two libraries that batch one convolution differently (cuDNN picks its algorithm per shape)
    would then differ by 1e-4 while both are right."""
    if request.param != "cuda":
        yield request.param
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield request.param
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _assert_on_device_and_same(ours, theirs, device, **tolerances):
    leaves = torch.utils._pytree.tree_leaves(ours)
    assert leaves, "the program returned no tensors"
    for leaf in leaves:
        assert type(leaf) is torch.Tensor, f"a transform returned a {type(leaf).__name__}"
        assert leaf.device.type == device, f"a result is on {leaf.device}, not on {device}"
    torch.testing.assert_close(ours, theirs, **tolerances)


def _cnn_per_sample_gradients():
    model = SmallCNN().eval()
    data, targets = torch.randn(8, 1, 12, 12), torch.randint(10, (8,))
    return per_sample_gradients, (model, data, targets), {"rtol": 1e-4, "atol": 1e-6}


def _model_ensembling():
    return ensemble, ([MLP() for _ in range(5)], torch.randn(5, 6, 4, 4)), {}


def _ntk(method):
    def build():
        program = {"jacobian_contraction": ntk_by_jacobian_contraction,
                   "ntk_vector_products": ntk_by_ntk_vector_products}[method]
        args = (TinyCNN(), torch.randn(4, 3, 8, 8), torch.randn(3, 3, 8, 8), "full")
        return program, args, {"rtol": 1e-4, "atol": 1e-5}
    return build


def _jacobians_and_hessians():
    args = (torch.randn(16, 16), torch.randn(16), torch.randn(16), torch.randn(16))
    return jacobians_and_hessians, args, {"rtol": 1e-4, "atol": 1e-5}


def _batch_jacobians_and_hessians():
    args = (torch.randn(5, 7), torch.randn(5), torch.randn(8, 7))
    return batch_jacobians_and_hessians, args, {"rtol": 1e-4, "atol": 1e-5}


PROGRAMS = {
    "cnn_per_sample_gradients": _cnn_per_sample_gradients,
    "model_ensembling": _model_ensembling,
    "ntk_jacobian_contraction": _ntk("jacobian_contraction"),
    "ntk_vector_products": _ntk("ntk_vector_products"),
    "jacobians_and_hessians": _jacobians_and_hessians,
    "batch_jacobians_and_hessians": _batch_jacobians_and_hessians,
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_tutorial_program_runs_on_the_device(name, device):
    torch.manual_seed(0)
    with torch.device(device):
        program, args, tolerances = PROGRAMS[name]()
        ours, theirs = program(mf, *args), program(tf, *args)
    _assert_on_device_and_same(ours, theirs, device, **tolerances)


def test_jit_replays_per_sample_gradients_on_the_device(device):
    """A traced program keeps the device of the tensors it was traced with, and its replay
    on new inputs of that device is the eager result (the kernels' own, bit for bit)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = SmallCNN().eval()
        params = {k: v.detach() for k, v in model.named_parameters()}
        batches = [(torch.randn(8, 1, 12, 12), torch.randint(10, (8,))) for _ in range(2)]

    def loss(params, sample, target):
        prediction = mf.functional_call(model, params, (sample.unsqueeze(0),))
        return F.nll_loss(prediction, target.unsqueeze(0))

    eager = mf.vmap(mf.grad(loss), in_dims=(None, 0, 0))
    jitted = mf.jit(eager)
    for data, targets in batches:  # the second call replays the trace of the first
        replayed = jitted(params, data, targets)
        _assert_on_device_and_same(replayed, eager(params, data, targets), device,
                                   rtol=0, atol=0)


def test_numbers_and_created_tensors_follow_the_device(device):
    """Python numbers in an op (kept as 0-d CPU tensors, NOTE [Number operands as tensors])
    and tensors made inside the function with the device of an input mix with values on
    any device, as in torch."""
    def f(x, buffer):
        buffer[0] = (2.5 * x).sin().sum()
        buffer[1:] = x[:2] + 1
        return (buffer * 0.5).exp().sum()

    def made_with_the_device(x):  # grad and jacrev: an unbatched local takes the writes
        return f(x, torch.zeros(3, device=x.device))

    def made_like_an_input(x):  # under vmap the buffer must be batched, as in torch.func
        return f(x, torch.zeros_like(x[:3]))

    with torch.device(device):
        x = torch.randn(4)
        xs = torch.randn(5, 4)
    for api_fn in (lambda api: api.grad(made_with_the_device)(x),
                   lambda api: api.jacrev(made_with_the_device)(x),
                   lambda api: api.vmap(api.grad(made_like_an_input))(xs)):
        _assert_on_device_and_same(api_fn(mf), api_fn(tf), device)
