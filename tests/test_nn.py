"""The nn family (core/nn.py): convolution, pooling, normalization, padding, losses and the
other layers of torch.nn.functional, under every transform, against torch.func.

Each OpCase is one user-level call on small float64 inputs. Where torch.func cannot be the
oracle (no forward-mode derivative in torch, no double backward, a batching rule of its own
that fails), another one is named: torch.func with vmap as a loop, or our engine with
forward mode computed by reverse mode or the other way round. Then: no per-example fallback
under vmap, the kernels kept
fused are bit-exact with torch.func in float32, per-sample gradients of a convolution are
one grouped convolution, batch norm's running statistics, the regression tests of the issue
tracker, refusals, and small nn.Module models through functional_call.
"""
import itertools
import warnings

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core import kernels
from minifunctorch.core import nn as mf_nn
from minifunctorch.core.errors import (
    DimOutOfRangeError,
    InPlaceError,
    InputDtypeError,
    InvalidOptionError,
    MissingRuleError,
    RandomnessError,
    ShapeMismatchError,
    TransformError,
    TransformUsageError,
    UnsupportedOperationError,
)
from op_table import DTYPE, OpCase, distinct, indices, normal, positive
from oracle import (
    TRANSFORMS,
    t_hessian as TRANSFORMS_HESSIAN,
    aten_calls,
    assert_same,
    check_finite_differences,
    check_under_transform,
    transform_params,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Using padding='same'"),
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides"),
    pytest.mark.filterwarnings("ignore:Using a target size"),
]


def case(name, fn, make, diff=(0,), hessian=False):
    return OpCase(name, fn, make, tuple(diff), hessian)


def unit(g, *shape):
    """Values in (0.05, 0.95): probabilities for the binary cross-entropy."""
    return torch.rand(shape, generator=g, dtype=DTYPE) * 0.9 + 0.05


def signs(g, *shape):
    return torch.randint(0, 2, shape, generator=g).to(DTYPE) * 2 - 1


def grid(g, *shape):
    """Sampling positions slightly beyond [-1, 1], so that every padding mode matters."""
    return torch.rand(shape, generator=g, dtype=DTYPE) * 2.4 - 1.2


def ignored(g, classes, *shape):
    """Class indices with about a third of them ignore_index (-100)."""
    target = torch.randint(0, classes, shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.33, -100, target)


x4 = lambda g: normal(g, 2, 4, 5, 5)  # noqa: E731  an NCHW batch

CASES = [
    # --- convolution: the front door (F.conv*, F.conv_transpose*) and the back door
    case("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1),
         lambda g: (x4(g), normal(g, 3, 4, 3, 3), normal(g, 3)), diff=(0, 1, 2), hessian=True),
    case("conv2d_stride_dilation_groups", lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1),
                                                                    dilation=(1, 2), groups=2),
         lambda g: (x4(g), normal(g, 6, 2, 2, 2), normal(g, 6)), diff=(0, 1, 2)),
    case("conv2d_same", lambda x, w: F.conv2d(x, w, padding="same", dilation=(1, 2)),
         lambda g: (x4(g), normal(g, 3, 4, 2, 3)), diff=(0, 1)),
    case("conv2d_valid_unbatched", lambda x, w: F.conv2d(x, w, padding="valid"),
         lambda g: (normal(g, 4, 5, 5), normal(g, 2, 4, 3, 2)), diff=(0, 1)),
    case("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=2),
         lambda g: (normal(g, 2, 3, 7), normal(g, 4, 3, 3), normal(g, 4)), diff=(0, 1, 2),
         hessian=True),
    case("conv1d_same_even_kernel", lambda x, w: F.conv1d(x, w, padding="same"),
         lambda g: (normal(g, 2, 3, 6), normal(g, 2, 3, 4)), diff=(0, 1)),
    case("conv3d_groups", lambda x, w: F.conv3d(x, w, groups=2, padding=1, stride=2),
         lambda g: (normal(g, 2, 4, 3, 4, 3), normal(g, 4, 2, 2, 2, 2)), diff=(0, 1)),
    case("conv_transpose2d", lambda x, w, b: F.conv_transpose2d(
        x, w, b, stride=2, padding=1, output_padding=1, groups=2),
         lambda g: (normal(g, 2, 4, 3, 3), normal(g, 4, 3, 3, 3), normal(g, 6)), diff=(0, 1, 2),
         hessian=True),
    case("conv_transpose1d_dilation", lambda x, w: F.conv_transpose1d(x, w, stride=2,
                                                                       dilation=2),
         lambda g: (normal(g, 2, 3, 4), normal(g, 3, 2, 3)), diff=(0, 1)),
    case("conv_transpose3d", lambda x, w: F.conv_transpose3d(x, w, stride=(1, 2, 1)),
         lambda g: (normal(g, 1, 2, 2, 3, 2), normal(g, 2, 3, 2, 2, 2)), diff=(0, 1)),
    case("nn_conv2d_reflect", lambda x, w, b: torch.func.functional_call(
        CONV_REFLECT, {"weight": w, "bias": b}, (x,)),
         lambda g: (x4(g), normal(g, 3, 4, 3, 3), normal(g, 3)), diff=(0, 1, 2)),
    case("aten_convolution", lambda x, w: torch.ops.aten.convolution(
        x, w, None, [1, 2], [0, 1], [1, 1], False, [0, 0], 1),
         lambda g: (x4(g), normal(g, 3, 4, 2, 2)), diff=(0, 1)),
    # --- pooling
    case("max_pool2d", lambda x: F.max_pool2d(x, 3, 2, padding=1),
         lambda g: (distinct(g, 2, 3, 5, 5),),
         hessian=True),
    case("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True)[0] *
         F.max_pool2d(x, 2, return_indices=True)[1], lambda g: (distinct(g, 2, 3, 4, 4),)),
    case("max_pool2d_dilation_ceil", lambda x: F.max_pool2d(x, 2, 2, dilation=2, ceil_mode=True),
         lambda g: (distinct(g, 2, 2, 6, 5),)),
    case("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1), lambda g: (distinct(g, 2, 3, 8),)),
    case("max_pool3d_unbatched", lambda x: F.max_pool3d(x, 2),
         lambda g: (distinct(g, 2, 4, 4, 4),)),
    case("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (3, 2)),
         lambda g: (distinct(g, 2, 2, 5, 5),)),
    case("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 3),
         lambda g: (distinct(g, 2, 3, 7),)),
    case("aten_max_pool2d_with_indices", lambda x: torch.ops.aten.max_pool2d_with_indices(
        x, [2, 2], [1, 1])[0], lambda g: (distinct(g, 2, 3, 4, 4),)),
    case("aten_max_pool2d_with_indices_backward", lambda ct, x: torch.ops.aten.
         max_pool2d_with_indices_backward(ct, x, [3, 3], [2, 2], [1, 1], [1, 2], False,
                                          F.max_pool2d(x, 3, 2, 1, (1, 2), return_indices=True)[1]),
         lambda g: (normal(g, 2, 2, 2, 2), distinct(g, 2, 2, 3, 6)), diff=(0, 1)),
    case("adaptive_max_pool3d_with_indices", lambda x: (lambda v, i: v * i)(
        *F.adaptive_max_pool3d(x, (2, 1, 2), return_indices=True)),
         lambda g: (distinct(g, 2, 3, 4, 3),)),
    case("avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2, padding=1), lambda g: (x4(g),),
         hessian=True),
    case("avg_pool2d_ceil_no_pad_count", lambda x: F.avg_pool2d(
        x, 2, 2, padding=1, ceil_mode=True, count_include_pad=False), lambda g: (x4(g),)),
    case("avg_pool2d_divisor", lambda x: F.avg_pool2d(x, 2, divisor_override=3),
         lambda g: (x4(g),)),
    case("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1), lambda g: (normal(g, 2, 3, 8),)),
    case("avg_pool3d", lambda x: F.avg_pool3d(x, 2, ceil_mode=True),
         lambda g: (normal(g, 2, 2, 3, 4, 3),)),
    case("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), lambda g: (x4(g),)),
    case("adaptive_avg_pool2d_1x1", lambda x: F.adaptive_avg_pool2d(x, 1), lambda g: (x4(g),)),
    case("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 4),
         lambda g: (normal(g, 2, 3, 7),)),
    case("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, None, 1)),
         lambda g: (normal(g, 1, 2, 3, 4, 3),)),
    case("lp_pool2d", lambda x: F.lp_pool2d(x, 2, 2), lambda g: (positive(g, 2, 3, 4, 4),)),
    case("lp_pool1d", lambda x: F.lp_pool1d(x, 3, 2), lambda g: (positive(g, 2, 3, 6),)),
    # --- normalization
    case("batch_norm_train", lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
         lambda g: (normal(g, 3, 4, 3, 3), normal(g, 4), normal(g, 4)), diff=(0, 1, 2),
         hessian=True),
    case("batch_norm_train_2d_no_affine", lambda x: F.batch_norm(x, None, None, training=True),
         lambda g: (normal(g, 5, 3),), hessian=True),
    case("batch_norm_eval", lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, eps=1e-3),
         lambda g: (normal(g, 3, 4, 3), normal(g, 4), normal(g, 4), normal(g, 4),
                    positive(g, 4)), diff=(0, 1, 2), hessian=True),
    case("aten_native_batch_norm", lambda x, w: torch.native_batch_norm(
        x, w, None, None, None, True, 0.1, 1e-5)[0] + torch.native_batch_norm(
        x, w, None, None, None, True, 0.1, 1e-5)[2].sum(),
         lambda g: (normal(g, 4, 3, 2), normal(g, 3)), diff=(0, 1)),
    case("instance_norm", lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
         lambda g: (normal(g, 2, 3, 4, 4), normal(g, 3), normal(g, 3)), diff=(0, 1, 2)),
    case("instance_norm_1d_no_affine", lambda x: F.instance_norm(x, eps=1e-3),
         lambda g: (normal(g, 3, 2, 5),), hessian=True),
    case("instance_norm_3d_weight", lambda x, w: F.instance_norm(x, weight=w),
         lambda g: (normal(g, 2, 2, 3, 2, 3), normal(g, 2)), diff=(0, 1), hessian=True),
    case("layer_norm", lambda x, w, b: F.layer_norm(x, (5,), w, b),
         lambda g: (normal(g, 3, 4, 5), normal(g, 5), normal(g, 5)), diff=(0, 1, 2),
         hessian=True),
    case("layer_norm_two_dims", lambda x: F.layer_norm(x, (4, 5), eps=1e-3),
         lambda g: (normal(g, 3, 4, 5),)),
    case("layer_norm_no_affine", lambda x: F.layer_norm(x, (5,)),
         lambda g: (normal(g, 3, 4, 5),), hessian=True),
    case("layer_norm_weight_only", lambda x, w: F.layer_norm(x, (5,), w),
         lambda g: (normal(g, 4, 5), normal(g, 5)), diff=(0, 1), hessian=True),
    case("layer_norm_bias_only", lambda x, b: F.layer_norm(x, (5,), None, b, 1e-3),
         lambda g: (normal(g, 4, 5), normal(g, 5)), diff=(0, 1)),
    case("layer_norm_two_dims_affine", lambda x, w, b: F.layer_norm(x, (4, 5), w, b),
         lambda g: (normal(g, 3, 4, 5), normal(g, 4, 5), normal(g, 4, 5)), diff=(0, 1, 2),
         hessian=True),
    case("torch_layer_norm_unbatched", lambda x, w, b: torch.layer_norm(x, [5], w, b, 1e-3),
         lambda g: (normal(g, 5), normal(g, 5), normal(g, 5)), diff=(0, 1, 2), hessian=True),
    # over one element the output is the bias whatever the input: every input derivative 0
    case("layer_norm_one_element", lambda x, w, b: F.layer_norm(x, (1,), w, b),
         lambda g: (normal(g, 3, 1), normal(g, 1), normal(g, 1)), diff=(0, 1, 2)),
    case("aten_native_layer_norm", lambda x: torch.ops.aten.native_layer_norm(
        x, [5], None, None, 1e-5)[2].sum() * x, lambda g: (normal(g, 3, 5),)),
    case("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b),
         lambda g: (normal(g, 2, 4, 3, 3), normal(g, 4), normal(g, 4)), diff=(0, 1, 2),
         hessian=True),
    case("group_norm_no_affine", lambda x: F.group_norm(x, 3), lambda g: (normal(g, 2, 6, 5),),
         hessian=True),
    case("group_norm_1d_affine", lambda x, w, b: F.group_norm(x, 3, w, b, 1e-3),
         lambda g: (normal(g, 3, 6, 4), normal(g, 6), normal(g, 6)), diff=(0, 1, 2),
         hessian=True),
    case("group_norm_weight_only", lambda x, w: F.group_norm(x, 1, w),
         lambda g: (normal(g, 2, 4, 2, 3), normal(g, 4)), diff=(0, 1), hessian=True),
    case("group_norm_no_spatial", lambda x, w, b: F.group_norm(x, 2, w, b),
         lambda g: (normal(g, 3, 4), normal(g, 4), normal(g, 4)), diff=(0, 1, 2)),
    case("torch_group_norm", lambda x, w, b: torch.group_norm(x, 2, w, b, 1e-5),
         lambda g: (normal(g, 2, 4, 3, 3), normal(g, 4), normal(g, 4)), diff=(0, 1, 2)),
    case("aten_native_group_norm", lambda x: (lambda out, mean, rstd: out * mean.sum() +
                                              rstd.sum())(
        *torch.ops.aten.native_group_norm(x, None, None, 2, 4, 3, 2, 1e-5)),
         lambda g: (normal(g, 2, 4, 3),)),
    case("rms_norm", lambda x, w: F.rms_norm(x, (5,), w), lambda g: (normal(g, 3, 5), normal(g, 5)),
         diff=(0, 1)),
    case("normalize", lambda x: F.normalize(x, dim=-1), lambda g: (normal(g, 3, 4),)),
    case("normalize_p1", lambda x: F.normalize(x, p=1.0, dim=0), lambda g: (normal(g, 3, 4),)),
    # p = 0 counts the nonzero elements (no derivative): once a ZeroDivisionError (1 / p)
    case("normalize_p0", lambda x: F.normalize(x, p=0.0, dim=-1), lambda g: (normal(g, 3, 4),)),
    case("normalize_p_half_inf", lambda x: F.normalize(x, p=0.5, dim=0) +
         F.normalize(x, p=float("inf"), dim=1), lambda g: (distinct(g, 3, 4),)),
    case("local_response_norm", lambda x: F.local_response_norm(x, 3),
         lambda g: (normal(g, 2, 5, 3, 3),)),
    # --- padding
    case("pad_constant", lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), lambda g: (x4(g),),
         hessian=True),
    case("pad_negative_crops", lambda x: F.pad(x, (1, -2, -1, 2)), lambda g: (x4(g),)),
    case("aten_constant_pad_nd", lambda x: torch.constant_pad_nd(x, [2, 1]),
         lambda g: (normal(g, 3, 4),)),
    case("pad_reflect", lambda x: F.pad(x, (2, 1, 1, 3), mode="reflect"), lambda g: (x4(g),)),
    case("pad_reflect1d", lambda x: F.pad(x, (2, 3), mode="reflect"),
         lambda g: (normal(g, 2, 3, 5),)),
    case("pad_replicate3d", lambda x: F.pad(x, (1, 0, 2, 1, 0, 2), mode="replicate"),
         lambda g: (normal(g, 1, 2, 3, 3, 2),)),
    case("pad_circular", lambda x: F.pad(x, (2, 1, 1, 2), mode="circular"), lambda g: (x4(g),)),
    # negative pads crop first, and the wrap-around reads the part that is kept: once it read
    # the whole input (50% of the elements wrong)
    case("pad_circular_negative", lambda x: F.pad(x, (-1, 1, -2, 1), mode="circular"),
         lambda g: (x4(g),)),
    case("pad_circular_crop_and_wrap_3d", lambda x: F.pad(x, (2, -1, -1, 1, 0, -1),
                                                          mode="circular"),
         lambda g: (normal(g, 1, 2, 3, 4, 4),)),
    case("aten_pad_circular_negative", lambda x: torch.ops.aten._pad_circular(x, [1, -2]),
         lambda g: (normal(g, 2, 3, 5),)),
    # --- losses
    case("nll_loss", F.nll_loss, lambda g: (normal(g, 5, 4), indices(g, 4, 5)), hessian=True),
    case("nll_loss_weight_ignore", lambda x, t, w: F.nll_loss(x, t, w),
         lambda g: (normal(g, 6, 4), ignored(g, 4, 6), positive(g, 4))),
    case("nll_loss_nd_sum", lambda x, t: F.nll_loss(x, t, reduction="sum", ignore_index=2),
         lambda g: (normal(g, 2, 4, 3, 2), indices(g, 4, 2, 3, 2))),
    case("nll_loss_none_1d", lambda x, t: F.nll_loss(x, t, reduction="none"),
         lambda g: (normal(g, 4), indices(g, 4))),
    case("nll_loss_1d_mean_weight", lambda x, t, w: F.nll_loss(x, t, w),
         lambda g: (normal(g, 4), indices(g, 4), positive(g, 4)), hessian=True),
    case("cross_entropy", F.cross_entropy, lambda g: (normal(g, 5, 4), indices(g, 4, 5)),
         hessian=True),
    case("cross_entropy_weight_ignore_smoothing", lambda x, t, w: F.cross_entropy(
        x, t, w, label_smoothing=0.2), lambda g: (normal(g, 6, 4), ignored(g, 4, 6),
                                                  positive(g, 4)), hessian=True),
    case("cross_entropy_smoothing_none_nd", lambda x, t: F.cross_entropy(
        x, t, reduction="none", label_smoothing=0.1, ignore_index=1),
         lambda g: (normal(g, 2, 4, 3), indices(g, 4, 2, 3))),
    case("cross_entropy_smoothing_sum_weight", lambda x, t, w: F.cross_entropy(
        x, t, w, reduction="sum", label_smoothing=0.3), lambda g: (normal(g, 5, 3),
                                                                   ignored(g, 3, 5),
                                                                   positive(g, 3))),
    case("cross_entropy_probabilities", lambda x, p, w: F.cross_entropy(
        x, p, w, label_smoothing=0.1), lambda g: (normal(g, 5, 4),
                                                  torch.softmax(normal(g, 5, 4), 1),
                                                  positive(g, 4)), diff=(0, 1)),
    case("binary_cross_entropy", lambda x, t, w: F.binary_cross_entropy(x, t, w),
         lambda g: (unit(g, 3, 4), unit(g, 3, 4), positive(g, 4)), diff=(0, 1), hessian=True),
    case("binary_cross_entropy_with_logits", lambda x, t, w, p: F.binary_cross_entropy_with_logits(
        x, t, w, pos_weight=p), lambda g: (normal(g, 3, 4), unit(g, 3, 4), positive(g, 4),
                                           positive(g, 4)), diff=(0, 1), hessian=True),
    case("binary_cross_entropy_with_logits_sum", lambda x, t: F.binary_cross_entropy_with_logits(
        x, t, reduction="sum"), lambda g: (normal(g, 3, 4), unit(g, 3, 4)), diff=(0, 1)),
    case("mse_loss_weight", lambda x, t, w: F.mse_loss(x, t, weight=w),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4), positive(g, 3, 4)), diff=(0, 1)),
    case("mse_loss", lambda x, t: F.mse_loss(x, t),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("mse_loss_sum", lambda x, t: F.mse_loss(x, t, reduction="sum"),
         lambda g: (normal(g, 2, 3, 4), normal(g, 2, 3, 4)), diff=(0, 1), hessian=True),
    case("mse_loss_none", lambda x, t: F.mse_loss(x, t, reduction="none"),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("mse_loss_scalar", lambda x, t: F.mse_loss(x, t),
         lambda g: (normal(g), normal(g)), diff=(0, 1), hessian=True),
    case("mse_loss_broadcast", lambda x, t: F.mse_loss(x, t),
         lambda g: (normal(g, 3, 4), normal(g, 1, 4)), diff=(0, 1), hessian=True),
    case("l1_loss", lambda x, t: F.l1_loss(x, t, reduction="sum"),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1)),
    case("smooth_l1_loss", lambda x, t: F.smooth_l1_loss(x, t, beta=0.7),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("smooth_l1_loss_beta0", lambda x, t: F.smooth_l1_loss(x, t, beta=0.0, reduction="none"),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1)),
    case("smooth_l1_loss_sum", lambda x, t: F.smooth_l1_loss(x, t, beta=1.5, reduction="sum"),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("smooth_l1_loss_broadcast", lambda x, t: F.smooth_l1_loss(x, t),
         lambda g: (normal(g, 3, 4), normal(g, 1, 4)), diff=(0, 1), hessian=True),
    case("huber_loss", lambda x, t: F.huber_loss(x, t, delta=0.8),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("huber_loss_none", lambda x, t: F.huber_loss(x, t, delta=1.2, reduction="none"),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1), hessian=True),
    case("huber_loss_weight", lambda x, t, w: F.huber_loss(x, t, delta=0.8, weight=w),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4), positive(g, 3, 4)), diff=(0, 1),
         hessian=True),
    case("kl_div_batchmean", lambda x, t: F.kl_div(x, t, reduction="batchmean"),
         lambda g: (normal(g, 3, 4), unit(g, 3, 4)), diff=(0, 1), hessian=True),
    case("kl_div_log_target", lambda x, t: F.kl_div(x, t, reduction="sum", log_target=True),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1)),
    case("kl_div_mean", lambda x, t: F.kl_div(x, t), lambda g: (normal(g, 3, 4), unit(g, 3, 4)),
         diff=(0, 1)),
    case("poisson_nll_loss", lambda x, t: F.poisson_nll_loss(x, t),
         lambda g: (normal(g, 3, 4), positive(g, 3, 4)), diff=(0, 1)),
    case("poisson_nll_loss_full", lambda x, t: F.poisson_nll_loss(x, t, log_input=False, full=True),
         lambda g: (positive(g, 3, 4), positive(g, 3, 4) * 2), diff=(0, 1)),
    case("gaussian_nll_loss", lambda x, t: F.gaussian_nll_loss(x, t, GAUSSIAN_VAR, full=True),
         lambda g: (normal(g, 3, 4), normal(g, 3, 4)), diff=(0, 1)),
    case("margin_ranking_loss", lambda a, b, t: F.margin_ranking_loss(a, b, t, margin=0.1),
         lambda g: (normal(g, 5), normal(g, 5), signs(g, 5)), diff=(0, 1)),
    case("hinge_embedding_loss", lambda x, t: F.hinge_embedding_loss(x, t, margin=0.5),
         lambda g: (normal(g, 3, 4), signs(g, 3, 4))),
    case("cosine_embedding_loss", lambda a, b, t: F.cosine_embedding_loss(a, b, t, margin=0.1),
         lambda g: (normal(g, 4, 5), normal(g, 4, 5), signs(g, 4)), diff=(0, 1)),
    case("triplet_margin_loss", lambda a, p, n: F.triplet_margin_loss(a, p, n, swap=True),
         lambda g: (normal(g, 4, 5), normal(g, 4, 5), normal(g, 4, 5)), diff=(0, 1, 2)),
    case("multilabel_soft_margin_loss", lambda x, t, w: F.multilabel_soft_margin_loss(x, t, w),
         lambda g: (normal(g, 3, 4), unit(g, 3, 4).round(), positive(g, 4))),
    case("cosine_similarity", lambda a, b: F.cosine_similarity(a, b, dim=-1),
         lambda g: (normal(g, 3, 5), normal(g, 5)), diff=(0, 1), hessian=True),
    case("pairwise_distance", lambda a, b: F.pairwise_distance(a, b),
         lambda g: (normal(g, 3, 5), normal(g, 3, 5)), diff=(0, 1)),
    case("pairwise_distance_p3_keepdim", lambda a, b: F.pairwise_distance(a, b, p=3.0,
                                                                           keepdim=True),
         lambda g: (normal(g, 3, 5), normal(g, 5)), diff=(0, 1)),
    # --- other layers
    case("bilinear", F.bilinear, lambda g: (normal(g, 3, 4), normal(g, 3, 5), normal(g, 2, 4, 5),
                                            normal(g, 2)), diff=(0, 1, 2, 3), hessian=True),
    case("embedding", lambda i, w: F.embedding(i, w),
         lambda g: (indices(g, 5, 2, 3), normal(g, 5, 3)),
         diff=(1,)),
    case("embedding_padding_idx", lambda i, w: F.embedding(i, w, padding_idx=2),
         lambda g: (indices(g, 5, 2, 3), normal(g, 5, 3)), diff=(1,)),
    case("nn_embedding_aten", lambda i, w: torch.embedding(w, i, 1),
         lambda g: (indices(g, 5, 4), normal(g, 5, 3)), diff=(1,)),
    case("interpolate_nearest", lambda x: F.interpolate(x, scale_factor=(1.5, 2.0)),
         lambda g: (x4(g),)),
    case("interpolate_nearest_down", lambda x: F.interpolate(x, size=(4, 3)),
         lambda g: (x4(g),)),
    case("interpolate_nearest_down_scale", lambda x: F.interpolate(x, scale_factor=0.6),
         lambda g: (normal(g, 2, 3, 4),)),
    case("interpolate_nearest_exact_down", lambda x: F.interpolate(x, size=(3, 2),
                                                                   mode="nearest-exact"),
         lambda g: (x4(g),)),
    case("interpolate_linear", lambda x: F.interpolate(x, scale_factor=1.7, mode="linear"),
         lambda g: (normal(g, 2, 3, 5),)),
    case("interpolate_bilinear_align_corners", lambda x: F.interpolate(
        x, size=(7, 4), mode="bilinear", align_corners=True), lambda g: (x4(g),), hessian=True),
    case("interpolate_bicubic", lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"),
         lambda g: (x4(g),)),
    case("interpolate_bilinear_antialias", lambda x: F.interpolate(
        x, size=(3, 2), mode="bilinear", antialias=True), lambda g: (x4(g),)),
    case("interpolate_trilinear", lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"),
         lambda g: (normal(g, 1, 2, 2, 3, 2),)),
    case("interpolate_area", lambda x: F.interpolate(x, size=(2, 3), mode="area"),
         lambda g: (x4(g),)),
    case("upsample_nearest3d", lambda x: F.interpolate(x, size=(3, 4, 3)),
         lambda g: (normal(g, 1, 2, 2, 3, 2),)),
    # NOTE [Attention without dropout, a mask or grouped heads: three ops]; with a mask,
    # torch's decomposition
    case("scaled_dot_product_attention", F.scaled_dot_product_attention,
         lambda g: (normal(g, 2, 3, 4), normal(g, 2, 5, 4), normal(g, 2, 5, 3)), diff=(0, 1, 2),
         hessian=True),
    case("scaled_dot_product_attention_causal_scale", lambda q, k, v:
         F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7),
         lambda g: (normal(g, 4, 3), normal(g, 5, 3), normal(g, 5, 2)), diff=(0, 1, 2)),
    case("scaled_dot_product_attention_mask", lambda q, k, v:
         F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([[True, False, True]])),
         lambda g: (normal(g, 2, 4, 3), normal(g, 2, 3, 3), normal(g, 2, 3, 2)), diff=(0, 1, 2)),
    case("max_unpool2d", lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2),
         lambda g: (distinct(g, 2, 3, 4, 4),)),
    case("max_unpool1d_output_size", lambda x: F.max_unpool1d(
        *F.max_pool1d(x, 2, 2, return_indices=True), 2, output_size=(7,)),
         lambda g: (distinct(g, 2, 3, 7),)),
    case("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), lambda g: (normal(g, 2, 8, 2, 3),)),
    case("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), lambda g: (normal(g, 2, 2, 4, 6),)),
    case("unfold", lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)),
         lambda g: (x4(g),)),
    case("fold", lambda x: F.fold(x, (5, 6), (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)),
         lambda g: (normal(g, 2, 12, 12),)),
    case("unfold_unbatched", lambda x: F.unfold(x, 2), lambda g: (normal(g, 3, 4, 4),)),
    case("dropout_eval", lambda x: F.dropout(x, 0.3, training=False) + nn.Dropout(0.5).eval()(x),
         lambda g: (normal(g, 3, 4),)),
    case("glu", lambda x: F.glu(x, 1), lambda g: (normal(g, 3, 4, 2),), hessian=True),
    case("prelu", F.prelu, lambda g: (normal(g, 3, 4, 2), normal(g, 4)), diff=(0, 1)),
    case("prelu_shared", F.prelu, lambda g: (normal(g, 3, 4), normal(g, 1)), diff=(0, 1)),
    case("softmin", lambda x: F.softmin(x, 1), lambda g: (normal(g, 3, 4),), hessian=True),
    case("softmax_dtype", lambda x: F.softmax(x.float(), 0, dtype=torch.float64),
         lambda g: (normal(g, 3, 4),)),
    case("log_softmax_dtype", lambda x: F.log_softmax(x, -1, dtype=torch.float64),
         lambda g: (normal(g, 3, 4),)),
]

