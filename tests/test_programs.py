"""Programs (issue 3): trace, the typed IR, its printer, typechecker and evaluator, the FX and
Python exports, and reverse mode as a program transformation (vjp_program, split_vjp).

Every primitive is reached from user-level torch code, and each traced program must
- evaluate to what the function computes,
- typecheck,
- be stable: tracing the program gives the same text back,
- export (generated Python and torch.fx) to code that computes the same thing.
"""
import dataclasses
import re
from typing import Callable

import optree
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch.testing import assert_close

from minifunctorch.core import (
    PRIMITIVES,
    Equation,
    Program,
    TransformError,
    TypecheckError,
    UnsupportedOperationError,
    Var,
    custom_vjp,
    grad,
    hessian,
    jvp,
    split_vjp,
    trace,
    vjp_program,
    vmap,
)
from minifunctorch.core import primitives as P
from minifunctorch.core.dispatch import transform_levels


@pytest.fixture(autouse=True)
def _no_level_left_behind():
    assert not transform_levels(), "a previous test left a transform level"
    yield
    assert not transform_levels(), f"the test left transform levels: {transform_levels()}"


def rand(seed, *shape, low=None):
    g = torch.Generator().manual_seed(seed)
    if low is not None:  # positive values in [low, low + 1.5): log, sqrt, divisors
        return torch.rand(shape, generator=g) * 1.5 + low
    return torch.randn(shape, generator=g)


