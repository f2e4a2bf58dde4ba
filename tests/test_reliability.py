"""Edge cases that an adversarial battery found (issue 17), each a reproducer checked against
torch.func: what torch.func returns, we return; what it refuses, we refuse."""

import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf

X = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)


def same(ours, theirs):
    assert type(ours) is torch.Tensor, f"expected a plain tensor, got {type(ours).__name__}"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, equal_nan=True)


# --- an empty dim list reduces over every dim, as in torch -----------------------------------
@pytest.mark.parametrize("reduce", [
    lambda a: a.mean(dim=()), lambda a: a.sum(dim=[]), lambda a: a.amax(dim=[]),
    lambda a: a.amin(dim=()), lambda a: torch.sum(a, dim=(), keepdim=True).sum(),
    lambda a: torch.mean(a, [], True).sum(),
], ids=["mean()", "sum[]", "amax[]", "amin()", "sum()keepdim", "mean[]keepdim"])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_an_empty_dim_list_reduces_every_dim(reduce, transform):
    if transform == "grad":
        ours, theirs = mf.grad(reduce)(X), tf.grad(reduce)(X)
    elif transform == "vmap":
        ours, theirs = mf.vmap(reduce)(X), tf.vmap(reduce)(X)
    else:
        tangent = torch.ones_like(X)
        ours, theirs = mf.jvp(reduce, (X,), (tangent,))[1], tf.jvp(reduce, (X,), (tangent,))[1]
    same(ours, theirs)


# --- an empty batch ------------------------------------------------------------------------
EMPTY_BATCH = [("max", lambda a: a.max(), torch.float32), ("max", lambda a: a.max(), torch.int64),
               ("sum", lambda a: a.sum(), torch.float32), ("sum", lambda a: a.sum(), torch.int64),
               ("mean", lambda a: a.mean(), torch.float32),
               ("amin", lambda a: a.amin(), torch.int64), ("sin", lambda a: a.sin(), torch.float32)]


@pytest.mark.parametrize("name, f, dtype", EMPTY_BATCH, ids=[f"{n}-{d}" for n, _, d in EMPTY_BATCH])
def test_a_reduction_over_an_empty_batch(name, f, dtype):
    xs = torch.empty(0, dtype=dtype)
    same(mf.vmap(f)(xs), tf.vmap(f)(xs))