# torch has no forward-mode derivative for these: their jvp is checked against our own vjp
NO_FORWARD_AD_IN_TORCH = [
    case("grid_sample_bilinear_zeros", lambda x, g_: F.grid_sample(x, g_, align_corners=False),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2)), diff=(0, 1)),
    case("grid_sample_bilinear_border", lambda x, g_: F.grid_sample(
        x, g_, padding_mode="border", align_corners=True),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2)), diff=(0, 1)),
    case("grid_sample_bilinear_reflection", lambda x, g_: F.grid_sample(
        x, g_, padding_mode="reflection", align_corners=False),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2)), diff=(0, 1)),
    case("grid_sample_nearest", lambda x, g_: F.grid_sample(x, g_, mode="nearest",
                                                            align_corners=False),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2))),
    case("grid_sample_bicubic_reflection", lambda x, g_: F.grid_sample(
        x, g_, mode="bicubic", padding_mode="reflection", align_corners=True),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2)), diff=(0, 1)),
    case("grid_sample_bicubic_zeros", lambda x, g_: F.grid_sample(
        x, g_, mode="bicubic", align_corners=False),
         lambda g: (normal(g, 2, 2, 4, 3), grid(g, 2, 3, 2, 2)), diff=(0, 1)),
    case("grid_sample_3d", lambda x, g_: F.grid_sample(x, g_, align_corners=False),
         lambda g: (normal(g, 1, 2, 3, 3, 2), grid(g, 1, 2, 2, 2, 3)), diff=(0, 1)),
    case("multi_margin_loss", lambda x, t, w: F.multi_margin_loss(x, t, p=2, margin=0.7,
                                                                  weight=w),
         lambda g: (normal(g, 4, 5), indices(g, 5, 4), positive(g, 5))),
    case("multilabel_margin_loss", lambda x, t: F.multilabel_margin_loss(x, t),
         lambda g: (normal(g, 4, 5), MULTILABEL_TARGET)),
    case("multi_margin_loss_one_sample", lambda x, t: F.multi_margin_loss(
        x, t, reduction="none"), lambda g: (normal(g, 4), indices(g, 4, 1))),
    case("pdist", F.pdist, lambda g: (normal(g, 4, 3),), hessian=True),
    case("pdist_p1", lambda x: F.pdist(x, 1.0), lambda g: (normal(g, 4, 3),)),
    # p = 0 counts the coordinates that differ (no derivative): once a ZeroDivisionError
    case("pdist_p0", lambda x: F.pdist(x, 0.0), lambda g: (normal(g, 4, 3),)),
    case("soft_margin_loss", lambda x, t: F.soft_margin_loss(x, t),
         lambda g: (normal(g, 3, 4), signs(g, 3, 4))),
]
CONV_REFLECT = nn.Conv2d(4, 3, 3, padding=1, padding_mode="reflect").double()
GAUSSIAN_VAR = torch.rand(3, 4, generator=torch.Generator().manual_seed(0), dtype=DTYPE) + 0.5
MULTILABEL_TARGET = torch.tensor([[1, 2, -1, 0, 0], [3, -1, 0, 0, 0], [0, 1, 2, 3, 4],
                                  [4, 0, -1, 1, 1]])
ALL_CASES = CASES + NO_FORWARD_AD_IN_TORCH
assert len({c.name for c in ALL_CASES}) == len(ALL_CASES), "two cases share a name"


# --- oracles where torch.func cannot be one --------------------------------------------------
class _Looping:
    """torch.func, with vmap as a Python loop over the examples: the oracle where torch.func's
    own batching rule fails."""
    grad, vjp, jvp, jacrev, jacfwd, hessian = (tf.grad, tf.vjp, tf.jvp, tf.jacrev, tf.jacfwd,
                                               tf.hessian)

    @staticmethod
    def vmap(f, in_dims=0):
        def looped(*args):
            dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
            size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
            results = [f(*(a if d is None else a.select(d, i) for a, d in zip(args, dims)))
                       for i in range(size)]
            return torch.utils._pytree.tree_map(lambda *r: torch.stack(r), *results)
        return looped


def _jvp_by_reverse_mode(f, primals, tangents):
    """J t from our own reverse mode (the Jacobian by jacrev, contracted with t)."""
    jacobians = mf.jacrev(f, argnums=tuple(range(len(primals))))(*primals)
    out = f(*primals)
    out_dot = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jacobians, tangents))
    return out, out_dot


class _OurReverseMode:
    """Our engine with forward mode computed by reverse mode: the oracle of our jvp where torch
    has no forward-mode derivative."""
    grad, vjp, vmap, jacrev = mf.grad, mf.vjp, mf.vmap, mf.jacrev
    jvp, jacfwd = staticmethod(_jvp_by_reverse_mode), mf.jacrev

    @staticmethod
    def hessian(f, argnums=0):
        return mf.jacrev(mf.jacrev(f, argnums=argnums), argnums=argnums)


class _OurForwardMode:
    """Our engine with gradients computed by forward mode: the oracle of our second-order
    reverse mode where torch has no double backward."""
    vjp, jvp, vmap, jacrev, jacfwd, hessian = mf.vjp, mf.jvp, mf.vmap, mf.jacrev, mf.jacfwd, \
        mf.hessian

    @staticmethod
    def grad(f, argnums=0):
        return mf.jacfwd(f, argnums=argnums)


_FORWARD_MODE = ("jvp", "jacfwd", "jacfwd_jacrev", "jvp_grad", "hessian")
# (case, transform) -> (the oracle, why torch.func is not)
ORACLES = {
    ("cross_entropy_smoothing_none_nd", "vmap_rest"):
        (_Looping, "torch's label smoothing writes a batched value into an unbatched one"),
    ("prelu", "vmap_jacrev"): (_Looping, "torch.func's prelu backward fails under vmap"),
    ("prelu_shared", "vmap_jacrev"): (_Looping, "torch.func's prelu backward fails under vmap"),
    ("grid_sample_3d", "vmap_dim1"): (_Looping, "an internal assert of torch.func"),
    ("huber_loss_weight", "jvp_grad"): (_OurReverseMode, "huber_loss_backward has no jvp"),
    ("huber_loss", "jvp_grad"): (_OurReverseMode, "huber_loss_backward has no jvp"),
    ("huber_loss_none", "jvp_grad"): (_OurReverseMode, "huber_loss_backward has no jvp"),
    ("multi_margin_loss", "grad_grad"): (_OurForwardMode, "torch has no double backward"),
    ("multilabel_margin_loss", "grad_grad"): (_OurForwardMode, "torch has no double backward"),
    ("pdist", "grad_grad"): (_OurForwardMode, "torch has no double backward"),
    ("multi_margin_loss_one_sample", "grad_grad"): (_OurForwardMode,
                                                    "torch has no double backward"),
    ("pdist_p1", "grad_grad"): (_OurForwardMode, "torch has no double backward"),
    ("pdist_p0", "grad_grad"): (_OurForwardMode, "torch has no double backward"),
    **{(c.name, t): (_OurReverseMode, "torch has no forward-mode derivative")
       for c in NO_FORWARD_AD_IN_TORCH for t in _FORWARD_MODE},
}