def distinct(seed, *shape):
    """Values without ties (amax/amin, comparisons)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for size in shape:
        n *= size
    return (torch.randperm(n, generator=g).float() * 0.25 - n * 0.125).reshape(shape)


def flat_tensors(args):
    return [leaf for leaf in optree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]


# --- one case per user-level operation -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    make: Callable  # seed -> tuple of arguments

    def __repr__(self):
        return self.name


def unary(name, fn, shape=(2, 3), low=None):
    return Case(name, fn, lambda s: (rand(s, *shape, low=low),))


def binary(name, fn, x_shape=(2, 3), y_shape=(2, 3), y_low=None):
    return Case(name, fn, lambda s: (rand(s, *x_shape), rand(s + 100, *y_shape, low=y_low)))


CASES = [
    # elementwise, one input
    unary("neg", lambda x: -x),
    unary("exp", torch.exp),
    unary("log", torch.log, low=0.5),
    unary("sin", torch.sin),
    unary("cos", lambda x: x.cos()),
    unary("tanh", torch.tanh),
    unary("sigmoid", torch.sigmoid),
    unary("relu", F.relu),
    unary("abs", abs),
    unary("sqrt", torch.sqrt, low=0.5),
    unary("sign", torch.sign),
    # a random draw whose numbers are certain: bernoulli of ones (NOTE [Random numbers in a
    # traced program])
    unary("draw", lambda x: x * torch.bernoulli(torch.ones_like(x))),
    # binary, with broadcasting and Python numbers on either side
    binary("add", torch.add),
    binary("add_alpha_broadcast", lambda x, y: torch.add(x, y, alpha=2.0), y_shape=(3,)),
    binary("sub_broadcast", lambda x, y: x - y, y_shape=(2, 1)),
    unary("rsub_scalar", lambda x: 1.5 - x),
    binary("mul_broadcast_outer", lambda x, y: x * y, (3, 1), (1, 4)),
    unary("mul_scalars", lambda x: 3.0 * x * 2),
    binary("div", lambda x, y: x / y, y_low=0.5),
    unary("rdiv_scalar", lambda x: 1.0 / x, low=0.5),
    binary("pow_tensor", lambda x, y: torch.pow(y, x), y_low=0.5),
    unary("pow_int", lambda x: x ** 3),
    unary("rpow", lambda x: 2 ** x),
    Case("comparisons", lambda x, y: (x == y, x != y, x < y, x <= y, x > y, x >= y),
         lambda s: (distinct(s, 2, 3), distinct(s + 1, 2, 3))),
    binary("where", lambda x, y: torch.where(x > y, x, y)),
    unary("where_scalar", lambda x: torch.where(x > 0, x, 0.0)),
    unary("where_neg_inf", lambda x: torch.where(x > 0, x, float("-inf"))),
    # reductions, with dims and keepdim
    unary("sum_all", lambda x: x.sum()),
    unary("sum_dim_keepdim", lambda x: torch.sum(x, dim=1, keepdim=True), (2, 3, 4)),
    unary("mean_dims", lambda x: x.mean(dim=(0, -1)), (2, 3, 4)),
    Case("amax_dim", lambda x: torch.amax(x, dim=-1), lambda s: (distinct(s, 3, 4),)),
    Case("amin_keepdim", lambda x: torch.amin(x, 0, keepdim=True), lambda s: (distinct(s, 3, 4),)),
    Case("max_all", lambda x: x.max(), lambda s: (distinct(s, 3, 4),)),
    unary("logsumexp", lambda x: torch.logsumexp(x, dim=1, keepdim=True)),
    unary("softmax", lambda x: torch.softmax(x, dim=-1)),
    unary("log_softmax", lambda x: F.log_softmax(x, dim=0)),
    # matmul: matrix-matrix, matrix-vector, vector-matrix, dot, batched, broadcast batch
    binary("matmul_mm", lambda x, y: x @ y, (2, 3), (3, 4)),
    binary("matmul_mv", torch.mv, (2, 3), (3,)),
    binary("matmul_vm", torch.matmul, (3,), (3, 4)),
    binary("matmul_dot", torch.dot, (3,), (3,)),
    binary("matmul_bmm", torch.bmm, (2, 3, 4), (2, 4, 5)),
    binary("matmul_broadcast", torch.matmul, (2, 3, 4), (4, 5)),
    Case("linear", F.linear, lambda s: (rand(s, 5, 3), rand(s + 1, 4, 3), rand(s + 2, 4))),
    # shape
    unary("permute", lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    unary("transpose_T", lambda x: x.T + x.transpose(0, 1)),
    unary("reshape", lambda x: x.reshape(3, -1).view(6, 2), (2, 3, 2)),
    unary("flatten", lambda x: torch.flatten(x, 1), (2, 3, 2)),
    unary("unsqueeze", lambda x: x.unsqueeze(-1)),
    unary("squeeze", lambda x: x.squeeze() + x.squeeze(0).sum(), (1, 3, 1)),
    unary("expand", lambda x: x.expand(4, 2, 3) + x.expand_as(torch.ones(2, 3)), (2, 1)),
    unary("broadcast_to", lambda x: torch.broadcast_to(x, (2, 3)), (3,)),
    binary("cat", lambda x, y: torch.cat([x, y, x], dim=-1), (2, 3), (2, 1)),
    binary("stack", lambda x, y: torch.stack([x, y], dim=1)),
    # basic indexing: ints (negative too), slices (with steps), None and ...
    unary("getitem_int", lambda x: x[0] + x[-1], (3, 4)),
    unary("getitem_slices", lambda x: x[1:, 1:3] * x[::2, -2:], (3, 4)),
    unary("getitem_none_ellipsis", lambda x: x[None, ..., 0] + x[1:, None, -2].sum(), (3, 4)),
    # diagonals
    unary("diag_of_vector", torch.diag, (3,)),
    unary("diag_of_matrix", lambda x: torch.diag(x) + x.diagonal(offset=1)[0], (3, 3)),
    unary("trace", torch.trace, (3, 3)),
    unary("diag_embed", torch.diag_embed, (2, 3)),
    # gather, directly and through the losses
    Case("cross_entropy", lambda logits, target: F.cross_entropy(logits, target),
         lambda s: (rand(s, 4, 3), torch.randint(0, 3, (4,),
                                                 generator=torch.Generator().manual_seed(s)))),
    Case("gather", lambda x, index: torch.gather(x, 1, index),
         lambda s: (rand(s, 3, 4), torch.randint(0, 4, (3, 2),
                                                 generator=torch.Generator().manual_seed(s)))),
    # creation and conversion
    unary("zeros_ones_like", lambda x: x * torch.ones_like(x) + torch.zeros_like(x)),
    unary("full_like", lambda x: torch.full_like(x, 2.5) - x),
    unary("to_dtype", lambda x: x.to(torch.float64) * x.double().float().to(dtype=torch.float64)),
    unary("detach", lambda x: x.detach() * x),
    unary("no_grad", lambda x: _no_grad_region(x)),
    unary("clone", lambda x: x.clone() * x),
    unary("div_rounding", lambda x: torch.div(x, 0.3, rounding_mode="floor") + x),
    # complex numbers, between real inputs and outputs
    unary("complex_numbers", lambda x: _complex_numbers(x)),
    # a captured tensor (a constant of the program)
    unary("captured_constant", lambda x: x * CONSTANT + CONSTANT.sum()),
    # the transposes of getitem, gather and diagonal appear in backward programs (cross_entropy's
    # is nll_loss_backward: NOTE [nll_loss: torch's kernels as a linear pair])
    unary("grad_getitem", grad(lambda x: (x[1:, ::2] ** 2).sum() + x[0, -1]), (3, 4)),
    Case("grad_cross_entropy", grad(lambda logits, target: F.cross_entropy(logits, target)),
         lambda s: (rand(s, 4, 3), torch.randint(0, 3, (4,),
                                                 generator=torch.Generator().manual_seed(s)))),
    Case("grad_gather", grad(lambda x, index: torch.gather(x, 1, index).sin().sum()),
         lambda s: (rand(s, 3, 4), torch.randint(0, 4, (3, 2),
                                                 generator=torch.Generator().manual_seed(s)))),
    unary("grad_trace", grad(lambda x: torch.sin(torch.trace(x))), (3, 3)),
    unary("grad_softmax", grad(lambda x: (torch.softmax(x, dim=-1) * x).sum())),
]
CONSTANT = torch.linspace(-1.0, 1.0, 3)


def _no_grad_region(x):
    with torch.no_grad():
        y = x * 2
    return y * x


def _complex_numbers(x):
    z = torch.complex(x, x * 2)
    w = torch.view_as_complex(torch.view_as_real(z.conj_physical()) * 2)
    return w.real + w.imag + w.angle() + torch.view_as_real(w.sgn()).sum(-1)


def primitive_names(program):
    return {equation.prim.name for equation in program.equations}


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_traced_program_evaluates_typechecks_and_is_stable(case):
    args = case.make(0)
    program = trace(case.fn)(*args)
    assert isinstance(program, Program)
    assert program.typecheck() is program
    assert_close(program(*args), case.fn(*args))
    # the program works for any input of the same types, not only the example
    new_args = case.make(1)
    assert_close(program(*new_args), case.fn(*new_args))
    # tracing the program gives the program back
    assert str(trace(program)(*args)) == str(program)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_exports_compute_the_program(case):
    args = case.make(2)
    program = trace(case.fn)(*args)
    tensors = flat_tensors(args)
    expected = optree.tree_leaves(program(*args))
    assert_close(list(program.compile_python()(*tensors)), expected)
    graph_module = program.to_fx()
    graph_module.graph.lint()
    assert_close(list(graph_module(*tensors)), expected)


def test_cases_reach_every_primitive_of_the_course():
    """Every primitive of core/primitives.py (the course's first pass) appears in some program
    here; the families' primitives are covered by their own tests and the OpInfo sweep."""
    import minifunctorch.core.primitives as P
    course = {value.name for name, value in vars(P).items() if name.endswith("_p")}
    course.discard("to_device")  # it needs a second device (a GPU run reaches it)
    reached = set()
    for case in CASES:
        reached |= primitive_names(trace(case.fn)(*case.make(0)))
    assert course <= reached, f"not reached: {sorted(course - reached)}"
    assert reached <= set(PRIMITIVES), f"unknown: {sorted(reached - set(PRIMITIVES))}"


# --- golden text -------------------------------------------------------------------------------
def test_golden_sin_times_two():
    program = trace(lambda x: torch.sin(x) * 2)(torch.ones(3))
    assert str(program) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
      c:f32[3] = mul b 2
  in (c,) }"""


def simple(a, b):
    return ((a + b) * b).sum()


def test_golden_grad_of_simple_wrt_both_arguments():
    program = trace(grad(simple, argnums=(0, 1)))(torch.ones(3), torch.ones(3))
    assert str(program) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = add a b
      d:f32[3] = mul c b
      e:f32[] = sum d dim=(0,) keepdim=False
      f:f32[] = full_like e fill_value=1
      g:f32[3] = expand f shape=(3,)
      h:f32[3] = mul g b
      i:f32[3] = mul g c
      j:f32[3] = add i h
  in (h, j) }"""
    a, b = rand(1, 3), rand(2, 3)
    assert_close(program(a, b), tf.grad(simple, argnums=(0, 1))(a, b))


