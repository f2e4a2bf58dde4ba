"""Grad modes inside transforms, and torch.autograd.grad / backward() inside transforms, against
torch.func (core/grad_mode.py, NOTE [Grad modes and transform levels]; core/autograd.py, NOTE
[torch.autograd.grad inside transforms]).

Each case is a function of the transform API (``torch.func`` or ``minifunctorch.core``): it runs
on both, and the results must agree (values, and ``requires_grad`` where torch.func sets it).
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func
import torch.nn.functional as F

import minifunctorch.core as mft
from minifunctorch.core.errors import TransformError, UnsupportedOperationError
from minifunctorch.core import grad_mode

X = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)
ONE = torch.ones(4, dtype=torch.float64)
XS = torch.stack([X, X * 0.5 + 0.1, -X])


@pytest.fixture(autouse=True)
def _float64_by_default():
    """The cases make their tensors in float64 (finite differences); restored after each."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _assert_same(expected, got):
    if isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(expected), (expected, got)
        for e, g in zip(expected, got):
            _assert_same(e, g)
        return
    if expected is None:
        assert got is None
        return
    assert type(got) is torch.Tensor, f"expected a plain tensor, got {type(got).__name__}"
    torch.testing.assert_close(got, expected)
    assert got.requires_grad == expected.requires_grad, (
        f"requires_grad: torch.func {expected.requires_grad}, here {got.requires_grad}")


def _both(case):
    expected = case(torch.func)
    got = case(mft)
    _assert_same(expected, got)
    return got


# --- grad modes ---------------------------------------------------------------------------------
def no_grad_inside(api):
    def f(x):
        with torch.no_grad():
            y = x.sin()
        return (y * x).sum()
    return api.grad(f)(X)


def inference_mode_inside(api):
    def f(x):
        with torch.inference_mode():
            c = x ** 2
        return (x - c).sum()
    return api.grad(f)(X)


def set_grad_enabled_false_inside(api):
    def f(x):
        with torch.set_grad_enabled(False):
            c = x ** 2
        return (x * c).sum()
    return api.grad(f)(X)


def enable_grad_inside_no_grad(api):
    def f(x):
        with torch.no_grad():
            with torch.enable_grad():
                c = x ** 2  # recorded
            d = x ** 3      # not recorded
        return (x * c + d).sum()
    return api.grad(f)(X)


def no_grad_outside(api):
    def f(x):
        with torch.no_grad():
            c = x ** 2
        return (x * c + x ** 3).sum()
    with torch.no_grad():
        return api.grad(f)(X)


def no_grad_outside_leaf(api):
    # grad ignores the outer no_grad, which still stops torch's own autograd
    x = X.clone().requires_grad_()
    with torch.no_grad():
        return api.grad(lambda x: x.sin().sum())(x)


def no_grad_inside_leaf_second_order(api):
    # torch's autograd records the grad level's work on a leaf: the result can be
    # differentiated again with torch.autograd.grad outside
    def f(x):
        with torch.no_grad():
            shift = x ** 2
        return (x ** 2 - shift).sum()
    x = X.clone().requires_grad_()
    y = api.grad(f)(x)
    return y.detach(), torch.autograd.grad(y.sum(), x)[0]


def nested_no_grad_around_inner_grad(api):
    def f(x):
        with torch.no_grad():
            g = api.grad(lambda y: (y ** 3).sum())(x)
        return (g * x).sum()
    return api.grad(f)(X)


def nested_no_grad_in_inner(api):
    def outer(x):
        def inner(y):
            with torch.no_grad():
                c = y ** 2
            return (c * y).sum() + (y * x).sum()
        return api.grad(inner)(x).sum()
    return api.grad(outer)(X)


def nested_no_grad_on_outer_value(api):
    def outer(x):
        def inner(y):
            with torch.no_grad():
                c = x ** 2  # a value of the outer level
            return (c * y).sum()
        return (api.grad(inner)(x) * x).sum()
    return api.grad(outer)(X)