@pytest.mark.parametrize("case, transform", list(transform_params(ALL_CASES)))
def test_under_transform(case, transform):
    oracle = ORACLES.get((case.name, transform))
    if oracle is None:
        check_under_transform(case, transform)
        return
    build = TRANSFORMS.get(transform, TRANSFORMS_HESSIAN)
    assert_same(build(mf, case), build(oracle[0], case))


# torch's derivatives of these are conventions, not the derivatives finite differences see:
# saved statistics declared not differentiable, and an embedding's padding row
DECLARED_NOT_DIFFERENTIABLE = {"aten_native_batch_norm", "aten_native_layer_norm",
                               "embedding_padding_idx",
                               "nn_embedding_aten",
                               "softmax_dtype"}  # (this one: its float32 step is too coarse)
FD_CASES = [c for c in ALL_CASES if c.name not in DECLARED_NOT_DIFFERENTIABLE]


@pytest.mark.parametrize("case", FD_CASES, ids=[c.name for c in FD_CASES])
def test_finite_differences(case):
    check_finite_differences(case)


def _eager_vjp(f, args, ct=None):
    """Eager autograd's output of ``f`` at ``args`` (plain tensors) and its gradients for the
    cotangent ``ct`` (ones by default): torch's own kernels and formulas, the oracle at points
    where torch.func's modes disagree."""
    leaves = [a.clone().requires_grad_() for a in args]
    out = f(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out) if ct is None else ct)
    return out.detach(), grads


def test_prelu_weight_gradient_at_positive_infinity():
    """The weight multiplies x's part at or below 0, which is 0 at +inf: its gradient there
    is 0, as torch's (it was 0 * inf = nan)."""
    x = torch.tensor([[float("inf"), 1.5, -2.0], [0.5, -1.0, 3.0]], dtype=torch.float64)
    w = torch.tensor([0.25, -0.5, 2.0], dtype=torch.float64)
    f = lambda v, u: F.prelu(v, u)  # noqa: E731
    ct = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).reshape(2, 3)
    _, eager = _eager_vjp(f, (x, w), ct)
    ours = mf.vjp(f, x, w)[1](ct)
    assert ours[1].isfinite().all()
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b)
    per_example = lambda api: api.vmap(api.grad(lambda v: f(v[None], w).sum()))(x)  # noqa: E731
    torch.testing.assert_close(per_example(mf), per_example(tf))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_binary_cross_entropy_at_saturated_probabilities(reduction):
    """NOTE [binary_cross_entropy: torch's kernel and its formulas]: a probability of exactly
    0 or 1 (a saturated sigmoid) has torch's large finite gradient, where the derivative of
    the clamped logs was nan; elsewhere torch's values, gradients in both arguments, tangents
    and hessian."""
    x = torch.tensor([0.0, 1.0, 0.3, 1 - 1e-7, 1e-30, 0.5], dtype=torch.float64)
    t = torch.tensor([1.0, 0.0, 0.2, 1.0, 0.0, 0.5], dtype=torch.float64)
    w = torch.arange(1.0, 7.0, dtype=torch.float64)
    f = lambda v, u: F.binary_cross_entropy(v, u, weight=w, reduction=reduction)  # noqa: E731
    out, eager = _eager_vjp(f, (x, t))
    ct = torch.ones_like(out)
    ours, pull_back = mf.vjp(f, x, t)
    assert torch.equal(ours, out)
    x_bar, t_bar = pull_back(ct)
    assert x_bar.isfinite().all()  # (t's is -logit(x): infinite at 0 and 1, in torch too)
    torch.testing.assert_close(x_bar, eager[0])
    torch.testing.assert_close(t_bar, eager[1])
    x_dot = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    torch.testing.assert_close(mf.jvp(f, (x, t), (x_dot, x_dot))[1],
                               tf.jvp(f, (x, t), (x_dot, x_dot))[1], equal_nan=True)
    batch = x.expand(3, 6), t.expand(3, 6)
    per_example = lambda api: api.vmap(api.grad(  # noqa: E731
        lambda v, u: f(v, u).sum(), argnums=(0, 1)))(*batch)
    torch.testing.assert_close(per_example(mf), per_example(tf))
    inside = torch.tensor([0.3, 0.6], dtype=torch.float64), t[2:4]
    torch.testing.assert_close(mf.hessian(lambda v: F.binary_cross_entropy(v, inside[1]))(
        inside[0]), tf.hessian(lambda v: F.binary_cross_entropy(v, inside[1]))(inside[0]))


@pytest.mark.parametrize("loss", ["huber_loss", "smooth_l1_loss"])
def test_quadratic_then_linear_losses_at_infinity_and_nan(loss):
    """huber_loss and smooth_l1_loss at an infinite difference have the linear piece's slope
    (the engine gave nan: the unused quadratic branch's gradient was 0 * inf), at a nan a nan
    (torch's kernels count it inside), and at the boundary torch's slope and curvature (the
    engine's hessian was 0 there, torch.func's the quadratic's)."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, 1.5, -inf, 0.5, nan, 2.5, -2.5, 9.0, 0.0], dtype=torch.float64)
    t = torch.zeros(9, dtype=torch.float64)
    width = {"huber_loss": {"delta": 2.5}, "smooth_l1_loss": {"beta": 2.5}}[loss]
    f = lambda v: getattr(F, loss)(v, t, reduction="none", **width)  # noqa: E731
    _, (eager,) = _eager_vjp(f, (x,))
    out, pull_back = mf.vjp(f, x)
    torch.testing.assert_close(out, f(x), equal_nan=True)
    torch.testing.assert_close(pull_back(torch.ones(9, dtype=torch.float64))[0], eager,
                               equal_nan=True)
    x_dot = torch.linspace(-1.0, 1.0, 9, dtype=torch.float64)
    torch.testing.assert_close(mf.jvp(f, (x,), (x_dot,))[1], tf.jvp(f, (x,), (x_dot,))[1],
                               equal_nan=True)
    finite = x[x.isfinite()]
    scalar = lambda v: getattr(F, loss)(v, torch.zeros_like(v), **width)  # noqa: E731
    torch.testing.assert_close(mf.hessian(scalar)(finite), tf.hessian(scalar)(finite))


@pytest.mark.parametrize("loss", ["multi_margin_loss", "multilabel_margin_loss"])
def test_margin_kernels_count_only_positive_margins(loss):
    """torch's multi-margin kernels add a term only where the margin is > 0: a margin of
    exactly 0 (3 - 2 - 1 below) and a nan have no gradient, and a nan adds nothing. (The
    engine clamped at 0, as torch._decomp writes it, and gave both a gradient.)"""
    x = torch.tensor([[3.0, 1.5, -4.0, 0.5, 2.0], [1.0, 1.5, 2.0, 0.5, float("nan")]],
                     dtype=torch.float64)
    if loss == "multi_margin_loss":
        target = torch.tensor([0, 0])
        g = lambda v, t: F.multi_margin_loss(v, t)  # noqa: E731
    else:
        target = torch.tensor([[0, -1, 1, 1, 1], [3, 0, -1, 1, 2]])
        g = lambda v, t: F.multilabel_margin_loss(v, t)  # noqa: E731
    f = lambda v: g(v, target)  # noqa: E731
    _, (eager,) = _eager_vjp(f, (x,))
    assert eager[0, 4] == 0 and eager[1, 4] == 0  # (the test's premise: torch's kernel)
    torch.testing.assert_close(mf.grad(f)(x), eager)
    torch.testing.assert_close(mf.grad(f)(x), tf.grad(f)(x))
    per_example = lambda api: api.vmap(api.grad(lambda v, t: g(v[None], t[None])))  # noqa: E731
    torch.testing.assert_close(per_example(mf)(x, target), per_example(tf)(x, target))
    torch.testing.assert_close(mf.vjp(f, x)[0], f(x))


# --- no per-example fallback ----------------------------------------------------------------
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_vmap_uses_no_fallback(case):
    with mf.capture_fallbacks() as used:
        TRANSFORMS["vmap_0"](mf, case)
        TRANSFORMS["vmap_grad"](mf, case)
        TRANSFORMS["vmap_rest"](mf, case)
    assert not used, f"{case.name} used the per-example fallback for {dict(used)}"


# --- the kernels kept fused: bit-exact with torch.func in float32 --------------------------------
def _f32(g, *shape):
    return torch.randn(shape, generator=g)


FUSED = {  # (conv2d above the sizes where torch's one-example kernels would be taken on either
    # kind of CPU, which round differently: NOTE [Small convolutions on a CPU],
    # test_small_convolutions_...)
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
               lambda g: (_f32(g, 16, 6, 29, 29), _f32(g, 8, 3, 3, 3), _f32(g, 8))),
    "conv2d_ungrouped": (lambda x, w, b: F.conv2d(x, w, b, padding=1),
                         lambda g: (_f32(g, 8, 8, 18, 18), _f32(g, 8, 8, 3, 3), _f32(g, 8))),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1),
                         lambda g: (_f32(g, 2, 4, 5, 5), _f32(g, 4, 3, 3, 3), _f32(g, 3))),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1),
               lambda g: (_f32(g, 3, 4, 11), _f32(g, 5, 4, 3), _f32(g, 5))),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
                   lambda g: (_f32(g, 2, 3, 9, 8),)),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
                            lambda g: (_f32(g, 2, 3, 9, 8),)),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), lambda g: (_f32(g, 2, 3, 9, 8),)),
    "max_pool2d_dilation_ceil": (lambda x: F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=True),
                                 lambda g: (_f32(g, 2, 3, 9, 8),)),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2, 1), lambda g: (_f32(g, 2, 2, 4, 5, 4),)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (4, 3)),
                            lambda g: (_f32(g, 2, 3, 9, 8),)),
    "batch_norm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                         lambda g: (_f32(g, 8, 3, 5, 5), _f32(g, 3), _f32(g, 3))),
    "batch_norm_eval": (lambda x, w, b: F.batch_norm(x, RUNNING_MEAN, RUNNING_VAR, w, b),
                        lambda g: (_f32(g, 8, 3, 5, 5), _f32(g, 3), _f32(g, 3))),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (16,), w, b),
                   lambda g: (_f32(g, 8, 6, 16) * 4 + 1, _f32(g, 16), _f32(g, 16))),
    "layer_norm_two_dims": (lambda x: F.layer_norm(x, (6, 16), eps=1e-3),
                            lambda g: (_f32(g, 8, 6, 16) * 4 + 1,)),
}
RUNNING_MEAN = torch.randn(3, generator=torch.Generator().manual_seed(1))
RUNNING_VAR = torch.rand(3, generator=torch.Generator().manual_seed(2)) + 0.5


@pytest.mark.parametrize("wide_vectors", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_kernels_are_bit_exact_in_float32(name, wide_vectors, monkeypatch):
    """torch.func's kernels, so torch.equal; but for a stride-1 grad_input on a CPU with
    512-bit vectors, which is a forward convolution (NOTE [grad_input as a forward
    convolution]): float32 rounding there. Both kinds of CPU are checked on this one."""
    monkeypatch.setattr(kernels, "WIDE_VECTORS", wide_vectors)
    fn, make = FUSED[name]
    args = make(torch.Generator().manual_seed(0))
    ours_out, ours_vjp = mf.vjp(fn, *args)
    theirs_out, theirs_vjp = tf.vjp(fn, *args)
    ct = torch.randn(ours_out.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours_out, theirs_out)
    for i, (ours, theirs) in enumerate(zip(ours_vjp(ct), theirs_vjp(ct))):
        if i == 0 and wide_vectors and name in _INPUT_GRAD_AS_FORWARD:  # float32 rounding
            torch.testing.assert_close(ours, theirs)
            continue
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()


# grad_input of a stride-1 ungrouped float32 convolution on a CPU with 512-bit vectors is a
# forward convolution (NOTE [grad_input as a forward convolution] in core/nn.py)
_INPUT_GRAD_AS_FORWARD = {"conv2d_ungrouped"}


@pytest.mark.parametrize("wide_vectors", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("padding", [0, 1, (2, 0)])
def test_input_gradient_kernel_follows_the_cpu(padding, wide_vectors, monkeypatch):
    """NOTE [grad_input as a forward convolution]: with 512-bit vectors the backward kernel
    is not called for grad_input, and the forward convolution of the flipped weight gives
    torch.func's gradient to float32 rounding, checked against the same gradient in float64;
    on other CPUs grad_input is torch's backward kernel, torch.func's bit for bit."""
    monkeypatch.setattr(kernels, "WIDE_VECTORS", wide_vectors)
    g = torch.Generator().manual_seed(4)
    x, w = normal(g, 16, 8, 14, 13).float(), normal(g, 8, 8, 3, 3).float()
    ct_shape = F.conv2d(x, w, padding=padding).shape
    ct = normal(g, *ct_shape).float()
    run = lambda api, x, w, ct: api.vjp(  # noqa: E731
        lambda x: F.conv2d(x, w, padding=padding), x)[1](ct)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours = run(mf, x, w, ct)
    ran = {e.key for e in prof.key_averages()}
    if wide_vectors:
        assert "aten::convolution" in ran and "aten::convolution_backward" not in ran, ran
        _float32_close_to_float64(ours, run(tf, x.double(), w.double(), ct.double()))
        torch.testing.assert_close(ours, run(tf, x, w, ct))
    else:
        assert "aten::convolution_backward" in ran, ran
        assert torch.equal(ours, run(tf, x, w, ct))


def test_native_layer_norm_over_one_element_is_torch_funcs():
    """OpInfo's native_layer_norm sample 8 (a normalized size of 1, eps 1e-5): the derivative
    of the input is 0 (the output is the bias), and the weight's is ct * x_hat, where x_hat is
    the kernel's rounding residue of x - mean (-1.1e-5 in float32, not 0). With the fused
    kernels as primitives (NOTE [Layer norm: the fused kernels as primitives]) all three are
    torch.func's bit for bit, in float32 and float64."""
    x, w, b = torch.tensor([-4.3228]), torch.tensor([-8.4784]), torch.tensor([-1.7658])
    ct = torch.tensor([1.1324])
    f = lambda x, w, b: torch.ops.aten.native_layer_norm(x, [1], w, b, 1e-5)[0]  # noqa: E731
    for dtype in (torch.float32, torch.float64):
        args = [a.to(dtype) for a in (x, w, b)]
        ours = mf.vjp(f, *args)[1](ct.to(dtype))
        theirs = tf.vjp(f, *args)[1](ct.to(dtype))
        assert torch.equal(ours[0], torch.zeros(1, dtype=dtype))
        for mine, torchs in zip(ours, theirs):
            assert torch.equal(mine, torchs), (mine, torchs)


def _layer_norm_sample(g=None):
    g = g or torch.Generator().manual_seed(0)
    # values far from 0 mean, so that the statistics' rounding shows in the gradients
    return _f32(g, 8, 6, 16) * 4 + 1, _f32(g, 16), _f32(g, 16), _f32(g, 8, 16)


def _layer_norm_loss(x, w, b):
    return (F.layer_norm(x, (16,), w, b) * torch.linspace(-2, 2, 16)).sin().sum()


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jvp"])
def test_layer_norm_is_bit_exact_with_torch_func_in_float32(transform):
    """NOTE [Layer norm: the fused kernels as primitives]: torch.func's kernels and formulas,
    so torch.equal (the formula path differed by up to 1e-4 here)."""
    x, w, b, _ = _layer_norm_sample()
    runs = {
        "grad": lambda ft: ft.grad(_layer_norm_loss, argnums=(0, 1, 2))(x, w, b),
        "vmap_grad": lambda ft: ft.vmap(ft.grad(_layer_norm_loss, argnums=(0, 1, 2)),
                                        in_dims=(0, None, None))(x, w, b),
        "jvp": lambda ft: ft.jvp(lambda x, w, b: F.layer_norm(x, (16,), w, b), (x, w, b),
                                 (x.cos(), w.sin(), b.cos())),
    }
    ours, theirs = runs[transform](mf), runs[transform](tf)
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine, torchs), (mine - torchs).abs().max()


def test_layer_norm_with_per_example_weights_under_vmap():
    """NOTE [Batching layer norm]: a batched weight and bias (an ensemble) are applied with an
    ordinary multiply and add after the kernel, as torch.func's batching rule does."""
    x, _, b, ws = _layer_norm_sample()
    bs = ws.cos()
    for in_dims, args in (((0, 0, None), (x, ws, b)), ((None, 0, 0), (x[0], ws, bs)),
                          ((0, 0, 0), (x, ws, bs))):
        run = lambda ft: ft.vmap(ft.grad(_layer_norm_loss, argnums=(0, 1, 2)),  # noqa: E731
                                 in_dims=in_dims)(*args)
        for mine, torchs in zip(run(mf), run(tf)):
            assert torch.equal(mine, torchs), (in_dims, (mine - torchs).abs().max())


