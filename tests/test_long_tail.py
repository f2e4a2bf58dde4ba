"""The long tail of op_db (issue 13): ops with a kernel of their own that torch.func
differentiates and batches, each checked under every transform against torch.func
(tests/oracle.py) and against central differences.

- frexp (core/structural.py, NOTE [frexp: the kernel's mantissa, a derivative through the
  exponent]);
- fractional max pooling (core/nn.py, NOTE [Fractional max pooling: random windows given as
  a tensor]), with the random samples passed in, so that both sides pool the same windows;
- segment_reduce (core/indexing.py, NOTE [segment_reduce: torch's kernel and its backward
  kernel]), and
- ctc_loss (core/nn.py, NOTE [CTC loss: torch's kernels as primitives]): torch.func has no
  forward-mode rule for either, so jvp and jacfwd are checked against torch.func's jacrev, and
  second derivatives are refused on both sides.
"""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core.errors import TransformError
from op_table import DTYPE, OpCase, distinct, normal
from oracle import (
    TRANSFORMS,
    assert_same,
    check_finite_differences,
    check_under_transform,
    transform_params,
)


def _frexp(x):
    mantissa, exponent = torch.frexp(x)
    return mantissa * (exponent + 1)


def _fractional(spatial, output_size):
    pool = F.fractional_max_pool2d if spatial == 2 else F.fractional_max_pool3d

    def fn(x, samples):
        return pool(x, 2, output_size=output_size, _random_samples=samples)
    return fn


def _samples(g, n, c, spatial):
    return torch.rand(n, c, spatial, generator=g, dtype=DTYPE)


CASES = [
    OpCase("frexp", _frexp, lambda g: (normal(g, 3, 4) * 10,)),
    OpCase("frexp_method", lambda x: x.frexp()[0], lambda g: (normal(g, 5),)),
    OpCase("fractional_max_pool2d", _fractional(2, (3, 3)),
           lambda g: (distinct(g, 2, 3, 7, 7), _samples(g, 2, 3, 2))),
    OpCase("fractional_max_pool2d_unbatched", _fractional(2, (2, 3)),
           lambda g: (distinct(g, 3, 6, 7), _samples(g, 1, 3, 2))),
    OpCase("fractional_max_pool3d", _fractional(3, (2, 2, 3)),
           lambda g: (distinct(g, 2, 2, 5, 5, 6), _samples(g, 2, 2, 3))),
]


