"""The indexing family (core/indexing.py) under every transform, against torch.func.

Cases whose index tensors are inputs get them batched by vmap (in_dims 0, 1/-1 and mixed
None come from the oracle's transform set); cases that build a constant index inside the
function keep it unbatched. Boolean masks that select (``x[mask]``) are constants: a batched
one is refused, as in torch.func (tested at the end).
"""
import math

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core as mf
from op_table import DTYPE, OpCase, distinct, indices, normal
from oracle import (TRANSFORMS, aten_calls, assert_same, check_finite_differences,
                    check_under_transform, t_hessian, transform_params)

aten = torch.ops.aten


def case(name, fn, make, diff=(0,), hessian=False):
    return OpCase(name, fn, make, tuple(diff), hessian)


def mask(g, *shape):
    return torch.rand(shape, generator=g) > 0.4


def sorted_normal(g, *shape):
    return torch.sort(normal(g, *shape), dim=-1).values


def _with_argsort(sequence, values):
    return sequence, values, torch.argsort(sequence)


def with_zeros(g, *shape):
    """Normal values with exact zeros in a fixed pattern (prod's special cases)."""
    x = normal(g, *shape)
    x.view(-1)[::3] = 0.0
    return x


I = torch.tensor
MASK_35 = torch.tensor([[True, False, True, True, False], [False, False, True, False, True],
                        [True, True, False, False, False]])
DUP = torch.tensor([0, 2, 2, 1, 0])

