"""The structural family (core/structural.py): reductions, values with indices, scans and
shape ops, each case checked under every transform against torch.func (tests/oracle.py).

Ops that return indices are checked through a float output that depends on them
(``values * (indices + 1)``), so that a wrong index shows up in every transform.
"""
import dataclasses
import itertools
import math

import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core import torch_api
from minifunctorch.core.errors import TransformUsageError
from op_table import DTYPE, OpCase, distinct, normal, positive
from oracle import (
    TRANSFORMS,
    assert_same,
    check_finite_differences,
    check_under_transform,
    t_hessian,
    transform_params,
)

aten = torch.ops.aten
prims = torch.ops.prims
INF = float("inf")
NAN = float("nan")


# --- inputs --------------------------------------------------------------------------------------
def with_zeros(*places, shape=(2, 3)):
    """Normal values with zeros at ``places`` (flat indices)."""
    def make(g):
        x = normal(g, *shape).reshape(-1)
        x[list(places)] = 0.0
        return (x.reshape(shape),)
    return make


def with_ties(shape=(3, 4), levels=3):
    """Values from a few levels, so that maxima, medians and modes are tied."""
    def make(g):
        return (torch.randint(0, levels, shape, generator=g).to(DTYPE) * 0.5 - 0.5,)
    return make


def with_nan(shape=(3, 4)):
    def make(g):
        x = distinct(g, *shape).reshape(-1)
        x[1] = float("nan")
        return (x.reshape(shape),)
    return make


def case(name, fn, make, diff=(0,), hessian=False):
    return OpCase(name, fn, make, tuple(diff), hessian)


def unary(name, fn, domain=normal, shape=(3, 4), hessian=False):
    return case(name, fn, lambda g: (domain(g, *shape),), hessian=hessian)


def binary(name, fn, x_shape=(3, 4), y_shape=(3, 4), domain=normal, hessian=False):
    return case(name, fn, lambda g: (domain(g, *x_shape), domain(g, *y_shape)), (0, 1),
                hessian)


def weighted(result):
    """A float output that depends on both halves of a (values, indices) result."""
    values, index = result
    return values * (index + 1)


def pieces(parts):
    """A tuple of pieces (split, unbind) as one tensor, each piece weighted differently."""
    return torch.cat([p.reshape(-1) * (i + 1) for i, p in enumerate(parts)])


# --- the cases -----------------------------------------------------------------------------------
REDUCTIONS = [
    unary("prod_all", torch.prod, hessian=True),
    unary("prod_dim", lambda x: x.prod(1), hessian=True),
    unary("prod_keepdim", lambda x: torch.prod(x, 0, keepdim=True)),
    unary("prod_dtype", lambda x: torch.prod(x, -1, dtype=torch.float64)),
    unary("prod_0d", torch.prod, shape=()),
    case("prod_one_zero", torch.prod, with_zeros(4), hessian=True),
    case("prod_two_zeros", torch.prod, with_zeros(1, 4), hessian=True),
    case("prod_three_zeros", torch.prod, with_zeros(0, 2, 5), hessian=True),
    case("prod_dim_zeros", lambda x: x.prod(1), with_zeros(1, 3, 5, shape=(3, 3)),
         hessian=True),
    case("prod_back_door", lambda x: aten.prod.dim_int(x, 0), with_zeros(2)),
    unary("prims_prod", lambda x: prims.prod(x, [0, 2]), shape=(2, 3, 2)),
    unary("var_all", torch.var, hessian=True),
    unary("var_dim", lambda x: x.var(1)),
    unary("var_correction0_keepdim", lambda x: torch.var(x, 0, correction=0, keepdim=True)),
    unary("var_dims_list", lambda x: x.var([0, 2], correction=2), shape=(2, 3, 2)),
    unary("var_unbiased_false", lambda x: torch.var(x, False)),
    unary("var_dim_unbiased_keepdim", lambda x: torch.var(x, 1, False, True)),
    unary("var_0d", lambda x: torch.var(x, correction=0), shape=()),
    unary("var_empty_dims", lambda x: torch.var(x, [], keepdim=True)),
    unary("std_empty_dims", lambda x: x.std(dim=())),
    unary("vector_norm_empty_dims", lambda x: torch.linalg.vector_norm(x, 3, [])),
    unary("var_back_door", lambda x: aten.var.correction(x, [1], correction=1)),
    unary("prims_var", lambda x: prims.var(x, [1], 0.0)),
    unary("std_all", torch.std, hessian=True),
    unary("std_dim_keepdim", lambda x: x.std(0, keepdim=True)),
    unary("std_correction", lambda x: torch.std(x, dim=(0, 1), correction=0)),
    case("std_constant_rows", lambda x: x.std(1),
         lambda g: (normal(g, 3, 1).expand(3, 4).clone(),)),
    unary("var_mean", lambda x: torch.stack(torch.var_mean(x, 1))),
    unary("std_mean", lambda x: torch.stack(torch.std_mean(x, dim=0, correction=0))),
    unary("std_mean_back_door", lambda x: torch.stack(aten.std_mean.correction(x, [1]))),
    unary("norm_default", torch.norm, hessian=True),
    unary("norm_p3_dim", lambda x: x.norm(3, dim=1), hessian=True),
    unary("norm_fro_dims", lambda x: torch.norm(x, "fro", dim=(0, 1), keepdim=True)),
    unary("norm_back_door", lambda x: aten.norm.ScalarOpt_dim(x, 2, [0])),
    unary("vector_norm_2", lambda x: torch.linalg.vector_norm(x, dim=1), hessian=True),
    unary("vector_norm_1", lambda x: torch.linalg.vector_norm(x, 1, 0)),
    unary("vector_norm_inf", lambda x: torch.linalg.vector_norm(x, INF, 1), distinct),
    unary("vector_norm_neg_inf", lambda x: torch.linalg.vector_norm(x, -INF), distinct),
    unary("vector_norm_0", lambda x: torch.linalg.vector_norm(x, 0, 1) * x.sum(1)),
    unary("vector_norm_half", lambda x: torch.linalg.vector_norm(x, 0.5, 1), positive),
    unary("vector_norm_1_5", lambda x: torch.linalg.vector_norm(x, 1.5, (0, 1)), hessian=True),
    unary("vector_norm_4_keepdim", lambda x: torch.linalg.vector_norm(x, 4, 0, keepdim=True)),
    unary("vector_norm_neg1", lambda x: torch.linalg.vector_norm(x, -1, 1), positive),
    unary("vector_norm_dtype", lambda x: torch.linalg.vector_norm(x, dtype=torch.float64)),
    # NOTE [The Frobenius norm at the front door]; the other orders go through the back door
    unary("matrix_norm_fro", torch.linalg.matrix_norm, hessian=True),
    unary("matrix_norm_fro_dims_keepdim",
          lambda x: torch.linalg.matrix_norm(x, dim=(1, 0), keepdim=True), shape=(3, 4, 2)),
    unary("matrix_norm_1", lambda x: torch.linalg.matrix_norm(x, 1), distinct),
    unary("linalg_norm_default", lambda x: torch.linalg.norm(x), shape=(2, 3, 4), hessian=True),
    unary("linalg_norm_fro", lambda x: torch.linalg.norm(x, "fro")),
    unary("linalg_norm_dims", lambda x: torch.linalg.norm(x, dim=(0, -1)), shape=(2, 3, 4)),
    unary("linalg_norm_vector_dim", lambda x: torch.linalg.norm(x, 3, dim=1)),
    unary("linalg_norm", lambda x: torch.linalg.norm(x, dim=0)),
    unary("norm_0d", lambda x: torch.linalg.vector_norm(x, 3), shape=()),
    # the subgradients at zero
    case("norm_2_at_zero", lambda x: torch.linalg.vector_norm(x, dim=1),
         lambda g: (torch.cat([torch.zeros(1, 4, dtype=DTYPE), normal(g, 2, 4)]),)),
    *[case(f"norm_{p}_at_zero", lambda x, p=p: torch.linalg.vector_norm(x, p, dim=1),
           lambda g: (torch.cat([torch.zeros(1, 4, dtype=DTYPE), positive(g, 2, 4)]),))
      for p in (1, INF, -INF, 0.5, 1.5, 3)],
    case("dist", torch.dist, lambda g: (normal(g, 3, 4), normal(g, 3, 4)), (0, 1)),
    case("dist_p1", lambda x, y: torch.dist(x, y, 1), lambda g: (normal(g, 4), normal(g, 4)),
         (0, 1)),
    case("dist_same", lambda x, y: torch.dist(x, y), lambda g: (normal(g, 4),) * 2, (0, 1)),
    unary("renorm", lambda x: x.renorm(2, 0, 1.0), shape=(3, 4)),
    case("nansum", torch.nansum, with_nan()),
    case("nanmean_dim", lambda x: x.nanmean(1), with_nan()),
    unary("count_nonzero", lambda x: x.sum(1) * torch.count_nonzero(x > 0, dim=1)),
    unary("aminmax", lambda x: torch.stack(torch.aminmax(x, dim=1)), distinct),
    unary("prims_sum", lambda x: prims.sum(x, [1])),
    unary("prims_amax", lambda x: prims.amax(x, [0]), distinct),
    unary("prims_amin", lambda x: prims.amin(x, [0, 1]), distinct),
]

