"""Random functions under vmap, against torch.func (core/randomness.py, NOTE [Randomness under
vmap]).

Every random function is run by torch.func and by minifunctorch from the same seed, in each
randomness mode, on a batched input (batch dim first or last) and on a tensor that is the same
for every example, with and without chunk_size. Where torch.func returns, the values are
bit-equal and the generator is left in the same state (the same numbers were drawn); where it
raises, ours raises a TransformError that is also the builtin exception torch.func raises, and
whose message starts with torch.func's words.
"""
import warnings

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core import RandomnessError, TransformError

# dropout2d warns about its input's rank; torch.func scripts its decompositions on first use
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")]

B = 3
MODES = ("error", "same", "different")


def _full(*shape, value=0.4):
    return torch.full(shape, value)


def _fill_row(x):
    x[1].uniform_()  # an in-place fill through a view writes into its base
    return x


# (name, f(x) for one example, the shape of one example); "plain" cases ignore x and draw from
# a tensor made inside the function (the same for every example)
CASES = [
    ("rand", lambda x: torch.rand(2, 4), (2, 4)),
    ("rand_size_tuple_dtype", lambda x: torch.rand((2, 4), dtype=torch.float64), (2, 4)),
    ("rand_size_kw", lambda x: torch.rand(size=(2, 4)), (2, 4)),
    ("randn_large", lambda x: torch.randn(2, 40), (2, 4)),
    ("randint_high", lambda x: torch.randint(10, (2, 4)), (2, 4)),
    ("randint_low_high_kw", lambda x: torch.randint(low=3, high=10, size=(2, 4)), (2, 4)),
    ("randperm", lambda x: torch.randperm(5), (2, 4)),
    ("normal_floats_size", lambda x: torch.normal(0.0, 2.0, (2, 4)), (2, 4)),
    ("normal_plain_tensors", lambda x: torch.normal(_full(2, 4), _full(2, 4)), (2, 4)),
    ("normal_plain_mean", lambda x: torch.normal(_full(2, 4), 1.5), (2, 4)),
    ("normal_plain_std", lambda x: torch.normal(1.0, _full(2, 4)), (2, 4)),
    ("normal_batched_tensors", lambda x: torch.normal(x, x), (2, 4)),
    ("normal_batched_mean", lambda x: torch.normal(mean=x, std=1.5), (2, 4)),
    ("normal_batched_std", lambda x: torch.normal(1.0, x), (2, 4)),
    ("normal_batched_and_plain", lambda x: torch.normal(_full(2, 4), x), (2, 4)),
    ("normal_broadcast", lambda x: torch.normal(x, _full(4)), (2, 4)),
    ("rand_like_batched", lambda x: torch.rand_like(x), (2, 4)),
    ("rand_like_plain", lambda x: torch.rand_like(_full(2, 4)), (2, 4)),
    ("randn_like_batched", lambda x: torch.randn_like(x), (2, 20)),
    ("randint_like_batched", lambda x: torch.randint_like(x, 3, 10), (2, 4)),
    ("randint_like_plain", lambda x: torch.randint_like(_full(2, 4), 10), (2, 4)),
    ("bernoulli_batched", lambda x: torch.bernoulli(x), (2, 4)),
    ("bernoulli_plain", lambda x: torch.bernoulli(_full(2, 4)), (2, 4)),
    ("bernoulli_p_batched", lambda x: torch.bernoulli(x, 0.3), (2, 4)),
    ("bernoulli_method_plain", lambda x: _full(2, 4).bernoulli(), (2, 4)),
    ("poisson_batched", lambda x: torch.poisson(x * 5), (2, 4)),
    ("poisson_plain", lambda x: torch.poisson(_full(2, 4) * 5), (2, 4)),
    ("standard_gamma_batched", lambda x: torch._standard_gamma(x), (2, 4)),
    ("sample_dirichlet_plain", lambda x: torch._sample_dirichlet(_full(2, 4)), (2, 4)),
    ("binomial_batched", lambda x: torch.binomial(x * 5, x / 2), (2, 4)),
    ("binomial_plain", lambda x: torch.binomial(_full(2, 4) * 5, _full(2, 4)), (2, 4)),
    ("binomial_plain_count_batched_prob",
     lambda x: torch.binomial(_full(2, 4) * 5, x / 2), (2, 4)),
    ("binomial_plain_count_prob_batched_last",
     lambda x: torch.binomial(_full(4, 2) * 5, x.movedim(0, -1) / 2), (2, 4)),
    ("multinomial_batched_rows", lambda x: torch.multinomial(x, 2), (2, 4)),
    ("multinomial_batched_vector", lambda x: torch.multinomial(x, 3, True), (4,)),
    ("multinomial_plain_rows", lambda x: _full(2, 4).multinomial(2), (2, 4)),
    ("bernoulli__tensor_p_both_batched", lambda x: x.clone().bernoulli_(x), (2, 4)),
    ("bernoulli__tensor_p_plain", lambda x: x.clone().bernoulli_(_full(2, 4)), (2, 4)),
    ("bernoulli__into_plain_from_batched", lambda x: _full(2, 4).bernoulli_(x), (2, 4)),
    ("random__bounds", lambda x: x.clone().random_(3, 10), (2, 4)),
    ("uniform__kw", lambda x: x.clone().uniform_(**{"from": -2, "to": 3}), (2, 4)),
    ("normal__written_into_input", lambda x: x.normal_(2.0, 3.0), (2, 4)),
    ("geometric_", lambda x: x.clone().geometric_(0.3), (2, 4)),
    ("init_kaiming_uniform_plain", lambda x: nn.init.kaiming_uniform_(torch.empty(3, 4)), (2, 4)),
    ("init_normal_plain", lambda x: nn.init.normal_(torch.empty(3, 4), 1.0, 2.0), (2, 4)),
    ("dropout_inplace", lambda x: F.dropout(x.clone(), 0.4, True, inplace=True), (2, 4)),
    ("dropout_eval", lambda x: F.dropout(x, 0.4, training=False), (2, 4)),
    ("nn_Dropout", lambda x: nn.Dropout(0.4)(x), (2, 4)),
    ("nn_AlphaDropout", lambda x: nn.AlphaDropout(0.3)(x), (2, 4)),
    ("nn_Dropout2d", lambda x: nn.Dropout2d(0.4)(x), (2, 3, 4)),
    ("dropout_of_a_plain_tensor", lambda x: x.sum() + F.dropout(torch.ones(5), 0.5), (2, 4)),
    ("randn_out", lambda x: torch.randn(3, out=torch.empty(3)), (2, 4)),
    ("rrelu", lambda x: F.rrelu(x, training=False), (2, 4)),
    ("gumbel_softmax", lambda x: F.gumbel_softmax(x, tau=0.5), (2, 4)),
    ("fill_through_a_view", lambda x: _fill_row(x.clone()), (2, 4)),
    # drawn in torch's own Python code (NOTE [Random draws inside torch's own Python code])
    ("fractional_max_pool3d_window_samples",
     lambda x: F.fractional_max_pool3d(x, 2, output_size=(3, 3, 3)), (1, 5, 5, 5)),
    ("svd_lowrank_sketch", lambda x: torch.svd_lowrank(x, q=2)[1], (6, 5)),
    ("distribution_rsample",
     lambda x: torch.distributions.Normal(x, 1.0, validate_args=False).rsample(), (2, 4)),
]
# the in-place fills, on the batched input and on a tensor made inside the function
for _method, _args in [("random_", ()), ("uniform_", ()), ("normal_", ()), ("exponential_", ()),
                       ("log_normal_", ()), ("cauchy_", ()), ("bernoulli_", ()),
                       ("bernoulli_", (0.3,))]:
    CASES.append((f"{_method}{_args}_batched",
                  lambda x, m=_method, a=_args: getattr(x.clone(), m)(*a), (2, 4)))
    CASES.append((f"{_method}{_args}_plain",
                  lambda x, m=_method, a=_args: getattr(_full(2, 4), m)(*a), (2, 4)))
