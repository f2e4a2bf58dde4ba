"""The cases S1-S6, each written once against an ``api`` that is either
``minifunctorch.core`` or ``torch.func`` (both have grad, vmap, jvp, jacrev, jacfwd, hessian
and functional_call), so that every contender computes the very same function.

S1 overhead       a chain of elementwise ops on a 10x10 tensor under each transform level
S2 per-sample     vmap(grad) of an MLP 784-128-10 with cross-entropy, B = 64 and 256
S3 Jacobians      jacrev and jacfwd of R^n -> R^m, square-ish, tall and wide
S4 second order   hessian, hvp (jvp of grad) and vmap(hessian) on R^32
S5 ensembles      vmap over the stacked parameters of 10 small MLPs (functional_call)
S6 tracing        time to first result, and cache-hit dispatch (from S1's 1-op function)
"""
import copy
import dataclasses
import functools

import torch
import torch.func
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import minifunctorch.core as mft

from .harness import (
    COMPILE, HAND, LOOP, MAKE_FX, MFT, MFT_INDUCTOR, MFT_JIT, TORCH_FUNC, Case, NotAvailable,
    find_jit,
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes; ``QUICK`` shrinks them so that the checks run in seconds."""

    s1_shape: tuple = (10, 10)
    s1_ops: int = 100
    s2_batches: tuple = (64, 256)
    s2_dims: tuple = (784, 128, 10)
    s3_shapes: tuple = (("32→64", 32, 64), ("tall 32→2048", 32, 2048),
                        ("wide 2048→32", 2048, 32))
    s4_n: int = 32
    s4_batch: int = 64
    s5_models: int = 10
    s5_dims: tuple = (32, 64, 10)
    s5_batch: int = 64
    inductor: bool = True  # build the torch.compile / jit(backend='inductor') contenders


FULL = Sizes()
QUICK = Sizes(s1_shape=(4, 4), s1_ops=10, s2_batches=(8,), s2_dims=(12, 8, 4),
              s3_shapes=(("4→6", 4, 6), ("tall 4→40", 4, 40), ("wide 40→4", 40, 4)),
              s4_n=6, s4_batch=3, s5_models=3, s5_dims=(5, 7, 3), s5_batch=4, inductor=False)

# Where the inductor contenders run: compiling costs seconds per graph, so only the cases
# that the inductor targets are about (S2), plus one second-order and one ensemble case.
INDUCTOR_NOTE = "not built for this case (compile time): see S2, S4 vmap(hessian), S5"
QUICK_INDUCTOR_NOTE = "not built in --quick (compile time)"


def engine_case(group, name, transform, args, *, sizes, inductor=False, loop=None, hand=None,
                notes=None, **tolerances) -> Case:
    """A case whose engine contenders all come from ``transform(api)``.

    ``transform(api)`` returns the transformed function, called as ``fn(*args)``; ``loop``
    and ``hand``, if given, are plain functions of ``args`` computing the same result.
    """
    def minifunctorch_eager():
        fn = transform(mft)
        return lambda: fn(*args)

    def minifunctorch_jit(backend=None):
        jit = find_jit()
        if jit is None:
            raise NotAvailable("not available: minifunctorch.core has no jit yet")
        options = {} if backend is None else {"backend": backend}
        fn = jit(transform(mft), **options)
        return lambda: fn(*args)

    def torch_func_eager():
        fn = transform(torch.func)
        return lambda: fn(*args)

    def make_fx_replay():
        graph = make_fx(transform(torch.func))(*args)
        return lambda: graph(*args)

    def compiled_make_fx():
        compiled = torch.compile(make_fx(transform(torch.func))(*args))
        return lambda: compiled(*args)

    builders = {MFT: minifunctorch_eager, MFT_JIT: minifunctorch_jit,
                TORCH_FUNC: torch_func_eager, MAKE_FX: make_fx_replay}
    notes = dict(notes or {})
    if inductor and sizes.inductor:
        builders[MFT_INDUCTOR] = functools.partial(minifunctorch_jit, "inductor")
        builders[COMPILE] = compiled_make_fx
    else:
        note = QUICK_INDUCTOR_NOTE if not sizes.inductor else INDUCTOR_NOTE
        notes.setdefault(MFT_INDUCTOR, note)
        notes.setdefault(COMPILE, note)
    if loop is not None:
        builders[LOOP] = lambda: functools.partial(loop, *args)
    if hand is not None:
        builders[HAND] = lambda: functools.partial(hand, *args)
    return Case(group, name, builders, notes, **tolerances)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, device, seed, scale=1.0):
    """Seeded normal numbers drawn on the CPU, then moved: the same inputs on every device."""
    return (torch.randn(*shape, generator=_generator(seed)) * scale).to(device)


# --- S1: overhead per op and per level -----------------------------------------------------------
_CHAIN = (torch.sin, lambda v: v * 1.1, torch.tanh, lambda v: v + 0.1)


def chain(n_ops):
    """``n_ops`` elementwise ops, then a sum: the sum makes every level's function scalar
    (grad needs it), so the 1-op function is the sum alone and the per-op cost is
    (time of the n-op chain - time of the 1-op function) / n_ops."""
    def f(x):
        for i in range(n_ops):
            x = _CHAIN[i % len(_CHAIN)](x)
        return x.sum()
    f.__name__ = f"chain{n_ops}"
    return f


# level -> (number of transform levels, transform(api, f), whether it takes a tangent)
S1_LEVELS = {
    "none": (0, lambda api, f: f, False),
    "grad": (1, lambda api, f: api.grad(f), False),
    "vmap": (1, lambda api, f: api.vmap(f), False),
    "jvp": (1, lambda api, f: lambda x, t: api.jvp(f, (x,), (t,)), True),
    "vmap(grad)": (2, lambda api, f: api.vmap(api.grad(f)), False),
    "vmap(vmap)": (2, lambda api, f: api.vmap(api.vmap(f)), False),
}


def _at_level(transform, f):
    return lambda api: transform(api, f)


def s1_cases(sizes, device) -> list:
    """Per level, a pair of cases (1-op function, n-op chain) measured together.

    vmap maps over the rows of the 10x10 tensor and vmap(vmap) over its elements, so every
    level computes on the same 100 numbers and the differences are overhead."""
    x = _randn(*sizes.s1_shape, device=device, seed=1)
    t = _randn(*sizes.s1_shape, device=device, seed=2)
    pairs = []
    for level, (_, transform, takes_tangent) in S1_LEVELS.items():
        args = (x, t) if takes_tangent else (x,)
        pairs.append([engine_case("S1", f"{level} {n_ops + 1}-op",
                                  _at_level(transform, chain(n_ops)), args, sizes=sizes)
                      for n_ops in (0, sizes.s1_ops)])
    return pairs


# --- S2: per-sample gradients of an MLP ----------------------------------------------------------
def mlp_loss(params, x, y):
    """Cross-entropy of a 784-128-10 ReLU MLP on one example (explicit weights, F.linear)."""
    hidden = F.relu(F.linear(x, params["w1"], params["b1"]))
    logits = F.linear(hidden, params["w2"], params["b2"])
    return F.cross_entropy(logits.unsqueeze(0), y.unsqueeze(0))


def mlp_params(dims, device, seed=3):
    d_in, d_hidden, d_out = dims
    return {
        "w1": _randn(d_hidden, d_in, device=device, seed=seed, scale=d_in ** -0.5),
        "b1": _randn(d_hidden, device=device, seed=seed + 1, scale=0.1),
        "w2": _randn(d_out, d_hidden, device=device, seed=seed + 2, scale=d_hidden ** -0.5),
        "b2": _randn(d_out, device=device, seed=seed + 3, scale=0.1),
    }


def per_sample_grads_loop(params, x, y):
    """The loop: one torch.autograd.grad per example."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    per_example = []
    for i in range(x.shape[0]):
        loss = mlp_loss(leaves, x[i], y[i])
        per_example.append(torch.autograd.grad(loss, tuple(leaves.values())))
    return {k: torch.stack([g[j] for g in per_example]) for j, k in enumerate(leaves)}


def per_sample_grads_hand(params, x, y):
    """The floor: the per-example gradients in closed form, batched with einsum."""
    pre = F.linear(x, params["w1"], params["b1"])  # (B, hidden)
    hidden = pre.clamp_min(0)
    logits = F.linear(hidden, params["w2"], params["b2"])  # (B, out)
    d_logits = torch.softmax(logits, dim=-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)
    d_pre = (d_logits @ params["w2"]) * (pre > 0)
    return {"w1": torch.einsum("bh,bi->bhi", d_pre, x), "b1": d_pre,
            "w2": torch.einsum("bo,bh->boh", d_logits, hidden), "b2": d_logits}


def s2_inputs(sizes, device, batch):
    """(params, x, y): the MLP's weights and a batch of examples with their labels."""
    params = mlp_params(sizes.s2_dims, device)
    x = _randn(batch, sizes.s2_dims[0], device=device, seed=10 + batch)
    y = torch.randint(0, sizes.s2_dims[2], (batch,), generator=_generator(batch)).to(device)
    return params, x, y


def per_sample_grads(api):
    return api.vmap(api.grad(mlp_loss), in_dims=(None, 0, 0))


def s2_cases(sizes, device) -> list:
    return [engine_case("S2", f"B={batch}", per_sample_grads, s2_inputs(sizes, device, batch),
                        sizes=sizes, inductor=True, loop=per_sample_grads_loop,
                        hand=per_sample_grads_hand)
            for batch in sizes.s2_batches]


# --- S3: Jacobians -------------------------------------------------------------------------------
def _tanh_of_matmul_sin(a):
    """f(x) = tanh(a @ sin(x)), R^n -> R^m, and its Jacobian in closed form."""
    def f(x):
        return torch.tanh(a @ torch.sin(x))

    def jacobian_by_hand(x):
        y = torch.tanh(a @ torch.sin(x))
        return (1 - y * y)[:, None] * a * torch.cos(x)[None, :]
    return f, jacobian_by_hand


def s3_cases(sizes, device) -> list:
    cases = []
    for name, n, m in sizes.s3_shapes:
        f, jacobian_by_hand = _tanh_of_matmul_sin(
            _randn(m, n, device=device, seed=20 + n + m, scale=n ** -0.5))
        x = _randn(n, device=device, seed=30 + n)
        for mode in ("jacrev", "jacfwd"):
            cases.append(engine_case(
                "S3", f"{mode} {name}", _jacobian(mode, f), (x,), sizes=sizes,
                hand=jacobian_by_hand, rtol=1e-4, atol=1e-5))
    return cases


def _jacobian(mode, f):
    return lambda api: getattr(api, mode)(f)


# --- S4: second order ----------------------------------------------------------------------------
def s4_cases(sizes, device) -> list:
    n = sizes.s4_n
    a = _randn(2 * n, n, device=device, seed=40, scale=n ** -0.5)

    def g(x):
        return torch.tanh(a @ x).sum()

    def weight(z):  # d²/dz² tanh(z) = -2 tanh(z) (1 - tanh(z)²)
        t = torch.tanh(z)
        return -2 * t * (1 - t * t)

    def hessian_by_hand(x):
        return (a.T * weight(a @ x)) @ a

    def hvp_by_hand(x, v):
        return a.T @ (weight(a @ x) * (a @ v))

    def batched_hessian_by_hand(xs):
        return torch.einsum("ki,bk,kj->bij", a, weight(xs @ a.T), a)

    x = _randn(n, device=device, seed=41)
    v = _randn(n, device=device, seed=42)
    xs = _randn(sizes.s4_batch, n, device=device, seed=43)
    tolerances = {"rtol": 1e-4, "atol": 1e-5}
    return [
        engine_case("S4", "hessian", lambda api: api.hessian(g), (x,), sizes=sizes,
                    hand=hessian_by_hand, **tolerances),
        engine_case("S4", "hvp = jvp(grad)",
                    lambda api: lambda x, v: api.jvp(api.grad(g), (x,), (v,))[1], (x, v),
                    sizes=sizes, hand=hvp_by_hand, **tolerances),
        engine_case("S4", f"vmap(hessian) B={sizes.s4_batch}",
                    lambda api: api.vmap(api.hessian(g)), (xs,), sizes=sizes, inductor=True,
                    hand=batched_hessian_by_hand, **tolerances),
    ]


# --- S5: ensembles -------------------------------------------------------------------------------
def s5_cases(sizes, device) -> list:
    d_in, d_hidden, d_out = sizes.s5_dims
    torch.manual_seed(50)
    models = [torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(d_hidden, d_out)).to(device)
              for _ in range(sizes.s5_models)]
    # Plain stacked tensors (no requires_grad): every contender computes predictions only.
    stacked = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
               for name, _ in models[0].named_parameters()}
    base = copy.deepcopy(models[0]).to("meta")  # holds no weights: each call supplies them
    x = _randn(sizes.s5_batch, d_in, device=device, seed=51)

    def ensemble(api):
        def one_model(params, x):
            return api.functional_call(base, params, (x,))
        return api.vmap(one_model, in_dims=(0, None))

    def loop(params, x):
        with torch.no_grad():
            return torch.stack([model(x) for model in models])

    def by_hand(params, x):
        hidden = torch.relu(torch.einsum("mhi,bi->mbh", params["0.weight"], x)
                            + params["0.bias"][:, None])
        return torch.einsum("moh,mbh->mbo", params["2.weight"], hidden) \
            + params["2.bias"][:, None]

    name = f"{sizes.s5_models} MLPs {d_in}-{d_hidden}-{d_out}, B={sizes.s5_batch}"
    return [engine_case("S5", name, ensemble, (stacked, x), sizes=sizes, inductor=True,
                        loop=loop, hand=by_hand, rtol=1e-4, atol=1e-5)]