WITH_INDICES = [
    unary("max_all", torch.max, distinct),
    case("max_all_ties", lambda x: x.max(), with_ties()),
    case("min_all_ties", torch.min, with_ties()),
    unary("max_dim", lambda x: weighted(torch.max(x, 1)), distinct, hessian=True),
    unary("max_dim_keepdim", lambda x: weighted(x.max(0, keepdim=True)), distinct),
    unary("max_dim_kwargs", lambda x: torch.max(x, dim=-1, keepdim=False).values, distinct),
    case("max_dim_ties", lambda x: weighted(torch.max(x, 1)), with_ties()),
    unary("min_dim", lambda x: weighted(torch.min(x, 0)), distinct),
    unary("max_0d", lambda x: weighted(torch.max(x, 0)), shape=()),
    binary("max_binary", torch.max, domain=distinct),
    binary("min_binary", lambda x, y: x.min(y), domain=distinct),
    unary("aten_max_dim", lambda x: weighted(aten.max.dim(x, 1)), distinct),
    unary("aten_min_all", lambda x: aten.min.default(x), distinct),
    unary("argmax_all", lambda x: x * x.argmax(), distinct),
    unary("argmax_dim", lambda x: x.sum(1) * torch.argmax(x, 1), distinct),
    unary("argmin_keepdim", lambda x: x * torch.argmin(x, 0, keepdim=True), distinct),
    unary("argmax_all_keepdim", lambda x: x * torch.argmax(x, keepdim=True), distinct),
    case("argmin_ties", lambda x: x * x.argmin(1, True), with_ties()),
    unary("sort", lambda x: weighted(torch.sort(x)), distinct, hessian=True),
    unary("sort_descending_dim0", lambda x: weighted(x.sort(0, descending=True)), distinct),
    case("sort_stable_ties", lambda x: weighted(torch.sort(x, dim=1, stable=True)),
         with_ties()),
    unary("sort_back_door", lambda x: weighted(aten.sort.default(x, 0)), distinct),
    unary("argsort", lambda x: x * torch.argsort(x, 1, descending=True), distinct),
    unary("msort", torch.msort, distinct),
    unary("topk", lambda x: weighted(torch.topk(x, 2)), distinct, hessian=True),
    unary("topk_smallest_dim0", lambda x: weighted(x.topk(2, 0, largest=False)), distinct),
    unary("topk_unsorted", lambda x: torch.topk(x, 3, sorted=False).values.sum(-1), distinct),
    unary("kthvalue", lambda x: weighted(torch.kthvalue(x, 2)), distinct),
    unary("kthvalue_dim0_keepdim", lambda x: weighted(x.kthvalue(1, 0, True)), distinct),
    unary("median_all", torch.median, distinct),
    case("median_all_ties", torch.median, with_ties()),
    unary("median_dim", lambda x: weighted(torch.median(x, 1)), distinct),
    case("median_dim_ties", lambda x: weighted(x.median(0, keepdim=True)), with_ties()),
    case("nanmedian_all", torch.nanmedian, with_nan()),
    case("nanmedian_dim", lambda x: weighted(torch.nanmedian(x, 1)), with_nan()),
    case("mode", lambda x: weighted(torch.mode(x)), with_ties()),
    case("mode_dim0_keepdim", lambda x: weighted(x.mode(0, True)), with_ties()),
    unary("cummax", lambda x: weighted(torch.cummax(x, 1)), distinct),
    case("cummax_ties", lambda x: weighted(torch.cummax(x, 1)), with_ties()),
    unary("cummin_dim0", lambda x: weighted(x.cummin(0)), distinct),
]