def inner_grad_created_under_no_grad_captures_outer(api):
    def outer(x):
        with torch.no_grad():
            g = api.grad(lambda y: (y ** 2 * x).sum())(x)
        return (g * x).sum()
    return api.grad(outer)(X)


def skipped_level(api):
    # The innermost grad uses a value of the outermost level directly, skipping the middle
    # level that was entered under no_grad: the outermost must not record (the floor).
    def outer(x):
        with torch.no_grad():
            def middle(z):
                with torch.enable_grad():
                    return api.grad(lambda y: (y ** 2 * x).sum())(z).sum()
            g = api.grad(middle)(x)
        return (g * x).sum()
    return api.grad(outer)(X)


def skipped_level_without_enable_grad(api):
    def outer(x):
        with torch.no_grad():
            def middle(z):
                return (api.grad(lambda y: (y ** 2 * x).sum())(z) * x).sum()
            g = api.grad(middle)(x)
        return (g * x).sum()
    return api.grad(outer)(X)


def grad_and_value_under_no_grad(api):
    def h(x):
        with torch.no_grad():
            _, value = api.grad_and_value(lambda x: (x ** 3).sum())(x)
        return (x ** 3).sum() - value
    return api.grad(h)(X)


def vmap_grad_no_grad(api):
    def f(x):
        with torch.no_grad():
            y = x.sin()
        return (y * x).sum()
    return api.vmap(api.grad(f))(XS)


def grad_vmap_no_grad_inside(api):
    def f(x):
        def row(r):
            with torch.no_grad():
                s = r.sin()
            return s * r
        return api.vmap(row)(x).sum()
    return api.grad(f)(XS)


def jacrev_no_grad(api):
    def f(x):
        with torch.no_grad():
            c = x.exp()
        return c * x.sin()
    return api.jacrev(f)(X)


def hessian_no_grad(api):
    def f(x):
        with torch.no_grad():
            c = x.exp()
        return (c * x ** 3).sum()
    return api.hessian(f)(X)


def vjp_fn_under_no_grad_inside_grad(api):
    def f(x):
        _, vjp_fn = api.vjp(lambda y: y ** 3, x)
        with torch.no_grad():
            g = vjp_fn(ONE)[0]
        return (g * x).sum()
    return api.grad(f)(X)


def vjp_under_no_grad_fn_outside(api):
    def f(x):
        with torch.no_grad():
            out, vjp_fn = api.vjp(lambda y: y ** 3, x)
        g = vjp_fn(ONE)[0]
        return (g * x + out).sum()
    return api.grad(f)(X)


def vjp_no_grad_outside(api):
    x = X.clone().requires_grad_()
    with torch.no_grad():
        out, vjp_fn = api.vjp(lambda x: x ** 2, x)
        return out, vjp_fn(ONE)[0]


def vjp_no_grad_outside_only(api):
    x = X.clone().requires_grad_()
    with torch.no_grad():
        out, vjp_fn = api.vjp(lambda x: x ** 2, x)
    y = vjp_fn(ONE)[0]  # requires grad: the backward ran with grad on, on the leaf
    return out, y.detach(), torch.autograd.grad(y.sum(), x)[0]


def jvp_ignores_no_grad(api):
    def f(x):
        with torch.no_grad():
            c = x ** 2
        return x * c
    return api.jvp(f, (X,), (ONE,))


def jvp_fwd_grad_disabled_inside(api):
    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            c = x ** 2
        return x * c
    return api.jvp(f, (X,), (ONE,))


def jvp_fwd_grad_disabled_outside(api):
    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            c = x ** 2
        return x * c + x.sin()
    with fwAD._set_fwd_grad_enabled(False):
        return api.jvp(f, (X,), (ONE,))