@pytest.mark.parametrize("case, transform", list(transform_params(CASES)))
def test_under_transform(case, transform):
    check_under_transform(case, transform)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_finite_differences(case):
    check_finite_differences(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vmap_uses_no_fallback(case):
    with mf.capture_fallbacks() as used:
        mf.vmap(mf.grad(lambda *a: case.fn(*a).sum()))(*case.batch())
    assert not used, f"{case.name}: per-example fallback for {dict(used)}"


def test_fractional_max_pool_returns_the_kernels_indices():
    g = torch.Generator().manual_seed(0)
    x, samples = distinct(g, 2, 3, 7, 7), _samples(g, 2, 3, 2)
    ours = mf.vmap(lambda x: F.fractional_max_pool2d(x, 2, output_size=3, return_indices=True,
                                                     _random_samples=samples))(x)
    theirs = tf.vmap(lambda x: F.fractional_max_pool2d(x, 2, output_size=3, return_indices=True,
                                                       _random_samples=samples))(x)
    assert_same(ours, theirs)


# --- ctc_loss ---------------------------------------------------------------------------------------
T, N, C = 6, 2, 4


def _ctc(reduction, padded):
    def fn(x, targets, input_lengths, target_lengths):
        return F.ctc_loss(x.log_softmax(-1), targets, input_lengths, target_lengths,
                          reduction=reduction, zero_infinity=True)
    return fn


def _ctc_inputs(padded):
    """Each example has other target lengths (summing to 4 when concatenated), so under vmap
    every example's sequences start at other offsets."""
    def make(g):
        x = normal(g, T, N, C)
        target_lengths = [(1, 3), (3, 1), (2, 2)][int(torch.randint(0, 3, (), generator=g))]
        if padded:
            targets = torch.randint(1, C, (N, 3), generator=g)
        else:
            targets = torch.randint(1, C, (sum(target_lengths),), generator=g)
        input_lengths = torch.tensor([T, T - 1 - int(torch.randint(0, 2, (), generator=g))])
        return x, targets, input_lengths, torch.tensor(target_lengths)
    return make


CTC_CASES = [
    OpCase("ctc_loss_none_concatenated", _ctc("none", False), _ctc_inputs(False)),
    OpCase("ctc_loss_mean_concatenated", _ctc("mean", False), _ctc_inputs(False)),
    OpCase("ctc_loss_sum_padded", _ctc("sum", True), _ctc_inputs(True)),
    OpCase("ctc_loss_none_padded", _ctc("none", True), _ctc_inputs(True)),
]
# torch.func has no forward-mode rule for ctc_loss, nor a second derivative: forward mode is
# checked against torch.func's reverse mode, second derivatives are refused on both sides.
FORWARD = {"jvp": "jacrev_contracted", "jacfwd": "jacrev"}
SECOND_ORDER = {"grad_grad", "jacfwd_jacrev", "jvp_grad", "hessian"}


@pytest.mark.parametrize("case, transform", list(transform_params(CTC_CASES)))
def test_ctc_loss_under_transform(case, transform):
    check_first_order_only(case, transform, "_ctc_loss_backward")


def check_first_order_only(case, transform, backward_name):
    """An op that torch.func differentiates in reverse mode only, once."""
    if transform in SECOND_ORDER:
        with pytest.raises(Exception):
            TRANSFORMS[transform](tf, case)
        with pytest.raises(TransformError, match=f"{backward_name} is not implemented"):
            TRANSFORMS[transform](mf, case)
        return
    if transform not in FORWARD:
        check_under_transform(case, transform)
        return
    args = case.sample()
    jacobian = tf.jacrev(case.fn)(*args)
    if transform == "jacfwd":
        assert_same(mf.jacfwd(case.fn)(*args), jacobian)
        return
    tangent = torch.randn(args[0].shape, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    out, out_dot = mf.jvp(lambda x: case.fn(x, *args[1:]), (args[0],), (tangent,))
    expected = (jacobian * tangent).sum(dim=tuple(range(-tangent.dim(), 0)))
    assert_same(out, case.fn(*args))
    torch.testing.assert_close(out_dot, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("case", CTC_CASES, ids=lambda c: c.name)
def test_ctc_loss_finite_differences(case):
    check_finite_differences(case)


@pytest.mark.parametrize("case", CTC_CASES, ids=lambda c: c.name)
def test_ctc_loss_vmap_uses_no_fallback(case):
    with mf.capture_fallbacks() as used:
        mf.vmap(mf.grad(lambda *a: case.fn(*a).sum()))(*case.batch())
        mf.vmap(case.fn, in_dims=(1, None, None, 0))(
            case.batch()[0].movedim(0, 1), *case.sample()[1:3], case.batch()[3])
    assert not used, f"{case.name}: per-example fallback for {dict(used)}"


def test_ctc_loss_unbatched_input():
    g = torch.Generator().manual_seed(3)
    x, targets = normal(g, T, C), torch.tensor([1, 2, 2])

    def f(x):
        return F.ctc_loss(x.log_softmax(-1), targets, torch.tensor(T), torch.tensor(3))
    assert_same(mf.grad(f)(x), tf.grad(f)(x))
    xs = torch.stack([x, x * 0.5, x * 2])
    assert_same(mf.vmap(mf.grad(f))(xs), tf.vmap(tf.grad(f))(xs))


# --- segment_reduce ---------------------------------------------------------------------------------
def _segment(reduce, by, axis=0, initial=None):
    def fn(data, segments):
        return torch.segment_reduce(data, reduce, axis=axis, initial=initial, **{by: segments})
    return fn


def _segment_inputs(by, axis, empty=False):
    """Data (3, 6) or (2, 6, 2) along ``axis``, cut into 3 segments at random places (each
    example of a batch cut elsewhere)."""
    def make(g):
        length = 6
        data = distinct(g, 3, length) if axis == 0 else distinct(g, 2, length, 2)
        if axis == 0:
            data = data.T.contiguous()
        lead = () if axis == 0 else (2,)
        low = 0 if empty else 1
        cuts = []
        for _ in range(max(1, len(lead) and lead[0])):
            first = int(torch.randint(low, 3, (), generator=g))
            second = int(torch.randint(low, length - first - low + 1, (), generator=g))
            lengths = [first, second, length - first - second]
            cuts.append(lengths if by == "lengths" else
                        [0, first, first + second, length])
        segments = torch.tensor(cuts if lead else cuts[0])
        return data, segments
    return make


SEGMENT_CASES = [
    OpCase(f"segment_{reduce}_{by}_axis{axis}", _segment(reduce, by, axis, initial),
           _segment_inputs(by, axis))
    for reduce, initial in (("sum", None), ("mean", None), ("max", None), ("min", 0.5),
                            ("prod", None))
    for by in ("lengths", "offsets") for axis in (0, 1)
] + [OpCase("segment_sum_empty", _segment("sum", "lengths"), _segment_inputs("lengths", 0, True)),
     OpCase("segment_max_initial", _segment("max", "offsets", 1, 0.3),
            _segment_inputs("offsets", 1))]


@pytest.mark.parametrize("case, transform", list(transform_params(SEGMENT_CASES)))
def test_segment_reduce_under_transform(case, transform):
    check_first_order_only(case, transform, "_segment_reduce_backward")


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: c.name)
def test_segment_reduce_finite_differences(case):
    check_finite_differences(case)


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: c.name)
def test_segment_reduce_vmap_uses_no_fallback(case):
    with mf.capture_fallbacks() as used:
        mf.vmap(mf.grad(lambda *a: case.fn(*a).sum()))(*case.batch())
    assert not used, f"{case.name}: per-example fallback for {dict(used)}"


# --- batch norm of an empty input --------------------------------------------------------------------
@pytest.mark.parametrize("shape, training, affine", [
    ((0,), True, False), ((0,), False, False), ((0, 3), True, True), ((2, 0, 4), False, False),
])
def test_batch_norm_of_an_empty_input(shape, training, affine):
    """NOTE [Batch norm of an empty input]: torch returns a copy, no statistics involved."""
    channels = shape[1] if len(shape) > 1 else 0
    stats = (torch.zeros(channels, dtype=DTYPE), torch.ones(channels, dtype=DTYPE))
    weight = torch.randn(channels, dtype=DTYPE) if affine else None
    bias = torch.randn(channels, dtype=DTYPE) if affine else None

    def f(x, weight, bias):
        return F.batch_norm(x, *stats, weight, bias, training=training)
    x = torch.zeros(shape, dtype=DTYPE)
    ours = mf.vjp(lambda x: f(x, weight, bias), x)
    theirs = tf.vjp(lambda x: f(x, weight, bias), x)
    assert_same(ours[0], theirs[0])
    ct = torch.zeros(shape, dtype=DTYPE)
    assert_same(ours[1](ct), theirs[1](ct))
    assert_same(mf.jvp(lambda x: f(x, weight, bias), (x,), (x,)),
                tf.jvp(lambda x: f(x, weight, bias), (x,), (x,)))
    xs = torch.zeros((3,) + shape, dtype=DTYPE)
    assert_same(mf.vmap(lambda x: f(x, weight, bias))(xs),
                tf.vmap(lambda x: f(x, weight, bias))(xs))
    if affine:
        assert_same(mf.grad(lambda w: f(x, w, bias).sum(), argnums=0)(weight),
                    tf.grad(lambda w: f(x, w, bias).sum(), argnums=0)(weight))


# --- embedding and embedding_bag: max_norm, sparse, scale_grad_by_freq ------------------------------
def _embedding_weight(seed=0):
    g = torch.Generator().manual_seed(seed)
    return normal(g, 6, 3) * 2


IDX = torch.tensor([[0, 2], [2, 5]])


@pytest.mark.parametrize("kwargs", [dict(max_norm=1.0), dict(max_norm=1.5, norm_type=1.0),
                                    dict(sparse=True), dict(sparse=True, padding_idx=2)])
def test_embedding_max_norm_and_sparse(kwargs):
    """NOTE [embedding with max_norm renormalizes the weight in place] and NOTE [embedding
    with sparse=True]: values, derivatives and the caller's weight as torch.func leaves them."""
    def f(w):
        return F.embedding(IDX, w, **kwargs)
    ct = torch.randn(2, 2, 3, dtype=DTYPE)
    results = {}
    for ft in (mf, tf):
        w = _embedding_weight()
        out, pull = ft.vjp(f, w)
        grad = pull(ct)[0]
        w_jvp = _embedding_weight()
        jvp = ft.jvp(f, (w_jvp,), (torch.ones_like(w_jvp),))
        ws = torch.stack([_embedding_weight(1), _embedding_weight(2)])
        batched = ft.vmap(f)(ws)
        idxs = torch.stack([IDX, IDX.flip(0)])
        ws2 = ws.clone()
        both = ft.vmap(lambda w, i: F.embedding(i, w, **kwargs))(ws2, idxs)
        results[ft] = (out, grad.to_dense() if grad.is_sparse else grad, grad.layout, w,
                       jvp, w_jvp, batched, ws, both, ws2)
    for ours, theirs in zip(results[mf], results[tf]):
        if isinstance(ours, torch.layout):
            assert ours == theirs
        else:
            assert_same(ours, theirs)


def test_embedding_max_norm_refusals():
    w = _embedding_weight()
    idxs = torch.stack([IDX, IDX.flip(0)])
    with pytest.raises(TransformError, match="torch.func refuses it too"):
        mf.vmap(lambda i: F.embedding(i, w, max_norm=1.0))(idxs)
    with pytest.raises(RuntimeError):
        tf.vmap(lambda i: F.embedding(i, w.clone(), max_norm=1.0))(idxs)
    ws = torch.stack([w, w])
    with pytest.raises(TransformError, match="sparse=False"):
        mf.vmap(mf.grad(lambda w: F.embedding(IDX, w, sparse=True).sum()))(ws)
    with pytest.raises(TransformError, match="scale_grad_by_freq is not supported with sparse"):
        mf.grad(lambda w: F.embedding(IDX, w, sparse=True, scale_grad_by_freq=True).sum())(w)


def _bag(**kwargs):
    offsets = torch.tensor([0, 2, 2, 5])

    def fn(w, per_sample_weights=None):
        return F.embedding_bag(torch.tensor([2, 2, 4, 1, 2, 0, 4]), w, offsets,
                               per_sample_weights=per_sample_weights, **kwargs)
    return fn


@pytest.mark.parametrize("kwargs", [
    dict(mode="sum", scale_grad_by_freq=True), dict(mode="mean", scale_grad_by_freq=True),
    dict(mode="sum", scale_grad_by_freq=True, padding_idx=4),
    dict(mode="sum", max_norm=1.0), dict(mode="max", max_norm=2.0, norm_type=1.0),
    dict(mode="mean", sparse=True), dict(mode="sum", sparse=True, padding_idx=2),
])
def test_embedding_bag_options(kwargs):
    """NOTE [embedding_bag's scale_grad_by_freq, as torch's kernel computes it] (torch.func
    has no jvp of embedding_bag: the tangent is checked against its jacrev)."""
    f = _bag(**kwargs)
    ct = torch.randn(4, 3, dtype=DTYPE)
    (out, pull), (out_t, pull_t) = mf.vjp(f, _embedding_weight()), tf.vjp(f, _embedding_weight())
    assert_same(out, out_t)
    ours, theirs = pull(ct)[0], pull_t(ct)[0]
    assert ours.layout == theirs.layout
    assert_same(ours.to_dense() if ours.is_sparse else ours,
                theirs.to_dense() if theirs.is_sparse else theirs)
    if not kwargs.get("sparse"):
        w, t = _embedding_weight(), torch.randn(6, 3, dtype=DTYPE)
        jacobian = tf.jacrev(f)(_embedding_weight())
        _, out_dot = mf.jvp(f, (w,), (t,))
        torch.testing.assert_close(out_dot, (jacobian * t).sum((-2, -1)))
    ws = torch.stack([_embedding_weight(1), _embedding_weight(2)])
    ws_t = ws.clone()
    assert_same(mf.vmap(f)(ws), tf.vmap(f)(ws_t))
    assert_same(ws, ws_t)


def test_embedding_bag_scale_grad_with_per_sample_weights_under_vmap():
    f = _bag(mode="sum", scale_grad_by_freq=True)
    psw = torch.rand(3, 7, dtype=DTYPE)
    w = _embedding_weight()

    def loss(w, p):
        return (f(w, p) ** 2).sum()
    assert_same(mf.vmap(mf.grad(loss), in_dims=(None, 0))(w, psw),
                tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, psw))