CASES = [
    # --- advanced indexing: the front door --------------------------------------------------
    case("index_1d", lambda x, i: x[i], lambda g: (normal(g, 5, 3), indices(g, 5, 4)),
         hessian=True),
    case("index_2d_index", lambda x, i: x[i], lambda g: (normal(g, 5, 3), indices(g, 5, 2, 3))),
    case("index_adjacent", lambda x, i, j: x[:, i, j],
         lambda g: (normal(g, 2, 4, 3), indices(g, 4, 5), indices(g, 3, 5))),
    case("index_separated", lambda x, i, j: x[i, :, j],
         lambda g: (normal(g, 4, 2, 3), indices(g, 4, 5), indices(g, 3, 5))),
    case("index_broadcast", lambda x, i, j: x[i[:, None], j],
         lambda g: (normal(g, 4, 3, 2), indices(g, 4, 2), indices(g, 3, 3))),
    case("index_int_and_tensor", lambda x, i: x[1, :, i],
         lambda g: (normal(g, 2, 3, 4), indices(g, 4, 2))),
    case("index_none_ellipsis", lambda x, i: x[None, ..., i],
         lambda g: (normal(g, 2, 3, 4), indices(g, 4, 3))),
    case("index_slice_tensor", lambda x, i: x[1:, i],
         lambda g: (normal(g, 3, 4), indices(g, 4, 5))),
    case("index_list", lambda x: x[[0, 2, 2, -1]], lambda g: (normal(g, 4, 3),)),
    case("index_list_tuple", lambda x: x[[0, 1], :, [2, 0]], lambda g: (normal(g, 2, 3, 4),)),
    case("index_negative", lambda x: x[:, I([-1, 0, -2])], lambda g: (normal(g, 2, 4),)),
    case("index_mask", lambda x: x[MASK_35], lambda g: (normal(g, 3, 5),), hessian=True),
    case("index_mask_trailing", lambda x: x[:, MASK_35[0]], lambda g: (normal(g, 2, 5),)),
    case("index_mask_and_index", lambda x, i: x[MASK_35, i],
         lambda g: (normal(g, 3, 5, 4), indices(g, 4, 7))),
    case("index_bool_scalar", lambda x: x[True] * 2 + x[None], lambda g: (normal(g, 2, 3),)),
    case("index_0d_index", lambda x, i: x[i], lambda g: (normal(g, 4, 3), indices(g, 4))),
    # --- advanced indexing: the back door ---------------------------------------------------
    case("aten_index", lambda x, i: aten.index.Tensor(x, [None, i]),
         lambda g: (normal(g, 2, 4), indices(g, 4, 3))),
    case("aten_unsafe_index", lambda x, i, j: aten._unsafe_index.Tensor(x, [i, None, j]),
         lambda g: (normal(g, 3, 2, 4), indices(g, 3, 2), indices(g, 4, 2))),
    # --- writing with tensor indices ---------------------------------------------------------
    case("setitem_index", lambda x, v: _set(x, I([3, 0, 2]), v),
         lambda g: (normal(g, 4, 2), normal(g, 3, 2)), diff=(0, 1), hessian=True),
    case("setitem_duplicates", lambda x, v: _set(x, DUP, v),
         lambda g: (normal(g, 4, 2), normal(g, 5, 2)), diff=(0, 1)),
    case("setitem_batched_index", lambda x, i, v: _set(x, i, v),
         lambda g: (normal(g, 4, 2), torch.randperm(4, generator=g)[:3], normal(g, 2)),
         diff=(0, 2)),
    case("setitem_scalar", lambda x: _set(x, (slice(None), I([0, 2])), 0.5),
         lambda g: (normal(g, 2, 3),)),
    case("setitem_mask", lambda x, v: _set(x, MASK_35, v),
         lambda g: (normal(g, 3, 5), normal(g, 1)), diff=(0, 1)),
    case("setitem_basic_and_tensor", lambda x, v: _set(x, (1, I([0, 2])), v),
         lambda g: (normal(g, 2, 3, 2), normal(g, 2, 2)), diff=(0, 1)),
    case("setitem_add", lambda x, v: _iadd(x, I([1, 1, 0]), v),
         lambda g: (normal(g, 3, 2), normal(g, 3, 2)), diff=(0, 1)),
    case("index_put", lambda x, i, v: torch.index_put(x, (i,), v),
         lambda g: (normal(g, 4, 3), torch.randperm(4, generator=g)[:2], normal(g, 2, 3)),
         diff=(0, 2)),
    case("index_put_accumulate", lambda x, i, v: x.index_put((i,), v, accumulate=True),
         lambda g: (normal(g, 4, 3), indices(g, 4, 5), normal(g, 5, 3)), diff=(0, 2),
         hessian=True),
    case("index_put_two_broadcast_values", lambda x, i, j, v: x.index_put((i, j), v, True),
         lambda g: (normal(g, 3, 4), indices(g, 3, 5), indices(g, 4, 5), normal(g, 1)),
         diff=(0, 3)),
    case("index_put_separated", lambda x, i, j, v: aten.index_put.default(x, [i, None, j], v, True),
         lambda g: (normal(g, 3, 2, 4), indices(g, 3, 5), indices(g, 4, 5), normal(g, 2)),
         diff=(0, 3)),
    case("index_put_in_place", lambda x, v: _method(x, "index_put_", (DUP,), v, True),
         lambda g: (normal(g, 3, 2), normal(g, 5, 2)), diff=(0, 1)),
    case("aten_index_put", lambda x, i, v: aten.index_put.default(x, [None, i], v, True),
         lambda g: (normal(g, 2, 4), indices(g, 4, 3), normal(g, 2, 3)), diff=(0, 2)),
    # --- index_select and the index_* family --------------------------------------------------
    case("index_select", lambda x, i: torch.index_select(x, 1, i),
         lambda g: (normal(g, 2, 4), indices(g, 4, 5)), hessian=True),
    case("index_select_method_0d", lambda x, i: x.index_select(0, i),
         lambda g: (normal(g, 3, 2), indices(g, 3))),
    case("aten_index_select", lambda x, i: aten.index_select.default(x, -1, i),
         lambda g: (normal(g, 2, 4), indices(g, 4, 3))),
    case("index_add", lambda x, i, s: torch.index_add(x, 0, i, s, alpha=2.0),
         lambda g: (normal(g, 3, 2), indices(g, 3, 4), normal(g, 4, 2)), diff=(0, 2),
         hessian=True),
    case("index_add_dim1", lambda x, i, s: x.index_add(1, i, s),
         lambda g: (normal(g, 2, 3), indices(g, 3, 4), normal(g, 2, 4)), diff=(0, 2)),
    case("index_add_in_place", lambda x, s: _method(x, "index_add_", 0, DUP, s),
         lambda g: (normal(g, 3, 2), normal(g, 5, 2)), diff=(0, 1)),
    case("index_copy", lambda x, s: torch.index_copy(x, 1, I([2, 0]), s),
         lambda g: (normal(g, 2, 3), normal(g, 2, 2)), diff=(0, 1)),
    case("index_copy_batched_index", lambda x, i, s: x.index_copy(0, i, s),
         lambda g: (normal(g, 4, 2), torch.randperm(4, generator=g)[:3], normal(g, 3, 2)),
         diff=(0, 2)),
    case("index_fill_scalar", lambda x, i: x.index_fill(1, i, -1.5),
         lambda g: (normal(g, 2, 4), indices(g, 4, 3))),
    case("index_fill_tensor", lambda x, v: torch.index_fill(x, 0, DUP, v),
         lambda g: (normal(g, 3, 2), normal(g)), diff=(0, 1)),
    case("index_fill_batched_index", lambda x, i, v: x.index_fill(0, i, v),
         lambda g: (normal(g, 3, 2), indices(g, 3, 4), normal(g)), diff=(0, 2)),
    case("take", lambda x, i: torch.take(x, i), lambda g: (normal(g, 2, 3), indices(g, 6, 2, 2)),
         hessian=True),
    case("take_method_0d", lambda x: x.take(I(4)), lambda g: (normal(g, 2, 3),)),
    case("put", lambda x, i, s: x.put(i, s),
         lambda g: (normal(g, 2, 3), torch.randperm(6, generator=g)[:4], normal(g, 4)),
         diff=(0, 2)),
    case("put_accumulate", lambda x, i, s: x.put(i, s, accumulate=True),
         lambda g: (normal(g, 2, 3), indices(g, 6, 2, 3), normal(g, 2, 3)), diff=(0, 2)),
    case("put_in_place", lambda x, s: _method(x, "put_", DUP, s, True),
         lambda g: (normal(g, 4), normal(g, 5)), diff=(0, 1)),
    case("take_along_dim", lambda x, i: torch.take_along_dim(x, i, 1),
         lambda g: (normal(g, 2, 4), indices(g, 4, 2, 3))),
    case("take_along_dim_broadcast", lambda x, i: x.take_along_dim(i, dim=0),
         lambda g: (normal(g, 3, 1, 4), indices(g, 3, 2, 5, 1))),
    case("take_along_dim_none", lambda x, i: torch.take_along_dim(x, i),
         lambda g: (normal(g, 2, 3), indices(g, 6, 2, 2))),
    case("take_along_dim_negative", lambda x, i: torch.take_along_dim(x, i - 3, -1),
         lambda g: (normal(g, 2, 3), indices(g, 3, 2, 4))),
    # --- gather (a course primitive: its batching rule, with 0-d examples) --------------------
    case("gather_smaller_index", lambda x, i: torch.gather(x, 1, i),
         lambda g: (normal(g, 3, 5), indices(g, 5, 2, 3))),
    case("gather_neg_dim", lambda x, i: x.gather(-2, i),
         lambda g: (normal(g, 3, 2, 2), indices(g, 2, 3, 4, 2))),
    case("gather_0d", lambda x, i: torch.gather(x, 0, i), lambda g: (normal(g), indices(g, 1)),
         hessian=True),
    case("gather_1d_0d_index", lambda x, i: torch.gather(x, 0, i),
         lambda g: (normal(g, 4), indices(g, 4))),
    case("gather_0d_1d_index", lambda x, i: torch.gather(x, 0, i),
         lambda g: (normal(g), indices(g, 1, 3))),
    # --- scatter --------------------------------------------------------------------------
    case("scatter_src", lambda x, i, s: torch.scatter(x, 1, i, s),
         lambda g: (normal(g, 2, 5), torch.stack([torch.randperm(5, generator=g)[:3]
                                                  for _ in range(2)]), normal(g, 2, 3)),
         diff=(0, 2), hessian=True),
    case("scatter_src_larger", lambda x, s: x.scatter(0, I([[2, 0]]), s),
         lambda g: (normal(g, 3, 2), normal(g, 1, 2)), diff=(0, 1)),
    case("scatter_value", lambda x, i: x.scatter(0, i, 2.5),
         lambda g: (normal(g, 4, 2), indices(g, 4, 3, 2))),
    case("scatter_in_place", lambda x, s: _method(x, "scatter_", 0, I([[1], [0]]), s),
         lambda g: (normal(g, 2, 2), normal(g, 2, 1)), diff=(0, 1)),
    case("scatter_0d", lambda x, s: torch.scatter(x, 0, I(0), s),
         lambda g: (normal(g), normal(g)), diff=(0, 1)),
    case("scatter_add", lambda x, i, s: torch.scatter_add(x, 0, i, s),
         lambda g: (normal(g, 3, 2), indices(g, 3, 4, 2), normal(g, 4, 2)), diff=(0, 2),
         hessian=True),
    case("scatter_add_method", lambda x, i, s: x.scatter_add(-1, i, s),
         lambda g: (normal(g, 2, 3), indices(g, 3, 2, 4), normal(g, 2, 4)), diff=(0, 2)),
    case("aten_scatter_add", lambda x, i, s: aten.scatter_add.default(x, 1, i, s),
         lambda g: (normal(g, 2, 3), indices(g, 3, 2, 2), normal(g, 2, 2)), diff=(0, 2)),
    *[case(f"scatter_reduce_{reduce}{'' if include_self else '_exclude_self'}",
           (lambda r, s_: lambda x, i, s: torch.scatter_reduce(x, 0, i, s, r,
                                                               include_self=s_))(reduce,
                                                                                 include_self),
           lambda g: (distinct(g, 3, 2), indices(g, 3, 4, 2), distinct(g, 4, 2)), diff=(0, 2),
           hessian=reduce in ("sum", "mean"))
      for reduce in ("sum", "mean", "amax", "amin") for include_self in (True, False)],
    case("scatter_reduce_method_amax", lambda x, i, s: x.scatter_reduce(1, i, s, "amax"),
         lambda g: (distinct(g, 2, 3), indices(g, 3, 2, 4), distinct(g, 2, 4)), diff=(0, 2)),
    # ties: the same src element twice, and x equal to a src element
    case("scatter_reduce_amax_ties",
         lambda x, s: torch.scatter_reduce(torch.cat([x[:1], s[:1], x[2:]]), 0, I([0, 1, 0, 1]),
                                           torch.cat([s, s]), "amax"),
         lambda g: (distinct(g, 3), distinct(g, 2)), diff=(0, 1)),
    case("scatter_reduce_amin_ties", lambda x, s: x.scatter_reduce(
        0, I([0, 0, 2]), torch.stack([s, s, x[2]]), "amin", include_self=True),
        lambda g: (distinct(g, 3), distinct(g)), diff=(0, 1)),
    # prod, with exact zeros in x and src (one zero per place, and places with several)
    *[case(f"scatter_reduce_prod{'' if include_self else '_exclude_self'}",
           (lambda s_: lambda x, i, s: torch.scatter_reduce(x, 0, i, s, "prod",
                                                            include_self=s_))(include_self),
           lambda g: (normal(g, 3, 2), indices(g, 3, 4, 2), normal(g, 4, 2)), diff=(0, 2),
           hessian=True)
      for include_self in (True, False)],
    case("scatter_reduce_prod_zeros", lambda x, s: torch.scatter_reduce(
        x, 0, I([[0, 1], [2, 1], [1, 0], [2, 2]]), s, "prod"),
        lambda g: (with_zeros(g, 3, 2), with_zeros(g, 4, 2)), diff=(0, 1)),
    # --- index_reduce: scatter_reduce along one dim ------------------------------------------
    *[case(f"index_reduce_{reduce}{'' if include_self else '_exclude_self'}",
           (lambda r, s_: lambda x, i, s: x.index_reduce(1, i, s, r, include_self=s_))(
               reduce, include_self),
           lambda g: (distinct(g, 2, 3), indices(g, 3, 4), distinct(g, 2, 4)), diff=(0, 2))
      for reduce in ("prod", "mean", "amax", "amin") for include_self in (True, False)],
    case("aten_index_reduce", lambda x, s: aten.index_reduce.default(x, 0, DUP, s, "mean"),
         lambda g: (normal(g, 3, 2), normal(g, 5, 2)), diff=(0, 1)),
    # --- masked ops --------------------------------------------------------------------------
    case("masked_fill", lambda x, m: x.masked_fill(m, -2.0),
         lambda g: (normal(g, 3, 4), mask(g, 3, 4)), hessian=True),
    case("masked_fill_tensor", lambda x, m, v: torch.masked_fill(x, m, v),
         lambda g: (normal(g, 3, 4), mask(g, 4), normal(g)), diff=(0, 2)),
    case("masked_fill_broadcast_x", lambda x, m: x.masked_fill(m, 1.5),
         lambda g: (normal(g, 4), mask(g, 3, 4))),
    case("masked_fill_in_place", lambda x, m: _method(x, "masked_fill_", m, 0.0),
         lambda g: (normal(g, 2, 3), mask(g, 2, 3))),
    case("aten_masked_fill", lambda x, m, v: aten.masked_fill.Tensor(x, m, v),
         lambda g: (normal(g, 2, 3), mask(g, 2, 3), normal(g)), diff=(0, 2)),
    case("masked_scatter", lambda x, m, s: x.masked_scatter(m, s),
         lambda g: (normal(g, 3, 4), mask(g, 3, 4), normal(g, 13)), diff=(0, 2), hessian=True),
    case("masked_scatter_broadcast", lambda x, m, s: torch.masked_scatter(x, m, s),
         lambda g: (normal(g, 4), mask(g, 2, 4), normal(g, 3, 3)), diff=(0, 2)),
    case("masked_select", lambda x: torch.masked_select(x, MASK_35), lambda g: (normal(g, 3, 5),)),
    case("masked_select_broadcast", lambda x: x.masked_select(MASK_35[0]),
         lambda g: (normal(g, 2, 5),)),
    # --- as_strided, unfold -------------------------------------------------------------------
    case("as_strided", lambda x: torch.as_strided(x, (3, 2), (1, 2), 1),
         lambda g: (normal(g, 2, 4),), hessian=True),
    case("as_strided_overlapping", lambda x: x.as_strided((3, 3), (1, 1)),
         lambda g: (normal(g, 5),)),
    case("as_strided_scatter", lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (3, 1), 1),
         lambda g: (normal(g, 2, 3), normal(g, 2, 2)), diff=(0, 1)),
    case("unfold", lambda x: x.unfold(1, 2, 1), lambda g: (normal(g, 2, 4),), hessian=True),
    case("unfold_step", lambda x: x.unfold(0, 3, 2), lambda g: (normal(g, 7, 2),)),
    case("aten_unfold", lambda x: aten.unfold.default(x, -1, 2, 2), lambda g: (normal(g, 3, 5),)),
    # --- index producers (not differentiable), mixed into a differentiable result ------------
    case("searchsorted", lambda s, v: v * torch.searchsorted(s, v),
         lambda g: (sorted_normal(g, 5), normal(g, 2, 3)), diff=(1,)),
    case("searchsorted_right_sorter",
         lambda s, v: v * torch.searchsorted(s, v, side="right", sorter=I([2, 0, 1, 3])),
         lambda g: (normal(g, 4), normal(g, 3)), diff=(1,)),
    case("searchsorted_batched_sorter", lambda s, v, o: v * torch.searchsorted(s, v, sorter=o),
         lambda g: _with_argsort(normal(g, 4), normal(g, 3)), diff=(1,)),
    case("searchsorted_nd", lambda s, v: v * torch.searchsorted(s, v, right=True),
         lambda g: (sorted_normal(g, 2, 4), normal(g, 2, 3)), diff=(1,)),
    case("bucketize", lambda x, b: x * torch.bucketize(x, b), lambda g: (normal(g, 2, 3),
                                                                      sorted_normal(g, 4))),
    case("bucketize_right", lambda x, b: x * torch.bucketize(x, b, right=True),
         lambda g: (normal(g, 5), sorted_normal(g, 3))),
    case("histc", lambda x: x * torch.histc(x, 4, -1.0, 1.0).sum(), lambda g: (normal(g, 2, 3),)),
    case("histc_data_range", lambda x: torch.histc(x, 5)[:, None] * x.sum(),
         lambda g: (normal(g, 3, 3),)),
    # --- embedding ----------------------------------------------------------------------------
    case("embedding", lambda w, i: F.embedding(i, w),
         lambda g: (normal(g, 5, 3), indices(g, 5, 2, 3)),
         hessian=True),
    case("embedding_padding", lambda w, i: F.embedding(i, w, padding_idx=1),
         lambda g: (normal(g, 4, 2), indices(g, 4, 5))),
    case("embedding_negative_padding", lambda w, i: F.embedding(i, w, padding_idx=-1),
         lambda g: (normal(g, 4, 2), indices(g, 4, 5))),
    case("embedding_scale_grad", lambda w: F.embedding(DUP, w, scale_grad_by_freq=True),
         lambda g: (normal(g, 3, 2),)),
    case("embedding_scale_padding", lambda w, i: torch.embedding(w, i, 0, True),
         lambda g: (normal(g, 3, 2), indices(g, 3, 6))),
    case("aten_embedding", lambda w, i: aten.embedding.default(w, i),
         lambda g: (normal(g, 4, 2), indices(g, 4, 3))),
    case("embedding_bag_mean", lambda w, i: F.embedding_bag(i, w),
         lambda g: (normal(g, 5, 3), indices(g, 5, 2, 3))),
    case("embedding_bag_offsets_sum", lambda w, i: F.embedding_bag(i, w, I([0, 2, 2]), mode="sum"),
         lambda g: (normal(g, 5, 3), indices(g, 5, 6))),
    case("embedding_bag_max_padding", lambda w, i: F.embedding_bag(
        i, w, I([0, 3]), mode="max", padding_idx=0),
        lambda g: (distinct(g, 4, 2), indices(g, 4, 5))),
    case("embedding_bag_per_sample_weights", lambda w, p: F.embedding_bag(
        DUP, w, I([0, 1, 4]), mode="sum", per_sample_weights=p, include_last_offset=True),
        lambda g: (normal(g, 3, 2), normal(g, 5)), diff=(0, 1)),
]


