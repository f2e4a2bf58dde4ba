"""The op table of the core tests, in the manner of PyTorch's OpInfo.

Each :class:`OpCase` is one user-level call (``torch.add(x, y)``, ``x[..., 0]``,
``F.cross_entropy(logits, target, reduction="sum")``, ...) written as a function of tensors,
with a generator of small random float64 sample inputs (fixed seeds) and the argnums of its
differentiable inputs. Integer inputs (class targets, gather indices) are ordinary arguments
that are never differentiated but are batched by vmap like the others.

``tests/test_core_ops.py`` runs every case under every transform and checks it against
torch.func; this module holds only data and the helpers that build inputs from it.

Input domains are chosen so that every derivative exists and finite differences agree with
it: positive inputs for log/sqrt/pow bases, values without ties for amax/amin, and values away
from the kinks of relu/abs and from the boundaries of comparisons (random float64 normals are,
for the fixed seeds).
"""
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

DTYPE = torch.float64
BATCH = 3  # examples per vmap batch


# --- input generators ------------------------------------------------------------------------
def normal(g, *shape):
    """Standard normal values."""
    return torch.randn(shape, generator=g, dtype=DTYPE)


def positive(g, *shape):
    """Values in [0.5, 2): for log, sqrt, pow bases and divisors."""
    return torch.rand(shape, generator=g, dtype=DTYPE) * 1.5 + 0.5


def distinct(g, *shape):
    """Values at least 0.2 apart, in random order: amax/amin never meet a tie."""
    n = 1
    for size in shape:
        n *= size
    order = torch.randperm(n, generator=g).to(DTYPE)
    jitter = torch.rand(n, generator=g, dtype=DTYPE) * 0.05
    return ((order + jitter) * 0.25 - n * 0.125).reshape(shape)