# the dropout functions, on the batched input and on a tensor made inside the function
for _f, _shape in [(F.dropout, (2, 4)), (F.dropout1d, (2, 4)), (F.dropout2d, (2, 3, 4)),
                   (F.dropout3d, (2, 2, 3, 4)), (F.alpha_dropout, (2, 4)),
                   (F.feature_alpha_dropout, (2, 3, 4))]:
    CASES.append((f"{_f.__name__}_batched",
                  lambda x, f=_f: f(x, 0.4, training=True), _shape))
    CASES.append((f"{_f.__name__}_plain",
                  lambda x, f=_f, s=_shape: f(torch.ones(s), 0.4, training=True), _shape))

def _run(vmap, f, x, in_dims, mode, chunk_size=None, seed=0):
    """(result or exception, the generator's state afterwards)."""
    torch.manual_seed(seed)
    options = {} if chunk_size is None else {"chunk_size": chunk_size}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = vmap(f, in_dims=in_dims, randomness=mode, **options)(x.clone())
    except Exception as error:  # noqa: BLE001 - the error is the result to compare
        return error, None
    return out, torch.get_rng_state()


def _bit_equal(ours, theirs):
    assert type(ours) is torch.Tensor, f"got {type(ours).__name__} instead of a plain tensor"
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (
        f"got {tuple(ours.shape)} {ours.dtype}, torch.func {tuple(theirs.shape)} {theirs.dtype}")
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0)), "the numbers differ"