def nested_jvp_fwd_disabled(api):
    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            c = api.jvp(lambda y: y ** 3 * x, (x,), (ONE,))[1]
        return c * x
    return api.jvp(f, (X,), (ONE,))


def grad_ignores_fwd_disabled(api):
    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            c = x ** 2
        return (x * c).sum()
    return api.grad(f)(X)


def grad_of_jvp_fwd_disabled(api):
    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            c = x ** 2
        return x * c
    return api.grad(lambda x: api.jvp(f, (x,), (ONE,))[1].sum())(X)


def jvp_of_grad_no_grad(api):
    def f(x):
        with torch.no_grad():
            y = x.sin()
        return (y * x).sum()
    return api.jvp(api.grad(f), (X,), (ONE,))


def inference_mode_outside(api):
    with torch.inference_mode():
        return (api.grad(lambda x: (x ** 2).sum())(X),
                api.jvp(lambda x: (x ** 2).sum(), (X,), (ONE,))[1],
                api.jacrev(api.grad(lambda x: (x ** 3).sum()))(X))


def inference_mode_inside_under_inference_mode(api):
    def f(x):
        with torch.inference_mode():
            c = x ** 2
        return (x - c).sum()
    with torch.inference_mode():
        return api.grad(f)(X)


def mode_seen_inside(api):
    seen = []

    def record(x):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     fwAD._is_fwd_grad_enabled()))
        return x.sum()
    with torch.no_grad():
        api.grad(record)(X)
        api.vmap(record)(XS)
        api.jvp(record, (X,), (ONE,))
    with torch.inference_mode():
        api.grad(record)(X)
        api.jvp(record, (X,), (ONE,))
    with fwAD._set_fwd_grad_enabled(False):
        api.jvp(record, (X,), (ONE,))
        api.grad(record)(X)
    return torch.tensor(seen, dtype=torch.float64)


def requires_grad_seen_inside(api):
    seen = []

    def record(x):
        flags = [x.requires_grad, (x * 2).requires_grad]
        with torch.no_grad():
            flags.append((x * 2).requires_grad)
        seen.append(flags)
        return x.sum()
    api.grad(record)(X)
    with torch.no_grad():
        api.grad(record)(X)
    api.vmap(record)(XS)
    api.jvp(record, (X,), (ONE,))
    return torch.tensor(seen, dtype=torch.float64)


def layer_norm_no_grad(api):
    w = torch.linspace(0.5, 1.5, 4)

    def f(x):
        with torch.no_grad():
            scale = F.layer_norm(x, (4,), w).exp()
        return (F.layer_norm(x, (4,), w) * scale).tanh().sum()
    return api.grad(f)(X), api.vmap(api.grad(f))(XS)


def write_back_through_vmap_inside_grad(api):
    # vmap writes an input in place, with its batch dim moved: the write into the caller's
    # tensor (a value of grad) must be recorded by grad (the write-back is not under no_grad)
    x = torch.tensor([[0.3, -1.2], [2.0, 0.5], [1.0, 1.5]])

    def f(x):
        buf = x * 1
        z = x.t() * 1
        api.vmap(lambda y, w: y.add_(w * w), in_dims=(1, 0))(buf, z)
        return (buf * x).sum()
    return api.grad(f)(x)


def _clamp_under_no_grad(y):
    z = y * 2
    with torch.no_grad():
        z.clamp_(max=1.0)  # new contents, same history: gradients flow straight through
    return (z * y).sum()


def in_place_under_no_grad(api):
    return api.grad(_clamp_under_no_grad)(X)


def in_place_under_no_grad_vmap(api):
    return (api.vmap(api.grad(_clamp_under_no_grad))(XS),
            api.grad(lambda xs: api.vmap(_clamp_under_no_grad)(xs).sum())(XS))


def in_place_under_no_grad_through_view(api):
    def f(y):
        z = y * 2
        with torch.no_grad():
            z[1:3].mul_(10)
        return (z * y).sum()
    return api.grad(f)(X)


