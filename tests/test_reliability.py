"""Edge cases that an adversarial battery found (issue 17), each a reproducer checked against
torch.func: what torch.func returns, we return; what it refuses, we refuse."""

import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf

X = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)


def same(ours, theirs):
    assert type(ours) is torch.Tensor, f"expected a plain tensor, got {type(ours).__name__}"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, equal_nan=True)


# --- an empty dim list reduces over every dim, as in torch -----------------------------------
@pytest.mark.parametrize("reduce", [
    lambda a: a.mean(dim=()), lambda a: a.sum(dim=[]), lambda a: a.amax(dim=[]),
    lambda a: a.amin(dim=()), lambda a: torch.sum(a, dim=(), keepdim=True).sum(),
    lambda a: torch.mean(a, [], True).sum(),
], ids=["mean()", "sum[]", "amax[]", "amin()", "sum()keepdim", "mean[]keepdim"])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_an_empty_dim_list_reduces_every_dim(reduce, transform):
    if transform == "grad":
        ours, theirs = mf.grad(reduce)(X), tf.grad(reduce)(X)
    elif transform == "vmap":
        ours, theirs = mf.vmap(reduce)(X), tf.vmap(reduce)(X)
    else:
        tangent = torch.ones_like(X)
        ours, theirs = mf.jvp(reduce, (X,), (tangent,))[1], tf.jvp(reduce, (X,), (tangent,))[1]
    same(ours, theirs)


# --- an empty batch ------------------------------------------------------------------------
EMPTY_BATCH = [("max", lambda a: a.max(), torch.float32), ("max", lambda a: a.max(), torch.int64),
               ("sum", lambda a: a.sum(), torch.float32), ("sum", lambda a: a.sum(), torch.int64),
               ("mean", lambda a: a.mean(), torch.float32),
               ("amin", lambda a: a.amin(), torch.int64), ("sin", lambda a: a.sin(), torch.float32)]


@pytest.mark.parametrize("name, f, dtype", EMPTY_BATCH, ids=[f"{n}-{d}" for n, _, d in EMPTY_BATCH])
def test_a_reduction_over_an_empty_batch(name, f, dtype):
    xs = torch.empty(0, dtype=dtype)
    same(mf.vmap(f)(xs), tf.vmap(f)(xs))


# --- jit's cache is bounded (least recently used out) ---------------------------------------
def test_jit_keeps_the_most_recently_used_signatures_only():
    traces = []

    def f(x):
        traces.append(tuple(x.shape))
        return (x.sin() ** 2).sum()

    g = mf.jit(mf.grad(f), max_signatures=4)
    for n in range(1, 7):  # six shapes: the first two are dropped
        torch.testing.assert_close(g(torch.ones(n)), tf.grad(f)(torch.ones(n)))
    assert g.cache_size() == 4
    traced = len(traces)
    g(torch.ones(6))  # cached, most recent: no trace
    g(torch.ones(3))  # cached (least recent of the four), becomes most recent
    assert len(traces) == traced
    g(torch.ones(1))  # dropped earlier: traced again, and drops shape 4, now the least recent
    assert len(traces) == traced + 1 and g.cache_size() == 4
    g(torch.ones(3))
    assert len(traces) == traced + 1
    g(torch.ones(4))
    assert len(traces) == traced + 2


def test_jit_over_many_shapes_keeps_memory_bounded():
    import gc
    import tracemalloc

    f = lambda x: torch.tanh(x @ x.T).sum()  # noqa: E731
    g = mf.jit(mf.grad(f), max_signatures=8)
    for n in range(1, 41):  # warm: the cache is full, torch's own caches are made
        g(torch.ones(n, 3))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(41, 201):
            g(torch.ones(n, 3))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert g.cache_size() == 8
    # unbounded, the 160 programs held about 1.5 MB here; bounded, about 0.2 MB
    assert grown < 600_000, grown


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_jit_max_signatures_must_be_a_positive_int(bad):
    with pytest.raises(mf.TransformError, match="max_signatures"):
        mf.jit(lambda x: x, max_signatures=bad)