def _layer_norm_by_formula(x, normalized_shape, w, b, eps=1e-5):
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    variance = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / (variance + eps).sqrt() * w + b


def test_layer_norm_hessian_agrees_with_torch_func():
    """Second order comes from torch's decomposition of native_layer_norm_backward,
    differentiated by the engine: torch.func's to rounding for the input's block. For the
    mixed block d/dx (dL/dw), torch.func (2.13, reverse and forward over reverse alike) is off
    by O(1) and not the transpose of its own d/dw (dL/dx); ours is, and agrees with the
    formula differentiated by torch.func."""
    x, w, b, _ = _layer_norm_sample()
    x, w, b = x[:2, :3].double(), w.double(), b.double()
    scale = torch.linspace(-2, 2, 16, dtype=torch.float64)
    f = lambda x, w, b: (F.layer_norm(x, (16,), w, b) * scale).sin().sum()  # noqa: E731
    by_formula = lambda x, w, b: (  # noqa: E731
        _layer_norm_by_formula(x, (16,), w, b) * scale).sin().sum()
    torch.testing.assert_close(mf.hessian(f)(x, w, b), tf.hessian(f)(x, w, b))
    ours = mf.hessian(f, argnums=(0, 1, 2))(x, w, b)
    expected = tf.hessian(by_formula, argnums=(0, 1, 2))(x, w, b)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(ours[1][0], ours[0][1].permute(3, 0, 1, 2))


def _group_norm_sample(g=None):
    g = g or torch.Generator().manual_seed(0)
    # values far from 0 mean, so that the statistics' rounding shows in the gradients
    return (_f32(g, 8, 4, 6, 5) * 4 + 1, _f32(g, 6), _f32(g, 6), _f32(g, 8, 6), _f32(g, 8, 6))


def _group_norm_loss(x, w, b):
    return (F.group_norm(x, 3, w, b) * torch.linspace(-2, 2, 5)).sin().sum()


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "vmap_grad_per_example_weights",
                                       "vmap_grad_unbatched_input", "jvp", "jvp_no_affine"])
def test_group_norm_is_bit_exact_with_torch_func_in_float32(transform):
    """NOTE [Group norm: the forward kernel as a primitive]: torch.func's kernel
    and formulas, so torch.equal (the formula path differed by up to 4e-6 here)."""
    xs, w, b, ws, bs = _group_norm_sample()
    x = xs[0]
    grads = lambda ft: ft.grad(_group_norm_loss, argnums=(0, 1, 2))  # noqa: E731
    runs = {
        "grad": lambda ft: grads(ft)(x, w, b),
        "vmap_grad": lambda ft: ft.vmap(grads(ft), in_dims=(0, None, None))(xs, w, b),
        "vmap_grad_per_example_weights": lambda ft: ft.vmap(grads(ft))(xs, ws, bs),
        "vmap_grad_unbatched_input": lambda ft: ft.vmap(grads(ft), in_dims=(None, 0, None))(
            x, ws, b),
        "jvp": lambda ft: ft.jvp(lambda x, w, b: F.group_norm(x, 3, w, b), (x, w, b),
                                 (x.cos(), w.sin(), b.cos())),
        "jvp_no_affine": lambda ft: ft.jvp(lambda x: F.group_norm(x, 3), (x,), (x.cos(),)),
    }
    ours, theirs = runs[transform](mf), runs[transform](tf)
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine, torchs), (mine - torchs).abs().max()


def _group_norm_by_formula(x, groups, w, b, eps=1e-5):
    grouped = x.reshape(x.shape[0], groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    variance = ((grouped - mean) ** 2).mean(-1, keepdim=True)
    out = ((grouped - mean) / (variance + eps).sqrt()).reshape(x.shape)
    view = (-1,) + (1,) * (x.dim() - 2)
    return out * w.reshape(view) + b.reshape(view)


def test_group_norm_hessian_agrees_with_torch_func_and_the_formula():
    """The vjp rule is torch.func's backward formula written with ops, so second order is the
    engine differentiating it: torch.func's hessian (checked here against the plain formula
    differentiated by torch.func, all blocks) to rounding."""
    xs, w, b, _, _ = _group_norm_sample()
    x, w, b = xs[0, :2].double(), w.double(), b.double()
    scale = torch.linspace(-2, 2, 5, dtype=torch.float64)
    f = lambda x, w, b: (F.group_norm(x, 3, w, b) * scale).sin().sum()  # noqa: E731
    by_formula = lambda x, w, b: (  # noqa: E731
        _group_norm_by_formula(x, 3, w, b) * scale).sin().sum()
    expected = tf.hessian(by_formula, argnums=(0, 1, 2))(x, w, b)
    torch.testing.assert_close(tf.hessian(f, argnums=(0, 1, 2))(x, w, b), expected)
    ours = mf.hessian(f, argnums=(0, 1, 2))(x, w, b)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(ours[1][0], ours[0][1].permute(3, 0, 1, 2))


def test_group_norm_with_a_bias_and_no_weight():
    """torch.func 2.13 fails here (its backward formula reshapes the absent weight's gradient:
    "shape '[0]' is invalid"); ours is the plain formula's gradient."""
    xs, _, b, _, _ = _group_norm_sample()
    x, b = xs[0].double(), b.double()
    f = lambda x, b: (F.group_norm(x, 3, None, b) * x).sin().sum()  # noqa: E731
    by_formula = lambda x, b: (  # noqa: E731
        _group_norm_by_formula(x, 3, torch.ones_like(b), b) * x).sin().sum()
    torch.testing.assert_close(mf.grad(f, argnums=(0, 1))(x, b),
                               tf.grad(by_formula, argnums=(0, 1))(x, b))


def test_group_norm_without_weight_or_bias_traces():
    """NOTE [Absent weight and bias]: jit's replay of group norm with no affine part is the
    eager result."""
    xs, w, _, _, _ = _group_norm_sample()
    loss = lambda x, w: (F.group_norm(x, 3) * w[:, None]).sin().sum()  # noqa: E731
    eager = mf.vmap(mf.grad(loss, argnums=(0, 1)), in_dims=(0, None))
    jitted = mf.jit(eager)
    for _ in range(2):
        for mine, expected in zip(jitted(xs, w), eager(xs, w)):
            assert torch.equal(mine, expected)


def test_layer_norm_without_weight_or_bias_traces():
    """NOTE [Absent weight and bias]: a trace refuses None operands, so the kernels'
    primitives take only the weight and bias given; jit's replay is the eager result."""
    x, w, _, _ = _layer_norm_sample()
    loss = lambda x, w: (F.layer_norm(x, (16,)) * w).sin().sum()  # noqa: E731
    eager = mf.vmap(mf.grad(loss, argnums=(0, 1)), in_dims=(0, None))
    jitted = mf.jit(eager)
    for _ in range(2):
        for mine, expected in zip(jitted(x, w), eager(x, w)):
            assert torch.equal(mine, expected)


def _kernel_calls(fn, *args, name="aten::max_pool2d_with_indices"):
    return aten_calls(lambda: fn(*args))[0].get(name, 0)


@pytest.mark.parametrize("size", ["small", "channels-last"])
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "vmap_grad"])
def test_max_pool_values_are_the_kernels_and_bit_exact(transform, size):
    """NOTE [Max pooling: the kernel's values, derivatives through its indices]: one kernel
    call gives the values and the indices (no re-gather of the values), float32 results stay
    bit-exact with torch.func; also where the CPU kernel runs on a channels-last copy
    (NOTE [Max pooling on the CPU runs channels-last])."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 2, 3, 9, 8) if size == "small" else (4, 16, 16, 12, 12)
    x, t = _f32(g, *shape), _f32(g, *shape)
    ct = _f32(g, *shape[:3], (shape[3] + 1) // 2, (shape[4] + 1) // 2)
    assert mf_nn._pool_channels_last(x[0]) == (size == "channels-last")
    f = lambda x: F.max_pool2d(x, 3, 2, 1)  # noqa: E731
    runs = {
        "vjp": lambda ft: (lambda out, pull: (out, pull(ct[0])))(*ft.vjp(f, x[0])),
        "jvp": lambda ft: ft.jvp(f, (x[0],), (t[0],)),
        "vmap": lambda ft: ft.vmap(f)(x),
        "vmap_grad": lambda ft: ft.vmap(ft.grad(lambda x, c: (f(x) * c).sum()))(x, ct),
    }
    ours, theirs = runs[transform](mf), runs[transform](tf)
    for a, b in zip(torch.utils._pytree.tree_leaves(ours),
                    torch.utils._pytree.tree_leaves(theirs)):
        assert torch.equal(a, b), (a - b).abs().max()
    assert _kernel_calls(runs[transform], mf) == 1
    # values are never gathered; jvp gathers the tangent at the indices
    gathers = 1 if transform == "jvp" else 0
    assert _kernel_calls(lambda: runs[transform](mf), name="aten::gather") == gathers


@pytest.mark.parametrize("door", ["ours", "torch's decomposition"])
def test_max_pool_indices_of_a_channels_last_input_are_viewable(door, monkeypatch):
    """torch's kernel returns channels-last indices for a channels-last input; shown to user
    code as a contiguous tensor, a view of them failed ("view size is not compatible"): torch's
    decomposition of max_pool2d_with_indices_backward reshapes them (OpInfo sample 743)."""
    backward = torch.ops.aten.max_pool2d_with_indices_backward.default
    if door != "ours":
        from minifunctorch.core import aten_api
        monkeypatch.delitem(aten_api.ATEN_OPS, backward)
    x = torch.randn(2, 2, 3, 6, dtype=DTYPE).contiguous(memory_format=torch.channels_last)
    ct = torch.randn(2, 2, 2, 2, dtype=DTYPE)

    def f(ct, x):
        values, indices = F.max_pool2d(x, 3, 2, 1, (1, 2), return_indices=True)
        return backward(ct, x, [3, 3], [2, 2], [1, 1], [1, 2], False, indices) * values.sum()
    ours, theirs = mf.vjp(f, ct, x), tf.vjp(f, ct, x)
    assert_same(ours[0], theirs[0])
    assert_same(ours[1](x), theirs[1](x))
    assert_same(mf.jvp(f, (ct, x), (ct, x)), tf.jvp(f, (ct, x), (ct, x)))


# --- shape rules: every primitive of the family evaluates on meta tensors ----------------------
_CONV = dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), transposed=False,
             output_padding=(0, 0), groups=2)
_POOL = dict(kernel_size=(2, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True)
_T = lambda *shape: torch.randn(shape, dtype=DTYPE)  # noqa: E731
_SAMPLES = {
    "linear": ((_T(2, 3, 4), _T(5, 4), _T(5)), {}),
    "convolution": ((_T(2, 4, 6, 5), _T(6, 2, 3, 2), _T(6)), _CONV),
    "convolution_backward_input": ((_T(2, 6, 3, 3), _T(6, 2, 3, 2)),
                                   dict(_CONV, input_shape=(2, 4, 6, 5))),
    "convolution_backward_weight": ((_T(2, 6, 3, 3), _T(2, 4, 6, 5)),
                                    dict(_CONV, weight_shape=(6, 2, 3, 2), with_bias=True)),
    "convolution_backward_bias": ((_T(2, 6, 3, 3),),
                                  dict(_CONV, input_shape=(2, 4, 6, 5),
                                       weight_shape=(6, 2, 3, 2))),
    "constant_pad_nd": ((_T(2, 3),), dict(pad=(1, -1), value=0.5)),
    "max_pool": ((_T(2, 3, 5, 4),), dict(_POOL, dilation=(1, 1))),
    "max_pool_indices": ((_T(2, 3, 5, 4),), dict(_POOL, dilation=(1, 1))),
    "max_pool_backward": ((_T(2, 3, 2, 2), torch.randint(16, (2, 3, 2, 2))),
                          dict(x_shape=(2, 3, 4, 4), spatial=2)),
    "adaptive_max_pool": ((_T(2, 3, 5, 4),), dict(output_size=(2, 3))),
    "adaptive_max_pool_indices": ((_T(2, 3, 5, 4),), dict(output_size=(2, 3))),
    "avg_pool": ((_T(2, 3, 5, 4),), dict(_POOL, count_include_pad=False,
                                         divisor_override=None)),
    "avg_pool_backward": ((_T(2, 3, 3, 3),), dict(_POOL, count_include_pad=False,
                                                  divisor_override=None,
                                                  input_shape=(2, 3, 5, 4))),
    "adaptive_avg_pool": ((_T(2, 3, 5, 4),), dict(output_size=(2, 3))),
    "adaptive_avg_pool_backward": ((_T(2, 3, 2, 3),), dict(output_size=(2, 3),
                                                           input_shape=(2, 3, 5, 4))),
    "mode_pad": ((_T(2, 3, 5, 4),), dict(mode="reflect", pad=(1, 2, 3, 0))),
    "mode_pad_backward": ((_T(2, 3, 8, 7),), dict(mode="replicate", pad=(1, 2, 3, 0),
                                                  input_shape=(2, 3, 5, 4))),
    "upsample": ((_T(2, 3, 5, 4),), dict(kernel="upsample_bilinear2d", output_size=(7, 9),
                                         align_corners=False, scales=(None, None))),
    "upsample_backward": ((_T(2, 3, 7, 9),), dict(kernel="upsample_nearest2d", output_size=(7, 9),
                                                  align_corners=None, scales=(1.5, 2.25),
                                                  input_shape=(2, 3, 5, 4))),
    "batch_norm_train": ((_T(4, 3, 2), _T(3), None), dict(eps=1e-5)),
    "batch_norm_eval": ((_T(4, 3, 2), _T(3), _T(3), _T(3), _T(3).abs()), dict(eps=1e-5)),
    "batch_norm_stats": ((_T(4, 3, 2),), dict(eps=1e-5)),
    "batch_norm_backward_input": ((_T(4, 3, 2), _T(4, 3, 2), _T(3), _T(3), _T(3).abs()),
                                  dict(training=True, eps=1e-5)),
    "batch_norm_backward_params": ((_T(4, 3, 2), _T(4, 3, 2), _T(3), _T(3).abs()),
                                   dict(training=False, eps=1e-5)),
    "layer_norm": ((_T(3, 4, 5), _T(5)), dict(normalized_shape=(5,), eps=1e-5,
                                               affine=("bias",))),
    "layer_norm_stats": ((_T(3, 4, 5),), dict(normalized_shape=(4, 5), eps=1e-5)),
    "layer_norm_backward_input": ((_T(3, 4, 5), _T(3, 4, 5), _T(3, 4, 1), _T(3, 4, 1).abs(),
                                   _T(5)), dict(normalized_shape=(5,), affine=("weight",))),
    "layer_norm_backward_params": ((_T(3, 4, 5), _T(3, 4, 5), _T(3, 4, 1), _T(3, 4, 1).abs()),
                                   dict(normalized_shape=(5,))),
    "group_norm": ((_T(3, 4, 5), _T(4)), dict(num_groups=2, eps=1e-5, affine=("weight",))),
    "group_norm_stats": ((_T(3, 4, 2, 5),), dict(num_groups=2, eps=1e-5)),
    "fractional_max_pool": ((_T(2, 3, 7, 6), torch.rand(2, 3, 2, dtype=DTYPE)),
                            dict(kernel_size=(2, 2), output_size=(3, 4))),
    "fractional_max_pool_indices": ((_T(2, 3, 7, 6), torch.rand(2, 3, 2, dtype=DTYPE)),
                                    dict(kernel_size=(2, 2), output_size=(3, 4))),
    "nll_loss": ((_T(4, 5), torch.tensor([0, 2, 4, 1]), _T(5).abs()),
                 dict(reduction="mean", ignore_index=2)),
    "nll_loss_backward": ((_T(), torch.tensor([0, 2, 4, 1]), None),
                          dict(input_shape=(4, 5), reduction="sum", ignore_index=-100)),
    "mse_loss": ((_T(3, 4), _T(3, 4)), dict(reduction="mean")),
    "binary_cross_entropy": ((torch.rand(3, 4, dtype=DTYPE), torch.rand(1, 4, dtype=DTYPE)),
                             {}),
    "mse_loss_backward": ((_T(3, 4), _T(3, 4), _T(3, 4)), dict(reduction="none")),
    "smooth_l1_loss": ((_T(3, 4), _T(3, 4)), dict(reduction="sum", beta=0.5)),
    "smooth_l1_loss_backward": ((_T(), _T(3, 4), _T(3, 4)), dict(reduction="mean", beta=0.5)),
    "huber_loss": ((_T(3, 4), _T(3, 4)), dict(reduction="none", delta=0.5)),
    "huber_loss_backward": ((_T(3, 4), _T(3, 4), _T(3, 4)), dict(reduction="none", delta=2.0)),
    "attention": ((_T(2, 3, 5, 4), _T(2, 3, 6, 4), _T(2, 3, 6, 4)),
                  dict(is_causal=False, scale=None)),
    "attention_logsumexp": ((_T(2, 3, 5, 4), _T(2, 3, 5, 4), _T(2, 3, 5, 4)),
                            dict(is_causal=True, scale=0.5)),
    **{f"attention_backward_{name}": ((_T(2, 3, 5, 4), _T(2, 3, 5, 4), _T(2, 3, 6, 4),
                                       _T(2, 3, 6, 4), _T(2, 3, 5, 4), _T(2, 3, 5)),
                                      dict(is_causal=False, scale=None))
       for name in ("query", "key", "value")},
    "grid_sampler": ((_T(2, 3, 4, 5), _T(2, 3, 2, 2).tanh()),
                     dict(mode="bilinear", padding_mode="zeros", align_corners=False)),
    "grid_sampler_input_backward": ((_T(2, 3, 3, 2), _T(2, 3, 4, 5), _T(2, 3, 2, 2).tanh()),
                                    dict(mode="bicubic", padding_mode="border",
                                         align_corners=True)),
    "grid_sampler_grid_backward": ((_T(2, 3, 2, 2, 2), _T(2, 3, 4, 5, 3),
                                    _T(2, 2, 2, 2, 3).tanh()),
                                   dict(mode="nearest", padding_mode="reflection",
                                        align_corners=False)),
    "ctc_loss": ((_T(6, 2, 4).log_softmax(-1), torch.tensor([[1, 2, 3], [2, 2, 0]]),
                  torch.tensor([6, 5]), torch.tensor([3, 2])), dict(blank=0, zero_infinity=False)),
    "ctc_loss_backward": ((_T(2), _T(6, 2, 4).log_softmax(-1), torch.tensor([1, 2, 3, 2, 2]),
                           torch.tensor([6, 5]), torch.tensor([3, 2]), _T(2).abs()),
                          dict(blank=0, zero_infinity=True)),
}
# Primitives whose output shape depends on the data: no shape rule on meta tensors.
# (ctc_loss_alpha: the table log_alpha, whose last dim is twice the longest target plus one.)
_DATA_DEPENDENT_SHAPES = {"ctc_loss_alpha"}


def test_every_primitive_of_the_family_is_sampled():
    names = {name for name, prim in mf.PRIMITIVES.items()
             if getattr(mf_nn, f"{name}_p", None) is prim or any(
                 value is prim for value in vars(mf_nn).values())}
    sampled = set(_SAMPLES) | _DATA_DEPENDENT_SHAPES
    assert names == sampled, names ^ sampled


@pytest.mark.parametrize("name", sorted(_SAMPLES))
def test_shape_rule(name):
    prim = mf.PRIMITIVES[name]
    args, params = _SAMPLES[name]
    out = prim.impl(*args, **params)
    assert tuple(prim.shape_rule(*args, **params)) == (out.shape, out.dtype)


# --- per-sample gradients: one grouped convolution -----------------------------------------------
def test_per_sample_weight_gradient_is_one_grouped_convolution(monkeypatch):
    """NOTE [Batching a convolution: the groups trick] in core/nn.py."""
    calls = []
    impl = mf_nn.conv_backward_weight_p.impl

    def counting(ct, x, **params):
        calls.append((tuple(ct.shape), tuple(x.shape), params["groups"]))
        return impl(ct, x, **params)
    monkeypatch.setattr(mf_nn.conv_backward_weight_p, "impl", counting)
    g = torch.Generator().manual_seed(0)
    xs, w = normal(g, 5, 1, 4, 6, 6), normal(g, 6, 2, 3, 3)

    def loss(w, x):
        return F.conv2d(x, w, groups=2).square().sum()
    ours = mf.vmap(mf.grad(loss), in_dims=(None, 0))(w, xs)
    assert_same(ours, tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))
    assert calls == [((1, 5 * 6, 4, 4), (1, 5 * 4, 6, 6), 5 * 2)], calls


# --- mse_loss: torch's kernel and its backward -------------------------------------------------
@pytest.mark.parametrize("options", [
    dict(scale_factor=2, mode="bilinear"), dict(size=(9, 7), mode="bicubic", align_corners=True),
    dict(scale_factor=0.6, mode="bilinear", antialias=True), dict(scale_factor=1.5)],
    ids=["bilinear", "bicubic-corners", "bilinear-antialias", "nearest"])
def test_interpolation_is_torchs_kernels_bit_for_bit(options):
    """NOTE [Interpolation is a linear kernel and its transpose]: values, per-sample gradients,
    tangents and second derivatives are torch.func's bit for bit, and an inf in the input
    makes no more nans than it does in torch (a matmul along the dim once spread it)."""
    x = torch.randn(3, 2, 6, 5, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    x[1, 0, 2, 3] = float("inf")

    def f(x):
        return F.interpolate(x[None], **options)[0]

    def loss(x):
        return torch.where(torch.isfinite(f(x)), f(x), 0.0).sin().sum()
    for transform in (lambda api: api.vmap(f)(x),
                      lambda api: api.vmap(api.grad(loss))(x),
                      lambda api: api.jvp(f, (x[0],), (x[2],))[1],
                      lambda api: api.hessian(loss)(x[0, :, :3, :2])):
        ours, theirs = transform(mf), transform(tf)
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(theirs))


@pytest.mark.parametrize("mode,pad", [
    ("reflect", (2, 1, 3, 2)), ("replicate", (1, 0, 2, 3)), ("reflect", (3, 1)),
    ("replicate", (1, 1, 2, 0, 1, 2)), ("replicate", (-2, -1, 4, 6)), ("circular", (1, 2, 1, 2))],
    ids=["reflect2d", "replicate2d", "reflect1d", "replicate3d", "crop-and-pad", "circular"])
def test_mode_padding_is_torch_func_bit_for_bit(mode, pad):
    """NOTE [Reflect and replicate padding: a linear kernel and its transpose]: torch's kernels
    where no pad crops, gathers otherwise (a crop of one dim beside a pad of another among
    them); values, per-sample gradients, tangents and second derivatives are torch.func's."""
    shape = {2: (3, 5, 4), 4: (2, 3, 5, 4), 6: (1, 2, 3, 5, 4)}[len(pad)]
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0), dtype=DTYPE)

    def loss(x):
        return F.pad(x, pad, mode=mode).sin().sum()
    for transform in (lambda api: api.vmap(lambda x: F.pad(x, pad, mode=mode))(x),
                      lambda api: api.vmap(api.grad(loss))(x),
                      lambda api: api.jvp(lambda x: F.pad(x, pad, mode=mode), (x[0],), (x[1],))[1],
                      lambda api: api.hessian(loss)(x[0, :1])):
        assert torch.equal(transform(mf), transform(tf))