def in_place_under_no_grad_on_input(api):
    def f(y):
        with torch.no_grad():
            y.mul_(3)
        return (y * y).sum()
    return api.grad(f)(X.clone())


def in_place_under_no_grad_moved_batch_dim(api):
    def f(xs):
        def row(r):
            z = r * 2
            with torch.no_grad():
                z.add_(XS[0] * 5)  # an unbatched addend: the batch dim may move
            return (z * r).sum()
        return api.vmap(row, in_dims=1)(xs).sum()
    return api.grad(f)(XS.t().contiguous())


def gaussian_nll_loss_small_variance(api):
    # torch clamps the variance in place under no_grad
    var = torch.tensor([0.5, 1e-8, 2.0, 1e-9])
    return api.grad(lambda v: F.gaussian_nll_loss(X, X.flip(0), v, reduction="sum"))(var)


def torch_internal_no_grad_in_back_door(api):
    # torch's decomposition of diagonal_scatter copies under no_grad inside the back door
    # (a prim's aten version): that is torch's bookkeeping, not the user's no_grad
    m = torch.arange(16.0).reshape(4, 4) / 10

    def f(x):
        return (torch.diagonal_scatter(m * x.sum(), x.sin()) * m.t()).sum()
    return api.grad(f)(X), api.vjp(torch.diagonal_scatter, m, X)[1](m)


GRAD_MODE_CASES = [
    torch_internal_no_grad_in_back_door,
    in_place_under_no_grad, in_place_under_no_grad_vmap, in_place_under_no_grad_through_view,
    in_place_under_no_grad_on_input, in_place_under_no_grad_moved_batch_dim,
    gaussian_nll_loss_small_variance, write_back_through_vmap_inside_grad,
    no_grad_inside, inference_mode_inside, set_grad_enabled_false_inside,
    enable_grad_inside_no_grad, no_grad_outside, no_grad_outside_leaf,
    no_grad_inside_leaf_second_order, nested_no_grad_around_inner_grad, nested_no_grad_in_inner,
    nested_no_grad_on_outer_value, inner_grad_created_under_no_grad_captures_outer,
    skipped_level, skipped_level_without_enable_grad, grad_and_value_under_no_grad,
    vmap_grad_no_grad, grad_vmap_no_grad_inside, jacrev_no_grad, hessian_no_grad,
    vjp_fn_under_no_grad_inside_grad, vjp_under_no_grad_fn_outside, vjp_no_grad_outside,
    vjp_no_grad_outside_only, jvp_ignores_no_grad, jvp_fwd_grad_disabled_inside,
    jvp_fwd_grad_disabled_outside, nested_jvp_fwd_disabled, grad_ignores_fwd_disabled,
    grad_of_jvp_fwd_disabled, jvp_of_grad_no_grad, inference_mode_outside,
    inference_mode_inside_under_inference_mode, mode_seen_inside, requires_grad_seen_inside,
    layer_norm_no_grad,
]


@pytest.mark.parametrize("case", GRAD_MODE_CASES, ids=[c.__name__ for c in GRAD_MODE_CASES])
def test_grad_mode_matches_torch_func(case):
    _both(case)


def test_no_grad_inside_is_the_value_of_the_issue():
    # the example of the issue: the no_grad part is a constant, so the gradient is sin(x)
    torch.testing.assert_close(no_grad_inside(mft), X.sin())
    # and the same function without no_grad differs: the case is not vacuous
    assert not torch.allclose(mft.grad(lambda x: (x.sin() * x).sum())(X), X.sin())


def test_finite_differences_with_no_grad_inside():
    def f(x):
        with torch.no_grad():
            c = x.exp()
        return (c * x.sin()).sum()
    c = X.exp()
    g = mft.grad(f)(X)
    eps = 1e-6
    for i in range(4):
        e = torch.zeros(4)
        e[i] = eps
        numeric = ((c * (X + e).sin()).sum() - (c * (X - e).sin()).sum()) / (2 * eps)
        torch.testing.assert_close(g[i], numeric, atol=1e-7, rtol=1e-6)


