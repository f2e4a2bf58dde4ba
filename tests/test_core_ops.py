"""Every op of the op table under every transform, checked against torch.func.

A transform is written once, as a function of a transform namespace (``minifunctorch.core``
or ``torch.func``) and an op case, and run with both: torch.func is the oracle. Test ids name
the op and the transform (``test_op_under_transform[matmul_1d_2d-jacrev]``).
"""
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core import ops
from op_table import DTYPE, OPS
from oracle import (aten_calls, assert_same, check_finite_differences, check_under_transform,
                    transform_params)

# torch.func scripts its decompositions on first use; torch deprecates torch.jit.script
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


@pytest.mark.parametrize("case, transform", list(transform_params(OPS)))
def test_op_under_transform(case, transform):
    check_under_transform(case, transform)



def test_every_op_is_in_the_hessian_subset_or_not_on_purpose():
    """The hessian subset covers each kind of op: elementwise, binary, reductions, matmul, nn."""
    subset = {case.name for case in OPS if case.hessian}
    for name in ("sin", "mul", "div", "softmax", "logsumexp", "matmul_2d_2d", "linear",
                 "cross_entropy", "gather_dim1", "mlp", "amax_dim1"):
        assert name in subset, name


# --- finite differences ------------------------------------------------------------------------
@pytest.mark.parametrize("case", OPS, ids=[case.name for case in OPS])
def test_grad_matches_finite_differences(case):
    check_finite_differences(case)


# --- broadcasting binary ops over generated shapes ----------------------------------------------
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul,
          "div": lambda x, y: x / (y * y + 0.5), "where": lambda x, y: torch.where(x > y, x, y * 2)}


@pytest.mark.parametrize("name", list(BINARY))
@hypothesis.settings(max_examples=12, deadline=None, derandomize=True, database=None)
@hypothesis.given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3,
                                                           max_side=3),
                  batched=st.sampled_from([(0, 0), (0, None), (None, 0), (-1, 1)]))
def test_broadcasting_binary_ops(name, shapes, batched):
    f = BINARY[name]
    x_shape, y_shape = shapes.input_shapes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g, dtype=DTYPE)
    y = torch.randn(y_shape, generator=g, dtype=DTYPE)
    weights = torch.randn(shapes.result_shape, generator=g, dtype=DTYPE)

    def scalarized(a, b):
        return (f(a, b) * weights).sum()
    assert_same(mf.grad(scalarized, argnums=(0, 1))(x, y),
                tf.grad(scalarized, argnums=(0, 1))(x, y))
    tangents = (torch.randn(x_shape, generator=g, dtype=DTYPE),
                torch.randn(y_shape, generator=g, dtype=DTYPE))
    assert_same(mf.jvp(f, (x, y), tangents), tf.jvp(f, (x, y), tangents))

    inputs, in_dims = [], []
    for value, dim in zip((x, y), batched):
        if dim is None:
            inputs.append(value)
        else:
            dim = min(dim, value.dim()) if dim >= 0 else dim
            stacked = torch.stack([value, value * 2, -value])
            inputs.append(torch.movedim(stacked, 0, dim))
        in_dims.append(dim)
    in_dims = tuple(in_dims)
    assert_same(mf.vmap(f, in_dims=in_dims)(*inputs), tf.vmap(f, in_dims=in_dims)(*inputs))
    assert_same(mf.vmap(mf.grad(scalarized, argnums=(0, 1)), in_dims=in_dims)(*inputs),
                tf.vmap(tf.grad(scalarized, argnums=(0, 1)), in_dims=in_dims)(*inputs))


VECTOR_LAYOUTS = {  # (B=5, k=7) examples along dim 0, as batching rules receive them
    "contiguous": lambda: torch.randn(5, 7, dtype=torch.float32),
    "transposed": lambda: torch.randn(7, 5, dtype=torch.float32).T,
    "strided": lambda: torch.randn(5, 14, dtype=torch.float32)[:, ::2],
    "every other row": lambda: torch.randn(10, 7, dtype=torch.float32)[::2],
    "expanded": lambda: torch.randn(1, 7, dtype=torch.float32).expand(5, 7),
}
MATRIX_LAYOUTS = {
    "contiguous": lambda: torch.randn(7, 3, dtype=torch.float32),
    "transposed": lambda: torch.randn(3, 7, dtype=torch.float32).T,
    "strided": lambda: torch.randn(7, 6, dtype=torch.float32)[:, ::2],
}