# --- custom rules do not outlive their definition ---------------------------------------------
def test_redefining_a_custom_vjp_does_not_grow_the_rule_tables():
    import gc

    def define():  # what a notebook cell that defines a custom_vjp does on each run
        @mf.custom_vjp
        def clip_gradient(x):
            return x

        clip_gradient.defvjp(lambda x: (x, ()), lambda saved, ct: (ct.clamp(-1, 1),))
        return clip_gradient

    x = torch.linspace(-3, 3, 5)
    clip_gradient = define()
    torch.testing.assert_close(mf.grad(lambda x: (clip_gradient(x) * 4).sum())(x),
                               torch.ones(5))
    torch.testing.assert_close(mf.vmap(mf.grad(lambda x: clip_gradient(x) * 4))(x),
                               torch.ones(5))
    gc.collect()
    sizes = (len(mf.vjp_rules), len(mf.jvp_rules), len(mf.batching_rules))
    for _ in range(10):
        clip_gradient = define()
        torch.testing.assert_close(mf.vmap(mf.grad(lambda x: clip_gradient(x) * 4))(x),
                                   torch.ones(5))
    gc.collect()
    assert (len(mf.vjp_rules), len(mf.jvp_rules), len(mf.batching_rules)) == sizes


# --- threads: each has its own stack of levels ------------------------------------------------
def _in_threads(work, count=4):
    import sys
    import threading

    errors = []

    def run(k):
        try:
            work(k)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, inside transforms
    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_transforms_in_concurrent_threads():
    x = torch.randn(4, 3, dtype=torch.float64)

    def f(k):
        return lambda a: ((a * (k + 1)).sin() ** 2).sum()

    # torch.func's answers, computed before (its forward AD levels are not per-thread)
    expected = [(tf.vmap(tf.grad(f(k)))(x), tf.jacrev(torch.sin)(x[k]),
                 tf.jvp(f(k), (x,), (x,))) for k in range(4)]

    def work(k):
        for _ in range(60):
            per_sample, jacobian, (out, out_dot) = expected[k]
            torch.testing.assert_close(mf.vmap(mf.grad(f(k)))(x), per_sample)
            torch.testing.assert_close(mf.jacrev(torch.sin)(x[k]), jacobian)
            torch.testing.assert_close(mf.jvp(f(k), (x,), (x,)), (out, out_dot))

    _in_threads(work)
    assert not mf.dispatch.transform_levels()



def test_threads_that_register_pytree_classes_while_others_flatten():
    # NOTE [Pytrees are torch's]: each thread registers its own class with torch while the
    # others run transforms, so the engine mirrors torch's registry from several threads
    import dataclasses

    registered = []

    def work(k):
        @dataclasses.dataclass
        class State:
            value: torch.Tensor

        torch.utils._pytree.register_dataclass(
            State, serialized_type_name=f"test_reliability.State{k}")
        registered.append(State)
        for _ in range(30):
            grads = mf.grad(lambda s: (s.value * (k + 1)).sin().sum())(State(torch.ones(3)))
            assert type(grads) is State
            torch.testing.assert_close(grads.value, (k + 1) * torch.ones(3).mul(k + 1).cos())

    try:
        _in_threads(work, count=6)
    finally:
        for cls in registered:
            torch.utils._pytree._deregister_pytree_node(cls)

def test_random_calls_in_one_thread_while_another_runs_vmap():
    x = torch.randn(4, 3)

    def work(k):
        for _ in range(200):
            if k % 2:
                mf.vmap(torch.sin, randomness="error")(x)
            else:
                assert torch.rand(3).shape == (3,)  # not inside any vmap of this thread

    _in_threads(work)


# --- an input written in place and returned is the caller's tensor, as in torch.func ----------
@pytest.mark.parametrize("in_dim, out_dim", [(0, 0), (1, 1), (1, 0), (0, -1)])
def test_an_input_written_in_place_and_returned_is_the_callers_tensor(in_dim, out_dim):
    results = []
    for api in (mf, tf):
        x = torch.linspace(0, 1, 24).reshape(3, 4, 2)
        y = api.vmap(torch.Tensor.sin_, in_dims=in_dim, out_dims=out_dim)(x)
        # the result aliases x ...
        assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        x.add_(1)  # ... so a later write to x shows in it
        results.append(y)
    torch.testing.assert_close(results[0], results[1])
    nested = mf.vmap(mf.vmap(torch.Tensor.cos_))
    x = torch.rand(3, 4, 2)
    assert nested(x) is x


