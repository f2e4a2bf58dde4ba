"""Module utilities against torch.func and functorch: functional_call (a dict or a tuple of
dicts, args and kwargs, tie_weights, strict, buffers, restoring the module, errors),
stack_module_state and ensembles under vmap, replace_all_batch_norm_modules_, and the
functorch-era make_functional / make_functional_with_buffers / combine_state_for_ensemble
(minifunctorch.core.compat) against torch._functorch.make_functional.

Each program is written once, against a namespace ``ft`` that is torch.func or minifunctorch,
and run on both.
"""
import copy
import types
import warnings

import pytest
import torch
import torch._functorch.make_functional as functorch_mf
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core import compat
from minifunctorch.core.errors import TransformError

# torch.func scripts its decompositions on first use (torch deprecates torch.jit.script)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64
# torch.func's side of each program: the transforms, and functorch's compatibility API
TORCH = types.SimpleNamespace(
    **{name: getattr(tf, name) for name in (
        "grad", "vjp", "jvp", "vmap", "jacrev", "jacfwd", "hessian", "functional_call",
        "stack_module_state", "replace_all_batch_norm_modules_")},
    make_functional=functorch_mf.make_functional,
    make_functional_with_buffers=functorch_mf.make_functional_with_buffers,
    combine_state_for_ensemble=functorch_mf.combine_state_for_ensemble)
OURS = types.SimpleNamespace(
    **{name: getattr(mf, name) for name in (
        "grad", "vjp", "jvp", "vmap", "jacrev", "jacfwd", "hessian", "functional_call",
        "stack_module_state", "replace_all_batch_norm_modules_")},
    make_functional=compat.make_functional,
    make_functional_with_buffers=compat.make_functional_with_buffers,
    combine_state_for_ensemble=compat.combine_state_for_ensemble)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def assert_same(ours, theirs):
    """Same structure, same values; and ours are plain tensors (nothing leaked out)."""
    ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
    theirs_leaves, theirs_spec = torch.utils._pytree.tree_flatten(theirs)
    assert ours_spec == theirs_spec, f"structure {ours_spec} != {theirs_spec}"
    for leaf in ours_leaves:
        if isinstance(leaf, torch.Tensor):
            assert type(leaf) in (torch.Tensor, nn.Parameter), f"got {type(leaf).__name__}"
    torch.testing.assert_close(ours_leaves, theirs_leaves, rtol=1e-7, atol=1e-9)


def both(program):
    """Run ``program(ns)`` on minifunctorch and on torch.func, and compare."""
    ours, theirs = program(OURS), program(TORCH)
    assert_same(ours, theirs)
    return ours


# --- modules -----------------------------------------------------------------------------------
def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)


class TiedLM(nn.Module):
    """A decoder weight shared with the embedding (the usual tied weights), plus a tied buffer."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(6, 3).to(DTYPE)
        self.decode = nn.Linear(3, 6).to(DTYPE)
        self.decode.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(6, dtype=DTYPE))
        self.register_buffer("shift_tied", self.shift)

    def forward(self, tokens, *, temperature=1.0):
        logits = self.decode(torch.tanh(self.embed(tokens))) / temperature
        return logits + self.shift + 2 * self.shift_tied


class Scaled(nn.Module):
    """forward with a keyword argument and two positional ones."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(randn(3, 3, seed=4))

    def forward(self, x, y, *, scale=1.0):
        return scale * (x @ self.weight + y)


def bn_net(seed=0, track=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=track),
                         nn.ReLU(), nn.Linear(4, 2)).to(DTYPE)


def params_of(model, detach=True):
    return {k: (v.detach() if detach else v) for k, v in model.named_parameters()}


def buffers_of(model):
    return {k: v.clone() for k, v in model.named_buffers()}


TOKENS = torch.tensor([0, 3, 5, 1])


# --- functional_call: plain calls ---------------------------------------------------------------
@pytest.mark.parametrize("form", ["dict", "tuple", "list", "one-dict tuple"])
def test_functional_call_dict_forms(form):
    model = bn_net().eval()
    params = {k: v * 1.5 for k, v in params_of(model).items()}
    buffers = {k: v + 0.25 if v.is_floating_point() else v for k, v in buffers_of(model).items()}
    given = {"dict": {**params, **buffers}, "tuple": (params, buffers), "list": [params, buffers],
             "one-dict tuple": ({**params, **buffers},)}[form]
    x = randn(5, 3)
    both(lambda ft: ft.functional_call(model, given, (x,)))
    with torch.no_grad():  # and by hand: the model with those tensors loaded
        loaded = copy.deepcopy(model)
        loaded.load_state_dict({**params, **buffers})
        torch.testing.assert_close(mf.functional_call(model, given, x), loaded(x))