@pytest.mark.parametrize("options", [
    dict(need_weights=False), dict(need_weights=True), dict(batch_first=True),
    dict(key_padding_mask=True), dict(attn_mask=True, need_weights=False)],
    ids=["no-weights", "weights", "batch-first", "key-padding-mask", "attn-mask"])
def test_multi_head_attention_per_sample_gradients_as_torch_func(options):
    """NOTE [Multi-head attention: torch's Python body, at the front door]: per-sample
    gradients of nn.MultiheadAttention's parameters through functional_call, masks and
    averaged weights included, are torch.func's."""
    options = dict(options)
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(8, 2, batch_first=options.pop("batch_first", False),
                                  dtype=DTYPE).eval()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    if options.pop("key_padding_mask", False):
        options["key_padding_mask"] = torch.tensor([False, False, True, False, True])
    if options.pop("attn_mask", False):
        options["attn_mask"] = torch.ones(5, 5, dtype=torch.bool).triu(1)

    def loss(api):
        def of(params, x):
            out, weights = api.functional_call(layer, params, (x, x, x), options)
            return out.square().sum() + (0 if weights is None else weights.sin().sum())
        return of
    ours = mf.vmap(mf.grad(loss(mf)), in_dims=(None, 0))(params, x)
    theirs = tf.vmap(tf.grad(loss(tf)), in_dims=(None, 0))(params, x)
    for name in params:
        torch.testing.assert_close(ours[name], theirs[name])


@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool3d(x, 2), lambda x: F.max_pool2d(x[:, :, 0], 2),
    lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 2, 2),
                                      _random_samples=torch.full((0, 1, 3), 0.5, dtype=DTYPE))],
    ids=["max_pool3d", "max_pool2d", "fractional_max_pool3d"])
def test_max_pooling_of_no_examples_has_an_empty_gradient(pool):
    """NOTE [Max pooling's backward, one primitive]: with no examples, the scatter-add's
    flattened size is given (a reshape to -1 of nothing is ambiguous, and crashed)."""
    x = torch.zeros(0, 1, 4, 5, 4, dtype=DTYPE)
    out, vjp_fn = mf.vjp(pool, x)
    (x_bar,) = vjp_fn(torch.ones_like(out))
    assert x_bar.shape == x.shape
    assert torch.equal(x_bar, tf.vjp(pool, x)[1](torch.ones_like(out))[0])


def test_mse_loss_is_one_kernel_and_its_backward_under_vmap_of_grad(monkeypatch):
    """NOTE [Pointwise losses: torch's kernel and its backward] in core/nn.py: MAML's inner
    loss, per task, calls torch's mse_loss kernel once forward and its backward kernel once; a
    weight still takes the ops, and both agree with torch.func."""
    calls = []

    def counting(prim):
        impl = prim.impl

        def counted(*args, **params):
            calls.append(prim.name)
            return impl(*args, **params)
        return counted
    for prim in (mf_nn.mse_loss_p, mf_nn.mse_loss_backward_p):
        monkeypatch.setattr(prim, "impl", counting(prim))
    g = torch.Generator().manual_seed(0)
    w, xs, ts = normal(g, 3, 2), normal(g, 4, 5, 2), normal(g, 4, 5, 3)

    def loss(w, x, t):
        return F.mse_loss(x @ w.T, t)
    ours = mf.vmap(mf.grad(loss), in_dims=(None, 0, 0))(w, xs, ts)
    assert_same(ours, tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(w, xs, ts))
    assert calls == ["mse_loss", "mse_loss_backward"], calls
    calls.clear()
    weight = positive(g, 5, 3)
    weighted = mf.grad(lambda w, x, t: F.mse_loss(x @ w.T, t, weight=weight))(w, xs[0], ts[0])
    assert calls == [], calls
    assert_same(weighted, torch.func.grad(
        lambda w, x, t: ((x @ w.T - t) ** 2 * weight).sum() / weight.sum())(w, xs[0], ts[0]))


# --- NOTE [Statistics of a plain tensor: the kernel's pair] -------------------------------------
@pytest.mark.parametrize("norm", ["batch", "layer", "group"])
def test_norm_statistics_of_a_plain_tensor_are_the_kernels_pair(norm, monkeypatch):
    """Under grad of plain tensors the rules take the forward kernel's mean and rstd as they
    are (no stacking primitive, no split); under vmap they go through the primitive; both
    give torch.func's gradients."""
    prim, f = {
        "batch": (mf_nn.batch_norm_stats_p,
                  lambda x: F.batch_norm(x, None, None, training=True)),
        "layer": (mf_nn.layer_norm_stats_p, lambda x: F.layer_norm(x, (4, 5))),
        "group": (mf_nn.group_norm_stats_p, lambda x: F.group_norm(x, 2)),
    }[norm]
    calls = _count_kernels(monkeypatch, (prim,))
    g = torch.Generator().manual_seed(6)
    x = normal(g, 3, 4, 5)

    def loss(x):
        return f(x).sin().sum()
    torch.testing.assert_close(mf.grad(loss)(x), tf.grad(loss)(x))
    assert calls == {}
    xs = torch.stack([x, x.cos()])
    torch.testing.assert_close(mf.vmap(mf.grad(loss))(xs), tf.vmap(tf.grad(loss))(xs))
    assert calls == {prim.name: 1}


# --- grid_sample: torch's kernels for one derivative, gathers for more ---------------------------
def _count_kernels(monkeypatch, prims):
    """Calls of the kernel primitives ``prims``, by name."""
    calls = {}
    for prim in prims:
        def counting(*args, _impl=prim.impl, _name=prim.name, **params):
            calls[_name] = calls.get(_name, 0) + 1
            return _impl(*args, **params)
        monkeypatch.setattr(prim, "impl", counting)
    return calls


def _count_grid_kernels(monkeypatch):
    return _count_kernels(monkeypatch, (mf_nn.grid_sampler_p, mf_nn.grid_sampler_input_backward_p,
                                        mf_nn.grid_sampler_grid_backward_p))


def _grid_sample_inputs(seed=0, spatial=2):
    g = torch.Generator().manual_seed(seed)
    x = normal(g, 2, 3, *(5, 4, 3)[:spatial])
    return x, grid(g, 2, *(3, 2, 2)[:spatial], spatial) * 1.2


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_takes_torchs_kernels_under_one_derivative(mode, monkeypatch):
    """NOTE [grid_sample: torch's kernels for one derivative, gathers for more]: grad,
    per-sample gradients and jacrev call torch's forward and backward kernels, one call each
    for every example (the batch joins N), and equal torch.func's: bit for bit but for
    bicubic's grid cotangent, which torch's kernel rounds differently when it computes the
    input's alongside (torch asks for both at once, the engine for each alone)."""
    calls = _count_grid_kernels(monkeypatch)
    x, g_ = _grid_sample_inputs()
    xs = torch.stack([x, 2 * x, x.flip(-1)])

    def f(x, g_):
        return F.grid_sample(x, g_, mode=mode, padding_mode="border", align_corners=False)

    def loss(x, g_):
        return f(x, g_).sin().sum()
    for transform in (lambda api: api.grad(loss, (0, 1))(x, g_),
                      lambda api: api.vmap(api.grad(loss, (0, 1)), (0, None))(xs, g_),
                      lambda api: api.jacrev(f, (0, 1))(x, g_)):
        calls.clear()
        ours = transform(mf)
        assert calls == {"grid_sampler": 1, "grid_sampler_input_backward": 1,
                         "grid_sampler_grid_backward": 1}
        x_ct, grid_ct = transform(tf)
        assert torch.equal(ours[0], x_ct)
        torch.testing.assert_close(ours[1], grid_ct, rtol=1e-13, atol=1e-13)
        assert mode == "bicubic" or torch.equal(ours[1], grid_ct)


def test_grid_sample_jvp_is_the_kernel_and_the_grids_partials(monkeypatch):
    """torch has no forward-mode formula for grid_sample: the tangent is the kernel applied to
    the input's tangent plus the grid's partials (its backward kernel, channels as
    examples) times the grid's tangent; checked against central differences."""
    calls = _count_grid_kernels(monkeypatch)
    for spatial in (2, 3):
        x, g_ = _grid_sample_inputs(seed=spatial, spatial=spatial)
        gen = torch.Generator().manual_seed(9)
        x_dot, g_dot = normal(gen, *x.shape), normal(gen, *g_.shape)

        def f(x, g_):
            return F.grid_sample(x, g_, padding_mode="reflection", align_corners=True)
        calls.clear()
        out, out_dot = mf.jvp(f, (x, g_), (x_dot, g_dot))
        assert calls == {"grid_sampler": 2, "grid_sampler_grid_backward": 1}
        eps = 1e-6
        expected = (f(x + eps * x_dot, g_ + eps * g_dot)
                    - f(x - eps * x_dot, g_ - eps * g_dot)) / (2 * eps)
        torch.testing.assert_close(out, f(x, g_), rtol=0, atol=0)
        torch.testing.assert_close(out_dot, expected, rtol=1e-6, atol=1e-7)


def test_grid_sample_second_derivatives_take_the_gathers(monkeypatch):
    """Two levels that differentiate (hessian, grad of grad, torch's autograd under grad)
    take the gathers, whose derivatives are taken again; torch.func's hessian fails (no
    forward-mode formula), so jacrev of jacrev is the oracle's."""
    calls = _count_grid_kernels(monkeypatch)
    x, g_ = _grid_sample_inputs(seed=3)

    def loss(g_):
        return F.grid_sample(x, g_, mode="bicubic", align_corners=False).square().sum()
    hessian = mf.hessian(loss)(g_)
    assert calls == {}
    torch.testing.assert_close(hessian, tf.jacrev(tf.jacrev(loss))(g_))
    # torch's autograd of a grid that requires grad, around grad: a MAML-like outer step
    g_leaf = g_.clone().requires_grad_()
    inner = mf.grad(loss)(g_leaf)
    assert calls == {}
    outer = torch.autograd.grad(inner.square().sum(), g_leaf)[0]
    torch.testing.assert_close(outer, mf.grad(lambda v: mf.grad(loss)(v).square().sum())(g_))


def test_grid_sample_vjp_fn_is_differentiated_in_its_cotangent():
    """A level made after the forward (grad or jvp around vjp_fn) sees the input and the grid
    as constants: the backward kernels are linear in the cotangent, with the forward kernel
    and the grid's partials as their transposes."""
    x, g_ = _grid_sample_inputs(seed=5)

    def f(x, g_):
        return F.grid_sample(x, g_, mode="bilinear", padding_mode="zeros", align_corners=True)
    ct = torch.randn(2, 3, 3, 2, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    results = []
    for api in (mf, tf):
        _, vjp_fn = api.vjp(f, x, g_)
        results.append(api.grad(lambda c: sum(t.sin().sum() for t in vjp_fn(c)))(ct))
    torch.testing.assert_close(*results)
    _, vjp_fn = mf.vjp(f, x, g_)
    ct_dot = ct.flip(0)
    tangents = mf.jvp(vjp_fn, (ct,), (ct_dot,))[1]
    for tangent, expected in zip(tangents, vjp_fn(ct_dot)):
        torch.testing.assert_close(tangent, expected)


# --- attention: torch's flash kernels for one derivative -----------------------------------------
def _count_attention_kernels(monkeypatch):
    return _count_kernels(monkeypatch, (mf_nn.attention_p, mf_nn.attention_logsumexp_p,
                                        *mf_nn.attention_backward_ps))


def _attention_inputs(seed, length=5):
    g = torch.Generator().manual_seed(seed)
    return normal(g, 2, 3, 6, 4), normal(g, 2, 3, length, 4), normal(g, 2, 3, length, 4)


@pytest.mark.parametrize("is_causal, scale", [(False, None), (True, 0.3)])
def test_attention_takes_torchs_flash_kernels_under_grad(is_causal, scale, monkeypatch):
    """NOTE [Attention: torch's flash kernels for one derivative]: grad runs the forward
    kernel once (its log-sum-exp kept) and the backward kernel once (its three outputs
    kept), as torch.func does, with torch.func's bits."""
    calls = _count_attention_kernels(monkeypatch)
    q, k, v = _attention_inputs(0, length=6 if is_causal else 5)

    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                              scale=scale).sin().sum()
    ours = mf.grad(loss, (0, 1, 2))(q, k, v)
    assert calls == {"attention": 1, "attention_logsumexp": 1, "attention_backward_query": 1,
                     "attention_backward_key": 1, "attention_backward_value": 1}
    for a, b in zip(ours, tf.grad(loss, (0, 1, 2))(q, k, v)):
        assert torch.equal(a, b)
    calls.clear()  # a model's own layer, through its Python body
    layer = nn.MultiheadAttention(12, 3, batch_first=True).to(DTYPE)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = q.reshape(2, 6, 12)

    def layer_loss(params):
        return tf.functional_call(layer, params, (x, x, x), {"need_weights": False})[0].sum()
    ours = mf.grad(layer_loss)(params)
    assert calls["attention"] == 1 and calls["attention_backward_query"] == 1
    theirs = tf.grad(layer_loss)(params)
    for name in params:
        torch.testing.assert_close(ours[name], theirs[name])


