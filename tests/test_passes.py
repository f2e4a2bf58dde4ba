"""Simplification passes (issue 3): each pass shown on a program before and after (golden
text), and ``simplify`` never changes what a program computes."""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch.testing import assert_close

import minifunctorch.core as mf
from minifunctorch.core import grad, hessian, jacrev, jvp, simplify, trace, vjp, vmap
from minifunctorch.core.dispatch import transform_levels
from minifunctorch.core.passes import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_symbolic_zeros,
)


@pytest.fixture(autouse=True)
def _no_level_left_behind():
    assert not transform_levels(), "a previous test left a transform level"
    yield
    assert not transform_levels(), f"the test left transform levels: {transform_levels()}"


def rand(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


WEIGHT = torch.linspace(-1.0, 1.0, 3)


# --- eliminate_dead_code -----------------------------------------------------------------------
def with_dead_code(x):
    unused = torch.cos(x) * WEIGHT  # noqa: F841  (dead, and so is its constant)
    return torch.sin(x) + 1


def test_golden_eliminate_dead_code():
    program = trace(with_dead_code)(torch.ones(3))
    assert str(program) == """\
{ lambda b:f32[3] ; a:f32[3] .
  let c:f32[3] = cos a
      d:f32[3] = mul c b
      e:f32[3] = sin a
      f:f32[3] = add e 1
  in (f,) }"""
    assert str(eliminate_dead_code(program)) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
      c:f32[3] = add b 1
  in (c,) }"""


def test_dead_code_elimination_keeps_every_input():
    program = eliminate_dead_code(trace(lambda x, y: x * 2)(torch.ones(2), torch.ones(5)))
    assert len(program.inputs) == 2
    assert_close(program(torch.ones(2), torch.zeros(5)), torch.full((2,), 2.0))


# --- eliminate_common_subexpressions ----------------------------------------------------------
def with_repeats(x, y):
    return torch.exp(x * y) + torch.exp(x * y) * 2, (x * 2) + (x * 2.0)


def test_golden_eliminate_common_subexpressions():
    program = trace(with_repeats)(torch.ones(3), torch.ones(3))
    assert str(program) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = mul a b
      d:f32[3] = exp c
      e:f32[3] = mul a b
      f:f32[3] = exp e
      g:f32[3] = mul f 2
      h:f32[3] = add d g
      i:f32[3] = mul a 2
      j:f32[3] = mul a 2.0
      k:f32[3] = add i j
  in (h, k) }"""
    # the second exp reuses the first; `mul a 2` and `mul a 2.0` stay apart (see below)
    assert str(eliminate_common_subexpressions(program)) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = mul a b
      d:f32[3] = exp c
      e:f32[3] = mul d 2
      f:f32[3] = add d e
      g:f32[3] = mul a 2
      h:f32[3] = mul a 2.0
      i:f32[3] = add g h
  in (f, i) }"""


def test_common_subexpressions_distinguish_literal_types():
    # 2 == 2.0 in Python, but i64 * 2 is i64 and i64 * 2.0 is f32
    program = eliminate_common_subexpressions(
        trace(lambda i: (i * 2, i * 2.0, i * True))(torch.arange(3)))
    assert len(program.equations) == 3
    assert [t.dtype for t in program(torch.arange(3))] == [torch.int64, torch.float32,
                                                          torch.int64]
    assert_close(program(torch.arange(3))[1], torch.tensor([0.0, 2.0, 4.0]))


def test_common_subexpressions_compare_params():
    program = eliminate_common_subexpressions(trace(
        lambda x: (x.sum(0), x.sum(1), x.sum(0), x[:, 1:], x[:, 1:], x[:, :1]))(torch.ones(2, 3)))
    assert [eq.prim.name for eq in program.equations] == ["sum", "sum", "getitem", "getitem"]
    outputs = program.outputs
    assert outputs[0] is outputs[2] and outputs[3] is outputs[4]


# --- fold_symbolic_zeros -----------------------------------------------------------------------
def with_zeros(x, y):
    z = torch.zeros_like(x)
    return x + z * 2, z - y, 1 + z


def test_golden_fold_symbolic_zeros():
    program = trace(with_zeros)(torch.ones(3), torch.ones(3))
    assert str(program) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = full_like a fill_value=0
      d:f32[3] = mul c 2
      e:f32[3] = add a d
      f:f32[3] = sub c b
      g:f32[3] = add c 1
  in (e, f, g) }"""
    # x + 0 is x, 0 - y is -y, and the product with a zero is made directly as a zero (dead
    # now: dead-code elimination removes it); 1 + z, which torch computes as z + 1, stays an
    # addition (its result is a tensor of z's shape)
    assert str(fold_symbolic_zeros(program)) == """\
{ lambda ; a:f32[3] b:f32[3] .
  let c:f32[3] = full_like a fill_value=0
      d:f32[3] = full_like c fill_value=0
      e:f32[3] = neg b
      f:f32[3] = add c 1
  in (a, e, f) }"""
    x, y = rand(0, 3), rand(1, 3)
    assert_close(fold_symbolic_zeros(program)(x, y), with_zeros(x, y))


