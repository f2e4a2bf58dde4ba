"""The cases S1-S10, each written once against an ``api`` that is either
``minifunctorch.core`` or ``torch.func`` (both have grad, vmap, jvp, jacrev, jacfwd, hessian,
functional_call and stack_module_state), so that every contender computes the very same
function.

S1 overhead       a chain of elementwise ops on a 10x10 tensor under each transform level
S2 per-sample     vmap(grad) of an MLP 784-128-10 with cross-entropy, B = 64 and 256
S3 Jacobians      jacrev and jacfwd of R^n -> R^m, square-ish, tall and wide
S4 second order   hessian, hvp (jvp of grad) and vmap(hessian) on R^32
S5 ensembles      vmap over the stacked parameters of 10 small MLPs (functional_call)
S6 tracing        time to first result, and cache-hit dispatch (from S1's 1-op function)
S7 per-sample CNN vmap(grad) through functional_call of a small CNN at MNIST shapes, B = 64
S8 MAML           a meta-step: vmap over tasks of one inner grad step and the query loss,
                  then torch.autograd.grad of the mean query loss into the meta-parameters
S9 NTK            the empirical neural tangent kernel of a small CNN: vmap(jacrev) through
                  functional_call for x1 and x2, contracted with einsum('Naf,Mbf->NMab')
S10 CNN ensemble  vmap over stack_module_state of 10 small CNNs (S7's), one shared
                  minibatch (in_dims (0, 0, None)) and one minibatch per model (0, 0, 0)
"""
import copy
import dataclasses
import functools

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import minifunctorch.core as mft

