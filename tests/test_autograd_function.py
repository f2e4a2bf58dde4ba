"""torch.autograd.Function under every transform, against torch.func on the same classes.

The classes are written in the style of torch's own docs (extending.func): forward without
ctx, setup_context, backward, jvp, and vmap support by a vmap staticmethod or by
generate_vmap_rule=True. Some backwards are deliberately not the true derivative (Tripled):
only a transform that really calls the custom backward agrees with torch.func on them.
"""

import pytest
import torch
import torch.func as tf
from torch.autograd.function import once_differentiable

import minifunctorch.core as mf
from minifunctorch.core.errors import MissingRuleError, TransformError
from op_table import OpCase, normal, positive
from oracle import assert_same, check_finite_differences, check_under_transform, transform_params


# --- the Functions ------------------------------------------------------------------------------
class MySin(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x)

    @staticmethod
    def jvp(ctx, x_t):
        (x,) = ctx.saved_tensors
        return x_t * torch.cos(x)


class Tripled(torch.autograd.Function):
    """x**2 whose backward and jvp say 3x: a transform that ignores them gives 2x."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x ** 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * t * x


class MulAddScaled(torch.autograd.Function):
    """Two tensor inputs, a number input kept on ctx, two outputs."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, k):
        return x * y * k, x + y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, k = inputs
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)
        ctx.k = k

    @staticmethod
    def backward(ctx, g_prod, g_sum):
        x, y = ctx.saved_tensors
        return g_prod * y * ctx.k + g_sum, g_prod * x * ctx.k + g_sum, None

    @staticmethod
    def jvp(ctx, x_t, y_t, k_t):
        x, y = ctx.saved_tensors
        return (x_t * y + x * y_t) * ctx.k, x_t + y_t


class MyExp(torch.autograd.Function):
    """vmap support by a vmap staticmethod; the output is saved for backward."""
    vmap_calls = 0

    @staticmethod
    def forward(x):
        return torch.exp(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return t * y

    @staticmethod
    def vmap(info, in_dims, x):
        MyExp.vmap_calls += 1
        (x_bdim,) = in_dims
        return MyExp.apply(x), x_bdim


class SumRows(torch.autograd.Function):
    """setup_context keeps a shape; backward expands: under a generated vmap rule the shape
    must be one example's (torch.func's NOTE [Why do we need to run setup_context under a
    vmap?])."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.sum(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x_shape = inputs[0].shape

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.x_shape)

    @staticmethod
    def jvp(ctx, t):
        return t.sum(0)


class ScaleBroadcast(torch.autograd.Function):
    """A backward that returns a broadcast gradient, which autograd reduces."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x  # the second has x's shape, w is a row

    @staticmethod
    def jvp(ctx, x_t, w_t):
        x, w = ctx.saved_tensors
        return x_t * w + x * w_t


def _mul_add(x, y):
    prod, total = MulAddScaled.apply(x, y, 2.0)
    return prod + total.sin()


CASES = [
    OpCase("MySin", MySin.apply, lambda g: (normal(g, 2, 3),), (0,), True),
    OpCase("MySin_composed", lambda x: MySin.apply(x * 2).exp(), lambda g: (normal(g, 3),),
           (0,), True),
    OpCase("MulAddScaled", _mul_add, lambda g: (normal(g, 2, 3), normal(g, 2, 3)), (0, 1),
           True),
    OpCase("MulAddScaled_first_output", lambda x, y: MulAddScaled.apply(x, y, 0.5)[0],
           lambda g: (normal(g, 3), normal(g, 3)), (0, 1)),
    OpCase("MyExp", MyExp.apply, lambda g: (normal(g, 2, 3),), (0,), True),
    OpCase("MyExp_twice", lambda x: MyExp.apply(MyExp.apply(x) * 0.5),
           lambda g: (normal(g, 4),), (0,)),
    OpCase("SumRows", SumRows.apply, lambda g: (normal(g, 3, 2),), (0,), True),
    OpCase("ScaleBroadcast", ScaleBroadcast.apply, lambda g: (normal(g, 2, 3), positive(g, 3)),
           (0, 1)),
]
# a backward that is not the derivative: compared with torch.func only
ORACLE_ONLY = [
    OpCase("Tripled", Tripled.apply, lambda g: (normal(g, 2, 3),), (0,), True),
]


@pytest.mark.parametrize("case, transform", list(transform_params(CASES + ORACLE_ONLY)))
def test_under_transform(case, transform):
    check_under_transform(case, transform)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_finite_differences(case):
    check_finite_differences(case)


def test_custom_backward_is_used():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert_same(mf.grad(lambda x: Tripled.apply(x).sum())(x), 3 * x)
    assert_same(mf.jvp(Tripled.apply, (x,), (torch.ones_like(x),))[1], 3 * x)


def test_vmap_staticmethod_is_the_batching_rule():
    xs = torch.randn(4, 3, dtype=torch.float64)
    MyExp.vmap_calls = 0
    with mf.capture_fallbacks() as used:
        out = mf.vmap(MyExp.apply)(xs)
    assert not used
    assert MyExp.vmap_calls == 1
    assert_same(out, tf.vmap(MyExp.apply)(xs))
    # in_dims that are not 0: the staticmethod's out_dim is honoured
    assert_same(mf.vmap(MyExp.apply, in_dims=1)(xs), tf.vmap(MyExp.apply, in_dims=1)(xs))


def test_generated_vmap_rule_has_no_fallback():
    xs, ys = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    with mf.capture_fallbacks() as used:
        ours = mf.vmap(_mul_add, in_dims=(0, None))(xs, ys)
    assert not used
    assert_same(ours, tf.vmap(_mul_add, in_dims=(0, None))(xs, ys))


# --- ctx features --------------------------------------------------------------------------------
def _recording(seen):
    class Recorder(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x, y):
            return x * y

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            seen.append(tuple(ctx.needs_input_grad))
            return (g * y if ctx.needs_input_grad[0] else None,
                    g * x if ctx.needs_input_grad[1] else None)
    return Recorder


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_needs_input_grad(argnums):
    x, y = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    results = []
    for ft in (tf, mf):
        seen = []
        Recorder = _recording(seen)
        out = ft.grad(lambda x, y: Recorder.apply(x, y).sum(), argnums=argnums)(x, y)
        results.append((out, seen))
    (ours, ours_seen), (theirs, theirs_seen) = results[1], results[0]
    assert_same(ours, theirs)
    assert ours_seen == theirs_seen


class SinWithSign(torch.autograd.Function):
    """Two outputs; the second is marked non-differentiable."""

    @staticmethod
    def forward(x):
        return torch.sin(x), torch.sign(x) * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g, g_sign):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x) + g_sign  # g_sign arrives as zeros

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return t * torch.cos(x), None

    @staticmethod
    def vmap(info, in_dims, x):
        return SinWithSign.apply(x), (in_dims[0], in_dims[0])


