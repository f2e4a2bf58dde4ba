"""Neural-network primitives: convolution, pooling, normalization, padding, losses.

NOTE [Which nn ops are primitives]
A few nn ops are kept as torch's own fused kernels, because torch.func runs exactly these
kernels and their backward kernels, so a primitive made of each keeps a training loop
bit-exact with torch.func:
- convolution, and its backward split in three (grad_input, grad_weight, grad_bias), each
  one output of ``aten.convolution_backward``;
- avg_pool, adaptive_avg_pool, the upsampling kernels of interpolation and reflect and
  replicate padding, each with its backward kernel: two linear maps, each the other's
  transpose;
- batch norm (training and eval), its statistics, and ``native_batch_norm_backward``;
- layer norm, its statistics, and ``native_layer_norm_backward`` (NOTE [Layer norm: the fused
  kernels as primitives]);
- group norm and its statistics; its derivatives are torch.func's formulas, written with ops
  (NOTE [Group norm: the forward kernel as a primitive]);
- max pooling (adaptive and fractional max pooling too): its kernel gives the values, and the
  indices it computes in the same pass are a non-differentiable primitive through which every
  derivative goes (a gather of the tangent, a scatter-add of the cotangent);
- grid_sample and its backward kernel, split in two (the input's cotangent and the grid's),
  where at most one level differentiates it (NOTE [grid_sample: torch's kernels for one
  derivative, gathers for more]);
- attention on a CPU: the flash kernel, its log-sum-exp, and its backward kernel split in
  three, where one grad level alone differentiates it (NOTE [Attention: torch's flash
  kernels for one derivative]).
Everything else is written with ``ops`` at the front door, readable, and every transform
handles it for free: constant padding (a primitive: its transpose is a crop), circular
padding and cropping reflect or replicate padding (gathers); RMS norm; the losses (nll_loss
and cross_entropy with weights, ignore_index and label smoothing, and the rest, replacing
ops.py's simpler entries); scaled_dot_product_attention without dropout or a mask (else);
grid_sample under two derivatives, unfold and fold (gathers and scatters); pixel shuffle,
glu, prelu, bilinear, pdist, max_unpool. multi_head_attention_forward runs torch's own
Python body at the front door.

Each op opens both doors: the torch functions users call (``F.conv2d``, ``F.max_pool2d``,
``F.cross_entropy``; front, torch_api.py) and the aten ops torch lowers to
(``aten.convolution``, ``aten.max_pool2d_with_indices``; back, aten_api.py). Left to others:
embedding and embedding_bag (the indexing family), dropout in training mode (randomness);
lp_pool, local_response_norm, instance_norm and most margin losses are torch composites of
the ops here; rrelu draws its slopes with torch's kernel (NOTE [rrelu outside vmap]).
Fractional max pooling is max pooling's pair of primitives with the random samples as an
argument, and ctc_loss wraps torch's kernel and its backward kernel (NOTE [CTC loss: torch's
kernels as primitives]).

Complex tensors: linear takes them (its vjp conjugates, as matmul's), convolution splits a
complex one into three real ones as torch does (NOTE [A complex convolution is three real
ones]), and padding, unfold, fold and l1_loss are made of complex-ready ops. The rest of the
family (pooling, normalization, the other losses, interpolation, ...) refuses them.
"""
import functools
import math
import types
import weakref

import torch
import torch._decomp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from . import aten_api, elementwise, indexing, kernels, ops, structural, torch_api
from . import primitives as P
from .autograd import conj, vjp_rules, wants_cotangent
from .batching import (batch_size, batched_by_every_level, batching_rules, bottom_operands,
                       chain_rules, fold_levels, level_sizes, move_bdim, to_front,
                       unfold_levels)
from .dispatch import complex_ready
from .errors import (DimOutOfRangeError, InPlaceError, InputDtypeError, InvalidOptionError,
                     MissingRuleError, ShapeMismatchError, TransformUsageError, TypecheckError,
                     UnsupportedOperationError)
from .fast_code import register_fresh
from .forward import add_tangents, jvp_rules, linear_jvp, sub_tangents
from .tensor import as_tensor, call_with_tensors, unwrap_tree
from .tracing import trace_call_of, traced_value
from .values import NUMBERS, Value, batched_by_vmap, bind, bottom_tensor

aten = torch.ops.aten
shape_of = ops.shape_of


# --- helpers -------------------------------------------------------------------------------------
def _is_tensor(x):
    return isinstance(x, (torch.Tensor, Value))


def _ntuple(value, n, what, op):
    """An int or a sequence as a tuple of ``n`` ints (a 1-sequence is repeated, as torch does)."""
    if isinstance(value, (int, torch.SymInt)):
        return (int(value),) * n
    value = tuple(int(v) for v in value)
    if len(value) == 1 and n > 1:
        return value * n
    if len(value) != n:
        raise ShapeMismatchError(
            f"{op}(..., {what}={value}): expected {what} to be a single integer value or a list "
            f"of {n} values to match the {n} spatial dims, but got {what}={list(value)} (as in "
            "torch). Fix: pass one value per spatial dim."
        )
    return value


def _refuse_complex(op, *args):
    """For the ops whose formulas are written for real numbers only. Convolution, linear,
    padding, unfold, fold and l1_loss take complex tensors (NOTE [Complex numbers] in
    dispatch.py); the rest of the family refuses them here."""
    for a in args:
        if _is_tensor(a) and a.dtype.is_complex:
            raise MissingRuleError(
                f"{op}: complex tensors are not supported by this op of the nn family yet "
                "(convolution, linear, padding, unfold, fold and l1_loss take them). Fix: use "
                "real tensors (split real and imaginary parts)."
            )


def _front(x, bdim):
    """A batched payload with its batch dim in front."""
    return move_bdim(x, bdim, 0)


def _fold_leading(x, keep):
    """``(B, *lead, *rest)`` -> ``(B * prod(lead), *rest)`` where ``rest`` is the last ``keep``
    dims: the batch joins the leading (N) dim that pooling and convolution loop over."""
    shape = shape_of(x)
    return ops.reshape(x, math.prod(shape[:len(shape) - keep]), *shape[len(shape) - keep:])


def _unfold_leading(x, lead):
    """The inverse of ``_fold_leading``: ``(B * prod(lead), *rest)`` -> ``(*lead, *rest)``."""
    return ops.reshape(x, *lead, *shape_of(x)[1:])


def _fold_examples(prim):
    """Batching of a primitive whose kernel computes each of the first dim's entries alone
    (the batch joins it)."""
    def rule(values, bdims, **params):
        moved = to_front(values, bdims, expand_unbatched=True)
        lead = shape_of(moved[0])[:2]
        out = bind(prim, *[_fold_leading(v, len(shape_of(v)) - 2) for v in moved], **params)
        return _unfold_leading(out, lead), 0
    return rule


def _fold_leading_at(x, bdim, keep):
    """``_fold_leading`` of a payload whose batch dim is ``bdim``, for the kernels that treat
    every dim before their last ``keep`` alike (pooling; a convolution's N): the batch joins
    them where it is, so a batch dim that an earlier rule left second, (N, B, C, H, W), is
    folded by a view where moving it in front would make reshape copy. Returns (the folded
    payload, the leading shape for ``_unfold_leading``, the unfolded result's batch dim). A
    batch dim among the last ``keep`` dims goes in front first."""
    rank = len(shape_of(x))
    if bdim >= rank - keep:
        x, bdim = _front(x, bdim), 0
    return _fold_leading(x, keep), shape_of(x)[:rank - keep], bdim


def _channel_view(v, rank, dim=1):
    """A per-channel vector of shape (C,) reshaped to broadcast along ``dim`` of a tensor of
    rank ``rank`` (``(1, C, 1, 1)`` for an NCHW tensor)."""
    shape = [1] * rank
    shape[dim] = shape_of(v)[0]
    return ops.reshape(v, *shape)


class _KeptOutput:
    """NOTE [Kernels with two outputs]
    Some of torch's kernels compute two results in one pass: native_batch_norm its output
    and the batch statistics, convolution_backward grad_weight and grad_bias, max pooling its
    values and their indices. A primitive has one output, so these are two primitives, and
    computed one after the other they would run the kernel twice. Instead, the first
    primitive's kernel keeps its other output, and the second primitive takes it when asked
    about the same elements, unchanged since, with the same parameters: the rules ask right
    after the first one. "The same elements": the same tensor, or a view with the same shape,
    strides and data pointer into the same base (a batching rule that folds the batch dim
    into another reshapes its payload anew for each primitive), at the same version (the
    counter a base shares with its views, which every in-place write bumps). One entry, at
    the bottom level only (plain tensors), held until the next keep or until its base is
    freed (a weak reference); anything else computes again, so the cache changes the speed,
    never a value. While torch.compile traces a program (jit's inductor backend) the cache
    is off: dynamo cannot follow a data pointer or a weak reference, and broke the graph at
    every take (S7's program compiled to five graphs); the traced program calls the kernel
    for each output, and inductor computes the shared work once."""

    def __init__(self):
        self.entry = None

    @staticmethod
    def _where(tensor):
        """(the base, the view's geometry and version): what makes two views the same."""
        base = tensor if tensor._base is None else tensor._base
        return base, (tuple(tensor.shape), tensor.stride(), tensor.data_ptr(), tensor._version)

    def _forget(self, ref):
        if self.entry is not None and self.entry[0] is ref:
            self.entry = None

    def keep(self, tensor, key, value):
        if tensor.device.type != "meta" and not torch.compiler.is_compiling():
            base, geometry = self._where(tensor)
            self.entry = (weakref.ref(base, self._forget), geometry, key, value)

    def take(self, tensor, key):
        entry = self.entry
        if entry is None or tensor.device.type == "meta" or torch.compiler.is_compiling():
            return None
        base, geometry = self._where(tensor)
        if entry[0]() is base and entry[1] == geometry and entry[2] == key:
            return entry[3]
        return None


# NOTE [A linear kernel and its transpose]
# avg_pool and adaptive_avg_pool are linear maps (so are upsampling, and reflect and replicate
# padding), and torch has a kernel for each and for its transpose (its backward). Both
# kernels are primitives, each the other's vjp: the vjp of avg_pool is avg_pool_backward, the
# vjp of avg_pool_backward is avg_pool. Their jvps are the op itself on the tangent, and
# batching folds the batch into N. torch.func's vjp runs the same backward kernel, so the
# gradients are bit-exact; second derivatives cost nothing more.
def _linear_pair(name, forward_impl, backward_impl):
    """Two primitives, ``name`` and ``name_backward``, each the other's transpose.
    ``backward_impl(ct, x_like, **params)`` reads only the shape of ``x_like``."""
    forward_p = P.primitive(name, forward_impl)
    backward_p = P.primitive(
        f"{name}_backward",
        lambda ct, *, input_shape, **params: backward_impl(ct, ct.new_empty(input_shape),
                                                           **params))

    def forward_vjp(x, **params):
        x_shape = shape_of(x)
        return (bind(forward_p, x, **params),
                lambda ct: (bind(backward_p, ct, input_shape=x_shape, **params),))

    def backward_vjp(ct, *, input_shape, **params):
        return (bind(backward_p, ct, input_shape=input_shape, **params),
                lambda g: (bind(forward_p, g, **params),))

    def forward_batch(values, bdims, **params):
        (x,), (bdim,) = values, bdims
        folded, lead, out_bdim = _fold_leading_at(x, bdim, _spatial_of(params) + 1)
        return _unfold_leading(bind(forward_p, folded, **params), lead), out_bdim

    def backward_batch(values, bdims, *, input_shape, **params):
        (ct,), (bdim,) = values, bdims
        keep = _spatial_of(params) + 1
        folded, lead, out_bdim = _fold_leading_at(ct, bdim, keep)
        folded_shape = (math.prod(lead),) + tuple(input_shape[len(input_shape) - keep:])
        out = bind(backward_p, folded, input_shape=folded_shape, **params)
        return _unfold_leading(out, lead), out_bdim

    vjp_rules[forward_p] = forward_vjp
    vjp_rules[backward_p] = backward_vjp
    jvp_rules[forward_p] = linear_jvp(forward_p)
    jvp_rules[backward_p] = linear_jvp(backward_p)
    batching_rules[forward_p] = forward_batch
    batching_rules[backward_p] = backward_batch
    return forward_p, backward_p


# --- linear --------------------------------------------------------------------------------------
# NOTE [Linear is a primitive]
# F.linear(x, w, b) = x @ w.T + b could be three ops (transpose, matmul, add), and that is how
# aten.linear decomposes. It is one primitive here because it is the op every model calls
# most: its kernel is torch's (addmm, the bias fused into the product, as torch.func runs
# it), one tape entry holds it, and under vmap one rule does what three did. Its rules are
# written in the ops it would decompose into, so nothing new is needed below it:
#   vjp: ct_x = ct @ conj(w),  ct_w = ct^T @ conj(x) over all leading dims,  ct_b = ct summed
#   over them (the conj is the adjoint's, on complex numbers, as matmul's; NOTE [Complex
#   numbers] in dispatch.py);
#   jvp: linear(x_dot, w, b_dot) + linear(x, w_dot) (it is bilinear in x and w, plus b);
#   vmap: with w and b shared, one call (linear maps the last dim only, so the batch dim
#   stays where it is); with batched weights (an ensemble), a batched matrix product.
# PyTorch's derivatives.yaml has the same formulas for addmm; JAX has no linear (dot_general).
linear_p = P.primitive("linear", lambda x, weight, bias: F.linear(x, weight, bias))


@torch_api.register(F.linear)
@aten_api.register(aten.linear.default)
def linear(x, weight, bias=None):
    weight_shape = shape_of(weight)
    if len(weight_shape) == 2 and (bias is None or shape_of(bias) == weight_shape[:1]):
        return bind(linear_p, x, weight, bias)
    # rare forms, as the ops torch decomposes them into: a vector weight (a dot product per
    # row), a bias that broadcasts ((), (1,), one per row)
    if len(weight_shape) == 1 and bias is not None:
        raise ShapeMismatchError(
            "F.linear(input, weight, bias): mat2 must be a matrix, got 1-D tensor (as in "
            "torch: a 1-D weight takes no bias). Fix: pass a (1, in_features) weight, or add "
            "the bias afterwards.")
    out = ops.matmul(x, weight if len(weight_shape) < 2 else ops.t(weight))
    return out if bias is None else ops.add(out, bias)


def linear_vjp(x, weight, bias):
    out = bind(linear_p, x, weight, bias)
    out_features, in_features = shape_of(weight)

    def backward(ct):
        ct_x = ops.matmul(ct, conj(weight)) if wants_cotangent(0, x) else None
        want_w = wants_cotangent(1, weight)
        want_b = bias is not None and wants_cotangent(2, bias)
        ct_w = ct_b = None
        if want_w or want_b:
            ct_rows = ops.reshape(ct, -1, out_features)  # one row per leading index
            if want_w:
                ct_w = ops.matmul(ops.transpose(ct_rows, 0, 1),
                                  ops.reshape(conj(x), -1, in_features))
            if want_b:
                ct_b = ops.reshape(ops.sum(ct_rows, 0), *shape_of(bias))
        return ct_x, ct_w, ct_b
    return out, backward


vjp_rules[linear_p] = linear_vjp


def linear_layer_jvp(primals, tangents):
    (x, weight, bias), (x_dot, weight_dot, bias_dot) = primals, tangents
    out = bind(linear_p, x, weight, bias)
    out_dot = None
    if x_dot is not None:
        out_dot = bind(linear_p, x_dot, weight, bias_dot)
        bias_dot = None
    if weight_dot is not None:
        out_dot = add_tangents(out_dot, bind(linear_p, x, weight_dot, bias_dot))
        bias_dot = None
    if bias_dot is not None:
        out_dot = ops.expand(bias_dot, *shape_of(out))
    return out, out_dot


jvp_rules[linear_p] = linear_layer_jvp
complex_ready(linear_p)  # checked against torch.func in tests/test_nn_complex.py


def linear_batch(values, bdims):
    (x, weight, bias), (x_bdim, w_bdim, b_bdim) = values, bdims
    if w_bdim is None and b_bdim is None:
        if x_bdim == len(shape_of(x)) - 1:  # the batch dim may not be the feature dim
            x, x_bdim = move_bdim(x, x_bdim, 0), 0
        return bind(linear_p, x, weight, bias), x_bdim
    size = batch_size(values, bdims)
    if (w_bdim is not None and type(x) is torch.Tensor and type(weight) is torch.Tensor
            and (bias is None or type(bias) is torch.Tensor)):
        return _linear_ensemble_kernel(x, x_bdim, weight, w_bdim, bias, b_bdim, size)
    # batched weights or bias: x (B or 1, N, in) @ w^T (B, in, out) + b (B or 1, 1, out)
    lead = list(shape_of(x))
    if x_bdim is not None:
        x = move_bdim(x, x_bdim, 0)
        lead = lead[:x_bdim] + lead[x_bdim + 1:]
    lead = lead[:-1]
    in_features = shape_of(x)[-1]
    x = ops.reshape(x, size if x_bdim is not None else 1, -1, in_features)
    weight = move_bdim(weight, w_bdim, 0) if w_bdim is not None else ops.unsqueeze(weight, 0)
    out = ops.matmul(x, ops.transpose(weight, -1, -2))
    if bias is not None:
        bias = move_bdim(bias, b_bdim, 0) if b_bdim is not None else ops.unsqueeze(bias, 0)
        out = ops.add(out, ops.unsqueeze(bias, 1))
    # (an unbatched x and w with a batched bias: the add broadcasts the product along B)
    return ops.reshape(out, size, *lead, shape_of(out)[-1]), 0


batching_rules[linear_p] = linear_batch


def _linear_ensemble_kernel(x, x_bdim, weight, w_bdim, bias, b_bdim, size):
    """NOTE [An ensemble's linear layer at the bottom level]
    With batched weights (B models) and plain tensors below (no level under this vmap), one
    fused kernel does the layer, as Batched.apply computes elementwise ops at the bottom:
    - a shared input: the B weight matrices stacked into one (B * out, in) matrix make a
      single linear of x, whose (..., B * out) result is viewed as (..., B, out), the batch
      dim second to last (no copy of x per model);
    - a batched input: a batched product (bmm), then the bias added in place into the
      product's fresh buffer: torch's baddbmm copies the bias into its output first and
      takes longer on the CPU (27 against 23 us for 10 models of 64x64 by 64x10; torch 2.13).
    Above another level the rule's general path (ops) computes the same."""
    weight = move_bdim(weight, w_bdim, 0)
    out_features, in_features = weight.shape[1:]
    if bias is not None:
        bias = move_bdim(bias, b_bdim, 0) if b_bdim is not None else bias.expand(size, -1)
    if x_bdim is None:
        out = F.linear(x, weight.reshape(size * out_features, in_features),
                       None if bias is None else bias.reshape(size * out_features))
        return out.view(*out.shape[:-1], size, out_features), x.dim() - 1
    x = move_bdim(x, x_bdim, 0)
    rows = x if x.dim() == 3 else x.reshape(size, -1, in_features)  # (B, rows, in)
    out = torch.bmm(rows, weight.transpose(1, 2))
    if bias is not None:
        out.add_(bias.unsqueeze(1))
    return (out if x.dim() == 3 else out.reshape(*x.shape[:-1], out_features)), 0


# --- convolution ---------------------------------------------------------------------------------
# The parameters of every convolution primitive, as aten.convolution takes them (tuples of
# one int per spatial dim, transposed a bool, groups an int).
#
# NOTE [Kernels through torch's own bindings]
# A call through ``torch.ops.aten`` converts its arguments by the op's schema, one at a time,
# in a slower path than torch's generated Python bindings: 8.3 against 4.1 us for a tiny
# convolution, 4.4 against 2.3 us for max pooling (the kernels themselves are the same). So
# an impl calls the binding where torch has one (``torch.convolution``,
# ``torch._C._nn.max_pool2d_with_indices``), and ``torch.ops.aten`` for the ops that have
# none (``convolution_backward``).
def _convolution(x, weight, bias, *, stride, padding, dilation, transposed, output_padding,
                 groups):
    if groups == 1 and _small_on_cpu(x, weight, bias, stride, padding, dilation, transposed,
                                     "forward"):
        return aten._slow_conv2d_forward(x, weight, weight.shape[2:], bias, stride, padding)
    return torch.convolution(x, weight, bias, stride, padding, dilation, transposed,
                             output_padding, groups)


def _convolution_backward(ct, x, weight, bias_sizes, mask, params):
    stride, padding, dilation = params["stride"], params["padding"], params["dilation"]
    groups = params["groups"]
    # (a grouped one: vmap's per-sample weight gradients have a single example, N = 1)
    if _small_on_cpu(x, weight, ct, stride, padding, dilation, params["transposed"],
                     "backward" if groups == 1 else "grouped", examples=1 if groups > 1 else 2):
        if groups == 1:
            return aten._slow_conv2d_backward.output_mask(ct, x, weight, weight.shape[2:],
                                                          stride, padding, mask)
        if mask[1] and not mask[0]:
            return None, _grouped_grad_weight(ct, x, weight.shape, stride, padding, groups), (
                ct.sum((0, 2, 3)) if mask[2] else None)
    if mask == (True, False, False) and _input_grad_as_forward(ct, weight, params):
        # NOTE [grad_input as a forward convolution]
        kh, kw = weight.shape[2:]
        return (torch.convolution(ct, weight.flip(2, 3).transpose(0, 1), None, (1, 1),
                                  (kh - 1 - padding[0], kw - 1 - padding[1]), (1, 1), False,
                                  (0, 0), 1), None, None)
    return aten.convolution_backward(ct, x, weight, bias_sizes, stride, padding, dilation,
                                     params["transposed"], params["output_padding"],
                                     params["groups"], mask)


def _input_grad_as_forward(ct, weight, params):
    """NOTE [grad_input as a forward convolution]
    For stride 1 and no dilation, grad_input is the convolution of the cotangent with the
    weight flipped in space and with its in and out channels swapped, padded by k - 1 - p
    (NOTE [The derivatives of a convolution are convolutions]). On a CPU, for float32 and more
    than one example, torch runs both on oneDNN, whose forward kernel is the faster one on
    CPUs with 512-bit vectors: 327 against 576 us for S9's second layer (80 examples of 8
    channels, 12x12 to 14x14), 421 against 516 us for S7's, 86 against 92 us at the small
    end, where _slow_conv2d is faster still and is taken first (NOTE [Small convolutions on
    a CPU]). On an AVX2 CPU the backward kernel is the faster (346 against 546 us for S9's
    layer, 1.66 against 2.67 ms for S7's), and torch's choice stands (NOTE [Kernel choices
    that depend on the CPU] in kernels.py). The two agree to float32 rounding."""
    if not kernels.WIDE_VECTORS or ct.dim() != 4 or weight.dim() != 4:
        return False
    padding = params["padding"]
    kh, kw = weight.shape[2], weight.shape[3]
    return (params["groups"] == 1 and not params["transposed"] and params["stride"] == (1, 1)
            and params["dilation"] == (1, 1) and ct.shape[0] >= 2
            and padding[0] <= kh - 1 and padding[1] <= kw - 1
            and _engine_picks_the_kernel(ct, weight))


# NOTE [Small convolutions on a CPU]
# For a float32 convolution on a CPU with more than one example, torch picks oneDNN (mkldnn),
# whose set-up costs about 35 us a call on this project's machine whatever the size; for one
# example it picks its own im2col-and-matmul kernel (_slow_conv2d). vmap turns one example's
# convolution into a batch of them, so a small model's convolutions, tiny per example, land on
# oneDNN as a batch and pay that set-up each time: 40 us for a 4x3x8x8 input and 8 filters of
# 3x3, against 11 us for _slow_conv2d (its backward: 134 against 27 us). Up to a size, then,
# the batched convolution calls the kernel torch itself uses for one example. The size is the
# im2col matrix (examples x in-channels x kernel x output positions), the work that kernel does
# per call; measured with 1 and 2 threads (torch 2.13, 1 to 64 examples, 3 to 64 channels, 8 to
# 128 filters, 8x8 to 32x32 images), _slow_conv2d is faster below about 40k elements forward
# and 60k backward, and oneDNN above. From 40k to 60k forward, alone and with the caches cold,
# the two are level for 8 to 16 filters (0.81 to 1.06) and oneDNN leads by 13% for 32 to 64;
# but _slow_conv2d is the faster in a program: where the other convolutions of a model are
# small ones, a oneDNN call among them costs its set-up and a cold start (the CNN per-sample
# program, whose second layer is 57.6k, takes 0.94 to 0.97 of the time it takes with that layer
# on oneDNN, A/B in one process), so the forward limit is 60k too. float64 and one example
# never take oneDNN. A grouped convolution has no such kernel in torch, but vmap's per-sample
# weight gradients are one (one group per example: NOTE [Convolutions under nested vmaps]), and
# its grad_weight is im2col and a batched matmul, which _grouped_grad_weight writes with
# torch's views: 21 against 52 us for 8 examples of 8 filters on a 12x12 image. Its limit, 60k
# elements, was measured with the caches cold, as in a program, where other work runs between
# two convolutions (a 2 MB write before each call): oneDNN then pays more for its set-up, and
# at 57.6k elements (8 examples, 8 to 80 filters of 8x3x3 on 10x10) the two are level
# (0.95-1.04); above, oneDNN is the faster (1.14 at 74k, 1.25 at 115k). Every other case
# (dilation, transposed, 1-D or 3-D, channels-last, CUDA, a tensor torch's autograd records,
# grad_input of a grouped convolution, a program torch.compile compiles for jit's inductor
# backend) stays with torch.convolution's own choice. The choice is a function of the shapes
# alone, as torch's own is, so a jit replay computes what the eager call did, and a small batch
# the user made takes the same kernels as one vmap made. The kernels round differently: the
# results agree with torch.func's to float32 rounding (as torch.func's agree with a loop over
# examples), and above the limits they are torch.func's bit for bit
# (test_fused_kernels_are_bit_exact_in_float32), but for a stride-1 grad_input, which is a
# forward convolution (NOTE [grad_input as a forward convolution]).
#
# The limits above were measured on an earlier machine, taken to have 512-bit vectors (NOTE
# [Kernel choices that depend on the CPU] in kernels.py). On an AVX2 CPU oneDNN gains less, and
# the crossover lies near 150k elements for all three (this project's AMD EPYC, AVX2, 1 and 2
# threads, caches cold, 2 to 32 examples, 3 to 32 channels, 8 to 64 filters, 8x8 to 24x24
# images): from 60k to 140k the small kernels take 0.5 to 0.9 of oneDNN's time forward and
# backward, and 0.6 to 0.9 for the grouped grad_weight, level (to 1.19) only with 8 filters on
# 8x8 images; above 160k oneDNN leads by up to 2x. S9's second layer (82,944 elements, forward
# and per-sample grad_weight) moves to them, and the NTK benchmark takes 0.95 of its time (A/B
# in one process, 15 rounds).
_SMALL_LIMITS = {  # kernels.WIDE_VECTORS -> each kind's limit, in im2col elements
    True: {"forward": 60_000, "backward": 65_536, "grouped": 60_000},
    False: {"forward": 140_000, "backward": 140_000, "grouped": 140_000},
}


def _small_on_cpu(x, weight, third, stride, padding, dilation, transposed, kind, examples=2):
    """Whether a convolution (or its backward: ``third`` is the bias or the cotangent) of at
    least ``examples`` examples takes the small kernels; ``kind`` names the limit ("forward",
    "backward" or "grouped"): NOTE [Small convolutions on a CPU]."""
    if transposed or x.dim() != 4 or weight.dim() != 4:
        return False
    n, c_in, height, width = x.shape
    kh, kw = weight.shape[2:]
    out_h = (height + 2 * padding[0] - kh) // stride[0] + 1
    out_w = (width + 2 * padding[1] - kw) // stride[1] + 1
    limit = _SMALL_LIMITS[kernels.WIDE_VECTORS][kind]
    if not (n >= examples and 0 < n * c_in * kh * kw * out_h * out_w <= limit):
        return False
    return (dilation[0] == 1 and dilation[1] == 1 and x.is_contiguous()
            and weight.is_contiguous() and _engine_picks_the_kernel(x, weight, third))


def _engine_picks_the_kernel(x, weight, third=None):
    """Where a convolution may run on another kernel than torch.convolution's own choice
    (NOTE [Small convolutions on a CPU], NOTE [grad_input as a forward convolution]): float32
    on a CPU, where torch takes oneDNN; not while torch.compile traces (jit's inductor
    backend picks its own kernels); and not where torch's autograd records the op (``third``:
    the bias or the cotangent, if any)."""
    return (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.is_cpu
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad
                or (third is not None and third.requires_grad))))