@pytest.mark.parametrize("vector", list(VECTOR_LAYOUTS))
@pytest.mark.parametrize("matrix", list(MATRIX_LAYOUTS))
@pytest.mark.parametrize("in_dim", [0, 1])
def test_a_batch_of_vectors_times_a_matrix_has_torch_funcs_bits(vector, matrix, in_dim):
    # matmul_batch makes a contiguous (B, k) @ (k, n) one matrix product, and every other
    # layout a (B, 1, k) @ (k, n) that torch.matmul folds its own way: both as torch.func
    torch.manual_seed(0)
    xs, m = VECTOR_LAYOUTS[vector](), MATRIX_LAYOUTS[matrix]()
    xs = xs if in_dim == 0 else xs.T

    def f(v):
        return v @ m
    assert torch.equal(mf.vmap(f, in_dims=in_dim)(xs), tf.vmap(f, in_dims=in_dim)(xs))
    nested = torch.stack([xs, 2 * xs])
    assert torch.equal(mf.vmap(mf.vmap(f, in_dims=in_dim))(nested),
                       tf.vmap(tf.vmap(f, in_dims=in_dim))(nested))
    # a jacrev pulls back the identity's rows through ``m.T @ v``: a (B, k) @ (k, n) product
    a = m.T.contiguous()

    def g(v):
        return torch.tanh(a @ torch.sin(v))
    example = xs[0] if in_dim == 0 else xs[:, 0]
    assert torch.equal(mf.jacrev(g)(example), tf.jacrev(g)(example))


@pytest.mark.parametrize("shapes", [
    [(3, 1), (1, 4)], [(2, 3, 4), (4,)], [(), (5,)], [(0,), (1,)], [(1, 0), (3, 1)],
    [(2, 1, 3), (1, 4, 1), (4, 3)], [(7,)], [], [(1,), ()], [torch.Size([2, 1]), [1, 5]],
])
def test_broadcast_shapes_is_torchs(shapes):
    # ops.broadcast_shapes replaces torch.broadcast_shapes in the rules (about 60 us a call)
    assert ops.broadcast_shapes(*shapes) == tuple(torch.broadcast_shapes(*shapes))


@pytest.mark.parametrize("shapes", [[(3,), (4,)], [(2, 3), (3, 2)], [(0,), (2,)],
                                    [(5, 2, 2), (3, 1)]])
def test_broadcast_shapes_refuses_what_torch_refuses(shapes):
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes(*shapes)
    with pytest.raises(mf.ShapeMismatchError, match=r"^mse_loss: Shape mismatch: objects "
                       r"cannot be broadcast to a single shape\. .* Fix: "):
        ops.broadcast_shapes(*shapes, op="mse_loss")


def test_a_reflected_operator_called_unbound_with_a_number_as_self_is_refused():
    # Tensor.__rdiv__(self, other) is other / self; torch fails when self is a number, and
    # the engine must not compute other / self with the roles swapped (OpInfo's __rdiv__)
    xs = torch.arange(1.0, 7.0).reshape(2, 3)
    with pytest.raises(mf.TransformUsageError, match=r"Tensor.__rdiv__\(self, other\)"):
        mf.vmap(lambda t: torch.Tensor.__rdiv__(2, t))(xs)
    torch.testing.assert_close(mf.vmap(lambda t: 2 / t)(xs), 2 / xs)
    torch.testing.assert_close(mf.vmap(lambda t: 2 - t)(xs), 2 - xs)
    # __rpow__'s body is pow(other, self) whatever self is: torch computes t ** 2 here
    torch.testing.assert_close(mf.vmap(lambda t: torch.Tensor.__rpow__(2.0, t))(xs),
                               torch.Tensor.__rpow__(2.0, xs))


def test_square_is_torchs_pow_of_two():
    """torch.square is pow(x, 2) in torch: its dtype for bools (int64), its bits for complex64
    (x * x rounds differently there), and a backward of ct * (2 x): two kernels, where the
    product x * x pulls back by two products and their sum (the fan-in chapter 1 shows)."""
    flags = torch.tensor([True, False, True])
    assert mf.vmap(torch.square)(flags[:, None]).dtype == torch.square(flags).dtype == torch.int64
    z = torch.randn(64, 5, dtype=torch.complex64)
    assert torch.equal(mf.vmap(torch.square)(z), tf.vmap(torch.square)(z))
    x = torch.randn(64, 5)

    def f(x):
        return x.square().sum()
    calls, ours = aten_calls(lambda: mf.grad(f)(x))
    assert calls.get("aten::mul") == 2 and "aten::add" not in calls, calls
    assert torch.equal(ours, tf.grad(f)(x))
    assert torch.equal(mf.vmap(mf.grad(f))(x[:, None]), tf.vmap(tf.grad(f))(x[:, None]))