SCANS = [
    unary("cumsum", lambda x: torch.cumsum(x, 1), hessian=True),
    unary("cumsum_dim0_method", lambda x: x.cumsum(0)),
    unary("cumsum_dtype", lambda x: torch.cumsum(x, -1, dtype=torch.float64)),
    unary("cumsum_0d", lambda x: torch.cumsum(x, 0), shape=()),
    unary("cumprod", lambda x: torch.cumprod(x, 1), hessian=True),
    unary("cumprod_long", lambda x: x.cumprod(0), shape=(11, 2), hessian=True),
    case("cumprod_one_zero", lambda x: torch.cumprod(x, 1), with_zeros(2, shape=(2, 5)),
         hessian=True),
    case("cumprod_two_zeros", lambda x: torch.cumprod(x, 1),
         with_zeros(1, 3, 6, shape=(2, 5)), hessian=True),
    case("cumprod_leading_zero", lambda x: x.cumprod(-1), with_zeros(0, 5, shape=(2, 5)),
         hessian=True),
    unary("logcumsumexp", lambda x: torch.logcumsumexp(x, 1), hessian=True),
    unary("logcumsumexp_dim0", lambda x: x.logcumsumexp(0) * 3),
    case("logcumsumexp_wide_range", lambda x: torch.logcumsumexp(x, 0),
         lambda g: (normal(g, 5, 2) * 200,)),
    unary("cumulative_trapezoid", lambda x: torch.cumulative_trapezoid(x, dim=1)),
    unary("trapezoid", lambda x: torch.trapezoid(x, dx=0.5)),
    case("trapz_x", torch.trapz, lambda g: (normal(g, 3, 4), positive(g, 4).cumsum(0)), (0, 1)),
]

SHAPES = [
    unary("flip", lambda x: torch.flip(x, (0,))),
    unary("flip_dims", lambda x: x.flip(0, -1), shape=(2, 3, 2)),
    unary("fliplr", torch.fliplr),
    unary("flipud", torch.flipud),
    unary("flip_back_door", lambda x: aten.flip.default(x, [1])),
    unary("prims_rev", lambda x: prims.rev(x, [0, 1])),
    unary("roll", lambda x: torch.roll(x, 1, 0)),
    unary("roll_dims", lambda x: x.roll((2, -1), (1, 0))),
    unary("roll_flat", lambda x: torch.roll(x, 5)),
    unary("roll_back_door", lambda x: aten.roll.default(x, [1], [1])),
    unary("rot90", torch.rot90),
    unary("rot90_k2", lambda x: torch.rot90(x, 2, (0, 1))),
    unary("rot90_k3_dims", lambda x: x.rot90(-1, [1, 2]), shape=(2, 3, 2)),
    unary("repeat", lambda x: x.repeat(2, 1, 3)),
    unary("repeat_back_door", lambda x: aten.repeat.default(x, [1, 2])),
    unary("tile", lambda x: torch.tile(x, (2,))),
    unary("repeat_interleave", lambda x: x.repeat_interleave(2, dim=1)),
    unary("repeat_interleave_flat", lambda x: torch.repeat_interleave(x, 3)),
    unary("repeat_interleave_tensor",
          lambda x: torch.repeat_interleave(x, torch.tensor([1, 0, 3]), dim=0), shape=(3, 2)),
    unary("tril", torch.tril, shape=(4, 4)),
    unary("triu_offset", lambda x: x.triu(1)),
    unary("narrow", lambda x: torch.narrow(x, 1, 1, 2)),
    unary("narrow_method_neg", lambda x: x.narrow(-1, -3, 2)),
    unary("select", lambda x: x.select(1, -1)),
    unary("select_fn", lambda x: torch.select(x, 0, 1)),
    unary("split", lambda x: pieces(torch.split(x, 2, 1))),
    unary("split_list", lambda x: pieces(x.split([1, 2], 0))),
    unary("split_with_sizes", lambda x: pieces(x.split_with_sizes([3, 1], dim=1))),
    unary("split_back_door", lambda x: pieces(aten.split.Tensor(x, 2))),
    unary("chunk", lambda x: pieces(torch.chunk(x, 3, 1))),
    unary("chunk_uneven", lambda x: pieces(x.chunk(2)), shape=(5, 2)),
    unary("tensor_split", lambda x: pieces(torch.tensor_split(x, 3, dim=1)), shape=(2, 7)),
    unary("tensor_split_indices", lambda x: pieces(x.tensor_split([1, 3, 9])), shape=(5, 2)),
    unary("hsplit", lambda x: pieces(torch.hsplit(x, 2))),
    unary("vsplit", lambda x: pieces(torch.vsplit(x, [1]))),
    unary("dsplit", lambda x: pieces(torch.dsplit(x, 2)), shape=(2, 3, 4)),
    unary("unbind", lambda x: pieces(torch.unbind(x, 1))),
    unary("unbind_back_door", lambda x: pieces(aten.unbind.int(x))),
    unary("movedim", lambda x: torch.movedim(x, 0, -1), shape=(2, 3, 4)),
    unary("movedim_lists", lambda x: x.movedim((0, 1), (2, 0)), shape=(2, 3, 4)),
    unary("moveaxis", lambda x: torch.moveaxis(x, -1, 0), shape=(2, 3, 4)),
    unary("swapaxes", lambda x: torch.swapaxes(x, 0, 2), shape=(2, 3, 4)),
    unary("swapdims", lambda x: x.swapdims(0, 1)),
    unary("unflatten", lambda x: x.unflatten(1, (2, -1)), shape=(3, 6)),
    unary("unflatten_fn", lambda x: torch.unflatten(x, 0, (3, 1))),
    unary("unfold", lambda x: x.unfold(1, 2, 1)),
    unary("unfold_step", lambda x: x.unfold(0, 2, 2), shape=(5, 2)),
    binary("hstack", lambda x, y: torch.hstack([x, y])),
    binary("hstack_1d", lambda x, y: torch.hstack((x, y)), (3,), (2,)),
    binary("vstack", lambda x, y: torch.vstack([x, y]), (4,), (2, 4)),
    binary("row_stack", lambda x, y: torch.row_stack([x, y])),
    binary("dstack", lambda x, y: torch.dstack([x, y])),
    binary("column_stack", lambda x, y: torch.column_stack([x, y]), (3,), (3, 2)),
    binary("stack", lambda x, y: torch.stack([x, y], 1)),
    unary("diagflat", torch.diagflat, shape=(2, 2)),
    unary("diagflat_offset", lambda x: x.diagflat(-1), shape=(3,)),
    unary("diag", torch.diag, shape=(3, 3)),
    unary("trace", torch.trace, shape=(3, 3)),
    # NOTE [tril and triu are their own transposes]
    unary("triu_offset_batched", lambda x: x.triu(1), shape=(2, 3, 4), hessian=True),
    unary("tril_negative_offset", lambda x: torch.tril(x, diagonal=-1), shape=(4, 3)),
    binary("kron", torch.kron, (2, 3), (2, 2)),
    binary("cross", lambda x, y: torch.linalg.cross(x, y), (4, 3), (4, 3), hessian=True),
    binary("cross_dim0_broadcast", lambda x, y: torch.cross(x, y, dim=0), (3, 4), (3, 1)),
    binary("cross_default_dim", torch.cross, (3, 2), (3, 2)),
]