def indices(g, high, *shape):
    """int64 values in [0, high): class targets and gather indices."""
    return torch.randint(0, high, shape, generator=g)


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One user-level operation with sample inputs.

    name: the test id; fn: a function of tensors; make: generator -> tuple of inputs;
    diff: the argnums of the differentiable (float) inputs; hessian: whether the case is in
    the (slower) hessian subset.
    """

    name: str
    fn: Callable
    make: Callable
    diff: tuple = (0,)
    hessian: bool = False

    def sample(self, seed=0):
        g = torch.Generator().manual_seed(1000 + seed)
        return tuple(self.make(g))

    def batch(self, size=BATCH, seed=0):
        """``size`` independent samples stacked along a new dim 0."""
        samples = [self.sample(seed + 1 + i) for i in range(size)]
        return tuple(torch.stack(column) for column in zip(*samples))

    def __repr__(self):
        return self.name


def _case(name, fn, make, diff=(0,), hessian=False):
    return OpCase(name, fn, make, tuple(diff), hessian)


# --- the table -------------------------------------------------------------------------------
def _unary(name, fn, domain=normal, shape=(2, 3), hessian=True):
    return _case(name, fn, lambda g: (domain(g, *shape),), hessian=hessian)


def _binary(name, fn, x_shape=(2, 3), y_shape=(2, 3), x_domain=normal, y_domain=normal,
            hessian=False):
    return _case(name, fn, lambda g: (x_domain(g, *x_shape), y_domain(g, *y_shape)),
                 diff=(0, 1), hessian=hessian)


OPS: list[OpCase] = [
    # arithmetic, with broadcasting, scalars and reflected operators
    _binary("add", torch.add, hessian=True),
    _binary("add_broadcast_row", torch.add, (2, 3), (3,)),
    _binary("add_broadcast_outer", lambda x, y: x + y, (3, 1), (1, 4)),
    _binary("add_0d", lambda x, y: x + y, (2, 3), ()),
    _binary("add_alpha", lambda x, y: torch.add(x, y, alpha=2.0), (2, 3), (3,)),
    _unary("add_scalar", lambda x: x + 2.0, hessian=False),
    _unary("radd_scalar", lambda x: 2.0 + x, hessian=False),
    _binary("sub", torch.sub, (2, 3), (2, 1)),
    _binary("sub_alpha", lambda x, y: torch.sub(x, y, alpha=0.5)),
    _unary("rsub_scalar", lambda x: 1.5 - x, hessian=False),
    _binary("mul", torch.mul, hessian=True),
    _binary("mul_broadcast", lambda x, y: x * y, (4, 1, 3), (2, 1)),
    _unary("mul_scalar", lambda x: x * 3.0, hessian=False),
    _unary("rmul_scalar", lambda x: 3.0 * x, hessian=False),
    _binary("div", torch.div, y_domain=positive, hessian=True),
    _binary("div_broadcast", lambda x, y: x / y, (2, 3), (3,), y_domain=positive),
    _unary("div_scalar", lambda x: x / 4.0, hessian=False),
    _unary("rdiv_scalar", lambda x: 1.0 / x, positive),
    _unary("neg", torch.neg, hessian=False),
    _unary("neg_operator", lambda x: -x, hessian=False),
    _binary("pow_tensor", torch.pow, x_domain=positive, hessian=True),
    _binary("pow_tensor_broadcast", torch.pow, (2, 3), (3,), x_domain=positive),
    _unary("pow_int", lambda x: x ** 3),
    _unary("pow_float", lambda x: torch.pow(x, 2.5), positive),
    _unary("pow_zero", lambda x: x ** 0, hessian=False),
    _unary("rpow", lambda x: 2 ** x),
    _unary("rpow_tensor_base", lambda x: torch.pow(1.5, x)),
    # elementwise functions
    _unary("exp", torch.exp),
    _unary("log", torch.log, positive),
    _unary("sin", torch.sin),
    _unary("cos", torch.cos),
    _unary("tanh", torch.tanh),
    _unary("sigmoid", torch.sigmoid),
    _unary("relu", torch.relu),
    _unary("abs", torch.abs),
    _unary("sqrt", torch.sqrt, positive),
    _unary("exp_method", lambda x: x.exp().sin(), hessian=False),
    # comparisons, under where
    _binary("where_gt", lambda x, y: torch.where(x > y, x, y)),
    _binary("where_lt_mixed", lambda x, y: torch.where(x < y, x * y, x - y), hessian=True),
    _binary("where_ge_le", lambda x, y: torch.where(x >= 0, y, x) + torch.where(y <= 0.1, x, 2.0)),
    _binary("where_eq_ne", lambda x, y: torch.where(x == x, x, y) * torch.where(x != y, y, 0.0)),
    _binary("where_broadcast_cond", lambda x, y: torch.where(y > 0, x, -x), (2, 3), (3,)),
    _binary("where_method", lambda x, y: x.where(x.gt(y), y * 2)),
    # reductions
    _unary("sum_all", torch.sum, shape=(2, 3, 2)),
    _unary("sum_method", lambda x: x.sum(), hessian=False),
    _unary("sum_dim1", lambda x: torch.sum(x, 1), shape=(2, 3, 2)),
    _unary("sum_dims_keepdim", lambda x: x.sum(dim=(0, 2), keepdim=True), shape=(2, 3, 2)),
    _unary("sum_neg_dim_keepdim", lambda x: x.sum(-1, keepdim=True), shape=(2, 3)),
    _unary("sum_dim_none", lambda x: torch.sum(x, dim=None), hessian=False),
    _unary("mean_all", torch.mean, shape=(2, 3, 2)),
    _unary("mean_dim0", lambda x: x.mean(0), shape=(2, 3, 2)),
    _unary("mean_dims_keepdim", lambda x: torch.mean(x, (1, 2), keepdim=True), shape=(2, 3, 2)),
    _unary("amax_all", torch.amax, distinct),
    _unary("amax_dim1", lambda x: torch.amax(x, 1), distinct, shape=(2, 3, 2)),
    _unary("amax_keepdim", lambda x: x.amax(dim=(0, 2), keepdim=True), distinct, shape=(2, 3, 2)),
    _unary("amin_dim0", lambda x: torch.amin(x, 0), distinct),
    _unary("amin_keepdim", lambda x: x.amin(-1, keepdim=True), distinct),
    _unary("max_all", torch.max, distinct, hessian=False),
    _unary("min_all", lambda x: x.min(), distinct, hessian=False),
    _unary("logsumexp", lambda x: torch.logsumexp(x, 1)),
    _unary("logsumexp_keepdim", lambda x: x.logsumexp((0, 1), keepdim=True), hessian=False),
    _unary("softmax", lambda x: torch.softmax(x, -1)),
    _unary("softmax_dim0", lambda x: x.softmax(0), shape=(3, 2, 2)),
    _unary("log_softmax", lambda x: torch.log_softmax(x, 1)),
    _unary("log_softmax_dim0", lambda x: x.log_softmax(dim=0), shape=(3, 2, 2)),
    # linear algebra
    _binary("matmul_1d_1d", torch.matmul, (3,), (3,), hessian=True),
    _binary("matmul_1d_2d", torch.matmul, (3,), (3, 2)),
    _binary("matmul_2d_1d", torch.matmul, (2, 3), (3,)),
    _binary("matmul_2d_2d", torch.matmul, (2, 3), (3, 4), hessian=True),
    _binary("matmul_batched", torch.matmul, (2, 2, 3), (2, 3, 2)),
    _binary("matmul_broadcast_3d_2d", torch.matmul, (2, 2, 3), (3, 2)),
    _binary("matmul_broadcast_2d_3d", torch.matmul, (2, 3), (2, 3, 2)),
    _binary("matmul_broadcast_4d", torch.matmul, (2, 1, 2, 3), (2, 3, 2)),
    _binary("matmul_1d_3d", torch.matmul, (3,), (2, 3, 2)),
    _binary("matmul_3d_1d", torch.matmul, (2, 2, 3), (3,)),
    _binary("matmul_operator", lambda x, y: x @ y, (2, 3), (3, 2)),
    _binary("matmul_outer", torch.matmul, (3, 1), (1, 2)),
    _binary("dot", torch.dot, (3,), (3,)),
    _binary("mm", torch.mm, (2, 3), (3, 2)),
    _binary("mv", torch.mv, (2, 3), (3,)),
    _binary("bmm", torch.bmm, (2, 2, 3), (2, 3, 2)),
    # shape
    _unary("transpose", lambda x: torch.transpose(x, 0, 1), hessian=False),
    _unary("transpose_neg", lambda x: x.transpose(-1, -3), shape=(2, 3, 2), hessian=False),
    _unary("permute", lambda x: x.permute(2, 0, 1), shape=(2, 3, 2), hessian=False),
    _unary("T", lambda x: x.T, hessian=False),
    _unary("t", torch.t, hessian=False),
    _unary("mT", lambda x: x.mT.sin(), shape=(2, 3, 2)),
    _unary("reshape", lambda x: x.reshape(3, 2), hessian=False),
    _unary("reshape_infer", lambda x: torch.reshape(x, (-1, 2)), shape=(2, 3, 2), hessian=False),
    _unary("view", lambda x: x.view(6), hessian=False),
    _unary("flatten", torch.flatten, shape=(2, 3, 2), hessian=False),
    _unary("flatten_start", lambda x: x.flatten(1), shape=(2, 3, 2), hessian=False),
    _unary("unsqueeze", lambda x: x.unsqueeze(1), hessian=False),
    _unary("unsqueeze_neg", lambda x: torch.unsqueeze(x, -1), hessian=False),
    _unary("squeeze_all", torch.squeeze, shape=(2, 1, 3, 1), hessian=False),
    _unary("squeeze_dim", lambda x: x.squeeze(1), shape=(2, 1, 3, 1), hessian=False),
    _unary("expand", lambda x: x.expand(2, 4, 3), shape=(4, 1), hessian=False),
    _unary("expand_minus_one", lambda x: x.expand(3, -1, 2), shape=(4, 1), hessian=False),
    _unary("broadcast_to", lambda x: torch.broadcast_to(x, (2, 3)), shape=(3,), hessian=False),
    _binary("expand_as", lambda x, y: x.expand_as(y) * y, (3, 1), (3, 2)),
    _binary("cat_dim0", lambda x, y: torch.cat([x, y]), (2, 3), (1, 3)),
    _binary("cat_dim1", lambda x, y: torch.cat((x, y), dim=1), (2, 3), (2, 2)),
    _binary("cat_neg_dim", lambda x, y: torch.cat([x, y, x], -1), (2, 1), (2, 2)),
    _binary("stack_dim0", lambda x, y: torch.stack([x, y]), (2, 3), (2, 3)),
    _binary("stack_dim1", lambda x, y: torch.stack((x, y), dim=1), (2, 3), (2, 3)),
    _binary("stack_dim_last", lambda x, y: torch.stack([x, y], -1), (3,), (3,)),
    # indexing
    _unary("index_int", lambda x: x[1], shape=(3, 2), hessian=False),
    _unary("index_neg_int", lambda x: x[-1], shape=(3, 2), hessian=False),
    _unary("index_two_ints", lambda x: x[0, -1], shape=(3, 2), hessian=False),
    _unary("index_slice", lambda x: x[:, 1:3], shape=(2, 4), hessian=False),
    _unary("index_step", lambda x: x[::2], shape=(5, 2), hessian=False),
    _unary("index_neg_slice", lambda x: x[-2:, :-1], shape=(3, 3), hessian=False),
    _unary("index_none", lambda x: x[None], hessian=False),
    _unary("index_ellipsis", lambda x: x[..., 0], shape=(2, 3, 2), hessian=False),
    _unary("index_mixed", lambda x: x[1, ..., None, -1], shape=(2, 3, 2), hessian=False),
    _unary("index_none_middle", lambda x: x[:, None, 1:], shape=(2, 3), hessian=False),
    # diagonals
    _unary("diag_1d", torch.diag, shape=(3,), hessian=False),
    _unary("diag_1d_offset", lambda x: torch.diag(x, 1), shape=(3,), hessian=False),
    _unary("diag_2d", torch.diag, shape=(3, 3), hessian=False),
    _unary("diag_2d_offset", lambda x: x.diag(-1), shape=(3, 4), hessian=False),
    _unary("diagonal", torch.diagonal, shape=(3, 4), hessian=False),
    _unary("diagonal_dims", lambda x: x.diagonal(1, 0, 2), shape=(3, 2, 4), hessian=False),
    _unary("trace", torch.trace, shape=(3, 3), hessian=False),
    _unary("trace_of_product", lambda x: torch.trace(x @ x.T), shape=(3, 3)),
    # creation
    _unary("zeros_like", torch.zeros_like, hessian=False),
    _unary("ones_like", torch.ones_like, hessian=False),
    _unary("ones_like_times", lambda x: torch.ones_like(x) * x.sum()),
    # torch.nn.functional
    _case("linear", F.linear,
          lambda g: (normal(g, 3, 4), normal(g, 2, 4), normal(g, 2)), diff=(0, 1, 2),
          hessian=True),
    _case("linear_no_bias", F.linear,
          lambda g: (normal(g, 3, 4), normal(g, 2, 4)), diff=(0, 1)),
    _case("linear_1d", F.linear,
          lambda g: (normal(g, 4), normal(g, 2, 4), normal(g, 2)), diff=(0, 1, 2)),
    _case("linear_3d", F.linear,
          lambda g: (normal(g, 2, 3, 4), normal(g, 5, 4), normal(g, 5)), diff=(0, 1, 2)),
    _case("linear_broadcast_bias", F.linear,
          lambda g: (normal(g, 3, 4), normal(g, 2, 4), normal(g, 1)), diff=(0, 1, 2)),
    _case("linear_vector_weight", F.linear,
          lambda g: (normal(g, 3, 4), normal(g, 4)), diff=(0, 1)),
    _unary("F.relu", F.relu),
    _unary("F.tanh", F.tanh),
    _unary("F.sigmoid", F.sigmoid),
    _unary("F.softmax", lambda x: F.softmax(x, dim=-1)),
    _unary("F.log_softmax", lambda x: F.log_softmax(x, dim=1)),
    _case("cross_entropy", F.cross_entropy,
          lambda g: (normal(g, 4, 3), indices(g, 3, 4)), hessian=True),
    _case("cross_entropy_sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"),
          lambda g: (normal(g, 4, 3), indices(g, 3, 4))),
    _case("cross_entropy_none", lambda x, t: F.cross_entropy(x, t, reduction="none"),
          lambda g: (normal(g, 4, 3), indices(g, 3, 4))),
    _case("cross_entropy_1d", F.cross_entropy,
          lambda g: (normal(g, 3), indices(g, 3))),
    _binary("mse_loss", F.mse_loss, (2, 3), (2, 3), hessian=True),
    _binary("mse_loss_sum", lambda x, y: F.mse_loss(x, y, reduction="sum")),
    _binary("mse_loss_none", lambda x, y: F.mse_loss(x, y, reduction="none")),
    _case("gather_dim1", lambda x, i: torch.gather(x, 1, i),
          lambda g: (normal(g, 2, 4), indices(g, 4, 2, 3)), hessian=True),
    _case("gather_dim0", lambda x, i: x.gather(0, i),
          lambda g: (normal(g, 3, 2), indices(g, 3, 4, 2))),
    _case("cross_entropy_probs", F.cross_entropy,
          lambda g: (normal(g, 4, 3), torch.softmax(normal(g, 4, 3), 1)), diff=(0, 1)),
    _case("nll_loss", lambda x, t: F.nll_loss(F.log_softmax(x, 1), t),
          lambda g: (normal(g, 4, 3), indices(g, 3, 4))),
    # the softmax vjps, torch's kernels, as torch's own backward graphs call them (aten door)
    _case("softmax_backward_data",
          lambda ct, x: torch.ops.aten._softmax_backward_data(ct, torch.softmax(x, 1), 1,
                                                                x.dtype),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    # gelu's vjp, torch's kernel (its second derivatives are the engine's formulas)
    _case("gelu_backward", lambda ct, x: torch.ops.aten.gelu_backward(ct, x),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _case("gelu_backward_tanh",
          lambda ct, x: torch.ops.aten.gelu_backward(ct, x, approximate="tanh"),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _unary("gelu", F.gelu),
    _unary("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    # softplus's and elu's vjps, torch's kernels too; silu and exp2 multiply factor by factor
    _case("softplus_backward",
          lambda ct, x: torch.ops.aten.softplus_backward(ct, x, 2.0, 1.5),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _case("elu_backward",
          lambda ct, x: torch.ops.aten.elu_backward(ct, 0.7, 1.2, 0.9, False, x),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _case("elu_backward_of_result",
          lambda ct, x: torch.ops.aten.elu_backward(ct, 0.7, 1.2, 0.9, True,
                                                    torch.ops.aten.elu(x, 0.7, 1.2, 0.9)),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _case("log_sigmoid_backward",
          lambda ct, x: torch.ops.aten.log_sigmoid_backward(
              ct, x, torch.ops.aten.log_sigmoid_forward(x)[1]),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    _unary("logsigmoid", F.logsigmoid),
    _unary("softplus", lambda x: F.softplus(x, 2.0, 1.5)),
    _unary("elu", lambda x: F.elu(x, 0.7)),
    _unary("selu", F.selu),
    _unary("celu", lambda x: F.celu(x, 0.5)),
    _unary("silu", F.silu),
    _unary("exp2", torch.exp2),
    _case("log_softmax_backward_data",
          lambda ct, x: torch.ops.aten._log_softmax_backward_data(
              ct, torch.log_softmax(x, 0), 0, x.dtype),
          lambda g: (normal(g, 2, 3), normal(g, 2, 3)), diff=(0, 1), hessian=True),
    # mixed with plain tensors, bools and ints; shapes read in Python
    _unary("plain_tensor_left",
           lambda x: torch.arange(3.0, dtype=DTYPE) * x - torch.ones(3, dtype=DTYPE),
           hessian=False),
    _unary("mul_bool_mask", lambda x: x * (x > 0), hessian=False),
    _unary("float_mask", lambda x: (x > 0).to(DTYPE) * x.sin()),
    _case("add_int_tensor", lambda x, i: x + i, lambda g: (normal(g, 2, 3), indices(g, 5, 3))),
    _unary("square", lambda x: torch.square(x) + x.pow(2)),
    _unary("pow_self", lambda x: x ** x, positive),
    _unary("sum_list_dims", lambda x: x.sum([0, 2]), shape=(2, 3, 2), hessian=False),
    _unary("diag_embed", torch.diag_embed, shape=(2, 3), hessian=False),
    _unary("shape_arithmetic", lambda x: x.reshape(x.shape[0] * x.size(1)) * len(x),
           hessian=False),
    _unary("type_as_clone", lambda x: x.clone().type_as(x).contiguous() * 2, hessian=False),
    # a small composite: a two-layer network on one example
    _case("mlp", lambda x, w1, w2: torch.tanh(x @ w1).relu() @ w2,
          lambda g: (normal(g, 3), normal(g, 3, 4), normal(g, 4, 2)), diff=(0, 1, 2),
          hessian=True),
]

OPS_BY_NAME = {case.name: case for case in OPS}
assert len(OPS_BY_NAME) == len(OPS), "two op cases share a name"