from .harness import (
    COMPILE, COMPILE_HAND, HAND, LOOP, MAKE_FX, MFT, MFT_INDUCTOR, MFT_JIT, TORCH_FUNC, Case,
    NotAvailable,
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
    s7_image: int = 28  # 1×28×28 inputs (MNIST)
    s7_channels: tuple = (8, 16)  # conv 1→8 3×3, conv 8→16 3×3
    s7_classes: int = 10
    s7_batch: int = 64
    s8_tasks: int = 8  # the meta-batch
    s8_points: int = 10  # support points, and as many query points, per task
    s8_hidden: int = 40  # MLP 1-40-40-1
    s9_in_channels: int = 3
    s9_image: int = 16  # 3×16×16 inputs
    s9_channels: tuple = (8, 8)  # conv 3→8 3×3, conv 8→8 3×3, linear to s9_classes
    s9_classes: int = 10
    s9_examples: tuple = (8, 8)  # N rows of x1, M rows of x2: the kernel is N×M×10×10
    s10_models: int = 10
    s10_image: int = 28  # S7's CNN at MNIST shapes
    s10_channels: tuple = (8, 16)
    s10_classes: int = 10
    s10_batch: int = 64
    inductor: bool = True  # build the torch.compile / jit(backend='inductor') contenders


FULL = Sizes()
QUICK = Sizes(s1_shape=(4, 4), s1_ops=10, s2_batches=(8,), s2_dims=(12, 8, 4),
              s3_shapes=(("4→6", 4, 6), ("tall 4→40", 4, 40), ("wide 40→4", 40, 4)),
              s4_n=6, s4_batch=3, s5_models=3, s5_dims=(5, 7, 3), s5_batch=4,
              s7_image=10, s7_channels=(2, 3), s7_classes=4, s7_batch=4,
              s8_tasks=3, s8_points=4, s8_hidden=6,
              s9_in_channels=2, s9_image=7, s9_channels=(2, 3), s9_classes=3,
              s9_examples=(3, 2), s10_models=3, s10_image=10, s10_channels=(2, 3),
              s10_classes=4, s10_batch=4, inductor=False)

# Where the inductor contenders run: compiling costs seconds per graph (S7, S9 and S10 take
# 3-17 s each on a 2-core CPU), so the cases that the inductor targets are about (S2), one
# second-order case, the ensembles (S5, S10), the MAML meta-step (S8: compiled with its outer
# backward) and the CNN programs (S7, S9), not the S1 chains or every S3/S4 Jacobian.
INDUCTOR_NOTE = ("not built for this case (compile time): see S2, S4 vmap(hessian), S5, "
                 "S7-S10")
QUICK_INDUCTOR_NOTE = "not built in --quick (compile time)"
NO_INDUCTOR_NOTE = "not built: run with --no-inductor (compile time)"
NO_HAND_NOTE = "no hand-batched floor to compile"  # (the hand-batched row says why)


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

    def compiled_hand():
        compiled = torch.compile(hand)
        return lambda: compiled(*args)

    builders = {MFT: minifunctorch_eager, MFT_JIT: minifunctorch_jit,
                TORCH_FUNC: torch_func_eager, MAKE_FX: make_fx_replay}
    notes = dict(notes or {})
    if hand is None:  # nothing for inductor to compile (hand-batched's note says why)
        notes.setdefault(COMPILE_HAND, NO_HAND_NOTE)
    if inductor and sizes.inductor:
        builders[MFT_INDUCTOR] = functools.partial(minifunctorch_jit, "inductor")
        builders[COMPILE] = compiled_make_fx
        if hand is not None:
            builders[COMPILE_HAND] = compiled_hand
    else:
        note = (INDUCTOR_NOTE if sizes.inductor else
                QUICK_INDUCTOR_NOTE if sizes == QUICK else NO_INDUCTOR_NOTE)
        notes.setdefault(MFT_INDUCTOR, note)
        notes.setdefault(COMPILE, note)
        notes.setdefault(COMPILE_HAND, note)
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


# --- S7: per-sample gradients of a small CNN ------------------------------------------------------
S7_HAND_NOTE = ("left out: per-sample gradients of a convolution's weight have no einsum "
                "closed form; batching them by hand (unfold, or torch's expanded weights) "
                "would be a second implementation to benchmark, not a floor")


def small_cnn(channels, image, classes):
    """conv 1→c1 3×3, relu, max_pool 2, conv c1→c2 3×3, relu, max_pool 2, flatten, linear,
    log_softmax (the torch.func per-sample-gradients tutorial's kind of model), on
    1×image×image inputs; S7 and S10 use it."""
    c1, c2 = channels
    side = ((image - 2) // 2 - 2) // 2
    return nn.Sequential(nn.Conv2d(1, c1, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(c2 * side * side, classes), nn.LogSoftmax(dim=-1))


def cnn_per_sample_grads(model):
    def transform(api):
        def loss(params, buffers, sample, target):
            predictions = api.functional_call(model, (params, buffers), (sample.unsqueeze(0),))
            return F.nll_loss(predictions, target.unsqueeze(0))
        return api.vmap(api.grad(loss), in_dims=(None, None, 0, 0))
    return transform


def cnn_per_sample_grads_loop(model):
    """The loop: the model itself (its own parameters, the same values), one
    ``torch.autograd.grad`` per example."""
    names, leaves = zip(*model.named_parameters())

    def loop(params, buffers, x, y):
        per_example = [torch.autograd.grad(F.nll_loss(model(x[i:i + 1]), y[i:i + 1]), leaves)
                       for i in range(x.shape[0])]
        return {name: torch.stack([g[j] for g in per_example]) for j, name in enumerate(names)}
    return loop


def s7_cases(sizes, device) -> list:
    torch.manual_seed(70)
    model = small_cnn(sizes.s7_channels, sizes.s7_image, sizes.s7_classes).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    side, batch = sizes.s7_image, sizes.s7_batch
    x = _randn(batch, 1, side, side, device=device, seed=71)
    y = torch.randint(0, sizes.s7_classes, (batch,), generator=_generator(72)).to(device)
    c1, c2 = sizes.s7_channels
    name = f"CNN {c1}-{c2} on 1×{side}×{side}, B={batch}"
    return [engine_case("S7", name, cnn_per_sample_grads(model), (params, buffers, x, y),
                        sizes=sizes, inductor=True, loop=cnn_per_sample_grads_loop(model),
                        notes={HAND: S7_HAND_NOTE}, rtol=1e-4, atol=1e-5)]


# --- S8: MAML, a meta-step with an outer backward -------------------------------------------------
MAML_INNER_LR = 1e-2
S8_HAND_NOTE = "no closed form of the second-order meta-gradient is written here"


def sine_tasks(sizes, device, seed=80):
    """(x_support, y_support, x_query, y_query), each (tasks, points, 1): sine waves of
    random amplitude in [0.1, 5] and phase in [0, π], sampled on [-5, 5]."""
    generator = _generator(seed)
    tasks, k = sizes.s8_tasks, sizes.s8_points
    amplitude = torch.rand(tasks, 1, 1, generator=generator) * 4.9 + 0.1
    phase = torch.rand(tasks, 1, 1, generator=generator) * torch.pi
    x = torch.rand(tasks, 2 * k, 1, generator=generator) * 10 - 5
    y = amplitude * torch.sin(x - phase)
    return tuple(t.to(device) for t in (x[:, :k], y[:, :k], x[:, k:], y[:, k:]))


def maml_query_losses(net):
    """transform(api) -> query_losses(params, x1, y1, x2, y2): per task (vmap), one inner
    ``api.grad`` step on the support set from ``params`` (closed over, so that their
    derivatives reach the outer backward), then the loss of the adapted model on the query
    set."""
    def transform(api):
        def inner_loss(params, x, y):
            return F.mse_loss(api.functional_call(net, params, (x,)), y)

        def query_losses(params, x1, y1, x2, y2):
            def loss_for_task(x1, y1, x2, y2):
                grads = api.grad(inner_loss)(params, x1, y1)
                adapted = {k: params[k] - MAML_INNER_LR * grads[k] for k in params}
                return inner_loss(adapted, x2, y2)
            return api.vmap(loss_for_task)(x1, y1, x2, y2)
        return query_losses
    return transform


def meta_gradients(query_losses, params):
    """The outer backward: torch's autograd from the mean query loss into the real
    (requires_grad) meta-parameters, through whatever computed the losses."""
    grads = torch.autograd.grad(query_losses.mean(), tuple(params.values()))
    return dict(zip(params, grads))


def maml_step(net):
    losses = maml_query_losses(net)

    def transform(api):
        query_losses = losses(api)
        return lambda params, *tasks: meta_gradients(query_losses(params, *tasks), params)
    return transform


def maml_step_loop(net):
    """The loop: per task, the inner gradient by ``torch.autograd.grad(create_graph=True)``,
    the adapted parameters, the query loss; then the same outer backward."""
    def inner_loss(params, x, y):  # functional_call here only substitutes the parameters
        return F.mse_loss(torch.func.functional_call(net, params, (x,)), y)

    def loop(params, x1, y1, x2, y2):
        losses = []
        for i in range(x1.shape[0]):
            grads = torch.autograd.grad(inner_loss(params, x1[i], y1[i]),
                                        tuple(params.values()), create_graph=True)
            adapted = {k: p - MAML_INNER_LR * g for (k, p), g in zip(params.items(), grads)}
            losses.append(inner_loss(adapted, x2[i], y2[i]))
        return meta_gradients(torch.stack(losses), params)
    return loop


def s8_cases(sizes, device) -> list:
    torch.manual_seed(81)
    hidden = sizes.s8_hidden
    net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                        nn.Linear(hidden, 1)).to(device)
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    base = copy.deepcopy(net).to("meta")  # holds no weights: each call supplies them
    args = (params, *sine_tasks(sizes, device))
    case = engine_case("S8", f"{sizes.s8_tasks} tasks, MLP 1-{hidden}-{hidden}-1, "
                       f"{sizes.s8_points}+{sizes.s8_points} points",
                       maml_step(base), args, sizes=sizes, inductor=True,
                       loop=maml_step_loop(base), notes={HAND: S8_HAND_NOTE},
                       rtol=1e-4, atol=1e-5)
    query_losses = maml_query_losses(base)

    # NOTE [The jit contenders of S8]
    # jit traces into a program, and a trace refuses torch.autograd.grad on its values
    # (UnsupportedOperationError), so jit cannot hold the whole meta-step. Its contenders
    # compile the vmapped query losses (the transforms), called with the requires_grad
    # meta-parameters: the program replays plain torch calls, and the outer backward runs
    # through torch's autograd over them, as eager minifunctorch's does.
    def jit_then_outer_backward(backend=None):
        jit = find_jit()
        if jit is None:
            raise NotAvailable("not available: minifunctorch.core has no jit yet")
        options = {} if backend is None else {"backend": backend}
        losses = jit(query_losses(mft), **options)
        return lambda: meta_gradients(losses(*args), params)

    case.builders[MFT_JIT] = jit_then_outer_backward
    if MFT_INDUCTOR in case.builders:
        case.builders[MFT_INDUCTOR] = functools.partial(jit_then_outer_backward, "inductor")
    return [case]


# --- S9: the empirical NTK of a small CNN ---------------------------------------------------------
S9_HAND_NOTE = ("left out: the Jacobian of a CNN's outputs w.r.t. its convolution weights has "
                "no einsum closed form (as in S7); batching it by hand would be a second "
                "implementation to benchmark, not a floor")


def ntk_cnn(sizes):
    """conv in→c1 3×3, relu, conv c1→c2 3×3, relu, flatten, linear (the NTK tutorial's kind
    of model: no pooling, no softmax), on in×image×image inputs."""
    c1, c2 = sizes.s9_channels
    side = sizes.s9_image - 4
    return nn.Sequential(nn.Conv2d(sizes.s9_in_channels, c1, 3), nn.ReLU(),
                         nn.Conv2d(c1, c2, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(c2 * side * side, sizes.s9_classes))


def empirical_ntk(net):
    """transform(api) -> ntk(params, x1, x2), the torch.func NTK tutorial's "Jacobian
    contraction": per example (vmap), the Jacobian of the network's outputs w.r.t. its
    parameters (jacrev through functional_call), for x1 and for x2; then, per parameter,
    ``einsum('Naf,Mbf->NMab')`` of the flattened Jacobians, summed over the parameters.
    The kernel is (N, M, classes, classes)."""
    def transform(api):
        def net_single(params, x):
            return api.functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

        def ntk(params, x1, x2):
            jac1 = api.vmap(api.jacrev(net_single), (None, 0))(params, x1)
            jac2 = api.vmap(api.jacrev(net_single), (None, 0))(params, x2)
            return _contract_jacobians(jac1, jac2)
        return ntk
    return transform


def _contract_jacobians(jac1, jac2):
    """Σ over parameters of einsum('Naf,Mbf->NMab') of the per-example Jacobians (each a
    dict name -> (examples, outputs, *parameter shape))."""
    return torch.stack([torch.einsum("Naf,Mbf->NMab", jac1[name].flatten(2),
                                     jac2[name].flatten(2)) for name in jac1]).sum(0)


def empirical_ntk_loop(net):
    """The loop: the network itself (its own parameters, the same values), one forward per
    example and one ``torch.autograd.grad`` per output of it, giving the same per-example
    Jacobians; then the same contraction."""
    names, leaves = zip(*net.named_parameters())

    def jacobians(x):
        per_example = []
        for i in range(x.shape[0]):
            outputs = net(x[i:i + 1]).squeeze(0)
            rows = [torch.autograd.grad(output, leaves, retain_graph=True)
                    for output in outputs]  # one tuple of parameter gradients per output
            per_example.append([torch.stack([row[j] for row in rows])
                                for j in range(len(names))])
        return {name: torch.stack([jacobian[j] for jacobian in per_example])
                for j, name in enumerate(names)}

    def loop(params, x1, x2):
        return _contract_jacobians(jacobians(x1), jacobians(x2))
    return loop


def s9_cases(sizes, device) -> list:
    torch.manual_seed(90)
    net = ntk_cnn(sizes).to(device)
    params = {k: v.detach() for k, v in net.named_parameters()}
    side, (n, m) = sizes.s9_image, sizes.s9_examples
    x1 = _randn(n, sizes.s9_in_channels, side, side, device=device, seed=91)
    x2 = _randn(m, sizes.s9_in_channels, side, side, device=device, seed=92)
    c1, c2 = sizes.s9_channels
    name = f"CNN {c1}-{c2} on {sizes.s9_in_channels}×{side}×{side}, N={n}, M={m}"
    return [engine_case("S9", name, empirical_ntk(net), (params, x1, x2), sizes=sizes,
                        inductor=True, loop=empirical_ntk_loop(net), notes={HAND: S9_HAND_NOTE},
                        rtol=1e-4, atol=1e-5)]


# --- S10: an ensemble of small CNNs (stack_module_state) ------------------------------------------
def cnn_ensemble(models, in_dims):
    """transform(api) -> predict(x), the torch.func model-ensembling tutorial's program with
    S7's CNN: ``api.stack_module_state(models)`` (once, when the contender is built), a base
    model on the meta device, and ``vmap(fmodel, in_dims=in_dims)`` over the models:
    (0, 0, None) gives every model the same minibatch, (0, 0, 0) each its own."""
    base = copy.deepcopy(models[0]).to("meta")  # holds no weights: each call supplies them

    def transform(api):
        params, buffers = api.stack_module_state(models)
        # stack_module_state returns leaves that require grad (for training the ensemble);
        # here every contender computes predictions only, as in S5, so that none records an
        # autograd graph that the loop (under no_grad) does not.
        params = {k: v.detach() for k, v in params.items()}
        buffers = {k: v.detach() for k, v in buffers.items()}

        def fmodel(params, buffers, x):
            return api.functional_call(base, (params, buffers), (x,))

        ensemble = api.vmap(fmodel, in_dims=in_dims)
        return lambda x: ensemble(params, buffers, x)
    return transform


def cnn_ensemble_loop(models, shared):
    """The loop: each model itself on the shared minibatch, or on its own, under no_grad."""
    def loop(x):
        with torch.no_grad():
            return torch.stack([model(x if shared else x[i]) for i, model in enumerate(models)])
    return loop


def cnn_ensemble_hand(models, shared):
    """The floor: the models side by side in the channels. The first convolution of a shared
    minibatch is one convolution with every model's output channels; of one minibatch per
    model, and for the second convolution, one grouped convolution (groups = the number of
    models); the linear layer is an einsum."""
    stacked = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
               for name in dict(models[0].named_parameters())}
    n_models = len(models)

    def conv(h, name, groups):  # name: small_cnn's "0" (first conv) or "3" (second)
        return F.conv2d(h, stacked[name + ".weight"].flatten(0, 1),
                        stacked[name + ".bias"].flatten(), groups=groups)

    def relu_pool(h):
        # Pooled channels-last, as the engine pools (NOTE [Max pooling on the CPU runs
        # channels-last] in core/nn.py): torch's CPU max-pool kernel is not vectorized over
        # contiguous (N, C, H, W) planes, and 80 or 160 channels make it several times slower
        # than the channels-last one. A floor without it would be slower than the engine for
        # a reason that has nothing to do with batching.
        return F.max_pool2d(F.relu(h).contiguous(memory_format=torch.channels_last), 2)

    def hand(x):
        if shared:  # (batch, 1, side, side): every model's channels from one convolution
            h = conv(x, "0", groups=1)
        else:  # (models, batch, 1, side, side) -> (batch, models·1, side, side)
            h = conv(x.transpose(0, 1).flatten(1, 2), "0", groups=n_models)
        h = relu_pool(conv(relu_pool(h), "3", groups=n_models))
        h = h.unflatten(1, (n_models, -1)).flatten(2)  # (batch, models, c2·side·side)
        logits = torch.einsum("moi,bmi->mbo", stacked["7.weight"], h) \
            + stacked["7.bias"][:, None]
        return torch.log_softmax(logits, dim=-1)
    return hand


def s10_cases(sizes, device) -> list:
    torch.manual_seed(100)
    models = [small_cnn(sizes.s10_channels, sizes.s10_image, sizes.s10_classes).to(device)
              for _ in range(sizes.s10_models)]
    n_models, batch, side = sizes.s10_models, sizes.s10_batch, sizes.s10_image
    shared_x = _randn(batch, 1, side, side, device=device, seed=101)
    own_x = _randn(n_models, batch, 1, side, side, device=device, seed=102)
    c1, c2 = sizes.s10_channels
    cases = []
    for shared, x, what in ((True, shared_x, "one minibatch"), (False, own_x, "own minibatches")):
        in_dims = (0, 0, None) if shared else (0, 0, 0)
        cases.append(engine_case(
            "S10", f"{n_models} CNNs {c1}-{c2} on 1×{side}×{side}, {what}, B={batch}",
            cnn_ensemble(models, in_dims), (x,), sizes=sizes, inductor=True,
            loop=cnn_ensemble_loop(models, shared), hand=cnn_ensemble_hand(models, shared),
            rtol=1e-4, atol=1e-5))
    return cases


# Every group: how its cases are measured (each inner list is timed together).
GROUPS = {
    "S1": lambda sizes, device: s1_cases(sizes, device),
    "S2": lambda sizes, device: [[case] for case in s2_cases(sizes, device)],
    "S3": lambda sizes, device: [[case] for case in s3_cases(sizes, device)],
    "S4": lambda sizes, device: [[case] for case in s4_cases(sizes, device)],
    "S5": lambda sizes, device: [[case] for case in s5_cases(sizes, device)],
    "S7": lambda sizes, device: [[case] for case in s7_cases(sizes, device)],
    "S8": lambda sizes, device: [[case] for case in s8_cases(sizes, device)],
    "S9": lambda sizes, device: [[case] for case in s9_cases(sizes, device)],
    "S10": lambda sizes, device: [[case] for case in s10_cases(sizes, device)],
}


def all_cases(sizes, device, groups=None) -> dict:
    """group -> list of measurement groups (each a list of cases timed together); only the
    ``groups`` named, if given (S6 is not here: it is built by ``s6_first_result_cases``)."""
    unknown = set(groups or ()) - set(GROUPS) - {"S6"}
    if unknown:
        raise ValueError(f"all_cases(groups={sorted(groups)}): no group {sorted(unknown)}; "
                         f"the groups are {', '.join(GROUPS)} and S6.")
    return {group: build(sizes, device) for group, build in GROUPS.items()
            if groups is None or group in groups}