def test_golden_vmap_of_matrix_vector_product():
    A, xs = rand(1, 3, 4), rand(2, 5, 4)
    program = trace(vmap(torch.mv, in_dims=(None, 0)))(A, xs)
    assert str(program) == """\
{ lambda ; a:f32[3,4] b:f32[5,4] .
  let c:f32[4,3] = permute a dims=(1,0)
      d:f32[5,3] = matmul b c
  in (d,) }"""
    assert_close(program(A, xs), tf.vmap(torch.mv, in_dims=(None, 0))(A, xs))


def test_golden_constants_are_binders_before_the_semicolon():
    weight = torch.arange(3.0)
    program = trace(lambda x: x * weight + 1)(torch.ones(3))
    assert str(program) == """\
{ lambda b:f32[3] ; a:f32[3] .
  let c:f32[3] = mul a b
      d:f32[3] = add c 1
  in (d,) }"""


def test_golden_generated_code():
    program = trace(lambda x, y: torch.cat([x[1:], y.sum(0, keepdim=True)]))(
        torch.ones(3), torch.ones(2))
    source, _ = program.python_source()
    assert source == """\
def _lambda_(a, b):
    c = a[1:3]
    d = torch.sum(b, dim=(0,), keepdim=True)
    e = torch.cat([c, d], dim=0)
    return (e,)
"""


def test_repr_and_html():
    program = trace(lambda x: torch.where(x < 1, x, 0.5))(torch.ones(2))
    assert repr(program) == "<Program <lambda>: 1 inputs, 0 constants, 2 equations>"
    html = program._repr_html_()
    assert '<span class="mft-prim">where</span>' in html
    assert '<span class="mft-literal">0.5</span>' in html
    # the text without its tags is the printed program
    assert re.sub(r"<style>.*?</style>|<[^>]+>", "", html) == str(program)