# --- S6: tracing ---------------------------------------------------------------------------------
def s6_first_result_cases(sizes, device) -> list:
    """Fresh cases whose check (build + first call) is the time to first result: the jit
    traces, make_fx traces, the eager contenders just run. Built anew for every repetition
    so that no cache survives from one to the next."""
    cases = []
    x = _randn(*sizes.s1_shape, device=device, seed=1)
    f = chain(sizes.s1_ops)
    cases.append(engine_case("S6", f"first result: vmap(grad) {sizes.s1_ops + 1}-op chain",
                             lambda api: api.vmap(api.grad(f)), (x,), sizes=sizes))
    batch = sizes.s2_batches[0]
    cases.append(engine_case("S6", f"first result: per-sample grads B={batch}",
                             per_sample_grads, s2_inputs(sizes, device, batch), sizes=sizes))
    return cases


def all_cases(sizes, device) -> dict:
    """group -> list of measurement groups (each a list of cases timed together)."""
    return {
        "S1": s1_cases(sizes, device),
        "S2": [[case] for case in s2_cases(sizes, device)],
        "S3": [[case] for case in s3_cases(sizes, device)],
        "S4": [[case] for case in s4_cases(sizes, device)],
        "S5": [[case] for case in s5_cases(sizes, device)],
    }