def test_two_attentions_that_one_cotangent_reaches():
    """add passes its cotangent on unchanged to both terms: the backward kernel's kept
    outputs belong to one attention, not to the cotangent alone; two attentions that share
    their queries keep their own log-sum-exp."""
    q, k, v = _attention_inputs(4)
    k2, v2 = k.flip(0), v.cos()

    def loss(q, k, v, k2, v2):
        return (F.scaled_dot_product_attention(q, k, v)
                + F.scaled_dot_product_attention(q, k2, v2)).sin().sum()
    ours = mf.grad(loss, (0, 1, 2, 3, 4))(q, k, v, k2, v2)
    for a, b in zip(ours, tf.grad(loss, (0, 1, 2, 3, 4))(q, k, v, k2, v2)):
        torch.testing.assert_close(a, b)


def test_attention_keeps_its_three_ops_elsewhere(monkeypatch):
    """vmap, forward mode and second derivatives run softmax(q k^T scale) v as ops; torch's
    fused kernels have no forward-mode formula nor a double backward (torch.func's math
    path is the oracle there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    calls = _count_attention_kernels(monkeypatch)
    q, k, v = _attention_inputs(1)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def loss(q, k, v):
        return f(q, k, v).sin().sum()
    qs = torch.stack([q, q.cos()])
    for transform in (lambda api: api.vmap(api.grad(loss), (0, None, None))(qs, k, v),
                      lambda api: api.jvp(f, (q, k, v), (q.flip(0), k.cos(), v.sin()))[1],
                      lambda api: api.hessian(loss, 1)(q, k, v)):
        ours = transform(mf)
        assert calls == {}
        with sdpa_kernel(SDPBackend.MATH):
            torch.testing.assert_close(ours, transform(tf))
    # where torch itself would not take the kernel: a last dim not contiguous in memory, and
    # the math path asked for by name
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(mf.grad(loss)(q_t, k, v), tf.grad(loss)(q_t, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(mf.grad(loss)(q, k, v), tf.grad(loss)(q, k, v))
    assert calls == {}


def test_attention_vjp_fn_is_differentiated_in_its_cotangent(monkeypatch):
    """A level made after the forward sees q, k and v as constants: jacrev's vmap folds the
    cotangent into the backward kernel, and grad or jvp of vjp_fn take the forward's
    linearization (torch's backward kernel has no derivative: its math path is the oracle)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    calls = _count_attention_kernels(monkeypatch)
    q, k, v = _attention_inputs(2)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.7)
    torch.testing.assert_close(mf.jacrev(f, (0, 1, 2))(q, k, v),
                               tf.jacrev(f, (0, 1, 2))(q, k, v))
    assert calls["attention_backward_key"] == 1
    ct = torch.randn(2, 3, 6, 4, generator=torch.Generator().manual_seed(3), dtype=DTYPE)

    def second(api):
        _, vjp_fn = api.vjp(f, q, k, v)
        return api.grad(lambda c: sum(t.sin().sum() for t in vjp_fn(c)))(ct)
    ours = second(mf)
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(ours, second(tf))
    _, vjp_fn = mf.vjp(f, q, k, v)
    for tangent, expected in zip(mf.jvp(vjp_fn, (ct,), (ct.flip(0),))[1], vjp_fn(ct.flip(0))):
        torch.testing.assert_close(tangent, expected)


# --- small convolutions on a CPU: torch's one-example kernels ----------------------------------
def _aten_ops_run(f):
    """The aten ops that ``f()`` calls (by torch's profiler), and its result."""
    calls, out = aten_calls(f)
    return set(calls), out


def _float32_close_to_float64(ours, exact):
    """float32 results within float32 rounding of the same transform computed in float64
    (the oracle the two float32 kernels are each compared with: they round differently)."""
    for a, e in zip(ours if isinstance(ours, tuple) else (ours,),
                    exact if isinstance(exact, tuple) else (exact,)):
        assert a.dtype == torch.float32
        scale = e.abs().max().item() + 1
        torch.testing.assert_close(a.double(), e, rtol=0, atol=2e-5 * scale)


_SMALL_CONVS = {  # name -> (f, in_dims, shapes); f(x, w, b) with examples batched by vmap
    "per-sample gradients (grouped grad_weight)": (
        lambda api: api.vmap(api.grad(lambda w, b, x: F.conv2d(x[None], w, b, padding=1)
                                      .square().sum(), argnums=(0, 1)), in_dims=(None, None, 0)),
        ((4, 3, 3, 3), (4,), (6, 3, 8, 8))),
    "per-sample gradients, strided (grouped grad_weight)": (
        lambda api: api.vmap(api.grad(lambda w, b, x: F.conv2d(x[None], w, b, stride=(2, 1),
                                                                padding=(1, 2)).sin().sum()),
                             in_dims=(None, None, 0)),
        ((3, 2, 3, 2), (3,), (5, 2, 9, 8))),
    # the cotangent reaches the kernel strided (bilinear upsampling's backward gives one)
    "per-sample gradients, a strided cotangent (grouped grad_weight)": (
        lambda api: api.vmap(api.grad(lambda w, b, x: F.interpolate(
            F.conv2d(x[None], w, b, padding=1), scale_factor=2, mode="bilinear").square().sum()),
            in_dims=(None, None, 0)),
        ((4, 3, 3, 3), (4,), (6, 3, 8, 8))),
    "grad_input, a strided cotangent (slow backward)": (
        lambda api: api.vmap(api.grad(lambda x, w, b: F.conv2d(x[None], w, b, padding=1)
                                      .transpose(-1, -2).tanh().sum()), in_dims=(0, None, None)),
        ((6, 3, 8, 8), (5, 3, 3, 3), (5,))),
    "a batch of examples (forward)": (
        lambda api: api.vmap(lambda w, b, x: F.conv2d(x[None], w, b)[0], in_dims=(None, None, 0)),
        ((8, 3, 3, 3), (8,), (4, 3, 8, 8))),
    "an ensemble of weights (forward)": (
        lambda api: api.vmap(lambda w, b, x: F.conv2d(x, w, b), in_dims=(0, 0, None)),
        ((3, 4, 2, 3, 3), (3, 4), (5, 2, 7, 7))),
    "grad_input of a batch (slow backward)": (
        lambda api: api.vmap(api.grad(lambda x, w, b: F.conv2d(x[None], w, b, padding=1)
                                      .tanh().sum()), in_dims=(0, None, None)),
        ((6, 3, 8, 8), (5, 3, 3, 3), (5,))),
}


@pytest.mark.parametrize("name", sorted(_SMALL_CONVS))
def test_small_convolutions_take_the_one_example_kernels(name):
    """NOTE [Small convolutions on a CPU] in core/nn.py: a small batched float32 convolution
    runs on torch's _slow_conv2d kernels (or im2col and bmm for the grouped grad_weight of
    per-sample gradients), not oneDNN's, and gives torch.func's result to float32 rounding,
    which is checked against the same transform in float64."""
    make, shapes = _SMALL_CONVS[name]
    g = torch.Generator().manual_seed(0)
    args = [normal(g, *shape).float() for shape in shapes]
    ran, ours = _aten_ops_run(lambda: make(mf)(*args))
    assert ran & {"aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward", "aten::bmm"}, ran
    assert not ran & {"aten::mkldnn_convolution", "aten::convolution_backward"}, ran
    theirs = make(tf)(*args)
    exact = make(tf)(*[a.double() for a in args])
    _float32_close_to_float64(ours, exact)
    _float32_close_to_float64(theirs, exact)


@pytest.mark.parametrize("wide_vectors", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("part", ["forward", "per-sample grad_weight"])
def test_the_small_convolution_limit_follows_the_cpu(part, wide_vectors, monkeypatch):
    """NOTE [Small convolutions on a CPU]: S9's second layer (8 examples, 8 channels, 8 filters
    of 3x3 on 14x14: 82,944 im2col elements) takes the one-example kernels on an AVX2 CPU,
    where they are the faster up to about 140k, and oneDNN on one with 512-bit vectors (limit
    60k); both give torch.func's result to float32 rounding."""
    monkeypatch.setattr(kernels, "WIDE_VECTORS", wide_vectors)
    g = torch.Generator().manual_seed(5)
    w, b, x = (normal(g, *shape).float() for shape in ((8, 8, 3, 3), (8,), (8, 8, 14, 14)))
    if part == "forward":
        make = lambda api: api.vmap(lambda w, b, x: F.conv2d(x[None], w, b)[0],  # noqa: E731
                                    in_dims=(None, None, 0))
        small, large = {"aten::_slow_conv2d_forward"}, {"aten::mkldnn_convolution"}
    else:
        make = lambda api: api.vmap(api.grad(  # noqa: E731
            lambda w, x: F.conv2d(x[None], w).square().sum()), in_dims=(None, 0))
        small, large = {"aten::bmm"}, {"aten::convolution_backward"}
    args = (w, b, x) if part == "forward" else (w, x)
    ran, ours = _aten_ops_run(lambda: make(mf)(*args))
    assert ran & (large if wide_vectors else small), ran
    assert not ran & (small if wide_vectors else large), ran
    _float32_close_to_float64(ours, make(tf)(*[a.double() for a in args]))


_TORCHS_OWN_CHOICE = {  # the same programs where the one-example kernels do not apply
    "float64": lambda a: [t.double() for t in a],
    "large": lambda a: [a[0], a[1], a[2].repeat(1, 1, 8, 8)],
    "channels last": lambda a: [a[0], a[1], a[2].contiguous(memory_format=torch.channels_last)
                                if a[2].dim() == 4 else a[2]],
}


@pytest.mark.parametrize("case", sorted(_TORCHS_OWN_CHOICE))
def test_other_convolutions_keep_torchs_own_kernel(case):
    """float64 (never oneDNN), a convolution above the size limit and a channels-last input
    call torch.convolution as before, and still give torch.func's result."""
    make, shapes = _SMALL_CONVS["a batch of examples (forward)"]
    g = torch.Generator().manual_seed(1)
    args = _TORCHS_OWN_CHOICE[case]([normal(g, *shape).float() for shape in shapes])
    ran, ours = _aten_ops_run(lambda: make(mf)(*args))
    assert "aten::_slow_conv2d_forward" not in ran or case == "float64", ran
    assert "aten::convolution" in ran, ran
    torch.testing.assert_close(ours, make(tf)(*args), rtol=1e-5, atol=1e-5)


def test_a_convolution_torchs_autograd_records_keeps_torchs_kernel():
    """Plain tensors that require grad (MAML's outer backward runs torch's autograd through
    the engine's kernels): torch.convolution, so torch's autograd records its own op."""
    g = torch.Generator().manual_seed(2)
    w = normal(g, 8, 3, 3, 3).float().requires_grad_()
    x = normal(g, 4, 3, 8, 8).float()
    f = lambda api: api.vmap(lambda x: F.conv2d(x[None], w)[0])(x)  # noqa: E731
    ran, ours = _aten_ops_run(lambda: f(mf))
    assert "aten::_slow_conv2d_forward" not in ran, ran
    (ours_grad,) = torch.autograd.grad(ours.square().sum(), w)
    (their_grad,) = torch.autograd.grad(f(tf).square().sum(), w)
    torch.testing.assert_close(ours_grad, their_grad, rtol=1e-5, atol=1e-5)


# --- under several vmaps: one kernel call for all levels -------------------------------------------
def _batched_by(levels, g, *shape):
    """A tensor with one leading dim for each of the three vmaps that batches it."""
    return normal(g, *[size for size, on in zip((2, 3, 4), levels) if on], *shape)


def _three_vmaps(api, f, roles):
    """``f`` under three vmaps; ``roles[i]`` says which vmaps batch argument i."""
    for level in (2, 1, 0):
        f = api.vmap(f, in_dims=tuple(0 if on[level] else None for on in roles))
    return f


def _chain_rule_calls(monkeypatch):
    """(primitive name, whether its chain rule computed it) for each convolution chain rule
    call (NOTE [Convolutions under nested vmaps] in core/nn.py)."""
    from minifunctorch.core import batching
    calls = []
    for prim in (mf_nn.convolution_p, mf_nn.conv_backward_input_p,
                 mf_nn.conv_backward_weight_p):
        rule = batching.chain_rules[prim]

        def spy(args, params, prim=prim, rule=rule):
            out = rule(args, params)
            calls.append((prim.name, out is not None))
            return out
        monkeypatch.setitem(batching.chain_rules, prim, spy)
    return calls


_LEVEL_SETS = [levels for levels in itertools.product((False, True), repeat=3)]


@pytest.mark.parametrize("x_levels", _LEVEL_SETS, ids=lambda v: "x" + "".join("01"[b] for b in v))
def test_a_convolution_under_three_vmaps_is_one_kernel_call(x_levels, monkeypatch):
    """Every way three vmaps can batch the input, the weight and the bias (each level batching
    one of them at least): torch.func's value, computed by the chain rule in one call wherever
    two levels or more are involved and the bias is batched only where the weight is."""
    calls = _chain_rule_calls(monkeypatch)
    conv = lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=(1, 2))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    for w_levels, b_levels in itertools.product(_LEVEL_SETS, repeat=2):
        roles = (x_levels, w_levels, b_levels)
        if not all(any(on[level] for on in roles) for level in range(3)):
            continue  # (a vmap must batch something)
        x = _batched_by(x_levels, g, 2, 3, 5, 6)
        w = _batched_by(w_levels, g, 4, 3, 3, 3)
        b = _batched_by(b_levels, g, 4)
        calls.clear()
        ours = _three_vmaps(mf, conv, roles)(x, w, b)
        assert_same(ours, _three_vmaps(tf, conv, roles)(x, w, b))
        involved = sum(any(on[level] for on in (x_levels, w_levels)) for level in range(3))
        expected = involved >= 2 and all(w_levels[k] or not b_levels[k] for k in range(3))
        assert calls[0] == ("convolution", expected), (roles, calls)


@pytest.mark.parametrize("x_levels", _LEVEL_SETS, ids=lambda v: "x" + "".join("01"[b] for b in v))
def test_convolution_gradients_under_three_vmaps(x_levels, monkeypatch):
    """vjp inside three vmaps that batch the input, the weight and the output's cotangent in
    every way: the backward convolutions' chain rules give torch.func's gradients."""
    calls = _chain_rule_calls(monkeypatch)

    def gradients(api):
        def f(x, w, b, ct):
            conv = lambda x, w: F.conv2d(x, w, b, padding=(0, 1), dilation=(1, 2))  # noqa: E731
            return api.vjp(conv, x, w)[1](ct)
        return f
    g = torch.Generator().manual_seed(1)
    for w_levels, ct_levels in itertools.product(_LEVEL_SETS, repeat=2):
        roles = (x_levels, w_levels, (False,) * 3, ct_levels)
        if not all(any(on[level] for on in roles) for level in range(3)):
            continue
        x = _batched_by(x_levels, g, 2, 3, 5, 6)
        w = _batched_by(w_levels, g, 4, 3, 3, 3)
        b = normal(g, 4)
        ct = _batched_by(ct_levels, g, 2, 4, 3, 4)
        ours = _three_vmaps(mf, gradients(mf), roles)(x, w, b, ct)
        assert_same(ours, _three_vmaps(tf, gradients(tf), roles)(x, w, b, ct))
    computed = {name for name, done in calls if done}
    assert {"convolution_backward_input", "convolution_backward_weight"} <= computed, calls

_AT_EVERY_DIM = {  # name -> (f, its batched argument's unbatched shape, the other arguments)
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), (3, 2, 6, 6), ()),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 1, 1), (3, 2, 6, 6), ()),
    "conv2d, shared weight": (lambda x, w: F.conv2d(x, w, padding=1), (3, 2, 6, 6),
                              ((4, 2, 3, 3),)),
    "conv2d, groups 2": (lambda x, w: F.conv2d(x, w, groups=2), (3, 4, 6, 6), ((4, 2, 3, 3),)),
    "conv2d, batched weight": (lambda x, w: F.conv2d(x, w), (3, 2, 6, 6), ((4, 2, 3, 3),)),
}