def test_html_escapes_names():
    # a custom function made from a lambda is a primitive called `<lambda>`
    odd = custom_vjp(lambda x: torch.sin(x))
    odd.defvjp(lambda x: (torch.sin(x), x), lambda x, ct: (ct * torch.cos(x),))
    program = trace(lambda x: odd(x) * 2)(torch.ones(2))
    assert "= <lambda> a" in str(program)
    html = program._repr_html_()
    assert '<span class="mft-prim">&lt;lambda&gt;</span>' in html
    text = re.sub(r"<style>.*?</style>|<[^>]+>", "", html)
    assert text.replace("&lt;", "<").replace("&gt;", ">") == str(program)


# --- tracing composes with the transforms ----------------------------------------------------
def mlp_loss(params, x, target):
    w1, b1, w2, b2 = params
    hidden = torch.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    return F.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))


def mlp_inputs(seed):
    params = (rand(seed, 4, 5), rand(seed + 1, 5), rand(seed + 2, 5, 3), rand(seed + 3, 3))
    xs = rand(seed + 4, 6, 4)
    targets = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(seed))
    return params, xs, targets


def f_scalar(x):
    return (torch.sin(x) * x).sum() + (x ** 2).mean()


def test_trace_of_grad():
    program = trace(grad(f_scalar))(rand(0, 4))
    x = rand(1, 4)
    assert_close(program(x), tf.grad(f_scalar)(x))


def test_trace_of_vmap():
    f = lambda x, y: torch.softmax(x, -1) @ y  # noqa: E731
    program = trace(vmap(f, in_dims=(0, None)))(rand(0, 5, 3), rand(1, 3, 2))
    x, y = rand(2, 5, 3), rand(3, 3, 2)
    assert_close(program(x, y), tf.vmap(f, in_dims=(0, None))(x, y))


def test_trace_of_jvp():
    f = lambda x: torch.tanh(x) * x.sum()  # noqa: E731

    def jvp_of_f(x, v):
        return jvp(f, (x,), (v,))

    program = trace(jvp_of_f)(rand(0, 3), rand(1, 3))
    x, v = rand(2, 3), rand(3, 3)
    assert_close(program(x, v), tf.jvp(f, (x,), (v,)))


def test_trace_of_vmap_of_grad_of_mlp_loss():
    params, xs, targets = mlp_inputs(0)
    per_example = vmap(grad(mlp_loss), in_dims=(None, 0, 0))
    program = trace(per_example)(params, xs, targets)
    program.typecheck()
    params, xs, targets = mlp_inputs(10)
    expected = tf.vmap(tf.grad(mlp_loss), in_dims=(None, 0, 0))(params, xs, targets)
    assert_close(program(params, xs, targets), expected)


def test_trace_of_hessian():
    program = trace(hessian(f_scalar))(rand(0, 3))
    program.typecheck()
    x = rand(1, 3)
    assert_close(program(x), tf.hessian(f_scalar)(x))


def test_transforms_of_a_program():
    program = trace(f_scalar)(rand(0, 3))
    xs = rand(1, 4, 3)
    assert_close(grad(program)(xs[0]), tf.grad(f_scalar)(xs[0]))
    assert_close(vmap(program)(xs), tf.vmap(f_scalar)(xs))


def test_trace_keeps_pytree_structure_and_static_arguments():
    def f(inputs, scale, mode):
        out = inputs["x"] * scale + inputs["y"][0]
        return {"out": out, "sum": out.sum() if mode == "sum" else out.mean()}

    inputs = {"x": rand(0, 3), "y": (rand(1, 3),)}
    program = trace(f)(inputs, 2.0, "sum")
    assert len(program.inputs) == 2  # numbers and strings are static, not inputs
    new = {"x": rand(2, 3), "y": (rand(3, 3),)}
    assert_close(program(new, 2.0, "sum"), f(new, 2.0, "sum"))
    with pytest.raises(TransformError, match=r"expected inputs with the traced structure"):
        program(new["x"], 2.0, "sum")
    with pytest.raises(TransformError, match=r"input 0 should have type f32\[3\], got shape"):
        program({"x": rand(2, 4), "y": (rand(3, 3),)}, 2.0, "sum")