def _set(x, index, value):
    y = x.clone()
    y[index] = value
    return y


def _iadd(x, index, value):
    y = x.clone()
    y[index] += value
    return y


def _method(x, name, *args):
    y = x.clone()
    getattr(y, name)(*args)
    return y


# --- where torch.func cannot be the oracle -------------------------------------------------------
def reference(ns):
    """``ns`` (torch.func or minifunctorch) with its vmap replaced by a loop over the examples,
    and its forward mode by reverse mode (jvp, jacfwd and hessian through jacrev): what every
    transform must equal, computed with the fewest transforms."""
    class Reference:
        grad, vjp, jacrev = staticmethod(ns.grad), staticmethod(ns.vjp), staticmethod(ns.jacrev)

        @staticmethod
        def jacfwd(f, argnums=0):
            return ns.jacrev(f, argnums=argnums)

        @staticmethod
        def hessian(f, argnums=0):
            return ns.jacrev(ns.jacrev(f, argnums=argnums), argnums=argnums)

        @staticmethod
        def jvp(f, primals, tangents):
            out = f(*primals)
            jacobians = ns.jacrev(f, argnums=tuple(range(len(primals))))(*primals)
            out_dot = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jacobians, tangents))
            return out, out_dot

        @staticmethod
        def vmap(f, in_dims=0):
            def looped(*args):
                dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
                size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
                outs = [f(*[a if d is None else a.select(d, k).clone() for a, d in zip(args, dims)])
                        for k in range(size)]
                return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *outs)
            return looped
    return Reference