@pytest.mark.parametrize("inner_in, outer_in, outer_out", [(1, 2, 2), (0, 1, 0), (2, 0, 1)])
def test_nested_vmaps_of_an_in_place_op_return_a_view_of_the_callers_tensor(
        inner_in, outer_in, outer_out):
    # the inner vmap returns its input with the batch dim moved (a view of it), and the outer
    # one returns the same view of the caller's tensor (PyTorch's test_unary_pointwise)
    results = []
    for api in (mf, tf):
        x = torch.linspace(0, 1, 120).reshape(2, 3, 4, 5)
        f = api.vmap(api.vmap(torch.Tensor.cos_, in_dims=inner_in), in_dims=outer_in,
                     out_dims=outer_out)
        y = f(x)
        assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        x.mul_(2)  # a later write to x shows in y
        results.append((y.clone(), y.shape, y.stride()))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert results[0][1:] == results[1][1:]


# --- pow at base 0 and with a number base --------------------------------------------------------
ZEROS, ONES = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
POW_CASES = [
    ("zeros**b", lambda b: (ZEROS ** b).sum(), ONES),
    ("x**x at 0", lambda b: (b ** b).sum(), ZEROS),
    ("x**0 at 0", lambda b: (b ** 0).sum(), ZEROS),
    ("0.0**y", lambda y: (0.0 ** y).sum(), ONES),
    ("0.0**y at 0", lambda y: (0.0 ** y).sum(), ZEROS),
    ("(-2.0)**y", lambda y: ((-2.0) ** y).sum(), ONES),
    ("2.0**y", lambda y: (2.0 ** y).sum(), ONES),
    ("x**y mixed", lambda b: (torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64) ** (b - 1)).sum(),
     torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)),
]


@pytest.mark.parametrize("name, f, at", POW_CASES, ids=[c[0] for c in POW_CASES])
def test_pow_derivatives_at_zero_as_torch_func(name, f, at):
    same(mf.grad(f)(at), tf.grad(f)(at))
    tangent = torch.ones_like(at)
    same(mf.jvp(f, (at,), (tangent,))[1], tf.jvp(f, (at,), (tangent,))[1])
    batch = torch.stack([at, at + 1])
    same(mf.vmap(mf.grad(f))(batch), tf.vmap(tf.grad(f))(batch))


# --- mixed float32 / float64: a gradient has its input's dtype ------------------------------------
F32 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float32)
C64 = torch.tensor(1.5, dtype=torch.float64)
F64_ONES = torch.ones(3, dtype=torch.float64)
MIXED = [
    ("argnums over f32 and a 0-d f64",
     lambda api: api.grad(lambda a, c: (a * c).sum(), argnums=(0, 1))(F32, C64)),
    ("f32 plus a captured f64", lambda api: api.grad(lambda a: (a + F64_ONES).sum())(F32)),
    ("vmap of f32 times a 0-d f64 example",
     lambda api: api.vmap(lambda c: F32 * c)(torch.arange(4.0, dtype=torch.float64))),
    ("jacrev with respect to a 0-d f64",
     lambda api: api.jacrev(lambda a, c: a * c, argnums=1)(F32, C64)),
    ("jacfwd with respect to a 0-d f64",
     lambda api: api.jacfwd(lambda a, c: a * c, argnums=1)(F32, C64)),
    ("vjp of f32 through an f64 op",
     lambda api: api.vjp(lambda a: a.double().sin(), F32)[1](F64_ONES)),
]


@pytest.mark.parametrize("name, run", MIXED, ids=[m[0] for m in MIXED])
def test_mixed_precision_results_have_torch_funcs_dtypes(name, run):
    ours, theirs = run(mf), run(tf)
    ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    for o, t in zip(ours, theirs):
        same(o, t)


# --- a user's label that looks like an engine name ----------------------------------------------
@pytest.mark.parametrize("name", ["v0", "v2", "v5", "c1"])
def test_a_label_that_looks_like_an_engine_name_changes_no_gradient(name):
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    f = lambda a: (a.sin() * a.cos()).exp().sum()  # noqa: E731
    labelled = mf.label(x.view_as(x), name)
    same(mf.grad(f)(labelled), tf.grad(f)(x))
    same(mf.vmap(mf.grad(lambda a: f(a * labelled)))(torch.ones(3, 4, dtype=torch.float64)),
         tf.vmap(tf.grad(lambda a: f(a * x)))(torch.ones(3, 4, dtype=torch.float64)))