def test_data_dependent_python_control_flow_fails_loudly():
    def f(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(TransformError, match=r"^trace\(f\)\(<inputs>\): Python needed the "
                                             r"concrete value of a traced tensor"):
        trace(f)(torch.ones(3))


# --- typecheck ---------------------------------------------------------------------------------
def test_typecheck_rejects_a_wrong_declared_type():
    program = trace(lambda x: torch.sin(x) * 2)(torch.ones(3))
    sin_eq, mul_eq = program.equations
    wrong = Var((4,), torch.float32)
    corrupted = program.replace(equations=[
        Equation(sin_eq.prim, sin_eq.inputs, sin_eq.params, wrong),
        Equation(mul_eq.prim, [wrong, *mul_eq.inputs[1:]], mul_eq.params, mul_eq.out),
    ])
    with pytest.raises(TypecheckError, match=re.escape(
            "program.typecheck(): equation 0 `b:f32[4] = sin a` declares f32[4], but the shape "
            "rule of sin derives f32[3]. Fix:")):
        corrupted.typecheck()


def test_typecheck_names_an_operand_that_is_never_defined():
    program = trace(lambda x: torch.sin(x) * 2)(torch.ones(3))
    sin_eq, mul_eq = program.equations
    stray = Var((3,), torch.float32)
    corrupted = program.replace(equations=[
        sin_eq, Equation(mul_eq.prim, [stray, *mul_eq.inputs[1:]], mul_eq.params, mul_eq.out)])
    with pytest.raises(TypecheckError, match=re.escape(
            "program.typecheck(): equation 1 `c:f32[3] = mul ? 2` uses ? before it is defined")):
        corrupted.typecheck()


def test_typecheck_rejects_a_wrong_dtype():
    program = trace(lambda x: x.to(torch.float64))(torch.ones(3))
    eq = program.equations[0]
    corrupted = program.replace(equations=[
        Equation(eq.prim, eq.inputs, eq.params, Var((3,), torch.float32))])
    with pytest.raises(TypecheckError, match=r"equation 0 `b:f32\[3\] = convert a dtype=f64` "
                                             r"declares f32\[3\].*derives f64\[3\]"):
        corrupted.typecheck()


def test_typecheck_rejects_ill_typed_operands():
    program = trace(lambda x, y: (x * x, y))(torch.ones(3), torch.ones(4))
    eq = program.equations[0]
    x, y = program.inputs
    corrupted = program.replace(equations=[Equation(eq.prim, [x, y], eq.params, eq.out)])
    with pytest.raises(TypecheckError, match=r"^program\.typecheck\(\): equation 0 "
                                             r"`c:f32\[3\] = mul a b` is ill-typed"):
        corrupted.typecheck()


def test_typecheck_rejects_use_before_definition():
    program = trace(lambda x: torch.cos(torch.sin(x)))(torch.ones(3))
    corrupted = program.replace(equations=program.equations[::-1])
    with pytest.raises(TypecheckError, match=r"equation 0 `b:f32\[3\] = cos c` uses c before "
                                             r"it is defined"):
        corrupted.typecheck()


def test_evaluation_errors_name_the_equation():
    program = trace(lambda x, y: x @ y)(torch.ones(2, 3), torch.ones(3))
    # a program made by hand that lies about its input type fails where it computes
    lying = program.replace(inputs=[program.inputs[0], Var((3,), torch.float32)])
    with pytest.raises(TransformError):
        lying(torch.ones(2, 3), torch.ones(4))
    try:
        program.evaluate_flat([torch.ones(2, 3), torch.ones(4)])
    except RuntimeError as error:
        assert any("while evaluating `c:f32[2] = matmul a b`" in note
                   for note in getattr(error, "__notes__", []))
    else:
        pytest.fail("evaluating with a wrong shape must raise")


# --- reverse mode as a program transformation ---------------------------------------------------
def foo(x):
    return torch.sin(torch.trace(x)) * x


def bar(x):
    return x.T @ x


def broadcasting(x, y):
    return torch.exp(x) * y + x


def mlp(w1, b1, w2, x):
    return torch.tanh(x @ w1 + b1) @ w2


VJP_CASES = [
    ("foo", foo, lambda s: (rand(s, 3, 3),)),
    ("bar", bar, lambda s: (rand(s, 3, 4),)),
    ("broadcasting", broadcasting, lambda s: (rand(s, 3, 1), rand(s + 1, 4))),
    ("mlp", mlp, lambda s: (rand(s, 4, 5), rand(s + 1, 5), rand(s + 2, 5, 2), rand(s + 3, 6, 4))),
    ("two_outputs", lambda x, y: (x * y, torch.sin(x).sum()),
     lambda s: (rand(s, 3), rand(s + 1, 3))),
]


def cotangents_for(f, args, seed):
    outputs = f(*args)
    return tuple(rand(seed + i, *o.shape) for i, o in enumerate(optree.tree_leaves(outputs)))


def assert_lean(program):
    """No dead equation, and no arithmetic with a known zero (no `0 + x` accumulation)."""
    used = {o for eq in program.equations for o in eq.inputs} | set(program.outputs)
    for eq in program.equations:
        assert eq.out in used, f"dead equation `{program.equation_text(eq)}` in\n{program}"
    zeros = {eq.out for eq in program.equations
             if eq.prim is P.full_like_p and eq.params["fill_value"] == 0}
    for eq in program.equations:
        if eq.prim in (P.add_p, P.sub_p, P.mul_p, P.matmul_p):
            for o in eq.inputs:
                is_zero = o in zeros or (not isinstance(o, Var) and o.value == 0)
                assert not is_zero, f"`{program.equation_text(eq)}` computes with a zero"


@pytest.mark.parametrize("name, f, make", VJP_CASES, ids=[c[0] for c in VJP_CASES])
def test_vjp_program_matches_torch_func(name, f, make):
    program = vjp_program(trace(f)(*make(0)))
    program.typecheck()
    assert_lean(program)
    args = make(5)
    cts = cotangents_for(f, args, 50)
    outputs, vjp_fn = tf.vjp(f, *args)
    got = program(*args, *cts)
    n_out = len(optree.tree_leaves(outputs))
    assert_close(list(got[:n_out]), optree.tree_leaves(outputs))
    assert_close(list(got[n_out:]), list(vjp_fn(cts[0] if n_out == 1 else cts)))
    # and its exported code computes the same
    assert_close(list(program.compile_python()(*args, *cts)), list(got))
    graph_module = program.to_fx()
    graph_module.graph.lint()
    assert_close(list(graph_module(*args, *cts)), list(got))


@pytest.mark.parametrize("name, f, make", VJP_CASES, ids=[c[0] for c in VJP_CASES])
def test_split_vjp_matches_torch_func(name, f, make):
    fwd, bwd = split_vjp(f)(*make(0))
    fwd.typecheck()
    bwd.typecheck()
    assert_lean(fwd)
    assert_lean(bwd)
    args = make(7)
    outputs, saved = fwd(*args)
    expected_outputs, vjp_fn = tf.vjp(f, *args)
    assert_close(outputs, expected_outputs)
    cts = cotangents_for(f, args, 70)
    cotangents = cts[0] if len(cts) == 1 else cts
    assert_close(bwd(saved, cotangents), vjp_fn(cotangents))
    # the backward program takes exactly the saved values and the cotangents
    assert len(bwd.inputs) == len(saved) + len(cts)


def test_vjp_program_of_outputs_that_are_inputs_constants_or_booleans():
    def f(x):
        return x, torch.sin(x), x > 0, torch.ones(2)

    program = vjp_program(trace(f)(torch.ones(3)))
    program.typecheck()
    assert_lean(program)
    x = rand(0, 3)
    cts = (rand(1, 3), rand(2, 3), torch.zeros(3, dtype=torch.bool), rand(3, 2))
    *outputs, x_bar = program(x, *cts)
    assert_close(outputs, list(f(x)))
    # the input is an output too: both cotangents reach it
    assert_close(x_bar, cts[0] + cts[1] * torch.cos(x))


def test_vjp_program_refuses_a_number_output():
    program = trace(lambda x: (torch.sin(x), 2))(torch.ones(3))
    with pytest.raises(TransformError, match=r"^vjp_program\(program\): expected every output "
                                             r"of program <lambda> to be a tensor, got the "
                                             r"number 2 as output 1"):
        vjp_program(program)


def test_golden_vjp_program_of_sin():
    program = vjp_program(trace(torch.sin)(torch.ones(3)))
    assert str(program) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = sin a
      d:f32[3] = cos a
      e:f32[3] = mul b d
  in (c, e) }"""


def test_golden_vjp_program_of_foo():
    program = vjp_program(trace(foo)(torch.ones(3, 3)))
    assert str(program) == """\
{ lambda ; a:f32[3,3] b:f32[3,3] .
  let c:f32[3] = diagonal a offset=0 dim1=0 dim2=1
      d:f32[] = sum c dim=(0,) keepdim=False
      e:f32[] = sin d
      f:f32[3,3] = mul e a
      g:f32[3,3] = mul b a
      h:f32[] = sum g dim=(0,1) keepdim=False
      i:f32[3,3] = mul b e
      j:f32[] = cos d
      k:f32[] = mul h j
      l:f32[3] = expand k shape=(3,)
      m:f32[3,3] = diagonal_scatter l offset=0 dim1=0 dim2=1 shape=(3,3)
      n:f32[3,3] = add i m
  in (f, n) }"""


def test_golden_split_vjp_of_foo():
    fwd, bwd = split_vjp(foo)(torch.ones(3, 3))
    assert str(fwd) == """\
{ lambda ; a:f32[3,3] .
  let b:f32[3] = diagonal a offset=0 dim1=0 dim2=1
      c:f32[] = sum b dim=(0,) keepdim=False
      d:f32[] = sin c
      e:f32[3,3] = mul d a
  in (e, c, d, a) }"""
    assert str(bwd) == """\
{ lambda ; a:f32[] b:f32[] c:f32[3,3] d:f32[3,3] .
  let e:f32[3,3] = mul d c
      f:f32[] = sum e dim=(0,1) keepdim=False
      g:f32[3,3] = mul d b
      h:f32[] = cos a
      i:f32[] = mul f h
      j:f32[3] = expand i shape=(3,)
      k:f32[3,3] = diagonal_scatter j offset=0 dim1=0 dim2=1 shape=(3,3)
      l:f32[3,3] = add g k
  in (l,) }"""


def _custom_sins():
    @custom_vjp
    def sin_saving_x(x):
        return torch.sin(x)

    sin_saving_x.defvjp(lambda x: (torch.sin(x), x), lambda x, ct: (ct * torch.cos(x),))

    @custom_vjp
    def sin_saving_cos(x):
        return torch.sin(x)

    sin_saving_cos.defvjp(lambda x: (torch.sin(x), torch.cos(x)), lambda c, ct: (ct * c,))
    return sin_saving_x, sin_saving_cos


def test_split_vjp_shows_what_a_custom_vjp_saves():
    sin_saving_x, sin_saving_cos = _custom_sins()
    x = torch.ones(3)

    fwd, bwd = split_vjp(sin_saving_x)(x)
    assert str(fwd) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
  in (b, a) }"""
    assert "cos" in primitive_names(bwd)  # recomputed in the backward

    fwd, bwd = split_vjp(sin_saving_cos)(x)
    assert str(fwd) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
      c:f32[3] = cos a
  in (b, c) }"""
    assert str(bwd) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = mul b a
  in (c,) }"""

    for f in (sin_saving_x, sin_saving_cos):
        fwd, bwd = split_vjp(f)(x)
        x_new, ct = rand(1, 3), rand(2, 3)
        out, saved = fwd(x_new)
        assert_close(out, torch.sin(x_new))
        assert_close(bwd(saved, ct), (ct * torch.cos(x_new),))