def test_functional_call_args_and_kwargs():
    model = Scaled()
    p = {"weight": randn(3, 3, seed=1)}
    x, y = randn(2, 3, seed=2), randn(2, 3, seed=3)
    both(lambda ft: ft.functional_call(model, p, (x, y), {"scale": 3.0}))
    both(lambda ft: ft.functional_call(model, p, (x,), {"y": y}))
    single = mlp()  # one argument that is not a tuple is the only positional argument
    both(lambda ft: ft.functional_call(single, params_of(single), randn(4, 3)))
    lm = TiedLM()
    both(lambda ft: ft.functional_call(lm, params_of(lm), TOKENS, {"temperature": 0.5}))


def test_functional_call_restores_the_module_and_keeps_autograd():
    model = mlp()
    before = {k: v for k, v in model.named_parameters()}
    values = {k: v.detach().clone() for k, v in before.items()}
    x = randn(4, 3)
    out = mf.functional_call(model, {k: v * 2 for k, v in values.items()}, x)
    assert out.grad_fn is None  # detached tensors given: nothing to record
    assert all(model.get_parameter(k) is v for k, v in before.items()), "not restored"
    assert all(torch.equal(v.detach(), values[k]) for k, v in model.named_parameters())
    # the model's own (non-detached) parameters: ordinary autograd records, as in torch.func
    out = mf.functional_call(model, dict(model.named_parameters()), x)
    assert out.grad_fn is not None
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_functional_call_restores_after_an_error_and_works_again():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, dtype=DTYPE))

        def forward(self, x):
            if x.sum() > 0:
                raise KeyError("boom")
            return x * self.weight

    model = Fails()
    original = model.weight
    with pytest.raises(KeyError):
        mf.grad(lambda w: mf.functional_call(model, {"weight": w}, torch.ones(2)).sum())(
            torch.ones(2, dtype=DTYPE))
    assert model.weight is original
    got = mf.grad(lambda w: mf.functional_call(model, {"weight": w}, -torch.ones(2)).sum())(
        torch.full((2,), 3.0, dtype=DTYPE))
    torch.testing.assert_close(got, -torch.ones(2, dtype=DTYPE))