def test_zero_folding_keeps_a_product_of_zeros_and_a_tensor():
    """NOTE [Zero times infinity]: 0 * inf is nan, as eager torch computes; the product was
    folded to zeros, and jit returned 0 there."""
    def products(x, w):
        z = torch.zeros_like(x)
        return z * x, x * 0, (torch.exp(x) * z).sum(), w @ z, z * float("inf")
    x = torch.tensor([1.0, float("inf"), float("nan")])
    w = torch.tensor([[1.0, float("inf"), 0.0]])
    program = simplify(trace(products)(x, w))
    assert [eq.prim.name for eq in program.equations].count("mul") == 4
    for ours, eager in zip(program(x, w), products(x, w)):
        assert_close(ours, eager, equal_nan=True)
    for ours, eager in zip(mf.jit(products)(x, w), products(x, w)):
        assert_close(ours, eager, equal_nan=True)
    loss = lambda x: (torch.exp(x) * torch.zeros_like(x)).sum()  # noqa: E731
    assert_close(mf.jit(mf.grad(loss))(x), tf.grad(loss)(x), equal_nan=True)


def test_zero_folding_keeps_a_number_plus_zeros():
    for f, expected in [(lambda x: 1 + torch.zeros_like(x), 1.0),
                        (lambda x: 1 - torch.zeros_like(x), 1.0),
                        (lambda x: 3.0 * torch.zeros_like(x) + 2, 2.0)]:
        program = simplify(trace(f)(torch.ones(3)))
        assert_close(program(rand(0, 3)), torch.full((3,), expected))


def test_zero_folding_keeps_a_broadcast_by_a_zero():
    # x + zeros of a larger shape is x broadcast, neither x nor the zeros
    def f(x, y):
        return x + torch.zeros_like(y), torch.zeros_like(y) - x

    x, y = rand(0, 3), rand(1, 2, 3)
    program = simplify(trace(f)(x, y))
    program.typecheck()
    assert_close(program(x, y), f(x, y))


def test_zero_folding_in_a_zero_tangent():
    # a jvp with a zero tangent for y, a tensor of zeros the user made: its product with
    # sin(x) is computed, as torch.func computes it (nan where x is inf: NOTE [Zero times
    # infinity]); the sum of that product with the other term is not folded either
    def f(x, y):
        return torch.sin(x) * y

    def jvp_x_only(x, y, v):
        return jvp(f, (x, y), (v, torch.zeros_like(y)))

    program = simplify(trace(jvp_x_only)(torch.ones(3), torch.ones(3), torch.ones(3)))
    assert [eq.prim.name for eq in program.equations].count("full_like") == 1
    x, y, v = rand(0, 3), rand(1, 3), rand(2, 3)
    assert_close(program(x, y, v), jvp_x_only(x, y, v))
    x[1] = float("inf")
    assert_close(program(x, y, v), tf.jvp(f, (x, y), (v, torch.zeros_like(y))), equal_nan=True)