# --- the remaining reproducers of the issue, each against torch.func -----------------------------
XV = torch.linspace(-1, 1, 4, dtype=torch.float64)
TARGET = torch.tensor([0, 2, 1, 2])
REPRODUCERS = [
    ("softmax of 0-d examples", lambda api: api.vmap(lambda a: a.softmax(0))(torch.ones(4))),
    ("log_softmax of 0-d examples",
     lambda api: api.vmap(lambda a: a.log_softmax(0))(torch.ones(4))),
    ("iterating a tensor", lambda api: api.grad(lambda a: sum(r.sum() for r in a))(X)),
    ("list of a tensor", lambda api: api.grad(lambda a: list(a)[1].sin().sum())(X)),
    ("x.to(other tensor)",
     lambda api: api.vmap(lambda a: a.to(torch.ones(1, dtype=torch.float32)))(X)),
    ("cross_entropy with ignore_index", lambda api: api.grad(
        lambda a: torch.nn.functional.cross_entropy(a, TARGET, ignore_index=2))(X)),
    ("nll_loss with the default ignore_index", lambda api: api.grad(
        lambda a: torch.nn.functional.nll_loss(a, torch.tensor([0, -100, 1, 2])))(X)),
    ("relu at NaN", lambda api: api.grad(lambda a: torch.relu(a).sum())(
        torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float64))),
    ("grad of an integer input", lambda api: api.grad(lambda a: (a * 2).sum())(torch.arange(3))),
    ("vmap of a function that returns None", lambda api: api.vmap(lambda a: None)(X)),
]


@pytest.mark.parametrize("name, run", REPRODUCERS, ids=[r[0] for r in REPRODUCERS])
def test_reproducer_as_torch_func(name, run):
    try:
        theirs = run(tf)
    except Exception as error:  # noqa: BLE001 - torch.func refuses: so must we
        with pytest.raises(type(error)) as ours:
            run(mf)
        assert isinstance(ours.value, mf.TransformError)
        return
    same(run(mf), theirs)


# --- values that escape a transform ----------------------------------------------------------------
def test_a_value_that_escapes_grad_is_its_plain_value_afterwards():
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    results = []
    for api in (mf, tf):
        kept = []
        api.grad(lambda a: (kept.append(a), a.sin().sum())[1])(x)
        torch.testing.assert_close(kept[0] * 2, x * 2)
        results.append(api.grad(lambda y: (kept[0] * y).sum())(x))  # a constant: x
    same(results[0], results[1])
    torch.testing.assert_close(results[0], x)


def test_a_value_that_escapes_vmap_is_refused_afterwards():
    kept = []
    mf.vmap(lambda a: (kept.append(a), a.sin())[1])(torch.ones(2, 3))
    # torch.func's words first (what people search for), after the call
    with pytest.raises(RuntimeError, match=r"^vmap\(<lambda>\)\(<inputs>\): your tensor may "
                                           r"have escaped from inside a function being vmapped"
                       ) as info:
        kept[0] * 2
    assert isinstance(info.value, mf.TransformError)
    assert mf.vmap(torch.sin)(torch.zeros(2)).tolist() == [0.0, 0.0]  # the next call works


@pytest.mark.parametrize("inner", ["grad", "jvp"])
def test_a_write_by_an_inner_transform_into_an_outer_tensor_it_closes_over(inner):
    """The inner function writes its own value into ``b``, a tensor of the enclosing vmap:
    after the inner transform returns, ``b`` holds what that value wraps (as an escaped
    value does), and vmap copies it into the caller's tensor, as a loop in eager torch
    does. (torch.func refuses the write; the write-back used to fail with vmap's "escaped"
    message.)"""
    def per_example(x, b):
        def f(w):
            b.copy_(w * 3)
            return (w * 2).sum()
        if inner == "grad":
            derivative = mf.grad(f)(x)
        else:
            derivative = mf.jvp(f, (x,), (torch.ones_like(x),))[1]
        return derivative + b
    x = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    ours = torch.zeros(2, 3, dtype=torch.float64)
    result = mf.vmap(per_example)(x, ours)
    loop = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(2):  # eager torch: the same function, one example at a time
        loop[i].copy_(x[i] * 3)
    torch.testing.assert_close(ours, loop)
    torch.testing.assert_close(result, (2.0 if inner == "grad" else 6.0) + loop)


def test_anomaly_detection_without_the_nan_check_lets_nan_gradients_through():
    # torch's tracers (AOTAutograd under torch.compile) enter detect_anomaly(check_nan=False):
    # the NaN check (NOTE [Anomaly detection]) stays off there, as in torch
    x = torch.zeros(3) - 1
    with torch.autograd.detect_anomaly(check_nan=False):
        ours = mf.vmap(mf.grad(lambda a: a.sqrt().sum()))(x)
        theirs = tf.vmap(tf.grad(lambda a: a.sqrt().sum()))(x)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