def test_modes_restored_after_an_error():
    def fails(x):
        with torch.no_grad():
            raise ValueError("boom")
    for outer_grad in (True, False):
        with torch.set_grad_enabled(outer_grad):
            with pytest.raises(ValueError, match="boom"):
                mft.grad(fails)(X)
            assert torch.is_grad_enabled() is outer_grad
    with fwAD._set_fwd_grad_enabled(False):
        with pytest.raises(ValueError, match="boom"):
            mft.jvp(fails, (X,), (ONE,))
        assert not fwAD._is_fwd_grad_enabled()
    assert fwAD._is_fwd_grad_enabled()
    with torch.inference_mode():
        with pytest.raises(ValueError, match="boom"):
            mft.grad(fails)(X)
        assert torch.is_inference_mode_enabled()
    assert grad_mode.floors == [0, 0]
    torch.testing.assert_close(no_grad_inside(mft), X.sin())  # the next call works


def test_explicit_api_ignores_grad_modes():
    # a level of the explicit API is not a transform call: no_grad does not change its tape
    from minifunctorch.core import Autograd, Torch, label
    d = Autograd(Torch())
    a = label(torch.tensor([1.0, 2.0]), "a")
    with torch.no_grad():
        d.mul(a, a)
    d.mul(a, a)
    assert len(d.tape) == 2


# --- torch.autograd.grad inside transforms --------------------------------------------------------
W = torch.tensor([0.5, -1.0, 1.5, 2.0], requires_grad=True)


def batched_grad_outputs(api):
    out = W.sin() * W
    return api.vmap(lambda v: torch.autograd.grad(out, W, v, retain_graph=True)[0])(XS)


def batched_grad_outputs_several(api):
    a, b = W * 2, W ** 3
    return api.vmap(lambda v: torch.autograd.grad([a, b], [W], [v, v * 2],
                                                  retain_graph=True))(XS)


def batched_grad_outputs_create_graph(api):
    out = W ** 3
    result = api.vmap(lambda v: torch.autograd.grad(out, W, v, create_graph=True)[0])(XS)
    return result.detach(), torch.autograd.grad(result.sum(), W)[0]


def batched_second_order(api):
    first = torch.autograd.grad((W.exp() * W).sum(), W, create_graph=True)[0]
    return api.vmap(lambda v: torch.autograd.grad(first, W, v, retain_graph=True)[0])(XS)


def batched_allow_unused(api):
    other = torch.ones(2, requires_grad=True)
    out = W.exp()

    def f(v):
        g = torch.autograd.grad(out, [W, other], v, retain_graph=True, allow_unused=True)
        assert g[1] is None
        return g[0]
    return api.vmap(f)(XS)


def batched_materialize_grads(api):
    other = torch.ones(2, requires_grad=True)
    out = W.exp()
    return api.vmap(lambda v: torch.autograd.grad(out, [W, other], v, retain_graph=True,
                                                  materialize_grads=True))(XS)


def leaf_made_inside_vmap(api):
    def f(x):
        w = torch.ones(4, requires_grad=True)
        return torch.autograd.grad((w * 2).sum(), w)[0] * x
    return api.vmap(f)(XS)


def leaf_made_inside_vmap_batched_grad_outputs(api):
    def f(x):
        w = torch.linspace(0.1, 0.4, 4, requires_grad=True)
        return torch.autograd.grad(w.tanh(), w, x)[0]
    return api.vmap(f)(XS)


def inside_grad_no_create_graph(api):
    # the gradient is a constant for the enclosing grad
    return api.grad(lambda x: torch.autograd.grad((x ** 3).sum(), x)[0].sum() + x.sum())(X)