def test_split_vjp_saves_only_what_the_backward_reads():
    weight = torch.arange(3.0)

    def f(x):  # add's and mul's closures hold x and both sums; the backward reads exp x
        return (x * weight).sum() + torch.exp(x).sum()

    fwd, bwd = split_vjp(f)(torch.ones(3))
    defined_by = {eq.out: eq.prim.name for eq in fwd.equations}
    assert [defined_by.get(v) for v in fwd.outputs[1:]] == ["exp"]
    read = {o for eq in bwd.equations for o in eq.inputs} | set(bwd.outputs)
    assert all(v in read for v in bwd.inputs)
    x, ct = rand(0, 3), rand(1)
    out, saved = fwd(x)
    expected_out, vjp_fn = tf.vjp(f, x)
    assert_close(out, expected_out)
    assert_close(bwd(saved, ct), vjp_fn(ct))


def test_split_vjp_refuses_writes_its_programs_would_not_repeat():
    """A write into a tensor f closes over would run once, while traced; a write into an
    argument has no place in either program. Both used to run silently or fail inside."""
    counter = torch.zeros(3)

    def counts(x):
        counter.add_(1)
        return (x * 2).sum()
    with pytest.raises(UnsupportedOperationError,
                       match=r"^split_vjp\(counts\)\(<inputs>\): Tensor\.add_\(\.\.\.\) writes "
                             r"in place into a tensor that the traced function closes over.*Fix: "):
        split_vjp(counts)(torch.ones(3))
    assert counter.tolist() == [0.0, 0.0, 0.0], "nothing was written"

    def scales(x, s):
        s.mul_(2)
        return (x * s).sum()
    with pytest.raises(UnsupportedOperationError,
                       match=r"^split_vjp\(scales\)\(<inputs>\): f writes in place into an "
                             r"argument of shape \(3,\).*Fix: compute out of place"):
        split_vjp(scales)(torch.ones(3), torch.ones(3))

    def keeps_a_constant(x):  # a no_grad region is a constant of the backward, as in trace
        with torch.no_grad():
            shift = x * 3
        return (x * shift).sum()
    fwd, bwd = split_vjp(keeps_a_constant)(torch.ones(3))
    x, ct = rand(0, 3), rand(1)
    out, saved = fwd(x)
    expected_out, vjp_fn = tf.vjp(keeps_a_constant, x)
    assert_close(out, expected_out)
    assert_close(bwd(saved, ct), vjp_fn(ct))