@pytest.mark.parametrize("in_dim", range(5))
@pytest.mark.parametrize("name", sorted(_AT_EVERY_DIM))
def test_a_batch_dim_anywhere_gives_torch_funcs_result(name, in_dim):
    """The pooling and convolution rules fold a batch dim among the leading dims where it is
    (``_fold_leading_at``) and take it from any dim into the channels (``_fold_channels``);
    the value, the per-example gradient and the tangent are torch.func's, whatever dim the
    examples come in (float64, for the convolutions' reductions)."""
    f, shape, others = _AT_EVERY_DIM[name]
    g = torch.Generator().manual_seed(in_dim)
    x = normal(g, *shape[:in_dim], 3, *shape[in_dim:])
    args = [x] + [normal(g, 3, *s) if name.endswith("batched weight") else normal(g, *s)
                  for s in others]
    in_dims = (in_dim,) + tuple(0 if name.endswith("batched weight") else None for _ in others)
    loss = lambda *a: f(*a).sin().sum()  # noqa: E731
    t = normal(g, *x.shape)
    tangent = lambda api: api.vmap(  # noqa: E731
        lambda x, x_dot, *o: api.jvp(lambda x: f(x, *o), (x,), (x_dot,))[1],
        in_dims=(in_dim, in_dim) + in_dims[1:])(x, t, *args[1:])
    for run in (lambda api: api.vmap(f, in_dims=in_dims)(*args),
                lambda api: api.vmap(api.grad(loss, argnums=tuple(range(len(args)))),
                                     in_dims=in_dims)(*args),
                tangent):
        assert_same(run(mf), run(tf))


def test_pooling_a_convolutions_batched_output_copies_nothing():
    """A convolution under vmap leaves its batch dim second, (N, B, C, H, W) (the groups
    trick's output, seen without a copy); pooling folds it there, where moving it in front
    first made reshape copy the whole activation."""
    g = torch.Generator().manual_seed(0)
    x, ws = normal(g, 4, 2, 8, 8), normal(g, 3, 5, 2, 3, 3)
    f = lambda w: F.max_pool2d(F.relu(F.conv2d(x, w)), 2)  # noqa: E731
    assert_same(mf.vmap(f)(ws), tf.vmap(f)(ws))
    assert _kernel_calls(mf.vmap(f), ws, name="aten::copy_") == 0


# --- regression tests: the issue tracker ---------------------------------------------------------
@pytest.mark.parametrize("loss", [F.nll_loss, F.cross_entropy])
def test_ignore_index_is_honoured(loss):
    """nll_loss and cross_entropy used to ignore ignore_index: the ignored targets were
    gathered (and -100 was out of range) and counted in the mean."""
    g = torch.Generator().manual_seed(0)
    x = normal(g, 6, 4)
    target = torch.tensor([0, -100, 3, 1, -100, 2])

    def f(x):
        return loss(x, target)
    ours = mf.grad(f)(x)
    assert_same(ours, tf.grad(f)(x))
    assert torch.all(ours[target == -100] == 0)
    other = torch.tensor([0, 3, 3, 1, 2, 3])
    assert_same(mf.vmap(lambda x: loss(x, other, ignore_index=3))(torch.stack([x, -x])),
                tf.vmap(lambda x: loss(x, other, ignore_index=3))(torch.stack([x, -x])))
    kept = target != -100
    torch.testing.assert_close(mf.grad_and_value(f)(x)[1], loss(x[kept], target[kept]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows", [1, 3], ids=["one_row", "three_rows"])
def test_per_sample_nll_loss_gradients_are_one_kernel_call_each_way(rows, reduction):
    """NOTE [nll_loss: torch's kernels as a linear pair]: under vmap(grad) the examples join N,
    so the forward is one nll_loss kernel and the backward one nll_loss_backward kernel, with
    the per-example means of torch.func (targets ignored in some examples and not others)."""
    g = torch.Generator().manual_seed(0)
    xs, weight = normal(g, 5, rows, 4), positive(g, 4)
    # (no example has all its targets ignored: its mean would be 0/0 in both engines)
    targets = torch.tensor([[0, 1, 2], [1, 3, 3], [2, 0, 3], [0, 3, 1], [1, 2, 3]])[:, :rows]

    def f(x, t):
        loss = F.nll_loss(F.log_softmax(x, 1), t, weight, ignore_index=3, reduction=reduction)
        return loss.sum()
    per_sample = mf.vmap(mf.grad(f))
    assert_same(per_sample(xs, targets), tf.vmap(tf.grad(f))(xs, targets))
    assert _kernel_calls(per_sample, xs, targets, name="aten::nll_loss_forward") == 1
    assert _kernel_calls(per_sample, xs, targets, name="aten::nll_loss_backward") == 1
    # (the ops' form scattered the cotangent into zeros: no longer)
    assert _kernel_calls(per_sample, xs, targets, name="aten::scatter_add_") == 0


def test_the_mean_nll_loss_backward_takes_the_forwards_total_weight():
    """Without class weights, the mean's denominator is the forward kernel's second output,
    kept for the backward kernel (NOTE [Kernels with two outputs]): nothing counts the kept
    targets again. With class weights it is computed as before. Every result is torch.func's
    bits."""
    g = torch.Generator().manual_seed(0)
    x, weight = normal(g, 6, 4), positive(g, 4)
    target = torch.tensor([0, -100, 2, 3, -100, 1])
    for w in (None, weight):
        f = lambda x: F.cross_entropy(x, target, w)  # noqa: E731
        assert_same(mf.grad(f)(x), tf.grad(f)(x))
    without_weights = mf.grad(lambda x: F.cross_entropy(x, target))
    assert _kernel_calls(without_weights, x, name="aten::ne") == 0
    assert _kernel_calls(mf.grad(lambda x: F.cross_entropy(x, target, weight)), x,
                         name="aten::ne") == 1


def test_a_tape_shows_an_optional_array_left_out_as_none():
    """nll_loss without class weights and a convolution without a bias: one tape entry each,
    the absent array written None, as a program writes it."""
    g = torch.Generator().manual_seed(0)
    x, w, target = normal(g, 2, 3, 5, 5), normal(g, 4, 3, 3, 3), torch.tensor([1, 0])
    with mf.capture_tapes() as tapes:
        mf.grad(lambda w: F.cross_entropy(F.conv2d(x, w).flatten(1), target))(w)
    lines = [entry.format() for entry in tapes[0].entries]
    assert [line.split(" = ")[1].split()[0] for line in lines] == [
        "convolution", "reshape", "log_softmax", "nll_loss"]
    assert " None " in lines[0] and " None " in lines[-1], lines


def test_nll_loss_takes_the_target_dtypes_of_torchs_kernel():
    """Long or Byte targets, as torch's kernel (torch.func's own decomposition gathers with a
    byte target and fails: the oracle here is the same loss with long targets)."""
    x, target = normal(torch.Generator().manual_seed(0), 3, 4), torch.tensor([0, 1, 2])
    weight = positive(torch.Generator().manual_seed(1), 4)
    for reduction, w in itertools.product(("mean", "sum", "none"), (None, weight)):
        f = lambda x, t: F.nll_loss(x, t, w, reduction=reduction).sum()  # noqa: E731
        assert_same(mf.vmap(mf.grad(f))(x[:, None], target.to(torch.uint8)[:, None]),
                    tf.vmap(tf.grad(f))(x[:, None], target[:, None]))
        assert_same(mf.grad(f)(x, target.to(torch.uint8)), tf.grad(f)(x, target))
    with pytest.raises(RuntimeError, match="expected target dtype to be Long or Byte"):
        F.nll_loss(x, target.int())
    with pytest.raises(TransformUsageError,
                       match=r"^nll_loss\(input, target\): expected target dtype to be Long or "
                             r"Byte, but got Int .*Fix: pass target.long\(\)") as error:
        mf.grad(lambda x: F.nll_loss(x, target.int()))(x)
    assert isinstance(error.value, RuntimeError)


def test_multilabel_margin_loss_agrees_with_torchs_kernel():
    """torch._decomp's decomposition of multilabel_margin_loss_forward counts the targets
    after the first -1; the op here agrees with torch's kernel."""
    x = normal(torch.Generator().manual_seed(0), 4, 5)
    for reduction in ("mean", "sum", "none"):
        f = lambda x: F.multilabel_margin_loss(x, MULTILABEL_TARGET, reduction=reduction)  # noqa
        assert_same(mf.vjp(f, x)[0], f(x))
    per_row = mf.vmap(lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"))(
        x, MULTILABEL_TARGET)
    assert_same(per_row, F.multilabel_margin_loss(x, MULTILABEL_TARGET, reduction="none"))


# --- batch norm: running statistics --------------------------------------------------------------
def _bn_inputs():
    g = torch.Generator().manual_seed(0)
    return normal(g, 6, 3, 4, 4), normal(g, 3), normal(g, 3)


def test_running_statistics_are_updated_under_grad_like_torch_func():
    x, w, b = _bn_inputs()
    stats = {ns: (torch.zeros(3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)) for ns in ("mf", "tf")}

    def loss(ns):
        mean, var = stats[ns]
        return lambda w, x: F.batch_norm(x, mean, var, w, b, training=True, momentum=0.3).pow(
            2).sum()
    assert_same(mf.grad(loss("mf"))(w, x), tf.grad(loss("tf"))(w, x))
    assert_same(mf.jvp(loss("mf"), (w, x), (w, x))[1], tf.jvp(loss("tf"), (w, x), (w, x))[1])
    assert torch.equal(stats["mf"][0], stats["tf"][0])
    assert torch.equal(stats["mf"][1], stats["tf"][1])
    assert not torch.equal(stats["mf"][0], torch.zeros(3, dtype=DTYPE))


def test_vmap_of_training_batch_norm_with_running_stats_is_refused():
    x, w, b = _bn_inputs()
    mean, var = torch.zeros(3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)

    def f(x):
        return F.batch_norm(x, mean, var, w, b, training=True)
    with pytest.raises(RuntimeError, match="Batch norm got a batched tensor"):
        tf.vmap(f)(x[None].expand(2, *x.shape))
    with pytest.raises(InPlaceError, match=r"^vmap\(f\)\(<inputs>\): batch_norm in training "
                                           r"mode.*replace_all_batch_norm_modules_"):
        mf.vmap(f)(x[None].expand(2, *x.shape))
    assert torch.equal(mean, torch.zeros(3, dtype=DTYPE)), "a refused call wrote the buffers"
    # eval mode, and a batch of models sharing one input, are fine
    ensemble = mf.vmap(lambda w: F.batch_norm(x, mean, var, w, b, training=True),
                       randomness="error")(torch.stack([w, 2 * w]))
    assert_same(ensemble[1], F.batch_norm(x, None, None, 2 * w, b, training=True))


def test_vmap_of_training_batch_norm_with_batched_running_stats_updates_each_example():
    """Buffers batched with the input: each example's running statistics, updated in place
    in the tensors given to vmap, as torch.func does."""
    x, w, b = _bn_inputs()
    xs = torch.stack([x, 2 * x + 1, -x])
    buffers = {ns: (torch.rand(3, 3, dtype=DTYPE), torch.rand(3, 3, dtype=DTYPE) + 0.5)
               for ns in ("mf", "tf")}
    buffers["tf"] = tuple(t.clone() for t in buffers["mf"])

    def f(ns):
        return lambda x, mean, var: F.batch_norm(x, mean, var, w, b, training=True,
                                                 momentum=0.2)
    with mf.capture_fallbacks() as used:
        ours = mf.vmap(f("mf"))(xs, *buffers["mf"])
    assert_same(ours, tf.vmap(f("tf"))(xs, *buffers["tf"]))
    assert not used, dict(used)
    for a, b_ in zip(buffers["mf"], buffers["tf"]):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    # the per-example gradient sees the same thing
    grads = mf.vmap(mf.grad(lambda x, m, v: f("mf")(x, m, v).sin().sum()))(xs, *buffers["mf"])
    assert_same(grads, tf.vmap(tf.grad(lambda x, m, v: f("tf")(x, m, v).sin().sum()))(
        xs, *buffers["tf"]))
    for a, b_ in zip(buffers["mf"], buffers["tf"]):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)


def test_running_statistics_given_to_jvp_are_updated_and_do_not_change_the_output():
    x, w, b = _bn_inputs()
    stats = {ns: (torch.zeros(3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)) for ns in ("a", "b")}

    def f(ns):
        return lambda x, mean: F.batch_norm(x, mean, stats[ns][1], w, b, training=True)
    tangents = (torch.ones_like(x), torch.ones(3, dtype=DTYPE))
    assert_same(mf.jvp(f("a"), (x, stats["a"][0]), tangents),
                tf.jvp(f("b"), (x, stats["b"][0]), tangents))
    assert torch.equal(stats["a"][0], stats["b"][0]) and torch.equal(stats["a"][1],
                                                                      stats["b"][1])
    # (torch.func refuses grad with respect to them; their derivative is zero)
    g = mf.grad(lambda mean: f("a")(x, mean).sin().sum())(torch.zeros(3, dtype=DTYPE))
    assert torch.equal(g, torch.zeros(3, dtype=DTYPE))


def test_batch_norm_is_not_differentiable_in_its_running_statistics():
    x, w, b = _bn_inputs()
    mean, var = torch.zeros(3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)
    f = lambda m: F.batch_norm(x, m, var, w, b).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument"):
        tf.grad(f)(mean)
    with pytest.raises(MissingRuleError, match="not differentiable with respect to running_mean"):
        mf.grad(f)(mean)
    # forward mode ignores their tangents, as torch.func does
    assert_same(mf.jvp(f, (mean,), (torch.ones(3, dtype=DTYPE),)),
                tf.jvp(f, (mean,), (torch.ones(3, dtype=DTYPE),)))


# --- dropout -------------------------------------------------------------------------------------
def test_dropout_in_training_mode_is_random_not_wrong():
    g = torch.Generator().manual_seed(0)
    x = normal(g, 4, 5)
    f = lambda x: F.dropout(x, 0.4).sin().sum()  # noqa: E731
    torch.manual_seed(7)
    ours = mf.grad(f)(x)
    torch.manual_seed(7)
    assert_same(ours, tf.grad(f)(x))
    with pytest.raises(RandomnessError):
        mf.vmap(lambda x: F.dropout(x, 0.4))(torch.stack([x, x]))
    with pytest.raises(RandomnessError):
        mf.vmap(lambda x: nn.Dropout(0.4).train()(x))(torch.stack([x, x]))
    assert_same(mf.vmap(lambda x: nn.Dropout(0.4).eval()(x))(torch.stack([x, x])),
                torch.stack([x, x]))


# --- refusals ------------------------------------------------------------------------------------
# Each misuse raises the engine's error, whose message starts with torch's own words and
# then names the call and the fix, and which is also the built-in exception torch raises for
# the same call on plain tensors (so code that catches torch's errors catches these).
@pytest.mark.parametrize("call, error, message", [
    (lambda x: F.conv2d(x, torch.ones(2, 3, 3, 3, dtype=DTYPE), padding="same", stride=2),
     InvalidOptionError, r"^conv2d\(\.\.\., padding='same', stride=\(2, 2\)\): padding='same' "
     r"is not supported for strided convolutions \(as in torch\)"),
    (lambda x: F.conv2d(x, torch.ones(2, 3, 3, 3, dtype=DTYPE), padding="full"),
     InvalidOptionError, r"^conv2d\(\.\.\., padding='full'\): Invalid padding string: 'full'"),
    (lambda x: F.conv2d(x[0, 0, 0], torch.ones(2, 3, 3, 3, dtype=DTYPE)), ShapeMismatchError,
     r"^conv2d\(input, \.\.\.\): Expected 3D \(unbatched\) or 4D \(batched\) input to conv2d, "
     r"but got input of size: \[4\]"),
    (lambda x: F.conv2d(x, torch.ones(2, 3, 3, 3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)),
     ShapeMismatchError, r"^conv2d\(input, weight, bias\): Given weight of size \[2, 3, 3, 3\], "
     r"expected bias to be 1-dimensional with 2 elements, but got bias of size \[3\] instead"),
    (lambda x: F.pad(x[0], (4, 4), mode="reflect"), ShapeMismatchError,
     r"^pad\(x, \[4, 4\], mode='reflect'\): Padding size should be less than the corresponding "
     r"input dimension, but got: padding \(4, 4\) at dimension 2 of input \[3, 4, 4\]"),
    (lambda x: F.pad(x, (1, 1), mode="replicate"), UnsupportedOperationError,
     r"^pad\(x, \[1, 1\], mode='replicate'\): Padding size 2 is not supported for 4D input "
     r"tensor"),
    (lambda x: F.pad(x[0], (-3, -2), mode="replicate"), ShapeMismatchError,
     r"^pad\(x, \[-3, -2\], mode='replicate'\): input \(W: 4\) is too small\. Calculated output "
     r"W: -1 \(as in torch: dim 2 of size 4 padded by \(-3, -2\) would have size -1\)"),
    (lambda x: F.pad(x, (1, 1), mode="reflect", value=2.0), InvalidOptionError,
     r'^pad\(x, \[1, 1\], mode=\'reflect\', value=2\.0\): Padding mode "reflect" doesn\'t take '
     r"in value argument"),
    (lambda x: F.pad(x, (1, 1), mode="wrap"), UnsupportedOperationError,
     r"^pad\(x, \[1, 1\], mode='wrap'\): Unrecognised padding mode wrap"),
    (lambda x: F.batch_norm(x, None, None), InvalidOptionError,
     r"^batch_norm\(input, running_mean, running_var, training=False\): running_mean must be "
     r"defined in evaluation mode"),
    (lambda x: F.batch_norm(x, None, None, torch.ones(4, dtype=DTYPE), training=True),
     ShapeMismatchError, r"^batch_norm\(input, \.\.\.\): weight should contain 3 elements not 4"),
    (lambda x: F.batch_norm(x, torch.zeros(2, dtype=DTYPE), torch.ones(3, dtype=DTYPE)),
     ShapeMismatchError, r"^batch_norm\(input, \.\.\.\): running_mean should contain 3 elements "
     r"not 2"),
    (lambda x: F.batch_norm(x[0, 0, 0], None, None, training=True), DimOutOfRangeError,
     r"^batch_norm\(input, \.\.\.\): Dimension out of range \(expected to be in range of "
     r"\[-1, 0\], but got 1\)"),
    (lambda x: F.group_norm(x, 2), ShapeMismatchError,
     r"^group_norm\(input, num_groups=2\): Expected number of channels in input to be divisible "
     r"by num_groups, but got input of shape \[2, 3, 4, 4\] and num_groups=2"),
    (lambda x: F.nll_loss(x[0, 0], torch.tensor([0, 1])), TransformUsageError,
     r"^nll_loss\(input, target\): expected class indices of shape \(4,\)"),
    (lambda x: F.nll_loss(x[:, :, 0, 0], torch.tensor([0.0, 1.0])), InputDtypeError,
     r"^nll_loss\(input, target\): expected target dtype to be Long or Byte, but got Float"),
    (lambda x: F.cross_entropy(x[:, :, 0, 0], torch.tensor([0.0, 1.0])), InputDtypeError,
     r"^cross_entropy\(input, target\): expected target dtype to be Long or Byte, but got Float "
     r"\(as in torch: a float target is class probabilities only with the input's shape"),
    (lambda x: F.nll_loss(x[:, :, 0, 0], torch.tensor([0, 1]), torch.ones(4, dtype=DTYPE)),
     ShapeMismatchError, r"^nll_loss\(input, target, weight\): weight tensor should be defined "
     r"either for all 3 classes or no classes but got weight tensor of shape: \[4\]"),
    (lambda x: F.layer_norm(x, (4,), torch.ones(1, 4, dtype=DTYPE)), ShapeMismatchError,
     r"^layer_norm\(input, normalized_shape, weight, bias\): Expected weight to be of same shape "
     r"as normalized_shape, but got weight of shape \[1, 4\] and normalized_shape = \[4\]"),
    (lambda x: F.linear(x[0, 0], torch.ones(4, dtype=DTYPE), torch.ones((), dtype=DTYPE)),
     ShapeMismatchError, r"^F\.linear\(input, weight, bias\): mat2 must be a matrix, got 1-D "
     r"tensor"),
    (lambda x: F.bilinear(x[0, 0], x[0, 0, :2], torch.ones(5, 4, 4, dtype=DTYPE)),
     ShapeMismatchError,
     r"^F\.bilinear\(input1, input2, weight, bias\): bilinear\(\): input batch dimensions do not "
     r"match at dim 0: got 4 and 2"),
    (lambda x: F.embedding(torch.tensor([0, 1]), x[0, 0, 0]), ShapeMismatchError,
     r"^embedding\(weight, indices\): 'weight' must be 2-D"),
    (lambda x: F.embedding(x[0, 0, 0], torch.ones(3, 2, dtype=DTYPE)), InputDtypeError,
     r"^embedding\(weight, indices\): Expected tensor for argument #1 'indices' to have one of "
     r"the following scalar types: Long, Int; but got torch.float64 instead"),
])
def test_refusals_are_clear(call, error, message):
    x = torch.randn(2, 3, 4, 4, dtype=DTYPE)
    with pytest.raises(error, match=message) as ours:
        mf.grad(lambda x: call(x)[0].sum())(x)
    with pytest.raises(Exception) as torchs:
        call(x)
    assert isinstance(ours.value, type(torchs.value)), (type(torchs.value), ours.value)


def test_a_circular_pad_that_wraps_twice_is_refused():
    """torch's circular pad of a dim cropped to fewer elements than the pad reads memory it
    is also writing (it raises for some shapes and returns values for others): the engine
    refuses it, in torch's words for the wrapping."""
    x = torch.randn(3, 4, 4, dtype=DTYPE)
    with pytest.raises(ShapeMismatchError,
                       match=r"^pad\(x, \[-3, 2\], mode='circular'\): Padding value causes "
                             r"wrapping around more than once .*dim 2 keeps 1 of 4"):
        mf.grad(lambda x: F.pad(x, (-3, 2), mode="circular").sum())(x)


@pytest.mark.parametrize("in_dims", [(None, 0, 0), (0, 0, 0)])
@pytest.mark.parametrize("bias_shape", [(), (3, 1), (4,)])
def test_a_batched_convolution_bias_of_the_wrong_shape_is_refused(in_dims, bias_shape):
    """The batching rules of a convolution reshape a batched bias before the kernel sees it:
    a bias of the wrong shape was read as another (or crashed inside). It is refused before,
    in torch's words, as torch refuses it outside vmap."""
    x, w = torch.randn(2, 2, 6, 6, dtype=DTYPE), torch.randn(3, 2, 3, 3, dtype=DTYPE)
    b = torch.randn(bias_shape, dtype=DTYPE)
    args = [torch.stack([a, 2 * a]) if d == 0 else a for a, d in zip((x, w, b), in_dims)]
    with pytest.raises(ShapeMismatchError, match=r"^conv2d\(input, weight, bias\): Given weight "
                       r"of size \[3, 2, 3, 3\], expected bias to be 1-dimensional with 3 "
                       rf"elements, but got bias of size \[{', '.join(map(str, bias_shape))}\] "
                       "instead"):
        mf.vmap(F.conv2d, in_dims=in_dims)(*args)
    with pytest.raises(RuntimeError, match="expected bias to be 1-dimensional"):
        F.conv2d(x, w, b)


_REFUSED_UNDER_VMAP = {
    # name: (f, one example's arguments); torch refuses the example, and every vmap of it
    # must refuse it too (each of these computed a value under some in_dims)
    "layer_norm weight (1, 2)": (lambda x, w, b: F.layer_norm(x, (2,), w, b),
                                 ((4, 3, 2), (1, 2), (2,))),
    "nll_loss weight of 4 for 3 classes": (
        lambda x, w: F.nll_loss(x, torch.tensor([0, 1, 2, 0]), w), ((4, 3), (4,))),
    "cross_entropy weight (1, 3)": (
        lambda x, w: F.cross_entropy(x, torch.tensor([0, 1, 2, 0]), w), ((4, 3), (1, 3))),
    "flatten(1, 0)": (lambda x: x.flatten(1, 0), ((4, 3),)),
    "bilinear batch dims": (lambda x1, x2, w: F.bilinear(x1, x2, w), ((4, 3), (2, 6), (5, 3, 3))),
}


@pytest.mark.parametrize("name", list(_REFUSED_UNDER_VMAP))
def test_what_torch_refuses_is_refused_under_every_in_dims(name):
    f, shapes = _REFUSED_UNDER_VMAP[name]
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, dtype=DTYPE, generator=g) for shape in shapes]
    with pytest.raises(Exception) as torchs:
        f(*args)
    for in_dims in itertools.product((None, 0), repeat=len(args)):
        if not any(d == 0 for d in in_dims):
            continue
        batched = [torch.stack([a, 2 * a]) if d == 0 else a for a, d in zip(args, in_dims)]
        with pytest.raises(TransformError) as ours:
            mf.vmap(f, in_dims=in_dims)(*batched)
        assert isinstance(ours.value, type(torchs.value)), (in_dims, ours.value)


