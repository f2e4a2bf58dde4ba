"""The oracle of the op tests: an op case under every transform, checked against torch.func.

A transform is written once, as a function of a transform namespace (``minifunctorch.core``
or ``torch.func``) and an op case (op_table.OpCase), and run with both: torch.func is the
oracle. Test files of each family of ops parametrize over their own cases:

    @pytest.mark.parametrize("case, transform", transform_params(CASES))
    def test_op_under_transform(case, transform):
        check_under_transform(case, transform)
"""
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from op_table import DTYPE


# --- helpers -----------------------------------------------------------------------------------
def _random_like(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=DTYPE)


def _scalarized(case, example_args, seed=7):
    """``(f(*args) * w).sum()`` for fixed random weights ``w`` of the output's shape."""
    weights = _random_like(case.fn(*example_args).shape, seed)

    def scalarized(*args):
        return (case.fn(*args) * weights).sum()
    return scalarized


def _of_diff(case, f, args):
    """``f`` as a function of the differentiable arguments only, the others held fixed."""
    def f_of_diff(*diff_args):
        full = list(args)
        for argnum, value in zip(case.diff, diff_args):
            full[argnum] = value
        return f(*full)
    return f_of_diff


def _diff_args(case, args):
    return tuple(args[i] for i in case.diff)


def _argnums(case):
    return case.diff[0] if len(case.diff) == 1 else case.diff


def _tangents(case, args, seed=11):
    return tuple(_random_like(a.shape, seed + i) for i, a in enumerate(_diff_args(case, args)))


def _output_weights_arg(case, example_args):
    """For one-input ops, vmap's mixed in_dims need a second input: output-shaped weights."""
    return _random_like(case.fn(*example_args).shape, 5)


# --- the transforms, written once for both namespaces -------------------------------------------
def t_grad(ft, case):
    args = case.sample()
    return ft.grad(_scalarized(case, args), argnums=_argnums(case))(*args)


def t_vjp(ft, case):
    args = case.sample()
    out, vjp_fn = ft.vjp(_of_diff(case, case.fn, args), *_diff_args(case, args))
    return out, vjp_fn(_random_like(out.shape, 3))


def t_jvp(ft, case):
    args = case.sample()
    return ft.jvp(_of_diff(case, case.fn, args), _diff_args(case, args), _tangents(case, args))


def t_vmap_0(ft, case):
    return ft.vmap(case.fn)(*case.batch())


def _vmap_mixed(ft, case, batched_positions):
    batched, example = case.batch(), case.sample()
    if len(example) == 1:  # a second, output-shaped input to mix with
        weights = _output_weights_arg(case, example)
        batched = batched + (torch.stack([weights * (i + 1) for i in range(len(batched[0]))]),)
        example = example + (weights,)
        f = lambda x, w: case.fn(x) * w  # noqa: E731
    else:
        f = case.fn
    inputs = [b if i in batched_positions(len(example)) else e
              for i, (b, e) in enumerate(zip(batched, example))]
    in_dims = tuple(0 if i in batched_positions(len(example)) else None
                    for i in range(len(example)))
    return ft.vmap(f, in_dims=in_dims)(*inputs)


def t_vmap_first(ft, case):
    """Only the first input is batched: in_dims=(0, None, ...)."""
    return _vmap_mixed(ft, case, lambda n: {0})


def t_vmap_rest(ft, case):
    """Every input but the first is batched: in_dims=(None, 0, ...)."""
    return _vmap_mixed(ft, case, lambda n: set(range(1, n)))


def t_vmap_dim1(ft, case):
    """Batch dims that are not in front: dim 1 (dim 0 for 0-d examples), or the last dim."""
    batched = case.batch()
    inputs, in_dims = [], []
    for i, b in enumerate(batched):
        dim = min(1, b.dim() - 1) if i % 2 == 0 else -1
        inputs.append(torch.movedim(b, 0, dim))
        in_dims.append(dim)
    return ft.vmap(case.fn, in_dims=tuple(in_dims))(*inputs)


def t_jacrev(ft, case):
    args = case.sample()
    return ft.jacrev(case.fn, argnums=_argnums(case))(*args)


def t_jacfwd(ft, case):
    args = case.sample()
    return ft.jacfwd(case.fn, argnums=_argnums(case))(*args)