def test_functional_call_writes_replaced_buffers_back_into_the_dict():
    """torch.func's note: a module that reassigns a buffer leaves the new one in the dict."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros((), dtype=DTYPE))

        def forward(self, x):
            self.count = self.count + 1
            return x * self.count

    def program(ft):
        module, state = Counter(), {"count": torch.full((), 5.0, dtype=DTYPE)}
        out = ft.functional_call(module, state, torch.ones(()))
        return out, state["count"], module.count
    both(program)


def test_functional_call_unexpected_key_without_strict_is_set_for_the_call():
    """strict=False (the default): a key the module lacks becomes a plain attribute for the
    call, then is removed; torch.func does the same."""
    class UsesExtra(nn.Module):
        def forward(self, x):
            return x * getattr(self, "extra", torch.ones(()))

    def program(ft):
        module = UsesExtra()
        out = ft.functional_call(module, {"extra": torch.full((), 3.0)}, torch.ones(2))
        return out, torch.tensor(hasattr(module, "extra"))
    both(program)


# --- functional_call under transforms ---------------------------------------------------------
def test_functional_call_under_grad_vjp_jvp_jacrev():
    model = mlp()
    p = params_of(model)
    x = randn(5, 3, seed=1)
    tangent = {k: randn(*v.shape, seed=i + 10) for i, (k, v) in enumerate(p.items())}

    def loss(ft):
        return lambda p: ft.functional_call(model, p, (x,)).pow(2).sum()
    both(lambda ft: ft.grad(loss(ft))(p))
    both(lambda ft: ft.jvp(loss(ft), (p,), (tangent,)))
    both(lambda ft: ft.jacrev(lambda p: ft.functional_call(model, p, x))(p))
    both(lambda ft: ft.jacfwd(lambda p: ft.functional_call(model, p, x))(p))
    both(lambda ft: ft.hessian(lambda b: ft.functional_call(
        model, {**p, "2.bias": b}, x).pow(3).sum())(p["2.bias"]))

    def pulled(ft):
        out, vjp_fn = ft.vjp(lambda p: ft.functional_call(model, p, x), p)
        return out, vjp_fn(torch.ones_like(out))
    both(pulled)
    # with respect to the input too, through a tuple of dicts with the buffers
    net = bn_net().eval()
    buffers = buffers_of(net)
    both(lambda ft: ft.grad(lambda p, x: ft.functional_call(net, (p, buffers), x).sum(),
                            argnums=(0, 1))(params_of(net), x))


def test_functional_call_gradient_by_finite_differences():
    lm = TiedLM()
    p = params_of(lm)
    loss = lambda p: mf.functional_call(lm, p, TOKENS).pow(2).sum()  # noqa: E731
    got = mf.grad(loss)(p)
    eps = 1e-6
    for name, value in p.items():
        flat = value.reshape(-1)
        for i in range(0, flat.numel(), 3):
            bump = torch.zeros_like(flat)
            bump[i] = eps
            plus = loss({**p, name: (flat + bump).reshape(value.shape)})
            minus = loss({**p, name: (flat - bump).reshape(value.shape)})
            torch.testing.assert_close(got[name].reshape(-1)[i], (plus - minus) / (2 * eps),
                                       rtol=1e-5, atol=1e-7)


def test_per_sample_gradients_with_vmap_of_grad():
    model = mlp()
    p = params_of(model)
    x, target = randn(6, 3, seed=1), torch.tensor([0, 1, 1, 0, 1, 0])

    def program(ft):
        def loss(p, x, t):
            return F.cross_entropy(ft.functional_call(model, p, (x.unsqueeze(0),)),
                                   t.unsqueeze(0))
        return ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(p, x, target)
    ours = both(program)
    assert ours["0.weight"].shape == (6, 4, 3)
    with mf.capture_fallbacks() as used:
        program(OURS)
    assert not used, f"per-example fallbacks: {used}"


# --- tied weights ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tie_weights", [True, False])
def test_tied_weights_one_name_given(tie_weights):
    lm = TiedLM()
    p = params_of(lm)
    assert set(p) == {"embed.weight", "decode.bias"}, "named_parameters lists a tied one once"
    new = {"embed.weight": randn(6, 3, seed=5), "shift": randn(6, seed=6)}
    both(lambda ft: ft.functional_call(lm, new, TOKENS, tie_weights=tie_weights))

    def loss(ft):
        return lambda q: ft.functional_call(lm, q, TOKENS, tie_weights=tie_weights).sum()
    grads = both(lambda ft: ft.grad(loss(ft))(new))
    # tied: the embedding and the decoder both use the given weight; untied: only the embedding
    with torch.no_grad():
        untied = loss(OURS)(new)
        manual = copy.deepcopy(lm)
        manual.embed.weight = nn.Parameter(new["embed.weight"])  # unties the copy
        if tie_weights:
            manual.decode.weight = manual.embed.weight
            manual.shift_tied = new["shift"]
        manual.shift = new["shift"]
        torch.testing.assert_close(untied, manual(TOKENS).sum())
    assert grads["shift"].shape == (6,)
    assert lm.decode.weight is lm.embed.weight, "the tie is still there after the call"


@pytest.mark.parametrize("tie_weights", [True, False])
def test_tied_weights_both_names_given(tie_weights):
    lm = TiedLM()
    w = randn(6, 3, seed=7)
    same = {"embed.weight": w, "decode.weight": w}
    both(lambda ft: ft.functional_call(lm, same, TOKENS, tie_weights=tie_weights))
    both(lambda ft: ft.grad(lambda w: ft.functional_call(
        lm, {"embed.weight": w, "decode.weight": w}, TOKENS, tie_weights=tie_weights).sum())(w))
    # different tensors for the two names: an error when tied, each its own when not
    other = {"embed.weight": w, "decode.weight": randn(6, 3, seed=8)}
    both(lambda ft: ft.functional_call(lm, other, TOKENS, tie_weights=False))
    both(lambda ft: ft.grad(lambda o: ft.functional_call(lm, o, TOKENS, tie_weights=False)
                            .pow(2).sum())(other))
    with pytest.raises(ValueError, match=r"^functional_call\(.*?\): functional_call got multiple "
                                         r"values for keys \['decode.weight', 'embed.weight'\], "
                                         r"which are tied"):
        mf.grad(lambda o: mf.functional_call(lm, o, TOKENS).sum())(other)


class SharedSubmodule(nn.Module):
    """One submodule under two names: its tensors have two names each, without a tie written."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(3, 3).to(DTYPE)
        self.b = self.a

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_the_search_for_ties_is_skipped_only_where_there_are_none():
    # NOTE [A module without ties skips torch's untying]: a module answered "no ties" gets
    # the swap with tie_weights=False, so the answer must never miss a tie
    from minifunctorch.core.modules import _has_tied_tensors
    assert not _has_tied_tensors(mlp())
    assert not _has_tied_tensors(nn.BatchNorm1d(3))  # buffers, a None-free module
    assert not _has_tied_tensors(nn.Linear(3, 3, bias=False))  # a None parameter
    assert _has_tied_tensors(TiedLM())  # a parameter and a buffer, each under two names
    assert _has_tied_tensors(SharedSubmodule())
    crossed = nn.Module()
    crossed.first, crossed.second = nn.Linear(2, 2), nn.Module()
    crossed.second.register_buffer("w", crossed.first.weight.detach())
    assert not _has_tied_tensors(crossed), "a detached copy is another tensor"
    crossed.second.register_buffer("w", crossed.first.weight)  # a parameter as another's buffer
    assert _has_tied_tensors(crossed)
    # one name given for the shared submodule's weight replaces it under both names
    net, x = SharedSubmodule(), randn(2, 3)
    new = {"a.weight": randn(3, 3, seed=4)}
    for tie_weights in (True, False):
        both(lambda ft: ft.functional_call(net, new, x, tie_weights=tie_weights))
        both(lambda ft: ft.grad(lambda p: ft.functional_call(
            net, p, x, tie_weights=tie_weights).sum())(new))