# --- simplify ----------------------------------------------------------------------------------
def jvp_of_sin_plus_y(x, y, v):
    return jvp(lambda x, y: torch.sin(x) * 2 + y + torch.sin(x), (x, y),
               (v, torch.zeros_like(y)))


def test_golden_simplify():
    program = trace(jvp_of_sin_plus_y)(torch.ones(3), torch.ones(3), torch.ones(3))
    assert str(program) == """\
{ lambda ; a:f32[3] b:f32[3] c:f32[3] .
  let d:f32[3] = full_like b fill_value=0
      e:f32[3] = sin a
      f:f32[3] = cos a
      g:f32[3] = mul c f
      h:f32[3] = mul e 2
      i:f32[3] = mul g 2
      j:f32[3] = add h b
      k:f32[3] = add i d
      l:f32[3] = sin a
      m:f32[3] = cos a
      n:f32[3] = mul c m
      o:f32[3] = add j l
      p:f32[3] = add k n
  in (o, p) }"""
    # the zero tangent added (k) folded, repeated sin/cos shared (l, m, n), and what became
    # dead dropped (d)
    assert str(simplify(program)) == """\
{ lambda ; a:f32[3] b:f32[3] c:f32[3] .
  let d:f32[3] = sin a
      e:f32[3] = cos a
      f:f32[3] = mul c e
      g:f32[3] = mul d 2
      h:f32[3] = mul f 2
      i:f32[3] = add g b
      j:f32[3] = add i d
      k:f32[3] = add h f
  in (j, k) }"""


def mlp_loss(params, x, target):
    w1, b1, w2 = params
    return F.cross_entropy((torch.tanh(x @ w1 + b1) @ w2).unsqueeze(0), target.unsqueeze(0))


def mlp_inputs(seed):
    params = (rand(seed, 4, 5), rand(seed + 1, 5), rand(seed + 2, 5, 3))
    targets = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(seed))
    return params, rand(seed + 3, 6, 4), targets


def pullback_of_slices(x, ct):
    _, vjp_fn = vjp(lambda x: (x[0] * x[1:]).sum() + torch.sin(x).sum(), x)
    return vjp_fn(ct)


SIMPLIFY_CASES = [
    ("jvp_zero_tangent", jvp_of_sin_plus_y,
     lambda s: (rand(s, 3), rand(s + 1, 3), rand(s + 2, 3))),
    ("zeros", with_zeros, lambda s: (rand(s, 3), rand(s + 1, 3))),
    ("repeats", with_repeats, lambda s: (rand(s, 3), rand(s + 1, 3))),
    ("dead_code", with_dead_code, lambda s: (rand(s, 3),)),
    ("pullback_of_slices", pullback_of_slices, lambda s: (rand(s, 3), rand(s + 1))),
    ("jacrev", jacrev(lambda x: torch.sin(x) * x.sum()), lambda s: (rand(s, 3),)),
    ("hessian", hessian(lambda x: (torch.tanh(x) * x).sum()), lambda s: (rand(s, 3),)),
    ("vmap_grad_mlp", vmap(grad(mlp_loss), in_dims=(None, 0, 0)), mlp_inputs),
    ("grad_of_grad", grad(grad(lambda x: torch.sin(x) * torch.exp(x))), lambda s: (rand(s),)),
]


@pytest.mark.parametrize("name, f, make", SIMPLIFY_CASES, ids=[c[0] for c in SIMPLIFY_CASES])
def test_simplify_leaves_results_unchanged(name, f, make):
    program = trace(f)(*make(0))
    text = str(program)
    simplified = simplify(program)
    assert str(program) == text, "passes build new programs, they never mutate"
    simplified.typecheck()
    assert len(simplified.equations) <= len(program.equations)
    args = make(1)
    assert_close(simplified(*args), program(*args))
    assert_close(simplified(*args), f(*args))
    # a fixed point
    assert str(simplify(simplified)) == str(simplified)
    # each pass alone leaves results unchanged too
    for one_pass in (eliminate_dead_code, eliminate_common_subexpressions, fold_symbolic_zeros):
        assert_close(one_pass(program)(*args), program(*args))