# --- linear_cross_entropy's chunked ops ------------------------------------------------------------
def _chunked(reduction, ignore_index=None, with_weight=False):
    options = F.LinearCrossEntropyOptions(batch_chunk_size=2) if hasattr(
        F, "LinearCrossEntropyOptions") else None

    def fn(x, w, b, target, class_weight, chunked=True):
        kwargs = dict(linear_bias=b, reduction=reduction, ignore_index=ignore_index,
                      weight=class_weight if with_weight else None)
        if chunked:
            kwargs["options"] = options
        return F.linear_cross_entropy(x, w, target, **kwargs)
    return fn


def _chunked_inputs(g):
    return (normal(g, 5, 3), normal(g, 4, 3), normal(g, 4),
            torch.tensor([0, 3, 1, 3, 2]), torch.rand(4, generator=g, dtype=DTYPE) + 0.5)


CHUNKED = [("mean", None, False), ("sum", 3, True), ("none", None, True), ("mean", 1, True)]


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has none")
@pytest.mark.parametrize("reduction, ignore_index, with_weight", CHUNKED)
def test_linear_cross_entropy_chunked(reduction, ignore_index, with_weight):
    """NOTE [linear_cross_entropy's chunked ops are cross_entropy of linear]: checked against
    torch.func on the unchunked computation (torch.func's own jvp of the chunked op gives
    zero tangents) and against central differences."""
    from torch.nn.modules import linear_cross_entropy  # noqa: F401  (defines the ops)
    fn = _chunked(reduction, ignore_index, with_weight)
    args = _chunked_inputs(torch.Generator().manual_seed(0))
    reference = lambda *a: fn(*a, chunked=False)  # noqa: E731
    with mf.capture_fallbacks() as used:
        assert_same(mf.jacrev(fn, argnums=(0, 1, 2))(*args),
                    tf.jacrev(reference, argnums=(0, 1, 2))(*args))
        tangents = tuple(torch.randn_like(a) for a in args[:3])
        assert_same(mf.jvp(lambda *d: fn(*d, *args[3:]), args[:3], tangents),
                    tf.jvp(lambda *d: reference(*d, *args[3:]), args[:3], tangents))
        batch = tuple(torch.stack([a, a * 0.5, a * 2]) if a.is_floating_point() else
                      torch.stack([a, a.flip(0), a]) for a in args)
        assert_same(mf.vmap(fn)(*batch), tf.vmap(reference)(*batch))
        assert_same(mf.vmap(fn, in_dims=(0, None, None, 0, None))(batch[0], *args[1:3],
                                                                  batch[3], args[4]),
                    tf.vmap(reference, in_dims=(0, None, None, 0, None))(
                        batch[0], *args[1:3], batch[3], args[4]))
    assert not used, dict(used)
    scalar = lambda x: (fn(x, *args[1:]) * 1.5).sum()  # noqa: E731
    x = args[0]
    step = torch.zeros_like(x)
    step[1, 2] = 1e-6
    expected = (scalar(x + step) - scalar(x - step)) / 2e-6
    torch.testing.assert_close(mf.grad(scalar)(x)[1, 2], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has none")
def test_linear_cross_entropy_chunked_op_returns_its_gradients():
    """The mean/sum op also returns its precomputed gradients: the same as torch's kernel."""
    from torch.nn.modules import linear_cross_entropy  # noqa: F401
    op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
    x, w, b, target, class_weight = _chunked_inputs(torch.Generator().manual_seed(1))

    def call(x):
        return op(x, w, target, b, class_weight, "mean", -100, 0.0, 2, "balanced", DTYPE, True,
                  True, True, True)
    xs = torch.stack([x, x * 0.5])
    ours = mf.vmap(call)(xs)
    theirs = [torch.stack(column) for column in zip(*(call(example) for example in xs))]
    for a, b_ in zip(ours, theirs):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-8)