def test_tied_weights_in_an_ensemble():
    models = [TiedLM(seed) for seed in range(3)]
    base = TiedLM(10)

    def program(ft):
        params, buffers = ft.stack_module_state(models)
        run = lambda p, b: ft.functional_call(base, (p, b), (TOKENS,))  # noqa: E731
        return ft.vmap(run)(params, buffers), ft.vmap(ft.grad(
            lambda p, b: run(p, b).pow(2).sum()))(params, buffers)
    outputs, _ = both(program)
    with torch.no_grad():
        torch.testing.assert_close(outputs, torch.stack([m(TOKENS) for m in models]))


def test_a_submodule_under_two_names_is_restored():
    """``self.again = self.linear``: 'linear.weight' and 'again.weight' are one slot. torch.func
    leaves the given tensor in the module after the call (pytorch/pytorch issue 164759); here
    the module gets its own tensors back, also after a transform."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3).to(DTYPE)
            self.again = self.linear

        def forward(self, x):
            return self.again(torch.tanh(self.linear(x)))

    model = Twice()
    original = dict(model.named_parameters(remove_duplicate=False))
    x = randn(2, 3)
    for tie_weights in (True, False):
        p = {k: v * 2 for k, v in params_of(model).items()}

        def program(ft):
            fresh = Twice()  # torch.func leaves p's tensors in the module it calls
            return ft.grad(lambda p: ft.functional_call(
                fresh, p, x, tie_weights=tie_weights).sum())(p)
        both(program)
        out = mf.functional_call(model, p, x, tie_weights=tie_weights)
        grads = mf.grad(lambda p: mf.functional_call(model, p, x, tie_weights=tie_weights)
                        .sum())(p)
        both_given = {**p, "again.weight": p["linear.weight"], "again.bias": p["linear.bias"]}
        mf.functional_call(model, both_given, x, tie_weights=tie_weights)
        assert dict(model.named_parameters(remove_duplicate=False)) == original
        with torch.no_grad():
            manual = copy.deepcopy(model)
            manual.linear.weight.copy_(p["linear.weight"])
            manual.linear.bias.copy_(p["linear.bias"])
            torch.testing.assert_close(out, manual(x))
        assert set(grads) == {"linear.weight", "linear.bias"}


# --- strict -----------------------------------------------------------------------------------------
def test_strict_accepts_exactly_the_state():
    lm = TiedLM()
    full = {**params_of(lm), **buffers_of(lm)}  # the tied names through their group
    both(lambda ft: ft.functional_call(lm, full, TOKENS, strict=True))
    everything = {**full, "decode.weight": full["embed.weight"],
                  "shift_tied": full["shift"]}  # every name, tied ones included
    both(lambda ft: ft.functional_call(lm, everything, TOKENS, strict=True, tie_weights=False))
    both(lambda ft: ft.vmap(lambda w: ft.functional_call(
        lm, {**full, "embed.weight": w}, TOKENS, strict=True))(randn(2, 6, 3, seed=3)))


# --- stack_module_state ------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [mlp, bn_net, TiedLM], ids=["mlp", "batchnorm", "tied"])
def test_stack_module_state_matches_torch_func(make):
    models = [make(seed) for seed in range(3)]
    ours, theirs = mf.stack_module_state(models), tf.stack_module_state(models)
    assert_same(ours, theirs)
    for mine, torch_s in zip(ours, theirs):
        for name in torch_s:
            for attribute in ("requires_grad", "is_leaf", "dtype", "grad_fn"):
                assert getattr(mine[name], attribute) == getattr(torch_s[name], attribute), \
                    (name, attribute)
    # frozen models: nothing requires grad
    for m in models:
        m.requires_grad_(False)
    ours = mf.stack_module_state(models)[0]
    assert not any(v.requires_grad for v in ours.values())


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_ensemble_with_buffers_under_vmap(train):
    """stack_module_state + vmap(functional_call), batch norm: in training mode the stacked
    running statistics are updated in place, one per model, as with torch.func."""
    models = [bn_net(seed).train(train) for seed in range(3)]
    base = bn_net(10).train(train)
    x, xs = randn(5, 3, seed=1), randn(3, 5, 3, seed=2)

    def program(ft):
        params, buffers = ft.stack_module_state(models)
        run = lambda p, b, x: ft.functional_call(base, (p, b), (x,))  # noqa: E731
        shared = ft.vmap(run, in_dims=(0, 0, None))(params, buffers, x)
        own = ft.vmap(run)(params, buffers, xs)
        return shared, own, buffers
    shared, own, buffers = both(program)
    assert shared.shape == (3, 5, 2)
    if not train:
        with torch.no_grad():
            torch.testing.assert_close(own, torch.stack([m(x) for m, x in zip(models, xs)]))
    else:
        assert int(buffers["1.num_batches_tracked"][0]) == 2


def test_ensemble_training_step_with_grad():
    models = [mlp(seed) for seed in range(4)]
    x, y = randn(4, 6, 3, seed=1), randn(4, 6, 2, seed=2)
    base = mlp(10)

    def program(ft):
        params, buffers = ft.stack_module_state(models)

        def loss(p, b, x, y):
            return F.mse_loss(ft.functional_call(base, (p, b), (x,)), y)
        return ft.vmap(ft.grad(loss))(params, buffers, x, y)
    grads = both(program)
    for i, model in enumerate(models):  # by ordinary autograd, one model at a time
        model.zero_grad()
        F.mse_loss(model(x[i]), y[i]).backward()
        torch.testing.assert_close(grads["2.bias"][i], model[2].bias.grad)


def test_stack_module_state_refuses_models_with_different_structures():
    torch.manual_seed(0)
    shorter = nn.Sequential(nn.Linear(3, 4))
    longer = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # torch.func drops '1.weight'
    with pytest.raises(RuntimeError, match=r"stack_module_state\(<2 models>\): model 1 has "):
        mf.stack_module_state([shorter, longer])


# --- replace_all_batch_norm_modules_ -----------------------------------------------------------
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 3), nn.BatchNorm1d(3))
        self.untracked = nn.BatchNorm1d(3, track_running_stats=False)

    def forward(self, x):
        return self.untracked(self.head(self.features(x)))


def test_replace_all_batch_norm_modules_matches_torch_func():
    ours, theirs = Nested().to(DTYPE), Nested().to(DTYPE)
    assert mf.replace_all_batch_norm_modules_(ours) is ours
    assert tf.replace_all_batch_norm_modules_(theirs) is theirs
    assert dict(ours.named_buffers()) == dict(theirs.named_buffers()) == {}
    for mine, torch_m in zip(ours.modules(), theirs.modules()):
        if isinstance(mine, nn.modules.batchnorm._BatchNorm):
            for attribute in ("running_mean", "running_var", "num_batches_tracked",
                              "track_running_stats"):
                assert getattr(mine, attribute) == getattr(torch_m, attribute) or \
                    getattr(mine, attribute) is getattr(torch_m, attribute) is None
            assert mine.track_running_stats is False
    root = nn.BatchNorm1d(3)  # the root itself is patched too
    assert mf.replace_all_batch_norm_modules_(root).running_mean is None


def test_batch_norm_under_vmap_needs_the_replacement():
    net = Nested().to(DTYPE)
    x = randn(4, 2, 1, 4, 4, seed=3)  # 4 groups of a minibatch of 2
    with pytest.raises(RuntimeError, match="running_mean"):
        mf.vmap(net)(x)  # torch.func refuses too: one buffer cannot hold 4 statistics
    mf.replace_all_batch_norm_modules_(net)
    params = params_of(net)
    both(lambda ft: ft.vmap(lambda x: ft.functional_call(net, params, x))(x))
    both(lambda ft: ft.vmap(ft.grad(lambda p, x: ft.functional_call(net, p, x).pow(2).sum()),
                            in_dims=(None, 0))(params, x))


# --- errors: torch.func's exception and wording, then the call and the fix -----------------------
def _tied_pair():
    lm = TiedLM()
    return lm, {"embed.weight": randn(6, 3, seed=1), "decode.weight": randn(6, 3, seed=2)}


def _mixed_requires_grad():
    models = [nn.Linear(2, 2) for _ in range(3)]
    models[0].weight.requires_grad_(False)
    return models


def _one_in_eval():
    models = [nn.Linear(2, 2) for _ in range(3)]
    models[1].eval()
    return models


LINEAR = nn.Linear(2, 2)
X2 = torch.ones(1, 2)
LINEAR_P = dict(LINEAR.named_parameters())
TIED = TiedLM()
# (id, program(ns), builtin exception torch.func raises, the start of torch.func's message)
ERROR_CASES = [
    ("overlapping keys", lambda ft: ft.functional_call(
        LINEAR, (LINEAR_P, {"weight": torch.ones(2, 2)}), X2), ValueError,
     "['weight'] appeared in multiple dictionaries; behavior of functional call is ambiguous"),
    ("element not a dict", lambda ft: ft.functional_call(LINEAR, (LINEAR_P, [1]), X2),
     ValueError, "Expected all elements of parameter_and_buffer_dicts to be dictionaries"),
    ("a string", lambda ft: ft.functional_call(LINEAR, "weight", X2),
     ValueError, "Expected all elements of parameter_and_buffer_dicts to be dictionaries"),
    ("not a dict", lambda ft: ft.functional_call(LINEAR, torch.ones(2), X2), ValueError,
     "Expected parameter_and_buffer_dicts to be a dict, or a list/tuple of dicts, but got"),
    ("strict missing", lambda ft: ft.functional_call(
        LINEAR, {"weight": torch.ones(2, 2)}, X2, strict=True), RuntimeError,
     "Error(s) in reparametrizing for Linear:\n\tMissing key(s): 'bias'."),
    ("strict unexpected and missing", lambda ft: ft.functional_call(
        LINEAR, {"weight": torch.ones(2, 2), "bais": torch.ones(2)}, X2, strict=True),
     RuntimeError, "Error(s) in reparametrizing for Linear:\n\tUnexpected key(s): 'bais'.\n\t"
                   "Missing key(s): 'bias'."),
    ("strict untied", lambda ft: ft.functional_call(
        TiedLM(), {**params_of(TiedLM()), **buffers_of(TiedLM())}, TOKENS, strict=True,
        tie_weights=False), RuntimeError,
     "Error(s) in reparametrizing for TiedLM:\n\tMissing key(s): 'decode.weight', "
     "'shift_tied'."),
    ("strict under grad", lambda ft: ft.grad(lambda w: ft.functional_call(
        LINEAR, {"weight": w}, X2, strict=True).sum())(torch.ones(2, 2)), RuntimeError,
     "Error(s) in reparametrizing for Linear:\n\tMissing key(s): 'bias'."),
    ("tied values differ", lambda ft: ft.functional_call(*_tied_pair(), TOKENS), ValueError,
     "functional_call got multiple values for keys ['decode.weight', 'embed.weight'], which "
     "are tied. Consider using tie_weights=False"),
    ("tied values differ under vmap", lambda ft: ft.vmap(lambda w: ft.functional_call(
        TIED, {"embed.weight": w, "decode.weight": w * 2}, TOKENS))(randn(2, 6, 3)),
     ValueError, "functional_call got multiple values for keys"),
    ("no such submodule", lambda ft: ft.functional_call(
        mlp(), {"5.weight": torch.ones(2)}, torch.ones(3)), AttributeError,
     "Sequential has no attribute `5`"),
    ("through a tensor", lambda ft: ft.functional_call(
        LINEAR, {"weight.data": torch.ones(2)}, X2), TypeError, "submodule `weight`: "),
    ("a non-tensor attribute", lambda ft: ft.functional_call(
        LINEAR, {"in_features": torch.ones(2)}, X2), TypeError,
     "attribute `in_features`: 2 is not an instance of torch.Tensor"),
    ("a non-tensor value", lambda ft: ft.functional_call(LINEAR, {"weight": 1.5}, X2),
     TypeError, "1.5 is not an instance of torch.Tensor"),
    ("DataParallel", lambda ft: ft.functional_call(nn.DataParallel(LINEAR), {}, X2),
     RuntimeError, "The stateless API can't be used with nn.DataParallel module"),
    ("stack no models", lambda ft: ft.stack_module_state([]), RuntimeError,
     "stack_module_state: Expected at least one model, got 0."),
    ("stack modes", lambda ft: ft.stack_module_state(_one_in_eval()), RuntimeError,
     "stack_module_state: Expected all models to have the same training/eval mode."),
    ("stack classes", lambda ft: ft.stack_module_state([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)]),
     RuntimeError, "stack_module_state: Expected all models to be of the same class."),
    ("stack requires_grad", lambda ft: ft.stack_module_state(_mixed_requires_grad()),
     RuntimeError, "Expected weight from each model to have the same .requires_grad"),
    ("stack shapes", lambda ft: ft.stack_module_state([nn.Linear(2, 2), nn.Linear(2, 3)]),
     RuntimeError, "stack expects each tensor to be equal size"),
    ("combine no models", lambda ft: ft.combine_state_for_ensemble([]), RuntimeError,
     "combine_state_for_ensemble: Expected at least one model, got 0."),
    ("combine modes", lambda ft: ft.combine_state_for_ensemble(_one_in_eval()), RuntimeError,
     "combine_state_for_ensemble: Expected all models to have the same training/eval mode."),
    ("combine classes", lambda ft: ft.combine_state_for_ensemble(
        [nn.Linear(2, 2), nn.Conv1d(2, 2, 1)]), RuntimeError,
     "combine_state_for_ensemble: Expected all models to be of the same class."),
    ("make_functional with buffers", lambda ft: ft.make_functional(nn.BatchNorm1d(2)),
     RuntimeError, "make_functional(model): `model` has buffers. Please use "
                   "make_functional_with_buffers(model) instead."),
]


@pytest.mark.parametrize("program, builtin, wording", [case[1:] for case in ERROR_CASES],
                         ids=[case[0] for case in ERROR_CASES])
def test_errors_match_torch_func(program, builtin, wording):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.DataParallel on a machine without GPUs
        with pytest.raises(builtin) as theirs:
            program(TORCH)
        with pytest.raises(builtin) as ours:
            program(OURS)
    assert str(theirs.value).startswith(wording), f"torch.func now says: {theirs.value}"
    assert isinstance(ours.value, TransformError), type(ours.value)
    message = str(ours.value)
    # the call as written, then torch.func's words (NOTE [Messages: ...] in transforms.py)
    call, _, rest = message.partition(": ")
    # (where torch.func's words begin with its own call, ours is the same call)
    assert message.startswith(wording) or (call.endswith(")") and rest.startswith(wording)), \
        message
    assert "Fix:" in message, message
    # and the engine is usable after the error
    torch.testing.assert_close(mf.grad(lambda x: (x * x).sum())(torch.ones(2)),
                               2 * torch.ones(2))


def test_error_names_the_call():
    with pytest.raises(mf.ModuleStateError) as info:
        mf.functional_call(LINEAR, ({"weight": torch.ones(2, 2)},), X2, strict=True)
    assert "functional_call(<Linear>, (<dict of 1>,), args, strict=True): " in str(info.value)
    with pytest.raises(mf.ModuleArgumentError, match=r"'weight' in dicts \[0, 1\]"):
        mf.functional_call(LINEAR, (LINEAR_P, LINEAR_P), X2)


# --- compat: functorch's make_functional & co, against functorch's own ---------------------------
class WithBuffer(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(3, 3).to(DTYPE)
        self.bias = nn.Parameter(torch.randn(3, dtype=DTYPE))
        self.weight = self.linear.weight  # a tied parameter
        self.scale = nn.Linear(3, 3, bias=False).to(DTYPE)
        self.scale_again = self.scale  # one submodule under two names
        self.register_buffer("offset", torch.randn(3, dtype=DTYPE))
        self.register_buffer("offset_tied", self.offset)

    def forward(self, x):
        x = self.linear(x) + F.linear(x, self.weight) + self.bias
        x = self.scale_again(self.scale(x))
        return x + self.offset + self.offset_tied


def _state_structure(func, *states):
    names = {k: getattr(func, k) for k in ("param_names", "buffer_names") if hasattr(func, k)}
    maps = {k: getattr(func, k) for k in ("names_map", "all_names_map") if hasattr(func, k)}
    return names, maps, [[(tuple(t.shape), t.requires_grad, t.is_leaf) for t in s]
                         for s in states]


@pytest.mark.parametrize("disable", [False, True], ids=["tracking", "no-tracking"])
@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_make_functional_matches_functorch(kind, disable):
    lm = TiedLM()
    model = mlp() if kind == "mlp" else nn.Sequential(lm.embed, lm.decode)  # no buffers
    x = randn(4, 3) if kind == "mlp" else TOKENS
    func, params = compat.make_functional(model, disable_autograd_tracking=disable)
    f_func, f_params = functorch_mf.make_functional(model, disable_autograd_tracking=disable)
    assert isinstance(func, nn.Module) and isinstance(params, tuple)
    assert _state_structure(func, params) == _state_structure(f_func, f_params)
    assert all(type(p) is nn.Parameter and p.requires_grad is not disable for p in params)
    assert_same(params, f_params)
    assert all(p is not q for p, q in zip(params, model.parameters())), "copies, not the model's"
    assert all(t.device.type == "meta" for t in func.stateless_model.parameters())
    torch.testing.assert_close(func(params, x), f_func(f_params, x))
    with torch.no_grad():
        torch.testing.assert_close(func(params, x), model(x))
    # round trip under the transforms: ours on our func, torch.func on functorch's
    grads = mf.grad(lambda p: func(p, x).pow(2).sum())(params)
    assert_same(grads, tf.grad(lambda p: f_func(p, x).pow(2).sum())(f_params))
    per_row = mf.vmap(lambda x: func(params, x))(x.unsqueeze(1))
    torch.testing.assert_close(per_row, tf.vmap(lambda x: f_func(f_params, x))(x.unsqueeze(1)))


def test_make_functional_with_buffers_matches_functorch():
    model = WithBuffer()
    x = randn(2, 3, seed=1)
    func, params, buffers = compat.make_functional_with_buffers(model)
    f_func, f_params, f_buffers = functorch_mf.make_functional_with_buffers(model)
    assert _state_structure(func, params, buffers) == \
        _state_structure(f_func, f_params, f_buffers)
    assert len(params) == 4 and len(buffers) == 1, "tied tensors are returned once"
    assert_same((params, buffers), (f_params, f_buffers))
    torch.testing.assert_close(func(params, buffers, x), f_func(f_params, f_buffers, x))
    grads = mf.grad(lambda p, b: func(p, b, x).sum(), argnums=(0, 1))(params, buffers)
    f_grads = tf.grad(lambda p, b: f_func(p, b, x).sum(), argnums=(0, 1))(f_params, f_buffers)
    assert_same(grads, f_grads)
    loss = model(x).sum()  # and by ordinary autograd on the model itself
    expected = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(list(grads[0]), list(expected))
    # the functional module's own state stays meta, before and after calls
    assert all(t.device.type == "meta" for t in (*func.stateless_model.parameters(),
                                                 *func.stateless_model.buffers()))
    with pytest.raises(ValueError, match=r"expected 4 parameters .* got 2"):
        func(params[:2], buffers, x)


def test_batch_norm_model_through_make_functional_with_buffers():
    model = bn_net().train()
    x = randn(6, 3)
    func, params, buffers = compat.make_functional_with_buffers(model)
    f_func, f_params, f_buffers = functorch_mf.make_functional_with_buffers(model)
    grads = mf.grad(lambda p: func(p, buffers, x).pow(2).sum())(params)
    # torch.func refuses the in-place update of captured buffers under grad; this engine
    # updates them with the primal statistics: compare with torch's ordinary autograd
    expected = torch.autograd.grad(f_func(f_params, f_buffers, x).pow(2).sum(), f_params)
    assert_same(grads, expected)
    assert_same(buffers, f_buffers)  # running statistics updated once, the same way
    assert int(buffers[2]) == 1


def test_combine_state_for_ensemble_matches_functorch():
    models = [WithBuffer(seed) for seed in range(3)]
    xs = randn(3, 4, 3, seed=2)
    func, params, buffers = compat.combine_state_for_ensemble(models)
    f_func, f_params, f_buffers = functorch_mf.combine_state_for_ensemble(models)
    assert _state_structure(func, params, buffers) == \
        _state_structure(f_func, f_params, f_buffers)
    assert not any(t.requires_grad for t in params), "functorch detaches the stacked state"
    assert_same((params, buffers), (f_params, f_buffers))
    ours = mf.vmap(func)(params, buffers, xs)
    torch.testing.assert_close(ours, tf.vmap(f_func)(f_params, f_buffers, xs))
    with torch.no_grad():
        torch.testing.assert_close(ours, torch.stack([m(x) for m, x in zip(models, xs)]))
    shared = mf.vmap(func, in_dims=(0, 0, None))(params, buffers, xs[0])
    torch.testing.assert_close(shared, tf.vmap(f_func, in_dims=(0, 0, None))(
        f_params, f_buffers, xs[0]))


def test_compat_functions_are_documented_as_deprecated_spellings():
    for function in (compat.make_functional, compat.make_functional_with_buffers,
                     compat.combine_state_for_ensemble):
        assert "deprecated spelling" in function.__doc__
    assert "functional_call" in compat.__doc__ and "stack_module_state" in compat.__doc__


def test_the_common_swap_is_written_out_and_the_rest_takes_torchs(monkeypatch):
    # NOTE [The common swap, written out]: existing parameters and buffers, no untying, not
    # strict: dict assignments; any other call: torch's swap, with its checks
    from minifunctorch.core import modules
    calls = []
    real = modules._reparametrize_module

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(modules, "_reparametrize_module", counted)
    net, x = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(DTYPE), randn(5, 3)
    state = {**params_of(net), **dict(net.named_buffers())}
    state = {k: v.clone() for k, v in state.items()}
    both(lambda ft: ft.functional_call(net, {k: v.clone() for k, v in state.items()}, x))
    assert calls == [], "an ordinary call took torch's swap"
    mf.functional_call(net, state, x, strict=True)
    mf.functional_call(net, {**state, "extra": torch.ones(())}, x)
    assert len(calls) == 2
    assert dict(net.named_buffers())["1.running_mean"].abs().sum() == 0  # the module's own


def test_a_module_copied_or_made_inside_vmap():
    # copy.deepcopy(model) inside vmap makes nn.Parameters of the function's own tensors
    # (requires_grad_ on a tensor no level owns: NOTE [requires_grad_ inside a transform]);
    # functorch's functional_init does so for an ensemble of fresh models
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    xs = torch.randn(5, 3)
    f = lambda x: copy.deepcopy(model)(x)  # noqa: E731
    torch.testing.assert_close(mf.vmap(f)(xs), tf.vmap(f)(xs))
    weights, fn, _ = functorch_mf.functional_init(nn.Linear, (2,))(3, 4)
    inputs = torch.randn(2, 7, 3)
    torch.testing.assert_close(mf.vmap(fn)(weights, (inputs,)), tf.vmap(fn)(weights, (inputs,)))