def inside_grad_create_graph(api):
    return api.grad(lambda x: torch.autograd.grad((x ** 3).sum(), x,
                                                  create_graph=True)[0].sum())(X)


def inside_grad_create_graph_nn(api):
    w = torch.linspace(0.5, 1.5, 4)

    def f(x):
        h = F.layer_norm(x, (4,), w)
        loss = (h.softmax(0) * x.tanh()).sum() + F.logsigmoid(h).sum() + (x @ w) ** 2
        g, = torch.autograd.grad(loss, x, create_graph=True)
        return (g ** 2).sum() + (g * x.exp()).sum()
    return api.grad(f)(X)


def inside_grad_create_graph_intermediate_input(api):
    def f(x):
        h = x.sin() * x
        out = (h.exp() * x).sum()
        g, = torch.autograd.grad(out, h, create_graph=True)
        return (g * h).sum()
    return api.grad(f)(X)


def inside_grad_twice_nested(api):
    def f(x):
        def inner(y):
            g = torch.autograd.grad((y ** 3 * x).sum(), y, create_graph=True)[0]
            return (g * y).sum()
        return api.grad(inner)(x).sum()
    return api.grad(f)(X)


def inner_grad_no_create_graph_is_constant_for_all_levels(api):
    def outer(x):
        def inner(y):
            return (torch.autograd.grad((y ** 3).sum(), y)[0] * y).sum()
        return api.grad(inner)(x).sum()
    return api.grad(outer)(X)


def inside_vjp_create_graph(api):
    out, vjp_fn = api.vjp(lambda x: torch.autograd.grad((x ** 3).sum(), x,
                                                        create_graph=True)[0], X)
    return out, vjp_fn(ONE)[0]


def vmap_of_grad_with_autograd_grad(api):
    return api.vmap(api.grad(lambda x: torch.autograd.grad(
        (x.sin() * x ** 2).sum(), x, create_graph=True)[0].sum()))(XS)


def jacrev_with_autograd_grad(api):
    return api.jacrev(lambda x: torch.autograd.grad((x.exp() * x).sum(), x,
                                                    create_graph=True)[0])(X)


def vmap_inside_grad_with_autograd_grad_on_outer(api):
    # vmap on top, the graph at the grad level: one vector-Jacobian product per row
    def f(x):
        h = x.sin() * x
        rows = api.vmap(lambda v: torch.autograd.grad(h, x, v, create_graph=True)[0])(XS)
        return rows.sum()
    return api.grad(f)(X)


def inside_grad_grad_outputs_and_unused(api):
    def f(x):
        c = x * 2
        h = x.exp()
        g = torch.autograd.grad([h, c], [x, c], [x, ONE], create_graph=True,
                                allow_unused=True)
        return g[0].sum() + g[1].sum()
    return api.grad(f)(X)


AUTOGRAD_GRAD_CASES = [
    batched_grad_outputs, batched_grad_outputs_several, batched_grad_outputs_create_graph,
    batched_second_order, batched_allow_unused, batched_materialize_grads,
    leaf_made_inside_vmap, leaf_made_inside_vmap_batched_grad_outputs,
    inside_grad_no_create_graph, inside_grad_create_graph, inside_grad_create_graph_nn,
    inside_grad_create_graph_intermediate_input, inside_grad_twice_nested,
    inner_grad_no_create_graph_is_constant_for_all_levels, inside_vjp_create_graph,
    vmap_of_grad_with_autograd_grad, jacrev_with_autograd_grad,
    vmap_inside_grad_with_autograd_grad_on_outer, inside_grad_grad_outputs_and_unused,
]


@pytest.mark.parametrize("case", AUTOGRAD_GRAD_CASES, ids=[c.__name__ for c in AUTOGRAD_GRAD_CASES])
def test_autograd_grad_matches_torch_func(case):
    _both(case)