def test_tangent_for_a_non_differentiable_output_is_refused():
    class BadJvp(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2, x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def backward(ctx, g, g2):
            return g * 2

        @staticmethod
        def jvp(ctx, t):
            return t * 2, t * 3

    x = torch.randn(3)
    for ft in (tf, mf):
        with pytest.raises(RuntimeError, match="differentiable"):
            ft.jvp(BadJvp.apply, (x,), (x,))


@pytest.mark.parametrize("transform", ["grad", "jvp", "jacrev", "jacfwd", "vmap_grad"])
def test_mark_non_differentiable(transform):
    x = torch.randn(3, dtype=torch.float64)

    def f(x):
        s, m = SinWithSign.apply(x)
        return s + m

    def run(ft):
        if transform == "grad":
            return ft.grad(lambda x: f(x).sum())(x)
        if transform == "jvp":
            return ft.jvp(f, (x,), (torch.ones_like(x),))
        if transform == "jacrev":
            return ft.jacrev(f)(x)
        if transform == "jacfwd":
            return ft.jacfwd(f)(x)
        return ft.vmap(ft.grad(lambda x: f(x).sum()))(torch.randn(2, 3, dtype=torch.float64))
    torch.manual_seed(0)
    theirs = run(tf)
    torch.manual_seed(0)
    assert_same(run(mf), theirs)


def test_set_materialize_grads():
    seen = []

    class Lazy(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2, x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx, g1, g2):
            seen.append((g1 is None, g2 is None))
            total = 0
            if g1 is not None:
                total = total + g1 * 2
            if g2 is not None:
                total = total + g2 * 3
            return total

    x = torch.randn(3, dtype=torch.float64)
    results = []
    for ft in (tf, mf):
        seen.clear()
        out = ft.grad(lambda x: Lazy.apply(x)[1].sum())(x)
        results.append((out, list(seen)))
    assert_same(results[1][0], results[0][0])
    assert results[1][1] == results[0][1] == [(True, False)]


class OnceCube(torch.autograd.Function):
    """once_differentiable; no vmap rule and no jvp."""

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x ** 2


class OnceCubeVmappable(OnceCube):
    generate_vmap_rule = True


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jacrev", "grad_grad"])
def test_once_differentiable(transform):
    x = torch.randn(3, dtype=torch.float64)

    def loss(x):
        return OnceCubeVmappable.apply(x).sum()

    def run(ft):
        if transform == "grad":
            return ft.grad(loss)(x)
        if transform == "vmap_grad":
            return ft.vmap(ft.grad(loss))(torch.randn(2, 3, dtype=torch.float64))
        if transform == "jacrev":
            return ft.jacrev(OnceCubeVmappable.apply)(x)
        # torch.func runs the backward under no_grad: an outer grad sees a constant
        return ft.grad(lambda x: ft.grad(loss)(x).sum())(x)
    torch.manual_seed(0)
    theirs = run(tf)
    torch.manual_seed(0)
    assert_same(run(mf), theirs)


def test_identity_forward_and_vjp_fn_outside_the_transform():
    class Twice(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x  # the input itself

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return MyExp.apply(g) * 0 + 2 * g  # a Function inside a backward

    x = torch.randn(3, dtype=torch.float64)
    ct = torch.randn(3, dtype=torch.float64)
    results = []
    for ft in (tf, mf):
        out, vjp_fn = ft.vjp(lambda x: Twice.apply(x) * x, x)
        results.append((out, vjp_fn(ct)))  # vjp_fn runs after the transform returned
    assert_same(results[1], results[0])


def test_constant_input_and_non_tensor_output():
    class WithInfo(torch.autograd.Function):
        @staticmethod
        def forward(x, scale):
            return x * scale, "info"

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, g, g_info):
            assert g_info is None
            return g * ctx.scale, None

    x, c = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def loss(x):  # the second call sees only a constant: plain torch computes it
        return (WithInfo.apply(x, 2.0)[0] * WithInfo.apply(c, 3.0)[0]).sum()
    ours, theirs = mf.grad(loss)(x), tf.grad(loss)(x)
    assert_same(ours, theirs)
    assert_same(ours, 2 * c * 3)


def test_tape_names_the_function():
    with mf.capture_tapes() as tapes:
        mf.grad(lambda x: MulAddScaled.apply(x, x, 1.0)[0].sum())(torch.ones(2))
    text = str(tapes[0])
    assert "MulAddScaled" in text and "MulAddScaled[1]" in text


# --- what torch.func refuses ----------------------------------------------------------------------
class OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_missing_setup_context_is_refused(transform):
    x = torch.randn(3)

    def run(ft):
        if transform == "grad":
            return ft.grad(lambda x: OldStyle.apply(x).sum())(x)
        if transform == "vmap":
            return ft.vmap(OldStyle.apply)(x)
        return ft.jvp(OldStyle.apply, (x,), (x,))
    with pytest.raises(RuntimeError, match="setup_context"):
        run(tf)
    with pytest.raises(TransformError,
                       match=r"OldStyle\.apply\(\.\.\.\).*setup_context.*Fix:") as info:
        run(mf)
    assert isinstance(info.value, RuntimeError)

    def loss(x):  # and the next call works
        return MySin.apply(x).sum()
    assert_same(mf.grad(loss)(x), tf.grad(loss)(x))


def test_missing_jvp_and_vmap_are_refused():
    x = torch.randn(3)
    for ft in (tf, mf):
        with pytest.raises(NotImplementedError, match="jvp"):
            ft.jvp(OnceCube.apply, (x,), (x,))
        with pytest.raises(RuntimeError, match="vmap"):
            ft.vmap(OnceCube.apply)(x)
    with pytest.raises(MissingRuleError, match="Fix:"):
        mf.vmap(OnceCube.apply)(x)


def test_both_vmap_rules_are_refused():
    class Both(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

        @staticmethod
        def vmap(info, in_dims, x):
            return x * 2, in_dims[0]

    x = torch.randn(2, 3)
    for ft in (tf, mf):
        with pytest.raises(RuntimeError, match="generate_vmap_rule"):
            ft.vmap(Both.apply)(x)


# --- outside the transforms: plain torch ---------------------------------------------------------
def test_plain_torch_is_untouched():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    Tripled.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([3.0, 6.0]))
    y = torch.tensor([1.0, 2.0], requires_grad=True)
    OldStyle.apply(y).sum().backward()  # forward(ctx, x) works as ever outside transforms
    assert torch.equal(y.grad, torch.tensor([2.0, 2.0]))
    # torch.func itself still sees its own path
    assert_same(tf.grad(lambda x: Tripled.apply(x).sum())(torch.ones(2, dtype=torch.float64)),
                torch.full((2,), 3.0, dtype=torch.float64))


def test_parameter_that_requires_grad_gets_the_custom_backward():
    """A plain weight captured by the transformed function: its torch graph goes through
    the Function at the bottom, so an outer .backward() uses the custom backward."""
    x = torch.randn(3, dtype=torch.float64)
    grads = []
    for ft in (tf, mf):
        w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
        ft.vmap(lambda x: Tripled.apply(x * w))(x.reshape(3, 1)).sum().backward()
        grads.append(w.grad)
    assert_same(grads[1], grads[0])


# --- other levels -------------------------------------------------------------------------------
def test_trace_refuses_rather_than_losing_the_backward():
    with pytest.raises(TransformError, match=r"trace\(.*MySin.*Fix:"):
        mf.trace(lambda x: MySin.apply(x))(torch.ones(3))


def test_explicit_api_levels():
    from minifunctorch.core.tensor import as_tensor
    d = mf.Autograd(mf.Torch())
    a = mf.label(torch.tensor([1.0, 2.0], dtype=torch.float64), "a")
    loss = d.sum(Tripled.apply(as_tensor(d.adopt(a))))
    assert "Tripled a" in str(d.tape)
    assert_same(d.grad(loss, [a])[0], 3 * a)
    lines = []

    class Lines:
        def write(self, text):
            lines.append(text)
    logged = mf.Logger(mf.Torch(), file=Lines())
    out = MySin.apply(as_tensor(logged.adopt(torch.ones(2))))
    assert "MySin.apply" in "".join(lines)
    assert_same(out.concrete(), torch.sin(torch.ones(2)))


# --- compositions ------------------------------------------------------------------------------
class LazyGenerated(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2, x * 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g1, g2):
        total = 0
        if g1 is not None:
            total = total + g1 * 2
        if g2 is not None:
            total = total + g2 * 3
        return total


_XS = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
_W = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
COMPOSITIONS = {
    "vmap_grad_lazy": lambda F: F.vmap(F.grad(lambda x: LazyGenerated.apply(x)[1].sum()))(_XS[0]),
    "vmap_vmap_generated": lambda F: F.vmap(F.vmap(MySin.apply))(_XS),
    "vmap_vmap_grad_generated":
        lambda F: F.vmap(F.vmap(F.grad(lambda x: MySin.apply(x).sum())))(_XS),
    "vmap_vmap_staticmethod": lambda F: F.vmap(F.vmap(lambda x: SinWithSign.apply(x)[0]))(_XS),
    "vmap_dim1_grad_staticmethod":
        lambda F: F.vmap(F.grad(lambda x: MyExp.apply(x).sum()), in_dims=1)(_XS[0]),
    "jacrev_vmap_staticmethod": lambda F: F.jacrev(F.vmap(MyExp.apply))(_XS[0]),
    "jacfwd_vmap_generated": lambda F: F.jacfwd(F.vmap(MySin.apply))(_XS[0]),
    "vmap_jvp_generated":
        lambda F: F.vmap(lambda x: F.jvp(MySin.apply, (x,), (torch.ones_like(x),)))(_XS[0]),
    "vmap_dim2_grad_shape_in_ctx":
        lambda F: F.vmap(F.grad(lambda x: (SumRows.apply(x) * _W[:3]).sum()), in_dims=2)(_XS),
    "vmap_grad_unbatched_weight": lambda F: F.vmap(F.grad(
        lambda x, w: ScaleBroadcast.apply(x, w).sum(), argnums=(0, 1)), in_dims=(0, None))(_XS, _W),
    "grad_vmap_unbatched_weight": lambda F: F.grad(
        lambda w: F.vmap(ScaleBroadcast.apply, in_dims=(0, None))(_XS, w).sum())(_W),
    "vmap_grad_second_input": lambda F: F.vmap(F.grad(
        lambda x, y: MulAddScaled.apply(x, y, 3.0)[1].sin().sum(), argnums=1),
        in_dims=(None, 0))(_W, _XS[0]),
    "hessian_vmap_generated":
        lambda F: F.hessian(lambda x: F.vmap(MySin.apply)(x).sum())(_XS[0, 0]),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_composition(name):
    assert_same(COMPOSITIONS[name](mf), COMPOSITIONS[name](tf))


def test_vmap_info():
    seen = []

    class Info(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

        @staticmethod
        def vmap(info, in_dims, x):
            seen.append((info.batch_size, info.randomness, in_dims))
            return Info.apply(x), in_dims[0]

    for ft in (tf, mf):
        ft.vmap(Info.apply, in_dims=1, randomness="same")(torch.randn(3, 5))
    assert seen[0] == seen[1] == (5, "same", (1,))


# --- in place, lists, keyword-only tensors ------------------------------------------------------
class MulInPlace(torch.autograd.Function):
    """Writes its input in place and marks it dirty."""

    @staticmethod
    def forward(x):
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 2 * g

    @staticmethod
    def jvp(ctx, t):
        return t.mul_(2)


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_mark_dirty(transform):
    x = torch.randn(3, dtype=torch.float64)

    def f(x):
        y = x.clone()
        z = MulInPlace.apply(y)
        assert z is y  # the very same tensor, as in torch
        return (y * x).sum()  # y holds the new value
    if transform == "grad":
        assert_same(mf.grad(f)(x), tf.grad(f)(x))
    else:
        t = torch.ones(3, dtype=torch.float64)
        assert_same(mf.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)))


def test_list_argument_under_vmap_staticmethod():
    seen = []

    class Id(torch.autograd.Function):
        @staticmethod
        def forward(x, ys):
            return x, ys

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g, g_ys):
            return g, None

        @staticmethod
        def vmap(info, in_dims, x, ys):
            seen.append(in_dims)
            return (x * 2, [y * 3 for y in ys]), in_dims

    x = torch.randn(2, 3)
    results = [ft.vmap(Id.apply)(x, [x, x]) for ft in (tf, mf)]
    assert_same(results[1], results[0])
    assert seen[0] == seen[1] == (0, [0, 0])


