"""Values are real tensors: what user code sees inside a transform, what transforms return,
and the silent wrong answers and crashes of the old wrappers (each a regression test)."""
import functools
import math
import operator
import random
import re

import optree

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core import Autograd, Batched, Forward, Logger, Torch, label

x3 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
batch = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) / 7


def _seen(transform):
    seen = []

    def f(x):
        seen.append((isinstance(x, torch.Tensor), x.layout, x.device, x.cpu() is not None))
        return (x * 2).sum()
    transform(f)
    return seen


@pytest.mark.parametrize("name, transform", [
    ("grad", lambda f: mf.grad(f)(x3)),
    ("vmap", lambda f: mf.vmap(f)(batch)),
    ("jvp", lambda f: mf.jvp(f, (x3,), (x3,))),
    ("vmap(grad)", lambda f: mf.vmap(mf.grad(f))(batch)),
])
def test_values_inside_transforms_are_tensors(name, transform):
    for is_tensor, layout, device, cpu in _seen(transform):
        assert is_tensor and layout == torch.strided and device == x3.device and cpu


def test_transforms_return_plain_tensors():
    f = lambda x: (x.sin() * x).sum()  # noqa: E731
    results = [mf.grad(f)(x3), mf.vmap(torch.sin)(batch), *mf.jvp(f, (x3,), (x3,)),
               mf.jacrev(torch.sin)(x3), mf.jacfwd(torch.sin)(x3), mf.hessian(f)(x3),
               *mf.vjp(torch.sin, x3)[1](x3), mf.vmap(mf.grad(f))(batch)]
    for result in results:
        assert type(result) is torch.Tensor, type(result)


def _elementwise(x):
    return [torch.sin(x), x.exp(), x * 2, 3.0 * x, x + 1, x / 4, x - 0.5, x.abs(),
            torch.sigmoid(x), x.tanh() * 1.5]