# torch.func has no forward mode for cdist, and its jacrev of cdist is wrong (the batched
# _cdist_backward): cdist is checked against torch.func of the same computation written out.
CDIST = [
    binary("cdist", torch.cdist, (3, 4), (2, 4), hessian=True),
    binary("cdist_p1", lambda x, y: torch.cdist(x, y, 1), (3, 4), (2, 4)),
    binary("cdist_inf_batched", lambda x, y: torch.cdist(x, y, INF), (2, 3, 4), (2, 2, 4),
           domain=distinct),
    binary("cdist_p3", lambda x, y: torch.cdist(x, y, 3.0), (3, 4), (2, 4)),
    # p = 2 by the matrix product (NOTE [cdist for p = 2: torch's matrix-product formula])
    binary("cdist_matrix_product", lambda x, y: torch.cdist(
        x, y, compute_mode="use_mm_for_euclid_dist"), (3, 4), (2, 4), hessian=True),
    binary("cdist_many_rows", torch.cdist, (27, 3), (2, 3)),
    binary("cdist_matrix_product_broadcast", lambda x, y: torch.cdist(
        x, y, compute_mode="use_mm_for_euclid_dist"), (2, 3, 4), (2, 4)),
]

CASES = REDUCTIONS + WITH_INDICES + SCANS + SHAPES + CDIST
assert len({c.name for c in CASES}) == len(CASES), "two cases share a name"

# Where finite differences do not apply: kinks (ties, zero norms, constant rows) and
# derivatives that are zero where the function jumps (argmax, counts).
NO_FINITE_DIFFERENCES = {
    "max_all_ties", "min_all_ties", "max_dim_ties", "median_all_ties", "median_dim_ties",
    "mode", "mode_dim0_keepdim", "cummax_ties", "sort_stable_ties", "argmin_ties",
    "std_constant_rows", "dist_same", "vector_norm_0", "nansum", "nanmean_dim",
    "nanmedian_all", "nanmedian_dim", *(f"norm_{p}_at_zero" for p in
                                        ("2", "1", "inf", "-inf", "0.5", "1.5", "3")),
}


# torch.func cannot run the prims ops (autograd.Functions without setup_context): those cases
# are checked against torch.func of the torch op they stand for
REFERENCES = {
    "prims_prod": lambda x: x.prod(2).prod(0),
    "prims_var": lambda x: torch.var(x, 1, correction=0),
    "prims_rev": lambda x: x.flip(0, 1),
    "prims_sum": lambda x: x.sum(1),
    "prims_amax": lambda x: x.amax(0),
    "prims_amin": lambda x: x.amin(),
    # torch reads dim=[] as every dim, but its var_backward divides by N - correction with
    # N = 1 (the product of no sizes): its gradient is inf; checked against dim=None
    "var_empty_dims": lambda x: torch.var(x, None, keepdim=True),
    "std_empty_dims": lambda x: x.std(),
    # torch.func has no batching rule for these two
    "moveaxis": lambda x: torch.movedim(x, -1, 0),
    "column_stack": lambda x, y: torch.cat([x.reshape(-1, 1), y], 1),
    **{case.name: (lambda p: lambda x, y: torch.linalg.vector_norm(
        x.unsqueeze(-2) - y.unsqueeze(-3), p, -1))(p)
       for case, p in zip(CDIST, (2.0, 1.0, INF, 3.0, 2.0, 2.0, 2.0))},
}


# Second derivatives at a norm of 0 do not exist: torch.func gives nan in some of them
# (NOTE [Norms and their subgradients]), and so must we, at the same places.
NAN_AT_KINKS = {"dist_same", "norm_2_at_zero", "norm_0.5_at_zero", "norm_1.5_at_zero"}


def test_cdist_by_the_matrix_product_is_torchs_kernel_with_torchs_gradient_at_zero():
    """NOTE [cdist for p = 2: torch's matrix-product formula]: more than 25 rows take torch's
    aten._euclidean_dist, and where two points coincide the gradient is 0, as torch.func's
    (whose vjp runs _euclidean_dist_backward); per-sample gradients agree with it too."""
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(30, 3, generator=g, dtype=DTYPE)
    x2 = torch.cat([x1[:4], torch.randn(6, 3, generator=g, dtype=DTYPE)])  # 4 distances of 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mf.vmap(lambda a: torch.cdist(a, x2))(x1[None])
    assert "aten::_euclidean_dist" in {e.key for e in prof.key_averages()}
    ct = torch.randn(30, 10, generator=g, dtype=DTYPE)
    ours = mf.vjp(torch.cdist, x1, x2)[1](ct)
    theirs = tf.vjp(torch.cdist, x1, x2)[1](ct)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    per_sample = (lambda api: api.vmap(api.grad(lambda a: torch.cdist(a, x2).sum())))
    torch.testing.assert_close(per_sample(mf)(torch.stack([x1, x1 * 2])),
                               per_sample(tf)(torch.stack([x1, x1 * 2])))


@pytest.mark.parametrize("case, transform", list(transform_params(CASES)))
def test_under_transform(case, transform):
    reference = REFERENCES.get(case.name)
    if reference is None and case.name not in NAN_AT_KINKS:
        check_under_transform(case, transform)
        return
    build = TRANSFORMS.get(transform, t_hessian)
    ours = build(mf, case)
    theirs = build(tf, dataclasses.replace(case, fn=reference or case.fn))
    assert all(type(t) is torch.Tensor for t in torch.utils._pytree.tree_leaves(ours))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8, equal_nan=True)


@pytest.mark.parametrize("case", [c for c in CASES if c.name not in NO_FINITE_DIFFERENCES],
                         ids=lambda c: c.name)