def test_split_vjp_refuses_non_tensor_arguments():
    with pytest.raises(TransformError, match=r"^split_vjp\(<lambda>\)\(<inputs>\): expected every "
                                             r"argument to be a tensor .*got a leaf of type int"):
        split_vjp(lambda x, k: x * k)(torch.ones(3), 2)


def test_split_vjp_of_constant_output_is_an_error():
    with pytest.raises(TransformError, match=r"^split_vjp\(<lambda>\)\(<inputs>\): every output "
                                             r"must depend on the inputs"):
        split_vjp(lambda x: torch.ones(3))(torch.ones(3))


# --- FX export ---------------------------------------------------------------------------------
WEIGHT = torch.linspace(0.5, 2.0, 4)

FX_CASES = [
    ("captured_constant", lambda x: torch.tanh(x * WEIGHT) @ WEIGHT, lambda s: (rand(s, 3, 4),)),
    ("getitem_cat", lambda x, y: torch.cat([x[:, 1:], y[..., None], x[:, :1] * 2], dim=1),
     lambda s: (rand(s, 3, 4), rand(s + 1, 3))),
    ("several_outputs", lambda x: (x.sum(0), torch.softmax(x, -1), x.T.reshape(-1)),
     lambda s: (rand(s, 2, 3),)),
    ("grad_with_scatters", grad(lambda x, t: F.cross_entropy(x[1:], t) + torch.trace(x[:, :3])),
     lambda s: (rand(s, 4, 3), torch.tensor([0, 2, 1]))),
    ("vmap_grad_mlp", vmap(grad(mlp_loss), in_dims=(None, 0, 0)), mlp_inputs),
    ("dtype_conversion", lambda x: (x.double() ** 2).sum().float(), lambda s: (rand(s, 3),)),
]