@pytest.mark.parametrize("in_dims", [(None, 0, 0), (0, 0, 0)])
def test_batched_batch_norm_operands_of_the_wrong_size_are_refused(in_dims):
    """batch_norm under vmap with a batched weight of the wrong size used to compute a value
    where torch and torch.func raise."""
    x, b = torch.randn(4, 3, 2, dtype=DTYPE), torch.randn(3, dtype=DTYPE)
    w = torch.randn(4, dtype=DTYPE)
    args = [torch.stack([a, 2 * a]) if d == 0 else a for a, d in zip((x, w, b), in_dims)]

    def f(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True)
    with pytest.raises(ShapeMismatchError,
                       match=r"^batch_norm\(input, \.\.\.\): weight should contain 3 elements "
                             r"not 4"):
        mf.vmap(f, in_dims=in_dims)(*args)
    with pytest.raises(RuntimeError, match=r"^weight should contain 3 elements not 4"):
        tf.vmap(f, in_dims=in_dims)(*args)


@pytest.mark.parametrize("op", [torch.ops.aten._native_batch_norm_legit.default,
                                torch.ops.aten._batch_norm_with_update.default])
def test_in_place_batch_norm_aten_ops_are_never_silently_wrong(op):
    """These ops write the running statistics (their schemas say so). Until tensor.py looks
    up the in-place aten ops registered in ATEN_OPS before functionalizing them, they are
    refused; with that lookup, they agree with torch.func and update the buffers."""
    x, w, b = _bn_inputs()
    buffers = {ns: (torch.zeros(3, dtype=DTYPE), torch.ones(3, dtype=DTYPE)) for ns in "ab"}
    args = (True,) if op is torch.ops.aten._native_batch_norm_legit.default else ()

    def f(ns):
        return lambda w: op(x, w, b, *buffers[ns], *args, 0.1, 1e-5)[0].sin().sum()
    try:
        ours = mf.grad(f("a"))(w)
    except TransformError as error:
        assert "has no out-of-place form" in str(error)
        assert torch.equal(buffers["a"][0], torch.zeros(3, dtype=DTYPE))
        return
    assert_same(ours, tf.grad(f("b"))(w))
    assert torch.equal(buffers["a"][0], buffers["b"][0])
    assert torch.equal(buffers["a"][1], buffers["b"][1])


# --- small nn.Module models through functional_call ---------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self, batch_norm=True, track_running_stats=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, track_running_stats=track_running_stats) if batch_norm \
            else nn.Identity()
        self.conv2 = nn.Conv2d(4, 6, 3, groups=2)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x)), inplace=True), 2)
        x = nn.functional.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 2).flatten(1)
        return F.log_softmax(self.fc(x), dim=1)


def _model(**kwargs):
    torch.manual_seed(0)
    return TinyCNN(**kwargs).double()


def _data(n=4):
    g = torch.Generator().manual_seed(1)
    return normal(g, n, 1, 8, 8), indices(g, 3, n)


def _loss(ft, model):
    def loss(params, x, target):
        return F.nll_loss(ft.functional_call(model, params, (x,)), target)
    return loss


def _per_example_loss(ft, model):
    def loss(params, x, target):
        out = ft.functional_call(model, params, (x.unsqueeze(0),))
        return F.nll_loss(out, target.unsqueeze(0))
    return loss


def test_tiny_cnn_grad_eval():
    model = _model().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, target = _data()
    assert_same(mf.grad(_loss(mf, model))(params, x, target),
                tf.grad(_loss(tf, model))(params, x, target))


def test_tiny_cnn_grad_train_updates_running_statistics():
    """Training mode under grad: the gradient is torch.func's, and the running statistics
    are updated with the plain batch statistics, as an eager forward pass updates them.
    (torch.func itself refuses this when the batch norm's input depends on the
    differentiated parameters: it would write a value of the transform into a captured
    buffer. Here the buffer gets the concrete statistics.)"""
    model, eager = _model().train(), _model().train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, target = _data()
    ours = mf.grad(_loss(mf, model))(params, x, target)
    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        tf.grad(_loss(tf, _model().train()))(params, x, target)
    untracked = _model().train()
    tf.replace_all_batch_norm_modules_(untracked)
    assert_same(ours, tf.grad(_loss(tf, untracked))(params, x, target))
    eager(x)
    for (name, ours_buffer), (_, eager_buffer) in zip(model.named_buffers(),
                                                      eager.named_buffers()):
        assert torch.equal(ours_buffer, eager_buffer), name


@pytest.mark.parametrize("mode", ["eval", "train_without_running_stats", "no_batch_norm"])
def test_tiny_cnn_per_sample_gradients(mode):
    model = _model(batch_norm=mode != "no_batch_norm",
                   track_running_stats=mode != "train_without_running_stats")
    model.eval() if mode == "eval" else model.train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, target = _data()
    with mf.capture_fallbacks() as used:
        ours = mf.vmap(mf.grad(_per_example_loss(mf, model)), in_dims=(None, 0, 0))(
            params, x, target)
    theirs = tf.vmap(tf.grad(_per_example_loss(tf, model)), in_dims=(None, 0, 0))(
        params, x, target)
    assert_same(ours, theirs)
    assert not used, dict(used)


def test_tiny_cnn_per_sample_gradients_with_running_stats_need_a_patched_model():
    model = _model().train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, target = _data()
    per_sample = mf.vmap(mf.grad(_per_example_loss(mf, model)), in_dims=(None, 0, 0))
    with pytest.raises(InPlaceError, match="replace_all_batch_norm_modules_"):
        per_sample(params, x, target)
    tf.replace_all_batch_norm_modules_(model)
    theirs = tf.vmap(tf.grad(_per_example_loss(tf, model)), in_dims=(None, 0, 0))(
        params, x, target)
    assert_same(per_sample(params, x, target), theirs)


def test_tiny_cnn_jacrev_and_ensemble():
    model = _model().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, _ = _data(2)

    def logits(ft):
        return lambda params, x: ft.functional_call(model, params, (x,))
    assert_same(mf.jacrev(logits(mf))(params, x), tf.jacrev(logits(tf))(params, x))
    assert_same(mf.jacrev(logits(mf), argnums=1)(params, x),
                tf.jacrev(logits(tf), argnums=1)(params, x))
    # an ensemble: a batch of parameters, one shared input
    stacked = {k: torch.stack([v, v * 0.5, -v]) for k, v in params.items()}
    with mf.capture_fallbacks() as used:
        ours = mf.vmap(logits(mf), in_dims=(0, None))(stacked, x)
    assert_same(ours, tf.vmap(logits(tf), in_dims=(0, None))(stacked, x))
    assert not used, dict(used)


def test_resnet_block_second_order():
    """A residual block with batch norm in training mode: hessian-vector products."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2, affine=True,
                                                                        track_running_stats=False),
                          nn.ReLU(), nn.Conv2d(2, 2, 1), nn.GroupNorm(1, 2), nn.Tanh()).double()
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(3, 2, 4, 4, dtype=DTYPE)

    def loss(ft):
        return lambda params: (ft.functional_call(block, params, (x,)) + x).pow(2).mean()
    tangent = {k: torch.randn_like(v) for k, v in params.items()}
    ours = mf.jvp(mf.grad(loss(mf)), (params,), (tangent,))[1]
    theirs = tf.jvp(tf.grad(loss(tf)), (params,), (tangent,))[1]
    assert_same(ours, theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(mf.grad(lambda p: sum(g.sum() for g in mf.grad(loss(mf))(p).values()))(params),
                    tf.grad(lambda p: sum(g.sum() for g in tf.grad(loss(tf))(p).values()))(params))


def test_group_norm_of_a_batch_dim_that_is_not_in_front():
    """torch's group norm kernel takes a contiguous input (torch.group_norm makes it so);
    under vmap along the last dim the payload is strided, and the kernel refused it."""
    g = torch.Generator().manual_seed(0)
    # examples (1, 4, 3) along the last dim: with N = 1, folding the batch into N is a view,
    # and a strided one
    x = torch.randn(1, 4, 3, 5, generator=g, dtype=DTYPE)
    w, b = torch.randn(4, generator=g, dtype=DTYPE), torch.randn(4, generator=g, dtype=DTYPE)

    def f(x):
        return F.group_norm(x, 2, w, b)
    assert_same(mf.vmap(f, in_dims=-1)(x), tf.vmap(f, in_dims=-1)(x))
    loss = lambda x: f(x).sin().sum()  # noqa: E731
    assert_same(mf.vmap(mf.grad(loss), in_dims=-1)(x), tf.vmap(tf.grad(loss), in_dims=-1)(x))


# --- values out of range: BCE's probabilities --------------------------------------------------
@pytest.mark.parametrize("transform", ["grad", "vmap", "jit", "jit_grad"])
@pytest.mark.parametrize("bad", ["input_above_1", "target_below_0", "input_nan"])
def test_binary_cross_entropy_refuses_what_is_not_a_probability(bad, transform):
    """torch's kernel reads every element and raises; the engine's composition would take
    logs of anything (NOTE [Checks of values, in eager code and in programs])."""
    x, t = torch.rand(2, 4, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1
    x_bad, t_bad = x.clone(), t.clone()
    if bad == "input_above_1":
        x_bad[2] = 1.5
    elif bad == "target_below_0":
        t_bad[1] = -0.25
    else:
        x_bad[0] = float("nan")
    f = F.binary_cross_entropy
    word = "target" if bad.startswith("target") else "input"
    with pytest.raises(RuntimeError, match=f"all elements of {word} should be between 0 and 1"):
        tf.grad(f)(x_bad, t_bad)  # torch.func's refusal, which ours must match
    if transform == "grad":
        run = mf.grad(f)
    elif transform == "vmap":
        def run(x, t):
            return mf.vmap(f)(torch.stack([x, x]), torch.stack([t, t]))
    else:
        run = mf.jit(f if transform == "jit" else mf.grad(f))
        expected = f(x, t) if transform == "jit" else tf.grad(f)(x, t)
        torch.testing.assert_close(run(x, t), expected)  # traced on good values
    with pytest.raises(mf.InvalidOptionError,
                       match=f"all elements of {word} should be between 0 and 1 .*Fix:"):
        run(x_bad, t_bad)
    torch.testing.assert_close(mf.grad(f)(x, t), tf.grad(f)(x, t))


def test_instance_norm_of_one_spatial_element_is_refused_as_torch_does():
    """NOTE [Instance norm is batch norm of one example]: the error speaks of the input as
    given, not of its fold into one example."""
    with pytest.raises(mf.TransformError, match=r"more than 1 spatial element .* \(2, 3, 1\)"):
        mf.grad(lambda x: F.instance_norm(x).sum())(torch.randn(2, 3, 1))