def test_finite_differences(case):
    check_finite_differences(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vmap_uses_no_fallback(case):
    """Every op here has a batching rule (or is made of ops that have one)."""
    batch = case.batch()
    in_dims = tuple(-1 for _ in batch)
    with mf.capture_fallbacks() as used:
        mf.vmap(mf.grad(lambda *a: case.fn(*a).sum()))(*batch)
        mf.vmap(case.fn, in_dims=in_dims)(*(torch.movedim(b, 0, -1) for b in batch))
    assert not used, f"{case.name}: per-example fallback for {dict(used)}"


# --- the front door: named tuples, plain tuples, tensors ------------------------------------------
@pytest.mark.parametrize("call, kind", [
    (lambda x: torch.max(x, 1), torch.return_types.max),
    (lambda x: x.min(dim=0, keepdim=True), torch.return_types.min),
    (lambda x: torch.sort(x), torch.return_types.sort),
    (lambda x: x.topk(2), torch.return_types.topk),
    (lambda x: torch.kthvalue(x, 1), torch.return_types.kthvalue),
    (lambda x: torch.median(x, 0), torch.return_types.median),
    (lambda x: x.nanmedian(1), torch.return_types.nanmedian),
    (lambda x: torch.mode(x), torch.return_types.mode),
    (lambda x: torch.cummax(x, 0), torch.return_types.cummax),
    (lambda x: x.cummin(1), torch.return_types.cummin),
])
def test_named_tuples(call, kind):
    x = torch.randn(3, 4, dtype=DTYPE)
    seen = []

    def f(x):
        result = call(x)
        seen.append(type(result))
        return result.values, result.indices
    values, index = mf.vmap(f)(torch.stack([x, 2 * x]))
    expected_values, expected_index = tf.vmap(lambda x: tuple(call(x)))(torch.stack([x, 2 * x]))
    assert seen == [kind]
    assert_same(values, expected_values)
    assert torch.equal(index, expected_index)


def test_var_mean_is_a_tuple():
    x = torch.randn(3, 4, dtype=DTYPE)
    out = mf.vmap(lambda x: torch.var_mean(x))(x)
    assert type(out) is tuple
    assert_same(out, tf.vmap(lambda x: torch.var_mean(x))(x))


@pytest.mark.parametrize("function", [
    torch.flip, torch.roll, torch.split, torch.Tensor.split, torch.chunk, torch.unbind,
    torch.narrow, torch.select, torch.stack, torch.movedim, torch.Tensor.repeat, torch.cumsum,
    torch.sort, torch.topk, torch.max, torch.Tensor.min, torch.argmax, torch.prod, torch.var,
    torch.std, torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.cumprod,
    torch.linalg.matrix_norm, torch.linalg.norm,
    torch.Tensor.unfold, torch.median, torch.swapaxes, torch.unflatten, torch.tensor_split,
])
def test_common_ops_take_the_front_door(function):
    assert function in torch_api.TORCH_FUNCTIONS


# --- views: a write through one reaches its base ------------------------------------------------
# torch's autograd refuses writes into the outputs of split, chunk and unbind: those are
# checked against torch.func of the same write through narrow or select
VIEW_REFERENCES = {
    "split": lambda y: y.narrow(0, 2, 2).mul_(3),
    "chunk": lambda y: y.narrow(1, 0, 2).add_(1),
    "unbind": lambda y: y.select(1, 2).mul_(-1),
}
VIEW_WRITES = {
    "split": lambda y: torch.split(y, 2)[1].mul_(3),
    "chunk": lambda y: y.chunk(2, 1)[0].add_(1),
    "unbind": lambda y: y.unbind(1)[2].mul_(-1),
    "narrow": lambda y: y.narrow(1, 1, 2).sin_(),
    "select": lambda y: y.select(0, 1).mul_(2),
    "movedim": lambda y: y.movedim(0, 1)[0].zero_(),
    "swapaxes": lambda y: y.swapaxes(0, 1)[1].add_(5),
    "unflatten": lambda y: y.unflatten(1, (2, 2))[:, 0].mul_(4),
    "tensor_split": lambda y: y.tensor_split(3)[2].exp_(),
    "unfold": lambda y: y.unfold(1, 2, 2)[..., 0].mul_(0.5),
    "as_strided": lambda y: y.as_strided((2, 2), (4, 1), 1).mul_(3),
    # functions that return their input itself (NOTE [Functions that return their input])
    "contiguous": lambda y: y.contiguous().add_(1),
    "contiguous_of_transpose": lambda y: y.t().contiguous().mul_(5),  # a copy, as in torch
    "to_its_dtype": lambda y: y.to(y.dtype).mul_(2),
    "to_another_dtype": lambda y: y.to(torch.float32).mul_(2),  # a copy
    "double": lambda y: y.double().add_(2),
    "type_as": lambda y: y.type_as(y).mul_(2),
    "positive": lambda y: y.positive().sub_(1),
}


@pytest.mark.parametrize("name", sorted(VIEW_WRITES))
def test_write_through_view(name):
    def writing(write):
        def f(x):
            y = x * 1.5
            write(y)
            return y * x
        return f
    f = writing(VIEW_WRITES[name])
    g = writing(VIEW_REFERENCES.get(name, VIEW_WRITES[name]))
    x = torch.randn(4, 4, dtype=DTYPE)
    xs = torch.randn(3, 4, 4, dtype=DTYPE)
    assert_same(mf.grad(lambda x: f(x).sum())(x), tf.grad(lambda x: g(x).sum())(x))
    assert_same(mf.vmap(f)(xs), tf.vmap(g)(xs))
    assert_same(mf.jvp(f, (x,), (xs[0],)), tf.jvp(g, (x,), (xs[0],)))


# writes through an alias without history: the base's contents change, its derivatives do
# not (NOTE [In-place writes under no_grad] in core/tensor.py); .data detaches from the
# tensor's own innermost level only (NOTE [x.data under nested transforms] in batching.py)
DETACHED_WRITES = {
    "detach": lambda b, s: b.detach().add_(s),
    "detach_row": lambda b, s: b.detach()[1].mul_(s),
    "data": lambda b, s: b.data.add_(s),
    "data_row": lambda b, s: b.data[1].mul_(s),
    "row_data": lambda b, s: b[1].data.sub_(s),
    "read_data": lambda b, s: b.data * s,
}
NESTED = {
    "grad": lambda api, f, x, t: api.grad(f)(x),
    "jvp": lambda api, f, x, t: api.jvp(f, (x,), (t,)),
    "vmap_grad": lambda api, f, x, t: api.vmap(api.grad(f))(torch.stack([x, t])),
    "jacfwd_grad": lambda api, f, x, t: api.jacfwd(api.grad(f))(x),
    "jacrev_jacrev": lambda api, f, x, t: api.jacrev(api.jacrev(f))(x),
    "hessian": lambda api, f, x, t: api.hessian(f)(x),
}


@pytest.mark.parametrize("transform", sorted(NESTED))
@pytest.mark.parametrize("name", sorted(DETACHED_WRITES))
def test_write_through_a_detached_alias(name, transform):
    weights = torch.arange(1.0, 13.0, dtype=DTYPE).reshape(3, 4)

    def f(x):
        base = torch.arange(12.0, dtype=DTYPE).reshape(3, 4) * 0.1 + x[0, 0] * x[0, 1]
        alias = DETACHED_WRITES[name](base, x.sum())
        return (base * weights).sum() + (base ** 2).sum() + alias.sum()
    x, t = torch.randn(2, 3, 4, dtype=DTYPE)
    run = NESTED[transform]
    assert_same(run(mf, f, x, t), run(tf, f, x, t))


def test_write_into_overlapping_windows_is_refused():
    def f(x):
        x.unfold(0, 2, 1).mul_(2)
        return x
    with pytest.raises(mf.InPlaceError, match="share one place"):
        mf.vmap(f)(torch.randn(3, 4, dtype=DTYPE))


# --- prod and cumprod with zeros: exact at every order --------------------------------------------
def test_prod_gradients_with_zeros_are_exact():
    x = torch.tensor([2.0, 0.0, 3.0, 0.0, 5.0], dtype=DTYPE)
    grad = mf.grad(torch.prod)(x)
    assert torch.equal(grad, torch.zeros(5, dtype=DTYPE))
    hessian = mf.hessian(torch.prod)(x)
    assert hessian[1, 3] == 30.0 and hessian[3, 1] == 30.0
    assert torch.count_nonzero(hessian) == 2
    one_zero = torch.tensor([2.0, 0.0, 3.0], dtype=DTYPE)
    assert torch.equal(mf.grad(torch.prod)(one_zero), torch.tensor([0.0, 6.0, 0.0], dtype=DTYPE))


@pytest.mark.parametrize("bad", [float("nan"), INF, -INF])
def test_prod_derivative_at_a_non_finite_element_is_nan_as_torch(bad):
    """NOTE [Products with zeros]: the product of the others is finite at a nan or infinite
    element, where torch's ``result / x`` (eager autograd and torch.func.vjp, on a tensor
    without a zero) and finite
    differences give nan (masked.prod, OpInfo sample 17: a nan on the diagonal, the masked
    elements set to 1). (torch.func.grad and jvp run the formula on wrapped tensors and take
    torch's path for zeros instead: the product of the others.)"""
    def same(ours, theirs):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8, equal_nan=True)
    x = torch.tensor([[bad, 2.0, -1.5], [0.5, bad, 3.0], [1.5, -2.0, 0.5]], dtype=DTYPE)
    mask = torch.tensor([[True, True, False], [False, True, True], [True, True, True]])
    t = torch.randn(3, 3, dtype=DTYPE)
    for f in (lambda x: x.prod(1), lambda x: torch.prod(x[0]).expand(3),
              lambda x: torch.where(mask, x, 1.0).prod(1),
              lambda x: torch.masked.prod(x, 1, mask=mask), torch.prod,
              lambda x: torch.prod(x[:, 1:2], 1)):  # (one element: x / x)
        out = f(x)
        ct = torch.randn(out.shape, dtype=DTYPE)
        leaf = x.clone().requires_grad_()
        eager, = torch.autograd.grad(f(leaf), leaf, ct)
        ours = mf.vjp(f, x)
        same(ours[1](ct)[0], eager)
        same(tf.vjp(f, x)[1](ct)[0], eager)
        differences = (f(x + 1e-6 * t) - f(x - 1e-6 * t)) / 2e-6
        torch.testing.assert_close(mf.jvp(f, (x,), (t,))[1], differences, rtol=1e-5,
                                   atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rows", [
    [[0.0, NAN, 2.0]], [[INF, 0.0, 2.0]], [[0.0, 0.0, INF]], [[-INF, INF, 1.0]],
    [[1.0, INF, 2.0], [3.0, 0.0, 2.0]],  # a zero in another slice: no nan at the inf
    [[NAN, 1.0, 2.0], [0.5, -1.0, 2.0]]], ids=str)