def assert_same_as_torch_func(theirs, ours):
    (their_out, their_state), (our_out, our_state) = theirs, ours
    if isinstance(their_out, Exception):
        assert isinstance(our_out, Exception), (
            f"torch.func raises {type(their_out).__name__}: {their_out}; ours returned")
        assert isinstance(our_out, TransformError), f"{type(our_out).__name__}: {our_out}"
        assert isinstance(our_out, type(their_out)), (
            f"{type(our_out).__name__} is not a {type(their_out).__name__}")
        # ours: the call, then torch.func's first sentence (NOTE [Messages: ...] in transforms.py)
        first_sentence = str(their_out).split(". ")[0]
        call, _, rest = str(our_out).partition(": ")
        assert call.endswith(")") and rest.startswith(first_sentence), (
            f"torch.func says {str(their_out)!r}; ours says {str(our_out)!r}")
        return
    assert not isinstance(our_out, Exception), (
        f"ours raises {type(our_out).__name__}: {our_out}; torch.func returned")
    _bit_equal(our_out, their_out)
    assert torch.equal(our_state, their_state), "a different amount of randomness was drawn"


def _input(shape, in_dims):
    x = torch.rand(B, *shape, generator=torch.Generator().manual_seed(1)) * 0.8 + 0.1
    return x if in_dims == 0 else x.movedim(0, -1).contiguous()