@pytest.mark.parametrize("name, f, make", FX_CASES, ids=[c[0] for c in FX_CASES])
def test_fx_export(name, f, make):
    program = trace(f)(*make(0))
    graph_module = program.to_fx()
    assert isinstance(graph_module, torch.fx.GraphModule)
    graph_module.graph.lint()
    args = make(3)
    tensors = flat_tensors(args)
    assert_close(list(graph_module(*tensors)), optree.tree_leaves(program(*args)))
    assert_close(optree.tree_leaves(program(*args)), optree.tree_leaves(f(*args)))
    # the generated code is plain Python: exec-able, no minifunctorch value in it
    assert "FuncTensor" not in graph_module.code


def test_fx_export_code_reads_like_torch():
    gm = trace(lambda x: torch.sin(x) * 2)(torch.ones(3)).to_fx()
    assert gm.code.strip() == """\
def forward(self, a):
    sin = torch.sin(a);  a = None
    mul = sin * 2;  sin = None
    return (mul,)"""


def test_fx_export_constants_are_buffers():
    program = trace(lambda x: x * WEIGHT)(torch.ones(4))
    graph_module = program.to_fx()
    assert [node.op for node in graph_module.graph.nodes] == [
        "placeholder", "get_attr", "call_function", "output"]
    assert_close(dict(graph_module.named_buffers())["b"], WEIGHT)


def test_fx_export_refuses_values_of_an_enclosing_transform():
    captured = {}

    def outer(y):
        captured["program"] = trace(lambda x: x * y)(torch.ones(3))
        return (y * 2).sum()

    grad(outer)(torch.ones(3))
    with pytest.raises(TransformError, match=r"program\.to_fx\(\): the program captured a value "
                                             r"of an enclosing transform"):
        captured["program"].to_fx()


# --- exported code of tricky values (regressions) ----------------------------------------------
def test_generated_code_writes_inf_and_nan():
    f = lambda x: torch.where(x > 0, x, float("-inf")) + torch.full_like(x, float("nan"))  # noqa
    program = trace(f)(torch.ones(3))
    source, _ = program.python_source()
    assert "float('-inf')" in source and "float('nan')" in source
    x = torch.tensor([-1.0, 2.0, 3.0])
    assert_close(program.compile_python()(x)[0], f(x), equal_nan=True)


def test_generated_code_of_scatter_index_keeps_slices():
    # (x[:2] ** 2).sum(): the cotangent of the slice depends on x, so the transpose of the
    # slice (scatter_index) is an equation rather than a constant folded while tracing
    program = trace(grad(lambda x: (x[:2] ** 2).sum()))(torch.ones(3))
    assert "scatter_index" in primitive_names(program)
    x = torch.tensor([1.0, 2.0, 3.0])
    assert_close(program.compile_python()(x)[0], torch.tensor([2.0, 4.0, 0.0]))


def test_generated_code_of_negative_base_power():
    program = trace(lambda x: (-2) ** x)(torch.ones(3))
    x = torch.tensor([1.0, 2.0, 3.0])
    assert_close(program.compile_python()(x)[0], torch.tensor([-2.0, 4.0, -8.0]))


def test_generated_code_does_not_shadow_a_custom_function():
    @custom_vjp
    def b(x):  # named like the program's second variable
        return torch.sin(x)

    b.defvjp(lambda x: (torch.sin(x), x), lambda x, ct: (ct * torch.cos(x),))
    program = trace(lambda x: b(x) * 2)(torch.ones(3))
    x = rand(0, 3)
    assert_close(program.compile_python()(x)[0], torch.sin(x) * 2)


def test_generated_code_of_a_long_program_avoids_keywords():
    # values are named a, b, ..., z, ba, bb, ...: the 214th would be `if`
    def f(x):
        for i in range(240):
            x = torch.sin(x) + i
        return x

    program = trace(f)(torch.ones(3))
    assert "      if_:f32[3] = sin ie" in str(program).splitlines()
    x = rand(0, 3)
    assert_close(program.compile_python()(x)[0], f(x))