def test_prod_derivative_at_non_finite_elements_beside_zeros_as_torch(rows):
    """NOTE [Products with zeros]: torch divides ``result / x`` only when its input holds no
    zero; a zero anywhere in it (another slice included) gives the exclusive products on every
    slice. (Before, a nan or inf beside a zero gave nan where torch gives a number.)"""
    x = torch.tensor(rows, dtype=DTYPE)
    for f in (torch.prod, lambda x: x.prod(1), lambda x: x.prod(0)):
        out = f(x)
        ct = torch.linspace(0.5, 1.5, out.numel(), dtype=DTYPE).reshape(out.shape)
        leaf = x.clone().requires_grad_()
        eager, = torch.autograd.grad(f(leaf), leaf, ct, create_graph=True)
        torch.testing.assert_close(tf.vjp(f, x)[1](ct)[0], eager, equal_nan=True)
        torch.testing.assert_close(mf.vjp(f, x)[1](ct)[0], eager, equal_nan=True)


@pytest.mark.parametrize("row", [[2.0, 3.0, INF, 1.0], [1.0, INF, 2.0], [INF, 0.0, 2.0, 5.0],
                                 [NAN, 1.0, 2.0, 0.5], [1.0, 2.0, -INF, NAN]], ids=str)
def test_cumprod_derivative_at_a_non_finite_element_as_torch_func(row):
    """The recurrences of cumprod's derivatives (``_linear_recurrence``) update only the places
    with a neighbour: a zero standing in for a missing one, times an infinite factor, made nan
    (the gradient of cumprod at [2, 3, inf] was nan at 3 where torch.func.grad gives inf, and
    the first tangent at [inf, 0, ...] was nan where the first output is x_0 itself)."""
    x = torch.tensor(row, dtype=DTYPE)
    ct = torch.linspace(0.5, 2.0, x.numel(), dtype=DTYPE)
    theirs = tf.grad(lambda v: (torch.cumprod(v, 0) * ct).sum())(x)
    torch.testing.assert_close(mf.vjp(lambda v: torch.cumprod(v, 0), x)[1](ct)[0], theirs,
                               equal_nan=True)
    x_dot = torch.linspace(-1.0, 1.5, x.numel(), dtype=DTYPE)
    tangent = mf.jvp(lambda v: torch.cumprod(v, 0), (x,), (x_dot,))[1]
    assert tangent[0] == x_dot[0], tangent