def _grouped_grad_weight(ct, x, weight_shape, stride, padding, groups):
    """grad_weight of a small grouped 2-D convolution, as im2col and one batched matmul: vmap's
    per-sample weight gradients are such a convolution, one group per example (NOTE [Small
    convolutions on a CPU]). The windows of x are a strided view (Tensor.unfold); one copy
    lays them out as each group's (in-channels x kernel, examples x positions) matrix."""
    n, c_out, out_h, out_w = ct.shape
    c_in, kh, kw = weight_shape[1], weight_shape[2], weight_shape[3]
    if padding[0] or padding[1]:
        x = torch.constant_pad_nd(x, (padding[1], padding[1], padding[0], padding[0]))
    windows = x.view(n, groups, c_in, x.shape[2], x.shape[3]).unfold(3, kh, stride[0]) \
        .unfold(4, kw, stride[1])  # (n, groups, c_in, out_h, out_w, kh, kw)
    columns = windows.permute(1, 2, 5, 6, 0, 3, 4).reshape(groups, c_in * kh * kw,
                                                             n * out_h * out_w)
    # (reshape, not view: the cotangent may come strided, as bilinear upsampling's does)
    ct = ct.reshape(n, groups, c_out // groups, out_h * out_w).permute(1, 2, 0, 3) \
        .reshape(groups, c_out // groups, n * out_h * out_w)
    return torch.bmm(ct, columns.transpose(1, 2)).view(weight_shape)


# The three outputs of aten.convolution_backward, one primitive each. The tensor that an
# output does not read (the input for grad_input, the weight for grad_weight) is passed as
# an uninitialized tensor of the right shape: the kernel never reads it.
def _conv_backward_input(ct, weight, *, input_shape, **params):
    unread = ct.new_empty(input_shape)
    return _convolution_backward(ct, unread, weight, None, (True, False, False), params)[0]


_kept_grad_bias = _KeptOutput()


def _conv_backward_weight(ct, x, *, weight_shape, with_bias, **params):
    """grad_weight; with_bias: grad_bias is asked for next, computed by the same kernel call
    and kept for it (NOTE [Kernels with two outputs])."""
    unread = ct.new_empty(weight_shape)
    if not with_bias:
        return _convolution_backward(ct, x, unread, None, (False, True, False), params)[1]
    _, grad_weight, grad_bias = _convolution_backward(ct, x, unread, [ct.shape[1]],
                                                      (False, True, True), params)
    _kept_grad_bias.keep(ct, (tuple(x.shape), tuple(weight_shape), tuple(params.items())),
                         grad_bias)
    return grad_weight


def _conv_backward_bias(ct, *, input_shape, weight_shape, **params):
    kept = _kept_grad_bias.take(ct, (tuple(input_shape), tuple(weight_shape),
                                     tuple(params.items())))
    if kept is not None:
        return kept
    return _convolution_backward(ct, ct.new_empty(input_shape), ct.new_empty(weight_shape),
                                 [ct.shape[1]], (False, False, True), params)[2]


convolution_p = P.primitive("convolution", _convolution)
conv_backward_input_p = P.primitive("convolution_backward_input", _conv_backward_input)
conv_backward_weight_p = P.primitive("convolution_backward_weight", _conv_backward_weight)
conv_backward_bias_p = P.primitive("convolution_backward_bias", _conv_backward_bias)
register_fresh(linear_p, convolution_p, conv_backward_input_p, conv_backward_weight_p,
               conv_backward_bias_p)  # (fast_code.py: jit's code may write over their results)


def _conv(x, weight, bias=None, **params):
    return bind(convolution_p, x, weight, bias, **params)


def _conv_backward_input_of(ct, weight, input_shape, params):
    return bind(conv_backward_input_p, ct, weight, input_shape=tuple(input_shape), **params)


def _conv_backward_weight_of(ct, x, weight_shape, params, with_bias=False):
    return bind(conv_backward_weight_p, ct, x, weight_shape=tuple(weight_shape),
                with_bias=with_bias, **params)


def _bias_broadcast(bias, out_shape):
    """A per-channel bias (or its tangent) broadcast to a convolution's output shape."""
    return ops.expand(_channel_view(bias, len(out_shape)), *out_shape)


# NOTE [The derivatives of a convolution are convolutions]
# A convolution is bilinear in (input, weight), plus the bias. Its vjp is
# aten.convolution_backward: grad_input is the transposed convolution of the cotangent with
# the weight, grad_weight a convolution of the input with the cotangent, grad_bias a sum.
# For second order the three backward primitives need derivatives of their own, and they
# follow from one identity: for any g, <grad_input(ct, w), g> = <ct, conv(g, w)> and
# <grad_weight(ct, x), h> = <ct, conv(x, h)>. So
#   vjp of grad_input(ct, w) with cotangent g:  ct_bar = conv(g, w),  w_bar = grad_weight(ct, g)
#   vjp of grad_weight(ct, x) with cotangent h: ct_bar = conv(x, h),  x_bar = grad_input(ct, h)
# and the jvps are bilinear. PyTorch's _convolution_double_backward (FunctionsManual.cpp)
# computes the same three convolutions; JAX's conv_general_dilated transposes one into the
# other the same way. The family closes: conv and its backward primitives are all anyone needs.
def convolution_vjp(x, weight, bias, **params):
    out = _conv(x, weight, bias, **params)
    x_shape, w_shape = shape_of(x), shape_of(weight)

    def backward(ct):
        x_bar = w_bar = b_bar = None
        want_b = bias is not None and wants_cotangent(2, bias)
        if wants_cotangent(0, x):
            x_bar = _conv_backward_input_of(ct, weight, x_shape, params)
        if wants_cotangent(1, weight):
            w_bar = _conv_backward_weight_of(ct, x, w_shape, params, with_bias=want_b)
        if want_b:
            b_bar = bind(conv_backward_bias_p, ct, input_shape=x_shape, weight_shape=w_shape,
                         **params)
        return x_bar, w_bar, b_bar
    return out, backward
vjp_rules[convolution_p] = convolution_vjp


def convolution_jvp(primals, tangents, **params):
    (x, weight, bias), (x_dot, w_dot, b_dot) = primals, tangents
    out = _conv(x, weight, bias, **params)
    out_dot = None
    if x_dot is not None:
        out_dot = _conv(x_dot, weight, None, **params)
    if w_dot is not None:  # conv(x, w_dot, b_dot) = conv(x, w_dot) + b_dot, one kernel
        out_dot = add_tangents(out_dot, _conv(x, w_dot, b_dot, **params))
        b_dot = None
    if b_dot is not None:
        out_dot = add_tangents(out_dot, _bias_broadcast(b_dot, shape_of(out)))
    return out, out_dot
jvp_rules[convolution_p] = convolution_jvp


def conv_backward_input_vjp(ct, weight, *, input_shape, **params):
    out = _conv_backward_input_of(ct, weight, input_shape, params)
    w_shape = shape_of(weight)

    def backward(g):
        ct_bar = _conv(g, weight, None, **params) if wants_cotangent(0, ct) else None
        w_bar = _conv_backward_weight_of(ct, g, w_shape, params) \
            if wants_cotangent(1, weight) else None
        return ct_bar, w_bar
    return out, backward
vjp_rules[conv_backward_input_p] = conv_backward_input_vjp


def conv_backward_input_jvp(primals, tangents, *, input_shape, **params):
    (ct, weight), (ct_dot, w_dot) = primals, tangents
    out = _conv_backward_input_of(ct, weight, input_shape, params)
    out_dot = None
    if ct_dot is not None:
        out_dot = _conv_backward_input_of(ct_dot, weight, input_shape, params)
    if w_dot is not None:
        out_dot = add_tangents(out_dot, _conv_backward_input_of(ct, w_dot, input_shape, params))
    return out, out_dot
jvp_rules[conv_backward_input_p] = conv_backward_input_jvp


def conv_backward_weight_vjp(ct, x, *, weight_shape, with_bias, **params):
    out = _conv_backward_weight_of(ct, x, weight_shape, params, with_bias)
    x_shape = shape_of(x)

    def backward(h):
        ct_bar = _conv(x, h, None, **params) if wants_cotangent(0, ct) else None
        x_bar = _conv_backward_input_of(ct, h, x_shape, params) if wants_cotangent(1, x) else None
        return ct_bar, x_bar
    return out, backward
vjp_rules[conv_backward_weight_p] = conv_backward_weight_vjp


def conv_backward_weight_jvp(primals, tangents, *, weight_shape, with_bias, **params):
    (ct, x), (ct_dot, x_dot) = primals, tangents
    out = _conv_backward_weight_of(ct, x, weight_shape, params, with_bias)
    out_dot = None
    if ct_dot is not None:
        out_dot = _conv_backward_weight_of(ct_dot, x, weight_shape, params)
    if x_dot is not None:
        out_dot = add_tangents(out_dot, _conv_backward_weight_of(ct, x_dot, weight_shape, params))
    return out, out_dot
jvp_rules[conv_backward_weight_p] = conv_backward_weight_jvp


def conv_backward_bias_vjp(ct, **params):
    out = bind(conv_backward_bias_p, ct, **params)
    ct_shape = shape_of(ct)
    return out, lambda g: (_bias_broadcast(g, ct_shape),)
vjp_rules[conv_backward_bias_p] = conv_backward_bias_vjp
jvp_rules[conv_backward_bias_p] = linear_jvp(conv_backward_bias_p)


# NOTE [Batching a convolution: the groups trick]
# A convolution already loops over two things a batch can join: the images (dim N) and the
# groups. With B examples:
# - only activations batched (the input, or the cotangent of grad_input), the weight shared:
#   the examples are more images, (B, N, C, ...) -> (B*N, C, ...).
# - the weight batched, the activation shared (an ensemble of models): the examples are more
#   channels on the weight's side that the shared activation does not carry. For conv that
#   is the output channels, (B, C_out, ...) -> (B*C_out, ...): one convolution computes every
#   example's output channels side by side.
# - both batched: the examples are more groups. Example b's input channels, weight and output
#   channels become groups b*g .. b*g+g-1 of one convolution with B*g groups: a block-
#   diagonal convolution, each example's block seeing only its own input and weight.
# The last case is what makes per-sample gradients of a CNN fast: under vmap(grad), the
# weight gradient grad_weight(ct, x) has both the cotangent and the input batched, and it
# becomes ONE grouped convolution backward with B*g groups, whose result (B*C_out, ...) is
# the B per-example weight gradients, with no loop and no (B, C_out, C_in, ...) intermediate
# per pixel. functorch's convolution batching rules (BatchRulesConvolution.cpp) do the same;
# Opacus's per-sample gradients use the unfold + einsum equivalent.
# The backward primitives batch the same way, each with its own shared operand: grad_input
# (ct, w) with only w batched puts the examples in the input channels; grad_weight (ct, x)
# with one side batched puts them in that side's channels, and its result has B times the
# channels on that side of the weight.
# When a batch joins a channel axis of a grouped convolution, it must stay inside each group:
# channels are laid out (group, example, channel in group), so that the g groups stay g
# contiguous blocks. With one group that is (example, channel): the helpers below then skip
# the group axis, which saves a reshape or a permute per operand (each one a bind per level
# under nested vmaps, as in vmap(jacrev) of the NTK).
def _conv_weight_dim(axis, transposed):
    """Which dim of the weight carries the channels of ``axis`` ('in' or 'out'): a convolution's
    weight is (C_out, C_in/g, ...), a transposed one's (C_in, C_out/g, ...)."""
    return 0 if (axis == "out") != transposed else 1


def _fold_channels(x, groups, bdim=0):
    """Activations (B, N, C, *sp), with B at dim ``bdim``, -> (N, B*C, *sp), channels laid out
    (group, example, c). Without groups it is one permute (none where B is already second,
    as ``_unfold_channels`` leaves it) and a reshape."""
    if groups == 1:  # (example, c): no group axis to split off
        rank = len(shape_of(x))
        n_dim, c_dim, *spatial_dims = [d for d in range(rank) if d != bdim]
        order = (n_dim, bdim, c_dim, *spatial_dims)
        if order != tuple(range(rank)):
            x = ops.permute(x, *order)
        n, b, c, *spatial = shape_of(x)
        return ops.reshape(x, n, b * c, *spatial)
    x = _front(x, bdim)
    b, n, c, *spatial = shape_of(x)
    x = ops.reshape(x, b, n, groups, c // groups, *spatial)
    x = ops.permute(x, 1, 2, 0, 3, *range(4, 4 + len(spatial)))
    return ops.reshape(x, n, b * c, *spatial)


def _unfold_channels(x, b, groups):
    """The inverse of ``_fold_channels``: (N, B*C, *sp) -> a payload and its batch dim."""
    n, bc, *spatial = shape_of(x)
    c = bc // b
    if groups == 1:
        return ops.reshape(x, n, b, c, *spatial), 1  # a view: no copy
    x = ops.reshape(x, n, groups, b, c // groups, *spatial)
    x = ops.permute(x, 2, 0, 1, 3, *range(4, 4 + len(spatial)))
    return ops.reshape(x, b, n, c, *spatial), 0


def _fold_weight(w, dim, groups):
    """A batched weight (B, w0, w1, *k) with the batch joined to weight dim ``dim``, inside
    each group: dim 0 -> (B*w0, w1, *k), dim 1 -> (w0, B*w1, *k)."""
    b, w0, w1, *kernel = shape_of(w)
    if groups == 1:  # (example, channel): no group axis to split off
        if dim == 0:
            return ops.reshape(w, b * w0, w1, *kernel)  # a view
        w = ops.permute(w, 1, 0, 2, *range(3, 3 + len(kernel)))
        return ops.reshape(w, w0, b * w1, *kernel)
    w = ops.reshape(w, b, groups, w0 // groups, w1, *kernel)
    rest = tuple(range(4, 4 + len(kernel)))
    if dim == 0:
        w = ops.permute(w, 1, 0, 2, 3, *rest)
        return ops.reshape(w, b * w0, w1, *kernel)
    w = ops.permute(w, 1, 2, 0, 3, *rest)
    return ops.reshape(w, w0, b * w1, *kernel)


def _unfold_weight(w, dim, b, groups):
    """The inverse of ``_fold_weight``: a payload with the batch dim in front."""
    w0, w1, *kernel = shape_of(w)
    if groups == 1:  # (example, channel): no group axis
        if dim == 0:
            return ops.reshape(w, b, w0 // b, w1, *kernel)  # a view
        w = ops.reshape(w, w0, b, w1 // b, *kernel)
        return ops.permute(w, 1, 0, 2, *range(3, 3 + len(kernel)))
    rest = tuple(range(4, 4 + len(kernel)))
    if dim == 0:
        w0 //= b
        w = ops.reshape(w, groups, b, w0 // groups, w1, *kernel)
        w = ops.permute(w, 1, 0, 2, 3, *rest)
    else:
        w1 //= b
        w = ops.reshape(w, groups, w0 // groups, b, w1, *kernel)
        w = ops.permute(w, 2, 0, 1, 3, *rest)
    return ops.reshape(w, b, w0, w1, *kernel)


def _fold_bias(bias, bdim, b, groups):
    """A per-output-channel bias, batched or shared, as (B*C_out,) laid out like the output
    channels (group, example, c)."""
    if bias is None:
        return None
    if bdim is None:
        bias = ops.expand(ops.unsqueeze(bias, 0), b, *shape_of(bias))
    else:
        bias = _front(bias, bdim)
    c = shape_of(bias)[1]
    if groups > 1:
        bias = ops.permute(ops.reshape(bias, b, groups, c // groups), 1, 0, 2)
    return ops.reshape(bias, b * c)


def _add_batched_bias(out, out_bdim, bias, bias_bdim):
    """A convolution output plus a batched bias (B, C): broadcast along N and space."""
    bias = _front(bias, bias_bdim)
    b, c = shape_of(bias)
    rank = len(shape_of(out)) - (out_bdim is not None)
    bias = ops.reshape(bias, b, 1, c, *([1] * (rank - 2)))
    if out_bdim is not None:
        out = _front(out, out_bdim)
    return ops.add(out, bias), 0


def convolution_batch(values, bdims, **params):
    (x, weight, bias), (x_bdim, w_bdim, b_bdim) = values, bdims
    b = batch_size(values, bdims)
    groups, transposed = params["groups"], params["transposed"]
    if x_bdim is None and w_bdim is None:  # only the bias is batched
        return _add_batched_bias(_conv(x, weight, None, **params), None, bias, b_bdim)
    if w_bdim is None:  # the examples are more images
        folded, lead, out_bdim = _fold_leading_at(x, x_bdim, len(shape_of(x)) - 2)
        if b_bdim is None:
            return _unfold_leading(_conv(folded, weight, bias, **params), lead), out_bdim
        out = _unfold_leading(_conv(folded, weight, None, **params), lead)
        return _add_batched_bias(out, out_bdim, bias, b_bdim)
    weight = _front(weight, w_bdim)
    if x_bdim is None:  # the examples are more output channels
        weight = _fold_weight(weight, _conv_weight_dim("out", transposed), groups)
        out = _conv(x, weight, _fold_bias(bias, b_bdim, b, groups), **params)
        return _unfold_channels(out, b, groups)
    # both batched: the examples are more groups
    x = _fold_channels(x, 1, x_bdim)
    weight = _fold_weight(weight, 0, 1)
    out = _conv(x, weight, _fold_bias(bias, b_bdim, b, 1), **{**params, "groups": b * groups})
    return _unfold_channels(out, b, 1)
batching_rules[convolution_p] = convolution_batch


def conv_backward_input_batch(values, bdims, *, input_shape, **params):
    (ct, weight), (ct_bdim, w_bdim) = values, bdims
    b = batch_size(values, bdims)
    groups, transposed = params["groups"], params["transposed"]
    n, c_in, *spatial = input_shape
    if w_bdim is None:  # the examples are more images
        folded, lead, out_bdim = _fold_leading_at(ct, ct_bdim, len(shape_of(ct)) - 2)
        out = _conv_backward_input_of(folded, weight, (b * n, c_in, *spatial), params)
        return _unfold_leading(out, lead), out_bdim
    weight = _front(weight, w_bdim)
    if ct_bdim is None:  # the examples are more input channels
        weight = _fold_weight(weight, _conv_weight_dim("in", transposed), groups)
        out = _conv_backward_input_of(ct, weight, (n, b * c_in, *spatial), params)
        return _unfold_channels(out, b, groups)
    ct = _fold_channels(ct, 1, ct_bdim)
    weight = _fold_weight(weight, 0, 1)
    out = _conv_backward_input_of(ct, weight, (n, b * c_in, *spatial),
                                  {**params, "groups": b * groups})
    return _unfold_channels(out, b, 1)
batching_rules[conv_backward_input_p] = conv_backward_input_batch


def conv_backward_weight_batch(values, bdims, *, weight_shape, with_bias, **params):
    # (with_bias is dropped: under vmap grad_bias is a sum, not a kernel output to keep)
    (ct, x), (ct_bdim, x_bdim) = values, bdims
    b = batch_size(values, bdims)
    groups, transposed = params["groups"], params["transposed"]
    if ct_bdim is None or x_bdim is None:
        # one side batched: the examples are more channels on that side
        axis = "in" if ct_bdim is None else "out"
        dim = _conv_weight_dim(axis, transposed)
        if ct_bdim is None:
            x = _fold_channels(x, groups, x_bdim)
        else:
            ct = _fold_channels(ct, groups, ct_bdim)
        shape = list(weight_shape)
        shape[dim] *= b
        out = _conv_backward_weight_of(ct, x, shape, params)
        return _unfold_weight(out, dim, b, groups), 0
    # both batched (per-sample gradients): one grouped convolution, B*g groups
    ct = _fold_channels(ct, 1, ct_bdim)
    x = _fold_channels(x, 1, x_bdim)
    shape = (b * weight_shape[0], *weight_shape[1:])
    out = _conv_backward_weight_of(ct, x, shape, {**params, "groups": b * groups})
    return _unfold_weight(out, 0, b, 1), 0
batching_rules[conv_backward_weight_p] = conv_backward_weight_batch


def conv_backward_bias_batch(values, bdims, **params):
    (ct,), (bdim,) = values, bdims
    ct = _front(ct, bdim)
    return ops.sum(ct, (1, *range(3, len(shape_of(ct))))), 0
batching_rules[conv_backward_bias_p] = conv_backward_bias_batch


# NOTE [Convolutions under nested vmaps]
# Under several vmaps (the NTK's jvp convolves an input batched by one level with a weight
# tangent batched by two others) each level's rule above folds its batch dim into the
# kernel's call and unfolds the result, one bind per level. The three roles a level can
# play do not interact, so all levels are folded at once by the chain rules below (NOTE [Ops
# on values of several vmaps, in one step] in batching.py): a level that batches only the
# input (or the cotangent of grad_input) joins N; one that batches only the weight joins its
# output (or input) channels; one that batches both joins the groups, each example its own
# group. One permute and reshape per operand, one kernel call, one reshape and permute of
# the result. They take ungrouped, untransposed convolutions; the rest take the rules.
def _levels_by_role(levels, first, second):
    """The level numbers (outermost first) that batch only ``first``, both, only ``second``."""
    order = sorted(levels)
    return ([n for n in order if n in first and n not in second],
            [n for n in order if n in first and n in second],
            [n for n in order if n in second and n not in first])


def _chain_operands(args, params):
    """For the chain rules below: the operands as ``bottom_operands`` gives them, the levels
    by number and each level's batch size; None where the one-level rules must run."""
    if params["groups"] != 1 or params["transposed"]:
        return None
    found = bottom_operands(args)
    if found is None:
        return None
    operands, levels = found
    return operands, levels, level_sizes(operands)


def _conv_of_chains(args, params):
    found = _chain_operands(args, params)
    if found is None:
        return None
    (x_op, w_op, b_op), levels, sizes = found
    if x_op is None or w_op is None:
        return None
    (x_levels, x), (w_levels, w) = x_op, w_op
    b_levels, bias = b_op if b_op is not None else ((), None)
    if not set(b_levels) <= set(w_levels):  # a bias batched where the weight is not
        return None
    n_levels, g_levels, o_levels = _levels_by_role(levels, x_levels, w_levels)
    x = fold_levels(x, x_levels, {0: n_levels, 1: g_levels})
    w = fold_levels(w, w_levels, {0: g_levels + o_levels})
    if bias is not None:  # laid out as the output channels, broadcast where it is unbatched
        channel_levels = g_levels + o_levels
        position = {n: i for i, n in enumerate(b_levels)}
        bias = bias.permute(*[position[n] for n in channel_levels if n in position],
                            len(b_levels))
        c_out = bias.shape[-1]
        bias = bias.reshape(*[sizes[n] if n in position else 1 for n in channel_levels], c_out)
        bias = bias.expand(*[sizes[n] for n in channel_levels], c_out).reshape(-1)
    groups = math.prod(sizes[n] for n in g_levels)
    out = _convolution(x, w, bias, **{**params, "groups": groups})
    out = unfold_levels(out, {0: n_levels, 1: g_levels + o_levels}, sizes, sorted(levels))
    return batched_by_every_level(out, levels)
chain_rules[convolution_p] = _conv_of_chains


def _conv_backward_input_of_chains(args, params):
    found = _chain_operands(args, params)
    if found is None:
        return None
    ((ct_levels, ct), (w_levels, w)), levels, sizes = found
    n_levels, g_levels, i_levels = _levels_by_role(levels, ct_levels, w_levels)
    ct = fold_levels(ct, ct_levels, {0: n_levels, 1: g_levels})
    w = fold_levels(w, w_levels, {0: g_levels, 1: i_levels})
    n, c_in, *spatial = params["input_shape"]
    channels = c_in * math.prod(sizes[k] for k in g_levels + i_levels)
    input_shape = (ct.shape[0], channels, *spatial)
    groups = math.prod(sizes[k] for k in g_levels)
    out = _conv_backward_input(ct, w, **{**params, "input_shape": input_shape,
                                         "groups": groups})
    out = unfold_levels(out, {0: n_levels, 1: g_levels + i_levels}, sizes, sorted(levels))
    return batched_by_every_level(out, levels)
chain_rules[conv_backward_input_p] = _conv_backward_input_of_chains


def _conv_backward_weight_of_chains(args, params):
    found = _chain_operands(args, params)
    if found is None:
        return None
    ((ct_levels, ct), (x_levels, x)), levels, sizes = found
    o_levels, g_levels, i_levels = _levels_by_role(levels, ct_levels, x_levels)
    # (grad_weight sums over N: no level joins it; ``with_bias`` is dropped as in the rule)
    ct = fold_levels(ct, ct_levels, {1: g_levels + o_levels})
    x = fold_levels(x, x_levels, {1: g_levels + i_levels})
    c_out, c_in, *kernel = params["weight_shape"]
    weight_shape = (ct.shape[1], c_in * math.prod(sizes[k] for k in i_levels), *kernel)
    groups = math.prod(sizes[k] for k in g_levels)
    rest = {k: v for k, v in params.items() if k not in ("weight_shape", "with_bias")}
    out = _conv_backward_weight(ct, x, weight_shape=weight_shape, with_bias=False,
                                **{**rest, "groups": groups})
    out = unfold_levels(out, {0: g_levels + o_levels, 1: i_levels}, sizes, sorted(levels))
    return batched_by_every_level(out, levels)
chain_rules[conv_backward_weight_p] = _conv_backward_weight_of_chains

# --- convolution: the doors ----------------------------------------------------------------------
def _conv_params(op, spatial, stride, padding, dilation, transposed, output_padding, groups):
    if int(groups) <= 0:  # (the batching rules divide channels by it before the kernel sees it)
        raise InvalidOptionError(
            f"{op}(..., groups={groups}): non-positive groups is not supported (as in torch). "
            "Fix: pass groups >= 1.")
    return dict(stride=_ntuple(stride, spatial, "stride", op),
                padding=_ntuple(padding, spatial, "padding", op),
                dilation=_ntuple(dilation, spatial, "dilation", op),
                transposed=bool(transposed),
                output_padding=_ntuple(output_padding, spatial, "output_padding", op),
                groups=int(groups))


def _check_conv_dtypes(op, x, weight, bias):
    """torch's convolutions take an input, weight and bias of one dtype (no promotion)."""
    for name, v in (("weight", weight), ("bias", bias)):
        if v is not None and v.dtype != x.dtype:
            raise ShapeMismatchError(
                f"{op}(input, weight, bias): Input type ({x.dtype}) and {name} type "
                f"({v.dtype}) should be the same, as in torch. Fix: convert the {name} with "
                f".to({x.dtype}).")


def _check_conv_bias(op, weight, bias, params):
    """torch's check of a convolution's bias: one value per output channel. (Under vmap the
    rules reshape a batched bias before the kernel sees it, so the kernel cannot check it.)"""
    if bias is None:
        return
    w_shape, b_shape = shape_of(weight), shape_of(bias)
    if len(w_shape) < 2:
        return  # (the kernel refuses the weight first, in torch's words)
    out_channels = w_shape[1] * params["groups"] if params["transposed"] else w_shape[0]
    if len(b_shape) != 1 or b_shape[0] != out_channels:
        given = "Given transposed=1, " if params["transposed"] else "Given "
        raise ShapeMismatchError(
            f"{op}(input, weight, bias): {given}weight of size {list(w_shape)}, expected bias "
            f"to be 1-dimensional with {out_channels} elements, but got bias of size "
            f"{list(b_shape)} instead (as in torch). Fix: pass one bias value per output "
            "channel.")


def _complex_conv(op, x, weight, bias, **params):
    """NOTE [A complex convolution is three real ones]
    aten.convolution and aten.convolution_backward have no complex kernel on the CPU (torch
    2.13): torch's conv2d and the others split a complex convolution into three real ones
    (Gauss's trick; complex_convolution in aten's Convolution.cpp), and torch.func
    differentiates those. So do we, with the same formula:
        a = conv(x_re, w_re, b_re),  b = conv(x_im, w_im),
        c = conv(x_re + x_im, w_re + w_im, b_re + b_im),
        conv(x, w, b) = (a - b) + i (c - a - b).
    The convolution primitives stay real, and no conj is written anywhere: the derivatives
    are those of real convolutions and of real, imag and complex, whose rules follow PyTorch's
    convention (NOTE [Complex numbers] in dispatch.py); the adjoint's conj of the weight in
    grad_input comes out of them. vmap batches the three real convolutions. As in torch, the
    input, weight and bias have one dtype."""
    x_re, x_im = ops.real(x), ops.imag(x)
    w_re, w_im = ops.real(weight), ops.imag(weight)
    b_re = b_both = None
    if bias is not None:
        b_re = ops.real(bias)
        b_both = ops.add(b_re, ops.imag(bias))
    a = _conv(x_re, w_re, b_re, **params)
    b = _conv(x_im, w_im, None, **params)
    c = _conv(ops.add(x_re, x_im), ops.add(w_re, w_im), b_both, **params)
    return ops.complex(ops.sub(a, b), ops.sub(ops.sub(c, a), b))


@aten_api.register(aten.convolution.default)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten.convolution``: every convolution torch runs, in normalized form (a complex one
    too, which torch's CPU kernel refuses: NOTE [A complex convolution is three real ones])."""
    spatial = len(shape_of(weight)) - 2
    params = _conv_params("convolution", spatial, stride, padding, dilation, transposed,
                          output_padding, groups)
    _check_conv_dtypes("convolution", x, weight, bias)
    _check_conv_bias("convolution", weight, bias, params)
    if x.dtype.is_complex:
        return _complex_conv("convolution", x, weight, bias, **params)
    return _conv(x, weight, bias, **params)


@aten_api.register(aten.convolution_backward.default)
def convolution_backward(ct, x, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    spatial = len(shape_of(weight)) - 2
    params = _conv_params("convolution_backward", spatial, stride, padding, dilation,
                          transposed, output_padding, groups)
    x_shape, w_shape = shape_of(x), shape_of(weight)
    return (_conv_backward_input_of(ct, weight, x_shape, params) if output_mask[0] else None,
            _conv_backward_weight_of(ct, x, w_shape, params, bool(output_mask[2]))
            if output_mask[1] else None,
            bind(conv_backward_bias_p, ct, input_shape=x_shape, weight_shape=w_shape, **params)
            if output_mask[2] else None)


def _same_padding(op, x, weight, stride, dilation):
    """padding='same': the total padding d*(k-1) split in two, the odd one out on the right
    (torch's _convolution_mode). Returns the (possibly right-padded) input and the symmetric
    padding."""
    if any(s != 1 for s in stride):
        raise InvalidOptionError(
            f"{op}(..., padding='same', stride={stride}): padding='same' is not supported for "
            "strided convolutions (as in torch). Fix: pass explicit padding, or stride=1."
        )
    kernel = shape_of(weight)[2:]
    left = [d * (k - 1) // 2 for d, k in zip(dilation, kernel)]
    extra = [d * (k - 1) - 2 * l for d, k, l in zip(dilation, kernel, left)]
    if any(extra):
        pad = []
        for e in reversed(extra):  # F.pad's order: last dim first
            pad += [0, e]
        x = constant_pad_nd(x, pad, 0)
    return x, tuple(left)


def _conv_front(spatial, transposed):
    """F.conv{1,2,3}d or F.conv_transpose{1,2,3}d, with torch's signature."""
    name = f"conv_transpose{spatial}d" if transposed else f"conv{spatial}d"

    def call(x, weight, bias, stride, padding, output_padding, groups, dilation):
        rank = len(shape_of(x))
        if rank not in (spatial + 1, spatial + 2):
            raise ShapeMismatchError(
                f"{name}(input, ...): Expected {spatial + 1}D (unbatched) or {spatial + 2}D "
                f"(batched) input to {name}, but got input of size: {list(shape_of(x))} (as in "
                "torch). Fix: give an input with (N,) C and the spatial dims."
            )
        unbatched = rank == spatial + 1
        if unbatched:
            x = ops.unsqueeze(x, 0)
        stride = _ntuple(stride, spatial, "stride", name)
        dilation = _ntuple(dilation, spatial, "dilation", name)
        if isinstance(padding, str):
            if transposed:
                raise TypecheckError(
                    f"{name}(..., padding={padding!r}): {name}(): argument 'padding' must be "
                    "tuple of ints, not str (as in torch: 'same' and 'valid' are for "
                    "convolutions, not transposed ones). Fix: pass ints."
                )
            if padding not in ("same", "valid"):
                raise InvalidOptionError(
                    f"{name}(..., padding={padding!r}): Invalid padding string: {padding!r} (as "
                    "in torch). Fix: pass 'same', 'valid' or ints."
                )
            if padding == "valid":
                padding = 0
            else:
                x, padding = _same_padding(name, x, weight, stride, dilation)
        params = _conv_params(name, spatial, stride, padding, dilation, transposed,
                              output_padding, groups)
        _check_conv_dtypes(name, x, weight, bias)
        _check_conv_bias(name, weight, bias, params)
        if x.dtype.is_complex:
            out = _complex_conv(name, x, weight, bias, **params)
        else:
            out = _conv(x, weight, bias, **params)
        return ops.squeeze(out, 0) if unbatched else out

    if transposed:
        def conv_transpose(x, weight, bias=None, stride=1, padding=0, output_padding=0,
                           groups=1, dilation=1):
            return call(x, weight, bias, stride, padding, output_padding, groups, dilation)
        conv_transpose.__name__ = name
        return conv_transpose

    def conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        return call(x, weight, bias, stride, padding, 0, groups, dilation)
    conv.__name__ = name
    return conv


for _spatial in (1, 2, 3):
    torch_api.register(getattr(F, f"conv{_spatial}d"), getattr(torch, f"conv{_spatial}d"))(
        _conv_front(_spatial, False))
    torch_api.register(getattr(F, f"conv_transpose{_spatial}d"),
                       getattr(torch, f"conv_transpose{_spatial}d"))(_conv_front(_spatial, True))


# --- padding -------------------------------------------------------------------------------------
# ``pad`` is in F.pad's order: (left, right) of the last dim, then of the dim before, ...
constant_pad_nd_p = P.primitive(
    "constant_pad_nd", lambda x, *, pad, value: torch.constant_pad_nd(x, pad, value))


def _padded_dims(pad, rank):
    """(dim, before, after) for each padded dim, from F.pad's flat list."""
    return [(rank - 1 - i, pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]


def constant_pad_nd_vjp(x, *, pad, value):
    """NOTE [The transpose of padding is cropping]
    Padding by p puts x inside a frame of constants, so its vjp keeps the middle of the
    cotangent: a slice (a view). A negative pad crops, and the transpose of cropping is
    padding with zeros; with pads of both signs the transpose is the pad by -p, which crops
    where the forward padded and pads where it cropped (PyTorch's constant_pad_nd backward
    is ``constant_pad_nd(grad, -pad)`` too)."""
    out = bind(constant_pad_nd_p, x, pad=pad, value=value)
    x_shape = shape_of(x)

    def backward(ct):
        if all(p >= 0 for p in pad):
            index = [slice(None)] * len(x_shape)
            for dim, before, _ in _padded_dims(pad, len(x_shape)):
                index[dim] = slice(before, before + x_shape[dim])
            return (ops.getitem(ct, tuple(index)),)
        return (bind(constant_pad_nd_p, ct, pad=tuple(-p for p in pad), value=0),)
    return out, backward
vjp_rules[constant_pad_nd_p] = constant_pad_nd_vjp


def constant_pad_nd_jvp(primals, tangents, *, pad, value):
    (x,), (x_dot,) = primals, tangents
    return (bind(constant_pad_nd_p, x, pad=pad, value=value),
            bind(constant_pad_nd_p, x_dot, pad=pad, value=0))
jvp_rules[constant_pad_nd_p] = constant_pad_nd_jvp


def constant_pad_nd_batch(values, bdims, *, pad, value):
    (x,), (bdim,) = values, bdims
    # the pads touch the last len(pad) // 2 dims: with the batch dim in front, never it
    return bind(constant_pad_nd_p, _front(x, bdim), pad=pad, value=value), 0
batching_rules[constant_pad_nd_p] = constant_pad_nd_batch


@aten_api.register(aten.constant_pad_nd.default)
@torch_api.register(torch.constant_pad_nd)
def constant_pad_nd(x, pad, value=0):
    pad = tuple(int(p) for p in pad)
    rank = len(shape_of(x))
    if len(pad) % 2 or len(pad) // 2 > rank:
        words = ("Padding length must be divisible by 2" if len(pad) % 2 else
                 "Padding length should be less than or equal to two times the input dimension "
                 f"but got padding length {len(pad)} and input of dimension {rank}")
        raise ShapeMismatchError(
            f"constant_pad_nd(x, pad={pad}): {words} (as in torch: at most two pads per dim "
            f"of the input's shape {shape_of(x)}). Fix: pass (left, right) pairs, last dim "
            "first."
        )
    if not any(pad):
        return x
    return bind(constant_pad_nd_p, x, pad=pad, value=value)


def _pad_positions(mode, size, before, after):
    """The input positions a padded dim reads, for reflect, replicate and circular padding.
    A negative pad crops. Circular padding wraps around what is left after cropping (torch
    crops first, then copies the ends of the kept part), so its positions are taken modulo
    the kept size, not the input's."""
    if mode == "circular":
        start = max(0, -before)
        kept = size - start - max(0, -after)
        return start + torch.arange(-max(before, 0), kept + max(after, 0)).remainder(kept)
    positions = torch.arange(-before, size + after)
    if mode == "reflect":
        positions = positions.abs()
        return torch.where(positions >= size, 2 * (size - 1) - positions, positions)
    return positions.clamp(0, size - 1)  # replicate


def _pad_by_gathering(x, pad, mode):
    """NOTE [Reflect, replicate and circular padding are gathers]
    Each of these modes makes every output element a copy of one input element: which one
    is a fixed function of its position (a reflection, a clamp, a modulo). So each padded dim
    is a gather along that dim with a constant index, and gather's rules give the
    derivatives: the vjp scatter-adds the cotangent back, summing where a border element was
    copied several times (what reflection_pad2d_backward computes). PyTorch's Python
    decompositions of these ops index the same way."""
    rank = len(shape_of(x))
    # (NOTE [Reflect and replicate padding: a linear kernel and its transpose])
    by_kernel = mode != "circular" and all(p >= 0 for p in pad)
    for dim, before, after in _padded_dims(pad, rank):
        size = shape_of(x)[dim]
        call = f"pad(x, {list(pad)}, mode={mode!r})"
        if size + before + after < (0 if mode == "circular" else 1):  # (as torch)
            letter = "WHD"[rank - 1 - dim]
            words = ("Negative padding value is resulting in an empty dimension"
                     if mode == "circular" else f"input ({letter}: {size}) is too small. "
                     f"Calculated output {letter}: {size + before + after}")
            raise ShapeMismatchError(
                f"{call}: {words} (as in torch: dim {dim} of size {size} padded by ({before}, "
                f"{after}) would have size {size + before + after}). Fix: crop less."
            )
        if mode == "reflect" and (before >= size or after >= size):
            raise ShapeMismatchError(
                f"{call}: Padding size should be less than the corresponding input dimension, "
                f"but got: padding ({before}, {after}) at dimension {dim} of input "
                f"{list(shape_of(x))} (as in torch: a reflection stays inside the dim). Fix: use "
                "smaller pads, or mode='replicate'."
            )
        kept = size - max(0, -before) - max(0, -after)
        if mode == "circular" and (before > kept or after > kept):
            raise ShapeMismatchError(
                f"{call}: Padding value causes wrapping around more than once (a circular pad "
                f"can be at most the size of the dim it pads, after cropping: dim {dim} keeps "
                f"{kept} of {size}). Fix: use smaller pads."
            )
        if by_kernel:
            continue  # (checked here, padded below)
        positions = _pad_positions(mode, size, before, after)
        shape = [1] * rank
        shape[dim] = len(positions)
        index_shape = list(shape_of(x))
        index_shape[dim] = len(positions)
        index = positions.to(x.device).reshape(shape).expand(index_shape)
        x = ops.gather(x, dim, index)
    if by_kernel:
        return bind(mode_pad_p, x, mode=mode, pad=pad)
    return x


# NOTE [Reflect and replicate padding: a linear kernel and its transpose]
# Without cropping, reflect and replicate padding are torch's kernels (reflection_pad2d,
# replication_pad2d, ...), linear maps whose backward kernels are their transposes: one pair
# of primitives, as avg_pool is (NOTE [A linear kernel and its transpose]), with values and
# gradients bit for bit torch.func's. As gathers, one per padded dim, with index tensors
# made on each call and scatter-adds for the vjp, they took twice torch.func's time. A
# negative pad (a crop) and circular padding, which torch writes as a composite of slices
# and concatenations, stay gathers (NOTE [Reflect, replicate and circular padding are
# gathers]).
def _mode_pad_kernel(mode, pad, backward=False):
    kind = "reflection" if mode == "reflect" else "replication"
    op = getattr(aten, f"{kind}_pad{len(pad) // 2}d{'_backward' if backward else ''}")
    return op.default


def _mode_pad_impl(x, *, mode, pad):
    return _mode_pad_kernel(mode, pad)(x, pad)


def _mode_pad_backward_impl(ct, x, *, mode, pad):
    return _mode_pad_kernel(mode, pad, backward=True)(ct, x, pad)


mode_pad_p, mode_pad_backward_p = _linear_pair("mode_pad", _mode_pad_impl,
                                               _mode_pad_backward_impl)
# (a map with real coefficients: its transpose is its adjoint, so complex numbers take the same
# rules; checked against torch.func in tests/test_nn_complex.py)
complex_ready(mode_pad_p, mode_pad_backward_p)


_PAD_RANKS = {2: (2, 3), 4: (3, 4), 6: (4, 5)}


@torch_api.register(F.pad)
def pad(x, pad, mode="constant", value=None):
    """F.pad with every mode."""
    pad = tuple(int(p) for p in pad)
    if mode == "constant":
        return constant_pad_nd(x, pad, 0 if value is None else value)
    if mode not in ("reflect", "replicate", "circular"):
        raise UnsupportedOperationError(
            f"pad(x, {list(pad)}, mode={mode!r}): Unrecognised padding mode {mode} (as in "
            "torch). Fix: use 'constant', 'reflect', 'replicate' or 'circular'."
        )
    if value is not None and value != 0:
        raise InvalidOptionError(
            f"pad(x, {list(pad)}, mode={mode!r}, value={value}): Padding mode \"{mode}\" "
            "doesn't take in value argument (as in torch: a fill value is only used by "
            "mode='constant'). Fix: drop value."
        )
    rank = len(shape_of(x))
    if rank not in _PAD_RANKS.get(len(pad), ()):
        raise UnsupportedOperationError(
            f"pad(x, {list(pad)}, mode={mode!r}): Padding size {len(pad)} is not supported "
            f"for {rank}D input tensor (as in torch: this mode pads the last 1, 2 or 3 dims of "
            "a 2-5 D input, with 2, 4 or 6 pads for 2-3, 3-4 or 4-5 dims). Fix: reshape the "
            "input."
        )
    return _pad_by_gathering(x, pad, mode)


def _mode_pad(mode):
    return lambda x, padding: _pad_by_gathering(x, tuple(int(p) for p in padding), mode)


for _n in (1, 2, 3):
    aten_api.register(getattr(aten, f"reflection_pad{_n}d").default)(_mode_pad("reflect"))
    aten_api.register(getattr(aten, f"replication_pad{_n}d").default)(_mode_pad("replicate"))
aten_api.register(aten._pad_circular.default)(_mode_pad("circular"))


# --- pooling: max pooling ------------------------------------------------------------------------
# NOTE [Max pooling: the kernel's values, derivatives through its indices]
# max_pool returns values and the indices of the chosen elements (flat positions within each
# (n, c) plane); torch's kernel computes both in one pass. Two primitives share that pass
# (NOTE [Kernels with two outputs]): max_pool gives the kernel's values, and keeps the
# indices for max_pool_indices, which is not differentiable. The derivatives go through the
# indices: the jvp gathers the tangent at them, the vjp scatter-adds the cotangent there
# (what max_pool2d_with_indices_backward computes, and what PyTorch's derivatives.yaml says),
# so the values are exactly the kernel's and every derivative is gather's or scatter-add's,
# whose own rules give the higher orders. Batching folds the batch into N. The outputs are
# made contiguous: for a channels-last input torch's kernel returns channels-last tensors,
# and a plain tensor that no level owns is shown to user code as a contiguous FuncTensor, so
# a view of it (torch's decomposition of the backward reshapes the indices) must be one.
def _max_pool_kernel(x, *, kernel_size, stride, padding, dilation, ceil_mode):
    # (NOTE [Kernels through torch's own bindings])
    if len(kernel_size) == 3:
        return torch._C._nn.max_pool3d_with_indices(x, kernel_size, stride, padding, dilation,
                                                    ceil_mode)
    if _pool_channels_last(x):
        x = x.contiguous(memory_format=torch.channels_last)
    return torch._C._nn.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation,
                                                ceil_mode)


def _pool_channels_last(x) -> bool:
    """NOTE [Max pooling on the CPU runs channels-last]
    torch's CPU kernel for 2-D max pooling of a contiguous (N, C, H, W) tensor walks one
    (H, W) plane at a time, a few microseconds each, and is not vectorized; its channels-last
    kernel vectorizes across C. With 8 channels or more and a few thousand elements per call
    the copy to channels-last plus that kernel take 0.25-0.6 of the time (torch 2.13, one
    thread: (64, 8, 26, 26) 2.4 ms against 0.8 ms), and a per-sample gradient folds the batch
    into N, so the calls are large. The values and the indices (flat positions within each
    (H, W) plane) do not depend on the layout: the results are bit-identical, and
    ``values_impl`` makes them contiguous again. Below 8 channels, or on small inputs, the
    copy costs more than it saves; the more channels, the more the vectorized kernel gains
    per element copied, and measured over 8 to 64 channels and 300 to 1.6M elements (2x2
    pooling) it is faster from about numel x channels = 200k on: (8, 16, 10, 10) 25 against
    42 us, (4, 16, 10, 10) 16 against 15. Other devices keep their own kernel choice, as does
    torch.compile (jit's inductor backend), which generates its own pooling loop: the two
    copies would only stand in its way (S10's compiled ensemble: 14.1 ms with them)."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.shape[1] >= 8
            and x.numel() * x.shape[1] >= 200_000 and x.is_contiguous()
            and not torch.compiler.is_compiling())


def _adaptive_max_pool_kernel(x, *, output_size):
    pool = aten.adaptive_max_pool2d if len(output_size) == 2 else aten.adaptive_max_pool3d
    return pool(x, output_size)


def _spatial_of(params):
    if "pad" in params:  # (a padding's pads come in pairs, one pair per spatial dim)
        return len(params["pad"]) // 2
    return len(params.get("kernel_size") or params.get("output_size"))


def _pool_batch(prim):
    """Pooling loops over every dim before (C, *spatial): the batch joins them."""
    def rule(values, bdims, **params):
        (x,), (bdim,) = values, bdims
        folded, lead, out_bdim = _fold_leading_at(x, bdim, _spatial_of(params) + 1)
        return _unfold_leading(bind(prim, folded, **params), lead), out_bdim
    return rule


def _flat_spatial(x, spatial):
    """x with its last ``spatial`` dims flattened into one."""
    shape = shape_of(x)
    return ops.reshape(x, *shape[:len(shape) - spatial], math.prod(shape[len(shape) - spatial:]))


def _gather_spatial(x, indices, spatial):
    """The values of x at flat spatial ``indices`` (max pooling's values)."""
    gathered = ops.gather(_flat_spatial(x, spatial), -1, _flat_spatial(indices, spatial))
    return ops.reshape(gathered, *shape_of(indices))


def _scatter_spatial(ct, indices, x_shape, spatial):
    """The transpose of ``_gather_spatial``: zeros of ``x_shape`` with ``ct`` added at the
    flat spatial ``indices`` (max pooling's vjp)."""
    return bind(max_pool_backward_p, ct, indices, x_shape=tuple(x_shape), spatial=spatial)


# NOTE [Max pooling's backward, one primitive]
# The vjp of max pooling adds each cotangent at its window's argmax: a scatter-add into the
# flattened spatial dims. Written with the general ops (two reshapes, scatter_add, a reshape
# back) it cost four binds under each level, and under vmap(grad) the pooling took about
# 80 us more than torch.func's (which calls max_pool2d_with_indices_backward). As one
# primitive it is one bind: a vmap joins its batch dim to the leading dims, and its
# derivatives are the gather it transposes (so higher orders still follow from gather's and
# scatter-add's rules), as in torch's derivatives.yaml for max_pool2d_with_indices_backward.
def _max_pool_backward_impl(ct, indices, *, x_shape, spatial):
    lead = x_shape[:len(x_shape) - spatial]
    summed = ct.new_zeros((*lead, math.prod(x_shape[len(x_shape) - spatial:])))
    # (the output's flattened size is given, not -1: with no examples, -1 is ambiguous)
    windows = math.prod(ct.shape[len(lead):])
    summed.scatter_add_(-1, indices.reshape(*lead, windows), ct.reshape(*lead, windows))
    return summed.view(x_shape)


max_pool_backward_p = P.primitive("max_pool_backward", _max_pool_backward_impl)


def max_pool_backward_batch(values, bdims, *, x_shape, spatial):
    b = batch_size(values, bdims)
    ct, indices = to_front(values, bdims, expand_unbatched=True, size=b)
    return bind(max_pool_backward_p, ct, indices, x_shape=(b, *x_shape), spatial=spatial), 0
batching_rules[max_pool_backward_p] = max_pool_backward_batch


def max_pool_backward_vjp(ct, indices, *, x_shape, spatial):
    out = bind(max_pool_backward_p, ct, indices, x_shape=x_shape, spatial=spatial)
    return out, lambda g: (_gather_spatial(g, indices, spatial), None)
vjp_rules[max_pool_backward_p] = max_pool_backward_vjp
jvp_rules[max_pool_backward_p] = linear_jvp(max_pool_backward_p)


def _max_pool_pair(name, kernel):
    """The values primitive and the indices primitive of one max pooling kernel, with their
    rules (NOTE [Max pooling: the kernel's values, derivatives through its indices])."""
    kept = _KeptOutput()

    def values_impl(x, **params):
        values, indices = kernel(x, **params)
        kept.keep(x, tuple(params.items()), indices.contiguous())
        return values.contiguous()

    def indices_impl(x, **params):
        indices = kept.take(x, tuple(params.items()))
        return indices if indices is not None else kernel(x, **params)[1].contiguous()

    values_p = P.primitive(name, values_impl)
    indices_p = P.primitive(f"{name}_indices", indices_impl, differentiable=False)

    def vjp(x, **params):
        out = bind(values_p, x, **params)
        indices = bind(indices_p, x, **params)  # at once: the kernel's kept indices
        x_shape = shape_of(x)
        return out, lambda ct: (_scatter_spatial(ct, indices, x_shape, _spatial_of(params)),)

    def jvp(primals, tangents, **params):
        (x,), (x_dot,) = primals, tangents
        out = bind(values_p, x, **params)
        indices = bind(indices_p, x, **params)
        return out, _gather_spatial(x_dot, indices, _spatial_of(params))

    vjp_rules[values_p] = vjp
    jvp_rules[values_p] = jvp
    batching_rules[values_p] = _pool_batch(values_p)
    batching_rules[indices_p] = _pool_batch(indices_p)
    return values_p, indices_p


max_pool_p, max_pool_indices_p = _max_pool_pair("max_pool", _max_pool_kernel)
adaptive_max_pool_p, adaptive_max_pool_indices_p = _max_pool_pair(
    "adaptive_max_pool", _adaptive_max_pool_kernel)


def _check_pool_input(op, x, spatial):
    rank = len(shape_of(x))
    if rank not in (spatial + 1, spatial + 2):
        raise ShapeMismatchError(
            f"{op}(input, ...): Expected {spatial + 1}D or {spatial + 2}D (batch mode) tensor "
            f"for input, but got:{list(shape_of(x))} (as in torch: (N,) C and {spatial} spatial "
            "dims). Fix: reshape the input."
        )
    _refuse_complex(op, x)


def _max_pool(op, spatial, x, kernel_size, stride, padding, dilation, ceil_mode,
              with_indices):
    """The values of max pooling over the last ``spatial`` dims, or (values, indices) (1d
    runs as 2d, with a height of 1, as torch does)."""
    _check_pool_input(op, x, spatial)
    kernel_size = _ntuple(kernel_size, spatial, "kernel_size", op)
    stride = kernel_size if stride is None or (not isinstance(stride, int) and not len(stride)) \
        else _ntuple(stride, spatial, "stride", op)
    padding = _ntuple(padding, spatial, "padding", op)
    dilation = _ntuple(dilation, spatial, "dilation", op)
    if spatial == 1:
        out = _max_pool("max_pool2d", 2, ops.unsqueeze(x, -2), (1, *kernel_size), (1, *stride),
                        (0, *padding), (1, *dilation), ceil_mode, with_indices)
        return tuple(ops.squeeze(o, -2) for o in out) if with_indices else ops.squeeze(out, -2)
    params = dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation,
                  ceil_mode=bool(ceil_mode))
    values = bind(max_pool_p, x, **params)
    return (values, bind(max_pool_indices_p, x, **params)) if with_indices else values


def _adaptive_output_size(op, spatial, output_size, in_spatial):
    """One output size per spatial dim (an int for all; None keeps the input's size), with
    torch's check of the count."""
    if isinstance(output_size, int):
        output_size = (output_size,) * spatial
    output_size = tuple(output_size)
    if len(output_size) != spatial:
        raise ShapeMismatchError(
            f"{op}(input, output_size={output_size}): output_size must be {spatial} (one size "
            f"per spatial dim, as torch checks), got {len(output_size)}. Fix: pass {spatial} "
            "sizes, or one int for all.")
    sizes = tuple(i if o is None else int(o) for o, i in zip(output_size, in_spatial))
    if any(size < 0 for size in sizes):
        raise ShapeMismatchError(
            f"{op}(input, output_size={output_size}): {op}: elements of output_size must be "
            "greater than or equal to 0 but received {" + ", ".join(map(str, sizes)) + "} (as "
            "in torch). Fix: pass sizes >= 0.")
    return sizes


def _adaptive_max_pool(op, spatial, x, output_size, with_indices):
    _check_pool_input(op, x, spatial)
    in_spatial = shape_of(x)[-spatial:]
    output_size = _adaptive_output_size(op, spatial, output_size, in_spatial)
    if spatial == 1:
        out = _adaptive_max_pool("adaptive_max_pool2d", 2, ops.unsqueeze(x, -2),
                                 (1, *output_size), with_indices)
        return tuple(ops.squeeze(o, -2) for o in out) if with_indices else ops.squeeze(out, -2)
    values = bind(adaptive_max_pool_p, x, output_size=output_size)
    if not with_indices:
        return values
    return values, bind(adaptive_max_pool_indices_p, x, output_size=output_size)


def _max_pool_front(spatial):
    name = f"max_pool{spatial}d"

    def max_pool(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                 return_indices=False):
        return _max_pool(name, spatial, x, kernel_size, stride, padding, dilation, ceil_mode,
                         bool(return_indices))

    def with_indices(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                     return_indices=True):
        return _max_pool(name, spatial, x, kernel_size, stride, padding, dilation, ceil_mode,
                         True)

    def adaptive(x, output_size, return_indices=False):
        return _adaptive_max_pool(f"adaptive_{name}", spatial, x, output_size,
                                  bool(return_indices))

    def adaptive_with_indices(x, output_size, return_indices=True):
        return _adaptive_max_pool(f"adaptive_{name}", spatial, x, output_size, True)

    return max_pool, with_indices, adaptive, adaptive_with_indices


for _n in (1, 2, 3):
    _max, _max_indices, _adaptive, _adaptive_indices = _max_pool_front(_n)
    torch_api.register(getattr(F, f"max_pool{_n}d"), getattr(torch, f"max_pool{_n}d"))(_max)
    torch_api.register(getattr(F, f"max_pool{_n}d_with_indices"),
                       getattr(torch, f"max_pool{_n}d_with_indices", None) or
                       getattr(F, f"max_pool{_n}d_with_indices"))(_max_indices)
    torch_api.register(getattr(F, f"adaptive_max_pool{_n}d"))(_adaptive)
    torch_api.register(getattr(F, f"adaptive_max_pool{_n}d_with_indices"))(_adaptive_indices)
    if _n > 1:
        aten_api.register(getattr(aten, f"max_pool{_n}d_with_indices").default)(_max_indices)
        aten_api.register(getattr(aten, f"adaptive_max_pool{_n}d").default)(_adaptive_indices)
aten_api.register(aten.max_pool1d_with_indices.default)(_max_pool_front(1)[1])
aten_api.register(aten.adaptive_max_pool1d.default)(_max_pool_front(1)[3])


def _max_pool_backward_door(spatial):
    """aten.max_pool{2,3}d_with_indices_backward: the cotangent added at the indices (the
    vjp of max pooling); its derivative with respect to the input is zero, as in torch."""
    def backward(ct, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _scatter_spatial(ct, indices, shape_of(x), spatial)
    return backward


for _n in (2, 3):
    aten_api.register(getattr(aten, f"max_pool{_n}d_with_indices_backward").default)(
        _max_pool_backward_door(_n))


# --- pooling: fractional max pooling -------------------------------------------------------------
# NOTE [Fractional max pooling: random windows given as a tensor]
# fractional_max_pool{2,3}d picks pseudo-random window edges from ``random_samples``, an
# (N, C, spatial) tensor of numbers in [0, 1) that F.fractional_max_pool draws with
# torch.rand (under vmap, randomness.py decides what that draw is) and hands to the kernel.
# So the kernel is a deterministic function of (input, samples), and it is max pooling
# otherwise: as for max_pool (NOTE [Max pooling: the kernel's values, derivatives through
# its indices]) the kernel's values are one primitive and its indices (flat positions
# within each plane) a non-differentiable one sharing the same pass; the jvp gathers the
# tangent at the indices and the vjp scatter-adds the cotangent there, which is what
# derivatives.yaml's fractional_max_pool2d_backward computes. The samples are not
# differentiable (they only choose windows). Batching folds the batch into N, for the input
# and for the samples (an unbatched samples tensor is expanded along the batch: every example
# uses the same windows, as each example's own call would).
def _fractional_max_pool_kernel(x, samples, *, kernel_size, output_size):
    pool = aten.fractional_max_pool2d if len(kernel_size) == 2 else aten.fractional_max_pool3d
    return pool(x, kernel_size, output_size, samples)


def _fractional_key(samples, params):
    return (tuple(params.items()), tuple(samples.shape), samples.data_ptr(), samples._version)


_fractional_kept = _KeptOutput()


def _fractional_values_impl(x, samples, **params):
    values, indices = _fractional_max_pool_kernel(x, samples, **params)
    if samples.device.type != "meta":
        _fractional_kept.keep(x, _fractional_key(samples, params), indices.contiguous())
    return values.contiguous()


def _fractional_indices_impl(x, samples, **params):
    indices = None
    if samples.device.type != "meta":
        indices = _fractional_kept.take(x, _fractional_key(samples, params))
    if indices is None:
        indices = _fractional_max_pool_kernel(x, samples, **params)[1].contiguous()
    return indices


fractional_max_pool_p = P.primitive("fractional_max_pool", _fractional_values_impl)
fractional_max_pool_indices_p = P.primitive("fractional_max_pool_indices",
                                            _fractional_indices_impl, differentiable=False)


def fractional_max_pool_vjp(x, samples, **params):
    out = bind(fractional_max_pool_p, x, samples, **params)
    indices = bind(fractional_max_pool_indices_p, x, samples, **params)  # the kept indices
    x_shape = shape_of(x)
    spatial = len(params["kernel_size"])
    return out, lambda ct: (_scatter_spatial(ct, indices, x_shape, spatial), None)


vjp_rules[fractional_max_pool_p] = fractional_max_pool_vjp


def fractional_max_pool_jvp(primals, tangents, **params):
    (x, samples), (x_dot, _) = primals, tangents
    out = bind(fractional_max_pool_p, x, samples, **params)
    if x_dot is None:
        return out, None
    indices = bind(fractional_max_pool_indices_p, x, samples, **params)
    return out, _gather_spatial(x_dot, indices, len(params["kernel_size"]))


jvp_rules[fractional_max_pool_p] = fractional_max_pool_jvp


def _fractional_batch(prim):
    def rule(values, bdims, **params):
        (x, samples), (x_bdim, s_bdim) = values, bdims
        size = batch_size(values, bdims)
        keep = len(params["kernel_size"]) + 1
        if x_bdim is None:
            x = ops.expand(ops.unsqueeze(x, 0), size, *shape_of(x))
        else:
            x = _front(x, x_bdim)
        if s_bdim is None:
            samples = ops.expand(ops.unsqueeze(samples, 0), size, *shape_of(samples))
        else:
            samples = _front(samples, s_bdim)
        lead = shape_of(x)[:len(shape_of(x)) - keep]
        per_example = math.prod(lead[1:])  # the kernel reads one row of samples per plane
        if shape_of(samples)[1] != per_example:
            samples = ops.getitem(samples, (slice(None), slice(0, per_example)))
        samples = ops.reshape(samples, -1, *shape_of(samples)[2:])
        out = bind(prim, _fold_leading(x, keep), samples, **params)
        return _unfold_leading(out, lead), 0
    return rule


batching_rules[fractional_max_pool_p] = _fractional_batch(fractional_max_pool_p)
batching_rules[fractional_max_pool_indices_p] = _fractional_batch(fractional_max_pool_indices_p)


def _fractional_door(spatial):
    name = f"fractional_max_pool{spatial}d"

    def fractional_max_pool(x, kernel_size, output_size, random_samples):
        _check_pool_input(name, x, spatial)
        params = dict(kernel_size=_ntuple(kernel_size, spatial, "kernel_size", name),
                      output_size=_ntuple(output_size, spatial, "output_size", name))
        return (bind(fractional_max_pool_p, x, random_samples, **params),
                bind(fractional_max_pool_indices_p, x, random_samples, **params))

    def backward(ct, x, kernel_size, output_size, indices):
        return _scatter_spatial(ct, indices, shape_of(x), spatial)
    return fractional_max_pool, backward


for _n in (2, 3):
    _forward, _backward = _fractional_door(_n)
    aten_api.register(getattr(aten, f"fractional_max_pool{_n}d").default)(_forward)
    aten_api.register(getattr(aten, f"fractional_max_pool{_n}d_backward").default)(_backward)


# --- ctc_loss ------------------------------------------------------------------------------------
# NOTE [CTC loss: torch's kernels as primitives]
# The CTC loss is a dynamic program (the forward variables alpha over time and target
# positions) that torch runs in one kernel, ``aten._ctc_loss``, returning the negative log
# likelihood of each sequence and the table log_alpha; ``aten._ctc_loss_backward`` runs the
# backward variables and turns both into the gradient with respect to log_probs. torch.func
# runs exactly these two kernels, so they are primitives here, and the vjp is bit-exact
# with torch.func's: the loss, and the backward kernel, which takes the table log_alpha that
# the loss's kernel kept from the same pass (NOTE [Kernels with two outputs]; computed again
# if it is gone). log_alpha's shape depends on the data (its last dim is twice the longest
# target plus one), so it is no argument of a primitive that a derivative goes through:
# ``ctc_loss_alpha``, a non-differentiable primitive, gives it only where the aten op's
# second output is asked for (F.ctc_loss drops it), and has no shape rule on meta tensors;
# under vmap its last dim is the longest target of the whole batch (-inf beyond each
# example's own).
# - vjp: the backward kernel on the cotangent. The targets and lengths are integers.
# - jvp (torch has none: torch.func's jvp refuses): each loss depends only on its own
#   sequence, and the backward kernel is linear in the cotangent, so the backward kernel on a
#   cotangent of ones gives every loss's gradient at once, G (T, N, C); the tangent of loss n
#   is sum over t, c of G[t, n, c] * log_probs_dot[t, n, c].
# - the backward kernel is linear in its cotangent (that is its vjp and jvp in that
#   argument: the same one-hot contraction); torch has no derivative of it with respect to
#   log_probs (derivatives.yaml: not implemented), nor do we: a second derivative of the loss
#   with respect to log_probs is refused, as torch.func refuses it.
# - vmap: examples become sequences. log_probs (T, N, C), per-sequence tensors (N, ...): the
#   batch dim is merged into N, one kernel call for the whole batch, and the result split
#   again (an unbatched argument is expanded). 1-D targets (every sequence's targets
#   concatenated) cannot simply be concatenated across examples (each example's targets
#   start at its own offsets, and its lengths need not add up to the same total), so they are
#   first laid out padded, one row per sequence (a gather at each sequence's offset): the
#   kernels read the same labels either way.
def _geometry(t):
    return (tuple(t.shape), t.stride(), t.data_ptr(), t._version) if t.device.type != "meta" \
        else None


_ctc_kept = _KeptOutput()


def _ctc_key(targets, input_lengths, target_lengths, params):
    return (tuple(params.items()), _geometry(targets), _geometry(input_lengths),
            _geometry(target_lengths))


def _ctc_impl(log_probs, targets, input_lengths, target_lengths, *, blank, zero_infinity):
    nll, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths,
                                           blank, zero_infinity)
    _ctc_kept.keep(log_probs, _ctc_key(targets, input_lengths, target_lengths,
                                       dict(blank=blank, zero_infinity=zero_infinity)),
                   log_alpha)
    return nll


def _ctc_impl_or_shape(log_probs, targets, input_lengths, target_lengths, *, blank,
                       zero_infinity):
    if log_probs.device.type == "meta":  # the shape rule: one loss per sequence
        return log_probs.new_empty(log_probs.shape[1:2])
    return _ctc_impl(log_probs, targets, input_lengths, target_lengths, blank=blank,
                     zero_infinity=zero_infinity)


def _ctc_alpha_impl(log_probs, targets, input_lengths, target_lengths, *, blank,
                    zero_infinity):
    log_alpha = None
    if log_probs.device.type != "meta":
        log_alpha = _ctc_kept.take(log_probs, _ctc_key(
            targets, input_lengths, target_lengths,
            dict(blank=blank, zero_infinity=zero_infinity)))
    if log_alpha is None:  # (on meta tensors torch raises: the shape depends on the data)
        log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths,
                                          blank, zero_infinity)[1]
    return log_alpha


def _ctc_backward_impl(grad, log_probs, targets, input_lengths, target_lengths, nll, *, blank,
                       zero_infinity):
    if log_probs.device.type == "meta":  # the shape rule
        return torch.empty_like(log_probs)
    log_alpha = _ctc_alpha_impl(log_probs, targets, input_lengths, target_lengths, blank=blank,
                                zero_infinity=zero_infinity)
    return aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths,
                                          target_lengths, nll, log_alpha, blank, zero_infinity)


ctc_loss_p = P.primitive("ctc_loss", _ctc_impl_or_shape)
ctc_loss_alpha_p = P.primitive("ctc_loss_alpha", _ctc_alpha_impl, differentiable=False)
ctc_loss_backward_p = P.primitive("ctc_loss_backward", _ctc_backward_impl)


def _refuse_ctc_second_order(op):
    raise MissingRuleError(
        f"{op}: the derivative of ctc_loss's backward with respect to log_probs is not "
        "implemented (torch has none either: torch.func raises 'derivative for "
        "aten::_ctc_loss_backward is not implemented'). Expected a first derivative of "
        "ctc_loss, got a second one. Fix: differentiate ctc_loss once (grad, vjp, jvp, "
        "jacrev or jacfwd), not twice.")


def ctc_loss_vjp(log_probs, targets, input_lengths, target_lengths, **params):
    nll = bind(ctc_loss_p, log_probs, targets, input_lengths, target_lengths, **params)

    def backward(ct):
        ct_log_probs = bind(ctc_loss_backward_p, ct, log_probs, targets, input_lengths,
                            target_lengths, nll, **params)
        return ct_log_probs, None, None, None
    return nll, backward


vjp_rules[ctc_loss_p] = ctc_loss_vjp


def _ctc_unit_gradient(log_probs, targets, input_lengths, target_lengths, nll, params):
    """Every loss's gradient with respect to its own sequence of log_probs: (T, N, C)."""
    return bind(ctc_loss_backward_p, ops.full_like(nll, 1.0), log_probs, targets,
                input_lengths, target_lengths, nll, **params)


def ctc_loss_jvp(primals, tangents, **params):
    (log_probs, targets, input_lengths, target_lengths), (lp_dot, *_) = primals, tangents
    nll = bind(ctc_loss_p, log_probs, targets, input_lengths, target_lengths, **params)
    if lp_dot is None:
        return nll, None
    unit = _ctc_unit_gradient(log_probs, targets, input_lengths, target_lengths, nll, params)
    return nll, ops.sum(ops.mul(unit, lp_dot), (0, 2))


jvp_rules[ctc_loss_p] = ctc_loss_jvp


def ctc_loss_backward_vjp(grad, log_probs, targets, input_lengths, target_lengths, nll,
                          **params):
    rest = (log_probs, targets, input_lengths, target_lengths, nll)
    out = bind(ctc_loss_backward_p, grad, *rest, **params)

    def backward(ct):
        if wants_cotangent(1, log_probs) or wants_cotangent(5, nll):
            _refuse_ctc_second_order("vjp of ctc_loss's backward")
        ct_grad = None
        if wants_cotangent(0, grad):
            unit = _ctc_unit_gradient(*rest, params)
            ct_grad = ops.sum(ops.mul(ct, unit), (0, 2))
        return (ct_grad,) + (None,) * 5
    return out, backward


vjp_rules[ctc_loss_backward_p] = ctc_loss_backward_vjp


# the backward kernel is linear in the output's cotangent (its only non-integer argument
# besides log_probs and the loss, whose derivatives torch does not have)
jvp_rules[ctc_loss_backward_p] = linear_jvp(
    ctc_loss_backward_p,
    refuse_others=lambda: _refuse_ctc_second_order("jvp of ctc_loss's backward"))


def _merge_batch(x, bdim, size, at):
    """A per-sequence argument with the vmap batch merged into its sequence dim ``at``:
    (..., B, N, ...) -> (..., B * N, ...) (an unbatched one is expanded first)."""
    if bdim is None:
        x = ops.unsqueeze(x, at)
        shape = list(shape_of(x))
        shape[at] = size
        x = ops.expand(x, *shape)
    else:
        x = move_bdim(x, bdim, at)
    shape = shape_of(x)
    return ops.reshape(x, *shape[:at], shape[at] * shape[at + 1], *shape[at + 2:])


def _padded_targets(targets, t_bdim, target_lengths, l_bdim, size):
    """Concatenated targets (B, L), one row per example, laid out padded (B, N, L): row n
    holds sequence n's labels from its offset on (NOTE [CTC loss: torch's kernels as
    primitives])."""
    targets = _merge_batch(targets, t_bdim, size, 0)  # (B * L,)
    targets = ops.reshape(targets, size, -1)
    lengths = ops.reshape(_merge_batch(target_lengths, l_bdim, size, 0), size, -1)
    total, n = shape_of(targets)[1], shape_of(lengths)[1]
    if total == 0:
        return ops.reshape(ops.expand(ops.unsqueeze(targets, 1), size, n, 0), size * n, 0)
    ends = bind(structural.cumsum_p, lengths, dim=1)
    starts = ops.sub(ends, lengths)
    positions = ops.add(ops.unsqueeze(starts, -1),
                        torch.arange(total, device=targets.device, dtype=lengths.dtype))
    positions = ops.where(ops.lt(positions, total), positions, total - 1)
    rows = ops.gather(ops.expand(ops.unsqueeze(targets, 1), size, n, total), 2,
                      ops.convert(positions, torch.int64))
    return ops.reshape(rows, size * n, total)


def _ctc_fold(values, bdims, size):
    """The four arguments of the CTC kernels with the batch merged into N, and N."""
    (log_probs, targets, input_lengths, target_lengths), (lp_b, t_b, il_b, tl_b) = values, bdims
    n = shape_of(log_probs)[1 + (lp_b is not None and lp_b <= 1)]
    if len(shape_of(targets)) - (t_b is not None) == 1:
        targets = _padded_targets(targets, t_b, target_lengths, tl_b, size)
    else:
        targets = _merge_batch(targets, t_b, size, 0)
    return (_merge_batch(log_probs, lp_b, size, 1), targets,
            _merge_batch(input_lengths, il_b, size, 0),
            _merge_batch(target_lengths, tl_b, size, 0)), n


def _split_batch(x, at, size, n):
    shape = shape_of(x)
    return ops.reshape(x, *shape[:at], size, n, *shape[at + 1:])


def ctc_loss_batch(values, bdims, **params):
    size = batch_size(values, bdims)
    args, n = _ctc_fold(values, bdims, size)
    return _split_batch(bind(ctc_loss_p, *args, **params), 0, size, n), 0


def ctc_loss_alpha_batch(values, bdims, **params):
    size = batch_size(values, bdims)
    args, n = _ctc_fold(values, bdims, size)
    return _split_batch(bind(ctc_loss_alpha_p, *args, **params), 0, size, n), 0


def ctc_loss_backward_batch(values, bdims, **params):
    (grad, *four, nll), (g_b, *four_b, nll_b) = values, bdims
    size = batch_size(values, bdims)
    args, n = _ctc_fold(four, four_b, size)
    out = bind(ctc_loss_backward_p, _merge_batch(grad, g_b, size, 0), *args,
               _merge_batch(nll, nll_b, size, 0), **params)
    return _split_batch(out, 1, size, n), 1


batching_rules[ctc_loss_p] = ctc_loss_batch
batching_rules[ctc_loss_alpha_p] = ctc_loss_alpha_batch
batching_rules[ctc_loss_backward_p] = ctc_loss_backward_batch


def _lengths(lengths, like):
    """Sequence lengths as a 1-D int64 tensor (the int-list overloads pass Python lists)."""
    if not _is_tensor(lengths):
        return torch.tensor(list(lengths), dtype=torch.int64, device=like.device)
    return ops.reshape(lengths, -1) if len(shape_of(lengths)) == 0 else lengths


@aten_api.register(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    _refuse_complex("ctc_loss", log_probs)
    input_lengths = _lengths(input_lengths, targets)
    target_lengths = _lengths(target_lengths, targets)
    params = dict(blank=int(blank), zero_infinity=bool(zero_infinity))
    return (bind(ctc_loss_p, log_probs, targets, input_lengths, target_lengths, **params),
            bind(ctc_loss_alpha_p, log_probs, targets, input_lengths, target_lengths, **params))


@aten_api.register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll,
                       log_alpha, blank, zero_infinity=False):
    """(log_alpha is the kernel's own table for these arguments: the primitive reads it
    from the kept output of the forward kernel, or computes it again.)"""
    return bind(ctc_loss_backward_p, grad, log_probs, targets, _lengths(input_lengths, targets),
                _lengths(target_lengths, targets), nll, blank=int(blank),
                zero_infinity=bool(zero_infinity))


def _max_unpool(op, spatial, x, indices, kernel_size, stride, padding, output_size):
    """The inverse of max pooling: zeros, with each value written at its index (a flat
    position within its (n, c) plane): a scatter, whose vjp is a gather (the indexing
    family's; an index named twice keeps its last value, as torch's kernel does)."""
    _refuse_complex(op, x)
    if shape_of(indices) != shape_of(x):
        raise ShapeMismatchError(
            f"{op}(input, indices, ...): Expected shape of indices to be same as that of the "
            f"input tensor ({list(shape_of(x))}) but got indices tensor with shape: "
            f"{list(shape_of(indices))} (as torch checks). Fix: pass the indices that max "
            "pooling returned with this input.")
    kernel_size = _ntuple(kernel_size, spatial, "kernel_size", op)
    stride = kernel_size if stride is None else _ntuple(stride, spatial, "stride", op)
    padding = _ntuple(padding, spatial, "padding", op)
    in_sizes = shape_of(x)[-spatial:]
    if output_size is None:
        output_size = [(i - 1) * s - 2 * p + k for i, s, p, k in
                       zip(in_sizes, stride, padding, kernel_size)]
    output_size = tuple(int(o) for o in tuple(output_size)[-spatial:])
    lead = shape_of(x)[:len(shape_of(x)) - spatial]
    zeros = torch.zeros((*lead, math.prod(output_size)), dtype=x.dtype, device=x.device)
    flat = indexing.scatter(zeros, -1, ops.reshape(indices, *lead, -1), ops.reshape(x, *lead, -1))
    return ops.reshape(flat, *lead, *output_size)


for _n in (1, 2, 3):
    torch_api.register(getattr(F, f"max_unpool{_n}d"))(
        (lambda n: lambda x, indices, kernel_size, stride=None, padding=0, output_size=None:
         _max_unpool(f"max_unpool{n}d", n, x, indices, kernel_size, stride, padding,
                     output_size))(_n))
aten_api.register(aten.max_unpool2d.default)(
    lambda x, indices, output_size: _max_unpool("max_unpool2d", 2, x, indices, 1, 1, 0,
                                                output_size))
aten_api.register(aten.max_unpool3d.default)(
    lambda x, indices, output_size, stride, padding: _max_unpool(
        "max_unpool3d", 3, x, indices, 1, 1, 0, output_size))


# --- pooling: average pooling --------------------------------------------------------------------
def _avg_pool_impl(x, *, kernel_size, stride, padding, ceil_mode, count_include_pad,
                   divisor_override):
    pool = torch._C._nn.avg_pool2d if len(kernel_size) == 2 else torch._C._nn.avg_pool3d
    return pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _avg_pool_backward_impl(ct, x, *, kernel_size, stride, padding, ceil_mode,
                            count_include_pad, divisor_override):
    pool = aten.avg_pool2d_backward if len(kernel_size) == 2 else aten.avg_pool3d_backward
    return pool(ct, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                divisor_override)


def _adaptive_avg_pool_impl(x, *, output_size):
    pool = torch._adaptive_avg_pool2d if len(output_size) == 2 else torch._adaptive_avg_pool3d
    return pool(x, output_size)


def _adaptive_avg_pool_backward_impl(ct, x, *, output_size):
    pool = aten._adaptive_avg_pool2d_backward if len(output_size) == 2 else \
        aten._adaptive_avg_pool3d_backward
    return pool(ct, x)


avg_pool_p, avg_pool_backward_p = _linear_pair("avg_pool", _avg_pool_impl,
                                               _avg_pool_backward_impl)
adaptive_avg_pool_p, adaptive_avg_pool_backward_p = _linear_pair(
    "adaptive_avg_pool", _adaptive_avg_pool_impl, _adaptive_avg_pool_backward_impl)


def _avg_pool(op, spatial, x, kernel_size, stride=None, padding=0, ceil_mode=False,
              count_include_pad=True, divisor_override=None):
    _check_pool_input(op, x, spatial)
    kernel_size = _ntuple(kernel_size, spatial, "kernel_size", op)
    stride = kernel_size if stride is None or (not isinstance(stride, int) and not len(stride)) \
        else _ntuple(stride, spatial, "stride", op)
    padding = _ntuple(padding, spatial, "padding", op)
    if spatial == 1:  # torch runs avg_pool1d as avg_pool2d with a height of 1
        out = _avg_pool("avg_pool2d", 2, ops.unsqueeze(x, -2), (1, *kernel_size), (1, *stride),
                        (0, *padding), ceil_mode, count_include_pad, divisor_override)
        return ops.squeeze(out, -2)
    return bind(avg_pool_p, x, kernel_size=kernel_size, stride=stride, padding=padding,
                ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad),
                divisor_override=None if divisor_override is None else int(divisor_override))


def _adaptive_avg_pool(op, spatial, x, output_size):
    _check_pool_input(op, x, spatial)
    in_spatial = shape_of(x)[-spatial:]
    output_size = _adaptive_output_size(op, spatial, output_size, in_spatial)
    if spatial == 1:
        out = _adaptive_avg_pool("adaptive_avg_pool2d", 2, ops.unsqueeze(x, -2),
                                 (1, *output_size))
        return ops.squeeze(out, -2)
    if all(o == 1 for o in output_size):
        # torch's adaptive_avg_pool2d/3d compute a 1x1 output as a mean, and so do we
        return ops.mean(x, tuple(range(-spatial, 0)), keepdim=True)
    return bind(adaptive_avg_pool_p, x, output_size=output_size)


def _avg_pool_front(spatial):
    name = f"avg_pool{spatial}d"

    def avg_pool(x, kernel_size, stride=None, padding=0, ceil_mode=False,
                 count_include_pad=True, divisor_override=None):
        return _avg_pool(name, spatial, x, kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override)

    def adaptive(x, output_size):
        return _adaptive_avg_pool(f"adaptive_{name}", spatial, x, output_size)
    return avg_pool, adaptive


for _n in (1, 2, 3):
    _avg, _adaptive = _avg_pool_front(_n)
    torch_api.register(getattr(F, f"avg_pool{_n}d"), getattr(torch, f"avg_pool{_n}d", None) or
                       getattr(F, f"avg_pool{_n}d"))(_avg)
    aten_api.register(getattr(aten, f"avg_pool{_n}d").default)(_avg)
    torch_api.register(getattr(F, f"adaptive_avg_pool{_n}d"),
                       getattr(torch, f"adaptive_avg_pool{_n}d", None) or
                       getattr(F, f"adaptive_avg_pool{_n}d"))(_adaptive)
    aten_api.register(getattr(aten, f"adaptive_avg_pool{_n}d").default)(_adaptive)
aten_api.register(aten._adaptive_avg_pool2d.default)(
    lambda x, output_size: _adaptive_avg_pool("_adaptive_avg_pool2d", 2, x, output_size))
aten_api.register(aten._adaptive_avg_pool3d.default)(
    lambda x, output_size: _adaptive_avg_pool("_adaptive_avg_pool3d", 3, x, output_size))


def _avg_pool_backward_door(spatial):
    """aten.avg_pool{2,3}d_backward: the input is read for its shape only."""
    def door(ct, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
             divisor_override):
        op = f"avg_pool{spatial}d_backward"
        return bind(avg_pool_backward_p, ct, input_shape=shape_of(x),
                    kernel_size=_ntuple(kernel_size, spatial, "kernel_size", op),
                    stride=_ntuple(stride or kernel_size, spatial, "stride", op),
                    padding=_ntuple(padding, spatial, "padding", op),
                    ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad),
                    divisor_override=divisor_override)
    return door


for _n in (2, 3):
    aten_api.register(getattr(aten, f"avg_pool{_n}d_backward").default)(
        _avg_pool_backward_door(_n))


def _adaptive_avg_pool_backward_door(spatial):
    def door(ct, x):
        return bind(adaptive_avg_pool_backward_p, ct, input_shape=shape_of(x),
                    output_size=tuple(shape_of(ct)[-spatial:]))
    return door


aten_api.register(aten._adaptive_avg_pool2d_backward.default)(_adaptive_avg_pool_backward_door(2))
aten_api.register(aten._adaptive_avg_pool3d_backward.default)(_adaptive_avg_pool_backward_door(3))


# --- normalization: batch norm -------------------------------------------------------------------
# NOTE [Batch norm: the fused kernels as primitives]
# torch.func runs native_batch_norm forward and native_batch_norm_backward, so these kernels
# are primitives here too, one per output (a primitive returns one tensor):
# - batch_norm_train(x, w, b) and batch_norm_eval(x, w, b, running_mean, running_var): the
#   output;
# - batch_norm_stats(x): the saved mean and inverse standard deviation, stacked as (2, C).
#   They are differentiable (a mean, and (var + eps)^-1/2), because the backward reads them:
#   a second derivative flows through them back to x;
# - batch_norm_backward_input and batch_norm_backward_params (grad_weight and grad_bias,
#   stacked as (2, C)), outputs of native_batch_norm_backward. Their own derivatives (second
#   order) are those of torch's Python decomposition of native_batch_norm_backward
#   (torch._decomp), differentiated by the engine itself: an exact formula, written once by
#   PyTorch, in the same ops as everything else.
# The running statistics are not part of any of this: they are buffers that training mode
# updates in place with the batch statistics, outside of autograd (NOTE [Running statistics]).
_kept_statistics = _KeptOutput()


def _bn_train(x, weight, bias, *, eps):
    """The output; the statistics the kernel also computes are kept for batch_norm_stats
    (NOTE [Kernels with two outputs])."""
    out, mean, invstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)
    _kept_statistics.keep(x, eps, (mean, invstd))
    return out


def _bn_eval(x, weight, bias, running_mean, running_var, *, eps):
    return torch.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.0,
                                  eps)[0]


def _bn_stats_pair(x, eps):
    """(mean, invstd) of a plain tensor: the forward kernel's, kept, or computed again."""
    kept = _kept_statistics.take(x, eps)
    if kept is not None:
        return kept
    return torch.native_batch_norm(x, None, None, None, None, True, 0.0, eps)[1:]


def _bn_stats(x, *, eps):
    return torch.stack(_bn_stats_pair(x, eps))


def _bn_backward_arguments(x, weight, stat0, stat1, training):
    """native_batch_norm_backward's statistics arguments: the saved mean and invstd in
    training mode, the running mean and variance in eval mode."""
    if training:
        return (weight, None, None, stat0, stat1)
    return (weight, stat0, stat1, None, None)


def _bn_backward_input(ct, x, weight, stat0, stat1, *, training, eps):
    return aten.native_batch_norm_backward(
        ct, x, *_bn_backward_arguments(x, weight, stat0, stat1, training), training, eps,
        [True, False, False])[0]


def _bn_backward_params(ct, x, stat0, stat1, *, training, eps):
    # grad_weight and grad_bias do not depend on the weight, but torch's own derivative of
    # this kernel (an outer .backward() through it, as in MAML) needs a defined one: ones
    ones = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    _, grad_weight, grad_bias = aten.native_batch_norm_backward(
        ct, x, *_bn_backward_arguments(x, ones, stat0, stat1, training), training, eps,
        [False, True, True])
    return torch.stack([grad_weight, grad_bias])


batch_norm_train_p = P.primitive("batch_norm_train", _bn_train)
batch_norm_eval_p = P.primitive("batch_norm_eval", _bn_eval)
batch_norm_stats_p = P.primitive("batch_norm_stats", _bn_stats)
batch_norm_backward_input_p = P.primitive("batch_norm_backward_input", _bn_backward_input)
batch_norm_backward_params_p = P.primitive("batch_norm_backward_params", _bn_backward_params)


def _reduced_dims(x):
    """Every dim of an (N, C, *spatial) tensor but the channels."""
    return (0, *range(2, len(shape_of(x))))


def _mean_and_rstd(stats):
    """The two statistics that a *_stats primitive (batch, layer or group norm) stacks, or
    the two halves of their cotangent, stacked the same way.

    NOTE [Statistics of a plain tensor: the kernel's pair]
    A primitive has one output, so the *_stats primitives stack the two statistics, and the
    rules split them again: a stack and two selects, three binds, each a few microseconds of
    a norm's grad (a tenth of layer norm's). On a plain tensor (the backward pass of a first
    derivative) no level records the statistics, so the rules take the kernel's pair as it
    is (``_*_stats_pair``); a level's value still goes through the primitive."""
    return ops.getitem(stats, 0), ops.getitem(stats, 1)


def _bn_statistics(x, eps):
    if type(x) is torch.Tensor:  # NOTE [Statistics of a plain tensor: the kernel's pair]
        return _bn_stats_pair(x, eps)
    return _mean_and_rstd(bind(batch_norm_stats_p, x, eps=eps))


def _refuse_running_stat_derivative(op):
    raise MissingRuleError(
        f"{op}: batch_norm is not differentiable with respect to running_mean or "
        "running_var (statistics that training updates outside of autograd), as in torch. "
        "Fix: pass them as plain tensors, not as inputs to differentiate."
    )


def batch_norm_train_vjp(x, weight, bias, *, eps):
    out = bind(batch_norm_train_p, x, weight, bias, eps=eps)
    mean, invstd = _bn_statistics(x, eps)  # at once (NOTE [Kernels with two outputs])

    def backward(ct):
        x_bar = w_bar = b_bar = None
        if wants_cotangent(0, x):
            x_bar = bind(batch_norm_backward_input_p, ct, x, weight, mean, invstd,
                         training=True, eps=eps)
        want_w = weight is not None and wants_cotangent(1, weight)
        want_b = bias is not None and wants_cotangent(2, bias)
        if want_w or want_b:
            params = bind(batch_norm_backward_params_p, ct, x, mean, invstd, training=True,
                          eps=eps)
            w_bar = ops.getitem(params, 0) if want_w else None
            b_bar = ops.getitem(params, 1) if want_b else None
        return x_bar, w_bar, b_bar
    return out, backward
vjp_rules[batch_norm_train_p] = batch_norm_train_vjp


def batch_norm_eval_vjp(x, weight, bias, running_mean, running_var, *, eps):
    out = bind(batch_norm_eval_p, x, weight, bias, running_mean, running_var, eps=eps)

    def backward(ct):
        if wants_cotangent(3, running_mean) or wants_cotangent(4, running_var):
            _refuse_running_stat_derivative("grad(batch_norm)")
        x_bar = w_bar = b_bar = None
        if wants_cotangent(0, x):
            x_bar = bind(batch_norm_backward_input_p, ct, x, weight, running_mean, running_var,
                         training=False, eps=eps)
        want_w = weight is not None and wants_cotangent(1, weight)
        want_b = bias is not None and wants_cotangent(2, bias)
        if want_w or want_b:
            params = bind(batch_norm_backward_params_p, ct, x, running_mean, running_var,
                          training=False, eps=eps)
            w_bar = ops.getitem(params, 0) if want_w else None
            b_bar = ops.getitem(params, 1) if want_b else None
        return x_bar, w_bar, b_bar, None, None
    return out, backward
vjp_rules[batch_norm_eval_p] = batch_norm_eval_vjp


def _affine_tangent(out_dot, x_hat, weight, w_dot, b_dot, rank):
    """The tangent of x_hat * w + b, given the tangent of x_hat (or None)."""
    if out_dot is not None and weight is not None:
        out_dot = ops.mul(out_dot, _channel_view(weight, rank))
    if w_dot is not None:
        out_dot = add_tangents(out_dot, ops.mul(x_hat, _channel_view(w_dot, rank)))
    if b_dot is not None:
        b_term = _channel_view(b_dot, rank)
        out_dot = ops.add(b_term, ops.zeros_like(x_hat)) if out_dot is None else \
            ops.add(out_dot, b_term)
    return out_dot


def batch_norm_train_jvp(primals, tangents, *, eps):
    """With x_hat = (x - mean) * invstd, the tangent of x_hat is
    invstd * (x_dot - mean(x_dot) - x_hat * mean(x_hat * x_dot)) (the means over N and
    space), and the affine part adds x_hat * w_dot + b_dot: FunctionsManual's batch_norm_jvp."""
    (x, weight, bias), (x_dot, w_dot, b_dot) = primals, tangents
    out = bind(batch_norm_train_p, x, weight, bias, eps=eps)
    rank, dims = len(shape_of(x)), _reduced_dims(x)
    mean, invstd = _bn_statistics(x, eps)
    invstd = _channel_view(invstd, rank)
    x_hat = ops.mul(ops.sub(x, _channel_view(mean, rank)), invstd)
    x_hat_dot = None
    if x_dot is not None:
        centered = ops.sub(x_dot, ops.mean(x_dot, dims, keepdim=True))
        projection = ops.mul(x_hat, ops.mean(ops.mul(x_hat, x_dot), dims, keepdim=True))
        x_hat_dot = ops.mul(ops.sub(centered, projection), invstd)
    return out, _affine_tangent(x_hat_dot, x_hat, weight, w_dot, b_dot, rank)
jvp_rules[batch_norm_train_p] = batch_norm_train_jvp


def batch_norm_eval_jvp(primals, tangents, *, eps):
    """Eval mode is an affine map of x; like torch.func, the tangents of the running
    statistics are ignored."""
    (x, weight, bias, running_mean, running_var), (x_dot, w_dot, b_dot, _, _) = primals, tangents
    out = bind(batch_norm_eval_p, x, weight, bias, running_mean, running_var, eps=eps)
    rank = len(shape_of(x))
    invstd = _channel_view(elementwise.rsqrt(ops.add(running_var, eps)), rank)
    x_hat = ops.mul(ops.sub(x, _channel_view(running_mean, rank)), invstd)
    x_hat_dot = None if x_dot is None else ops.mul(x_dot, invstd)
    if x_hat_dot is None and w_dot is None and b_dot is None:
        return out, None
    return out, _affine_tangent(x_hat_dot, x_hat, weight, w_dot, b_dot, rank)
jvp_rules[batch_norm_eval_p] = batch_norm_eval_jvp


# The statistics of batch, layer and group norm are the same two functions of x over the
# elements each one normalizes (n of them): the mean, and rstd = (var + eps)^-1/2, with
# d mean / dx = 1/n and d rstd / dx = -rstd^3 (x - mean) / n. ``view`` lays a statistic out
# to broadcast against x (a channel view for batch norm, nothing for layer norm's kept dims).
def _statistics_cotangent(ct, stats, x, n, view):
    """x's cotangent from the cotangent of the stacked (mean, rstd)."""
    mean, rstd = _mean_and_rstd(stats)
    ct_mean, ct_rstd = _mean_and_rstd(ct)
    scale = ops.mul(ops.mul(ct_rstd, ops.power(rstd, 3)), -1.0 / n)
    return ops.add(view(ops.div(ct_mean, n)), ops.mul(view(scale), ops.sub(x, view(mean))))


def _statistics_tangent(stats, x, x_dot, dims, view, keepdim=False):
    """The tangent of the stacked (mean, rstd), reduced over ``dims``."""
    mean, rstd = _mean_and_rstd(stats)
    mean_dot = ops.mean(x_dot, dims, keepdim=keepdim)
    rstd_dot = ops.mul(ops.mean(ops.mul(ops.sub(x, view(mean)), x_dot), dims, keepdim=keepdim),
                       ops.neg(ops.power(rstd, 3)))
    return ops.stack([mean_dot, rstd_dot])


def _keep(value):
    return value


def batch_norm_stats_vjp(x, *, eps):
    """The mean and invstd per channel (``_statistics_cotangent``)."""
    out = bind(batch_norm_stats_p, x, eps=eps)
    rank = len(shape_of(x))
    n = ops.shape_of(x)[0] * math.prod(shape_of(x)[2:])
    return out, lambda ct: (_statistics_cotangent(
        ct, out, x, n, lambda v: _channel_view(v, rank)),)
vjp_rules[batch_norm_stats_p] = batch_norm_stats_vjp


def batch_norm_stats_jvp(primals, tangents, *, eps):
    (x,), (x_dot,) = primals, tangents
    out = bind(batch_norm_stats_p, x, eps=eps)
    rank = len(shape_of(x))
    return out, _statistics_tangent(out, x, x_dot, _reduced_dims(x),
                                    lambda v: _channel_view(v, rank))
jvp_rules[batch_norm_stats_p] = batch_norm_stats_jvp


def _bn_backward_reference(prim, training, eps):
    """The primitive's output, from torch's Python decomposition of
    native_batch_norm_backward: a function of tensors, for the engine to differentiate."""
    decomposition = torch._decomp.decomposition_table[aten.native_batch_norm_backward.default]
    if prim is batch_norm_backward_input_p:
        def reference(ct, x, weight, stat0, stat1):
            return decomposition(ct, x, *_bn_backward_arguments(x, weight, stat0, stat1,
                                                                 training),
                                 training, eps, [True, False, False])[0]
    else:
        def reference(ct, x, stat0, stat1):
            _, grad_weight, grad_bias = decomposition(
                ct, x, *_bn_backward_arguments(x, None, stat0, stat1, training), training, eps,
                [False, True, True])
            return torch.stack([grad_weight, grad_bias])
    return reference


def _with_selected(args, positions, reference):
    """``reference`` as a function of the arguments at ``positions``, the others fixed."""
    shown = [as_tensor(a) for a in args]

    def f(*selected):
        full = list(shown)
        for position, value in zip(positions, selected):
            full[position] = value
        return reference(*full)
    return f, [shown[i] for i in positions]


def _rules_from_reference(prim, reference_of):
    """vjp and jvp rules for a backward kernel's primitive: those of ``reference_of(**params)``,
    a function of tensors written with torch ops (torch's Python decomposition of the kernel),
    differentiated by the engine itself."""
    def vjp(*args, **params):
        out = bind(prim, *args, **params)

        def backward(ct):
            from .transforms import vjp as vjp_transform
            positions = [i for i, a in enumerate(args)
                         if a is not None and wants_cotangent(i, a)]
            if not positions:
                return (None,) * len(args)
            f, selected = _with_selected(args, positions, reference_of(**params))
            _, pullback = vjp_transform(f, *selected)
            cts = unwrap_tree(pullback(as_tensor(ct)))
            result = [None] * len(args)
            for position, c in zip(positions, cts):
                result[position] = c
            return tuple(result)
        return out, backward

    def jvp(primals, tangents, **params):
        from .transforms import jvp as jvp_transform
        out = bind(prim, *primals, **params)
        positions = [i for i, t in enumerate(tangents) if t is not None]
        f, selected = _with_selected(primals, positions, reference_of(**params))
        _, out_dot = jvp_transform(f, tuple(selected),
                                   tuple(as_tensor(tangents[i]) for i in positions))
        return out, unwrap_tree(out_dot)

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp


def _bn_backward_rules(prim):
    _rules_from_reference(
        prim, lambda training, eps: _bn_backward_reference(prim, training, eps))


_bn_backward_rules(batch_norm_backward_input_p)
_bn_backward_rules(batch_norm_backward_params_p)


# NOTE [Batching batch norm: examples become channels]
# Batch norm normalizes each channel over N and space. Under vmap each example must get its
# own statistics, so the batch joins the channels: (B, N, C, ...) -> (N, B*C, ...), the
# per-channel vectors (weight, bias, statistics) become (B*C,), and one kernel call
# normalizes B*C channels. An argument that is not batched is broadcast along the batch
# first. functorch's batch norm rules do the same. In eval mode the forward is an affine map
# of each element, so a batch of inputs with shared statistics can simply be more images.
_BN_KINDS = {  # per argument: an activation (N, C, ...) or a per-channel vector (C,)
    batch_norm_train_p: ("act", "chan", "chan"),
    batch_norm_eval_p: ("act", "chan", "chan", "chan", "chan"),
    batch_norm_stats_p: ("act",),
    batch_norm_backward_input_p: ("act", "act", "chan", "chan", "chan"),
    batch_norm_backward_params_p: ("act", "act", "chan", "chan"),
}


def _bn_fold(value, bdim, kind, b):
    if value is None:
        return None
    if bdim is None:
        value = ops.expand(ops.unsqueeze(value, 0), b, *shape_of(value))
    else:
        value = _front(value, bdim)
    if kind == "chan":
        return ops.reshape(value, b * shape_of(value)[1])
    return _fold_channels(value, 1)


def _bn_batch(prim):
    kinds = _BN_KINDS[prim]

    def rule(values, bdims, **params):
        b = batch_size(values, bdims)
        elementwise_in_n = prim is batch_norm_eval_p or (
            prim is batch_norm_backward_input_p and not params["training"])
        if elementwise_in_n and all(bdim is None for bdim, kind in zip(bdims, kinds)
                                    if kind == "chan"):
            # an affine map of each element: the examples are more images
            folded, lead = [], None
            for value, bdim, kind in zip(values, bdims, kinds):
                if kind == "act":
                    value = ops.expand(ops.unsqueeze(value, 0), b, *shape_of(value)) \
                        if bdim is None else _front(value, bdim)
                    lead = shape_of(value)[:2]
                    value = _fold_leading(value, len(shape_of(value)) - 2)
                folded.append(value)
            return _unfold_leading(bind(prim, *folded, **params), lead), 0
        folded = [_bn_fold(v, bdim, kind, b) for v, bdim, kind in zip(values, bdims, kinds)]
        out = bind(prim, *folded, **params)
        if prim in (batch_norm_stats_p, batch_norm_backward_params_p):
            return ops.reshape(out, 2, b, shape_of(out)[1] // b), 1
        return _unfold_channels(out, b, 1)
    return rule


for _prim in _BN_KINDS:
    batching_rules[_prim] = _bn_batch(_prim)


# --- batch norm: the doors -----------------------------------------------------------------------
def _update_running_stats(op, x, running_mean, running_var, momentum, eps, updated):
    """NOTE [Running statistics]
    In training mode batch norm also updates its running statistics in place:
    running = (1 - momentum) * running + momentum * batch statistic (the variance unbiased).
    They are buffers, not values of a transform: torch.func updates them with the plain
    batch statistics, outside of autograd, and so do we, with torch's own kernel on the
    concrete input, writing into the tensors that hold them (a buffer given to grad or jvp
    is updated too; the output does not depend on it, so its derivative is zero). Under vmap
    a batched input has one set of statistics per example: buffers batched along with it
    hold one running statistic per example, and each is updated with its own example's (the
    kernel runs once, the examples folded into channels). One unbatched buffer cannot hold
    them: torch.func raises, as we do, naming the fixes it names.
    In a traced function the update becomes part of the program instead (``updated``:
    NOTE [Running statistics in a traced function])."""
    from .batching import BatchedValue
    trace_call = trace_call_of(x, running_mean, running_var)
    if trace_call is not None:
        if updated is None:  # an aten door, reached through one of torch's decompositions
            raise UnsupportedOperationError(
                f"{trace_call}: {op}(..., training=True) inside a traced function: this form "
                "of batch norm cannot update its running statistics. Fix: call "
                "torch.nn.functional.batch_norm (or the module) directly, or run the module "
                "in eval mode.")
        updated.extend(_traced_running_stats(trace_call, op, x, running_mean, running_var,
                                             momentum))
        return
    stats = [s for s in (running_mean, running_var) if s is not None]
    batched = {s.dispatcher for stat in stats for s in _chain(stat)
               if isinstance(s, BatchedValue)}
    stat_level = next(iter(batched)) if len(batched) == 1 else None
    x_levels = {v.dispatcher for v in _chain(x) if isinstance(v, BatchedValue)}
    if not batched and x_levels:
        raise InPlaceError(
            f"{next(iter(x_levels)).call}: batch_norm in training mode got a batched input, "
            "but it updates running_mean and running_var in place, and one unbatched buffer "
            "cannot hold a statistic per example (torch.func refuses this too). Fix: build "
            "the module with track_running_stats=False, or patch a model with "
            "torch.func.replace_all_batch_norm_modules_(model), batch the buffers along with "
            "the input, or run it in eval mode."
        )
    if len(batched) > 1 or (batched and not x_levels <= batched) or any(
            sum(isinstance(s, BatchedValue) for s in _chain(stat)) != len(batched)
            for stat in stats):
        raise InPlaceError(
            f"{op}(..., training=True): the running statistics and the input are batched by "
            "different vmaps, and training mode would update the statistics in place, which "
            "is not supported. Fix: batch them in the same vmap, use "
            "track_running_stats=False, or call in eval mode."
        )
    if stat_level is None:  # one set of statistics
        with torch.no_grad():
            aten.native_batch_norm(_concrete(x), None, None, bottom_tensor(running_mean),
                                   bottom_tensor(running_var), True, momentum, eps)
        return
    b = stat_level.length
    if not x_levels:
        examples = _concrete(x).unsqueeze(0).expand(b, *shape_of(x))
    else:
        examples = _examples(x, stat_level)
    n, c, *spatial = examples.shape[1:]
    folded = examples.movedim(0, 1).reshape(n, b * c, *spatial)  # NOTE [Batching batch norm]
    buffers = [None if s is None else _examples(s, stat_level, bottom=True)
               for s in (running_mean, running_var)]
    flat = [None if buffer is None else buffer.reshape(b * c).clone() for buffer in buffers]
    with torch.no_grad():
        aten.native_batch_norm(folded, None, None, *flat, True, momentum, eps)
        for buffer, updated in zip(buffers, flat):
            if buffer is not None:
                buffer.copy_(updated.reshape(b, c))


def _traced_running_stats(call, op, x, running_mean, running_var, momentum):
    """NOTE [Running statistics in a traced function]
    ``jit(train_step)(params, buffers, x, y)`` with batch norm in training mode: the input has
    no numbers while the function is traced, so torch's kernel cannot update the running
    statistics (NOTE [Running statistics]). The update is computed instead, from the traced
    input, with the kernel's formula (the variance unbiased), and the new values are returned
    to the front door, which writes them into the tensors that hold the statistics: arguments
    of the traced function, so the program writes them at every call (NOTE [A traced
    function that writes its inputs] in program.py), as make_fx records the functionalized
    ``_native_batch_norm_legit_functional`` and its copies into the buffers. The values are
    those of the trace, under any transform between it and the call: no derivative reaches
    them, as none reaches torch's kernel. Statistics that the function closes over, and
    statistics per example under vmap, are refused.
    """
    from .batching import BatchedValue
    if any(isinstance(v, BatchedValue) for value in (x, running_mean, running_var)
           for v in _chain(value)):
        raise UnsupportedOperationError(
            f"{call}: {op}(..., training=True) inside a traced function: batch norm in "
            "training mode under vmap would update running statistics per example, which a "
            "program does not record. Fix: build the module with track_running_stats=False "
            "(or patch it with replace_all_batch_norm_modules_), or run it in eval mode, or "
            "call it outside jit."
        )
    x_traced = traced_value(x)
    stats = [None if s is None else traced_value(s) for s in (running_mean, running_var)]
    if x_traced is None or any(s is None for s, given in zip(stats, (running_mean, running_var))
                               if given is not None):
        raise UnsupportedOperationError(
            f"{call}: {op}(..., training=True) inside a traced function: batch norm "
            "in training mode updates running_mean and running_var in place, and here they "
            "are tensors that the traced function closes over: the update would run once, "
            "while the function is traced, and never at a later call. Fix: pass the buffers "
            "as arguments (functional_call(model, (params, buffers), (x,)) with buffers an "
            "argument of the jit function), or run the module in eval mode."
        )
    shape = shape_of(x_traced)
    dims = (0, *range(2, len(shape)))
    batch_stats = (ops.mean(x_traced, dims), structural.var(x_traced, dims, correction=1))
    return [None if stat is None else ops.add(ops.mul(stat, 1 - momentum),
                                              ops.mul(batch_stat, momentum))
            for stat, batch_stat in zip(stats, batch_stats)]


def _chain(value):
    """A value and the values under it, down to the plain tensor (not included)."""
    while isinstance(value, Value):
        yield value
        value = value.payload


def _concrete(value):
    return value.concrete() if isinstance(value, Value) else value


def _examples(value, level, bottom=False):
    """The concrete tensor under ``value`` with ``level``'s batch dim in front (a view of the
    plain tensor at the bottom with ``bottom``, to write into)."""
    from .batching import BatchedValue
    batched = next(v for v in _chain(value) if isinstance(v, BatchedValue))
    tensor = bottom_tensor(value) if bottom else _concrete(batched.payload)
    return tensor.movedim(batched.bdim, 0)


def _batch_norm(op, x, weight, bias, running_mean, running_var, training, momentum, eps,
                updated=None):
    """Batch norm's result; in training mode its running statistics are updated too, or,
    in a traced function, their new values are added to ``updated`` for the front door to
    write (a door without it refuses: NOTE [Running statistics in a traced function])."""
    _refuse_complex(op, x, weight, bias)
    shape = shape_of(x)
    if math.prod(shape) == 0:
        # NOTE [Batch norm of an empty input]
        # torch's batch_norm returns early for an input with no elements, of any rank (a 1-D
        # (0,) one too): a copy of the input, times weight[0], plus bias[0], with no check
        # of the statistics and no update of the running ones. The same ops here give the
        # same (empty) values and the same (zero) derivatives.
        out = ops.clone(x)
        if weight is not None:
            out = ops.mul(out, ops.getitem(weight, (0,)))
        if bias is not None:
            out = ops.add(out, ops.getitem(bias, (0,)))
        return out
    if len(shape) < 2:
        if training or running_mean is None or running_var is None:
            raise DimOutOfRangeError(
                f"{op}(input, ...): Dimension out of range (expected to be in range of [-1, "
                f"0], but got 1) (as in torch: the channels are dim 1, and the input has shape "
                f"{shape}). Fix: give an input with at least 2 dims (N, C, ...).")
        raise ShapeMismatchError(
            f"{op}(input, ...): running_mean should contain 0 elements not "
            f"{math.prod(shape_of(running_mean))} (as in torch: the channels are dim 1, and the "
            f"input has shape {shape}). Fix: give an input with at least 2 dims (N, C, ...).")
    for label, v in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                     ("running_var", running_var)):
        if v is not None and math.prod(shape_of(v)) != shape[1]:
            raise ShapeMismatchError(
                f"{op}(input, ...): {label} should contain {shape[1]} elements not "
                f"{math.prod(shape_of(v))} (as in torch; the input has shape {shape}). Fix: "
                f"pass one value per channel, {shape[1]} in all.")
    eps = float(eps)
    if training or running_mean is None or running_var is None:
        if math.prod(shape) // shape[1] == 1:
            raise TransformUsageError(
                f"{op}(input, ..., training=True): expected more than 1 value per channel, "
                f"got input shape {shape}. Fix: use a batch of more than one example."
            )
        if running_mean is not None or running_var is not None:
            if training:
                _update_running_stats(op, x, running_mean, running_var, momentum, eps,
                                      updated)
        return bind(batch_norm_train_p, x, weight, bias, eps=eps)
    return bind(batch_norm_eval_p, x, weight, bias, running_mean, running_var, eps=eps)


@torch_api.register_updating(
    F.batch_norm, written=lambda x, running_mean, running_var, *args, **kwargs: (running_mean,
                                                                               running_var))
def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    if not training and (running_mean is None or running_var is None):
        raise InvalidOptionError(
            "batch_norm(input, running_mean, running_var, training=False): running_mean must "
            "be defined in evaluation mode (as in torch: eval mode normalizes with the running "
            "statistics, and they are None). Fix: pass them, or training=True."
        )
    updated = []
    out = _batch_norm("batch_norm", x, weight, bias, running_mean, running_var, training,
                      momentum, eps, updated)
    return out, updated


@torch_api.register_updating(
    torch.batch_norm, written=lambda x, weight, bias, running_mean, running_var, *args,
    **kwargs: (running_mean, running_var))
def _torch_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                      cudnn_enabled=True):
    return batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


# NOTE [Instance norm is batch norm of one example]
# torch's instance_norm (aten/src/ATen/native/Normalization.cpp) folds the examples into the
# channels, (N, C, ...) -> (1, N C, ...), repeats the weight and bias N times, and calls
# batch_norm in training mode. Reached as that composite, each of its steps crossed the aten
# door (and native_batch_norm there made its saved statistics too): grad took 1.7 times
# torch.func's time. At the front door it is the same fold, the same repeat and the engine's
# batch norm, so the kernels and the bits are torch's. With running statistics (their update
# averages the folded ones over the examples) or use_input_stats=False, torch's composite
# runs, as before; an input of fewer than 3 dims also keeps it, for torch's own error.
@torch_api.register(F.instance_norm)
def instance_norm(x, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    shape = shape_of(x)
    if (not use_input_stats or running_mean is not None or running_var is not None
            or len(shape) < 3):
        return NotImplemented
    if math.prod(shape[2:]) == 1:
        raise TransformUsageError(
            f"instance_norm(input, ...): Expected more than 1 spatial element when training, "
            f"got input size {tuple(shape)} (as in torch: each example's channel is normalized "
            "over its own spatial elements). Fix: give inputs with more than one spatial "
            "element, or use batch_norm to normalize over the batch.")
    examples, channels = shape[0], shape[1]
    folded = ops.reshape(x, 1, examples * channels, *shape[2:])
    weight, bias = (None if v is None else structural.repeat(v, examples)
                    for v in (weight, bias))
    out = _batch_norm("instance_norm", folded, weight, bias, None, None, True, momentum, eps)
    return ops.reshape(out, *shape)


def _saved_stats(x, training, eps):
    """native_batch_norm's second and third outputs: the batch statistics in training mode,
    empty tensors in eval mode (on CPU). torch declares them not differentiable (their
    derivatives are zero), and so do we."""
    if training:
        return tuple(ops.detach(stat) for stat in _bn_statistics(x, eps))
    empty = torch.empty(0, dtype=x.dtype, device=x.device)
    return empty, empty


@aten_api.register(aten.native_batch_norm.default)
def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    out = _batch_norm("native_batch_norm", x, weight, bias, running_mean, running_var, training,
                      momentum, eps)
    return (out, *_saved_stats(x, training or running_mean is None, float(eps)))


# The in-place forms (their schemas mark the running statistics as written): the front door
# and native_batch_norm are how torch reaches batch norm in eager mode; these two come from
# torch's own decompositions and export. tensor.py functionalizes an in-place aten op before
# it looks at ATEN_OPS, so these entries are reached only once it consults ATEN_OPS first for
# the in-place ops registered there (see the report of the nn family).
@aten_api.register(aten._native_batch_norm_legit.default)
def _native_batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum,
                             eps):
    return _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum,
                              eps)


@aten_api.register(aten._batch_norm_with_update.default)
def _batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, invstd = _native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                           momentum, eps)
    return out, mean, invstd, torch.empty(0, dtype=torch.uint8, device=x.device)


@aten_api.register(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    return _native_batch_norm(x, weight, bias, None, None, True, momentum, eps)


@aten_api.register(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)


@aten_api.register(aten._batch_norm_no_update.default)
def _batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    training = running_mean is None or running_var is None
    out, mean, invstd = _native_batch_norm(x, weight, bias, None if training else running_mean,
                                           None if training else running_var, training,
                                           momentum, eps)
    return out, mean, invstd, torch.empty(0, dtype=torch.uint8, device=x.device)


@aten_api.register(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_functional(x, weight, bias, running_mean, running_var, training,
                                  momentum, eps):
    """The functional form: the updated running statistics are returned, not written."""
    if not training:
        out, mean, invstd = _native_batch_norm(x, weight, bias, running_mean, running_var,
                                               False, momentum, eps)
        return out, mean, invstd, running_mean, running_var
    out = _batch_norm("_native_batch_norm_legit_functional", x, weight, bias, None, None, True,
                      momentum, eps)
    mean, invstd = (ops.detach(stat) for stat in _bn_statistics(x, float(eps)))
    n = math.prod(shape_of(x)) // shape_of(x)[1]
    variance = ops.mul(ops.sub(ops.pow(invstd, -2), eps), n / (n - 1))
    new_mean = ops.add(ops.mul(running_mean, 1 - momentum), ops.mul(mean, momentum))
    new_var = ops.add(ops.mul(running_var, 1 - momentum), ops.mul(variance, momentum))
    return out, mean, invstd, new_mean, new_var


@aten_api.register(aten.native_batch_norm_backward.default)
def _native_batch_norm_backward(ct, x, weight, running_mean, running_var, save_mean,
                                save_invstd, training, eps, output_mask):
    stat0, stat1 = (save_mean, save_invstd) if training else (running_mean, running_var)
    eps = float(eps)
    grad_input = bind(batch_norm_backward_input_p, ct, x, weight, stat0, stat1,
                      training=bool(training), eps=eps) if output_mask[0] else None
    grad_weight = grad_bias = None
    if output_mask[1] or output_mask[2]:
        params = bind(batch_norm_backward_params_p, ct, x, stat0, stat1,
                      training=bool(training), eps=eps)
        grad_weight = ops.getitem(params, 0) if output_mask[1] else None
        grad_bias = ops.getitem(params, 1) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


# --- normalization: layer norm -------------------------------------------------------------------
# NOTE [Layer norm: the fused kernels as primitives]
# torch.func runs native_layer_norm forward and native_layer_norm_backward backward, and its
# forward mode is derivatives.yaml's layer_norm_jvp formula. As for batch norm (NOTE [Batch
# norm: the fused kernels as primitives]), these kernels are primitives here, one per output,
# so that grad, vmap(grad) and jvp of layer_norm are bit-exact with torch.func:
# - layer_norm(x, w, b): the output;
# - layer_norm_stats(x): the saved mean and rstd, stacked as (2, *lead, 1, ..., 1), kept from
#   the forward's pass (NOTE [Kernels with two outputs]). Differentiable (the backward reads
#   them, so a second derivative flows through them back to x);
# - layer_norm_backward_input(ct, x, mean, rstd, w) and layer_norm_backward_params(ct, x, mean,
#   rstd) (grad_weight and grad_bias stacked as (2, *normalized_shape)): the outputs of
#   native_layer_norm_backward. Their own derivatives (second order) are those of torch's
#   Python decomposition of that kernel, differentiated by the engine (`_rules_from_reference`),
#   so they agree with torch.func to rounding, not bit for bit. (One exception: torch.func
#   2.13's mixed block d/dx (dL/dw) of a hessian is off, not the transpose of its d/dw (dL/dx);
#   ours is, and agrees with the formula differentiated by torch.func: tests/test_nn.py.)
# native_layer_norm_backward has no entry at the aten door (as before): torch's double
# backward of it differentiates through mean and rstd as functions of x, while the ones it is
# given there are plain arguments, so an entry needs more than these primitives.
# Under vmap the rules make the calls torch.func's batching rules make
# (NOTE [Batching layer norm]). An input with no elements, or a weight or bias that is not
# of normalized_shape and x's dtype, takes the formula path (`_layer_norm_formula`): the
# kernels would refuse it or give what torch's composite does not.
#
# NOTE [Absent weight and bias]
# A primitive's positional arguments are tensors (a trace records each as an operand, and
# refuses None), and layer norm's weight and bias are optional. So layer_norm and
# layer_norm_backward_input take only the ones given, after the tensors they always take, and
# their ``affine`` parameter names them: ("weight", "bias"), ("weight",), ("bias",) or ().
_kept_ln_statistics = _KeptOutput()


def _affine(names, tensors):
    """The weight and bias (None where absent) out of a primitive's trailing arguments
    (NOTE [Absent weight and bias])."""
    given = dict(zip(names, tensors))
    return given.get("weight"), given.get("bias")


def _bind_affine(prim, leading, weight=None, bias=None, **params):
    """``bind(prim, *leading, *the given of weight and bias, affine=their names)``."""
    present = [(name, value) for name, value in (("weight", weight), ("bias", bias))
               if value is not None]
    return bind(prim, *leading, *(value for _, value in present),
                affine=tuple(name for name, _ in present), **params)


def _ln_forward(x, *affine_args, normalized_shape, eps, affine):
    """The output; the statistics the kernel also computes are kept for layer_norm_stats."""
    weight, bias = _affine(affine, affine_args)
    out, mean, rstd = torch.native_layer_norm(x, list(normalized_shape), weight, bias, eps)
    _kept_ln_statistics.keep(x, (normalized_shape, eps), (mean, rstd))
    return out


def _ln_stats_pair(x, normalized_shape, eps):
    """(mean, rstd) of a plain tensor: the forward kernel's, kept, or computed again."""
    kept = _kept_ln_statistics.take(x, (normalized_shape, eps))
    if kept is None:
        kept = torch.native_layer_norm(x, list(normalized_shape), None, None, eps)[1:]
    return kept


def _ln_stats(x, *, normalized_shape, eps):
    return torch.stack(_ln_stats_pair(x, normalized_shape, eps))


def _ln_saved(mean, rstd):
    """The statistics as the backward kernel reads them: it indexes them as contiguous
    memory, so a view that is not (an expanded or moved batch under vmap) is copied first."""
    return mean.contiguous(), rstd.contiguous()


def _ln_backward_input(ct, x, mean, rstd, *affine_args, normalized_shape, affine):
    weight, _ = _affine(affine, affine_args)
    return aten.native_layer_norm_backward(ct, x, list(normalized_shape), *_ln_saved(mean, rstd),
                                           weight, None, [True, False, False])[0]


def _ln_backward_params(ct, x, mean, rstd, *, normalized_shape):
    # grad_weight and grad_bias do not read the weight or the bias, but the kernel wants both
    # defined to compute them
    ones = torch.ones(normalized_shape, dtype=x.dtype, device=x.device)
    zeros = torch.zeros(normalized_shape, dtype=x.dtype, device=x.device)
    _, grad_weight, grad_bias = aten.native_layer_norm_backward(
        ct, x, list(normalized_shape), *_ln_saved(mean, rstd), ones, zeros,
        [False, True, True])
    return torch.stack([grad_weight, grad_bias])


layer_norm_p = P.primitive("layer_norm", _ln_forward)
layer_norm_stats_p = P.primitive("layer_norm_stats", _ln_stats)
layer_norm_backward_input_p = P.primitive("layer_norm_backward_input", _ln_backward_input)
layer_norm_backward_params_p = P.primitive("layer_norm_backward_params", _ln_backward_params)
register_fresh(layer_norm_p, layer_norm_stats_p, layer_norm_backward_input_p,
               layer_norm_backward_params_p)


def _trailing_dims(x, normalized_shape):
    """The dims layer norm normalizes over: the last len(normalized_shape)."""
    rank = len(shape_of(x))
    return tuple(range(rank - len(normalized_shape), rank))


def _ln_statistics(x, normalized_shape, eps):
    if type(x) is torch.Tensor:  # NOTE [Statistics of a plain tensor: the kernel's pair]
        return _ln_stats_pair(x, normalized_shape, eps)
    return _mean_and_rstd(bind(layer_norm_stats_p, x, normalized_shape=normalized_shape,
                               eps=eps))


def layer_norm_vjp(x, *affine_args, normalized_shape, eps, affine):
    out = bind(layer_norm_p, x, *affine_args, normalized_shape=normalized_shape, eps=eps,
               affine=affine)
    mean, rstd = _ln_statistics(x, normalized_shape, eps)  # NOTE [Kernels with two outputs]
    weight, _ = _affine(affine, affine_args)

    def backward(ct):
        x_bar = None
        if wants_cotangent(0, x):
            x_bar = _bind_affine(layer_norm_backward_input_p, (ct, x, mean, rstd), weight,
                                 normalized_shape=normalized_shape)
        wanted = [wants_cotangent(i, a) for i, a in enumerate(affine_args, start=1)]
        affine_bars = [None] * len(affine_args)
        if any(wanted):
            params = bind(layer_norm_backward_params_p, ct, x, mean, rstd,
                          normalized_shape=normalized_shape)
            affine_bars = [ops.getitem(params, 0 if name == "weight" else 1) if want else None
                           for name, want in zip(affine, wanted)]
        return (x_bar, *affine_bars)
    return out, backward
vjp_rules[layer_norm_p] = layer_norm_vjp


def layer_norm_jvp(primals, tangents, *, normalized_shape, eps, affine):
    """With c = x - mean and x_hat = c * rstd: the tangent of x_hat is
    (x_dot - mean(x_dot)) * rstd + c * rstd_dot, where
    rstd_dot = sum(-rstd^3 * (x_dot - mean(x_dot)) * c) / n, and the affine part gives
    x_hat_dot * w + x_hat * w_dot + b_dot. The ops and their order are those of
    FunctionsManual's layer_norm_jvp, which torch.func runs, so the tangent is bit-exact."""
    (x, *affine_args), (x_dot, *affine_dots) = primals, tangents
    out = bind(layer_norm_p, *primals, normalized_shape=normalized_shape, eps=eps,
               affine=affine)
    (weight, _), (w_dot, b_dot) = _affine(affine, affine_args), _affine(affine, affine_dots)
    mean, rstd = _ln_statistics(x, normalized_shape, eps)
    out_dot = None
    if x_dot is not None:
        dims = _trailing_dims(x, normalized_shape)
        centered_dot = ops.sub(x_dot, ops.mean(x_dot, dims, keepdim=True))
        slope = ops.mul(ops.neg(ops.power(rstd, 3)), centered_dot)
        rstd_dot = ops.div(ops.sum(ops.mul(slope, ops.sub(x, mean)), dims, keepdim=True),
                           math.prod(normalized_shape))
        out_dot = ops.add(ops.mul(centered_dot, rstd), ops.mul(ops.sub(x, mean), rstd_dot))
        if weight is not None:
            out_dot = ops.mul(out_dot, weight)
    if w_dot is not None:
        x_hat = ops.mul(ops.sub(x, mean), rstd)
        out_dot = add_tangents(out_dot, ops.mul(x_hat, w_dot))
    if b_dot is not None:
        out_dot = ops.add(ops.zeros_like(out) if out_dot is None else out_dot, b_dot)
    return out, out_dot
jvp_rules[layer_norm_p] = layer_norm_jvp


def layer_norm_stats_vjp(x, *, normalized_shape, eps):
    """The mean and rstd per normalized group, kept dims (``_statistics_cotangent``)."""
    out = bind(layer_norm_stats_p, x, normalized_shape=normalized_shape, eps=eps)
    n = math.prod(normalized_shape)
    return out, lambda ct: (_statistics_cotangent(ct, out, x, n, _keep),)
vjp_rules[layer_norm_stats_p] = layer_norm_stats_vjp


def layer_norm_stats_jvp(primals, tangents, *, normalized_shape, eps):
    (x,), (x_dot,) = primals, tangents
    out = bind(layer_norm_stats_p, x, normalized_shape=normalized_shape, eps=eps)
    return out, _statistics_tangent(out, x, x_dot, _trailing_dims(x, normalized_shape), _keep,
                                    keepdim=True)
jvp_rules[layer_norm_stats_p] = layer_norm_stats_jvp


def _ln_backward_reference(prim, normalized_shape, affine=()):
    """The primitive's output, from torch's Python decomposition of
    native_layer_norm_backward: a function of tensors, for the engine to differentiate."""
    decomposition = torch._decomp.decomposition_table[aten.native_layer_norm_backward.default]
    shape = list(normalized_shape)
    if prim is layer_norm_backward_input_p:
        def reference(ct, x, mean, rstd, *affine_args):
            weight, _ = _affine(affine, affine_args)
            return decomposition(ct, x, shape, mean, rstd, weight, None,
                                 [True, False, False])[0]
    else:
        def reference(ct, x, mean, rstd):
            ones = torch.ones(shape, dtype=x.dtype, device=x.device)
            _, grad_weight, grad_bias = decomposition(ct, x, shape, mean, rstd, ones,
                                                      ones, [False, True, True])
            return torch.stack([grad_weight, grad_bias])
    return reference


for _prim in (layer_norm_backward_input_p, layer_norm_backward_params_p):
    _rules_from_reference(_prim, functools.partial(_ln_backward_reference, _prim))


# NOTE [Batching layer norm]
# Layer norm normalizes the trailing dims, which one example owns: a batch dim moved to the
# front is one more leading dim, and one kernel call serves the batch. The rules below make
# the calls functorch's batching rules for these kernels (BatchRulesNorm.cpp) make, so that
# vmap(grad) stays bit-exact with torch.func:
# - the forward with a batched weight or bias (per-example weights, as in model ensembles):
#   the kernel without them, then an ordinary multiply and add;
# - the backward, whenever anything is batched: the input's gradient is the kernel's with no
#   weight, given ct * w; grad_weight is sum(((x - mean) * rstd) * ct) and grad_bias sum(ct),
#   over the leading dims (but the batch dim).
def _ln_affine_front(value, bdim, rank):
    """A weight or bias of normalized_shape, broadcastable against a front-batched tensor of
    logical rank ``rank``: (B, 1, ..., 1, *normalized_shape) when batched."""
    if value is None or bdim is None:
        return value
    value = _front(value, bdim)
    shape = shape_of(value)
    return ops.reshape(value, shape[0], *([1] * (rank - len(shape) + 1)), *shape[1:])


def layer_norm_batch(values, bdims, *, normalized_shape, eps, affine):
    (x, *affine_args), (x_bdim, *affine_bdims) = values, bdims
    (weight, bias), (w_bdim, b_bdim) = _affine(affine, affine_args), _affine(affine, affine_bdims)
    rank = len(shape_of(x)) - (x_bdim is not None)
    if x_bdim is not None:
        x = _front(x, x_bdim)
    if w_bdim is None and b_bdim is None:
        return bind(layer_norm_p, x, *affine_args, normalized_shape=normalized_shape, eps=eps,
                    affine=affine), 0
    out = bind(layer_norm_p, x, normalized_shape=normalized_shape, eps=eps, affine=())
    if weight is not None:
        out = ops.mul(out, _ln_affine_front(weight, w_bdim, rank))
    if bias is not None:
        out = ops.add(out, _ln_affine_front(bias, b_bdim, rank))
    return out, 0
batching_rules[layer_norm_p] = layer_norm_batch


def layer_norm_stats_batch(values, bdims, *, normalized_shape, eps):
    (x,), (x_bdim,) = values, bdims
    return bind(layer_norm_stats_p, _front(x, x_bdim), normalized_shape=normalized_shape,
                eps=eps), 1
batching_rules[layer_norm_stats_p] = layer_norm_stats_batch


def layer_norm_backward_input_batch(values, bdims, *, normalized_shape, affine):
    (ct, x, mean, rstd, *affine_args), (ct_bdim, x_bdim, m_bdim, r_bdim, *affine_bdims) = \
        values, bdims
    (weight, _), (w_bdim, _) = _affine(affine, affine_args), _affine(affine, affine_bdims)
    b = batch_size(values, bdims)
    rank = len(shape_of(x)) - (x_bdim is not None)
    ct = ct if ct_bdim is None else _front(ct, ct_bdim)
    if weight is not None:
        ct = ops.mul(ct, _ln_affine_front(weight, w_bdim, rank))
    ct_bdim = None if len(shape_of(ct)) == rank else 0  # (None: nothing batched in ct * w)
    ct, x, mean, rstd = to_front([ct, x, mean, rstd], [ct_bdim, x_bdim, m_bdim, r_bdim],
                                 expand_unbatched=True, size=b)
    return bind(layer_norm_backward_input_p, ct, x, mean, rstd,
                normalized_shape=normalized_shape, affine=()), 0
batching_rules[layer_norm_backward_input_p] = layer_norm_backward_input_batch


def layer_norm_backward_params_batch(values, bdims, *, normalized_shape):
    ct, x, mean, rstd = to_front(values, bdims, expand_unbatched=True)
    lead = tuple(range(1, len(shape_of(x)) - len(normalized_shape)))
    grad_weight = ops.mul(ops.mul(ops.sub(x, mean), rstd), ct)
    grad_bias = ct
    if lead:
        grad_weight, grad_bias = ops.sum(grad_weight, lead), ops.sum(grad_bias, lead)
    return ops.stack([grad_weight, grad_bias]), 1
batching_rules[layer_norm_backward_params_p] = layer_norm_backward_params_batch


# --- layer norm: the doors -----------------------------------------------------------------------
def _normalized_dims(op, x, normalized_shape):
    """The trailing dims that layer_norm and rms_norm normalize over, checked as torch does:
    at least one, and the input's last sizes equal to ``normalized_shape``."""
    shape = shape_of(x)
    k = len(normalized_shape)
    if k == 0:
        raise ShapeMismatchError(
            f"{op}(input, normalized_shape=[]): Expected normalized_shape to be at least "
            "1-dimensional, i.e., containing at least one element (as in torch). Fix: pass the "
            "sizes of the dims to normalize over.")
    if tuple(shape[len(shape) - k:]) != normalized_shape:
        raise ShapeMismatchError(
            f"{op}(input, normalized_shape={list(normalized_shape)}): Given normalized_shape="
            f"{list(normalized_shape)}, expected input with shape [*, "
            f"{', '.join(map(str, normalized_shape))}], but got input of size{list(shape)}. "
            "Fix: pass the shape of the dims to normalize over.")
    return tuple(range(len(shape) - k, len(shape)))


def _normalize_over(x, dims, eps):
    """(x - mean) * rsqrt(var + eps) over ``dims``, and the mean and rstd (keepdim)."""
    mean = ops.mean(x, dims, keepdim=True)
    centered = ops.sub(x, mean)
    variance = ops.mean(ops.mul(centered, centered), dims, keepdim=True)
    rstd = elementwise.rsqrt(ops.add(variance, eps))
    return ops.mul(centered, rstd), mean, rstd


def _layer_norm_formula(x, dims, weight, bias, eps):
    """Layer norm written with ops: the path for what the kernels do not serve."""
    out, mean, rstd = _normalize_over(x, dims, eps)
    if weight is not None:
        out = ops.mul(out, weight)
    if bias is not None:
        out = ops.add(out, bias)
    return out, mean, rstd


def _kernels_serve(x, normalized_shape, weight, bias):
    """Whether the fused kernels compute this layer norm (NOTE [Layer norm: the fused kernels
    as primitives]): an input with elements, and a weight and bias (if any) of
    normalized_shape and of the input's dtype."""
    if math.prod(shape_of(x)) == 0:
        return False
    return all(p is None or (tuple(shape_of(p)) == normalized_shape and p.dtype == x.dtype)
               for p in (weight, bias))


def _layer_norm(x, normalized_shape, weight, bias, eps, *, statistics=True):
    """layer_norm's output, mean and rstd (the statistics as native_layer_norm gives them);
    without ``statistics``, the output alone where the kernels serve (F.layer_norm: the
    statistics would be one more primitive and two slices under every level)."""
    _refuse_complex("layer_norm", x, weight, bias)
    normalized_shape = _ntuple(normalized_shape, 1, "normalized_shape", "layer_norm") \
        if isinstance(normalized_shape, int) else tuple(int(s) for s in normalized_shape)
    dims = _normalized_dims("layer_norm", x, normalized_shape)
    for label, v in (("weight", weight), ("bias", bias)):
        if v is not None and tuple(shape_of(v)) != normalized_shape:
            raise ShapeMismatchError(
                "layer_norm(input, normalized_shape, weight, bias): Expected "
                f"{label} to be of same shape as normalized_shape, but got {label} of shape "
                f"{list(shape_of(v))} and normalized_shape = {list(normalized_shape)} (as in "
                f"torch). Fix: pass a {label} of shape {normalized_shape}.")
    eps = float(eps)
    if not _kernels_serve(x, normalized_shape, weight, bias):
        return _layer_norm_formula(x, dims, weight, bias, eps)
    out = _bind_affine(layer_norm_p, (x,), weight, bias, normalized_shape=normalized_shape,
                       eps=eps)
    return (out, *_ln_statistics(x, normalized_shape, eps)) if statistics else (out,)


@torch_api.register(F.layer_norm)
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _layer_norm(x, normalized_shape, weight, bias, eps, statistics=False)[0]


torch_api.register(torch.layer_norm)(
    lambda x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True:
    layer_norm(x, normalized_shape, weight, bias, eps))


def _without_derivative(outputs):
    """An op's first output, and its other outputs (saved statistics) detached: torch
    declares those not differentiable."""
    return (outputs[0], *(ops.detach(o) for o in outputs[1:]))


aten_api.register(aten.native_layer_norm.default)(
    lambda x, normalized_shape, weight, bias, eps:
    _without_derivative(_layer_norm(x, normalized_shape, weight, bias, eps)))


# --- normalization: group norm -------------------------------------------------------------------
# NOTE [Group norm: the forward kernel as a primitive]
# torch.func runs native_group_norm forward; its forward mode is derivatives.yaml's
# group_norm_jvp formula; and its reverse mode is not the backward kernel: the transforms
# differentiate with grad mode on, and there derivatives.yaml picks FunctionsManual's
# infinitely_differentiable_native_group_norm_backward, a formula of ops (the kernel
# native_group_norm_backward only serves a backward with grad mode off, which torch.func never
# runs). So, as for layer norm (NOTE [Layer norm: the fused kernels as primitives]), the
# forward kernel is a primitive (one per output), and the rules are those formulas op for op:
# grad, vmap(grad) and jvp of group_norm are bit-exact with torch.func:
# - group_norm(x, w, b) (the given of w and b only: NOTE [Absent weight and bias]): the output;
# - group_norm_stats(x): the saved mean and rstd, stacked as (2, N, groups), kept from the
#   forward's pass (NOTE [Kernels with two outputs]); differentiable (the backward reads them,
#   so a second derivative flows through them back to x).
# The vjp rule (`_gn_backward`) is made of ops, so second order is the engine differentiating
# those ops, as torch.func differentiates the same formula. The jvp rule is batch norm's
# training-mode tangent over the input seen as (1, N * groups, -1), then the affine part, in
# group_norm_jvp's order. Under vmap the forward makes the calls functorch's batching rule
# makes (NOTE [Batching group norm]). An input with no elements, or a weight or bias that is
# not of shape (C,) and x's dtype, takes the formula path (NOTE [Group norm at the front door]).
#
# NOTE [Batching group norm]
# Group norm normalizes each example's groups on their own, so a batch dim moved to the front
# and merged into N is exact: one kernel call with N * B serves the batch. As functorch's
# batching rule for native_group_norm (BatchRulesNorm.cpp) does, the kernel then runs with no
# weight or bias, batched or not, and they are applied after it with an ordinary multiply and
# add (the kernel's fused affine step rounds differently).
_kept_gn_statistics = _KeptOutput()


def _gn_sizes(x):
    """native_group_norm's N, C and HxW for an input (N, C, *spatial)."""
    shape = tuple(x.shape)
    return shape[0], shape[1], math.prod(shape[2:])


def _gn_forward(x, *affine_args, num_groups, eps, affine):
    """The output; the statistics the kernel also computes are kept for group_norm_stats."""
    weight, bias = _affine(affine, affine_args)
    # (the kernel takes a contiguous input only; torch.group_norm makes it so first, and so
    # does this: under vmap a batch dim that is not in front leaves the payload strided)
    out, mean, rstd = torch.native_group_norm(x.contiguous(), weight, bias, *_gn_sizes(x),
                                              num_groups, eps)
    _kept_gn_statistics.keep(x, (num_groups, eps), (mean, rstd))
    return out


def _gn_stats_pair(x, num_groups, eps):
    """(mean, rstd) of a plain tensor: the forward kernel's, kept, or computed again."""
    kept = _kept_gn_statistics.take(x, (num_groups, eps))
    if kept is None:
        kept = torch.native_group_norm(x.contiguous(), None, None, *_gn_sizes(x), num_groups,
                                       eps)[1:]
    return kept


def _gn_stats(x, *, num_groups, eps):
    return torch.stack(_gn_stats_pair(x, num_groups, eps))


group_norm_p = P.primitive("group_norm", _gn_forward)
group_norm_stats_p = P.primitive("group_norm_stats", _gn_stats)
register_fresh(group_norm_p, group_norm_stats_p)


def _gn_statistics(x, num_groups, eps):
    if type(x) is torch.Tensor:  # NOTE [Statistics of a plain tensor: the kernel's pair]
        return _gn_stats_pair(x, num_groups, eps)
    return _mean_and_rstd(bind(group_norm_stats_p, x, num_groups=num_groups, eps=eps))


def _gn_grouped(x, num_groups):
    """x seen as (N, groups, -1): the elements each statistic is over, last."""
    return ops.reshape(x, shape_of(x)[0], num_groups, -1)


def _gn_backward(ct, x, mean, rstd, weight, num_groups, wanted):
    """The input's, weight's and bias's cotangents (None where not ``wanted``), with the ops of
    FunctionsManual's infinitely_differentiable_native_group_norm_backward in their order:
    torch.func runs that formula, not the backward kernel (NOTE [Group norm: the forward
    kernel as a primitive])."""
    shape = shape_of(x)
    n, c, hxw = shape[0], shape[1], math.prod(shape[2:])
    cpg = c // num_groups
    grouped = (n, num_groups, cpg, hxw)
    x_g, ct_g = ops.reshape(x, *grouped), ops.reshape(ct, *grouped)
    mean, rstd = ops.reshape(mean, n, num_groups, 1, 1), ops.reshape(rstd, n, num_groups, 1, 1)
    ds = ops.unsqueeze(ops.sum(ops.mul(ct_g, x_g), (3,)), -1)
    db = ops.unsqueeze(ops.sum(ct_g, (3,)), -1)
    x_bar = w_bar = b_bar = None
    if wanted[0]:
        s = 1.0 / (hxw * cpg)
        rstd_cubed = ops.mul(ops.mul(rstd, rstd), rstd)
        if weight is not None:
            gamma = ops.reshape(weight, 1, num_groups, cpg, 1)
            scale = ops.mul(rstd, gamma)
            ds_sum = ops.unsqueeze(ops.sum(ops.mul(ds, gamma), (2,)), -2)
            db_sum = ops.unsqueeze(ops.sum(ops.mul(db, gamma), (2,)), -2)
        else:
            scale = rstd
            ds_sum = ops.unsqueeze(ops.sum(ds, (2,)), -2)
            db_sum = ops.unsqueeze(ops.sum(db, (2,)), -2)
        a = ops.mul(ops.mul(ops.sub(ops.mul(db_sum, mean), ds_sum), rstd_cubed), s)
        b = ops.mul(ops.mul(db_sum, rstd), s)
        offset = ops.sub(ops.mul(ops.neg(a), mean), b)
        x_bar = ops.reshape(ops.add(ops.add(ops.mul(scale, ct_g), ops.mul(a, x_g)), offset),
                            *shape)
    if wanted[1]:
        w_bar = ops.reshape(ops.sum(ops.mul(ops.sub(ds, ops.mul(db, mean)), rstd), (0,)), c)
    if wanted[2]:
        b_bar = ops.reshape(ops.sum(db, (0,)), c)
    return x_bar, w_bar, b_bar


def group_norm_vjp(x, *affine_args, num_groups, eps, affine):
    out = bind(group_norm_p, x, *affine_args, num_groups=num_groups, eps=eps, affine=affine)
    mean, rstd = _gn_statistics(x, num_groups, eps)  # NOTE [Kernels with two outputs]
    weight, _ = _affine(affine, affine_args)

    def backward(ct):
        wanted = {name: wants_cotangent(i, a) for i, (name, a) in
                  enumerate(zip(affine, affine_args), start=1)}
        x_bar, w_bar, b_bar = _gn_backward(
            ct, x, mean, rstd, weight, num_groups,
            (wants_cotangent(0, x), wanted.get("weight", False), wanted.get("bias", False)))
        bars = {"weight": w_bar, "bias": b_bar}
        return (x_bar, *(bars[name] for name in affine))
    return out, backward
vjp_rules[group_norm_p] = group_norm_vjp


def group_norm_jvp(primals, tangents, *, num_groups, eps, affine):
    """FunctionsManual's group_norm_jvp, op for op: with x and x_dot seen as
    (1, N * groups, -1), c = x - mean and the means over dims (0, 2), the tangent of x_hat is
    (x_dot - mean(x_dot)) * rstd + c * sum(-rstd^3 * (x_dot - mean(x_dot)) * c) / n, and the
    affine part gives x_hat_dot * w + x_hat * w_dot + b_dot (per channel)."""
    (x, *affine_args), (x_dot, *affine_dots) = primals, tangents
    out = bind(group_norm_p, *primals, num_groups=num_groups, eps=eps, affine=affine)
    (weight, _), (w_dot, b_dot) = _affine(affine, affine_args), _affine(affine, affine_dots)
    shape = shape_of(x)
    rank, groups = len(shape), shape[0] * num_groups
    mean, rstd = _gn_statistics(x, num_groups, eps)
    mean, rstd = ops.reshape(mean, 1, groups, 1), ops.reshape(rstd, 1, groups, 1)
    flat = ops.reshape(x, 1, groups, -1)
    out_dot = None
    if x_dot is not None:
        flat_dot = ops.reshape(x_dot, 1, groups, -1)
        centered_dot = ops.sub(flat_dot, ops.mean(flat_dot, (0, 2), keepdim=True))
        slope = ops.mul(ops.neg(ops.power(rstd, 3)), centered_dot)
        rstd_dot = ops.div(ops.sum(ops.mul(slope, ops.sub(flat, mean)), (0, 2), keepdim=True),
                           shape_of(flat)[2])
        out_dot = ops.reshape(ops.add(ops.mul(centered_dot, rstd),
                                      ops.mul(ops.sub(flat, mean), rstd_dot)), *shape)
        if weight is not None:
            out_dot = ops.mul(out_dot, _channel_view(weight, rank))
    if w_dot is not None:
        x_hat = ops.reshape(ops.mul(ops.sub(flat, mean), rstd), *shape)
        out_dot = add_tangents(out_dot, ops.mul(x_hat, _channel_view(w_dot, rank)))
    if b_dot is not None:
        out_dot = ops.add(ops.zeros_like(out) if out_dot is None else out_dot,
                          _channel_view(b_dot, rank))
    return out, out_dot
jvp_rules[group_norm_p] = group_norm_jvp


def _per_group(value):
    """A statistic (N, groups) laid out against the grouped input (N, groups, -1)."""
    return ops.unsqueeze(value, 2)


def group_norm_stats_vjp(x, *, num_groups, eps):
    """The mean and rstd per example and group (``_statistics_cotangent``)."""
    out = bind(group_norm_stats_p, x, num_groups=num_groups, eps=eps)
    grouped = _gn_grouped(x, num_groups)
    n = shape_of(grouped)[2]
    return out, lambda ct: (ops.reshape(
        _statistics_cotangent(ct, out, grouped, n, _per_group), *shape_of(x)),)
vjp_rules[group_norm_stats_p] = group_norm_stats_vjp


def group_norm_stats_jvp(primals, tangents, *, num_groups, eps):
    (x,), (x_dot,) = primals, tangents
    out = bind(group_norm_stats_p, x, num_groups=num_groups, eps=eps)
    return out, _statistics_tangent(out, _gn_grouped(x, num_groups),
                                    _gn_grouped(x_dot, num_groups), (2,), _per_group)
jvp_rules[group_norm_stats_p] = group_norm_stats_jvp


def _gn_affine_view(value, bdim, rank):
    """A weight or bias of shape (C,) broadcastable against a front-batched output of logical
    rank ``rank``: (B, 1, C, 1, ..., 1) when batched, (C, 1, ..., 1) otherwise."""
    if bdim is None:
        return _channel_view(value, rank)
    value = _front(value, bdim)
    return ops.reshape(value, shape_of(value)[0], 1, shape_of(value)[1], *([1] * (rank - 2)))


def group_norm_batch(values, bdims, *, num_groups, eps, affine):
    (x, *affine_args), (x_bdim, *affine_bdims) = values, bdims
    (weight, bias), (w_bdim, b_bdim) = _affine(affine, affine_args), _affine(affine, affine_bdims)
    rank = len(shape_of(x)) - (x_bdim is not None)
    if x_bdim is None:
        out = bind(group_norm_p, x, num_groups=num_groups, eps=eps, affine=())
    else:  # (B, N, C, ...) as (B * N, C, ...): the examples are more samples
        x = _front(x, x_bdim)
        out = _unfold_leading(bind(group_norm_p, _fold_leading(x, rank - 1),
                                   num_groups=num_groups, eps=eps, affine=()), shape_of(x)[:2])
    if weight is not None:
        out = ops.mul(out, _gn_affine_view(weight, w_bdim, rank))
    if bias is not None:
        out = ops.add(out, _gn_affine_view(bias, b_bdim, rank))
    return out, 0
batching_rules[group_norm_p] = group_norm_batch


def group_norm_stats_batch(values, bdims, *, num_groups, eps):
    (x,), (x_bdim,) = values, bdims
    x = _front(x, x_bdim)
    stats = bind(group_norm_stats_p, _fold_leading(x, len(shape_of(x)) - 2),
                 num_groups=num_groups, eps=eps)
    return ops.reshape(stats, 2, shape_of(x)[0], -1, num_groups), 1
batching_rules[group_norm_stats_p] = group_norm_stats_batch


# --- group norm: the doors -----------------------------------------------------------------------
# NOTE [Group norm at the front door]
# What the kernel does not serve (NOTE [Group norm: the forward kernel as a primitive]): an
# input with no elements, or a weight or bias not of shape (C,) and x's dtype, is group norm
# written with mean, sub, mul and rsqrt (`_normalize_over`), a handful of ops whose rules and
# batching rules are all native (the statistics are reductions over dims one example owns).
# Its derivatives are torch.func's to rounding, not bit for bit.
def _group_norm_formula(x, num_groups, weight, bias, eps):
    shape = shape_of(x)
    n = shape[0]
    grouped = ops.reshape(x, n, num_groups, math.prod(shape[1:]) // num_groups)
    out, mean, rstd = _normalize_over(grouped, (2,), eps)
    out = ops.reshape(out, *shape)
    if weight is not None:
        out = ops.mul(out, _channel_view(weight, len(shape)))
    if bias is not None:
        out = ops.add(out, _channel_view(bias, len(shape)))
    return out, ops.reshape(mean, n, num_groups), ops.reshape(rstd, n, num_groups)


def _group_norm(x, num_groups, weight, bias, eps, *, statistics=True):
    """group_norm's output, mean and rstd (the statistics as native_group_norm gives them);
    without ``statistics``, the output alone where the kernels serve (F.group_norm, as
    F.layer_norm)."""
    _refuse_complex("group_norm", x, weight, bias)
    shape = shape_of(x)
    if len(shape) < 2:
        raise ShapeMismatchError(
            f"group_norm(input, num_groups={num_groups}): Expected at least 2 dimensions for "
            f"input tensor but received {len(shape)} (as in torch; shape {shape}). Fix: give "
            "an input (N, C, ...).")
    if shape[1] % num_groups:
        raise ShapeMismatchError(
            f"group_norm(input, num_groups={num_groups}): Expected number of channels in input "
            f"to be divisible by num_groups, but got input of shape {list(shape)} and "
            f"num_groups={num_groups} (as in torch). Fix: pick num_groups that divides C."
        )
    eps = float(eps)
    if not _kernels_serve(x, (shape[1],), weight, bias):
        return _group_norm_formula(x, num_groups, weight, bias, eps)
    out = _bind_affine(group_norm_p, (x,), weight, bias, num_groups=num_groups, eps=eps)
    return (out, *_gn_statistics(x, num_groups, eps)) if statistics else (out,)


@torch_api.register(F.group_norm)
def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    return _group_norm(x, int(num_groups), weight, bias, eps, statistics=False)[0]


torch_api.register(torch.group_norm)(
    lambda x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True:
    group_norm(x, num_groups, weight, bias, eps))
# (native_group_norm's mean and rstd are differentiable, as in torch when the output's
# cotangent is given too; torch drops their cotangents when the output has none.)
aten_api.register(aten.native_group_norm.default)(
    lambda x, weight, bias, n, c, hxw, group, eps: _group_norm(x, int(group), weight, bias, eps))


@torch_api.register(F.rms_norm, torch.rms_norm)
def rms_norm(x, normalized_shape, weight=None, eps=None):
    normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(int(s) for s in normalized_shape)
    dims = _normalized_dims("rms_norm", x, normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    out = ops.mul(x, elementwise.rsqrt(ops.add(ops.mean(ops.mul(x, x), dims, keepdim=True),
                                               eps)))
    return out if weight is None else ops.mul(out, weight)


def _clamp_min_no_grad(x, minimum):
    """max(x, minimum) whose derivative is 1 everywhere, as torch's cosine_similarity clamps
    its norms under no_grad: the value is clamped, the gradient is the unclamped one's."""
    return ops.where(ops.lt(x, minimum), ops.add(ops.sub(x, ops.detach(x)), minimum), x)


# NOTE [Norms inside nn ops]
# torch's normalize, cosine_similarity and pairwise_distance call ``norm`` (so
# linalg_vector_norm, with norm_backward's derivative), and pdist's fused kernel has a
# backward with the same case analysis: 0 where the norm is 0, 0 for p = 0 (a count), zero at
# x = 0 for p < 1. So each takes the structural family's vector_norm, whose rules follow
# torch's for every p (NOTE [Norms and their subgradients] in structural.py), rather than a
# p-norm of its own.
@torch_api.register(F.normalize)
def normalize(x, p=2.0, dim=1, eps=1e-12, out=None):
    if out is not None:
        raise InPlaceError("normalize(..., out=...): out= is not supported inside transforms. "
                           "Fix: use the returned value.")
    norm = structural.vector_norm(
        x, p, ops.normalize_dim(dim, len(shape_of(x)), op="normalize"), keepdim=True)
    return ops.div(x, ops.expand_as(elementwise.clamp_min(norm, eps), x))


@torch_api.register(F.cosine_similarity, torch.cosine_similarity)
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    shape = ops.broadcast_shapes(shape_of(x1), shape_of(x2), op="cosine_similarity")
    x1, x2 = ops.expand(x1, *shape), ops.expand(x2, *shape)
    dim = ops.normalize_dim(dim, len(shape), op="cosine_similarity")
    n1 = _clamp_min_no_grad(structural.vector_norm(x1, 2, dim, keepdim=True), eps)
    n2 = _clamp_min_no_grad(structural.vector_norm(x2, 2, dim, keepdim=True), eps)
    return ops.sum(ops.mul(ops.div(x1, n1), ops.div(x2, n2)), dim)


@torch_api.register(F.pairwise_distance, torch.pairwise_distance)
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    rank = max(len(shape_of(x1)), len(shape_of(x2)))
    difference = ops.add(ops.sub(x1, x2), eps)
    if rank == 0:
        return ops.abs(difference)
    return structural.vector_norm(difference, p, rank - 1, keepdim)


@torch_api.register(F.pdist, torch.pdist)
@aten_api.register(aten._pdist_forward.default)
def pdist(x, p=2.0):
    """The p-norm distances between the rows of an (N, M) input, pairs i < j in row order
    (NOTE [Norms inside nn ops]; for p = inf torch's kernel gives the whole cotangent to
    every element that reaches the maximum, vector_norm shares it among them: they agree
    where there are no ties)."""
    _refuse_complex("pdist", x)
    if len(shape_of(x)) != 2:
        raise TransformUsageError(f"pdist(input): expected a 2-D input, got shape {shape_of(x)}.")
    n, m = shape_of(x)
    first, second = torch.triu_indices(n, n, 1, device=x.device)
    rows = [ops.gather(x, 0, index[:, None].expand(len(index), m)) for index in (first, second)]
    return structural.vector_norm(ops.sub(*rows), p, 1)


# --- losses --------------------------------------------------------------------------------------
# NOTE [Losses at the front door]
# torch's losses are fused kernels (nll_loss_forward, binary_cross_entropy, huber_loss, ...)
# or Python composites. The common ones are written here from their definitions, with
# torch's full signatures: a few ops each, every derivative and batching rule native, and
# each term readable in a tape. The rest are torch composites of ops the engine knows, or
# have torch._decomp decompositions, and reach the engine through the back door.
def _reduction(size_average, reduce, reduction):
    """The reduction string, honouring the deprecated size_average and reduce arguments."""
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


def _reduce(loss, reduction, op):
    if reduction == "mean":
        return ops.mean(loss)
    if reduction == "sum":
        return ops.sum(loss)
    if reduction == "none":
        return loss
    raise TransformUsageError(
        f"{op}(..., reduction={reduction!r}): expected 'mean', 'sum' or 'none'. Fix: pass one "
        "of them."
    )


def _weighted_reduce(loss, weights, reduction, op):
    """A loss with per-element weights: 'mean' divides by the total weight (torch's rule
    for nll_loss and for the weighted mse and l1 losses)."""
    if reduction == "mean":
        return ops.div(ops.sum(loss), ops.sum(weights))
    return _reduce(loss, reduction, op)


def _class_dim(x):
    return 0 if len(shape_of(x)) == 1 else 1


def _check_class_weight(op, x, weight, prefix=""):
    """torch's check of a per-class weight: 1-D, one value per class. (Under vmap a batched
    weight of another shape would broadcast instead of failing.)"""
    if weight is None:
        return
    classes, w_shape = shape_of(x)[_class_dim(x)], shape_of(weight)
    if len(w_shape) != 1 or w_shape[0] != classes:
        raise ShapeMismatchError(
            f"{op}(input, target, weight): {prefix}weight tensor should be defined either for "
            f"all {classes} classes or no classes but got weight tensor of shape: "
            f"{list(w_shape)} (as in torch). Fix: pass one weight per class, {classes} in all.")


def _check_target(op, x, target):
    shape, t_shape = shape_of(x), shape_of(target)
    expected = shape[1:] if len(shape) == 1 else (shape[0],) + tuple(shape[2:])
    if len(shape) == 1:
        expected = ()
    if tuple(t_shape) != tuple(expected):
        raise TransformUsageError(
            f"{op}(input, target): expected class indices of shape {tuple(expected)} for an "
            f"input of shape {shape}, got {t_shape}. Fix: targets are (N, d1, ...) for an "
            "input (N, C, d1, ...)."
        )
    if target.dtype not in (torch.int64, torch.uint8):  # torch's kernel takes these two
        raise InputDtypeError(
            f"{op}(input, target): expected target dtype to be Long or Byte, but got "
            f"{_dtype_word(target.dtype)} (as in torch: class indices). Fix: pass target.long() "
            "(or, to cross_entropy, float class probabilities of the input's shape)."
        )


_DTYPE_WORDS = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int8: "Char", torch.int16: "Short",
                torch.int32: "Int", torch.int64: "Long", torch.uint8: "Byte",
                torch.bool: "Bool", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble"}


def _dtype_word(dtype) -> str:
    """A dtype as torch's messages name it (its ScalarType: ``Float`` for torch.float32)."""
    return _DTYPE_WORDS.get(dtype, str(dtype))


def _require_long_target(op, target):
    """The margin losses' kernels take Long class indices only (nll_loss's take Byte too)."""
    if target.dtype != torch.int64:
        raise InputDtypeError(
            f"{op}(input, target): expected scalar type Long but found "
            f"{_dtype_word(target.dtype)} (as in torch). Fix: pass target.long().")


def _target_weights(target, weight, ignore_index, dtype):
    """The weight of each target's class (1 without class weights), 0 where the target is
    ignore_index; and the targets with ignored ones replaced by class 0, safe to gather."""
    kept = ops.ne(target, ignore_index)
    safe = ops.where(kept, target, 0)
    if safe.dtype == torch.uint8:  # (torch's kernels take byte targets; gather takes long)
        safe = ops.convert(safe, torch.int64)
    if weight is None:
        return ops.convert(kept, dtype), safe
    flat = ops.gather(weight, 0, ops.reshape(safe, -1))
    return ops.where(kept, ops.reshape(flat, *shape_of(target)), 0.0), safe


# NOTE [nll_loss: torch's kernels as a linear pair]
# nll_loss is linear in the log-probabilities: it picks -w[t] * x[t] per target and reduces.
# Written with ops it is about ten ops (ne, where, gather, squeeze, mul, sum, div, ...), each
# of which every transform level dispatches, and about six more in its vjp; it is the most
# common loss of a classifier, so it is a pair of primitives here, like avg_pool (NOTE [A
# linear kernel and its transpose]): nll_loss (torch's forward kernel) and nll_loss_backward
# (its backward kernel), each the other's transpose, each its own jvp. Under vmap the batch
# joins N: one kernel with reduction='none', then each example's own sum or weighted mean,
# which is how torch.func batches it too (its nll_loss decomposition). The targets and class
# weights carry no derivative; a class weight that is a transform's value (differentiated or
# batched), and inputs of more than two dims, take the ops below instead.
_REDUCTIONS = ("none", "mean", "sum")  # torch's enum order


# The mean's denominator (the summed weights of the kept targets) is the forward kernel's
# second output, which its backward kernel takes: without class weights it is kept for the
# backward (NOTE [Kernels with two outputs]), keyed by the targets, where recomputing it
# would cost five kernels (ne, where, a conversion, a sum and a scalar).
_NLL_TOTAL_WEIGHT = _KeptOutput()


def _nll_loss_impl(x, target, weight, *, reduction, ignore_index):
    if reduction == "mean" and weight is None:  # (x is 1-D or 2-D: nll_loss_nd's own call)
        loss, total = aten.nll_loss_forward(x, target, None, 1, ignore_index)
        _NLL_TOTAL_WEIGHT.keep(target, (ignore_index, x.dtype), total)
        return loss
    return torch._C._nn.nll_loss_nd(x, target, weight, _REDUCTIONS.index(reduction),
                                    ignore_index)


def _nll_loss_backward_impl(ct, target, weight, *, input_shape, reduction, ignore_index):
    total = None
    if reduction == "mean" and weight is None:
        total = _NLL_TOTAL_WEIGHT.take(target, (ignore_index, ct.dtype))
    if total is None:
        total = (ops.sum(_target_weights(target, weight, ignore_index, ct.dtype)[0])
                 if reduction == "mean" else ct.new_ones(()))
    return aten.nll_loss_backward(ct, ct.new_empty(input_shape), target, weight,
                                  _REDUCTIONS.index(reduction), ignore_index, total)


nll_loss_p = P.primitive("nll_loss", _nll_loss_impl)
nll_loss_backward_p = P.primitive("nll_loss_backward", _nll_loss_backward_impl)


def nll_loss_vjp(x, target, weight, **params):
    x_shape = shape_of(x)
    return (bind(nll_loss_p, x, target, weight, **params),
            lambda ct: (bind(nll_loss_backward_p, ct, target, weight, input_shape=x_shape,
                             **params), None, None))
vjp_rules[nll_loss_p] = nll_loss_vjp


def nll_loss_backward_vjp(ct, target, weight, *, input_shape, **params):
    return (bind(nll_loss_backward_p, ct, target, weight, input_shape=input_shape, **params),
            lambda g: (bind(nll_loss_p, g, target, weight, **params), None, None))
vjp_rules[nll_loss_backward_p] = nll_loss_backward_vjp
jvp_rules[nll_loss_p] = linear_jvp(nll_loss_p)
jvp_rules[nll_loss_backward_p] = linear_jvp(nll_loss_backward_p)


def _nll_rows(values, bdims, rank):
    """A batched nll_loss (or its backward) as one flat call: the first operand (B, *example)
    and the targets (B*N,), the batch joined with N (an unbatched operand is broadcast);
    ``rank`` is the rank of one example's input (1: (C,), N = 1; 2: (N, C))."""
    (x, target, _), (x_bdim, t_bdim, _) = values, bdims
    b = batch_size(values, bdims)
    x, target = to_front((x, target), (x_bdim, t_bdim), expand_unbatched=True, size=b)
    n = 1 if rank == 1 else shape_of(target)[1]
    return x, ops.reshape(target, b * n), b, n


def _example_weights(target, weight, ignore_index, b, n):
    """Each example's mean denominator, (B,): the summed weights of its kept targets (a
    bool count without class weights, which the division promotes)."""
    if weight is None:
        weights = ops.ne(target, ignore_index)
    else:
        weights, _ = _target_weights(target, weight, ignore_index, weight.dtype)
    return weights if n == 1 else ops.sum(ops.reshape(weights, b, n), (1,))


def nll_loss_batch(values, bdims, *, reduction, ignore_index):
    weight = values[2]
    rank = len(shape_of(values[0])) - (bdims[0] is not None)
    x, target, b, n = _nll_rows(values, bdims, rank)
    loss = bind(nll_loss_p, ops.reshape(x, b * n, shape_of(x)[-1]), target, weight,
                reduction="none", ignore_index=ignore_index)  # (B*N,)
    if reduction == "none":
        return (loss if rank == 1 else ops.reshape(loss, b, n)), 0
    if n != 1:
        loss = ops.sum(ops.reshape(loss, b, n), (1,))
    if reduction == "mean":
        loss = ops.div(loss, _example_weights(target, weight, ignore_index, b, n))
    return loss, 0
batching_rules[nll_loss_p] = nll_loss_batch


def nll_loss_backward_batch(values, bdims, *, input_shape, reduction, ignore_index):
    weight = values[2]
    ct, target, b, n = _nll_rows(values, bdims, len(input_shape))
    if reduction == "mean":  # each example's cotangent over its own denominator
        ct = ops.div(ct, _example_weights(target, weight, ignore_index, b, n))
    if reduction != "none" and n != 1:  # one cotangent per example, the same for its N terms
        ct = ops.expand(ops.unsqueeze(ct, 1), b, n)
    out = bind(nll_loss_backward_p, ops.reshape(ct, b * n), target, weight,
               input_shape=(b * n, input_shape[-1]), reduction="none", ignore_index=ignore_index)
    return ops.reshape(out, b, *input_shape), 0
batching_rules[nll_loss_backward_p] = nll_loss_backward_batch


def _nll_loss(log_probs, target, weight, ignore_index, reduction, op="nll_loss"):
    """NOTE [ignore_index]
    Targets equal to ignore_index contribute nothing: their loss is 0, their weight is 0 in
    the mean's denominator, and their gradient is 0. The picked log-probability is gathered
    with the ignored targets replaced by a valid class (ignore_index is often -100, which no
    gather may read); the zero weight then removes it."""
    _check_target(op, log_probs, target)
    _check_class_weight(op, log_probs, weight)
    if (len(shape_of(log_probs)) in (1, 2) and not isinstance(weight, Value)
            and reduction in _REDUCTIONS):
        # NOTE [nll_loss: torch's kernels as a linear pair]
        return bind(nll_loss_p, log_probs, target, weight, reduction=reduction,
                    ignore_index=ignore_index)
    class_dim = _class_dim(log_probs)
    weights, safe = _target_weights(target, weight, ignore_index, log_probs.dtype)
    picked = ops.squeeze(ops.gather(log_probs, class_dim, ops.unsqueeze(safe, class_dim)),
                         class_dim)
    # -picked * w as picked * -w (the same bits): the negation falls on the weights, which
    # carry no derivative, so a gradient transform records and propagates one op less
    return _weighted_reduce(ops.mul(picked, ops.neg(weights)), weights, reduction, op)


@torch_api.register(F.nll_loss)
def nll_loss(x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    _refuse_complex("nll_loss", x)
    return _nll_loss(x, target, weight, int(ignore_index),
                     _reduction(size_average, reduce, reduction))


@aten_api.register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    """(loss, total_weight), with reduction as torch's enum (0 none, 1 mean, 2 sum)."""
    reduction = _REDUCTIONS[reduction]
    weights, _ = _target_weights(target, weight, int(ignore_index), x.dtype)
    loss = _nll_loss(x, target, weight, int(ignore_index), reduction)
    total = ops.sum(weights) if reduction != "none" else ops.sum(ops.mul(weights, 0.0))
    return loss, ops.detach(total)


aten_api.register(aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default)(
    lambda x, target, weight=None, reduction=1, ignore_index=-100:
    _nll_loss(x, target, weight, int(ignore_index), _REDUCTIONS[reduction]))


@torch_api.register(F.cross_entropy)
def cross_entropy(x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """Cross-entropy from logits, with class indices or class probabilities.

    With label smoothing e, the target distribution is (1 - e) * one_hot + e / C, so the loss
    is (1 - e) * nll + e / C * (the sum of -log p over the classes, weighted)."""
    _refuse_complex("cross_entropy", x)
    reduction = _reduction(size_average, reduce, reduction)
    _check_class_weight("cross_entropy", x, weight,
                        "cross_entropy: " if target.dtype.is_floating_point else "")
    class_dim = _class_dim(x)
    classes = shape_of(x)[class_dim]
    log_probs = ops.log_softmax(x, class_dim)
    rank = len(shape_of(x))
    weight_view = None if weight is None else _channel_view(weight, rank, class_dim)
    if target.dtype.is_floating_point:  # class probabilities
        if shape_of(target) != shape_of(x):
            # (torch reads a float target of another shape as class indices, and refuses it)
            raise InputDtypeError(
                f"cross_entropy(input, target): expected target dtype to be Long or Byte, but "
                f"got {_dtype_word(target.dtype)} (as in torch: a float target is class "
                f"probabilities only with the input's shape {shape_of(x)}, and it has shape "
                f"{shape_of(target)}). Fix: pass one probability per class, or class indices "
                "(long)."
            )
        if label_smoothing:
            target = ops.add(ops.mul(target, 1 - label_smoothing), label_smoothing / classes)
        terms = ops.mul(log_probs, target)
        if weight_view is not None:
            terms = ops.mul(terms, weight_view)
        return _reduce(ops.neg(ops.sum(terms, class_dim)), reduction, "cross_entropy")
    loss = _nll_loss(log_probs, target, weight, int(ignore_index), reduction, "cross_entropy")
    if not label_smoothing:
        return loss
    weights, _ = _target_weights(target, weight, int(ignore_index), x.dtype)
    every_class = log_probs if weight_view is None else ops.mul(log_probs, weight_view)
    smooth = ops.where(ops.ne(target, ignore_index), ops.neg(ops.sum(every_class, class_dim)),
                       0.0)
    if reduction == "mean":
        smooth = ops.div(ops.sum(smooth), ops.sum(weights))
    elif reduction == "sum":
        smooth = ops.sum(smooth)
    return ops.add(ops.mul(loss, 1 - label_smoothing),
                   ops.mul(smooth, label_smoothing / classes))


def _check_same_shape(op, x, target):
    if shape_of(x) != shape_of(target):
        raise TransformUsageError(
            f"{op}(input, target): expected a target of the input's shape {shape_of(x)}, got "
            f"{shape_of(target)}. Fix: give one target per input element."
        )


# NOTE [binary_cross_entropy: torch's kernel and its formulas]
# -(t log x + (1 - t) log(1 - x)), each log clamped at -100, per element: torch's kernel
# (reduction 'none'), with derivatives.yaml's formulas rather than the derivative of the
# clamped logs. Those differ where the clamp binds: a sigmoid's output that rounds to exactly
# 0 or 1, where the clamp's zero derivative times log's infinite one is nan, and torch's
# binary_cross_entropy_backward divides by max(x (1 - x), 1e-12) instead (a large, finite
# gradient). The formulas are written with ops, so the higher derivatives follow.
_BCE_EPSILON = 1e-12

binary_cross_entropy_p = P.primitive(  # (the kernel does not broadcast; under vmap the
    "binary_cross_entropy",               # batched argument may meet an unbatched one)
    lambda x, target: aten.binary_cross_entropy(*torch.broadcast_tensors(x, target), None, 0))
elementwise.binary_rules(
    binary_cross_entropy_p,
    # binary_cross_entropy_backward: grad (x - t) / max((1 - x) x, eps)
    elementwise.OfGrad(lambda g, x, t, out: ops.div(
        ops.mul(g, ops.sub(x, t)),
        elementwise.clamp_min(ops.mul(ops.sub(1, x), x), _BCE_EPSILON))),
    # binary_cross_entropy_target_backward: -logit(x) grad
    elementwise.OfGrad(lambda g, x, t, out: ops.mul(ops.neg(elementwise.logit(x)), g)))


@torch_api.register(F.binary_cross_entropy)
def binary_cross_entropy(x, target, weight=None, size_average=None, reduce=None,
                         reduction="mean"):
    """-(t log x + (1 - t) log(1 - x)), each log clamped at -100 as torch does."""
    _refuse_complex("binary_cross_entropy", x, target)
    _check_same_shape("binary_cross_entropy", x, target)
    # torch's kernel reads every element (NOTE [Checks of values, in eager code and in
    # programs] in indexing.py)
    x, target = (indexing.refuse_outside(
        "binary_cross_entropy(input, target)", value, 0, 1, InvalidOptionError,
        f"all elements of {name} should be between 0 and 1",
        why=f"{name} is a probability; got {{value}}",
        fix="pass probabilities (a sigmoid's output), or use "
            "F.binary_cross_entropy_with_logits on the logits")
        for name, value in (("input", x), ("target", target)))
    loss = bind(binary_cross_entropy_p, x, target)
    if weight is not None:
        loss = ops.mul(loss, weight)
    return _reduce(loss, _reduction(size_average, reduce, reduction), "binary_cross_entropy")


aten_api.register(aten.binary_cross_entropy.default)(
    lambda x, target, weight=None, reduction=1: binary_cross_entropy(
        x, target, weight, reduction=_REDUCTIONS[reduction]))


@torch_api.register(F.binary_cross_entropy_with_logits)
def binary_cross_entropy_with_logits(x, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """(1 - t) x - w_pos log sigmoid(x), with w_pos = 1 + (pos_weight - 1) t: the log-sum-exp
    form, exact for large |x| (torch's formula)."""
    _refuse_complex("binary_cross_entropy_with_logits", x, target)
    _check_same_shape("binary_cross_entropy_with_logits", x, target)
    log_sigmoid = elementwise._log_sigmoid(x)
    if pos_weight is not None:
        log_sigmoid = ops.mul(ops.add(ops.mul(ops.sub(pos_weight, 1), target), 1), log_sigmoid)
    loss = ops.sub(ops.mul(ops.sub(1, target), x), log_sigmoid)
    if weight is not None:
        loss = ops.mul(loss, weight)
    return _reduce(loss, _reduction(size_average, reduce, reduction),
                   "binary_cross_entropy_with_logits")


def _pointwise_loss(op, x, target, reduction, weight, elementwise_loss):
    if op != "l1_loss":  # |x - t| takes complex numbers (abs's derivative); torch's others don't
        _refuse_complex(op, x, target)
    x_shape, t_shape = shape_of(x), shape_of(target)
    if x_shape != t_shape:  # (torch broadcasts them, and warns)
        shape = ops.broadcast_shapes(x_shape, t_shape, op=op)
        x, target = ops.expand(x, *shape), ops.expand(target, *shape)
    loss = elementwise_loss(ops.sub(x, target))
    if weight is None:
        return _reduce(loss, reduction, op)
    if shape_of(weight) != shape_of(x):
        raise TransformUsageError(
            f"{op}(input, target, weight=...): expected weights of the input's shape "
            f"{shape_of(x)}, got {shape_of(weight)}. Fix: give one weight per element."
        )
    return _weighted_reduce(ops.mul(loss, weight), weight, reduction, op)


# NOTE [Pointwise losses: torch's kernel and its backward]
# mean((x - t)^2) written with ops is three ops (sub, mul, mean), and its vjp six more (the
# mean's division and expand, the square's two products and their sum); smooth_l1 and huber
# are twice that (a where between a square and a line). mse is the loss of every regression,
# and MAML takes its gradient under vmap, where each of those ops is a bind at every level.
# So each is a pair of primitives, as torch.func runs it: the loss (torch's kernel) and its
# backward (torch's backward kernel: the loss's slope at x - t times ct, over the element
# count for 'mean'), with the formulas of PyTorch's derivatives.yaml, which need one more
# fact per loss, its second derivative at d = x - t (``curvature``; 2 for mse):
#   the loss's vjp: backward(ct, x, t) for x, and backward(ct, t, x) for t (the slope is odd
#   in d: its negation, bit for bit); its jvp: the reduction of backward(x_dot, x, t) +
#   backward(t_dot, t, x), each with reduction 'none';
#   the backward's own derivatives: it is linear in ct (the reduction of backward(g, x, t)
#   with 'none'), and in x and t its derivative is g ct curvature(d) (over the element count
#   for 'mean'), written with ops, so higher orders follow.
# Under vmap the batch rides along with reduction='none', and each example's mean or sum
# follows (as torch.func batches it). A weight, a target of another shape (torch broadcasts
# it, and warns) or of another dtype take the ops (_pointwise_loss).
def _loss_scale(x, reduction):
    """The constant of a pointwise loss's derivative: 1 over the element count for 'mean'."""
    return 1.0 / max(math.prod(shape_of(x)), 1) if reduction == "mean" else 1.0


def pointwise_loss_kernels(name, kernel, backward_kernel, curvature):
    """The primitives (loss, loss_backward) of a pointwise loss and their rules, from torch's
    ``kernel(x, t, reduction, **static)`` and ``backward_kernel(ct, x, t, reduction,
    **static)`` (reduction as torch's enum) and ``curvature(d, **static)``, the loss's second
    derivative at d = x - t: a number, or ops on d (NOTE [Pointwise losses: torch's kernel and
    its backward])."""
    forward_p = P.primitive(name, lambda x, target, *, reduction, **static: kernel(
        x, target, _REDUCTIONS.index(reduction), **static))
    backward_p = P.primitive(f"{name}_backward", lambda ct, x, target, *, reduction, **static:
                             backward_kernel(ct, x, target, _REDUCTIONS.index(reduction),
                                             **static))

    def each_slope_times(v, x, target, static):
        """The slope at x - t, times v, per element (the backward with reduction 'none')."""
        return bind(backward_p, v, x, target, reduction="none", **static)

    def curvature_times(v, x, target, reduction, static):
        """v times the second derivative at x - t (over the element count for 'mean')."""
        factor = curvature(ops.sub(x, target), **static)
        if isinstance(factor, NUMBERS):
            return ops.mul(v, factor * _loss_scale(x, reduction))
        return ops.mul(ops.mul(v, factor), _loss_scale(x, reduction))

    def forward_vjp(x, target, *, reduction, **static):
        def backward(ct):
            return (bind(backward_p, ct, x, target, reduction=reduction, **static)
                    if wants_cotangent(0, x) else None,
                    bind(backward_p, ct, target, x, reduction=reduction, **static)
                    if wants_cotangent(1, target) else None)
        return bind(forward_p, x, target, reduction=reduction, **static), backward

    def forward_jvp(primals, tangents, *, reduction, **static):
        (x, target), (x_dot, target_dot) = primals, tangents
        out_dot = None
        if x_dot is not None:
            out_dot = each_slope_times(x_dot, x, target, static)
        if target_dot is not None:
            out_dot = add_tangents(out_dot, each_slope_times(target_dot, target, x, static))
        return (bind(forward_p, x, target, reduction=reduction, **static),
                _reduce(out_dot, reduction, name))

    def forward_batch(values, bdims, *, reduction, **static):
        x, target = to_front(values, bdims, expand_unbatched=True)
        loss = bind(forward_p, x, target, reduction="none", **static)
        example_dims = tuple(range(1, len(shape_of(loss))))
        if reduction == "none" or not example_dims:  # (the mean or sum of one number is itself)
            return loss, 0
        reduce = ops.mean if reduction == "mean" else ops.sum
        return reduce(loss, example_dims), 0

    def backward_vjp(ct, x, target, *, reduction, **static):
        def backward(g):
            ct_ct = ct_x = ct_target = None
            if wants_cotangent(0, ct):
                ct_ct = _reduce(each_slope_times(g, x, target, static), reduction,
                                f"{name}_backward")
            if wants_cotangent(1, x) or wants_cotangent(2, target):
                ct_x = curvature_times(ops.mul(g, ct), x, target, reduction, static)
                ct_target = ops.neg(ct_x) if wants_cotangent(2, target) else None
                ct_x = ct_x if wants_cotangent(1, x) else None
            return ct_ct, ct_x, ct_target
        return bind(backward_p, ct, x, target, reduction=reduction, **static), backward

    def backward_jvp(primals, tangents, *, reduction, **static):
        (ct, x, target), (ct_dot, x_dot, target_dot) = primals, tangents
        out_dot = None
        if ct_dot is not None:
            out_dot = bind(backward_p, ct_dot, x, target, reduction=reduction, **static)
        difference_dot = sub_tangents(x_dot, target_dot)
        if difference_dot is not None:
            out_dot = add_tangents(out_dot, curvature_times(ops.mul(difference_dot, ct), x,
                                                            target, reduction, static))
        return bind(backward_p, ct, x, target, reduction=reduction, **static), out_dot

    def backward_batch(values, bdims, *, reduction, **static):
        ct, x, target = to_front(values, bdims, expand_unbatched=True)
        x_shape = shape_of(x)
        if reduction != "none":  # each example's cotangent, spread over its elements
            ct = ops.reshape(ct, x_shape[0], *[1] * (len(x_shape) - 1))
            if reduction == "mean":
                ct = ops.div(ct, max(math.prod(x_shape[1:]), 1))
            ct = ops.expand(ct, *x_shape)
        return bind(backward_p, ct, x, target, reduction="none", **static), 0

    vjp_rules[forward_p], jvp_rules[forward_p] = forward_vjp, forward_jvp
    batching_rules[forward_p] = forward_batch
    vjp_rules[backward_p], jvp_rules[backward_p] = backward_vjp, backward_jvp
    batching_rules[backward_p] = backward_batch
    return forward_p, backward_p


mse_loss_p, mse_loss_backward_p = pointwise_loss_kernels(
    "mse_loss", torch._C._nn.mse_loss, aten.mse_loss_backward, lambda d: 2.0)


def _inside(d, width, *, boundary_inside):
    """|d| < width (or <=), a nan inside: as torch's kernels test the linear pieces
    (d < -width, d > width)."""
    outside = ops.ge(ops.abs(d), width) if not boundary_inside else ops.gt(ops.abs(d), width)
    return ops.where(outside, 0.0, 1.0)


def _smooth_l1_curvature(d, *, beta):
    """1 / beta where |d| < beta (at |d| = beta, the line's 0, as derivatives.yaml's
    smooth_l1_loss_double_backward); 0 for beta 0 (|d|)."""
    if beta == 0:
        return 0.0
    return ops.div(_inside(d, beta, boundary_inside=False), beta)


def _huber_curvature(d, *, delta):
    """1 where |d| <= delta (at |d| = delta the quadratic's, as torch.func's Hessian of
    huber_loss gives)."""
    return _inside(d, delta, boundary_inside=True)


smooth_l1_loss_p, smooth_l1_loss_backward_p = pointwise_loss_kernels(
    "smooth_l1_loss", torch._C._nn.smooth_l1_loss, aten.smooth_l1_loss_backward,
    _smooth_l1_curvature)
huber_loss_p, huber_loss_backward_p = pointwise_loss_kernels(
    "huber_loss", torch._C._nn.huber_loss, aten.huber_loss_backward, _huber_curvature)


def _loss_kernel_applies(x, target, reduction, weight):
    """Whether a pointwise loss is its kernel pair: no weight, tensors of one floating (not
    complex) dtype and one shape."""
    return (weight is None and reduction in _REDUCTIONS and _is_tensor(x) and _is_tensor(target)
            and shape_of(x) == shape_of(target) and x.dtype == target.dtype
            and x.dtype.is_floating_point)


def _mse_loss(x, target, reduction, weight):
    if _loss_kernel_applies(x, target, reduction, weight):
        # NOTE [Pointwise losses: torch's kernel and its backward]
        return bind(mse_loss_p, x, target, reduction=reduction)
    return _pointwise_loss("mse_loss", x, target, reduction, weight, ops.square)


@torch_api.register(F.mse_loss)
def mse_loss(x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    return _mse_loss(x, target, _reduction(size_average, reduce, reduction), weight)


@torch_api.register(F.l1_loss)
def l1_loss(x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    # (torch's F.l1_loss does not pass weight on to __torch_function__: a weighted l1_loss of
    # a transformed input never reaches here with its weight. See the report.)
    return _pointwise_loss("l1_loss", x, target, _reduction(size_average, reduce, reduction),
                           weight, ops.abs)


def _quadratic_then_linear(d, width, quadratic_scale, linear_scale, *, boundary_inside):
    """``quadratic_scale * d^2`` where |d| < width, ``linear_scale * (|d| - width / 2)``
    elsewhere: smooth_l1 and huber. The square sees 0 outside (a where before it as well as
    after), so its unused branch has a zero gradient there, not ``0 * inf`` = nan at an
    infinite d: torch's backward kernels give the linear piece's slope. A nan counts as
    inside, as in those kernels (their linear pieces are ``d < -width`` and ``d > width``).
    At |d| = width both pieces have the same value and slope; the second derivative there is
    the quadratic's for huber and the linear's for smooth_l1 (``boundary_inside``), as their
    double backwards in derivatives.yaml give."""
    absolute = ops.abs(d)
    outside = ops.gt(absolute, width) if boundary_inside else ops.ge(absolute, width)
    inside = elementwise.logical_not(outside)
    quadratic = ops.mul(ops.square(ops.where(inside, d, 0.0)), quadratic_scale)
    return ops.where(inside, quadratic,
                     ops.mul(ops.sub(absolute, 0.5 * width), linear_scale))


def _smooth_l1(beta):
    """0.5 d^2 / beta where |d| < beta, |d| - 0.5 beta elsewhere (beta 0: |d|)."""
    def loss(d):
        if beta == 0:
            return ops.abs(d)
        return _quadratic_then_linear(d, beta, 0.5 / beta, 1.0, boundary_inside=False)
    return loss


def _huber(delta):
    """0.5 d^2 where |d| < delta, delta (|d| - 0.5 delta) elsewhere."""
    return lambda d: _quadratic_then_linear(d, delta, 0.5, delta, boundary_inside=True)


@torch_api.register(F.smooth_l1_loss)
def smooth_l1_loss(x, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    if beta < 0:
        raise TransformUsageError(f"smooth_l1_loss(..., beta={beta}): expected beta >= 0.")
    return _smooth_l1_loss(x, target, _reduction(size_average, reduce, reduction), beta)


def _smooth_l1_loss(x, target, reduction, beta):
    if _loss_kernel_applies(x, target, reduction, None):
        # NOTE [Pointwise losses: torch's kernel and its backward]
        return bind(smooth_l1_loss_p, x, target, reduction=reduction, beta=float(beta))
    return _pointwise_loss("smooth_l1_loss", x, target, reduction, None, _smooth_l1(beta))


@torch_api.register(F.huber_loss)
def huber_loss(x, target, reduction="mean", delta=1.0, weight=None):
    if delta <= 0:
        raise InvalidOptionError(
            f"huber_loss(..., delta={delta}): huber_loss does not support non-positive values "
            "for delta. (as in torch). Fix: pass delta > 0.")
    if _loss_kernel_applies(x, target, reduction, weight):
        # NOTE [Pointwise losses: torch's kernel and its backward]
        return bind(huber_loss_p, x, target, reduction=reduction, delta=float(delta))
    loss = _pointwise_loss("huber_loss", x, target, "none", None, _huber(delta))
    if weight is not None:
        loss = ops.mul(loss, weight)  # torch's weighted huber loss averages over elements
    return _reduce(loss, reduction, "huber_loss")


aten_api.register(aten.mse_loss.default)(
    lambda x, target, reduction=1: _mse_loss(x, target, _REDUCTIONS[reduction], None))
aten_api.register(aten.l1_loss.default)(
    lambda x, target, reduction=1: _pointwise_loss("l1_loss", x, target, _REDUCTIONS[reduction],
                                                   None, ops.abs))
aten_api.register(aten.smooth_l1_loss.default)(
    lambda x, target, reduction=1, beta=1.0: _smooth_l1_loss(x, target, _REDUCTIONS[reduction],
                                                             beta))
aten_api.register(aten.huber_loss.default)(
    lambda x, target, reduction=1, delta=1.0: huber_loss(x, target, _REDUCTIONS[reduction],
                                                         delta))


@torch_api.register(F.kl_div)
def kl_div(x, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """The pointwise KL divergence t (log t - x) (x and, with log_target, t are logs);
    'batchmean' divides the sum by the batch size."""
    _refuse_complex("kl_div", x, target)
    if log_target:
        loss = ops.mul(ops.exp(target), ops.sub(target, x))
    else:
        loss = ops.sub(elementwise.xlogy(target, target), ops.mul(target, x))
    reduction = _reduction(size_average, reduce, reduction)
    if reduction == "batchmean":
        total = ops.sum(loss)
        return ops.div(total, shape_of(x)[0]) if shape_of(x) else total
    return _reduce(loss, reduction, "kl_div")


@torch_api.register(F.softmin)
def softmin(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise TransformUsageError("softmin(x): expected an explicit dim, got None. Fix: pass "
                                  "dim=-1 (or the dim to normalize over).")
    if dtype is not None:
        x = ops.convert(x, dtype)
    return ops.softmax(ops.neg(x), dim)


def _positive_part(z):
    """z where z > 0, else 0: the margin terms of torch's multi-margin kernels, which add a
    term only ``if (z > 0)``. So a margin of exactly 0, or nan, has no gradient and a nan adds
    nothing (clamp_min, as torch._decomp writes it, passes the gradient at 0 and keeps the nan;
    relu passes it at nan)."""
    return ops.where(ops.gt(z, 0), z, 0.0)


def _multilabel_margin(x, target, reduction):
    """For each sample: the sum over its target classes j (those before the first -1) and
    over the other classes i of max(0, 1 - (x[j] - x[i])), divided by C.

    (torch._decomp's decomposition of multilabel_margin_loss_forward also counts the
    positions after the first -1, so it disagrees with torch's kernel: this op is written
    here rather than borrowed.)"""
    _refuse_complex("multilabel_margin_loss", x)
    _require_long_target("multilabel_margin_loss", target)
    if len(shape_of(x)) in (1, 2) and shape_of(x)[-1] == 0:
        raise ShapeMismatchError(
            "multilabel_margin_loss(input, target): Expected non-empty vector or matrix with "
            f"optional 0-dim batch size, but got: {list(shape_of(x))} (as in torch). Fix: give "
            "each sample at least one class.")
    if len(shape_of(x)) == 0 and len(shape_of(target)) == 0:  # one sample of one class
        x, target = ops.reshape(x, 1), ops.reshape(target, 1)
    if shape_of(x) != shape_of(target) or len(shape_of(x)) not in (1, 2):
        raise ShapeMismatchError(
            f"multilabel_margin_loss(input, target): expected a (C,) or (N, C) input and a "
            f"target of its shape, got {shape_of(x)} and {shape_of(target)} (torch refuses "
            "them too). Fix: pad each sample's target classes with -1."
        )
    vector = len(shape_of(x)) == 1
    if vector:
        x, target = ops.unsqueeze(x, 0), ops.unsqueeze(target, 0)
    classes = shape_of(x)[1]
    positions = torch.arange(classes, device=x.device)
    # a target slot counts if it comes before the sample's first -1
    first_end = ops.amin(ops.where(ops.eq(target, -1), positions, classes), -1, keepdim=True)
    counts = ops.lt(positions, first_end)
    picked = ops.gather(x, 1, ops.where(counts, target, 0))  # x[y_j]
    # class i is a target of its sample if a counted slot names it
    names_i = ops.eq(ops.unsqueeze(ops.where(counts, target, -1), -1), positions)
    is_target = ops.gt(ops.sum(names_i, 1), 0)
    margins = _positive_part(ops.add(ops.sub(1, ops.unsqueeze(picked, -1)),
                                     ops.unsqueeze(x, 1)))
    keep = elementwise.logical_and(ops.unsqueeze(counts, -1),
                                   elementwise.logical_not(ops.unsqueeze(is_target, 1)))
    loss = ops.div(ops.sum(ops.where(keep, margins, 0.0), (1, 2)), classes)
    if reduction == "none" and vector:
        loss = ops.squeeze(loss, 0)
    is_target = ops.convert(ops.squeeze(is_target, 0) if vector else is_target, x.dtype)
    return _reduce(loss, reduction, "multilabel_margin_loss"), is_target


@torch_api.register(F.multilabel_margin_loss)
def multilabel_margin_loss(x, target, size_average=None, reduce=None, reduction="mean"):
    return _multilabel_margin(x, target, _reduction(size_average, reduce, reduction))[0]


aten_api.register(aten.multilabel_margin_loss_forward.default)(
    lambda x, target, reduction: _multilabel_margin(x, target, _REDUCTIONS[reduction]))


def _multi_margin(x, target, p, margin, weight, reduction):
    """For each sample: the sum over the classes i other than its target y of
    w[y] * max(0, margin - x[y] + x[i])^p, divided by C."""
    _refuse_complex("multi_margin_loss", x)
    if p not in (1, 2):
        raise TransformUsageError(f"multi_margin_loss(..., p={p}): only p == 1 and p == 2 "
                                  "supported (as in torch). Fix: pass p=1 or p=2.")
    if weight is not None and len(shape_of(weight)) != 1:
        raise TransformUsageError(
            "multi_margin_loss(..., weight): weight must be one-dimensional (as in torch; shape "
            f"{shape_of(weight)}). Fix: pass one weight per class.")
    _require_long_target("multi_margin_loss", target)
    target_shape = shape_of(target)
    if len(shape_of(x)) <= 1:  # one sample ((C,), or () for one class)
        x, target = ops.reshape(x, 1, -1), ops.reshape(target, -1)
    if len(shape_of(x)) != 2 or shape_of(target) != shape_of(x)[:1]:
        raise ShapeMismatchError(
            f"multi_margin_loss(input, target): expected a (C,) or (N, C) input and one class "
            f"index per sample, got shapes {shape_of(x)} and {target_shape} (torch refuses "
            "them too). Fix: pass a 1-D target of class indices."
        )
    classes = shape_of(x)[1]
    column = ops.unsqueeze(target, 1)
    margins = _positive_part(ops.add(ops.sub(margin, ops.gather(x, 1, column)), x))
    if p == 2:
        margins = ops.square(margins)
    if weight is not None:
        margins = ops.mul(margins, ops.unsqueeze(ops.gather(weight, 0, target), 1))
    others = ops.ne(column, torch.arange(classes, device=x.device))
    loss = ops.div(ops.sum(ops.where(others, margins, 0.0), 1), classes)
    if reduction == "none":
        return ops.reshape(loss, *target_shape)  # torch: the shape of the target
    return _reduce(loss, reduction, "multi_margin_loss")


@torch_api.register(F.multi_margin_loss)
def multi_margin_loss(x, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None,
                      reduction="mean"):
    return _multi_margin(x, target, p, margin, weight, _reduction(size_average, reduce,
                                                                  reduction))


aten_api.register(aten.multi_margin_loss.default)(
    lambda x, target, p=1, margin=1.0, weight=None, reduction=1: _multi_margin(
        x, target, p, margin, weight, _REDUCTIONS[reduction]))


# --- interpolation -------------------------------------------------------------------------------
# NOTE [Interpolation is a linear kernel and its transpose]
# Every upsampling mode of F.interpolate ('area' is adaptive average pooling) is a linear map
# of its input, and torch has a kernel for it and one for its transpose, the backward
# (``upsample_bilinear2d`` and ``upsample_bilinear2d_backward``, and so on for nearest,
# nearest-exact, linear, bicubic, trilinear and the antialiased kernels). So interpolation is
# one pair of primitives, upsample and upsample_backward, with the kernel's name a parameter,
# as avg_pool is a pair (NOTE [A linear kernel and its transpose]). torch's own rules for
# source coordinates (align_corners, scale factors, the half-pixel shifts), its clamping at
# the borders and its handling of an inf or nan (which stays in the outputs whose taps read
# it) come with the kernels, and values and gradients are torch.func's bit for bit. (An
# earlier version read one matrix per dim off the kernel and applied it with a matmul. That
# was faster for small images and for bicubic, whose backward kernel is slow, but it did
# O(in x out) work per row, 2.3 times torch.func's time for vmap(grad) at 256x256, and it
# spread an inf or nan along the whole row.)
def _upsample_impl(x, *, kernel, output_size, align_corners, scales):
    op = getattr(aten, kernel).default
    if align_corners is None:
        return op(x, output_size, *scales)
    return op(x, output_size, align_corners, *scales)


def _upsample_backward_impl(ct, x, *, kernel, output_size, align_corners, scales):
    op = getattr(aten, f"{kernel}_backward").default
    if align_corners is None:
        return op(ct, output_size, x.shape, *scales)
    return op(ct, output_size, x.shape, align_corners, *scales)


upsample_p, upsample_backward_p = _linear_pair("upsample", _upsample_impl,
                                               _upsample_backward_impl)


def _interpolate(kernel, x, output_size, align_corners, scales):
    """Upsampling with the aten ``kernel`` (its .default overload): NOTE [Interpolation is a
    linear kernel and its transpose]."""
    op = kernel.overloadpacket.__name__
    _refuse_complex(op, x)
    spatial = len(output_size)
    shape = shape_of(x)
    if len(shape) != spatial + 2:
        raise TransformUsageError(
            f"{op}(input, ...): expected an (N, C) input with {spatial} spatial dims, got shape "
            f"{shape}. Fix: add the batch and channel dims."
        )
    return bind(upsample_p, x, kernel=op, output_size=tuple(output_size),
                align_corners=align_corners,
                scales=tuple(None if scale is None else float(scale) for scale in scales))


def _upsample_door(packet, spatial, with_align_corners):
    kernel = packet.default

    def default(x, output_size, *args):
        align_corners, scales = (args[0], args[1:]) if with_align_corners else (None, args)
        scales = list(scales) + [None] * (spatial - len(scales))
        return _interpolate(kernel, x, tuple(int(s) for s in output_size),
                            None if align_corners is None else bool(align_corners), scales)

    def vec(x, output_size, *args):
        align_corners, scale_factors = args if with_align_corners else (None, args[0])
        if output_size is None:
            output_size = [int(size * scale) for size, scale in
                           zip(shape_of(x)[2:], scale_factors)]
            scales = list(scale_factors)
        else:
            scales = [None] * spatial
        return _interpolate(kernel, x, tuple(int(s) for s in output_size),
                            None if align_corners is None else bool(align_corners), scales)
    return default, vec


for _name, _spatial, _align in (
        ("upsample_nearest1d", 1, False), ("upsample_nearest2d", 2, False),
        ("upsample_nearest3d", 3, False), ("_upsample_nearest_exact1d", 1, False),
        ("_upsample_nearest_exact2d", 2, False), ("_upsample_nearest_exact3d", 3, False),
        ("upsample_linear1d", 1, True), ("upsample_bilinear2d", 2, True),
        ("upsample_trilinear3d", 3, True), ("upsample_bicubic2d", 2, True),
        ("_upsample_bilinear2d_aa", 2, True), ("_upsample_bicubic2d_aa", 2, True)):
    _packet = getattr(aten, _name)
    _default, _vec = _upsample_door(_packet, _spatial, _align)
    aten_api.register(_packet.default)(_default)
    aten_api.register(_packet.vec)(_vec)


# --- grid_sample ---------------------------------------------------------------------------------
# NOTE [grid_sample is gathers]
# Each output of grid_sample reads a few input pixels (2^d corners for bilinear, one for
# nearest, 16 for bicubic) at positions computed from the grid, and weighs them by
# functions of the grid. The positions are integers (floor, round): not differentiable. The
# pixels are a gather of the flattened spatial dims; the weights are ops of the grid. So the
# derivative with respect to the input is gather's (a scatter-add, as torch's backward
# kernel), and the one with respect to the grid flows through the weights, as in torch.
def _unnormalize(coordinate, size, align_corners):
    """[-1, 1] grid coordinates to pixel coordinates."""
    if align_corners:
        return ops.mul(ops.add(coordinate, 1), (size - 1) / 2)
    return ops.div(ops.sub(ops.mul(ops.add(coordinate, 1), size), 1), 2)


def _reflect(coordinate, twice_low, twice_high):
    """Reflect coordinates into [twice_low / 2, twice_high / 2] (torch's reflect_coordinates)."""
    if twice_low == twice_high:
        return ops.zeros_like(coordinate)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    distance = ops.abs(ops.sub(coordinate, low))
    extra = elementwise.fmod(distance, span)
    flips = elementwise.floor(ops.div(distance, span))
    even = ops.eq(elementwise.remainder(flips, 2), 0)
    return ops.where(even, ops.add(extra, low), ops.sub(span + low, extra))


def _apply_padding(coordinate, size, padding_mode, align_corners):
    if padding_mode == "border":
        return elementwise.clamp(coordinate, 0, size - 1)
    if padding_mode == "reflection":
        if align_corners:
            coordinate = _reflect(coordinate, 0, 2 * (size - 1))
        else:
            coordinate = _reflect(coordinate, -1, 2 * size - 1)
        return elementwise.clamp(coordinate, 0, size - 1)
    return coordinate


def _cubic_coefficients(t):
    """The four weights of cubic convolution (A = -0.75) at fraction t, as torch uses."""
    a = -0.75

    def near(s):  # |s| <= 1
        return ops.add(ops.mul(ops.sub(ops.mul(s, a + 2), a + 3), ops.mul(s, s)), 1)

    def far(s):  # 1 < |s| < 2
        return ops.sub(ops.mul(ops.add(ops.mul(ops.sub(ops.mul(s, a), 5 * a), s), 8 * a), s),
                       4 * a)
    return [far(ops.add(t, 1)), near(t), near(ops.sub(1, t)), far(ops.sub(2, t))]


def _grid_sample(x, grid, mode, padding_mode, align_corners):
    """grid_sample: torch's kernel where at most one level differentiates it, else gathers
    (NOTE [grid_sample: torch's kernels for one derivative, gathers for more])."""
    _check_grid_sample(x, grid, mode)
    if _kernel_suffices(x, grid):
        return bind(grid_sampler_p, x, grid, mode=mode, padding_mode=padding_mode,
                    align_corners=align_corners)
    return _grid_sample_gathers(x, grid, mode, padding_mode, align_corners)


def _check_grid_sample(x, grid, mode):
    _refuse_complex("grid_sample", x, grid)
    spatial = len(shape_of(x)) - 2
    n = shape_of(x)[0]
    if spatial not in (2, 3) or len(shape_of(grid)) != spatial + 2 or \
            shape_of(grid)[-1] != spatial or shape_of(grid)[0] != n:
        raise TransformUsageError(
            f"grid_sample(input, grid): expected a 4-D or 5-D input (N, C, ...) and a grid "
            f"(N, ..., {spatial}) with as many spatial dims, got shapes {shape_of(x)} and "
            f"{shape_of(grid)}. Fix: match the grid to the input."
        )
    if mode == "bicubic" and spatial != 2:
        raise TransformUsageError("grid_sample(..., mode='bicubic'): only 4-D inputs, as in "
                                  "torch. Fix: use mode='bilinear'.")


def _grid_sample_gathers(x, grid, mode, padding_mode, align_corners):
    """grid_sample as gathers weighed by ops of the grid (NOTE [grid_sample is gathers])."""
    spatial = len(shape_of(x)) - 2
    n, c, *in_sizes = shape_of(x)
    out_sizes = shape_of(grid)[1:-1]
    flat_x = ops.reshape(x, n, c, math.prod(in_sizes))
    points = math.prod(out_sizes)
    # the grid's last dim is (x, y[, z]): coordinate k indexes spatial dim spatial - 1 - k
    coordinates = []
    for dim in range(spatial):
        coordinate = ops.reshape(ops.getitem(grid, (Ellipsis, spatial - 1 - dim)), n, 1, points)
        coordinates.append(_unnormalize(coordinate, in_sizes[dim], align_corners))

    def read(positions):
        """The input at integer positions (one per dim), 0 outside the input."""
        inside, flat = None, None
        for dim, position in enumerate(positions):
            size = in_sizes[dim]
            ok = elementwise.logical_and(ops.ge(position, 0), ops.le(position, size - 1))
            inside = ok if inside is None else elementwise.logical_and(inside, ok)
            safe = ops.convert(elementwise.clamp(position, 0, size - 1), torch.long)
            flat = safe if flat is None else ops.add(ops.mul(flat, size), safe)
        values = ops.gather(flat_x, 2, ops.expand(flat, n, c, points))
        return ops.where(inside, values, 0.0)

    if mode == "bicubic":
        taps = []
        for dim, coordinate in enumerate(coordinates):
            start = elementwise.floor(coordinate)
            weights = _cubic_coefficients(ops.sub(coordinate, start))
            positions = [_apply_padding(ops.add(start, k - 1), in_sizes[dim], padding_mode,
                                        align_corners) for k in range(4)]
            taps.append(list(zip(positions, weights)))
        out = None
        for y_position, y_weight in taps[0]:
            for x_position, x_weight in taps[1]:
                term = ops.mul(read([y_position, x_position]), ops.mul(y_weight, x_weight))
                out = term if out is None else ops.add(out, term)
    else:
        coordinates = [_apply_padding(coordinate, size, padding_mode, align_corners)
                       for coordinate, size in zip(coordinates, in_sizes)]
        if mode == "nearest":
            out = read([elementwise.round(coordinate) for coordinate in coordinates])
        else:  # bilinear (trilinear for 5-D inputs): the 2^d corners around each point
            corners = []
            for coordinate in coordinates:
                low = elementwise.floor(coordinate)
                high_weight = ops.sub(coordinate, low)
                corners.append([(low, ops.sub(1, high_weight)), (ops.add(low, 1), high_weight)])
            out = None
            for corner in _product(corners):
                weight = functools.reduce(ops.mul, [w for _, w in corner])
                term = ops.mul(read([p for p, _ in corner]), weight)
                out = term if out is None else ops.add(out, term)
    return ops.reshape(out, n, c, *out_sizes)


def _product(choices):
    """Every way to pick one item from each list (itertools.product, as lists)."""
    result = [[]]
    for options in choices:
        result = [picked + [option] for picked in result for option in options]
    return result


_GRID_MODES = ("bilinear", "nearest", "bicubic")
_GRID_PADDINGS = ("zeros", "border", "reflection")


# NOTE [grid_sample: torch's kernels for one derivative, gathers for more]
# As gathers (NOTE [grid_sample is gathers]) grad of grid_sample took five times torch.func's
# time: a dozen ops per corner, each recorded and pulled back. torch's kernel computes the
# output in one pass, and its backward kernel both cotangents, but that backward kernel has
# no derivative of its own, so the gathers stay for whatever differentiates twice. Which it
# is is known at the forward: the values' levels are all there, and a level made later (a
# grad around a vjp_fn) sees the saved input and grid as constants. So ``grid_sampler`` is a
# primitive, torch's kernel, where at most one level differentiates the op (one grad or jvp
# level, or torch's autograd of an input that requires grad; any number of vmaps): its
# cotangents are torch's backward kernel, as torch.func's, two primitives (the input's and
# the grid's), and its tangent is the kernel applied to the input's tangent plus the grid's
# partials times the grid's tangent (torch has no forward-mode formula: torch.func's jvp
# and hessian of grid_sample fail). The grid's partials, d out[n, c, p] / d grid[n, p, k],
# are the grid backward kernel of a cotangent of ones with each channel its own example.
# The two backward primitives are linear in their cotangent, the only argument a later level
# can differentiate, which gives their rules. Anywhere else (hessian, grad of grad, jit's
# programs, which may be replayed under other levels) the gathers run.
def _at_most_one_derivative(*values, forward_mode=True) -> bool:
    """Whether at most one level may differentiate an op of ``values``: any number of vmap
    levels, and one grad level (or one jvp level, with ``forward_mode``) or torch's autograd
    of a plain tensor that requires grad. A level made later sees the op's arguments as
    constants (NOTE [grid_sample: torch's kernels for one derivative, gathers for more])."""
    kinds = ("grad", "jvp") if forward_mode else ("grad",)
    differentiating = set()
    for value in values:
        while isinstance(value, Value):
            name = value.dispatcher.transform_name
            if name in kinds:
                differentiating.add(value.dispatcher)
            elif name != "vmap":
                return False
            value = value.payload
        if value.requires_grad and torch.is_grad_enabled():
            differentiating.add(None)
    return len(differentiating) <= 1


def _kernel_suffices(x, grid) -> bool:
    """Whether torch's kernel computes grid_sample here: real floats of one dtype, a
    non-empty input, and at most one level to differentiate it."""
    return (x.dtype == grid.dtype and x.dtype in (torch.float32, torch.float64)
            and 0 not in shape_of(x)[2:] and _at_most_one_derivative(x, grid))


_GRID_KERNELS = {2: (aten.grid_sampler_2d.default, aten.grid_sampler_2d_backward.default),
                 3: (aten.grid_sampler_3d.default, aten.grid_sampler_3d_backward.default)}


def _grid_sampler_impl(x, grid, *, mode, padding_mode, align_corners):
    forward, _ = _GRID_KERNELS[x.dim() - 2]
    return forward(x, grid, _GRID_MODES.index(mode), _GRID_PADDINGS.index(padding_mode),
                   align_corners)


def _grid_sampler_backward_impl(which):
    """The cotangent of grid_sample's input (which=0) or grid (1) from torch's kernel."""
    def impl(ct, x, grid, *, mode, padding_mode, align_corners):
        _, backward = _GRID_KERNELS[x.dim() - 2]
        return backward(ct, x, grid, _GRID_MODES.index(mode), _GRID_PADDINGS.index(padding_mode),
                        align_corners, [which == 0, which == 1])[which]
    return impl


grid_sampler_p = P.primitive("grid_sampler", _grid_sampler_impl)
grid_sampler_input_backward_p = P.primitive("grid_sampler_input_backward",
                                            _grid_sampler_backward_impl(0))
grid_sampler_grid_backward_p = P.primitive("grid_sampler_grid_backward",
                                           _grid_sampler_backward_impl(1))


def _grid_partials(x, grid, params):
    """d out[n, c, *p] / d grid[n, *p, k], shaped (N, C, *out, d): the grid backward kernel
    of a cotangent of ones, each channel its own example."""
    n, c, *in_sizes = shape_of(x)
    grid_shape = shape_of(grid)
    examples = ops.reshape(x, n * c, 1, *in_sizes)
    grids = ops.reshape(ops.expand(ops.unsqueeze(grid, 1), n, c, *grid_shape[1:]),
                        n * c, *grid_shape[1:])
    ones = ops.ones_like(ops.getitem(grids, (Ellipsis, 0)))  # (N C, *out)
    partials = bind(grid_sampler_grid_backward_p, ops.unsqueeze(ones, 1), examples, grids,
                    **params)
    return ops.reshape(partials, n, c, *grid_shape[1:])


def _along_the_grid(x, grid, grid_dot, params):
    """The change of grid_sample's output along a change ``grid_dot`` of its grid: the grid's
    partials times it, summed over the grid's last dim."""
    along = ops.mul(_grid_partials(x, grid, params), ops.unsqueeze(grid_dot, 1))
    return ops.sum(along, len(shape_of(along)) - 1)


def grid_sampler_vjp(x, grid, **params):
    def backward(ct):
        return (bind(grid_sampler_input_backward_p, ct, x, grid, **params)
                if wants_cotangent(0, x) else None,
                bind(grid_sampler_grid_backward_p, ct, x, grid, **params)
                if wants_cotangent(1, grid) else None)
    return bind(grid_sampler_p, x, grid, **params), backward


vjp_rules[grid_sampler_p] = grid_sampler_vjp


def grid_sampler_jvp(primals, tangents, **params):
    (x, grid), (x_dot, grid_dot) = primals, tangents
    out_dot = None
    if x_dot is not None:  # linear in the input
        out_dot = bind(grid_sampler_p, x_dot, grid, **params)
    if grid_dot is not None:
        out_dot = add_tangents(out_dot, _along_the_grid(x, grid, grid_dot, params))
    return bind(grid_sampler_p, x, grid, **params), out_dot


jvp_rules[grid_sampler_p] = grid_sampler_jvp


def _refuse_constant_operands(prim, operands):
    """A backward primitive's operands after the cotangent are constants of every level above
    the one that took torch's kernel (NOTE [grid_sample: torch's kernels for one derivative,
    gathers for more])."""
    assert not any(wants_cotangent(position, operand)
                   for position, operand in enumerate(operands, start=1)), (
        f"{prim.name}: an operand other than the cotangent is differentiated")


def grid_sampler_input_backward_vjp(ct, x, grid, **params):
    def backward(g):  # the transpose of the transpose of the linear map x -> out
        _refuse_constant_operands(grid_sampler_input_backward_p, (x, grid))
        return bind(grid_sampler_p, g, grid, **params), None, None
    return bind(grid_sampler_input_backward_p, ct, x, grid, **params), backward


def grid_sampler_grid_backward_vjp(ct, x, grid, **params):
    def backward(g):  # ct -> sum over the grid's dims k of d out / d grid[k] times g[k]
        _refuse_constant_operands(grid_sampler_grid_backward_p, (x, grid))
        return _along_the_grid(x, grid, g, params), None, None
    return bind(grid_sampler_grid_backward_p, ct, x, grid, **params), backward


vjp_rules[grid_sampler_input_backward_p] = grid_sampler_input_backward_vjp
vjp_rules[grid_sampler_grid_backward_p] = grid_sampler_grid_backward_vjp


def _linear_in_cotangent(prim):
    """The jvp rule of a backward primitive, linear in its cotangent, its first argument
    (the only one a level can vary: NOTE [grid_sample: torch's kernels for one derivative,
    gathers for more])."""
    def jvp(primals, tangents, **params):
        ct_dot, *constant_dots = tangents
        assert all(dot is None for dot in constant_dots), (
            f"{prim.name}: an operand other than the cotangent has a tangent")
        return (bind(prim, *primals, **params),
                None if ct_dot is None else bind(prim, ct_dot, *primals[1:], **params))
    return jvp


for _prim in (grid_sampler_p, grid_sampler_input_backward_p, grid_sampler_grid_backward_p):
    batching_rules[_prim] = _fold_examples(_prim)  # (each of N examples is sampled alone)
for _prim in (grid_sampler_input_backward_p, grid_sampler_grid_backward_p):
    jvp_rules[_prim] = _linear_in_cotangent(_prim)


@torch_api.register(F.grid_sample)
def grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    if mode not in _GRID_MODES or padding_mode not in _GRID_PADDINGS:
        raise TransformUsageError(
            f"grid_sample(..., mode={mode!r}, padding_mode={padding_mode!r}): expected a mode "
            f"in {_GRID_MODES} and a padding_mode in {_GRID_PADDINGS}."
        )
    return _grid_sample(x, grid, mode, padding_mode, bool(align_corners))


aten_api.register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default,
                  aten.grid_sampler.default)(
    lambda x, grid, mode, padding_mode, align_corners: _grid_sample(
        x, grid, _GRID_MODES[mode], _GRID_PADDINGS[padding_mode], bool(align_corners)))


# --- unfold and fold (im2col and col2im) ---------------------------------------------------------
def _im2col_index(padded_size, kernel_size, dilation, stride, device):
    """The flat position in the padded image of each (kernel offset, block) pair, and the
    number of blocks along each dim."""
    (height, width), (kh, kw), (dh, dw), (sh, sw) = padded_size, kernel_size, dilation, stride
    blocks_h = (height - dh * (kh - 1) - 1) // sh + 1
    blocks_w = (width - dw * (kw - 1) - 1) // sw + 1
    rows = (torch.arange(kh, device=device) * dh)[:, None] + \
        (torch.arange(blocks_h, device=device) * sh)[None, :]  # (kh, blocks_h)
    cols = (torch.arange(kw, device=device) * dw)[:, None] + \
        (torch.arange(blocks_w, device=device) * sw)[None, :]  # (kw, blocks_w)
    positions = rows[:, None, :, None] * width + cols[None, :, None, :]  # kh, kw, bh, bw
    return positions.reshape(-1), (blocks_h, blocks_w)


def _unfold_params(op, kernel_size, dilation, padding, stride):
    return (_ntuple(kernel_size, 2, "kernel_size", op), _ntuple(dilation, 2, "dilation", op),
            _ntuple(padding, 2, "padding", op), _ntuple(stride, 2, "stride", op))


@torch_api.register(F.unfold)
def unfold(x, kernel_size, dilation=1, padding=0, stride=1):
    """NOTE [unfold is a gather, fold a scatter-add]
    unfold (im2col) copies each kernel-sized block of the (zero-padded) image into a
    column: every output element is one input element, at a position that depends only on
    the shapes. So it is a gather with a constant index, and fold (col2im), its transpose,
    the scatter-add with the same index: each derivative is the other op."""
    kernel_size, dilation, padding, stride = _unfold_params("unfold", kernel_size, dilation,
                                                            padding, stride)
    unbatched = len(shape_of(x)) == 3
    if unbatched:
        x = ops.unsqueeze(x, 0)
    if len(shape_of(x)) != 4:
        raise TransformUsageError(f"unfold(input, ...): expected a 3-D or 4-D input, got shape "
                                  f"{shape_of(x)}.")
    x = constant_pad_nd(x, (padding[1], padding[1], padding[0], padding[0]))
    n, c, height, width = shape_of(x)
    index, blocks = _im2col_index((height, width), kernel_size, dilation, stride, x.device)
    columns = ops.gather(ops.reshape(x, n, c, height * width), 2,
                         index.expand(n, c, len(index)))
    out = ops.reshape(columns, n, c * kernel_size[0] * kernel_size[1], blocks[0] * blocks[1])
    return ops.squeeze(out, 0) if unbatched else out


@torch_api.register(F.fold)
def fold(x, output_size, kernel_size, dilation=1, padding=0, stride=1):
    output_size = _ntuple(output_size, 2, "output_size", "fold")
    kernel_size, dilation, padding, stride = _unfold_params("fold", kernel_size, dilation,
                                                            padding, stride)
    unbatched = len(shape_of(x)) == 2
    if unbatched:
        x = ops.unsqueeze(x, 0)
    n, ck, length = shape_of(x)
    k = kernel_size[0] * kernel_size[1]
    height, width = output_size[0] + 2 * padding[0], output_size[1] + 2 * padding[1]
    index, blocks = _im2col_index((height, width), kernel_size, dilation, stride, x.device)
    if ck % k or length != blocks[0] * blocks[1]:
        raise TransformUsageError(
            f"fold(input, output_size={output_size}, kernel_size={kernel_size}): expected an "
            f"input (N, C*{k}, {blocks[0] * blocks[1]}), got shape {shape_of(x)}. Fix: match "
            "the input to the blocks of the output."
        )
    c = ck // k
    columns = ops.reshape(x, n, c, k * length)
    image = bind(P.scatter_add_p, columns, index.expand(n, c, len(index)), dim=2,
                 shape=(n, c, height * width))
    image = ops.reshape(image, n, c, height, width)
    image = ops.getitem(image, (slice(None), slice(None),
                                slice(padding[0], padding[0] + output_size[0]),
                                slice(padding[1], padding[1] + output_size[1])))
    return ops.squeeze(image, 0) if unbatched else image


aten_api.register(aten.im2col.default)(
    lambda x, kernel_size, dilation, padding, stride: unfold(x, kernel_size, dilation, padding,
                                                             stride))
aten_api.register(aten.col2im.default)(
    lambda x, output_size, kernel_size, dilation, padding, stride: fold(
        x, output_size, kernel_size, dilation, padding, stride))


# --- attention -----------------------------------------------------------------------------------
# NOTE [Attention without dropout, a mask or grouped heads: three ops]
# On a transform's values torch lowers F.scaled_dot_product_attention to its math
# decomposition: about twenty ops (q and k scaled by sqrt(scale) each, a bias of -inf, a
# softmax that zeroes fully masked rows, ...), which took twice torch.func's time for grad of
# 4 heads of 128 tokens (torch.func runs the fused flash kernel and its backward kernel).
# Without dropout, a mask or grouped heads it is softmax(q k^T scale) v, causal or not, and
# a causal mask leaves every row an element; so it is written with the engine's matmul and
# softmax, whose rules give every derivative, batching and forward mode (under one grad
# level, torch's kernels: NOTE [Attention: torch's flash kernels for one derivative]). Any
# other call returns NotImplemented and takes torch's decomposition (dropout's draws among
# them).
@torch_api.register(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None or dropout_p != 0.0 or enable_gqa:
        return NotImplemented
    q_shape, k_shape = shape_of(query), shape_of(key)
    if len(q_shape) < 2 or len(k_shape) < 2 or 0 in (q_shape[-2], k_shape[-2], q_shape[-1]):
        return NotImplemented  # (torch's checks and empty results)
    if _flash_applies(query, key, value, is_causal, scale):
        return bind(attention_p, query, key, value, is_causal=bool(is_causal),
                    scale=None if scale is None else float(scale))
    return ops.matmul(_attention_weights(query, key, is_causal, scale), value)


def _attention_scale(query, scale):
    """The scores' scale: ``scale``, or 1 / sqrt(head size) where it is None."""
    return 1.0 / math.sqrt(shape_of(query)[-1]) if scale is None else float(scale)


def _attention_weights(query, key, is_causal, scale):
    """softmax(q k^T scale), causal or not (scale None: 1 / sqrt(head size))."""
    q_shape, k_shape = shape_of(query), shape_of(key)
    scores = ops.mul(ops.matmul(query, ops.transpose(key, -2, -1)),
                     _attention_scale(query, scale))
    if is_causal:
        allowed = torch.ones(q_shape[-2], k_shape[-2], dtype=torch.bool,
                             device=query.device).tril()
        scores = ops.where(allowed, scores, -math.inf)
    return ops.softmax(scores, -1)


# NOTE [Attention: torch's flash kernels for one derivative]
# On a CPU torch runs attention of (N, H, L, E) tensors as one fused kernel, flash attention,
# which also returns the log-sum-exp of each row of scores, and its backward as another that
# reads them: torch.func's grad runs those two. The three ops above are a dozen binds with
# their backward, and took 1.2 to 1.4 times torch.func's time for grad of attention and of
# the layers around it. So where torch would take the kernel (4-D real tensors of one dtype
# and one head size, every query and key batched alike, no mask, dropout or grouped heads, a
# causal mask on a square only: torch's own choice, on the tensors below), no vmap batches
# it, and at most one grad level (or torch's autograd) differentiates it, attention is a
# primitive, the kernel, as grid_sample is (NOTE
# [grid_sample: torch's kernels for one derivative, gathers for more]). Its log-sum-exp is
# a second primitive that takes the kernel's kept output (NOTE [Kernels with two outputs]),
# and the backward kernel's three outputs are three primitives the same way. A forward-mode
# level, or a second derivative, takes the three ops, and so does vmap: folding its batch into
# the kernel's first dim copies q, k, v and the cotangent at every bind (they come out of
# transposes), and per-sample gradients of a 4-head layer took 1.6 times torch.func's time,
# against 0.9 with the three ops (a vmap made later, as jacrev's over vjp_fn, batches only
# the cotangent, which folds as a view). The backward primitives are linear in
# their cotangent, whose transpose is the forward's linearization, written with ops
# (``_attention_tangent``), which is also the primitive's own jvp. torch's kernels for a
# GPU are others (flash and memory-efficient attention, with other outputs): there the
# three ops run.
def _flash_applies(query, key, value, is_causal, scale) -> bool:
    """Whether attention is torch's flash kernel here: no vmap, one grad level at most, and
    the tensors below are those torch itself would hand to the kernel (its own choice, which
    reads their layout and ``torch.nn.attention.sdpa_kernel``)."""
    if (any(batched_by_vmap(t) for t in (query, key, value))
            or not _at_most_one_derivative(query, key, value, forward_mode=False)):
        return False
    bottoms = [bottom_tensor(t) for t in (query, key, value)]
    if any(b.device.type != "cpu" or b.dim() != 4 or b.dtype not in (torch.float32,
                                                                      torch.float64)
           for b in bottoms) or (is_causal and bottoms[0].shape[2] != bottoms[1].shape[2]):
        return False
    return torch._fused_sdp_choice(*bottoms, None, 0.0, is_causal, scale=scale) == _FLASH


_FLASH = int(SDPBackend.FLASH_ATTENTION)


_kept_logsumexp = _KeptOutput()
_kept_attention_grads = _KeptOutput()


def _same_data(*tensors):
    """A key that tells tensors apart by what they hold: two live tensors with the same
    geometry (shape, strides, data pointer and version) are views of the same numbers."""
    return tuple(_KeptOutput._where(t)[1] for t in tensors)


def _attention_impl(q, k, v, *, is_causal, scale):
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale)
    _kept_logsumexp.keep(q, (is_causal, scale, _same_data(k, v)), logsumexp)
    return out


def _attention_logsumexp_impl(q, k, v, *, is_causal, scale):
    kept = _kept_logsumexp.take(q, (is_causal, scale, _same_data(k, v)))
    if kept is not None:
        return kept
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                            scale=scale)[1]


def _attention_backward_impl(which):
    """The cotangent of attention's query (which=0), key (1) or value (2) from torch's
    backward kernel, which computes all three: the first asked keeps the other two (for
    this cotangent of this attention: one cotangent may reach two, as add's does)."""
    def impl(ct, q, k, v, out, logsumexp, *, is_causal, scale):
        key = (is_causal, scale, _same_data(q, k, v, out, logsumexp))
        kept = _kept_attention_grads.take(ct, key)
        if kept is None:
            kept = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                ct, q, k, v, out, logsumexp, 0.0, is_causal, scale=scale)
            _kept_attention_grads.keep(ct, key, kept)
        return kept[which]
    return impl


attention_p = P.primitive("attention", _attention_impl)
attention_logsumexp_p = P.primitive("attention_logsumexp", _attention_logsumexp_impl,
                                    differentiable=False)
attention_backward_query_p, attention_backward_key_p, attention_backward_value_p = (
    P.primitive(f"attention_backward_{name}", _attention_backward_impl(which))
    for which, name in enumerate(("query", "key", "value")))
attention_backward_ps = (attention_backward_query_p, attention_backward_key_p,
                         attention_backward_value_p)


def _attention_tangent(q, k, v, q_dot, k_dot, v_dot, *, is_causal, scale):
    """The tangent of softmax(q k^T scale) v for the tangents of q, k and v (None: zero)."""
    weights = _attention_weights(q, k, is_causal, scale)
    scores_dot = None
    if q_dot is not None:
        scores_dot = ops.matmul(q_dot, ops.transpose(k, -2, -1))
    if k_dot is not None:
        scores_dot = add_tangents(scores_dot, ops.matmul(q, ops.transpose(k_dot, -2, -1)))
    out_dot = None
    if scores_dot is not None:  # softmax's jvp: w (s_dot - sum(w s_dot))
        scores_dot = ops.mul(scores_dot, _attention_scale(q, scale))
        centered = ops.sub(scores_dot, ops.sum(ops.mul(weights, scores_dot), -1, keepdim=True))
        out_dot = ops.matmul(ops.mul(weights, centered), v)
    if v_dot is not None:
        out_dot = add_tangents(out_dot, ops.matmul(weights, v_dot))
    return out_dot


def attention_vjp(q, k, v, **params):
    out = bind(attention_p, q, k, v, **params)
    logsumexp = bind(attention_logsumexp_p, q, k, v, **params)  # the kernel's, kept

    def backward(ct):
        return tuple(bind(prim, ct, q, k, v, out, logsumexp, **params)
                     if wants_cotangent(position, arg) else None
                     for position, (prim, arg) in enumerate(zip(attention_backward_ps,
                                                                (q, k, v))))
    return out, backward


def attention_jvp(primals, tangents, **params):
    return bind(attention_p, *primals, **params), _attention_tangent(*primals, *tangents,
                                                                     **params)


vjp_rules[attention_p] = attention_vjp
jvp_rules[attention_p] = attention_jvp


def _attention_backward_vjp(which, prim):
    """The vjp of a backward primitive, linear in its cotangent: the forward's linearization
    along the argument ``which`` (its jvp: ``_linear_in_cotangent``)."""
    def vjp(ct, q, k, v, out, logsumexp, **params):
        def backward(g):
            _refuse_constant_operands(prim, (q, k, v, out))
            directions = [None, None, None]
            directions[which] = g
            return (_attention_tangent(q, k, v, *directions, **params),
                    None, None, None, None, None)
        return bind(prim, ct, q, k, v, out, logsumexp, **params), backward
    return vjp


for _which, _prim in enumerate(attention_backward_ps):
    vjp_rules[_prim] = _attention_backward_vjp(_which, _prim)
    jvp_rules[_prim] = _linear_in_cotangent(_prim)


for _prim in (attention_p, attention_logsumexp_p, *attention_backward_ps):
    batching_rules[_prim] = _fold_examples(_prim)


# NOTE [Multi-head attention: torch's Python body, at the front door]
# F.multi_head_attention_forward is Python: its first line sees a transform's tensors
# (``has_torch_function``) and hands the whole call to __torch_function__, where the engine
# has no rule for it, so torch ran it past the front door, as aten ops: about 45 calls
# through the slower aten door, and attention by torch's math decomposition, which took 3.9
# times torch.func's time for grad of a 4-head layer on 20 tokens. The body itself is
# ordinary torch code (linear layers, views, scaled_dot_product_attention): run as written,
# on FuncTensors, each of its calls takes the front door and its rule (attention's:
# NOTE [Attention without dropout, a mask or grouped heads: three ops]). The function is
# rebuilt from its code with a ``has_torch_function`` that answers False, so that its first
# line lets the body run instead of dispatching again; its other names are those of
# torch.nn.functional when the engine is imported. (torch.func needs no such step: its
# transforms sit below Python, in the dispatcher.) The body gets a FuncTensor per argument, so
# self-attention's ``query is key is value`` is False there and it projects with three
# linear layers where torch.func takes the packed path (one linear layer, a copy, three
# selects): equal to float32 rounding, in three ops where the packed path makes eight, faster
# here (grad of a 4-head layer on 20 tokens: 1.27x torch.func's time, 1.61x with the
# tensors' identity kept, A/B on an Intel Xeon).
def _python_body(function):
    """``function``'s own body: the function rebuilt with ``has_torch_function`` False."""
    namespace = dict(function.__globals__, has_torch_function=lambda *args: False)
    body = types.FunctionType(function.__code__, namespace, function.__name__,
                              function.__defaults__, function.__closure__)
    body.__kwdefaults__ = function.__kwdefaults__
    return body


_MULTI_HEAD_ATTENTION = _python_body(F.multi_head_attention_forward)


@torch_api.register(F.multi_head_attention_forward)
def multi_head_attention_forward(*args, **kwargs):
    return call_with_tensors(_MULTI_HEAD_ATTENTION, *args, **kwargs)


# --- small layers: pixel shuffle, glu, prelu, bilinear -------------------------------------------
@torch_api.register(F.pixel_shuffle, torch.pixel_shuffle)
@aten_api.register(aten.pixel_shuffle.default)
def pixel_shuffle(x, upscale_factor):
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r): a reshape, a permute and a reshape."""
    r = int(upscale_factor)
    *lead, crr, height, width = shape_of(x)
    rank = len(lead)
    x = ops.reshape(x, *lead, crr // (r * r), r, r, height, width)
    x = ops.permute(x, *range(rank), rank, rank + 3, rank + 1, rank + 4, rank + 2)
    return ops.reshape(x, *lead, crr // (r * r), height * r, width * r)


@torch_api.register(F.pixel_unshuffle, torch.pixel_unshuffle)
@aten_api.register(aten.pixel_unshuffle.default)
def pixel_unshuffle(x, downscale_factor):
    r = int(downscale_factor)
    *lead, c, height, width = shape_of(x)
    rank = len(lead)
    x = ops.reshape(x, *lead, c, height // r, r, width // r, r)
    x = ops.permute(x, *range(rank), rank, rank + 2, rank + 4, rank + 1, rank + 3)
    return ops.reshape(x, *lead, c * r * r, height // r, width // r)


@torch_api.register(F.glu)
@aten_api.register(aten.glu.default)
def glu(x, dim=-1):
    """The first half of ``dim`` gated by the sigmoid of the second half."""
    rank = len(shape_of(x))
    dim = ops.normalize_dim(dim, rank, op="glu")
    half = shape_of(x)[dim] // 2
    if shape_of(x)[dim] % 2:
        raise TransformUsageError(
            f"glu(input, dim={dim}): expected an even size along dim {dim}, got shape "
            f"{shape_of(x)}. Fix: split a dim of even size."
        )
    first = ops.getitem(x, (slice(None),) * dim + (slice(0, half),))
    second = ops.getitem(x, (slice(None),) * dim + (slice(half, 2 * half),))
    return ops.mul(first, ops.sigmoid(second))


@torch_api.register(F.prelu, torch.prelu)
def prelu(x, weight):
    """x where x > 0, weight * x elsewhere; one weight per channel (dim 1), or one for all."""
    _refuse_complex("prelu", x, weight)
    count, rank = math.prod(shape_of(weight)), len(shape_of(x))
    if count != 1:  # torch's checks of a weight per channel
        if rank == 0:
            raise ShapeMismatchError(
                "prelu(input, weight): Not allow zero-dim input tensor (with one weight per "
                "channel, as in torch). Fix: give the input a channel dim, or one weight.")
        channels = shape_of(x)[1] if rank > 1 else 1
        if count != channels:
            raise ShapeMismatchError(
                f"prelu(input, weight): Mismatch of parameter numbers and input channel size. "
                f"Found parameter numbers = {count} and channel size = {channels}. Fix: one "
                "weight per channel (dim 1), or one for all.")
    if len(shape_of(weight)) > 1:
        raise ShapeMismatchError(
            f"prelu(input, weight): prelu: Expected `weight` to be a scalar or 1D tensor, but "
            f"got: ndim = {len(shape_of(weight))}. Fix: pass weight.flatten().")
    if count == 1:
        weight = ops.reshape(weight, *([1] * len(shape_of(x))))
    elif len(shape_of(x)) >= 2:
        weight = _channel_view(ops.reshape(weight, -1), len(shape_of(x)))
    return _prelu_kernel(x, weight)


@torch_api.register(F.rrelu, torch.rrelu)
def rrelu(x, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    """NOTE [rrelu outside vmap]
    In eval mode rrelu is leaky_relu with the mean slope. In training mode torch's kernel
    (rrelu_with_noise) draws one slope per element that is not positive and writes the slopes
    (1 elsewhere) into a noise tensor: the output is x * noise, and torch's derivative is the
    noise (rrelu_with_noise_backward). Here the kernel runs on the concrete numbers under the
    value of a grad or jvp level (its draws are torch's own, in torch's order), and the
    engine computes x * noise, whose derivative is the same. Under vmap randomness.py refuses,
    as torch.func does."""
    if inplace:
        raise InPlaceError(
            "rrelu(x, inplace=True): writing random slopes into a value of a transform is not "
            "supported. Fix: use the returned value, inplace=False.")
    if lower > upper:
        raise InvalidOptionError(
            f"rrelu(x, lower={lower}, upper={upper}): Lower bound should be less than or equal "
            "to the upper bound (as in torch, in eval mode too). Fix: swap them.")
    if not training:
        return elementwise.leaky_relu(x, (lower + upper) / 2)
    plain = bottom_tensor(x)
    if plain.device.type == "meta":
        raise MissingRuleError(
            "rrelu(x, training=True): a traced program cannot replay rrelu's random slopes. "
            "Fix: trace the model in eval mode, or use F.leaky_relu.")
    noise = torch.empty_like(plain)
    with torch.no_grad():
        aten.rrelu_with_noise(plain.detach(), noise, lower, upper, True)
    return ops.mul(x, noise)


@aten_api.register(aten._prelu_kernel.default)
def _prelu_kernel(x, weight):
    # (the weight multiplies x's part at or below 0: where x > 0 that part is 0, so the
    # weight's gradient there is 0, as torch's, not 0 * inf at an infinite x)
    positive = ops.gt(x, 0)
    return ops.where(positive, x, ops.mul(weight, ops.where(positive, 0.0, x)))


def _check_bilinear(x1, x2, weight, bias):
    """torch's checks of bilinear's operands, in its words: the reshapes below would read
    some mismatched shapes as others."""
    s1, s2, w = shape_of(x1), shape_of(x2), shape_of(weight)
    words = None
    if len(w) != 3:
        words = f"bilinear(): expected a 3-D weight (out, in1, in2), got shape {list(w)}"
    elif len(s1) != len(s2):
        words = f"bilinear(): input dimensions do not match: got {len(s1)} and {len(s2)}"
    elif s1[:-1] != s2[:-1]:
        dim = next(i for i, (a, b) in enumerate(zip(s1[:-1], s2[:-1])) if a != b)
        words = (f"bilinear(): input batch dimensions do not match at dim {dim}: got "
                 f"{s1[dim]} and {s2[dim]}")
    elif s1[-1] != w[1]:
        words = (f"bilinear(): input1 size does not match weight size: got {s1[-1]} but "
                 f"expected {w[1]}")
    elif s2[-1] != w[2]:
        words = (f"bilinear(): input2 size does not match weight size: got {s2[-1]} but "
                 f"expected {w[2]}")
    elif bias is not None and shape_of(bias)[:1] != w[:1]:
        words = (f"bilinear(): bias size does not match weight size: got "
                 f"{(shape_of(bias) or (None,))[0]} but expected {w[0]}")
    if words is not None:
        raise ShapeMismatchError(
            f"F.bilinear(input1, input2, weight, bias): {words} (as in torch; shapes {s1}, {s2}, "
            f"{w}). Fix: input1 (..., in1), input2 (..., in2), weight (out, in1, in2), bias "
            "(out,).")


@torch_api.register(F.bilinear, torch.bilinear)
@aten_api.register(aten.bilinear.default)
def bilinear(x1, x2, weight, bias=None):
    """out[..., o] = x1 W[o] x2 + b[o]: one matmul of x1 against every W[o], then a product
    with x2 summed over its features."""
    _refuse_complex("bilinear", x1, x2, weight, bias)
    _check_bilinear(x1, x2, weight, bias)
    lead = shape_of(x1)[:-1]
    outputs, in1, in2 = shape_of(weight)
    rows = math.prod(lead)
    x1 = ops.reshape(x1, rows, in1)
    x2 = ops.reshape(x2, rows, 1, in2)
    mixed = ops.matmul(x1, ops.reshape(ops.permute(weight, 1, 0, 2), in1, outputs * in2))
    out = ops.sum(ops.mul(ops.reshape(mixed, rows, outputs, in2), x2), -1)
    if bias is not None:
        out = ops.add(out, bias)
    return ops.reshape(out, *lead, outputs)


# --- linear_cross_entropy's chunked ops -----------------------------------------------------------
# NOTE [linear_cross_entropy's chunked ops are cross_entropy of linear]
# F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(...)) calls one of two custom
# ops of torch (``torch_nn::_linear_cross_entropy_batch_chunked`` for mean and sum,
# ``..._no_reduction`` for none), which run the classifier in chunks of the batch to save
# memory. Their value is cross_entropy(linear(input, linear_weight, linear_bias), target,
# weight, ignore_index, reduction) (label smoothing is always 0 on that path), which is what
# they are here: the chunking is a memory schedule, and every derivative then comes from
# linear's and cross_entropy's rules (torch's own ops have an autograd formula only, no
# forward rule and no batching rule but a loop). The mean/sum op also returns the gradients
# with respect to input, linear_weight and linear_bias, which it computes in its forward
# pass for its backward (F.linear_cross_entropy drops them): they are computed here too,
# with the same ops, where its compute_*_grad flags ask for them (empty (0, 0) or (0,)
# tensors otherwise, as torch's op returns): with p = softmax(logits) and w_n the weight of
# sample n's class (0 where ignored), d loss / d logits = w_n (p - onehot(target)), divided
# by the sum of the w_n for the mean.
def _chunked_logits_and_loss(x, linear_weight, target, linear_bias, weight, ignore_index,
                             reduction):
    logits = linear(x, linear_weight, linear_bias)
    return logits, cross_entropy(logits, target, weight, ignore_index=int(ignore_index),
                                 reduction=reduction)


def _linear_cross_entropy_chunked(x, linear_weight, target, linear_bias, weight, reduction,
                                  ignore_index, label_smoothing, batch_chunk_size, acc_policy,
                                  acc_dtype, allow_retain_graph, compute_input_grad,
                                  compute_linear_weight_grad, compute_linear_bias_grad):
    if label_smoothing:
        raise TransformUsageError(
            "linear_cross_entropy chunked op: expected label_smoothing=0 (F.linear_cross_entropy "
            f"takes the chunked path only then), got {label_smoothing}. Fix: call "
            "F.linear_cross_entropy, which falls back to the unchunked computation.")
    logits, loss = _chunked_logits_and_loss(x, linear_weight, target, linear_bias, weight,
                                            ignore_index, reduction)
    empty2 = torch.empty((0, 0), dtype=x.dtype, device=x.device)
    grads = [empty2, empty2, torch.empty((0,), dtype=x.dtype, device=x.device)]
    if compute_input_grad or compute_linear_weight_grad or compute_linear_bias_grad:
        weights, safe = _target_weights(target, weight, int(ignore_index), x.dtype)
        classes = shape_of(logits)[-1]
        onehot = ops.eq(ops.unsqueeze(safe, -1), torch.arange(classes, device=x.device))
        g = ops.mul(ops.sub(ops.softmax(logits, -1), ops.convert(onehot, x.dtype)),
                    ops.unsqueeze(weights, -1))
        if reduction == "mean":
            g = ops.div(g, ops.sum(weights))
        if compute_input_grad:
            grads[0] = ops.matmul(g, linear_weight)
        if compute_linear_weight_grad:
            grads[1] = ops.matmul(ops.t(g), x)
        if compute_linear_bias_grad:
            grads[2] = ops.sum(g, 0)
    return (loss, *grads)


def _linear_cross_entropy_chunked_none(x, linear_weight, target, linear_bias, weight,
                                       ignore_index, batch_chunk_size, acc_policy, acc_dtype):
    return _chunked_logits_and_loss(x, linear_weight, target, linear_bias, weight,
                                    ignore_index, "none")[1]


def _register_chunked_ops():
    """The doors of the two custom ops (defined when torch.nn.modules.linear_cross_entropy
    is imported, which F.linear_cross_entropy does; absent from older torch)."""
    try:
        from torch.nn.modules import linear_cross_entropy  # noqa: F401
        namespace = torch.ops.torch_nn
        chunked = namespace._linear_cross_entropy_batch_chunked.default
        chunked_none = namespace._linear_cross_entropy_batch_chunked_no_reduction.default
    except (ImportError, AttributeError):
        return
    aten_api.register(chunked)(_linear_cross_entropy_chunked)
    aten_api.register(chunked_none)(_linear_cross_entropy_chunked_none)


_register_chunked_ops()