@pytest.mark.parametrize("in_dims", [0, -1], ids=["batch_first", "batch_last"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, f, shape", CASES, ids=[c[0] for c in CASES])
def test_random_function_matches_torch_func(name, f, shape, mode, in_dims):
    x = _input(shape, in_dims)
    assert_same_as_torch_func(_run(tf.vmap, f, x, in_dims, mode),
                              _run(mf.vmap, f, x, in_dims, mode))


CHUNKED = [c for c in CASES if c[0] in {
    "rand", "randperm", "normal_plain_tensors", "rand_like_batched", "bernoulli_plain",
    "multinomial_plain_rows", "uniform_()_batched", "uniform_()_plain", "dropout_batched",
    "dropout2d_plain", "alpha_dropout_batched", "bernoulli__tensor_p_plain"}]


@pytest.mark.parametrize("chunk_size", [1, 2])
@pytest.mark.parametrize("mode", ["same", "different"])
@pytest.mark.parametrize("name, f, shape", CHUNKED, ids=[c[0] for c in CHUNKED])
def test_chunked_vmap_matches_torch_func(name, f, shape, mode, chunk_size):
    x = _input(shape, 0)
    assert_same_as_torch_func(_run(tf.vmap, f, x, 0, mode, chunk_size),
                              _run(mf.vmap, f, x, 0, mode, chunk_size))


def test_same_randomness_gives_the_same_draw_with_and_without_chunks():
    x = torch.zeros(5, 4)
    f = lambda x: x + torch.rand(4) + F.dropout(torch.ones(4), 0.5)  # noqa: E731
    whole, _ = _run(mf.vmap, f, x, 0, "same")
    for chunk_size in (1, 2, 3):
        chunked, _ = _run(mf.vmap, f, x, 0, "same", chunk_size)
        _bit_equal(chunked, whole)


# --- nested vmaps --------------------------------------------------------------------------------
NESTED = {
    "rand": lambda x, y: torch.rand(5, 4),
    "randn_like_inner_batched": lambda x, y: torch.randn_like(x),
    "rand_like_outer_batched": lambda x, y: torch.rand_like(y),
    "bernoulli_inner_batched": lambda x, y: torch.bernoulli(x),
    "bernoulli_outer_batched": lambda x, y: torch.bernoulli(y),
    "normal_both": lambda x, y: torch.normal(x, y),
    "uniform__inner_batched": lambda x, y: x.clone().uniform_(),
    "uniform__outer_batched": lambda x, y: y.clone().uniform_(),
    "bernoulli__p_outer_batched": lambda x, y: x.clone().bernoulli_(y),
    "dropout_outer_batched": lambda x, y: F.dropout(y, 0.3),
    "feature_dropout_inner_batched": lambda x, y: F.dropout2d(x.unsqueeze(-1), 0.3),
    "randperm": lambda x, y: torch.randperm(6),
    "multinomial_inner_batched": lambda x, y: torch.multinomial(x, 2),
}


def _run_nested(vmap, f, inner_mode, outer_mode, chunk_size):
    x = torch.rand(2, 3, 5, 4, generator=torch.Generator().manual_seed(2)) * 0.8 + 0.1
    y = torch.rand(2, 5, 4, generator=torch.Generator().manual_seed(3)) * 0.8 + 0.1
    inner = vmap(f, in_dims=(0, None), randomness=inner_mode)
    options = {} if chunk_size is None else {"chunk_size": chunk_size}
    outer = vmap(lambda x, y: inner(x, y), randomness=outer_mode, **options)
    torch.manual_seed(0)
    try:
        out = outer(x, y)
    except Exception as error:  # noqa: BLE001
        return error, None
    return out, torch.get_rng_state()


@pytest.mark.parametrize("outer_mode", MODES)
@pytest.mark.parametrize("inner_mode", MODES)
@pytest.mark.parametrize("name", list(NESTED))
def test_nested_vmaps_match_torch_func(name, inner_mode, outer_mode):
    f = NESTED[name]
    assert_same_as_torch_func(_run_nested(tf.vmap, f, inner_mode, outer_mode, None),
                              _run_nested(mf.vmap, f, inner_mode, outer_mode, None))


@pytest.mark.parametrize("outer_mode", ["same", "different"])
@pytest.mark.parametrize("name", ["rand", "randn_like_inner_batched", "uniform__inner_batched"])
def test_nested_chunked_vmaps_match_torch_func(name, outer_mode):
    f = NESTED[name]
    assert_same_as_torch_func(_run_nested(tf.vmap, f, "different", outer_mode, 1),
                              _run_nested(mf.vmap, f, "different", outer_mode, 1))


# --- with the other transforms: random numbers are constants for grad and jvp --------------------
x5 = torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) + 0.1
COMPOSED = {
    "vmap(grad(dropout))": lambda api, mode: api.vmap(
        api.grad(lambda x: (F.dropout(x, 0.3) * x.sin()).sum()), randomness=mode)(x5),
    "vmap(grad(bernoulli))": lambda api, mode: api.vmap(
        api.grad(lambda x: (torch.bernoulli(torch.sigmoid(x)) * x ** 2).sum()),
        randomness=mode)(x5),
    "grad(vmap(dropout))": lambda api, mode: api.grad(lambda x: api.vmap(
        lambda r: F.dropout(r, 0.3) * r, randomness=mode)(x).sum())(x5),
    "vmap(jvp(rand_like))": lambda api, mode: api.vmap(lambda r: api.jvp(
        lambda r: torch.rand_like(r) * r, (r,), (torch.ones_like(r),))[1], randomness=mode)(x5),
    "vmap(vjp(uniform_))": lambda api, mode: api.vmap(lambda r: api.vjp(
        lambda r: r * r.clone().uniform_(), r)[1](torch.ones_like(r))[0], randomness=mode)(x5),
    "jacfwd(dropout)": lambda api, mode: api.jacfwd(
        lambda r: F.dropout(r, 0.3) * r, randomness=mode)(x5[0]),
    "jacfwd(bernoulli)": lambda api, mode: api.jacfwd(
        lambda r: torch.bernoulli(r / 2) * r, randomness=mode)(x5[0]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(COMPOSED))
def test_with_other_transforms_matches_torch_func(name, mode):
    def run(api):
        torch.manual_seed(0)
        try:
            return COMPOSED[name](api, mode), torch.get_rng_state()
        except Exception as error:  # noqa: BLE001
            return error, None
    assert_same_as_torch_func(run(tf), run(mf))


# --- errors --------------------------------------------------------------------------------------
def test_error_mode_names_the_call_the_function_and_the_fix():
    with pytest.raises(RandomnessError) as info:
        mf.vmap(lambda x: x + torch.rand(3))(torch.zeros(2, 3))
    message = str(info.value)
    assert message.startswith("vmap(<lambda>)(<inputs>): vmap: called random operation while in "
                              "randomness error mode.")
    assert "torch.rand draws random numbers" in message
    assert "Fix: pass randomness='different'" in message
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, TransformError)


def test_same_mode_refuses_a_batched_probability_with_a_fix():
    with pytest.raises(RandomnessError, match=r"^vmap\(<lambda>\)\(<inputs>\): Vmap does not "
                       r"currently support same randomness with a batched tensor input\. "
                       r"torch\.bernoulli got a tensor that varies over the batch.*Fix: "):
        mf.vmap(lambda p: torch.bernoulli(p), randomness="same")(torch.rand(2, 3))


def test_different_mode_refuses_filling_an_unbatched_tensor_with_a_fix():
    with pytest.raises(RandomnessError, match=r"^vmap\(<lambda>\)\(<inputs>\): vmap: Cannot ask "
                       r"for different inplace randomness on an unbatched tensor\..*"
                       r"torch\.Tensor\.uniform_ fills.*"
                       r"Fix: "):
        mf.vmap(lambda x: x + torch.zeros(3).uniform_(), randomness="different")(torch.zeros(2, 3))


def test_state_is_clean_after_an_error():
    plain = torch.zeros(3)
    with pytest.raises(RandomnessError):
        mf.vmap(lambda x: x + plain.uniform_(), randomness="different")(torch.zeros(2, 3))
    assert torch.equal(plain, torch.zeros(3)), "a refused fill must not write"
    drawn = torch.rand(2)
    assert type(drawn) is torch.Tensor, "no transform mode is left behind"
    torch.manual_seed(0)
    again = mf.vmap(lambda x: x + torch.rand(3), randomness="different")(torch.zeros(2, 3))
    torch.manual_seed(0)
    assert torch.equal(again, torch.rand(2, 3))


def test_same_mode_fills_a_tensor_from_outside_in_place_like_torch_func():
    outside = {}
    for api in (tf, mf):
        target = torch.zeros(4)
        torch.manual_seed(0)
        api.vmap(lambda x: x + target.uniform_(), randomness="same")(torch.zeros(3, 4))
        outside[api] = target
    _bit_equal(outside[mf], outside[tf])


def test_random_functions_cost_nothing_outside_vmap():
    """Without a vmap level the table hands the call back untouched (grad's constants)."""
    from minifunctorch.core import randomness
    assert randomness.draw(torch.rand, (3,), {}) is NotImplemented
    torch.manual_seed(0)
    ours = mf.grad(lambda x: (F.dropout(x, 0.5) * x).sum())(x5[0])
    torch.manual_seed(0)
    _bit_equal(ours, tf.grad(lambda x: (F.dropout(x, 0.5) * x).sum())(x5[0]))


@pytest.mark.parametrize("name", ["dropout", "feature_dropout", "alpha_dropout",
                                  "feature_alpha_dropout", "dropout_"])
def test_dropout_that_draws_nothing_returns_its_input_as_torch_does(name):
    """In eval mode (train=False), or with p=0, torch's dropouts return the input tensor itself
    and draw no numbers; inside vmap(grad) the engine hands back the same FuncTensor, costing no
    op at any level, in every randomness mode ('error' too: nothing is drawn)."""
    func = getattr(torch, name)
    x = torch.randn(3, 2, 4)
    for api in (tf, mf):
        seen = []

        def f(v):
            for p, train in ((0.3, False), (0.0, True)):
                seen.append(func(v, p, train) is v)
            return (func(v, 0.3, False) * v).sum()
        ours = api.vmap(api.grad(f))(x)
        torch.testing.assert_close(ours, 2 * x)
        assert seen == [True, True], (api.__name__, seen)
        # a probability out of [0, 1] is refused in eval mode too, as torch does
        with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1"):
            api.vmap(lambda v: func(v, 1.5, False))(x)


# --- the back door: aten's random ops called on batched values -----------------------------------
aten = torch.ops.aten
with torch.random.fork_rng():
    torch.manual_seed(0)
    _ATTENTION = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)