# --- fold_identity_bases -------------------------------------------------------------------------
def _matmuls(program):
    return [tuple(tuple(o.shape) for o in e.inputs) for e in program.equations
            if e.prim.name == "matmul"]


def _layer(a, activation):
    # (the basis meets traced values first: an op of it with constants, such as `* 2.0` at
    # the end, is computed once at trace time into a plain constant)
    return lambda x: activation(a @ torch.sin(x))


def _basis_matmuls(program, basis):
    """The matmuls whose left operand is (basis, basis) or (basis, 1, basis)."""
    return [shapes for shapes in _matmuls(program) if shapes[0] in ((basis, basis),
                                                                     (basis, 1, basis))]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # (torch.func's jacfwd)
@pytest.mark.parametrize("activation", [torch.tanh, torch.sigmoid, torch.relu],
                         ids=["tanh", "sigmoid", "relu"])
@pytest.mark.parametrize("n, m", [(3, 40), (40, 3)], ids=["tall", "wide"])
@pytest.mark.parametrize("mode", ["jacrev", "jacfwd"])
def test_jit_computes_with_a_jacobians_identity_basis_by_its_diagonal(mode, n, m, activation):
    """NOTE [An identity basis is a diagonal matrix] (passes.py): jit's Jacobian programs have
    no matmul of the (basis, basis) identity (or of a diagonal matrix made from it) any more,
    and they compute torch.func's Jacobian. The pass keeps every dense equation, which
    dead-code elimination then drops."""
    import torch.func as tf
    from minifunctorch.core import jacfwd, jit
    from minifunctorch.core.passes import fold_identity_bases
    a, x = rand(0, m, n), rand(2, n)
    f = _layer(a, activation)
    transform = {"jacrev": jacrev, "jacfwd": jacfwd}[mode](f)
    basis = m if mode == "jacrev" else n
    dense = simplify(trace(transform)(x))
    assert len(_basis_matmuls(dense, basis)) == 1, _matmuls(dense)
    folded = simplify(fold_identity_bases(dense))
    assert _basis_matmuls(folded, basis) == [], _matmuls(folded)
    assert len(folded.equations) <= len(dense.equations) + 3
    expected = getattr(tf, mode)(f)(x)
    assert_close(folded(x), expected)
    jf = jit(transform)
    assert_close(jf(x), expected)
    assert_close(jf(-x), getattr(tf, mode)(f)(-x))  # the cached program again


def test_an_identity_the_user_made_is_not_read_as_a_diagonal():
    """Only the identities the engine made for a Jacobian: a captured tensor that equals one
    when traced may be written afterwards, and the program must read its new numbers."""
    from minifunctorch.core import jit
    eye, w = torch.eye(4), rand(0, 4, 3)
    jf = jit(lambda x: (eye * x) @ w)
    x = rand(1, 4)
    assert_close(jf(x), torch.diag(x) @ w)
    eye.fill_(1.0)  # no longer an identity
    assert_close(jf(x), (torch.ones(4, 4) * x) @ w)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_nan_in_the_jacobian_stays_in_its_row_under_jit():
    """NOTE [An identity basis is a diagonal matrix]: where one output is NaN, the dense
    product (torch.func, and the engine's eager jacrev) spreads it over the whole Jacobian
    (0 * NaN in every row); jit's diagonal product keeps it in that output's row, and every
    other row is the exact Jacobian."""
    import torch.func as tf
    from minifunctorch.core import jit
    a, x = rand(0, 6, 3), rand(1, 3)
    a[2, 0] = float("nan")
    f = _layer(a, torch.tanh)
    dense = tf.jacrev(f)(x)
    assert torch.isnan(dense).all()
    assert torch.isnan(jacrev(f)(x)).all()  # the eager engine computes the dense products
    ours = jit(jacrev(f))(x)
    assert torch.isnan(ours[2]).any() and not torch.isnan(ours[[0, 1, 3, 4, 5]]).any()
    by_hand = (1 - f(x) ** 2)[:, None] * a * torch.cos(x)[None, :]
    assert_close(ours[[0, 1, 3, 4, 5]], by_hand[[0, 1, 3, 4, 5]])