Reference = reference(tf)


VMAPS = ("vmap_0", "vmap_first", "vmap_rest", "vmap_dim1", "vmap_grad", "vmap_jacrev")
FORWARD = ("jvp", "jacfwd", "jacfwd_jacrev", "jvp_grad", "hessian")
# (case, transform) -> why torch.func is not the oracle there; checked against Reference.
TORCH_GAPS = {
    **{("index_mask_and_index", t): "torch.func's batched x[mask, i] adds a size-1 dim"
       for t in ("vmap_0", "vmap_rest", "vmap_dim1", "vmap_jacrev")},
    **{("index_0d_index", t): "torch.func calls .item() on a batched 0-d index"
       for t in ("vmap_grad", "vmap_jacrev")},
    **{("index_select_method_0d", t): "torch.func's batched index_select of a 0-d index "
       "keeps the whole dim" for t in VMAPS + ("jacfwd", "jacfwd_jacrev")},
    **{(name, "vmap_rest"): "torch.func refuses an in-place write of a batched value into "
       "a tensor created unbatched inside the function; minifunctorch allows it"
       for name in ("setitem_index", "setitem_duplicates", "setitem_batched_index",
                    "setitem_mask", "setitem_basic_and_tensor", "setitem_add",
                    "index_put_in_place", "index_add_in_place", "put_in_place",
                    "scatter_in_place", "masked_fill_in_place")},
    **{("index_fill_batched_index", t): "torch.func's batched index_fill backward crashes"
       for t in ("vmap_rest", "vmap_grad")},
    ("index_fill_tensor", "vmap_rest"): "torch.func's batched index_fill crashes",
    **{("as_strided_scatter", t): "torch.func has no batching rule for as_strided_scatter"
       for t in ("vmap_0", "vmap_first", "vmap_rest", "vmap_dim1")},
    **{(name, t): "torch.func's jvp of scatter_reduce(prod) is zero"
       for name in ("scatter_reduce_prod", "scatter_reduce_prod_exclude_self",
                    "scatter_reduce_prod_zeros")
       for t in FORWARD},
    **{(name, t): "torch.func's backward of scatter_reduce(prod) calls .item() under vmap"
       for name in ("scatter_reduce_prod", "scatter_reduce_prod_exclude_self",
                    "scatter_reduce_prod_zeros", "index_reduce_prod",
                    "index_reduce_prod_exclude_self")
       for t in ("vmap_grad", "vmap_jacrev")},
    **{(f"index_reduce_{r}{s_}", t): "torch.func has no forward mode for index_reduce"
       for r in ("prod", "mean", "amax", "amin") for s_ in ("", "_exclude_self")
       for t in FORWARD if t != "hessian"},
    **{("aten_index_reduce", t): "torch.func has no forward mode for index_reduce"
       for t in FORWARD if t != "hessian"},
    **{(name, t): "torch.func has no forward mode for embedding_bag"
       for name in ("embedding_bag_mean", "embedding_bag_offsets_sum",
                    "embedding_bag_max_padding", "embedding_bag_per_sample_weights")
       for t in FORWARD if t != "hessian"},
}
# (case, transform) -> why neither torch.func nor Reference is right there: checked by
# finite differences and jacfwd == jacrev instead (test_self_consistent).
TORCH_WRONG = {
    **{("as_strided_scatter", t): "torch's as_strided_scatter backward zeroes the wrong "
       "places of self" for t in ("grad", "vjp", "jacrev", "jacfwd", "vmap_grad", "grad_grad",
                                  "jacfwd_jacrev", "vmap_jacrev", "jvp_grad")},
    **{("embedding_bag_per_sample_weights", t): "torch has no double backward for "
       "embedding_bag with per_sample_weights" for t in ("grad_grad", "jvp_grad")},
}