def test_logcumsumexp_of_one_number_passes_the_gradient_through():
    """logcumsumexp of a 0-d tensor is the tensor: its gradient is the cotangent, at an
    infinite value too (the log-space sum gave exp(inf - inf) = nan), as torch's."""
    for value in (float("inf"), float("-inf"), 2.0):
        x = torch.tensor(value, dtype=DTYPE)
        f = lambda v: torch.logcumsumexp(v, 0)  # noqa: E731
        ct = torch.tensor(0.75, dtype=DTYPE)
        assert mf.vjp(f, x)[1](ct)[0] == tf.vjp(f, x)[1](ct)[0] == ct
        assert mf.grad(f)(x) == tf.grad(f)(x)


def test_cumprod_third_order_with_zeros():
    """d3/dx_a dx_b dx_c sum_j prod_{i<=j} x_i = sum_{j>=max(a,b,c)} prod_{i<=j, i not in
    {a,b,c}} x_i for distinct a, b, c (0 otherwise: the function is multilinear). torch.func
    gets some of these wrong (its third derivative is not even symmetric); every way of
    stacking the transforms here gives the exact one."""
    x = torch.tensor([1.5, 0.0, 2.0, 0.0, -1.0, 0.0], dtype=DTYPE)
    n = len(x)
    exact = torch.zeros(n, n, n, dtype=DTYPE)
    for a, b, c in itertools.permutations(range(n), 3):
        for j in range(max(a, b, c), n):
            exact[a, b, c] += math.prod(x[i].item() for i in range(j + 1) if i not in (a, b, c))
    f = lambda x: torch.cumprod(x, 0).sum()  # noqa: E731
    for third in (mf.jacfwd(mf.hessian(f)), mf.jacrev(mf.jacrev(mf.jacrev(f))),
                  mf.jacfwd(mf.jacfwd(mf.jacfwd(f)))):
        assert_same(third(x), exact)


def test_prims_reduction_over_no_dims_keeps_the_tensor():
    """prims.sum(x, []) reduces nothing (its meta function's shape; torch's eager kernel
    disagrees with it, and torch._refs never emit it)."""
    x = torch.randn(3, 4, dtype=DTYPE)
    assert_same(mf.vmap(lambda x: prims.sum(x, []) * 2)(x), x * 2)
    assert_same(mf.grad(lambda x: prims.prod(x, []).sum())(x), torch.ones_like(x))


# --- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda x: torch.split(x, [1, 1]), r"split\(x, \[1, 1\], dim=0\): split_with_sizes expects "
     r"split_sizes to sum exactly to 3"),
    (lambda x: x.narrow(0, 2, 3), r"narrow\(x, 0, 2, 3\): start \(2\) \+ length \(3\) exceeds "
     r"dimension size \(3\)"),
    (lambda x: x.roll((1, 2), (0,)), r"roll\(x, shifts=\(1, 2\), dims=\(0,\)\)"),
    (lambda x: x.repeat(2), r"repeat\(x, \(2,\)\): Number of dimensions of repeat dims can not "
     r"be smaller than number of dimensions of tensor"),
    (lambda x: torch.linalg.cross(x, x), r"linalg.cross\(x, y, dim=-1\): linalg.cross: inputs "
     r"dimension -1 must have length 3\. Got 4 and 4"),
    (lambda x: x.movedim((0, 0), (1, 0)), r"movedim\(x, \[0, 0\], \[1, 0\]\)"),
    (lambda x: x.unflatten(1, (3, 2)), r"unflatten\(x, 1, \(3, 2\)\): unflatten: Provided "
     r"sizes \[3, 2\] don't multiply up to the size of dim 1 \(4\)"),
    (lambda x: torch.linalg.vector_norm(x, dtype=torch.float32),
     r"vector_norm\(\.\.\., dtype=torch\.float32\): linalg\.vector_norm: the dtype of the "
     r"input \(torch\.float64\) should be convertible without narrowing"),
    (lambda x: x.norm(dtype=torch.complex128), r"dtype should be real for real inputs"),
])
def test_usage_errors(call, message):
    """Each is the engine's error (the call, then torch's words) and also the built-in
    exception torch raises for the same call on a plain tensor."""
    x = torch.randn(2, 3, 4, dtype=DTYPE)
    with pytest.raises(TransformUsageError, match=message) as ours:
        mf.vmap(call)(x)
    with pytest.raises(Exception) as torchs:
        call(x[0])
    assert isinstance(ours.value, type(torchs.value)), (type(torchs.value), ours.value)


def test_complex_is_refused():
    x = torch.randn(3, dtype=torch.complex128)
    # the level refuses a primitive not marked complex-ready (NOTE [Complex numbers]); every
    # primitive of this family that torch computes on complex numbers is complex-ready, so
    # the example is an activation
    with pytest.raises(mf.UnsupportedOperationError, match="silu takes a complex input"):
        mf.grad(lambda x: torch.nn.functional.silu(x).sum().real)(x)


def test_cumprod_of_integers_under_vmap():
    x = torch.randint(0, 4, (3, 5))
    assert torch.equal(mf.vmap(lambda x: x.cumprod(0))(x), x.cumprod(1))
    assert torch.equal(mf.vmap(lambda x: x.prod())(x), x.prod(1))


def test_prims_xor_sum():
    x = torch.randint(-50, 50, (3, 4, 5))
    out = mf.vmap(lambda x: prims.xor_sum(x, [1]))(x)
    expected = x[:, :, 0]
    for i in range(1, 5):
        expected = expected ^ x[:, :, i]
    assert torch.equal(out, expected)
    flags = torch.rand(3, 4) > 0.5
    assert torch.equal(mf.vmap(lambda b: prims.xor_sum(b, None))(flags),
                       flags.sum(1).remainder(2).bool())