def t_vmap_grad(ft, case):
    scalarized = _scalarized(case, case.sample())
    return ft.vmap(ft.grad(scalarized, argnums=_argnums(case)))(*case.batch())


def t_grad_grad(ft, case):
    args = case.sample()
    first = case.diff[0]
    inner = ft.grad(_scalarized(case, args), argnums=first)
    weights = _random_like(args[first].shape, 13)
    return ft.grad(lambda *a: (inner(*a) * weights).sum(), argnums=_argnums(case))(*args)


def t_jacfwd_jacrev(ft, case):
    args = case.sample()
    first = case.diff[0]
    return ft.jacfwd(ft.jacrev(case.fn, argnums=first), argnums=first)(*args)


def t_vmap_jacrev(ft, case):
    return ft.vmap(ft.jacrev(case.fn, argnums=case.diff[0]))(*case.batch())


def t_jvp_grad(ft, case):
    args = case.sample()
    inner = ft.grad(_scalarized(case, args), argnums=case.diff[0])
    return ft.jvp(_of_diff(case, inner, args), _diff_args(case, args), _tangents(case, args))


def t_hessian(ft, case):
    args = case.sample()
    return ft.hessian(_scalarized(case, args), argnums=case.diff[0])(*args)


TRANSFORMS = {
    "grad": t_grad, "vjp": t_vjp, "jvp": t_jvp,
    "vmap_0": t_vmap_0, "vmap_first": t_vmap_first, "vmap_rest": t_vmap_rest,
    "vmap_dim1": t_vmap_dim1, "jacrev": t_jacrev, "jacfwd": t_jacfwd,
    "vmap_grad": t_vmap_grad, "grad_grad": t_grad_grad, "jacfwd_jacrev": t_jacfwd_jacrev,
    "vmap_jacrev": t_vmap_jacrev, "jvp_grad": t_jvp_grad,
}

# Known engine bugs, (op name, transform) -> reason; each is an xfail(strict=True).
KNOWN_FAILURES: dict = {}


def transform_params(cases, known_failures=None):
    """pytest params (case, transform) for every case under every transform."""
    known_failures = KNOWN_FAILURES if known_failures is None else known_failures
    for case in cases:
        names = list(TRANSFORMS) + (["hessian"] if case.hessian else [])
        for transform in names:
            marks = ()
            reason = known_failures.get((case.name, transform))
            if reason:
                marks = (pytest.mark.xfail(strict=True, reason=reason),)
            yield pytest.param(case, transform, id=f"{case.name}-{transform}", marks=marks)


def _assert_plain_tensors(tree):
    for leaf in torch.utils._pytree.tree_leaves(tree):
        assert type(leaf) is torch.Tensor, f"a transform returned a {type(leaf).__name__}"


def assert_same(ours, theirs):
    _assert_plain_tensors(ours)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)


def aten_calls(f):
    """How many times ``f()`` ran each aten op (torch's profiler, by name: "aten::mul"), and
    its result: the tests that say which kernels a rule runs count with it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = f()
    return {event.key: event.count for event in prof.key_averages()}, result


def check_under_transform(case, transform):
    build = TRANSFORMS.get(transform, t_hessian)
    expected = build(tf, case)
    actual = build(mf, case)
    assert_same(actual, expected)


# --- finite differences ------------------------------------------------------------------------
def central_differences(f, args, argnum, eps=1e-6):
    """The gradient of the scalar ``f(*args)`` with respect to ``args[argnum]``, by central
    differences (float64 arguments)."""
    x = args[argnum]
    gradient = torch.zeros_like(x)
    flat = gradient.view(-1)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = eps
        step = step.view(x.shape)
        plus = list(args)
        minus = list(args)
        plus[argnum] = x + step
        minus[argnum] = x - step
        flat[i] = (f(*plus) - f(*minus)) / (2 * eps)
    return gradient


def check_finite_differences(case):
    args = case.sample(seed=4)
    scalarized = _scalarized(case, args, seed=17)
    ours = mf.grad(scalarized, argnums=case.diff)(*args)
    for argnum, g in zip(case.diff, ours):
        expected = central_differences(scalarized, args, argnum)
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{case.name}, argument {argnum}: {m}")