def _count_applies(monkeypatch) -> list:
    """The names of the primitives that vmap levels apply from now on (a list that grows)."""
    applied = []
    apply = Batched.apply

    def counting(self, prim, *args, **params):
        applied.append(prim.name)
        return apply(self, prim, *args, **params)
    monkeypatch.setattr(Batched, "apply", counting)
    return applied


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
@pytest.mark.parametrize("in_dims", [0, 1])
def test_vmaps_elementwise_ops_at_the_front_door(monkeypatch, in_dims, dtype):
    """NOTE [vmap's elementwise ops at the front door] (tensor.py): a batched tensor over a
    plain one and an elementwise function, maybe with a number: the kernel runs on the payload
    at the front door, the batch dim stays where it was, the result has the kernel's dtype
    (abs of a complex number is real); no level's apply runs. Every result is torch.func's."""
    applied = _count_applies(monkeypatch)
    xs = (batch if in_dims == 0 else batch.T).to(dtype)
    shapes = []

    def f(x):
        outs = _elementwise(x)
        shapes.append([(tuple(o.shape), o.dtype) for o in outs])
        return outs
    ours, theirs = mf.vmap(f, in_dims=in_dims)(xs), tf.vmap(f, in_dims=in_dims)(xs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert shapes[0] == shapes[1]
    assert applied == []
    # the other elementwise calls take the levels' path, as before: a number on the left of
    # a subtraction, two batched operands, nested vmaps (the payload is a value, not a tensor)
    g = lambda x: (1 - x, x * x)  # noqa: E731
    for a, b in zip(mf.vmap(g, in_dims=in_dims)(xs), tf.vmap(g, in_dims=in_dims)(xs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert applied == ["sub", "mul"]
    nested = lambda x: _elementwise(x)  # noqa: E731
    for a, b in zip(mf.vmap(mf.vmap(nested))(xs[None]), tf.vmap(tf.vmap(nested))(xs[None])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _beside_plain_tensors(x, w, m):
    """x an example of shape (3, 4); w a plain (4,) tensor of x's dtype, m a plain (3, 4)
    float32 tensor (so float64 examples promote it)."""
    return [x - w, w - x, x + w, w + x, x * m, m * x, x / m, m / x]


@pytest.mark.parametrize("in_dims", [0, 1])
def test_an_unbatched_tensor_beside_a_batched_one_is_one_kernel(monkeypatch, in_dims):
    """NOTE [An unbatched tensor beside a batched value] (batching.py): an operator of a
    batched tensor over a plain one and an unbatched tensor that broadcasts right of the
    batch dim runs its kernel on the payload at the front door; one whose dims reach the
    batch dim (m with the batch dim at 1) and a 0-d tensor (which promotes as a number) take
    the rule (so does an op whose kernel does not broadcast: the gelu test above). Every
    result is torch.func's, dtypes included."""
    applied = _count_applies(monkeypatch)
    torch.manual_seed(0)
    xs = torch.randn(5, 3, 4, dtype=torch.float64).movedim(0, in_dims)
    w, m = torch.randn(4, dtype=torch.float64), torch.rand(3, 4) + 0.5
    f = functools.partial(_beside_plain_tensors, w=w, m=m)
    ours, theirs = mf.vmap(f, in_dims=in_dims)(xs), tf.vmap(f, in_dims=in_dims)(xs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # with the batch dim at 1 the payload is (3, 5, 4): m's dims (3, 4) would meet it
    assert applied == ([] if in_dims == 0 else ["mul", "mul", "div", "div"])
    applied.clear()
    # 0-d examples: a 0-d float64 tensor promotes them (two 0-d operands), a (1,) one too
    scalar, one = torch.tensor(2.0, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    g = lambda x: (x * scalar, scalar - x, x + one)  # noqa: E731
    numbers = torch.randn(5)
    for a, b in zip(mf.vmap(g)(numbers), tf.vmap(g)(numbers)):
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert applied == ["mul", "sub", "add"]
    # under vmap of grad (a MAML step's update), and nested vmaps, the same values
    loss = lambda v: ((v - w) * m).sin().sum()  # noqa: E731
    torch.testing.assert_close(mf.vmap(mf.grad(loss), in_dims=in_dims)(xs),
                               tf.vmap(tf.grad(loss), in_dims=in_dims)(xs), rtol=0, atol=0)
    nested = xs.movedim(in_dims, 0)[None]
    for a, b in zip(mf.vmap(mf.vmap(f))(nested), tf.vmap(tf.vmap(f))(nested)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


_BINARY_OPERATORS = [operator.add, operator.sub, operator.mul, operator.truediv, torch.maximum,
                     torch.pow, torch.atan2]
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64]


def _operand(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype == torch.int64:
        return torch.randint(1, 4, shape, generator=generator)
    return (torch.rand(shape, generator=generator) + 0.5).to(dtype)


@pytest.mark.parametrize("seed", range(4))
def test_a_batched_and_an_unbatched_tensor_promote_and_refuse_as_in_torch_func(seed):
    """An operator of examples (rank 0 to 3, batch dim anywhere) and an unbatched tensor
    (rank 0 to 4), in every pair of dtypes, either way round: the fast path (NOTE [An
    unbatched tensor beside a batched value]) or the rule (NOTE [Type promotion sees one
    example]) gives torch.func's dtype, shape and values, or fails where it fails (a bool
    operand of a subtraction, unless the example is a number, which torch.func converts)."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    compared = 0
    for _ in range(150):
        example = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 3))]
        bdim = rng.randint(0, len(example))
        other = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4))]
        xs = _operand([rng.choice([1, 2, 4]), *example], rng.choice(_DTYPES),
                      generator).movedim(0, bdim)
        t = _operand(other, rng.choice(_DTYPES), generator)
        op, first = rng.choice(_BINARY_OPERATORS), rng.random() < 0.5
        f = (lambda x: op(x, t)) if first else (lambda x: op(t, x))  # noqa: E731
        try:
            theirs = tf.vmap(f, in_dims=bdim)(xs)
        except RuntimeError as error:
            with pytest.raises(RuntimeError, match=re.escape(str(error).split(".")[0])):
                mf.vmap(f, in_dims=bdim)(xs)
            continue
        ours = mf.vmap(f, in_dims=bdim)(xs)
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), (op, example, other)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        compared += 1
    assert compared > 80  # (the rest raise in both)

def _views(x):
    """Every view primitive on an example of shape (3, 4): reshape, permute, unsqueeze,
    squeeze and expand (with a new leading dim), and a chain of them."""
    return (x.reshape(12), x.permute(1, 0), x.unsqueeze(1), x.unsqueeze(0).squeeze(0),
            x.expand(2, 3, 4), x.t().reshape(2, 6).unsqueeze(-1).expand(2, 6, 5))


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (1, 0, 2), (2, 1, 1)])
def test_a_view_of_nested_batched_values_takes_one_step(monkeypatch, in_dims):
    """NOTE [A view of nested batched values in one step] (batching.py): under three vmaps,
    a view op is computed on the bottom tensor by the innermost level, with no rule and no
    level below it applied, and gives torch.func's values and the level-by-level path's
    values and strides."""
    from minifunctorch.core import batching
    torch.manual_seed(0)
    xs = torch.randn(5, 6, 7, 3, 4)  # three batch dims, then the example's (3, 4)
    xs = xs.movedim(2, 2 + in_dims[2]).movedim(1, 1 + in_dims[1]).movedim(0, in_dims[0])

    def nest(api):
        return api.vmap(api.vmap(api.vmap(_views, in_dims=in_dims[2]), in_dims=in_dims[1]),
                        in_dims=in_dims[0])

    applied = _count_applies(monkeypatch)
    ours = nest(mf)(xs)
    assert applied == ["reshape", "permute", "unsqueeze", "unsqueeze", "squeeze", "expand",
                       "permute", "reshape", "unsqueeze", "expand"]
    for a, b in zip(ours, nest(tf)(xs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(batching, "_VIEWS", frozenset())  # the rules, level by level
    applied.clear()
    level_by_level = nest(mf)(xs)
    assert len(applied) > 20
    for a, b in zip(ours, level_by_level):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.stride() == b.stride()


def test_an_escaped_batched_value_is_refused_inside_a_later_vmap():
    """The front door's elementwise path (above) also refuses a value whose vmap returned."""
    kept = []
    mf.vmap(lambda a: (kept.append(a), a.sin())[1])(batch)
    with pytest.raises(RuntimeError, match="escaped"):
        mf.vmap(lambda b: b + torch.sin(kept[0]))(batch)
    with pytest.raises(RuntimeError, match="escaped"):
        mf.vmap(lambda b: b + kept[0] * 2)(batch)
    torch.testing.assert_close(mf.vmap(torch.sin)(batch), batch.sin())


def test_nn_module_code_accepts_the_values():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.GELU(),
                                torch.nn.Linear(4, 1)).double()
    params = dict(model.named_parameters())

    def loss(p, x):
        return mf.functional_call(model, p, (x,)).sum()

    def reference(p, x):
        return torch.func.functional_call(model, p, (x,)).sum()
    torch.testing.assert_close(mf.vmap(mf.grad(loss), in_dims=(None, 0))(params, batch),
                               tf.vmap(tf.grad(reference), in_dims=(None, 0))(params, batch))


@pytest.mark.parametrize("make", [
    lambda: Autograd(Torch(), create_graph=True),
    lambda: Logger(Torch()),
    lambda: Forward(Torch()),
    lambda: Batched(Torch(), length=3),
])
def test_explicit_dispatcher_values_are_accepted_by_torch(make, capsys):
    a = label(torch.tensor([[1.0, 2.0, 3.0]] * 3, dtype=torch.float64), "a")
    d = make()
    out = d.mul(a, 2.0)
    assert isinstance(out, torch.Tensor)
    if isinstance(d, Autograd):
        (g,) = d.grad(d.sum(d.mul(a, a)), [a])
        assert torch.allclose(g, 2 * a) and torch.as_tensor(g) is g
        assert "FuncTensor" in repr(g)
    if not isinstance(d, Batched):
        assert torch.allclose(out, a * 2)
    assert torch.as_tensor(out) is out
    assert isinstance(repr(out), str)


# --- the silent wrong answers and crashes of the issue ------------------------------------------
def test_a_batched_float32_with_a_float64_0d_tensor_promotes_per_example():
    x = torch.ones(4, dtype=torch.float32)
    y = torch.tensor(2.0, dtype=torch.float64)
    ours, theirs = mf.vmap(lambda v: v * y)(x), tf.vmap(lambda v: v * y)(x)
    assert ours.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(ours, theirs)
    w = torch.ones(3, dtype=torch.float32)  # a dimensioned operand keeps float32
    f = lambda v: v + w  # noqa: E731
    assert mf.vmap(f)(batch[:, 0]).dtype == tf.vmap(f)(batch[:, 0]).dtype


@pytest.mark.parametrize("in_dim", [0, 1])
@pytest.mark.parametrize("other_shape", [(), (3,), (2, 3), (1, 3)])
@pytest.mark.parametrize("other_dtype", [torch.float32, torch.float64, torch.int64])
def test_a_batched_tensor_with_an_unbatched_tensor_broadcasts_and_promotes_per_example(
        in_dim, other_shape, other_dtype):
    xs = torch.randn(4, 2, 3) if in_dim == 0 else torch.randn(2, 4, 3)
    other = torch.arange(1, 1 + math.prod(other_shape)).reshape(other_shape).to(other_dtype)
    for f in (lambda v: v * other, lambda v: other - v, lambda v: torch.maximum(v, other)):
        ours, theirs = mf.vmap(f, in_dims=in_dim)(xs), tf.vmap(f, in_dims=in_dim)(xs)
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("shapes", [((), ()), ((3,), (3,)), ((2, 3), (2, 3)), ((2, 3), (3,)),
                                    ((3,), ()), ((1, 3), (2, 1))])
@pytest.mark.parametrize("in_dims", [(0, 0), (1, 1), (0, 1)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.int64, torch.float32),
                                    (torch.float32, torch.float32)])
def test_two_batched_operands_broadcast_and_promote_per_example(shapes, in_dims, dtypes):
    """Batched.apply computes an elementwise op on two batched values itself when their batch
    dims line up (NOTE [The commonest cases, written out]); every other layout goes through
    the rule. Both must match torch.func, 0-d examples included (they promote together)."""
    def batch_of(shape, in_dim, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        values = (torch.randn(4, *shape, generator=gen) * 3).to(dtype)
        return values.movedim(0, in_dim) if in_dim < len(shape) + 1 else values
    in_dims = tuple(d if d <= len(s) else 0 for d, s in zip(in_dims, shapes))
    xs = batch_of(shapes[0], in_dims[0], dtypes[0], 0)
    ys = batch_of(shapes[1], in_dims[1], dtypes[1], 1)
    for f in (torch.mul, torch.add, torch.maximum, torch.atan2 if dtypes[0].is_floating_point
              and dtypes[1].is_floating_point else torch.sub):
        ours = mf.vmap(f, in_dims=in_dims)(xs, ys)
        theirs = tf.vmap(f, in_dims=in_dims)(xs, ys)
        assert ours.dtype == theirs.dtype, (f, ours.dtype, theirs.dtype)
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("like", [torch.ones_like, torch.zeros_like,
                                  lambda v, dtype: torch.full_like(v, 3, dtype=dtype)])
def test_like_functions_keep_their_dtype_under_vmap(like):
    f = lambda v: like(v, dtype=torch.int64)  # noqa: E731
    ours, theirs = mf.vmap(f)(batch), tf.vmap(f)(batch)
    assert ours.dtype == theirs.dtype == torch.int64
    torch.testing.assert_close(ours, theirs)


def test_clone_under_vmap_copies_and_squeeze_is_a_view():
    x = torch.randn(4, 1, 3)
    cloned = mf.vmap(torch.clone)(x)
    assert cloned.data_ptr() != x.data_ptr() and cloned.is_contiguous()
    torch.testing.assert_close(cloned, x)
    for in_dims, source in ((0, x), (2, x.movedim(0, 2).contiguous())):
        squeezed = mf.vmap(lambda v: v.squeeze(0), in_dims=in_dims)(source)
        torch.testing.assert_close(squeezed, tf.vmap(lambda v: v.squeeze(0), in_dims=in_dims)(source))
        assert squeezed._base is source, "a view op under vmap returns a view of its input"


def test_cat_of_batched_and_unbatched_operands():
    unbatched = torch.randn(2, 3, dtype=torch.float64)
    for f in (lambda v: torch.cat([v.unsqueeze(0), unbatched]),
              lambda v: torch.cat([v, torch.empty(0, dtype=torch.float64)]),
              lambda v: torch.stack([v, unbatched[0]])):
        torch.testing.assert_close(mf.vmap(f)(batch), tf.vmap(f)(batch))


def test_gather_under_vmap():
    index = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    for in_dims, f in (((0, 0), lambda v, i: torch.gather(v, 0, i)),
                       ((0, None), lambda v, i: torch.gather(v, 0, i[0])),
                       ((None, 0), lambda v, i: torch.gather(v, 0, i))):
        v = batch[0] if in_dims[0] is None else batch
        torch.testing.assert_close(mf.vmap(f, in_dims=in_dims)(v, index),
                                   tf.vmap(f, in_dims=in_dims)(v, index))


def test_single_out_dims_tuple_for_a_single_output():
    ours = mf.vmap(torch.sin, out_dims=(1,))(batch)
    torch.testing.assert_close(ours, tf.vmap(torch.sin, out_dims=(1,))(batch))


def test_tanh_backward_is_bit_exact_with_torch():
    x = torch.randn(64, dtype=torch.float32)
    f = lambda v: torch.tanh(v).sum()  # noqa: E731
    assert torch.equal(mf.grad(f)(x), tf.grad(f)(x))
    g = lambda v: torch.sigmoid(v).sum()  # noqa: E731
    assert torch.equal(mf.grad(g)(x), tf.grad(g)(x))


def test_softmax_backward_is_bit_exact_with_torch_func():
    # torch.func differentiates softmax and log_softmax with torch's fused kernels, under vmap
    # too; the formula written with four ops rounds differently (by up to 3e-7 here)
    x = torch.randn(8, 64, 10, dtype=torch.float32)
    w = torch.randn(10, dtype=torch.float32)
    for softmax in (torch.softmax, torch.log_softmax):
        f = lambda v: (softmax(v, -1) * w).sum()  # noqa: E731
        assert torch.equal(mf.grad(f)(x[0]), tf.grad(f)(x[0]))
        assert torch.equal(mf.vmap(mf.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_softmax_tangents_are_bit_exact_with_torch_func():
    # forward mode follows PyTorch's logsumexp_jvp: sum(x_dot * w) / sum(w), w = exp(x - max);
    # a tangent constant along the dim then gives a log_softmax tangent of exactly 0
    x, t = torch.randn(16, 10), torch.randn(16, 10)
    for f in (lambda v: torch.softmax(v, 1), lambda v: torch.log_softmax(v, -1),
              lambda v: torch.logsumexp(v, 1)):
        assert torch.equal(mf.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1])
    shifted = mf.jvp(lambda v: torch.log_softmax(v, -1), (x,), (torch.ones_like(x),))[1]
    assert torch.equal(shifted, torch.zeros_like(x))


# elementwise ops whose vjp and jvp round as torch.func's, on float32 inputs in their domains:
# each formula follows derivatives.yaml's order of operations (NOTE [A formula written once]);
# exp2, sinc, logit and a few special functions still differ in the last bit
_EXACT_UNARY = {
    "sin": (-2, 2), "cos": (-2, 2), "tan": (-1, 1), "asin": (-0.9, 0.9), "acos": (-0.9, 0.9),
    "atan": (-2, 2), "sinh": (-2, 2), "cosh": (-2, 2), "asinh": (-2, 2), "acosh": (1.1, 3),
    "atanh": (-0.9, 0.9), "exp": (-2, 2), "expm1": (-2, 2), "log": (0.1, 3), "log2": (0.1, 3),
    "log10": (0.1, 3), "log1p": (0.1, 3), "sqrt": (0.1, 3), "rsqrt": (0.1, 3),
    "reciprocal": (0.5, 3), "erf": (-2, 2), "erfc": (-2, 2), "erfinv": (-0.9, 0.9),
    "tanh": (-2, 2), "sigmoid": (-2, 2), "digamma": (0.1, 3), "lgamma": (0.1, 3),
    "exp2": (-2, 2),
}


@pytest.mark.parametrize("name", sorted(_EXACT_UNARY))
def test_elementwise_derivatives_are_bit_exact_with_torch_func(name):
    low, high = _EXACT_UNARY[name]
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(257, generator=generator) * (high - low) + low
    t = torch.randn(257, generator=generator)
    f = getattr(torch, name)
    assert torch.equal(mf.vjp(f, x)[1](t)[0], tf.vjp(f, x)[1](t)[0])
    assert torch.equal(mf.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1])


_EXACT_ACTIVATIONS = {
    # torch's kernels softplus_backward and elu_backward (NOTE [gelu differentiates with
    # torch's kernel]); silu's formula multiplied in factor by factor, as derivatives.yaml does
    "silu": F.silu, "softplus": F.softplus, "softplus(beta=2, threshold=1)":
    lambda x: F.softplus(x, 2.0, 1.0), "elu": F.elu, "elu(alpha=0.5)": lambda x: F.elu(x, 0.5),
    "selu": F.selu, "celu(alpha=0.7)": lambda x: F.celu(x, 0.7), "logsigmoid": F.logsigmoid,
    "mish": F.mish,
}


@pytest.mark.parametrize("name", sorted(_EXACT_ACTIVATIONS))
def test_activation_derivatives_are_bit_exact_with_torch_func(name):
    f = _EXACT_ACTIVATIONS[name]
    generator = torch.Generator().manual_seed(0)
    x, t = torch.randn(16, 33, generator=generator) * 3, torch.randn(16, 33, generator=generator)
    loss = lambda v: (f(v) * t).sum()  # noqa: E731
    assert torch.equal(mf.grad(loss)(x), tf.grad(loss)(x))
    assert torch.equal(mf.vmap(mf.grad(loss))(x), tf.vmap(tf.grad(loss))(x))
    assert torch.equal(mf.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1])
    torch.testing.assert_close(mf.hessian(lambda v: f(v).sum())(x[0]),
                               tf.hessian(lambda v: f(v).sum())(x[0]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_derivatives_are_bit_exact_with_torch_func(approximate):
    # torch's gelu_backward kernel, as derivatives.yaml (NOTE [gelu differentiates with
    # torch's kernel]); the eight-op formula differed by up to 5e-7
    x = torch.randn(64, 33)
    f = lambda v: F.gelu(v, approximate=approximate)  # noqa: E731
    loss = lambda v: (f(v) * 1.5).sum()  # noqa: E731
    assert torch.equal(mf.grad(loss)(x), tf.grad(loss)(x))
    assert torch.equal(mf.vmap(mf.grad(loss))(x), tf.vmap(tf.grad(loss))(x))
    assert torch.equal(mf.jvp(f, (x,), (x,))[1], tf.jvp(f, (x,), (x,))[1])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_kernel_under_nested_transforms_in_float32(approximate):
    # torch's CPU kernel for float32 (oneDNN) neither broadcasts nor mixes dtypes: a tangent
    # batched by jacfwd against an unbatched input, or a float64 cotangent, must not reach it
    x, y = torch.randn(4, 5), torch.randn(5, dtype=torch.float64)
    f = lambda v: (F.gelu(v, approximate=approximate) * y).sum()  # noqa: E731
    assert torch.equal(mf.grad(f)(x), tf.grad(f)(x))
    torch.testing.assert_close(mf.hessian(f)(x), tf.hessian(f)(x))
    torch.testing.assert_close(mf.vmap(mf.hessian(f))(torch.stack([x, -x])),
                               tf.vmap(tf.hessian(f))(torch.stack([x, -x])))
    kernel = lambda ct, v: torch.ops.aten.gelu_backward(ct, v, approximate=approximate)  # noqa: E731
    for in_dims in ((0, None), (None, 0)):
        args = (x, x[0]) if in_dims == (0, None) else (x[0], x)
        torch.testing.assert_close(mf.vmap(kernel, in_dims=in_dims)(*args),
                                   tf.vmap(kernel, in_dims=in_dims)(*args))


_MIXED_DTYPE_LOSSES = {
    "tanh": torch.tanh, "sin": torch.sin, "chain": lambda v: (v.sin() * 2).exp() + v.cos(),
    "matmul": lambda v: torch.tanh(v @ torch.linspace(-1, 1, 9 * 4).reshape(9, 4)),
}


@pytest.mark.parametrize("name", sorted(_MIXED_DTYPE_LOSSES))
def test_a_cotangent_takes_its_values_dtype_as_in_torch_func(name):
    # NOTE [A cotangent takes its value's dtype]: a float32 model with float64 targets (numpy
    # data) sends float64 cotangents back; torch casts each to float32 where it arrives
    f = _MIXED_DTYPE_LOSSES[name]
    x = torch.randn(3, 9, generator=torch.Generator().manual_seed(0))
    target = torch.randn(3, 9 if name != "matmul" else 4, dtype=torch.float64)
    loss = lambda v: ((f(v) - target) ** 2).mean()  # noqa: E731
    assert torch.equal(mf.grad(loss)(x), tf.grad(loss)(x))
    assert torch.equal(mf.vmap(mf.grad(loss))(x[:, None]), tf.vmap(tf.grad(loss))(x[:, None]))
    ct = torch.randn_like(target)
    assert torch.equal(mf.vjp(f, x)[1](ct)[0], tf.vjp(f, x)[1](ct)[0])


def test_atan2_and_hypot_derivatives_are_bit_exact_with_torch_func():
    # derivatives.yaml's order: atan2's (grad * y) * r, (grad * -x) * r with r = 1 / (x^2 + y^2),
    # and (y x_dot - x y_dot) / (x^2 + y^2); the partial-derivative form rounded differently
    generator = torch.Generator().manual_seed(0)
    x, ct, x_dot = (torch.randn(4, 33, generator=generator) * 2 for _ in range(3))
    y, y_dot = (torch.randn(33, generator=generator) * 2 for _ in range(2))
    for got, want in zip(mf.vjp(torch.atan2, x, y)[1](ct), tf.vjp(torch.atan2, x, y)[1](ct)):
        assert torch.equal(got, want)
    assert torch.equal(mf.jvp(torch.atan2, (x, y), (x_dot, y_dot))[1],
                       tf.jvp(torch.atan2, (x, y), (x_dot, y_dot))[1])
    for f, primal, tangent in ((lambda a: torch.atan2(a, y), x, x_dot),
                               (lambda b: torch.atan2(x, b), y, y_dot)):
        assert torch.equal(mf.jvp(f, (primal,), (tangent,))[1],
                           tf.jvp(f, (primal,), (tangent,))[1])
    # hypot: grad * x / result, and the tangent as the sum of those terms (OfGrad)
    for got, want in zip(mf.vjp(torch.hypot, x, y)[1](ct), tf.vjp(torch.hypot, x, y)[1](ct)):
        assert torch.equal(got, want)
    assert torch.equal(mf.jvp(torch.hypot, (x, y), (x_dot, y_dot))[1],
                       tf.jvp(torch.hypot, (x, y), (x_dot, y_dot))[1])


@pytest.mark.parametrize("weight", [0.3, 0.7, 1, "tensor"])
def test_lerp_as_torch_func(weight):
    """A number weight: the lerp primitive, whose values, gradients, per-example gradients and
    tangents (the lerp of the tangents) are torch.func's bit for bit; a tensor weight takes
    torch's lowering, which agrees to rounding (elementwise.py)."""
    generator = torch.Generator().manual_seed(0)
    x, y, ct, x_dot, y_dot = (torch.randn(4, 33, generator=generator) for _ in range(5))
    same = torch.equal
    if weight == "tensor":
        weight = torch.rand(33, generator=generator)
        same = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    f = lambda a, b: torch.lerp(a, b, weight)  # noqa: E731
    for got, want in zip(mf.vjp(f, x, y[0])[1](ct), tf.vjp(f, x, y[0])[1](ct)):
        assert same(got, want)
    assert same(mf.jvp(f, (x, y), (x_dot, y_dot))[1], tf.jvp(f, (x, y), (x_dot, y_dot))[1])
    per_example = lambda api: api.vmap(api.grad(lambda a, b: f(a, b).sin().sum()))  # noqa: E731
    assert same(per_example(mf)(x, y), per_example(tf)(x, y))


@pytest.mark.parametrize("eps", [None, 0.01])
def test_logit_derivatives_are_torch_funcs_inside_and_outside_its_domain(eps):
    # derivatives.yaml: grad / (x (1 - x)) inside [eps, 1 - eps], else 0 (nan without eps,
    # where the value is nan too); the engine gave a finite gradient outside [0, 1]
    x = torch.cat([torch.rand(50, generator=torch.Generator().manual_seed(0)),
                   torch.tensor([-0.5, 1.5, 0.0, 1.0, 0.001, 0.999])])
    t = torch.randn(56, generator=torch.Generator().manual_seed(1))
    f = lambda v: torch.logit(v, eps)  # noqa: E731
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(mf.vjp(f, x)[1](t)[0], tf.vjp(f, x)[1](t)[0], **same)
    torch.testing.assert_close(mf.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1], **same)


_DIVISIONS = {
    "tensor / tensor": lambda x, y: x / y,
    "number / tensor": lambda x, y: 1.1 / x + y,  # Tensor.__rtruediv__: reciprocal(x) * 1.1
    "plain tensor / tensor": lambda x, y: torch.linspace(1, 2, 9) / x + y,
    "torch.div(number, tensor)": lambda x, y: torch.div(2.5, x) + y,
}


@pytest.mark.parametrize("name", sorted(_DIVISIONS))
def test_divisions_are_bit_exact_with_torch_func(name):
    # torch computes `1.1 / x` as reciprocal(x) * 1.1, and differentiates div as
    # derivatives.yaml says (-grad * ((x / y) / y), (x_dot - y_dot * out) / y); a div(1.1, x)
    # and -(ct * x) / (y * y) differed in the last bit
    f = _DIVISIONS[name]
    generator = torch.Generator().manual_seed(0)
    x, y, t, u, ct = (torch.rand(4, 9, generator=generator) + 0.5 for _ in range(5))
    assert torch.equal(mf.vmap(f)(x, y), tf.vmap(f)(x, y))
    for argnums in (0, 1, (0, 1)):
        loss = lambda x, y: (f(x, y) * ct).sum()  # noqa: E731
        for got, want in zip(optree.tree_leaves(mf.grad(loss, argnums=argnums)(x, y)),
                             optree.tree_leaves(tf.grad(loss, argnums=argnums)(x, y))):
            assert torch.equal(got, want)
    for tangents in ((t, u), (t, torch.zeros_like(u)), (torch.zeros_like(t), u)):
        assert torch.equal(mf.jvp(f, (x, y), tangents)[1], tf.jvp(f, (x, y), tangents)[1])
    for g in (lambda x: f(x, y), lambda y: f(x, y)):  # one tangent: the other is a constant
        assert torch.equal(mf.jvp(g, (x,), (t,))[1], tf.jvp(g, (x,), (t,))[1])
    assert torch.equal(mf.jit(f)(x, y), f(x, y))


def _bits(t):
    """The tensor's bits as integers (NaNs and signed zeros compare as themselves)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


_NUMBERS = (1.1, -2.5, 3, 7, 0.1, 1e-30, 1e30, 1e300, -1e-300, 2 ** 53 + 1, 2 ** 60 + 1, 0.0,
            -0.0, 0, float("inf"), float("nan"), 1.5 + 2j, True, 2 ** 63, 2 ** 70, -2 ** 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64,
                                   torch.complex128, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("prim", ["add", "sub", "mul", "div"])
def test_a_number_operand_gives_torchs_bits(dtype, prim):
    # NOTE [Number operands as tensors]: the primitive passes a number as a kept 0-d tensor
    # where that gives the bits torch gives with the number, and the number itself elsewhere
    from minifunctorch.core import primitives as P
    impl, torch_function = getattr(P, f"{prim}_p").impl, getattr(torch, prim)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(300, generator=generator) * 10).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(dtype)
    for number in _NUMBERS:
        try:
            want = torch_function(x, number)
        except (RuntimeError, OverflowError) as error:  # an int beyond int64, ...
            with pytest.raises(type(error), match=re.escape(str(error)[:40])):
                impl(x, number)
            continue
        got = impl(x, number)
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), (number, got)
        assert impl(x, number).data_ptr() != got.data_ptr()  # a new result each call
    for dtype_kept in set(P._number_tensors.values()):
        assert dtype_kept.dim() == 0 and dtype_kept.device.type == "cpu"
    assert P.number_tensor(-0.0, torch.float32) is None  # the kept 0.0 would stand for it
    assert P.number_tensor(True, torch.float32) is None
    assert P.number_tensor(2 ** 60 + 1, torch.float32) is None  # it could round twice
    assert P.number_tensor(1.5j, torch.float32) is None  # the result would be complex


def test_a_number_operand_under_transforms_is_bit_exact_with_torch_func():
    generator = torch.Generator().manual_seed(1)
    x, ct = torch.randn(6, 5, generator=generator), torch.randn(6, 5, generator=generator)
    f = lambda x: ((x * 1.1 + 0.1) / 3 - 2.5) * (x - -0.0)  # noqa: E731
    assert torch.equal(mf.vmap(f)(x), tf.vmap(f)(x))
    assert torch.equal(mf.vmap(mf.vmap(f))(x), tf.vmap(tf.vmap(f))(x))
    loss = lambda x: (f(x) * ct).sum()  # noqa: E731
    assert torch.equal(mf.grad(loss)(x), tf.grad(loss)(x))
    assert torch.equal(mf.vmap(mf.grad(lambda r: (f(r) * 1.7).sum()))(x),
                       tf.vmap(tf.grad(lambda r: (f(r) * 1.7).sum()))(x))
    assert torch.equal(mf.jvp(f, (x,), (ct,))[1], tf.jvp(f, (x,), (ct,))[1])


def test_a_number_on_the_left_is_computed_as_torch_computes_it():
    # torch's Tensor.__rmul__ and __radd__ are mul(self, other) and add(self, other): 2.0 * t
    # is t * 2.0. Of complex operands the order changes the bits (an FMA rounds one of the
    # two products), so the engine computing c * t would differ from torch.func
    generator = torch.Generator().manual_seed(3)
    for dtype, numbers in ((torch.float32, (1.1, 3, True)), (torch.complex64, (0.3 + 0.7j, 1.1))):
        x = torch.randn(6, 5, generator=generator, dtype=dtype)
        x_dot = torch.randn(6, 5, generator=generator, dtype=dtype)
        for c in numbers:
            def f(x, c=c):
                return (c * x + 0.5) * (2.5 + x) * (c * (x * x))
            assert torch.equal(mf.vmap(f)(x), tf.vmap(f)(x)), (dtype, c)
            assert torch.equal(mf.vmap(mf.vmap(f))(x), tf.vmap(tf.vmap(f))(x)), (dtype, c)
            assert torch.equal(mf.jvp(f, (x,), (x_dot,))[1], tf.jvp(f, (x,), (x_dot,))[1])
            if not dtype.is_complex:
                loss = lambda x, f=f: (f(x) * x_dot).sum()  # noqa: E731
                assert torch.equal(mf.grad(loss)(x), tf.grad(loss)(x)), (dtype, c)
        # a plain tensor on the left stays on the left: ``a * r`` reaches ``r.__rmul__(a)``
        # first (Python asks the subclass), and is ``mul(a, r)`` as written
        a = torch.randn(5, generator=generator, dtype=dtype)
        for g in (lambda r: a * r, lambda r: a + r):
            assert torch.equal(mf.vmap(g)(x), tf.vmap(g)(x)), dtype
            assert [e.prim.name for e in mf.trace(g)(x[0]).equations] in (["mul"], ["add"])


def test_numpy_scalars_are_numbers_as_in_torch():
    # torch's argument parser reads a NumPy scalar as the Python number it holds; here one
    # used to reach the engine's dtype checks and crash there (a NumPy dtype has no
    # is_complex) under grad
    import numpy as np
    x = batch[0].float()
    for s in (np.float64(2.5), np.float32(2.5), np.int64(3), np.bool_(True)):
        for transform in (lambda api, f: api.grad(lambda x: f(x).sum()),
                          lambda api, f: api.vmap(f),
                          lambda api, f: api.vmap(api.grad(lambda x: f(x).sum())),
                          lambda api, f: lambda x: api.jvp(f, (x,), (x,))[1]):
            for f in (lambda x, s=s: x * s, lambda x, s=s: torch.add(x, s) ** 2):
                ours, theirs = transform(mf, f)(batch.float()), transform(tf, f)(batch.float())
                assert type(ours) is torch.Tensor and ours.dtype == theirs.dtype, type(s)
                assert torch.equal(ours, theirs), type(s)
        assert torch.equal(mf.grad(lambda x: (x * s).sum())(x), tf.grad(lambda x: (x * s).sum())(x))
        # and as a keyword argument
        clamped = lambda x, s=s: torch.clamp(x, min=s).sum()  # noqa: E731
        assert torch.equal(mf.grad(clamped)(x), tf.grad(clamped)(x))


def test_a_numpy_array_operand_is_refused_as_torch_func_refuses_it():
    # torch hands x * array to NumPy, which asks the tensor for its numbers: torch.func raises
    # (RuntimeError); here the array used to reach the engine's dtype checks and crash there
    import numpy as np
    array = np.ones(3)
    with pytest.raises(RuntimeError, match="Can't call numpy"):
        tf.grad(lambda x: (x * array).sum())(x3.float())
    for call in (lambda: mf.grad(lambda x: (x * array).sum())(x3.float()),
                 lambda: mf.grad(lambda x: (array * x).sum())(x3.float()),
                 lambda: mf.vmap(lambda x: x + np.array(2.0))(batch),
                 lambda: mf.jvp(lambda x: x - array, (x3,), (x3,))):
        with pytest.raises(mf.UnsupportedOperationError) as error:
            call()
        assert isinstance(error.value, RuntimeError)
        message = str(error.value)
        assert message.startswith("Tensor.__") and "Can't call numpy() on Tensor" in message
        assert "torch.as_tensor(array)" in message
    assert torch.equal(mf.grad(lambda x: (x * 2.0).sum())(x3), torch.full((3,), 2.0,
                                                                          dtype=x3.dtype))


def test_a_number_first_met_inside_a_trace_is_kept_as_a_plain_tensor():
    # NOTE [Number operands as tensors]: a trace computes each op on meta tensors inside the
    # user's function, where the transform mode is on; the kept tensor of a number first met
    # there was made under that mode (a wrapped value), and every later ``x * number`` then
    # returned one (found as test_grad_of_a_dict_of_parameters failing after this file)
    from minifunctorch.core import ops
    from minifunctorch.core import primitives as P
    x = torch.rand(3)
    for dtype in (torch.float32, torch.float64):
        P._number_tensors.pop((1.8125, dtype), None)
        mf.trace(lambda x: ops.mul(x, 1.8125))(x.to(dtype))
        assert type(P.number_tensor(1.8125, dtype)) is torch.Tensor
        g = mf.grad(lambda x: (x * 1.8125).sum())(x.to(dtype))
        assert type(g) is torch.Tensor and torch.equal(g, torch.full((3,), 1.8125, dtype=dtype))
        assert torch.equal(mf.vmap(lambda r: r * 1.8125)(x.to(dtype)), x.to(dtype) * 1.8125)
    assert all(type(t) is torch.Tensor for t in P._number_tensors.values())


def test_each_function_that_is_one_primitive_is_its_op():
    # NOTE [Functions that are one primitive]: the front door binds the primitive itself for
    # these functions; that must be exactly what the function's op does
    from minifunctorch.core import torch_api
    from minifunctorch.core.tensor import unwrap, wrap
    from minifunctorch.core import tensor as tensor_module
    assert len(torch_api.ONE_PRIMITIVE) > 60
    # the mode's shortcut for them skips call_function's special cases, so none may be one
    special = (set(tensor_module._SPECIAL_CALLS) | set(torch_api.VIEWS)
               | set(torch_api.RANDOM_FUNCTIONS) | set(torch_api.IN_PLACE))
    for table in (torch_api.ONE_PRIMITIVE, torch_api.NUMBER_SECOND):
        assert not special & set(table), special & set(table)
    inputs = (torch.rand(3) + 1.5, torch.arange(3), torch.tensor([True, False]),
              torch.complex(torch.rand(3), torch.rand(3)))
    for function, prim in torch_api.ONE_PRIMITIVE.items():
        op = torch_api.TORCH_FUNCTIONS[function]
        checked = 0
        for x in inputs:  # every dtype the op takes: an op may treat complex numbers apart
            try:
                program = mf.trace(lambda x: wrap(op(unwrap(x))))(x)
            except Exception:  # noqa: BLE001 (an op of another dtype: try the next one)
                continue
            assert [e.prim for e in program.equations] == [prim], (function, x.dtype, program)
            checked += 1
        assert checked, f"no dtype to check {function} on"
    assert len(torch_api.NUMBER_SECOND) == 14
    for function, prim in torch_api.NUMBER_SECOND.items():
        op = torch_api.TORCH_FUNCTIONS[function]
        for number in (1.5, 2, True, 1j):
            program = mf.trace(lambda x: wrap(op(unwrap(x), number)))(torch.rand(3) + 1.5)
            [equation] = program.equations
            assert equation.prim is prim and equation.inputs[1].value == number, function


def test_in_place_on_tensors_created_inside_the_function():
    def f(x):
        buf = torch.zeros(3, dtype=x.dtype)
        buf[0] = x.sin().sum()
        buf[1:] = x[:2] * 2
        h = F.relu(x - 1, inplace=True)
        return (buf * h).sum()
    torch.testing.assert_close(mf.grad(f)(x3), tf.grad(f)(x3))
    # torch.func's vmap refuses a batched value written into an unbatched tensor; here the
    # tensor becomes batched, and the result is the per-example gradient
    torch.testing.assert_close(mf.vmap(mf.grad(f))(batch),
                               torch.stack([tf.grad(f)(row) for row in batch]))


def _written_in_place(method, *args):
    def f(x):
        y = x.abs() + 1
        getattr(y, method)(*[x if a is None else a for a in args])
        return y * x
    return f


@pytest.mark.parametrize("name, f", [
    # aten's in-place overload and its out-of-place one have different names for these
    ("transpose_", lambda x: (lambda y: (y.transpose_(0, 1), y @ x)[1])(x.sin())),
    ("pow_ tensor exponent", _written_in_place("pow_", None)),
    ("float_power_ tensor exponent", _written_in_place("float_power_", None)),
    # pow.Scalar takes a number as its base; pow_.Scalar's form is pow.Tensor_Scalar
    ("pow_ number exponent", _written_in_place("pow_", 2)),
    ("float_power_ number exponent", _written_in_place("float_power_", 3)),
    # ldexp.default takes two numbers; ldexp_'s form is ldexp.Tensor
    ("ldexp_", _written_in_place("ldexp_", torch.tensor([1.0, 2.0, 3.0, 4.0]))),
    # polygamma(n, self) puts its arguments in the other order from polygamma_(self, n)
    ("polygamma_", _written_in_place("polygamma_", 1)),
    ("quantile (torch sorts with transpose_)", lambda x: torch.quantile(x, 0.3, dim=1)),
])
def test_in_place_ops_whose_out_of_place_overload_is_named_otherwise(name, f):
    xs = torch.rand(2, 3, 4, dtype=torch.float64) + 0.5
    x_dots = torch.randn(2, 3, 4, dtype=torch.float64)
    scalar = lambda x: f(x).sum()  # noqa: E731
    torch.testing.assert_close(mf.vmap(f)(xs), tf.vmap(f)(xs))
    torch.testing.assert_close(mf.vmap(mf.grad(scalar))(xs), tf.vmap(tf.grad(scalar))(xs))
    torch.testing.assert_close(mf.jvp(f, (xs[0],), (x_dots[0],)),
                               tf.jvp(f, (xs[0],), (x_dots[0],)))


def test_fill_with_a_tensor_value_that_varies_per_example():
    def f(x, value):
        filled = x.clone()
        filled.fill_(value)
        return filled * x
    xs, values = batch.clone(), torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(mf.vmap(f)(xs, values), tf.vmap(f)(xs, values))
    per_example = lambda api: api.vmap(api.grad(lambda x, v: f(x, v).sum(), argnums=(0, 1)))  # noqa: E731,E501
    torch.testing.assert_close(per_example(mf)(xs, values), per_example(tf)(xs, values))
    with pytest.raises(mf.TransformError, match="fill_ only supports 0-dimension value tensor"):
        mf.grad(lambda x: x.clone().fill_(x).sum())(x3)


def test_relu_inplace_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(inplace=True)).double()
    params = dict(model.named_parameters())
    f = lambda p, x: mf.functional_call(model, p, (x,)).sum()  # noqa: E731
    g = lambda p, x: torch.func.functional_call(model, p, (x,)).sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(f)(params, x3), tf.grad(g)(params, x3))


def test_writes_through_views_reach_their_base():
    def f(x):
        y = x * 1
        head = y[:2]
        head.mul_(3)  # a write through a view
        tail = y[1:]  # a view read after its base was written
        y.add_(1)
        return (tail * x[1:]).sum() + y.sum()
    torch.testing.assert_close(mf.grad(f)(x3), tf.grad(f)(x3))
    torch.testing.assert_close(mf.vmap(mf.grad(f))(batch), tf.vmap(tf.grad(f))(batch))


def test_write_through_an_expanded_view_is_refused():
    def f(x):
        y = torch.zeros(1, dtype=x.dtype).expand(3)
        y.add_(x)
        return y.sum()
    with pytest.raises(mf.TransformError, match=r"several elements share one place"):
        mf.grad(f)(x3)


# --- NOTE [A tape has no version counter] ---------------------------------------------------------
def _write_after_use(x, w):
    y = (x * w).sum()  # mul's backward reads w
    w.add_(1)
    return y


def _renorm_after_use(x, w):
    y = (x * w).sum()
    return y + torch.nn.functional.embedding(torch.tensor([0, 2]), w, max_norm=1.0).sum()


def _renorm_of_an_output(x):
    w = x.exp()  # exp's backward reads its output
    return torch.nn.functional.embedding(torch.tensor([0, 2]), w, max_norm=1.0).sum()


@pytest.mark.parametrize("f, args", [
    (_write_after_use, (torch.randn(3), torch.randn(3))),
    (_renorm_after_use, (torch.randn(4, 3), 3 * torch.randn(4, 3))),
    (_renorm_of_an_output, (torch.randn(4, 3) + 2,)),
], ids=["add_ after mul", "embedding max_norm after mul", "embedding max_norm of exp"])
def test_a_write_into_a_tensor_a_tape_may_read_is_refused(f, args):
    # The tensor written is one that f closes over: torch.func refuses every write into
    # one. Here a write that no recorded op reads is done; this one would make the gradient
    # silently read the new numbers, so it is refused. (An argument that is not
    # differentiated is written after the backward pass:
    # test_writes_into_arguments_that_are_not_differentiated)
    def closing_over(captured):
        def g(x):
            return f(x, *captured)
        g.__name__ = f.__name__
        return g
    with pytest.raises(RuntimeError, match="mutate a captured Tensor|modified by an inplace"):
        tf.grad(closing_over([a.clone() for a in args[1:]]))(args[0].clone())
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^grad\(.*?\)\(<inputs>\): .* writes in place into a tensor that "
                             r"grad recorded an op on \((mul|exp)\).*Fix: "):
        mf.grad(closing_over([a.clone() for a in args[1:]]))(args[0].clone())
    assert mf.grad(lambda x: (x * 2).sum())(torch.ones(2)).tolist() == [2.0, 2.0], \
        "the next call works"


@pytest.mark.parametrize("write", ["after its use", "whose backward reads it"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_a_write_into_a_differentiated_input_that_a_recorded_op_reads_is_refused(transform,
                                                                                 write):
    # The write is copied into the caller's tensor, which the recorded ops read in the
    # backward pass: the gradients would have been 2 * (x + 1) and cos(sin(x)), silently.
    # torch.func refuses every write into its leaves (_refuse_writes_a_tape_reads)
    def f(x):
        if write == "after its use":
            y = (x * x).sum()  # mul's backward reads x
            x.add_(1)
            return y
        return x.sin_().sum()  # sin's backward reads x
    run = {"grad": lambda api, x: api.grad(f)(x), "vjp": lambda api, x: api.vjp(f, x)[0],
           "jacrev": lambda api, x: api.jacrev(f)(x)}[transform]
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in "
                                           "an in-place operation"):
        run(tf, torch.ones(2))
    x = torch.ones(2)
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^(grad|vjp)\(f\)\(<inputs>\): .*a leaf Variable that requires grad "
                             r"is being used in an in-place operation.*Fix: "):
        run(mf, x)
    assert x.tolist() == [1.0, 1.0], "the caller's tensor is untouched"
    assert mf.grad(lambda a: (a * a).sum())(x).tolist() == [2.0, 2.0], "the next call works"


def test_a_write_before_any_use_runs_as_in_torch_func():
    def f(x, w):
        w.add_(1)
        return (x * w).sum()
    ours_w, theirs_w = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(mf.grad(f)(torch.ones(3), ours_w),
                               tf.grad(f)(torch.ones(3), theirs_w))
    torch.testing.assert_close(ours_w, theirs_w)



# --- writes into arguments that a transform does not differentiate ---------------------------
def _running_mean(w, stats, x):  # a statistic kept by the caller, updated with a plain value
    y = x @ w
    stats.mul_(0.9).add_(0.1 * y.detach().mean(0))
    return y.sum()


def _copy_into(x, y):  # torch.func's test_inplace: the write carries x's derivative
    y.copy_(x)
    return y


def _write_a_slice(x, y, z):  # ... and through a view of an argument that is not selected
    x[:2] = y
    return torch.vstack([(x ** 2).sum(), (z ** 3).sum()])


def _written_then_read(x, buf):  # the write's value carries x's derivative, then is read
    buf.copy_(x * 2)
    return (buf * x).sum()


def _in_a_dict(x, state):  # an argument that is a pytree, one tensor passed twice
    state["seen"].add_(x.detach())
    state["out"].copy_(x.exp())
    return (state["out"] * state["alias"]).sum()


_WRITES = {
    "grad, a running statistic": (lambda api, f, a: api.grad(f)(*a), _running_mean,
                                  lambda: (torch.arange(12.0).reshape(3, 4) / 10,
                                           torch.zeros(4), torch.randn(8, 3))),
    "jacrev, copy_": (lambda api, f, a: api.jacrev(f)(*a), _copy_into,
                      lambda: (torch.randn(2), torch.randn(2))),
    "jacfwd, copy_": (lambda api, f, a: api.jacfwd(f)(*a), _copy_into,
                      lambda: (torch.randn(2), torch.randn(2))),
    "jacrev, a slice": (lambda api, f, a: api.jacrev(f, argnums=(1, 2))(*a), _write_a_slice,
                        lambda: (torch.randn(3), torch.randn(2), torch.randn(2))),
    "jacfwd, a slice": (lambda api, f, a: api.jacfwd(f, argnums=(1, 2))(*a), _write_a_slice,
                        lambda: (torch.randn(3), torch.randn(2), torch.randn(2))),
    "grad_and_value, read after": (lambda api, f, a: api.grad_and_value(f)(*a),
                                   _written_then_read, lambda: (torch.randn(2), torch.zeros(2))),
    "hessian, read after": (lambda api, f, a: api.hessian(f)(*a), _written_then_read,
                            lambda: (torch.randn(2), torch.zeros(2))),
    "vmap(grad), read after": (lambda api, f, a: api.vmap(api.grad(f))(*a), _written_then_read,
                               lambda: (torch.randn(3, 2), torch.zeros(3, 2))),
    "grad(grad), read after": (lambda api, f, a: api.grad(lambda x, b: api.grad(f)(x, b).sum())(*a),
                               _written_then_read, lambda: (torch.randn(2), torch.zeros(2))),
}


@pytest.mark.parametrize("case", list(_WRITES))
def test_writes_into_arguments_that_are_not_differentiated(case):
    # torch.func shows every positional argument to f at the transform's level, so f may
    # write into one it does not differentiate, even a value of the transform, and the write
    # reaches the caller's tensor (NOTE [Arguments a transform does not differentiate])
    run, f, make = _WRITES[case]
    torch.manual_seed(0)
    theirs_args = make()
    before = [a.clone() for a in theirs_args]
    ours_args = [a.clone() for a in theirs_args]
    expected = run(tf, f, theirs_args)
    got = run(mf, f, ours_args)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(ours_args, theirs_args):  # the writes reached the caller
        torch.testing.assert_close(ours, theirs)
    assert any(not torch.equal(a, b) for a, b in zip(ours_args, before)), "an argument changed"


def test_a_write_into_an_argument_in_a_pytree_and_passed_twice():
    x = torch.tensor([0.5, -1.0])

    def state():
        alias = torch.full((2,), 2.0)
        return {"seen": torch.zeros(2), "out": torch.zeros(2), "alias": alias}
    theirs, ours = state(), state()
    torch.testing.assert_close(mf.grad(_in_a_dict)(x, ours), tf.grad(_in_a_dict)(x, theirs))
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key])
    # One tensor under two keys: a write under one is seen under both, with its derivative,
    # as in eager torch: the gradient of exp(x) * exp(x). (torch.func wraps the tensor once
    # per key, and the other key sees the new numbers as a constant: exp(2x), not 2 exp(2x).)
    shared = torch.zeros(2)
    both = {"seen": torch.zeros(2), "out": shared, "alias": shared}
    eager_x, eager_shared = x.clone().requires_grad_(), torch.zeros(2)
    _in_a_dict(eager_x, {"seen": torch.zeros(2), "out": eager_shared, "alias": eager_shared}
               ).backward()
    torch.testing.assert_close(mf.grad(_in_a_dict)(x, both), eager_x.grad)
    torch.testing.assert_close(eager_x.grad, 2 * torch.exp(2 * x))
    torch.testing.assert_close(shared, torch.exp(x))


def test_a_write_into_an_argument_that_a_recorded_op_reads_gives_the_gradient_of_the_old_value():
    # torch.func raises at its backward pass (version counter). The caller's tensor is
    # written after the backward pass here, so the gradient reads what f computed with
    def f(x, w):
        y = (x * w).sum()  # mul's backward reads w
        w.add_(1)
        return y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tf.grad(f)(torch.ones(3), torch.full((3,), 2.0))
    w = torch.full((3,), 2.0)
    assert mf.grad(f)(torch.ones(3), w).tolist() == [2.0, 2.0, 2.0]
    assert w.tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("argnums", [0, 1], ids=["differentiated", "not differentiated"])
def test_a_batched_write_into_an_argument_that_vmap_does_not_batch_is_refused(argnums):
    def f(buf, x):
        buf.copy_(x * 2)
        return (buf * x).sum()
    # (torch.func refuses a write into a differentiated input before it looks at batching)
    with pytest.raises(RuntimeError, match="vmap: inplace arithmetic|a leaf Variable that "):
        tf.vmap(tf.grad(f, argnums=argnums), in_dims=(None, 0))(torch.zeros(2), torch.ones(3, 2))
    buf = torch.zeros(2)
    with pytest.raises(mf.InPlaceError, match=r"^grad\(f.*\)\(<inputs>\): vmap: inplace "
                                              r"arithmetic.*in_dims=None.*Fix: "):
        mf.vmap(mf.grad(f, argnums=argnums), in_dims=(None, 0))(buf, torch.ones(3, 2))
    assert buf.tolist() == [0.0, 0.0]
    assert mf.vmap(mf.grad(f, argnums=argnums))(torch.zeros(3, 2), torch.ones(3, 2)).shape == \
        (3, 2), "the next call works"

def test_a_write_into_a_keyword_argument_of_grad_and_into_a_captured_tensor():
    # torch.func's grad shows its keyword arguments at its level too, so f may write into
    # them; a tensor that f closes over is captured, and a write of a value of the transform
    # into it is refused (the fix names the way that works)
    def f(x, *, buf):
        buf.copy_(x * 2)
        return (buf * x).sum()
    ours, theirs = torch.zeros(2), torch.zeros(2)
    torch.testing.assert_close(mf.grad(f)(torch.ones(2), buf=ours),
                               tf.grad(f)(torch.ones(2), buf=theirs))
    torch.testing.assert_close(ours, theirs)
    captured = torch.zeros(2)

    def g(x):
        return f(x, buf=captured)
    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        tf.grad(g)(torch.ones(2))
    with pytest.raises(mf.InPlaceError, match=r"^Tensor\.copy_\(\.\.\.\): .*mutate a captured "
                                              r"Tensor.*Fix: .*pass it to the transformed function"):
        mf.grad(g)(torch.ones(2))
    assert captured.tolist() == [0.0, 0.0]
    assert mf.grad(lambda x: (x * 2).sum())(torch.ones(2)).tolist() == [2.0, 2.0], \
        "the next call works"

def _view_then_write_its_base(x):
    y = x.clone()
    first, rows = y[0], y.view(-1)[1:]
    y.sin_()
    return first * 2, rows


@pytest.mark.parametrize("transform", [
    lambda api, f, x: api.grad(lambda a: f(a)[0] + f(a)[1].sum())(x),
    lambda api, f, x: api.vjp(f, x)[1]((torch.tensor(1.0), torch.ones(2)))[0],
    lambda api, f, x: api.jvp(f, (x,), (torch.ones(3),)),
    lambda api, f, x: api.vmap(f)(torch.stack([x, x * 2])),
    lambda api, f, x: api.vmap(api.grad(lambda a: f(a)[0]))(torch.stack([x, x * 2])),
    lambda api, f, x: api.jacrev(f)(x),
], ids=["grad", "vjp", "jvp", "vmap", "vmap(grad)", "jacrev"])
def test_an_output_that_is_a_view_of_a_base_written_later(transform):
    # NOTE [Outputs are read while their level runs]: the view is replayed on the written
    # base on the transform's level (it was replayed after the level closed: grad gave 0, vmap
    # raised)
    x = torch.tensor([0.3, -1.2, 2.0])
    torch.testing.assert_close(transform(mf, _view_then_write_its_base, x),
                               transform(tf, _view_then_write_its_base, x))


def _write_through_a_view_of_a_view(x):
    y = x.clone()
    rows = y.view(-1)[1:]
    rows.mul_(rows.exp())
    first = y[:1]
    y.add_(1)
    return y, rows, first


@pytest.mark.parametrize("transform", [
    lambda api, f, x: api.grad(lambda a: sum(o.sin().sum() for o in f(a)))(x),
    lambda api, f, x: api.jvp(f, (x,), (torch.ones(3),)),
    lambda api, f, x: api.vmap(f)(torch.stack([x, x * 2])),
], ids=["grad", "jvp", "vmap"])
def test_writes_through_a_view_of_a_view(transform):
    x = torch.tensor([0.3, -1.2, 2.0])
    torch.testing.assert_close(transform(mf, _write_through_a_view_of_a_view, x),
                               transform(tf, _write_through_a_view_of_a_view, x))


def _views_read_between_writes(x):
    # NOTE [Views that outlive a write]: each view is read (so checked up to date) before a
    # write, and again after it, in both orders along the chain root -> flat -> tail -> pair
    y = x.clone()
    flat = y.view(-1)
    tail = flat[2:]
    pair = tail.view(-1, 2)
    reads = [pair.sum(), tail.sum()]  # both checked before any write
    y.mul_(2)  # the root written: the whole chain is behind
    reads += [tail.sum(), pair.sum()]  # the inner view first, then the outer one
    tail.add_(1)  # a write through the middle of the chain
    reads += [pair.sum(), flat.sum(), y.sum()]  # outer view first, then up to the root
    deep = flat
    for _ in range(50):  # a long chain of views, read once at its end
        deep = deep.view(2, -1).view(-1)
    y.sub_(0.5)
    reads.append(deep.sum())
    return torch.stack(reads) * x.sum()


@pytest.mark.parametrize("transform", [
    lambda api, f, x: api.grad(lambda a: f(a).sum())(x),
    lambda api, f, x: api.vmap(f)(torch.stack([x, x * 2, -x])),
    lambda api, f, x: api.jvp(f, (x,), (torch.ones_like(x),)),
], ids=["grad", "vmap", "jvp"])
def test_views_read_between_writes_see_every_write(transform):
    x = torch.tensor([[0.3, -1.2, 2.0], [0.5, 1.5, -0.7]], dtype=torch.float64)
    torch.testing.assert_close(_views_read_between_writes(x.clone()),
                               torch.func.vmap(_views_read_between_writes)(x[None])[0])
    torch.testing.assert_close(transform(mf, _views_read_between_writes, x),
                               transform(tf, _views_read_between_writes, x))


def test_clamp_with_tensor_bounds_promotes_as_torch():
    # an int example clamped by float bounds is float (it kept the int dtype, and truncated)
    xs, low, high = torch.tensor([3, -2]), torch.rand(2, 1, 4), torch.rand(2, 3, 4) + 1
    ours, theirs = mf.vmap(torch.clamp)(xs, low, high), tf.vmap(torch.clamp)(xs, low, high)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs)
    x = torch.randn(3, 4)
    f = lambda t: t.clamp(torch.tensor(0.0, dtype=torch.float64))  # noqa: E731 (0-d: no promotion)
    assert mf.vmap(f)(x).dtype == tf.vmap(f)(x).dtype == torch.float32



@pytest.mark.parametrize("clamp", [
    lambda x, lo, hi: torch.clamp(x, lo, hi), lambda x, lo, hi: torch.clamp(x, min=lo),
    lambda x, lo, hi: torch.clamp(x, max=hi), lambda x, lo, hi: torch.clamp_max(x, hi),
], ids=["both", "min", "max", "clamp_max"])
def test_clamp_with_tensor_bounds_at_ties_and_nans_as_torch(clamp):
    # every combination of x, lo and hi from {0, 1, 2, nan}: ties, crossed bounds, NaNs
    values = torch.tensor([0.0, 1.0, 2.0, math.nan], dtype=torch.float64)
    x, lo, hi = torch.cartesian_prod(values, values, values).unbind(1)
    expected = clamp(x, lo, hi)
    torch.testing.assert_close(mf.vmap(clamp)(x, lo, hi), expected, equal_nan=True)
    loss = lambda *a: clamp(*a).sum()  # noqa: E731
    ours = mf.grad(loss, argnums=(0, 1, 2))(x, lo, hi)
    theirs = tf.grad(loss, argnums=(0, 1, 2))(x, lo, hi)
    defined = ~expected.isnan()  # (NOTE [clamp with tensor bounds]: no gradient at a NaN)
    for g_ours, g_theirs in zip(ours, theirs):
        torch.testing.assert_close(g_ours[defined], g_theirs[defined])


@pytest.mark.parametrize("op", [
    lambda t: t.squeeze_(), lambda t: t.unsqueeze_(0), lambda t: t.t_(),
    lambda t: t.transpose_(0, 1), lambda t: t.sin_(),
], ids=["squeeze_", "unsqueeze_", "t_", "transpose_", "sin_"])
def test_in_place_ops_that_reshape_a_batched_input(op):
    # the caller's tensor takes the new shape, as in torch.func (the write-back copied into
    # the old shape and crashed on the overlap)
    x = torch.randn(2, 3, 1)
    ours_x, theirs_x = x.clone(), x.clone()
    ours, theirs = mf.vmap(op)(ours_x), tf.vmap(op)(theirs_x)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_x, theirs_x)


def test_a_reshaping_in_place_op_inside_nested_transforms_is_refused():
    x = torch.randn(2, 3, 1)
    with pytest.raises(mf.TransformError, match="changes an input's shape"):
        mf.grad(lambda t: mf.vmap(lambda u: u.squeeze_())(t).sum())(x)
    torch.testing.assert_close(mf.vmap(torch.sin)(x), x.sin())


def test_numpy_argument_names_and_where_of_a_condition_alone():
    # torch's argument parser takes axis= and keepdims=; torch.where(c) is nonzero(c, as_tuple)
    xs = torch.rand(3, 4)
    f = lambda t: torch.argsort(t, axis=0) + t.sum(axis=0, keepdims=True).long()  # noqa: E731
    torch.testing.assert_close(mf.vmap(f)(xs), tf.vmap(f)(xs))
    g = lambda t: (t[torch.where(t > 0.5)[0]] ** 2).sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(g)(xs[0]), tf.grad(g)(xs[0]))
    for api in (mf, tf):
        with pytest.raises(RuntimeError, match="Attempted to vmap over aten::where"):
            api.vmap(lambda t: torch.where(t))(xs)


@pytest.mark.parametrize("f, shape", [
    (torch.squeeze, (7,)), (torch.squeeze, (7, 3)), (lambda t: t.view(3), (7, 3)),
    (mf.vmap(lambda t: torch.squeeze(t, dim=1)), (7, 11, 1, 3, 4)),
], ids=["squeeze_0d", "squeeze_nothing", "view_same_shape", "nested_squeeze_nothing"])
def test_a_view_op_that_changes_nothing_returns_a_view(f, shape):
    # torch.func returns a new tensor, a view of the input (y._base is x), not x itself
    x = torch.rand(shape)
    y = mf.vmap(f)(x)
    assert y is not x and y._base is x
    assert mf.vmap(lambda t: t)(x) is x  # (the identity returns the input, as in torch.func)


def test_a_dim_out_of_range_raises_torchs_index_error():
    for xs, dim in [(torch.rand(10), 1), (torch.rand(10, 2), 3), (torch.rand(10, 2), -3)]:
        with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in "
                                             r"range of \[-1, 0\], but got"):
            mf.vmap(lambda t: torch.squeeze(t, dim=dim))(xs)


def test_the_transpose_of_numbers_is_the_input_itself():
    # torch.func's one exception to views being fresh tensors (its transpose batching rule)
    x = torch.rand(7)
    for api in (mf, tf):
        assert api.vmap(lambda t: torch.transpose(t, 0, -1))(x) is x
        assert api.vmap(torch.squeeze)(x) is not x


def test_a_0d_tensor_formats_as_its_number_inside_transforms():
    """f"{loss:.3f}" inside a transform, as torch formats it outside; a spec on a tensor of
    more dims is refused as torch refuses it, and under vmap the value has no single number."""
    x = torch.tensor([0.25, 1.5])
    seen = []

    def f(x):
        seen.append((f"{x.sum():.3f}", f"{x.sum()}", format(x[0], "e")))
        return x.sum()
    mf.grad(f)(x)
    f(x)
    assert seen[0] == seen[1] == ("1.750", "1.75", "2.500000e-01")
    with pytest.raises(TypeError, match="unsupported format string"):
        mf.grad(lambda x: f"{x:.2f}" and x.sum())(x)
    with pytest.raises(mf.BatchedControlFlowError):
        mf.vmap(lambda x: f"{x.sum():.2f}" and x)(torch.ones(2, 2))


# --- gradient hooks (NOTE [Gradient hooks] in core/autograd.py) --------------------------------
def _hooked(x):
    y = x.sin()
    y.register_hook(lambda g: g * 2)  # doubles y's gradient before it flows on
    z = y * x
    z.register_hook(lambda g: None)  # sees z's gradient, changes nothing
    x.register_hook(lambda g: g + 1)  # on the input: the gradient returned
    removed = x.exp().register_hook(lambda g: g * 0)
    removed.remove()
    return (z + y).sum()


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "hessian", "jacrev_jacrev",
                                       "jacfwd_jacrev"])
def test_gradient_hooks_match_torch_func(transform):
    x = torch.randn(3, generator=torch.Generator().manual_seed(0))
    xs = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    runs = {
        "grad": lambda api: api.grad(_hooked)(x),
        "vmap_grad": lambda api: api.vmap(api.grad(_hooked))(xs),
        "hessian": lambda api: api.hessian(_hooked)(x),
        "jacrev_jacrev": lambda api: api.jacrev(api.jacrev(_hooked))(x),
        "jacfwd_jacrev": lambda api: api.jacfwd(api.jacrev(_hooked))(x),
    }
    torch.testing.assert_close(runs[transform](mf), runs[transform](tf))


def test_gradient_hook_errors_name_the_call_and_the_fix():
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't "
                                           "require gradient .*Fix:"):
        mf.grad(lambda x: (torch.ones(3).register_hook(lambda g: g), x.sum())[1])(x)
    def resized(x):
        y = x.sin()
        y.register_hook(lambda g: g[:1])
        return y.sum()
    with pytest.raises(mf.TransformUsageError, match="has changed the size of value"):
        mf.grad(resized)(x)
    torch.testing.assert_close(mf.grad(lambda x: x.sin().sum())(x), x.cos())  # next call works


def test_memory_formats_are_values_under_grad_and_refused_under_vmap_as_in_torch_func():
    """NOTE [Memory formats under vmap] (core/ops.py): under grad and jvp, contiguous() and
    clone() in a channels-last format give torch.func's numbers; under vmap the ordinary
    formats work and the others raise, as torch.func's vmap does (the rows of
    test_torchfunc_errors.py check its wording)."""
    images = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5) / 50

    def f(x):
        y = x.sin().contiguous(memory_format=torch.channels_last)
        return (torch.clone(y, memory_format=torch.channels_last) * x).sum()
    torch.testing.assert_close(mf.grad(f)(images), tf.grad(f)(images))
    torch.testing.assert_close(mf.jvp(f, (images,), (images,)),
                               tf.jvp(f, (images,), (images,)))

    def ordinary(x):
        return (x.contiguous(memory_format=torch.contiguous_format)
                + torch.clone(x, memory_format=torch.preserve_format)
                + x.clone(memory_format=torch.contiguous_format) * x.is_contiguous())
    torch.testing.assert_close(mf.vmap(ordinary)(images), tf.vmap(ordinary)(images))
    with pytest.raises(RuntimeError, match=r"^Tensor\.contiguous\(memory_format=torch\.channels"
                                           r"_last\): NYI: querying is_contiguous"):
        mf.vmap(lambda x: x[None].contiguous(memory_format=torch.channels_last))(images)
    assert mf.vmap(lambda x: x.sin())(images).shape == images.shape  # usable right after


# --- a write into an input that another input aliases ---------------------------------------------
def _writes_its_first_reads_its_second(a, b):
    a.add_(1)
    return a * b


@pytest.mark.parametrize("transform", ["vmap", "jvp", "grad", "vmap of views"])
def test_a_write_into_an_input_that_another_input_aliases_is_refused(transform):
    """NOTE [A write into an input that another input aliases]: the second input was read
    without the write, where torch.func shows it (vmap(f)(x, x) gave 2 where torch.func
    gives 4)."""
    x = torch.ones(2, 3)
    f = _writes_its_first_reads_its_second
    calls = {
        "vmap": lambda: mf.vmap(f)(x, x),
        "jvp": lambda: mf.jvp(f, (x, x), (torch.ones(2, 3), torch.ones(2, 3))),
        "grad": lambda: mf.grad_and_value(lambda a, b: f(a, b).sum(), argnums=1)(x, x),
        "vmap of views": lambda: mf.vmap(f)(x[0, :2].view(2, 1), x[0, 1:3].view(2, 1)),
    }
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"f writes in place into an input of shape .* that shares memory "
                             r"with another input .*Fix: pass a copy"):
        calls[transform]()
    assert x.tolist() == [[1.0] * 3] * 2, "nothing was copied back"
    # copies, and inputs that do not overlap, run as torch.func runs them
    ours, theirs = torch.ones(2, 3), torch.ones(2, 3)
    torch.testing.assert_close(mf.vmap(f)(ours, ours.clone()), tf.vmap(f)(theirs, theirs.clone()))
    torch.testing.assert_close(ours, theirs)
    ours, theirs = torch.ones(4, 1), torch.ones(4, 1)
    torch.testing.assert_close(mf.vmap(f)(ours[:2], ours[2:]), tf.vmap(f)(theirs[:2], theirs[2:]))
    torch.testing.assert_close(ours, theirs)