ATEN_CASES = [
    ("bernoulli", lambda x: aten.bernoulli(x), (2, 4)),
    ("bernoulli.p", lambda x: aten.bernoulli.p(x, 0.3), (2, 4)),
    ("poisson", lambda x: aten.poisson(x * 4), (2, 4)),
    ("normal.Tensor_float", lambda x: aten.normal.Tensor_float(x, 2.0), (2, 4)),
    ("normal.float_Tensor", lambda x: aten.normal.float_Tensor(1.0, x), (2, 4)),
    ("normal.Tensor_Tensor", lambda x: aten.normal.Tensor_Tensor(x, x), (2, 4)),
    ("binomial", lambda x: aten.binomial(x * 5, x), (2, 4)),
    ("multinomial", lambda x: aten.multinomial(x, 2), (2, 4)),
    ("rand_like", lambda x: aten.rand_like(x), (2, 4)),
    ("randint_like", lambda x: aten.randint_like(x, 10), (2, 4)),
    # in-place fills at the back door: how torch's C++ draws dropout masks
    ("bernoulli_.float", lambda x: aten.bernoulli_.float(aten.empty_like(x), 0.3) * x, (2, 4)),
    ("uniform_", lambda x: aten.uniform_(aten.clone(x), -1.0, 1.0), (2, 4)),
    ("native_dropout", lambda x: aten.native_dropout(x, 0.3, True)[0], (2, 4)),
    ("scaled_dot_product_attention_dropout",
     lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.5), (3, 4)),
    ("multi_head_attention_dropout",
     lambda x: _ATTENTION(x, x, x, need_weights=False)[0], (3, 4)),
]