def test_create_graph_second_derivative_by_finite_differences():
    # d/dx of sum(g(x)^2) with g = d/dx sum(exp(x) * x) = exp(x) (x + 1)
    got = inside_grad_create_graph_nn(mft)
    assert got.shape == (4,)
    g = lambda x: x.exp() * (x + 1)  # noqa: E731
    h = mft.grad(lambda x: (torch.autograd.grad((x.exp() * x).sum(), x,
                                                create_graph=True)[0] ** 2).sum())(X)
    eps = 1e-6
    for i in range(4):
        e = torch.zeros(4)
        e[i] = eps
        numeric = (((g(X + e)) ** 2).sum() - ((g(X - e)) ** 2).sum()) / (2 * eps)
        torch.testing.assert_close(h[i], numeric, atol=1e-6, rtol=1e-6)


def test_batched_gradient_uses_batching_rules():
    out = (W.sin() * W).exp()
    with mft.capture_fallbacks() as used:
        mft.vmap(lambda v: torch.autograd.grad(out, W, v, retain_graph=True)[0])(XS)
    assert not used


def _raises_like_torch_func(case, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        case(torch.func)
    with pytest.raises(TransformError, match=pattern) as info:
        case(mft)
    assert "Fix:" in str(info.value)


def test_batched_outputs_refused_as_torch_func_does():
    def case(api):
        return api.vmap(lambda x: torch.autograd.grad((x * W).sum(), W)[0])(XS)
    _raises_like_torch_func(case, "element 0 of tensors does not require grad")


def test_jvp_outputs_refused_as_torch_func_does():
    def case(api):
        return api.jvp(lambda x: torch.autograd.grad((x * W).sum(), W)[0], (X,), (ONE,))
    _raises_like_torch_func(case, "element 0 of tensors does not require grad")


def test_unused_input_refused_as_torch_func_does():
    def case(api):
        return api.grad(lambda x: torch.autograd.grad((W * x).sum(), W,
                                                      create_graph=True)[0].sum())(X)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        case(torch.func)
    with pytest.raises(TransformError, match="appears to not have been used in the graph"):
        case(mft)


@pytest.mark.parametrize("where", ["vmap", "grad"])
@pytest.mark.parametrize("what", ["transform value", "plain tensor"])
def test_backward_refused_inside_transforms(where, what):
    def f(x):
        target = x if what == "transform value" else W
        (target * 2).sum().backward()
        return x.sum()

    def case(api):
        return api.vmap(f)(XS) if where == "vmap" else api.grad(f)(X)
    W.grad = None
    with pytest.raises(RuntimeError, match=r"backward\(\) called inside a functorch transform"):
        case(torch.func)
    with pytest.raises(UnsupportedOperationError,
                       match=r"backward\(\) called inside a functorch transform") as info:
        case(mft)
    assert "Fix:" in str(info.value)
    assert W.grad is None
    torch.testing.assert_close(no_grad_inside(mft), X.sin())  # the next call works


def test_is_grads_batched_refused():
    with pytest.raises(UnsupportedOperationError, match="is_grads_batched"):
        mft.grad(lambda x: torch.autograd.grad((x ** 2).sum(), x,
                                               is_grads_batched=True)[0].sum())(X)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "hessian"])
def test_saved_tensor_hooks_entered_inside_a_reverse_transform_are_refused(transform):
    # torch.func refuses them (torch.autograd.graph.disable_saved_tensors_hooks); jvp allows
    def g(a):
        with torch.autograd.graph.save_on_cpu():
            return a.sin().sum()
    x = torch.randn(3)
    call = (lambda api: api.vjp(g, x)) if transform == "vjp" else \
        (lambda api: getattr(api, transform)(g)(x))
    for api in (torch.func, mft):
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            call(api)
    torch.testing.assert_close(mft.jvp(g, (x,), (x,)), torch.func.jvp(g, (x,), (x,)))
    torch.testing.assert_close(mft.grad(lambda a: a.sin().sum())(x), x.cos())  # and after