# --- shapes that depend on the data, where every example agrees ---------------------------------------
def test_argwhere_under_vmap():
    """NOTE [argwhere under vmap: one shape or an error]."""
    x = torch.tensor([[1.0, 0, 2], [0, 0, 3]], dtype=DTYPE)
    xs = torch.stack([x, x * 0.9, x * 0.8])
    assert_same(mf.vmap(torch.argwhere)(xs), tf.vmap(torch.argwhere)(xs))
    assert_same(mf.vmap(torch.argwhere, in_dims=1)(xs.movedim(0, 1)),
                tf.vmap(torch.argwhere, in_dims=1)(xs.movedim(0, 1)))

    def f(x):
        return (x * torch.argwhere(x).sum()).sum()
    # (torch.func's vmap of grad refuses argwhere; the grad is that of the other factor)
    assert_same(mf.vmap(mf.grad(f))(xs), torch.full_like(xs, 5.0))
    assert_same(mf.grad(lambda x: mf.vmap(f)(x).sum())(xs),
                tf.grad(lambda x: tf.vmap(f)(x).sum())(xs))
    with pytest.raises(TransformError, match="stack expects each tensor to be equal size"):
        mf.vmap(torch.argwhere)(torch.stack([x, torch.ones_like(x)]))


@pytest.mark.parametrize("repeats", [
    torch.tensor([[1, 2, 0]] * 3), torch.tensor([[1, 2, 0], [0, 2, 1], [3, 0, 0]]),
    torch.tensor([2, 2, 2]),
])
def test_repeat_interleave_with_batched_repeats(repeats):
    """NOTE [repeat_interleave with repeats batched by vmap]."""
    x = torch.randn(2, 3, dtype=DTYPE)
    xs = torch.stack([x, x * 0.9, x * 0.8])

    def f(x, r):
        return x.repeat_interleave(r, dim=1)

    def g(x, r):
        return (f(x, r) ** 2).sum()
    assert_same(mf.vmap(f)(xs, repeats), tf.vmap(f)(xs, repeats))
    assert_same(mf.vmap(f, in_dims=(None, 0))(x, repeats),
                tf.vmap(f, in_dims=(None, 0))(x, repeats))
    assert_same(mf.vmap(mf.grad(g))(xs, repeats), tf.vmap(tf.grad(g))(xs, repeats))
    with pytest.raises(TransformError, match="stack expects each tensor to be equal size"):
        mf.vmap(f)(xs, torch.tensor([[1, 2, 0], [1, 2, 1], [0, 0, 0]]))