def _params():
    for param in transform_params(CASES):
        case_, transform = param.values
        if (case_.name, transform) not in TORCH_WRONG:
            yield param


@pytest.mark.parametrize("case, transform", list(_params()))
def test_under_transform(case, transform):
    if (case.name, transform) in TORCH_GAPS:
        build = TRANSFORMS.get(transform, t_hessian)
        assert_same(build(mf, case), build(Reference, case))
    else:
        check_under_transform(case, transform)


@pytest.mark.parametrize("key", sorted(TORCH_GAPS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_torch_gaps_are_real(key):
    """Each gap is one: torch.func raises there, or disagrees with the reference."""
    name, transform = key
    c = next(c for c in CASES if c.name == name)
    build = TRANSFORMS.get(transform, t_hessian)
    try:
        theirs = build(tf, c)
    except Exception:
        return
    with pytest.raises(AssertionError):
        assert_same(theirs, build(Reference, c))


@pytest.mark.parametrize("key", sorted(TORCH_WRONG), ids=lambda k: f"{k[0]}-{k[1]}")
def test_self_consistent(key):
    """Where torch is wrong: each transform equals its loop and reverse-mode reference built
    from minifunctorch's own grad and jacrev (which finite differences check)."""
    name, transform = key
    c = next(c for c in CASES if c.name == name)
    build = TRANSFORMS.get(transform, t_hessian)
    assert_same(build(mf, c), build(reference(mf), c))


@pytest.mark.parametrize("name", sorted({k[0] for k in TORCH_WRONG}))
def test_second_derivatives_by_finite_differences(name):
    """Where torch cannot check them: the Hessian of the scalarized case is the finite
    differences of its gradient."""
    c = next(c for c in CASES if c.name == name)
    args = c.sample(seed=4)
    first = c.diff[0]
    weights = torch.randn(c.fn(*args).shape, generator=torch.Generator().manual_seed(17),
                          dtype=DTYPE)

    def grad_of(*a):
        return mf.grad(lambda *b: (c.fn(*b) * weights).sum(), argnums=first)(*a)
    hessian = mf.jacrev(grad_of, argnums=first)(*args)
    x, eps = args[first], 1e-6
    for k in range(x.numel()):
        step = torch.zeros(x.numel(), dtype=DTYPE)
        step[k] = eps
        plus, minus = list(args), list(args)
        plus[first], minus[first] = x + step.view(x.shape), x - step.view(x.shape)
        column = (grad_of(*plus) - grad_of(*minus)) / (2 * eps)
        torch.testing.assert_close(hessian.reshape(*x.shape, x.numel())[..., k], column,
                                   rtol=1e-4, atol=1e-5)


# Cases whose derivatives are torch's conventions rather than derivatives of the function:
NO_FINITE_DIFFERENCES = {
    "scatter_reduce_amax_ties": "ties share the derivative, which is not differentiable there",
    "scatter_reduce_amin_ties": "ties share the derivative, which is not differentiable there",
    "setitem_duplicates": "a place written twice gives both values its cotangent",
    "setitem_add": "a place written twice gives both values its cotangent",
    "embedding_scale_grad": "scale_grad_by_freq divides the gradient, not the function",
    "embedding_scale_padding": "the padding row gets no gradient",
    "histc": "piecewise constant", "histc_data_range": "piecewise constant",
}


@pytest.mark.parametrize("case", [c for c in CASES if c.name not in NO_FINITE_DIFFERENCES],
                         ids=lambda c: c.name)
def test_finite_differences(case):
    check_finite_differences(case)


def test_no_per_example_fallback():
    """Every case runs under vmap with batching rules only."""
    for c in CASES:
        with mf.capture_fallbacks() as used:
            TRANSFORMS["vmap_0"](mf, c)
            TRANSFORMS["vmap_dim1"](mf, c)
            TRANSFORMS["vmap_grad"](mf, c)
        assert not used, f"{c.name}: {dict(used)}"


# --- front door and programs ---------------------------------------------------------------------
def test_programs_print_basic_and_advanced_indexing():
    """Basic indexing stays one getitem (a view), tensors make one index."""
    program = mf.trace(lambda x: x[0] + x[I([1, 0])].sum(0) + x[:, [True, False]].sum())(
        torch.randn(3, 2))
    text = str(program)
    assert "getitem a index=(0,)" in text
    assert "index a b dims=(0,)" in text and "index a c dims=(1,)" in text


def test_write_through_a_view_with_tensor_indices():
    def f(x):
        y = x.clone()
        row = y[1]
        row[I([0, 2])] = x[0, :2] * 3
        return y * 2
    x = torch.randn(2, 3, dtype=DTYPE)
    assert_same(mf.vmap(f)(torch.stack([x, x + 1])), tf.vmap(f)(torch.stack([x, x + 1])))
    assert_same(mf.grad(lambda x: f(x).sum())(x), tf.grad(lambda x: f(x).sum())(x))


def test_scatter_reduce_keyword_matches_scatter_reduce():
    """torch has no derivative for scatter(..., reduce=): it is scatter_reduce including x,
    and gets that op's derivatives (checked against torch.func on scatter_reduce)."""
    g = torch.Generator().manual_seed(3)
    x, s = normal(g, 3, 2), normal(g, 4, 2)
    index = indices(g, 3, 4, 2)
    for reduce, name in (("add", "sum"), ("multiply", "prod")):
        ours = lambda x, s: x.scatter(0, index, s, reduce=reduce)  # noqa: E731
        theirs = lambda x, s: x.scatter_reduce(0, index, s, name)  # noqa: E731
        assert_same(mf.jacrev(ours, argnums=(0, 1))(x, s), tf.jacrev(theirs, argnums=(0, 1))(x, s))
        assert_same(mf.vmap(ours)(x.expand(2, 3, 2), s.expand(2, 4, 2)),
                    tf.vmap(theirs)(x.expand(2, 3, 2), s.expand(2, 4, 2)))
    value = lambda x: x.scatter(1, I([[0, 0], [1, 0], [0, 1]]), 2.0, reduce="multiply")  # noqa
    assert_same(mf.jacrev(value)(x), tf.jacrev(
        lambda x: x.scatter_reduce(1, I([[0, 0], [1, 0], [0, 1]]), torch.full((3, 2), 2.0,
                                                                              dtype=DTYPE),
                                   "prod"))(x))


def test_larger_src_gets_zero_cotangent():
    """A src larger than its index is read in its leading block (torch's backward raises)."""
    case_ = case("scatter_add_large_src",
                 lambda x, s: torch.scatter_add(x, 1, I([[0, 2], [1, 1]]), s),
                 lambda g: (normal(g, 2, 3), normal(g, 3, 4)), diff=(0, 1))
    check_finite_differences(case_)
    x, s = case_.sample()
    assert_same(mf.jacfwd(case_.fn, argnums=1)(x, s), mf.jacrev(case_.fn, argnums=1)(x, s))


def test_nn_embedding_module():
    """grad with respect to the weight of nn.Embedding, vmapped over batches of indices."""
    module = nn.Embedding(6, 3, padding_idx=2).double()
    params = dict(module.named_parameters())
    tokens = torch.randint(0, 6, (4, 5))

    def loss(params, tokens, ns):
        return ns.functional_call(module, params, (tokens,)).pow(2).sum()
    ours = mf.vmap(mf.grad(lambda p, t: loss(p, t, mf)), in_dims=(None, 0))(params, tokens)
    theirs = tf.vmap(tf.grad(lambda p, t: loss(p, t, tf)), in_dims=(None, 0))(params, tokens)
    assert_same(ours, theirs)
    bag = nn.EmbeddingBag(6, 3, mode="max").double()
    bag_params = dict(bag.named_parameters())
    ours = mf.grad(lambda p: mf.functional_call(bag, p, (tokens,)).sum())(bag_params)
    theirs = tf.grad(lambda p: tf.functional_call(bag, p, (tokens,)).sum())(bag_params)
    assert_same(ours, theirs)


def test_group_norm_through_as_strided():
    """torch's decomposition of group_norm ends with an as_strided (a reshape) on CPU."""
    x = torch.randn(2, 4, 3, dtype=DTYPE)
    w, b = torch.randn(4, dtype=DTYPE), torch.randn(4, dtype=DTYPE)
    f = lambda x, w, b: F.group_norm(x, 2, w, b)  # noqa: E731
    try:
        ours = mf.jacrev(f, argnums=(0, 1, 2))(x, w, b)
    except mf.MissingRuleError as error:
        if "var" in str(error):
            pytest.skip(f"needs var (another family): {error}")
        raise
    assert_same(ours, tf.jacrev(f, argnums=(0, 1, 2))(x, w, b))
    assert_same(mf.vmap(f, in_dims=(0, None, None))(x[None].expand(3, 2, 4, 3), w, b),
                tf.vmap(f, in_dims=(0, None, None))(x[None].expand(3, 2, 4, 3), w, b))


# --- as_strided on a tensor that torch lays out as a view ---------------------------------------
_WEIGHTS4 = torch.arange(1.0, 5.0, dtype=DTYPE).reshape(2, 2)
# (function of x, transform, x, whether the engine computes it): torch reads as_strided in the
# memory that x lies in; the engine, in x's own contiguous layout (NOTE [as_strided reads
# memory] in core/tensor.py). Where the two readings agree it computes torch.func's answer;
# where they differ it refuses, never reads other elements.
AS_STRIDED_LAYOUTS = {
    "contiguous_view": (lambda x: (x.reshape(3, 2).as_strided((2, 2), (2, 1), 1)
                                   * _WEIGHTS4).sum(), "grad", (2, 3), True),
    "row_default_offset": (lambda x: (x[1].as_strided((2,), (1,)) * _WEIGHTS4[0]).sum(),
                           "grad", (2, 3), True),
    "columns_read_in_order": (lambda x: (x[:, 1:].as_strided((2,), (1,)) * _WEIGHTS4[0]).sum(),
                              "grad", (2, 3), True),
    "transpose": (lambda x: (x.t().as_strided((2, 2), (1, 2)) * _WEIGHTS4).sum(),
                  "grad", (2, 2), False),
    "row_explicit_offset": (lambda x: (x[1].as_strided((3,), (1,), 0)).sum(),
                            "grad", (2, 3), False),
    "computed_from_transpose": (lambda x: (x.t().sin().as_strided((2, 2), (2, 1))
                                           * _WEIGHTS4).sum(), "grad", (2, 2), False),
    "vmap_offset": (lambda x: x.sin().as_strided((2,), (1,), 1), "vmap", (3, 2, 2), True),
    "vmap_transpose": (lambda x: x.t().as_strided((2, 2), (1, 2)), "vmap", (3, 2, 2), False),
    "scatter_into_transpose": (lambda x: torch.as_strided_scatter(
        x.t(), torch.ones(2, dtype=DTYPE), (2,), (1,)).sum(), "grad", (2, 2), False),
    "copy_of_transpose": (lambda x: (torch.as_strided_copy(x.t(), (2,), (1,), 1)
                                     * _WEIGHTS4[0]).sum(), "grad", (3, 3), False),
    "copy_of_contiguous": (lambda x: (torch.as_strided_copy(x, (2,), (1,), 1)
                                      * _WEIGHTS4[0]).sum(), "grad", (3, 3), True),
    "aten_op_of_transpose": (lambda x: (torch.ops.aten.as_strided(x.t(), (2,), (1,), 1)
                                        * _WEIGHTS4[0]).sum(), "grad", (3, 3), False),
    "in_place_of_transpose": (lambda x: (x.clone().t().as_strided_((2,), (1,), 1)
                                         * _WEIGHTS4[0]).sum(), "grad", (3, 3), False),
    "in_place_of_contiguous": (lambda x: (x.clone().as_strided_((2,), (1,), 1)
                                          * _WEIGHTS4[0]).sum(), "grad", (3, 3), True),
}


@pytest.mark.parametrize("name", list(AS_STRIDED_LAYOUTS))
def test_as_strided_reads_memory_like_torch_or_refuses(name):
    f, transform, shape, computed = AS_STRIDED_LAYOUTS[name]
    x = torch.arange(float(math.prod(shape)), dtype=DTYPE).reshape(shape) / 7
    if computed:
        assert_same(getattr(mf, transform)(f)(x), getattr(tf, transform)(f)(x))
    else:
        with pytest.raises(mf.UnsupportedOperationError,
                           match=r"^(Tensor|torch|aten)\.as_strided(_scatter|_copy|_)?"
                                 r"\(x, \.\.\.\): in torch x lies in memory with strides"):
            getattr(mf, transform)(f)(x)
        mf.grad(lambda x: x.sin().sum())(x)  # and the next call works


def test_as_strided_scatter_writes_into_a_copy_that_starts_its_memory():
    """torch's as_strided_scatter writes into ``x.clone()``, which starts at offset 0: on a
    row slice (offset 3 in torch) it reads as the engine does, so it is computed. torch.func's
    backward of as_strided_scatter is off (TORCH_WRONG above): finite differences judge."""
    def f(x):
        out = torch.as_strided_scatter(x[1:], torch.tensor([-1.0, -2.0], dtype=DTYPE), (2,), (1,))
        return (out * torch.arange(1.0, 7.0, dtype=DTYPE).reshape(2, 3)).sum()
    x = torch.randn(3, 3, dtype=DTYPE)
    ours = mf.grad(f)(x)
    expected = torch.zeros_like(x)
    for i in range(3):
        for j in range(3):
            step = torch.zeros_like(x)
            step[i, j] = 1e-6
            expected[i, j] = (f(x + step) - f(x - step)) / 2e-6
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_as_strided_of_a_non_contiguous_input_refuses():
    """A transposed input lies in memory as torch.func sees it inside grad."""
    f = lambda x: (x.as_strided((2, 2), (2, 1)) * _WEIGHTS4).sum()  # noqa: E731
    x = torch.arange(4.0, dtype=DTYPE).reshape(2, 2).t()
    with pytest.raises(mf.UnsupportedOperationError, match="strides \\(1, 2\\)"):
        mf.grad(f)(x)
    assert_same(mf.grad(f)(x.contiguous()), tf.grad(f)(x.contiguous()))


def test_as_strided_of_a_plain_view_reads_its_memory():
    """A tensor created inside the function has real memory: torch's kernel reads it."""
    def f(x):
        made_inside = torch.arange(4.0, dtype=DTYPE).reshape(2, 2).t()
        return (made_inside.as_strided((2, 2), (1, 2)) * x).sum()
    x = torch.ones(2, 2, dtype=DTYPE)
    assert_same(mf.grad(f)(x), tf.grad(f)(x))
    assert_same(mf.vmap(f)(x[None].expand(3, 2, 2)), tf.vmap(f)(x[None].expand(3, 2, 2)))


# --- histc under vmap: torch's own bin arithmetic ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histc_batched_counts_like_torch(dtype):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(40, 50, generator=g).to(dtype)
    xs[:, :5] = torch.linspace(-1, 1, 5).to(dtype)  # exactly on bin edges
    xs[0] = 0.25  # an example whose range is empty
    xs[1, 7] = 5.0  # outside the given range
    for args in ((7,), (7, -1.0, 1.0), (3, -0.3, 0.7), (4, 0.5, 0.5)):
        with mf.capture_fallbacks() as used:
            ours = mf.vmap(lambda x: torch.histc(x, *args))(xs)
        assert not used
        assert torch.equal(ours, torch.stack([torch.histc(x, *args) for x in xs])), args


# --- refusals ------------------------------------------------------------------------------------
def _batched_mask_cases():
    x, m = torch.randn(3, 4), torch.randn(3, 4) > 0
    return [
        ("x[mask]", lambda: mf.vmap(lambda x, m: x[m])(x, m)),
        ("x[mask] = 0", lambda: mf.vmap(lambda x, m: _set(x, m, 0.0))(x, m)),
        ("masked_select", lambda: mf.vmap(torch.masked_select)(x, m)),
        ("nonzero", lambda: mf.vmap(torch.nonzero)(x)),
        # (argwhere runs when every example has as many nonzero elements, as in torch.func:
        # tests/test_long_tail.py)
        ("nonzero(as_tuple=True)", lambda: mf.vmap(lambda x: torch.nonzero(x, as_tuple=True))(x)),
        ("unique", lambda: mf.vmap(torch.unique)(x)),
        ("unique_consecutive", lambda: mf.vmap(torch.unique_consecutive)(x)),
    ]


@pytest.mark.parametrize("what, call", _batched_mask_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_data_dependent_shapes_refused_under_vmap(what, call):
    with pytest.raises(mf.UnsupportedOperationError, match=r"^vmap\(.*output shape depends"):
        call()


def test_data_dependent_shapes_under_grad_and_jvp():
    """Unbatched masks and nonzero work under grad and jvp; unique of a float has no
    derivative in torch, and is refused."""
    x = torch.randn(3, 4, dtype=DTYPE)

    def f(x):
        return (x[torch.nonzero(x > 0, as_tuple=True)] ** 2).sum() + x.masked_select(x < 0).sum()
    assert_same(mf.grad(f)(x), tf.grad(f)(x))
    assert_same(mf.jvp(f, (x,), (x,)), tf.jvp(f, (x,), (x,)))
    assert_same(mf.vmap(lambda x: x[MASK_35[:, :4]])(torch.stack([x, x])),
                tf.vmap(lambda x: x[MASK_35[:, :4]])(torch.stack([x, x])))
    with pytest.raises(mf.MissingRuleError, match=r"^grad\(.*unique"):
        mf.grad(lambda x: torch.unique(x).sum())(x)


def test_prod_double_backward_with_two_zeros_is_refused():
    """Two zeros reduced into one place: the first derivative is right (zero), the second is
    not defined by torch's formula, which torch refuses (and torch.func silently zeroes)."""
    index = I([0, 1, 0, 2])

    def first(x, s):
        return mf.grad(lambda s: x.scatter_reduce(0, index, s, "prod").sum())(s)
    x = torch.randn(3, dtype=DTYPE)
    assert_same(first(x, I([0.0, 1.0, 0.0, 2.0], dtype=DTYPE)),
                tf.grad(lambda s: x.scatter_reduce(0, index, s, "prod").sum())(
                    I([0.0, 1.0, 0.0, 2.0], dtype=DTYPE)))
    with pytest.raises(mf.UnsupportedOperationError, match="second derivative"):
        mf.jacrev(first, argnums=1)(x, I([0.0, 1.0, 0.0, 2.0], dtype=DTYPE))
    with pytest.raises(mf.UnsupportedOperationError, match="second derivative"):
        mf.jacfwd(first, argnums=1)(x, I([0.0, 1.0, 0.0, 2.0], dtype=DTYPE))
    one_zero = I([0.0, 1.0, 3.0, 2.0], dtype=DTYPE)  # one zero per place: fine to any order
    theirs = tf.jacrev(tf.grad(lambda s: x.scatter_reduce(0, index, s, "prod").sum()))
    assert_same(mf.jacrev(first, argnums=1)(x, one_zero), theirs(one_zero))


@pytest.mark.parametrize("call, match", [
    (lambda x: x.as_strided((3, 3), (3, 2)), "reach outside"),
    (lambda x: x[torch.tensor([0.5])], "integer or boolean"),
    (lambda x: x[torch.tensor([True, False])], "does not match"),
    (lambda x: x[0, 1, I([0])], "too many indices"),
    (lambda x: x.index_put((I([0]),), torch.ones(2, 3)), "cannot be broadcast"),
    (lambda x: torch.histc(x, 3, 1.0, -1.0), "max larger than min"),
], ids=["as_strided", "float_index", "mask_shape", "too_many", "values_shape", "histc"])
def test_usage_errors(call, match):
    with pytest.raises(mf.TransformError, match=match):
        mf.grad(lambda x: call(x).sum())(torch.randn(3, 3))


@pytest.mark.parametrize("check", [torch.ops.aten._is_all_true, torch.ops.aten._is_any_true])
def test_checks_over_the_whole_batch_give_one_unbatched_answer(check):
    # NOTE [Checks over the whole batch]: torch.func answers for every example at once
    masks = [torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, 3, dtype=torch.bool)]
    masks.append(masks[0].clone())
    masks[2][1, 2] = False
    for mask in masks:
        seen = {}

        def f(m, api):
            seen[api] = check(m)
            return m
        tf.vmap(lambda m: f(m, tf))(mask)
        mf.vmap(lambda m: f(m, mf))(mask)
        assert seen[mf].shape == () and seen[mf].item() == seen[tf].item()
    with pytest.raises(RuntimeError, match="Test message for TORCH_CHECK_TENSOR_ALL"):
        mf.vmap(lambda t: torch._test_check_tensor(t >= 0))(torch.tensor([[1.0], [-1.0]]))
    checked = mf.vmap(lambda t: torch._test_check_tensor(t >= 0))(torch.ones(2, 3))
    torch.testing.assert_close(checked, torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("index", [-1, 3], ids=["negative", "past the end"])
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
def test_an_embedding_index_out_of_range_is_refused_under_every_transform(index, bag):
    """The lookup is advanced indexing, which reads a negative index from the end: torch's
    kernels refuse any index outside [0, rows), and so must every transform (a negative
    index used to give the last row under vmap, grad and jvp)."""
    weight = torch.randn(3, 2, dtype=DTYPE)
    indices = torch.tensor([0, index])

    def f(w):
        if bag:
            return F.embedding_bag(indices, w, torch.tensor([0]))
        return F.embedding(indices, w)
    with pytest.raises(Exception) as torchs:
        f(weight)
    runs = {"vmap": lambda: mf.vmap(f)(torch.stack([weight, 2 * weight])),
            "grad": lambda: mf.grad(lambda w: f(w).sum())(weight),
            "jvp": lambda: mf.jvp(f, (weight,), (weight,)),
            "vmap over the indices": lambda: mf.vmap(
                lambda i: F.embedding(i, weight))(torch.stack([indices, indices.flip(0)]))}
    for name, run in runs.items():
        with pytest.raises(mf.TransformError, match="index|valid range") as ours:
            run()
        assert isinstance(ours.value, type(torchs.value)) or (
            name == "vmap over the indices" and isinstance(ours.value, IndexError)), name


_INDEX_OPS = {
    "index_select": lambda x, i, s: torch.index_select(x, 0, i),
    "index_add": lambda x, i, s: x.index_add(0, i, s),
    "index_copy": lambda x, i, s: x.index_copy(0, i, s),
    "index_reduce": lambda x, i, s: x.index_reduce(0, i, s, "amax"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # (index_reduce is in beta)
@pytest.mark.parametrize("index", [-1, 3], ids=["negative", "past the end"])
@pytest.mark.parametrize("name", list(_INDEX_OPS))
def test_an_index_out_of_range_is_refused_by_the_index_ops(name, index):
    """NOTE [Indices out of range are read, not wrapped]: index_select, index_add, index_copy
    and index_reduce are advanced indexing here, which would read a negative index from the
    end; torch refuses it, and so does every transform, with torch's exception type."""
    f = _INDEX_OPS[name]
    x, source = torch.randn(3, 2, dtype=DTYPE), torch.randn(2, 2, dtype=DTYPE)
    indices = torch.tensor([0, index])
    with pytest.raises(Exception) as torchs:
        f(x, indices, source)
    runs = {"vmap": lambda: mf.vmap(f, in_dims=(0, None, 0))(
                torch.stack([x, x]), indices, torch.stack([source, source])),
            "vmap over the indices": lambda: mf.vmap(f, in_dims=(None, 0, None))(
                x, torch.stack([indices, indices.flip(0)]), source),
            "grad": lambda: mf.grad(lambda x: f(x, indices, source).sum())(x),
            "jvp": lambda: mf.jvp(lambda x: f(x, indices, source), (x,), (x,))}
    for transform, run in runs.items():
        with pytest.raises(mf.TransformError, match="out of") as ours:
            run()
        assert isinstance(ours.value, type(torchs.value)), (transform, ours.value)


# --- one_hot ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_classes", [4, -1])
def test_one_hot_under_vmap_and_jit(num_classes):
    t = torch.tensor([[0, 3, 1], [2, 2, 0]])
    if num_classes == -1:
        # torch.func's words: each example would count its own classes
        for api in (mf, tf):
            with pytest.raises(RuntimeError, match="please provide an explicit positive"):
                api.vmap(lambda t: F.one_hot(t))(t)
        assert torch.equal(mf.grad(lambda x: (F.one_hot(t) * x).sum())(torch.ones(4)),
                           F.one_hot(t).sum((0, 1)).float())
    else:
        assert torch.equal(mf.vmap(lambda t: F.one_hot(t, num_classes))(t),
                           tf.vmap(lambda t: F.one_hot(t, num_classes))(t))
    program = mf.jit(lambda t: F.one_hot(t, 4))
    assert torch.equal(program(t), F.one_hot(t, 4))
    for bad in ([0, 4], [-1, 0]):  # torch's C++ skips its check on a traced tensor
        with pytest.raises(RuntimeError, match="Class values must be"):
            F.one_hot(torch.tensor(bad), 4)
        with pytest.raises(RuntimeError, match="Class values must be"):
            program(torch.tensor(bad))
    with pytest.raises(mf.UnsupportedOperationError, match="Fix: pass num_classes"):
        mf.jit(lambda t: F.one_hot(t))(t)
    with pytest.raises(RuntimeError, match="only applicable to index tensor"):
        mf.vmap(lambda t: F.one_hot(t, 4))(t.float())


def test_the_backward_of_index_select_adds_into_its_zeros_in_place():
    """NOTE [index_select and index_add: torch's kernels for one index along one dim]: the
    cotangent is added into a fresh tensor of zeros where it is a plain tensor (no copy of
    the zeros, as torch.index_add would make), and bound as index_add under vmap; both are
    torch.func's bits."""
    weight, index = torch.randn(50, 8, dtype=DTYPE), torch.tensor([3, 0, 3, 49, 7])
    f = lambda w: (F.embedding(index, w) ** 2).sum()  # noqa: E731
    calls, ours = aten_calls(lambda: mf.grad(f)(weight))
    assert calls.get("aten::index_add_") == 1 and "aten::copy_" not in calls, calls
    assert_same(ours, tf.grad(f)(weight))
    weights = torch.randn(3, 50, 8, dtype=DTYPE)
    assert_same(mf.vmap(mf.grad(f))(weights), tf.vmap(tf.grad(f))(weights))