def test_shape_rules_of_the_new_primitives():
    x = torch.randn(3, 4, dtype=DTYPE)
    samples = {
        "prod": ((x,), {"dim": (0, 1), "keepdim": True}),
        "var": ((x,), {"dim": (1,), "correction": 0, "keepdim": False}),
        "std": ((x,), {"dim": (0,), "correction": 1, "keepdim": True}),
        "vector_norm": ((x,), {"ord": 3.0, "dim": (1,), "keepdim": False}),
        "xor_sum": ((torch.ones(3, 4, dtype=torch.int32),), {"dim": (1,), "keepdim": False}),
        "cumsum": ((x,), {"dim": 1}), "cumprod": ((x,), {"dim": 0}),
        "logcumsumexp": ((x,), {"dim": 1}),
        "flip": ((x,), {"dims": (0, 1)}), "roll": ((x,), {"shifts": (1,), "dims": (1,)}),
        "argmax": ((x,), {"dim": 1}), "sort_indices": ((x,), {"dim": 1, "descending": True,
                                                             "stable": False}),
        "topk_indices": ((x,), {"k": 2, "dim": 1, "largest": True, "sorted": True}),
        "pick_of_all": ((x.reshape(-1),), {"dim": 0, "pick": "median"}),
        "mode_indices": ((x,), {"dim": 0}), "cummax_indices": ((x,), {"dim": 1}),
    }
    for name, (args, params) in samples.items():
        prim = mf.PRIMITIVES[name]
        out = prim.impl(*args, **params)
        assert prim.shape_rule(*args, **params) == (out.shape, out.dtype), name


@pytest.mark.parametrize("call", [
    lambda x: torch.flip(x, dims=(0,)), lambda x: x.tile(dims=(2, 1)),
    lambda x: pieces(x.split(split_size=2)), lambda x: pieces(torch.split(x, 2, dim=1)),
    lambda x: pieces(torch.tensor_split(x, sections=2)),
    lambda x: pieces(torch.tensor_split(x, indices=[1])),
    lambda x: pieces(torch.hsplit(x, indices=[1])),
    lambda x: torch.swapaxes(x, axis0=0, axis1=1), lambda x: x.swapdims(dim0=1, dim1=0),
    lambda x: torch.dist(x, other=x.sin(), p=3), lambda x: torch.roll(x, shifts=1, dims=0),
    lambda x: torch.sort(x, stable=True, dim=0, descending=True).values,
    lambda x: torch.topk(x, k=2, dim=0, largest=False, sorted=True).values,
    lambda x: torch.max(x, other=x.cos()), lambda x: torch.narrow(x, dim=1, start=1, length=2),
    lambda x: x.unflatten(dim=1, sizes=(2, 2)), lambda x: torch.movedim(x, source=0,
                                                                        destination=1),
], ids=lambda f: "")
def test_keyword_arguments(call):
    x = torch.randn(4, 4, dtype=DTYPE)
    xs = torch.randn(3, 4, 4, dtype=DTYPE)
    assert_same(mf.vmap(call)(xs), tf.vmap(call)(xs))
    assert_same(mf.grad(lambda x: call(x).sum())(x), tf.grad(lambda x: call(x).sum())(x))


@pytest.mark.parametrize("name", ["quantile", "nanquantile"])
def test_quantile_refuses_q_out_of_range_under_every_transform(name):
    """torch's composite checks q only on a plain tensor; a batched q is checked here (the
    grad case is torch.func's own check, whose error torch.func itself gets wrong)."""
    f = getattr(torch, name)
    x = torch.rand(5, dtype=DTYPE)
    for q in (torch.tensor([0.5, 1.5], dtype=DTYPE), torch.tensor([-0.25], dtype=DTYPE)):
        with pytest.raises(RuntimeError, match=r"q values must be in the range \[0, 1\]"):
            tf.vmap(lambda q: f(x, q))(torch.stack([q, q]))
        with pytest.raises(mf.InvalidOptionError,
                           match=r"q values must be in the range \[0, 1\] .*Fix:"):
            mf.vmap(lambda q: f(x, q))(torch.stack([q, q]))
        with pytest.raises(RuntimeError, match=r"q values must be in the range \[0, 1\]"):
            mf.grad(lambda x: f(x, q).sum())(x)
    good = torch.tensor([[0.2, 0.9], [0.0, 1.0]], dtype=DTYPE)
    torch.testing.assert_close(mf.vmap(lambda q: f(x, q))(good),
                               tf.vmap(lambda q: f(x, q))(good))
    # in a program the check is an effectful step: kept though nothing reads its output
    program = mf.jit(f)
    torch.testing.assert_close(program(x, good[0]), f(x, good[0]))
    with pytest.raises(mf.InvalidOptionError, match=r"q values must be in the range \[0, 1\]"):
        program(x, torch.tensor([0.5, 1.5], dtype=DTYPE))


@pytest.mark.parametrize("name", ["max", "min", "median", "nanmedian"])
@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap_grad", "jacfwd", "jvp_grad"])
def test_reductions_of_all_elements_at_nan_as_torch_func(name, transform):
    """NOTE [Reductions of all elements whose ties share]: x.max() of [1, nan, 3, nan] sends
    the cotangent to the nans (evenly_distribute_backward), while its tangent is nan
    (evenly_read_jvp ties by == alone); median likewise; nanmedian skips the nans."""
    f = getattr(torch, name)
    x = torch.tensor([1.0, float("nan"), 3.0, float("nan"), 3.0], dtype=torch.float64)
    t = torch.tensor([0.5, 2.0, -1.0, 4.0, 1.5], dtype=torch.float64)
    runs = {
        "grad": lambda api: api.grad(f)(x),
        "jvp": lambda api: api.jvp(f, (x,), (t,))[1],
        "vmap_grad": lambda api: api.vmap(api.grad(f))(torch.stack([x, x.flip(0), t])),
        "jacfwd": lambda api: api.jacfwd(f)(x),
        "jvp_grad": lambda api: api.jvp(api.grad(f), (x,), (t,)),
    }
    ours, theirs = runs[transform](mf), runs[transform](tf)
    for mine, torchs in zip(torch.utils._pytree.tree_leaves(ours),
                            torch.utils._pytree.tree_leaves(theirs)):
        torch.testing.assert_close(mine, torchs, equal_nan=True, rtol=0, atol=0)


def test_matrix_norm_with_no_dims_is_torchs_error():
    """NOTE [The Frobenius norm at the front door]: matrix_norm(A, dim=None) is declined, and
    torch refuses it (a Frobenius norm of every element would answer where torch raises)."""
    x = torch.randn(3, 4, dtype=DTYPE)
    with pytest.raises(TypeError, match="linalg_matrix_norm"):
        mf.grad(lambda x: torch.linalg.matrix_norm(x, dim=None))(x)