def test_kwarg_only_tensor_is_refused_under_vmap():
    class KwargOnly(torch.autograd.Function):
        @staticmethod
        def forward(x, *, y):
            return x + y

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def vmap(info, in_dims, x, *, y):
            return x + y, 0

    x, y = torch.randn(3), torch.randn(3)
    for ft in (tf, mf):
        with pytest.raises(NotImplementedError, match="kwarg-only Tensor args"):
            ft.vmap(lambda x: KwargOnly.apply(x, y=y))(x)


@pytest.mark.parametrize("out_dims", [(None,), "list"])
def test_incompatible_out_dims_are_refused(out_dims):
    class Zeros(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.zeros(x.shape) if out_dims != "list" else [torch.zeros(x.shape)]

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def vmap(info, in_dims, x):
            r = torch.zeros(x.shape[1:])
            return (r, (None,)) if out_dims != "list" else ([r], (None,))

    for ft in (tf, mf):
        with pytest.raises(RuntimeError, match="returned an incompatible"):
            ft.vmap(Zeros.apply)(torch.randn(2, 3))


def test_in_place_forward_does_not_corrupt_saved_values():
    """exp saves its output; a Function that then doubles that output in place must not
    change exp's gradient. torch.func refuses (its version counter); here forward writes
    into a copy, and the gradient is the true one."""
    x = torch.randn(3, dtype=torch.float64)

    def f(x):
        y = x.exp()
        MulInPlace.apply(y)
        return y.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tf.grad(f)(x)
    assert_same(mf.grad(f)(x), 2 * x.exp())


def test_no_grad_around_the_call():
    x = torch.randn(3, dtype=torch.float64)

    def f(x):
        with torch.no_grad():
            y = Tripled.apply(x)
        return (y * x).sum()
    assert_same(mf.grad(f)(x), tf.grad(f)(x))


def _autograd_function_db():
    from torch.testing._internal import autograd_function_db as db
    return {op.name: op for op in db.autograd_function_db}


@pytest.mark.parametrize("name", sorted(_autograd_function_db()))
def test_pytorchs_own_example_functions_under_vmap(name):
    # torch.testing's autograd.Functions (NumPy in forward, a vmap staticmethod or
    # generate_vmap_rule) are user code, not torch's bookkeeping (_is_torchs_own)
    info = _autograd_function_db()[name]
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=False):
        args = (sample.input,) + tuple(sample.args)
        batched = tuple(torch.stack([a, a * 0.5 + 0.25]) if isinstance(a, torch.Tensor)
                        and a.is_floating_point() else a for a in args)
        in_dims = tuple(0 if isinstance(a, torch.Tensor) and a.is_floating_point() else None
                        for a in args)
        f = lambda *a: info.op(*a, **sample.kwargs)  # noqa: E731
        try:
            expected = tf.vmap(f, in_dims)(*batched)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                mf.vmap(f, in_dims)(*batched)
            continue
        torch.testing.assert_close(mf.vmap(f, in_dims)(*batched), expected)