@pytest.mark.parametrize("size, fill_value", [(0, -1), (2, -1), (5, 7), (12, -3)])
def test_nonzero_static_under_vmap(size, fill_value):
    """NOTE [nonzero_static under vmap]: examples with different counts, nested vmaps."""
    g = torch.Generator().manual_seed(0)
    xs = (torch.rand(3, 2, 2, 3, generator=g) > 0.5).to(DTYPE) * normal(g, 3, 2, 2, 3)

    def f(x):
        return torch.nonzero_static(x, size=size, fill_value=fill_value)
    with mf.capture_fallbacks() as used:
        assert_same(mf.vmap(f)(xs), tf.vmap(f)(xs))
        assert_same(mf.vmap(f, in_dims=2)(xs), tf.vmap(f, in_dims=2)(xs))
        assert_same(mf.vmap(mf.vmap(f))(xs), tf.vmap(tf.vmap(f))(xs))
        assert_same(mf.vmap(mf.vmap(f), in_dims=1)(xs), tf.vmap(tf.vmap(f), in_dims=1)(xs))
        assert_same(mf.vmap(f)(xs[:, 0, 0, 0]), tf.vmap(f)(xs[:, 0, 0, 0]))
    assert not used, dict(used)
    assert_same(mf.grad(lambda x: (x * f(x).sum()).sum())(xs[0]),
                tf.grad(lambda x: (x * f(x).sum()).sum())(xs[0]))