@pytest.mark.parametrize("in_dims", [0, -1], ids=["batch_first", "batch_last"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, f, shape", ATEN_CASES, ids=[c[0] for c in ATEN_CASES])
def test_aten_random_op_on_a_batched_value_matches_torch_func(name, f, shape, mode, in_dims):
    x = _input(shape, in_dims)
    assert_same_as_torch_func(_run(tf.vmap, f, x, in_dims, mode),
                              _run(mf.vmap, f, x, in_dims, mode))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap_grad"])
def test_native_dropout_draws_torchs_mask_under_other_transforms(transform, train):
    """torch's CPU kernel draws with bernoulli_ (torch._decomp's version would compare
    rand_like with p, and give other numbers than torch.func)."""
    def f(x):
        out, mask = aten.native_dropout(x, 0.3, train)
        assert mask.dtype == torch.bool
        return (out * x).sum()
    x = _input((2, 4), 0)
    results = []
    for api in (tf, mf):
        torch.manual_seed(0)
        if transform == "grad":
            results.append(api.grad(f)(x[0]))
        elif transform == "jvp":
            results.append(api.jvp(f, (x[0],), (x[1],))[1])
        else:
            results.append(api.vmap(api.grad(f), randomness="different")(x))
    _bit_equal(results[1], results[0])