@pytest.mark.parametrize("kwargs", [{}, dict(dim=0), dict(dim=-1, keepdim=True),
                                    dict(dim=(0, 2)), dict(mode=0)])
def test_hash_tensor_under_vmap(kwargs):
    g = torch.Generator().manual_seed(0)
    xs = normal(g, 3, 2, 4, 2)

    def f(x):
        return torch.hash_tensor(x, **kwargs)
    with mf.capture_fallbacks() as used:
        assert_same(mf.vmap(f)(xs), tf.vmap(f)(xs))
        assert_same(mf.vmap(f, in_dims=3)(xs), tf.vmap(f, in_dims=3)(xs))
        if not isinstance(kwargs.get("dim"), tuple):
            assert_same(mf.vmap(mf.vmap(f), in_dims=(1,))(xs),
                        tf.vmap(tf.vmap(f), in_dims=(1,))(xs))
    assert not used, dict(used)
    if not kwargs.get("dim"):
        assert_same(mf.vmap(f)(xs[:, 0, 0, 0]), tf.vmap(f)(xs[:, 0, 0, 0]))


def test_resize_as_under_vmap():
    """NOTE [resize_ keeps the first elements]: same-shape resizes run under vmap with one
    reshape; derivatives are refused as torch refuses them; a resize to more elements (its
    new elements uninitialized) is refused."""
    a, b = torch.randn(3, 4, 3, dtype=DTYPE), torch.randn(3, 4, 3, dtype=DTYPE)

    def f(a, b):
        return a.clone().resize_as_(b) * 2
    with mf.capture_fallbacks() as used:
        assert_same(mf.vmap(f)(a, b), tf.vmap(f)(a, b))
        assert_same(mf.vmap(f, in_dims=(1, None))(a, b[0, :3, :]),
                    tf.vmap(f, in_dims=(1, None))(a, b[0, :3, :]))
    assert not used, dict(used)
    with pytest.raises(TransformError, match="cannot resize variables that require grad"):
        mf.vjp(lambda a: a.resize_as_(b[0]), a[0])
    with pytest.raises(TransformError, match="cannot resize variables that has a forward grad"):
        mf.jvp(lambda a: a.clone().resize_(4, 3), (a[0],), (a[0],))
    with pytest.raises(TransformError, match="uninitialized"):
        mf.vmap(lambda a: a.clone().resize_(5, 5))(a)


# --- rrelu (NOTE [rrelu outside vmap]) -------------------------------------------------------
@pytest.mark.parametrize("training", [False, True], ids=["eval", "training"])
def test_rrelu_under_grad_and_jvp_draws_torchs_slopes(training):
    x = torch.randn(4, 5, dtype=torch.float64)
    f = lambda a: torch.nn.functional.rrelu(a, 0.1, 0.3, training=training)  # noqa: E731
    for transform in (lambda api: api.grad(lambda a: (f(a) * a.cos()).sum())(x),
                      lambda api: api.jvp(f, (x,), (x.sin(),)),
                      lambda api: api.jacrev(f)(x)):
        torch.manual_seed(7)
        ours = transform(mf)
        torch.manual_seed(7)
        theirs = transform(torch.func)
        torch.testing.assert_close(ours, theirs)


def test_rrelu_refuses_what_torch_func_refuses():
    x = torch.randn(3, 4)
    with pytest.raises(mf.TransformError, match="rrelu"):
        mf.vmap(lambda a: torch.nn.functional.rrelu(a, training=True),
                randomness="different")(x)
    with pytest.raises(mf.TransformError, match="inplace=True"):
        mf.grad(lambda a: torch.nn.functional.rrelu(a, inplace=True).sum())(x)
