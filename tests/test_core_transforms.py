"""The transforms' options and compositions, checked against torch.func (or by hand).

pytrees in and out, argnums, has_aux, grad_and_value, linearize, vmap's in_dims / out_dims /
chunk_size / randomness, functional_call (per-sample gradients, ensembles), custom_vjp,
perturbation confusion, Python control flow, and the tapes that grad records.
"""
import collections
import dataclasses

import optree
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from oracle import aten_calls

# torch.func scripts its decompositions on first use (torch deprecates torch.jit.script), and
# torch.func.linearize's constant folding warns inside torch.fx
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node:UserWarning"),
]

DTYPE = torch.float64
Pair = collections.namedtuple("Pair", ["first", "second"])


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def assert_same(ours, theirs):
    for leaf in torch.utils._pytree.tree_leaves(ours):
        assert type(leaf) is torch.Tensor, f"got {type(leaf).__name__} instead of a tensor"
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)


def assert_same_structure(ours, theirs):
    """Same containers (dict keys, namedtuple types, tuple vs list), same tensors."""
    ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
    theirs_leaves, theirs_spec = torch.utils._pytree.tree_flatten(theirs)
    assert ours_spec == theirs_spec, f"{ours_spec} != {theirs_spec}"
    assert_same(ours_leaves, theirs_leaves)


# --- pytrees -------------------------------------------------------------------------------------
def tree_inputs(seed=0):
    return {"w": randn(3, seed=seed),
            "pair": Pair(randn(2, 3, seed=seed + 1), randn(seed=seed + 2)),
            "rest": [randn(3, seed=seed + 3), (randn(2, seed=seed + 4),)]}


def tree_scalar(tree):
    pair, (v, (u,)) = tree["pair"], tree["rest"]
    return (torch.sin(pair.first @ tree["w"]) * u).sum() + pair.second * (v * tree["w"]).sum()


def tree_to_tree(tree, scale):
    pair, (v, (u,)) = tree["pair"], tree["rest"]
    return {"out": Pair(pair.first * tree["w"] * scale, (u * pair.second).exp()),
            "list": [torch.tanh(v), v.sum() * scale]}



# NOTE [Pytrees are torch's] (core/pytree.py): classes registered with torch.utils._pytree
# are containers to every transform, as they are to torch.func's
@dataclasses.dataclass
class Particles:  # registered with register_dataclass (which torch does not mirror to optree)
    positions: torch.Tensor
    charges: torch.Tensor


torch.utils._pytree.register_dataclass(Particles)


class Box:  # registered with register_pytree_node, after the engine was imported
    def __init__(self, corner, size):
        self.corner, self.size = corner, size


torch.utils._pytree.register_pytree_node(
    Box, lambda box: ([box.corner], box.size), lambda children, size: Box(children[0], size),
    serialized_type_name="test_core_transforms.Box")


def _energy(particles, box):
    shifted = particles.positions - box.corner * box.size
    return Particles(shifted.sin() * particles.charges[:, None], particles.charges.exp())


def test_containers_registered_with_torch_are_containers_to_every_transform():
    particles, box = Particles(randn(5, 3), randn(5, seed=1)), Box(randn(3, seed=2), 2.0)
    scalar = lambda p, b: _energy(p, b).positions.sum() + _energy(p, b).charges.sum()  # noqa: E731
    for argnums in (0, 1, (0, 1)):
        assert_same_structure(mf.grad(scalar, argnums=argnums)(particles, box),
                              tf.grad(scalar, argnums=argnums)(particles, box))
    out, pullback = mf.vjp(_energy, particles, box)
    out_t, pullback_t = tf.vjp(_energy, particles, box)
    assert_same_structure(out, out_t)
    assert_same_structure(pullback(out_t), pullback_t(out_t))
    assert_same_structure(mf.jvp(_energy, (particles, box), (particles, box)),
                          tf.jvp(_energy, (particles, box), (particles, box)))
    for jac in ("jacrev", "jacfwd"):
        assert_same_structure(getattr(mf, jac)(_energy)(particles, box),
                              getattr(tf, jac)(_energy)(particles, box))
    # vmap: in_dims and out_dims as the registered class itself
    batch = Particles(randn(4, 5, 3, seed=3), randn(5, 4, seed=4))
    in_dims, out_dims = (Particles(0, 1), None), Particles(0, 1)
    assert_same_structure(mf.vmap(_energy, in_dims=in_dims, out_dims=out_dims)(batch, box),
                          tf.vmap(_energy, in_dims=in_dims, out_dims=out_dims)(batch, box))
    torch.testing.assert_close(mf.jit(scalar)(particles, box), scalar(particles, box))


def test_a_class_registered_again_after_deregistering_is_the_new_one():
    # (PyTorch's own tests register a class, deregister it, then register another of the
    # same name: the registry then has the same size as before)
    for attempt in range(2):
        class Holder:
            def __init__(self, value):
                self.value = value

        torch.utils._pytree.register_pytree_node(
            Holder, lambda h: ([h.value], None), lambda children, _: Holder(children[0]),
            serialized_type_name=f"test_core_transforms.Holder{attempt}")
        try:
            x = Holder(randn(3, seed=attempt))
            f = lambda h: (h.value.sin() * (attempt + 1)).sum()  # noqa: E731
            ours, theirs = mf.grad(f)(x), tf.grad(f)(x)
            assert type(ours) is Holder
            torch.testing.assert_close(ours.value, theirs.value)
        finally:
            torch.utils._pytree._deregister_pytree_node(Holder)
    # deregistered, it is a leaf again: vmap refuses it as torch.func does
    with pytest.raises(mf.TransformError, match="We cannot vmap over non-Tensor arguments"):
        mf.vmap(lambda v: v * 2)(Holder(randn(2, 3)))

def test_grad_of_pytree_input():
    tree = tree_inputs()
    assert_same_structure(mf.grad(tree_scalar)(tree), tf.grad(tree_scalar)(tree))


def test_vjp_pytrees_in_and_out():
    tree, scale = tree_inputs(), randn(seed=9)
    out, vjp_fn = mf.vjp(tree_to_tree, tree, scale)
    out_t, vjp_fn_t = tf.vjp(tree_to_tree, tree, scale)
    assert_same_structure(out, out_t)
    cotangents = torch.utils._pytree.tree_map(lambda o: torch.ones_like(o) * 0.5, out_t)
    assert_same_structure(vjp_fn(cotangents), vjp_fn_t(cotangents))




@pytest.mark.parametrize("labelled", [False, True], ids=["plain", "labelled"])
def test_a_tensor_given_twice_is_two_inputs(labelled):
    """Each input of grad has its own gradient, also when one tensor is passed twice (as two
    arguments, or twice in one pytree), and when the course's ``label`` names it: the tape
    keys cotangents by name, so the second input needs a name of its own."""
    x = randn(3, seed=4)
    if labelled:
        x = mf.label(x, "x")

    def f(a, b):
        return (a.sin() * 2 + b * b * 3).sum()

    assert_same(mf.grad(f, argnums=(0, 1))(x, x), tf.grad(f, argnums=(0, 1))(x, x))
    assert_same(mf.jacrev(lambda a, b: a.sin() * b, argnums=(0, 1))(x, x),
                tf.jacrev(lambda a, b: a.sin() * b, argnums=(0, 1))(x, x))
    assert_same(mf.hessian(f, argnums=(0, 1))(x, x), tf.hessian(f, argnums=(0, 1))(x, x))

    def g(tree):
        return f(tree["a"], tree["b"])
    assert_same(mf.grad(g)({"a": x, "b": x}), tf.grad(g)({"a": x, "b": x}))

@dataclasses.dataclass
class _Points:  # a container registered with torch's pytree (mirrored into the engine's)
    coordinates: torch.Tensor


def _tanh_loss(w, x):
    return torch.tanh(x @ w).square().sum()


_UNDER_COMPILE = {  # name -> api -> the function torch.compile compiles
    "grad": lambda api: lambda w, x: api.grad(_tanh_loss)(w, x) * 2,
    "vmap(grad)": lambda api: lambda w, x: api.vmap(api.grad(_tanh_loss), in_dims=(None, 0))(
        w, x).sum(0),
    "jacrev": lambda api: lambda w, x: api.jacrev(lambda w: torch.sin(x @ w))(w),
    "jacfwd": lambda api: lambda w, x: api.jacfwd(lambda w: torch.sin(x @ w))(w),
    "hessian": lambda api: lambda w, x: api.hessian(_tanh_loss)(w, x),
    "jvp": lambda api: lambda w, x: api.jvp(lambda w: _tanh_loss(w, x), (w,),
                                            (torch.ones_like(w),))[1],
    "vjp": lambda api: lambda w, x: api.vjp(lambda w: torch.sin(x @ w), w)[1](
        torch.ones(x.shape[0]))[0],
    "chunk_vmap": lambda api: lambda w, x: mf.chunk_vmap(torch.sin)(x) + w,
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(_UNDER_COMPILE))
def test_a_transform_under_torch_compile_runs_outside_the_graph(name, dynamic):
    """NOTE [Transforms under torch.compile] (compile_boundary.py): a transform inside a
    compiled function runs eagerly, and computes torch.func's result, for new shapes too
    (with dynamic=True the engine's recorded shapes once broke dynamo's fake tensors)."""
    make = _UNDER_COMPILE[name]
    reference = make(tf) if name != "chunk_vmap" else lambda w, x: torch.sin(x) + w
    w, x = randn(4, seed=1), randn(5, 4, seed=2)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(make(mf), dynamic=dynamic, backend="eager")
        for w_, x_ in ((w, x), (w * 2, x[:3]), (w[:2], x[:, :2])):
            torch.testing.assert_close(compiled(w_, x_), reference(w_, x_))
    finally:
        torch._dynamo.reset()


def test_a_transform_put_in_the_graph_runs_on_fake_tensors():
    """PyTorch's TestCompileTransforms puts vmap(jacfwd(jacrev)) in the graph with
    allow_in_graph: dynamo runs it on fake tensors while it compiles, where the engine must
    not take its detour around dynamo again (NOTE [Transforms under torch.compile])."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()).double()
    params = (dict(model.named_parameters()), {})  # (fx hands a lone dict over as read-only)

    def hessians(api):
        def predict(params, x):
            out = api.functional_call(model, params, x)
            return out, out
        return api.vmap(api.jacfwd(api.jacrev(predict, argnums=1, has_aux=True), argnums=1,
                                   has_aux=True), in_dims=(None, 0))
    put_in_graph = torch._dynamo.allow_in_graph(hessians(mf))
    x = randn(4, 2, seed=3)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda p, x: put_in_graph(p, x), backend="eager")
        torch.testing.assert_close(compiled(params, x), hessians(tf)(params, x))
    finally:
        torch._dynamo.reset()


def test_fullgraph_compile_of_a_transform_says_what_to_do():
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="run outside torch.compile's graph.*Fix: drop "
                                            "fullgraph=True"):
            torch.compile(lambda w: mf.grad(lambda w: (w * w).sum())(w), fullgraph=True,
                          backend="eager")(randn(3, seed=0))
    finally:
        torch._dynamo.reset()


@dataclasses.dataclass
class _Points:  # a container registered with torch's pytree (mirrored into the engine's)
    coordinates: torch.Tensor


def test_vjp_fn_under_torch_compile_takes_a_registered_container():
    """vjp and its vjp_fn inside a compiled function, with a container registered with
    torch's pytree as the input: both run outside the graph, where the engine's flatten of
    the cotangents and of the outputs agree (dynamo's stand-in for optree, while it traced
    them, made treespecs that compared unequal for one leaf)."""
    torch.utils._pytree.register_dataclass(_Points)
    try:
        def loss(api, weight, points):
            def energy(p):
                return (p.coordinates.index_select(0, torch.arange(3)) * weight).sum(1, keepdim=True)
            y, vjp_fn = api.vjp(energy, points)
            (pulled,) = vjp_fn(torch.ones_like(y))
            return y.square().sum() + pulled.coordinates.square().sum()

        weight, points = randn(2, seed=1), _Points(randn(5, 2, seed=2))
        expected = tf.grad_and_value(lambda w, p: loss(tf, w, p))(weight, points)
        torch._dynamo.reset()
        compiled = torch.compile(mf.grad_and_value(lambda w, p: loss(mf, w, p)),
                                 dynamic=True, backend="eager")
        torch.testing.assert_close(compiled(weight, points), expected)
        # and vjp outside, its vjp_fn inside a compiled function
        y, vjp_fn = mf.vjp(lambda p: p.coordinates.sin(), points)
        pulled = torch.compile(lambda ct: vjp_fn(ct)[0].coordinates * 2, backend="eager")(
            torch.ones_like(y))
        torch.testing.assert_close(pulled, points.coordinates.cos() * 2)
    finally:
        torch._dynamo.reset()
        torch.utils._pytree._deregister_pytree_node(_Points)


def test_jvp_pytrees_in_and_out():
    tree, scale = tree_inputs(), randn(seed=9)
    tangents = (tree_inputs(seed=20), randn(seed=30))
    ours = mf.jvp(tree_to_tree, (tree, scale), tangents)
    theirs = tf.jvp(tree_to_tree, (tree, scale), tangents)
    assert_same_structure(ours, theirs)


def test_vmap_pytrees_in_and_out():
    batched = torch.utils._pytree.tree_map(lambda a: torch.stack([a, 2 * a, -a, a + 1]),
                                           tree_inputs())
    scale = randn(4, seed=9)
    assert_same_structure(mf.vmap(tree_to_tree)(batched, scale),
                          tf.vmap(tree_to_tree)(batched, scale))


def test_jacrev_pytrees_in_and_out():
    tree, scale = tree_inputs(), randn(seed=9)
    assert_same_structure(mf.jacrev(tree_to_tree, argnums=(0, 1))(tree, scale),
                          tf.jacrev(tree_to_tree, argnums=(0, 1))(tree, scale))


def test_jacfwd_pytree_input():
    tree, scale = tree_inputs(), randn(seed=9)
    assert_same_structure(mf.jacfwd(tree_to_tree)(tree, scale),
                          tf.jacfwd(tree_to_tree)(tree, scale))


# --- argnums, has_aux, grad_and_value, linearize ------------------------------------------------
def three_args(x, y, z):
    return (x.sin() * y).sum() * z + (y ** 2).sum()


@pytest.mark.parametrize("argnums", [0, 1, 2, -1, (0, 2), (2, 0), (0, 1, 2), (-1, 1)],
                         ids=str)
def test_grad_argnums(argnums):
    args = randn(3, seed=1), randn(3, seed=2), randn(seed=3)
    assert_same(mf.grad(three_args, argnums=argnums)(*args),
                tf.grad(three_args, argnums=argnums)(*args))


@pytest.mark.parametrize("argnums", [1, (0, 2)], ids=str)
def test_jacobian_argnums(argnums):
    args = randn(3, seed=1), randn(3, seed=2), randn(seed=3)
    f = lambda x, y, z: x.sin() * y * z  # noqa: E731
    assert_same(mf.jacrev(f, argnums=argnums)(*args), tf.jacrev(f, argnums=argnums)(*args))
    assert_same(mf.jacfwd(f, argnums=argnums)(*args), tf.jacfwd(f, argnums=argnums)(*args))


def with_aux(x):
    y = x.sin()
    return (y * x).sum(), {"y": y, "norm": (x * x).sum()}


def test_grad_has_aux():
    x = randn(3)
    assert_same(mf.grad(with_aux, has_aux=True)(x), tf.grad(with_aux, has_aux=True)(x))


def test_grad_and_value():
    x = randn(3)
    assert_same(mf.grad_and_value(lambda x: (x.exp() * x).sum())(x),
                tf.grad_and_value(lambda x: (x.exp() * x).sum())(x))
    assert_same(mf.grad_and_value(with_aux, has_aux=True)(x),
                tf.grad_and_value(with_aux, has_aux=True)(x))
    args = randn(3, seed=1), randn(3, seed=2), randn(seed=3)
    assert_same(mf.grad_and_value(three_args, argnums=(1, 2))(*args),
                tf.grad_and_value(three_args, argnums=(1, 2))(*args))


def test_vjp_has_aux():
    x = randn(3)
    out, vjp_fn, aux = mf.vjp(with_aux, x, has_aux=True)
    out_t, vjp_fn_t, aux_t = tf.vjp(with_aux, x, has_aux=True)
    assert_same((out, aux), (out_t, aux_t))
    assert_same(vjp_fn(torch.tensor(2.0, dtype=DTYPE)), vjp_fn_t(torch.tensor(2.0, dtype=DTYPE)))


def test_a_tangent_takes_its_values_dtype_as_in_torch_func():
    # NOTE [A tangent takes its value's dtype]: an operand that is not differentiated but
    # raises the result's dtype (a float64 constant, a complex number) raises the tangent's
    x = torch.tensor([0.5, -1.0, 2.0])
    wide = torch.tensor([1.0, 2.0, 3.0], dtype=DTYPE)
    for f in (lambda x: x + wide, lambda x: wide * x.sin(), lambda x: 1j + x,
              lambda x: torch.where(x > 0, x, wide), lambda x: torch.maximum(x, wide)):
        ours, theirs = mf.jvp(f, (x,), (x.cos(),)), tf.jvp(f, (x,), (x.cos(),))
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if not ours[0].dtype.is_complex:  # (jacfwd refuses complex outputs, as torch.func's)
            ours, theirs = mf.jacfwd(f)(x), tf.jacfwd(f)(x)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_jvp_has_aux():
    x, t = randn(3), randn(3, seed=1)
    assert_same(mf.jvp(with_aux, (x,), (t,), has_aux=True),
                tf.jvp(with_aux, (x,), (t,), has_aux=True))


def vector_with_aux(x):
    return x.sin() * x, {"cos": x.cos()}


@pytest.mark.parametrize("jac", ["jacrev", "jacfwd"])
def test_jacobian_has_aux(jac):
    x = randn(3)
    assert_same(getattr(mf, jac)(vector_with_aux, has_aux=True)(x),
                getattr(tf, jac)(vector_with_aux, has_aux=True)(x))


def test_linearize():
    f = lambda x, y: (x.sin() * y, (x @ y).exp())  # noqa: E731
    x, y = randn(3), randn(3, seed=1)
    out, jvp_fn = mf.linearize(f, x, y)
    out_t, jvp_fn_t = tf.linearize(f, x, y)
    assert_same(out, out_t)
    for seed in (2, 3):
        tangents = randn(3, seed=seed), randn(3, seed=seed + 10)
        assert_same(jvp_fn(*tangents), jvp_fn_t(*tangents))


# --- vmap options --------------------------------------------------------------------------------
def two_outputs(x, y):
    return x * y.sum(), (x @ y.T).tanh()


@pytest.mark.parametrize("out_dims", [0, 1, -1, (1, 0), (0, -1)], ids=str)
def test_vmap_out_dims(out_dims):
    x, y = randn(4, 3), randn(4, 2, 3, seed=1)
    assert_same(mf.vmap(two_outputs, out_dims=out_dims)(x, y),
                tf.vmap(two_outputs, out_dims=out_dims)(x, y))


def test_vmap_out_dims_none_for_unbatched_output():
    weights = randn(2, 3, seed=1)

    def f(x):
        return x @ weights.T, weights * 2
    ours = mf.vmap(f, out_dims=(0, None))(randn(4, 3))
    assert_same(ours, tf.vmap(f, out_dims=(0, None))(randn(4, 3)))
    assert ours[1].shape == (2, 3)


def test_vmap_unbatched_output_is_broadcast():
    weights = randn(3, seed=1)
    ours = mf.vmap(lambda x: (x * 2, weights.exp()))(randn(4, 2))
    assert_same(ours, tf.vmap(lambda x: (x * 2, weights.exp()))(randn(4, 2)))
    assert ours[1].shape == (4, 3)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 100])
def test_vmap_chunk_size(chunk_size):
    x, y = randn(5, 3), randn(3, 5, seed=1)
    f = lambda x, y: (x.sin() * y, x.sum())  # noqa: E731
    ours = mf.vmap(f, in_dims=(0, 1), out_dims=(1, 0), chunk_size=chunk_size)(x, y)
    assert_same(ours, tf.vmap(f, in_dims=(0, 1), out_dims=(1, 0))(x, y))


def test_vmap_chunk_size_with_jacrev():
    x = randn(4)
    f = lambda x: x.sin() * x.sum()  # noqa: E731
    assert_same(mf.jacrev(f, chunk_size=3)(x), tf.jacrev(f)(x))


def test_vmap_nested_in_dims_prefixes():
    tree = {"a": randn(3, 4), "b": (randn(4, 3, seed=1), randn(2, seed=2))}
    scale = randn(4, seed=3)
    in_dims = ({"a": 1, "b": (0, None)}, 0)

    def f(tree, s):
        return tree["a"] * s + tree["b"][0].sum() * tree["b"][1].sum()
    assert_same(mf.vmap(f, in_dims=in_dims)(tree, scale), tf.vmap(f, in_dims=in_dims)(tree, scale))
    # a prefix: one dim for a whole subtree
    tree2 = {"a": randn(4, 3), "b": (randn(4, 3, seed=1), randn(4, 2, seed=2))}
    scale2 = randn(3, seed=4)
    assert_same(mf.vmap(f, in_dims=(0, None))(tree2, scale2),
                tf.vmap(f, in_dims=(0, None))(tree2, scale2))


def test_vmap_kwargs_are_not_batched():
    f = lambda x, *, scale: x * scale  # noqa: E731
    x, scale = randn(4, 3), randn(3, seed=1)
    assert_same(mf.vmap(f)(x, scale=scale), tf.vmap(f)(x, scale=scale))


def test_nested_vmap():
    x, y = randn(2, 3, 4), randn(3, 4, seed=1)
    f = lambda x, y: (x * y).sum()  # noqa: E731
    assert_same(mf.vmap(mf.vmap(f, in_dims=(0, 0)), in_dims=(0, None))(x, y),
                tf.vmap(tf.vmap(f, in_dims=(0, 0)), in_dims=(0, None))(x, y))


@pytest.mark.parametrize("f", [
    lambda x, y, z: x * y,
    lambda x, y, z: x + y * z - 2.0,
    lambda x, y, z: torch.where(x > 0, y, z),
    lambda x, y, z: torch.where(z > 0, 1.5, x) / (y.abs() + 1),
    lambda x, y, z: torch.maximum(x, y).pow(2) + z,
    lambda x, y, z: x * z.float(),  # float64 * float32: promoted per example
], ids=["mul", "add-mul-sub", "where", "where-number", "maximum-pow", "mixed-dtypes"])
@pytest.mark.parametrize("outer_dims", [(0, 0), (1, 2), (2, 1)], ids=lambda d: f"outer-dims-{d}")
def test_elementwise_ops_on_values_batched_by_several_vmaps(f, outer_dims):
    # x is batched by the outer and middle vmaps, y by all three, z (of a lower rank) by the
    # inner one only: the rules of three levels meet in each op
    dx, dy = outer_dims
    x = randn(3, 4, 5, 2).movedim(0, dx)
    y = randn(3, 4, 2, 5, 2, seed=1).movedim(0, dy)
    z = randn(2, 2, seed=2)

    def build(api):
        inner = api.vmap(f, in_dims=(None, 0, 0))
        middle = api.vmap(inner, in_dims=(0, 0, None))
        return api.vmap(middle, in_dims=(dx, dy, None))
    ours, theirs = build(mf)(x, y, z), build(tf)(x, y, z)
    assert ours.shape == theirs.shape == (3, 4, 2, 5, 2)
    assert_same(ours, theirs)


def test_vmap_randomness_error_raises():
    with pytest.raises(mf.RandomnessError, match=r"vmap\(.*torch\.rand.*randomness='error'"):
        mf.vmap(lambda x: x + torch.rand(3))(torch.zeros(4, 3))


@pytest.mark.parametrize("draw", [lambda x: torch.rand(3, dtype=DTYPE),
                                  lambda x: torch.randn((3,), dtype=DTYPE),
                                  lambda x: torch.rand_like(x)], ids=["rand", "randn", "rand_like"])
def test_vmap_randomness_different_and_same(draw):
    x = torch.zeros(5, 3, dtype=DTYPE)
    torch.manual_seed(0)
    different = mf.vmap(lambda x: x + draw(x), randomness="different")(x)
    assert different.shape == (5, 3)
    for i in range(1, 5):
        assert not torch.equal(different[0], different[i]), "rows should differ"
    torch.manual_seed(0)
    same = mf.vmap(lambda x: x + draw(x), randomness="same")(x)
    assert same.shape == (5, 3)
    for i in range(1, 5):
        assert torch.equal(same[0], same[i]), "rows should be identical"
    assert not torch.equal(same[0], torch.zeros(3, dtype=DTYPE))


# --- functional_call -----------------------------------------------------------------------------
def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                               torch.nn.Linear(4, 2)).to(DTYPE)


def detached_params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_functional_call_matches_module_and_restores_parameters():
    model = make_model()
    original = detached_params(model)
    params = {k: v * 2 for k, v in original.items()}
    x = randn(5, 3)
    expected = tf.functional_call(model, params, (x,))
    assert_same(mf.functional_call(model, params, (x,)), expected)
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), original[k]), f"{k} was not restored"
    # under grad: the parameters are wrapped values during the call
    loss = lambda p: mf.functional_call(model, p, x).sum()  # noqa: E731
    loss_t = lambda p: tf.functional_call(model, p, x).sum()  # noqa: E731
    assert_same(mf.grad(loss)(params), tf.grad(loss_t)(params))
    assert all(isinstance(v, torch.nn.Parameter) for v in model.parameters())


def per_sample_loss(ft, model):
    def loss(params, x, target):
        logits = ft.functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits, target.unsqueeze(0))
    return loss


def test_per_sample_gradients():
    model = make_model()
    params = detached_params(model)
    x, target = randn(6, 3, seed=1), torch.tensor([0, 1, 1, 0, 1, 0])
    ours = mf.vmap(mf.grad(per_sample_loss(mf, model)), in_dims=(None, 0, 0))(params, x, target)
    theirs = tf.vmap(tf.grad(per_sample_loss(tf, model)), in_dims=(None, 0, 0))(params, x, target)
    assert_same_structure(ours, theirs)
    assert ours["0.weight"].shape == (6, 4, 3)
    # and by a loop of ordinary autograd, one example at a time
    for i in range(6):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), target[i:i + 1]).backward()
        torch.testing.assert_close(ours["2.bias"][i], model[2].bias.grad)


def test_model_ensembling():
    models = [make_model(seed) for seed in range(3)]
    stacked = {k: torch.stack([detached_params(m)[k] for m in models])
               for k in detached_params(models[0])}
    base = make_model(10)
    x = randn(5, 3)

    def predict(ft):
        return lambda params, x: ft.functional_call(base, params, (x,))
    ours = mf.vmap(predict(mf), in_dims=(0, None))(stacked, x)
    assert_same(ours, tf.vmap(predict(tf), in_dims=(0, None))(stacked, x))
    with torch.no_grad():
        assert_same(ours, torch.stack([m(x) for m in models]))
    # different data per model too
    xs = randn(3, 5, 3, seed=1)
    assert_same(mf.vmap(predict(mf))(stacked, xs), tf.vmap(predict(tf))(stacked, xs))


# --- custom_vjp ----------------------------------------------------------------------------------
@mf.custom_vjp
def sin_double_grad(x):
    """sin(x) whose backward is doubled: gradients are those of 2 * sin(x)."""
    return torch.sin(x)


def _sin_double_grad_fwd(x):
    return torch.sin(x), (x,)


def _sin_double_grad_bwd(saved, ct):
    (x,) = saved
    return (ct * torch.cos(x) * 2,)


sin_double_grad.defvjp(_sin_double_grad_fwd, _sin_double_grad_bwd)


@mf.custom_vjp
def scaled_mul(x, y):
    return x * y


def _scaled_mul_fwd(x, y):
    return x * y, (x, y)


def _scaled_mul_bwd(saved, ct):
    x, y = saved
    return ct * y * 3, None  # a None: no gradient for y


scaled_mul.defvjp(_scaled_mul_fwd, _scaled_mul_bwd)


def twice_sin(x):
    return 2 * torch.sin(x)


def test_custom_vjp_forward_value_is_the_function():
    x = randn(3)
    assert_same(sin_double_grad(x), torch.sin(x))


def test_custom_vjp_under_grad():
    x = randn(3)
    assert_same(mf.grad(lambda x: sin_double_grad(x).sum())(x),
                tf.grad(lambda x: twice_sin(x).sum())(x))


def sin_double_grad_reference(x):
    """Value sin(x), gradient 2 cos(x): sin(x) + (sin(x) - sin(x).detach())."""
    s = torch.sin(x)
    return s + (s - s.detach())


def test_custom_vjp_under_vmap_of_grad():
    xs = randn(4, 3)
    assert_same(mf.vmap(mf.grad(lambda x: (sin_double_grad(x) * x).sum()))(xs),
                tf.vmap(tf.grad(lambda x: (sin_double_grad_reference(x) * x).sum()))(xs))


def test_custom_vjp_backward_is_differentiable():
    x = randn(3)
    # d/dx of the custom backward 2 cos(x) is -2 sin(x)
    ours = mf.grad(lambda x: mf.grad(lambda y: sin_double_grad(y).sum())(x).sum())(x)
    assert_same(ours, tf.grad(lambda x: tf.grad(lambda y: twice_sin(y).sum())(x).sum())(x))


def test_custom_vjp_under_jacrev_and_jacfwd():
    x = randn(3)
    assert_same(mf.jacrev(sin_double_grad)(x), tf.jacrev(twice_sin)(x))
    # forward mode differentiates the function itself, not the custom backward
    assert_same(mf.jacfwd(sin_double_grad)(x), tf.jacfwd(torch.sin)(x))


def test_custom_vjp_two_arguments_and_none_cotangent():
    x, y = randn(3), randn(3, seed=1)
    gx, gy = mf.grad(lambda x, y: scaled_mul(x, y).sum(), argnums=(0, 1))(x, y)
    assert_same((gx, gy), (3 * y, torch.zeros(3, dtype=DTYPE)))
    xs = randn(4, 3, seed=2)
    assert_same(mf.vmap(mf.grad(lambda x, y: scaled_mul(x, y).sum()), in_dims=(0, None))(xs, y),
                (3 * y).expand(4, 3))


# --- perturbation confusion, control flow --------------------------------------------------------
def test_perturbation_confusion_grad():
    one = torch.tensor(1.0, dtype=DTYPE)
    for x in (one, torch.tensor(3.0, dtype=DTYPE)):
        inner = lambda x: x * mf.grad(lambda y: x + y)(one)  # noqa: E731
        assert_same(mf.grad(inner)(x), torch.tensor(1.0, dtype=DTYPE))


def test_perturbation_confusion_jvp():
    one = torch.tensor(1.0, dtype=DTYPE)
    x = torch.tensor(2.0, dtype=DTYPE)

    def f(x):
        return x * mf.jvp(lambda y: x + y, (one,), (one,))[1]
    assert_same(mf.jvp(f, (x,), (one,)), (x, one))
    # and the product rule with a nested jvp that does depend on x
    def g(x):
        return mf.jvp(lambda y: x * y, (one,), (one,))[1] * x  # x * x
    assert_same(mf.jvp(g, (x,), (one,))[1], 2 * x)
    assert_same(mf.grad(g)(x), 2 * x)


def branchy(x):
    if x.sum() > 0:
        out = x.sin()
    else:
        out = x.cos() * 2
    for _ in range(int(x.abs().sum().item()) % 3 + 1):
        out = out * x
    return out


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_python_control_flow_under_grad_and_jvp(sign):
    x = randn(3).abs() * sign
    scalar = lambda x: branchy(x).sum()  # noqa: E731
    assert_same(mf.grad(scalar)(x), tf.grad(scalar)(x))
    t = randn(3, seed=1)
    assert_same(mf.jvp(branchy, (x,), (t,)), tf.jvp(branchy, (x,), (t,)))
    assert_same(mf.grad(mf.grad(scalar))(x[0:1].sum()), tf.grad(tf.grad(scalar))(x[0:1].sum()))


# --- tapes ---------------------------------------------------------------------------------------
def test_capture_tapes_outermost_first():
    x = randn(3)
    with mf.capture_tapes() as tapes:
        mf.grad(lambda x: mf.grad(lambda y: (y.sin() * y).sum())(x).sum())(x)
    assert len(tapes) == 2
    outer, inner = tapes
    # the inner level records the function; the outer one the function and the inner backward
    assert [e.prim.name for e in inner] == ["sin", "mul", "sum"]
    assert len(outer) > len(inner)
    assert [e.prim.name for e in outer][:3] == ["sin", "mul", "sum"]
    assert "cos" in [e.prim.name for e in outer]


def test_capture_tapes_collects_nothing_outside_the_block():
    with mf.capture_tapes() as tapes:
        pass
    mf.grad(lambda x: x.sin().sum())(randn(3))
    assert tapes == []


def test_tape_steps_seed_and_final_gradient_map():
    x = randn(3)
    f = lambda x: (x.sin() * x).sum()  # noqa: E731
    with mf.capture_tapes() as tapes:
        g = mf.grad(f)(x)
    (tape,) = tapes
    assert [e.prim.name for e in tape] == ["sin", "mul", "sum"]
    steps = tape.steps
    assert steps[0].index is None and steps[0].entry is None  # step 0 is the seed
    (seed_name, seed_ct, _), = steps[0].contributions
    assert seed_name == tape.entries[-1].output
    assert_same(seed_ct, torch.tensor(1.0, dtype=DTYPE))
    assert [s.index for s in steps[1:]] == [2, 1, 0]  # the entries, last first
    final = tape.gradient_map()
    input_name = tape.entries[0].inputs[0]
    gradient, sources = final[input_name]
    assert_same(gradient, g)
    assert_same(g, tf.grad(f)(x))
    assert sources == [1, 0]  # from mul, then from sin
    # an earlier step: only the seed so far
    assert set(tape.gradient_map(step=0)) == {seed_name}


# --- more compositions and options ---------------------------------------------------------------
def _sin_times_sum(v):
    return v.sin() * v.sum()


COMPOSITIONS = {
    "vmap_jacfwd": lambda ft, m, v: ft.vmap(ft.jacfwd(_sin_times_sum))(m),
    "jacrev_jacrev": lambda ft, m, v: ft.jacrev(ft.jacrev(_sin_times_sum))(v),
    "jvp_jvp": lambda ft, m, v: ft.jvp(lambda u: ft.jvp(torch.sin, (u,), (v * 2,))[1], (v,), (v,)),
    "grad_vmap": lambda ft, m, v: ft.grad(
        lambda a: ft.vmap(lambda r: (r.sin() * r).sum())(a).sum())(m),
    "vmap_vmap_grad": lambda ft, m, v: ft.vmap(ft.vmap(ft.grad(lambda s: s.sin() * s)))(m),
    "grad_grad_grad": lambda ft, m, v: ft.grad(ft.grad(ft.grad(lambda s: s.sin() * s ** 3)))(v[0]),
    "vmap_vjp": lambda ft, m, v: ft.vmap(lambda r: ft.vjp(torch.sin, r)[1](r))(m),
    "jvp_vmap": lambda ft, m, v: ft.jvp(ft.vmap(torch.sin), (m,), (m * 3,)),
    "linearize_vmap": lambda ft, m, v: ft.linearize(ft.vmap(torch.sin), m)[1](m),
    "vmap_grad_closure": lambda ft, m, v: ft.vmap(
        lambda r: ft.grad(lambda w: (w * r).sin().sum())(v))(m),
    "grad_of_vmap_broadcast": lambda ft, m, v: ft.grad(
        lambda w: ft.vmap(lambda r: (r * w).sum())(m).exp().sum())(v),
    "jacfwd_vmap": lambda ft, m, v: ft.jacfwd(ft.vmap(_sin_times_sum))(m),
    "hessian_vmap": lambda ft, m, v: ft.vmap(ft.hessian(lambda r: (r.sin() * r.sum()).sum()))(m),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_more_compositions(name):
    m, v = randn(3, 4), randn(4, seed=1)
    assert_same(COMPOSITIONS[name](mf, m, v), COMPOSITIONS[name](tf, m, v))


def test_hessian_with_argnums_tuple():
    f = lambda a, b: (a.sin() * b).sum() + (a * a * b * b).sum()  # noqa: E731
    a, b = randn(3), randn(3, seed=1)
    assert_same(mf.hessian(f, argnums=(0, 1))(a, b), tf.hessian(f, argnums=(0, 1))(a, b))


def test_grad_passes_keyword_arguments_through():
    f = lambda x, *, scale: (x * scale).sin().sum()  # noqa: E731
    x, scale = randn(3), randn(3, seed=1)
    assert_same(mf.grad(f)(x, scale=scale), tf.grad(f)(x, scale=scale))


def test_vmap_out_dims_as_a_pytree():
    f = lambda v: {"a": v, "b": (v.sum(), v * 2)}  # noqa: E731
    out_dims = {"a": 1, "b": (0, -1)}
    x = randn(3, 4)
    assert_same_structure(mf.vmap(f, out_dims=out_dims)(x), tf.vmap(f, out_dims=out_dims)(x))


@pytest.mark.parametrize("in_dims", [1, -1, (0, -1)], ids=str)
def test_vmap_chunk_size_with_non_leading_in_dims(in_dims):
    x, y = randn(5, 5), randn(4, 5, seed=1)
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims, in_dims)
    f = lambda a, b: a.sin().sum() * b  # noqa: E731
    assert_same(mf.vmap(f, in_dims=dims, chunk_size=2)(x, y), tf.vmap(f, in_dims=dims)(x, y))


def test_custom_vjp_under_plain_vmap_and_jvp_of_grad():
    xs, t = randn(4, 3), randn(3, seed=1)
    assert_same(mf.vmap(sin_double_grad)(xs), torch.sin(xs))
    x = xs[0]
    # jvp of the custom gradient 2 cos(x): -2 sin(x) * t
    _, tangent = mf.jvp(mf.grad(lambda y: sin_double_grad(y).sum()), (x,), (t,))
    assert_same(tangent, -2 * torch.sin(x) * t)
    assert_same(mf.jacfwd(mf.jacrev(lambda y: sin_double_grad(y).sum()))(x),
                torch.diag(-2 * torch.sin(x)))


# --- chunk_vmap (functorch.experimental) ---------------------------------------------------------
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("in_dim, out_dim", [(0, 0), (1, 2), (2, 1)])
@pytest.mark.parametrize("randomness", ["error", "same"])
def test_chunk_vmap_equals_vmap(chunks, in_dim, out_dim, randomness):
    from functorch.experimental import chunk_vmap as torch_chunk_vmap

    x = torch.randn(4, 5, 6)

    def f(x):
        y = x.sin()
        return y + torch.rand_like(x) if randomness == "same" else y

    results = []
    for make in (mf.chunk_vmap, torch_chunk_vmap):
        torch.manual_seed(0)
        results.append(make(f, in_dims=in_dim, out_dims=out_dim, randomness=randomness,
                            chunks=chunks)(x))
    torch.manual_seed(0)
    whole = mf.vmap(f, in_dims=in_dim, out_dims=out_dim, randomness=randomness)(x)
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], whole)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True])
def test_chunk_vmap_chunks_must_be_a_positive_int(chunks):
    with pytest.raises(mf.TransformError, match="chunks"):
        mf.chunk_vmap(torch.sin, chunks=chunks)


# --- torch.func's keywords: jvp(strict=), vjp_fn(retain_graph=, create_graph=), jacrev's -------
def test_jvp_strict_refuses_an_output_independent_of_the_inputs_as_torch_func():
    x = torch.randn(3)
    for api in (mf, torch.func):
        with pytest.raises(RuntimeError, match="independent of the inputs"):
            api.jvp(lambda a: torch.ones(2), (x,), (x,), strict=True)
        out, out_dot = api.jvp(torch.sin, (x,), (x,), strict=True)
        torch.testing.assert_close(out_dot, x.cos() * x)


@pytest.mark.parametrize("create_graph", [None, True, False])
def test_vjp_fn_takes_retain_graph_and_create_graph_as_torch_func(create_graph):
    x = torch.randn(3, requires_grad=True)
    results = []
    for api in (mf, torch.func):
        _, vjp_fn = api.vjp(torch.sin, x)
        first = vjp_fn(torch.ones(3), retain_graph=True, create_graph=create_graph)
        again = vjp_fn(torch.ones(3), create_graph=create_graph)  # the graph was retained
        results.append((first[0], again[0]))
    (ours, ours_again), (theirs, theirs_again) = results
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_again, theirs_again)
    assert ours.requires_grad == theirs.requires_grad == (create_graph is not False)


def test_jacrev_accepts_preallocate_and_copy():
    x = torch.randn(4)
    expected = torch.func.jacrev(torch.sin, chunk_size=3, _preallocate_and_copy=True)(x)
    torch.testing.assert_close(mf.jacrev(torch.sin, chunk_size=3, _preallocate_and_copy=True)(x),
                               expected)


@pytest.mark.parametrize("recurse", [True, False])
def test_debug_unwrap_shows_what_torch_func_shows(recurse):
    shapes = {}
    for api in (mf, torch.func):
        seen = []

        def f(x):
            seen.append(api.debug_unwrap(x, recurse=recurse))
            return x.sin()
        api.vmap(api.vmap(f))(torch.arange(24.0).reshape(2, 3, 4))
        (unwrapped,) = seen
        assert type(unwrapped) is torch.Tensor or not recurse
        shapes[api.__name__] = tuple(unwrapped.shape)
    assert shapes["minifunctorch.core"] == shapes["torch.func"]
    plain = torch.ones(2)
    assert mf.debug_unwrap(plain) is plain


# --- functionalize ---------------------------------------------------------------------------------
def _mutating(x):
    y = x.clone()
    y.add_(1.0)
    y[1:].mul_(2.0)  # a write through a view
    x.mul_(3.0)      # a write to the input: the caller's tensor changes
    return y.sin()


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
def test_functionalize_as_torch_func(remove):
    results = []
    for api in (mf, torch.func):
        x = torch.linspace(-1, 1, 4)
        out = api.functionalize(_mutating, remove=remove)(x)
        results.append((out, x))
    torch.testing.assert_close(results[0], results[1])


def test_functionalize_traces_to_a_program_without_writes():
    program = mf.trace(mf.functionalize(_mutating))(torch.ones(4))
    names = [eq.prim.name for eq in program.equations]
    assert names and not any(name.endswith("_") for name in names), names
    torch.testing.assert_close(program(torch.ones(4)), _mutating(torch.ones(4)))


def test_functionalize_refuses_an_unknown_remove():
    with pytest.raises(RuntimeError, match="received invalid argument for remove"):
        torch.func.functionalize(_mutating, remove="views")
    with pytest.raises(RuntimeError, match="received invalid argument for remove") as info:
        mf.functionalize(_mutating, remove="views")
    assert isinstance(info.value, mf.TransformError)


def test_jacrev_with_chunk_size_one_pulls_back_row_by_row_without_vmap():
    # as torch.func (pytorch/pytorch issue 127036): a backward with a data-dependent op
    # (nonzero) works with chunk_size=1, which vmap could not batch
    class IdentityWithNonzeroBackward(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad_output):
            grad_output.nonzero()
            return grad_output

    def f(x, y):
        return IdentityWithNonzeroBackward.apply(x).sin() * y, y.exp()

    x, y = torch.randn(3, 2), torch.randn(3, 2)
    ours = mf.jacrev(f, argnums=(0, 1), chunk_size=1)(x, y)
    theirs = torch.func.jacrev(f, argnums=(0, 1), chunk_size=1)(x, y)
    for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(theirs)):
        torch.testing.assert_close(a, b)
    with pytest.raises(mf.TransformError, match="nonzero"):
        mf.jacrev(f, chunk_size=2)(x, y)


@pytest.mark.parametrize("rows", [40, 4096])
def test_a_per_example_outer_product_is_a_broadcast_multiply_on_a_cpu(rows):
    """NOTE [Outer products: ...] in batching.py: on a CPU a per-example outer product is a
    broadcast multiply, small or large (4M elements of result here), never a batched matmul
    with an inner size of 1; the result is torch.func's bit for bit (one product per
    element)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, rows, generator=g), torch.randn(4, 256, generator=g)
    outer = lambda a, b: a.unsqueeze(1) @ b.unsqueeze(0)  # noqa: E731
    counts, ours = aten_calls(lambda: mf.vmap(outer)(a, b))
    assert "aten::bmm" not in counts and "aten::mul" in counts, counts
    assert torch.equal(ours, tf.vmap(outer)(a, b))


@pytest.mark.parametrize("rows", [40, 4096])
def test_a_large_per_example_outer_product_off_the_cpu_is_a_batched_matmul(rows):
    """Off the CPU (the meta device stands in for a GPU: the choice reads the device only),
    a large outer product is torch.func's batched matmul and a small one the multiply."""
    a, b = torch.empty(4, rows, device="meta"), torch.empty(4, 256, device="meta")
    outer = lambda a, b: a.unsqueeze(1) @ b.unsqueeze(0)  # noqa: E731
    counts, ours = aten_calls(lambda: mf.vmap(outer)(a, b))
    large = rows == 4096
    assert ("aten::bmm" in counts) == large and ("aten::mul" in counts) != large, counts
    assert ours.shape == (4, rows, 256) and ours.device.type == "meta"


def test_diag_of_a_matrix_is_a_copy_as_in_torch():
    """torch.diag of a 2-D tensor is a new tensor (torch.diagonal is the view): under vmap its
    result is laid out as torch.func's (contiguous), holds none of the input's memory, and a
    write into it leaves the input alone."""
    xs = torch.arange(18.0).reshape(2, 3, 3)
    ours, theirs = mf.vmap(torch.diag)(xs), tf.vmap(torch.diag)(xs)
    assert torch.equal(ours, theirs) and ours.stride() == theirs.stride() == (3, 1)
    assert ours.untyped_storage().data_ptr() != xs.untyped_storage().data_ptr()

    def write_into_the_diagonal(x):
        y = x * 1
        torch.diag(y).mul_(10)
        return y
    assert torch.equal(mf.vmap(write_into_the_diagonal)(xs), tf.vmap(write_into_the_diagonal)(xs))


# --- NOTE [Slices' cotangents are added in place] (core/autograd.py) ------------------------------
def _slicing_programs():
    """Functions that read a tensor slice by slice, mixed with other uses of it."""
    def steps(x):  # an RNN's loop: every step of x, in order
        h = torch.zeros(x.shape[1:], dtype=x.dtype)
        for x_t in x:
            h = torch.tanh(x_t + 0.5 * h)
        return h.sum()

    def mixed(x):  # slices, a whole-tensor use before and after, overlapping and repeated slices
        y = x * 1.5
        total = y.sum() + (y[1:4] * y[0:3]).sum() + y[2].sin().sum() + y[2].cos().sum()
        return total + (y[:, 1] ** 2).sum() + (y + 1).prod()

    def shared(x):  # a cotangent passed on unchanged (add's) to two inputs that are sliced
        a, b = x * 2, x * 3
        c = a + b
        return sum(c[i].exp().sum() for i in range(c.shape[0])) + a[0].sum() + b[-1].sum()
    return {"steps": steps, "mixed": mixed, "shared": shared}


@pytest.mark.parametrize("name", sorted(_slicing_programs()))
def test_slices_added_in_place_give_torch_funcs_gradients(name):
    f = _slicing_programs()[name]
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = tf.grad(f)(x)
    torch.testing.assert_close(mf.grad(f)(x), expected)
    torch.testing.assert_close(mf.vjp(f, x)[1](torch.tensor(1.0, dtype=torch.float64))[0],
                               expected)
    torch.testing.assert_close(mf.hessian(f)(x), tf.hessian(f)(x))  # (values: no in-place)
    torch.testing.assert_close(mf.vmap(mf.grad(f))(torch.stack([x, x.cos()])),
                               tf.vmap(tf.grad(f))(torch.stack([x, x.cos()])))
    with mf.capture_tapes():  # the stepper's pass keeps each partial sum: the pads, as before
        torch.testing.assert_close(mf.grad(f)(x), expected)


def test_a_loop_over_steps_pads_no_cotangent(monkeypatch):
    """The slices' cotangents go into one buffer: no zero-padded copy of x per step, with and
    without vmap."""
    from minifunctorch.core import primitives
    pads = []
    impl = primitives.scatter_index_p.impl
    monkeypatch.setattr(primitives.scatter_index_p, "impl",
                        lambda *args, **params: pads.append(params["shape"]) or impl(
                            *args, **params))
    steps = _slicing_programs()["steps"]
    x = torch.randn(50, 4, dtype=torch.float64)
    grad = mf.grad(steps)(x)
    assert pads == [], pads
    torch.testing.assert_close(grad, tf.grad(steps)(x))
    xs = torch.randn(3, 50, 4, dtype=torch.float64)  # per-sample: under vmap too
    per_sample = mf.vmap(mf.grad(steps))(xs)
    assert pads == [], pads
    torch.testing.assert_close(per_sample, tf.vmap(tf.grad(steps))(xs))


def test_an_index_that_keeps_every_element_has_a_reshape_for_its_cotangent(monkeypatch):
    """x[None], x[0] of a dim of one, x[:] keep every element in its order: the cotangent is
    the incoming one reshaped, with no zeros filled and copied into (neither scatter_index's
    nor a buffer of NOTE [Slices' cotangents are added in place])."""
    from minifunctorch.core import autograd, primitives
    pads, buffers = [], []
    impl = primitives.scatter_index_p.impl
    monkeypatch.setattr(primitives.scatter_index_p, "impl",
                        lambda *args, **params: pads.append(params["shape"]) or impl(
                            *args, **params))
    buffer_from = autograd._buffer_from
    monkeypatch.setattr(autograd, "_buffer_from",
                        lambda previous, shape, *args: buffers.append(shape) or buffer_from(
                            previous, shape, *args))

    def f(x):  # x: (1, 3, 4)
        y = x[None] * 2.0
        z = y[0][0, :, None] + x[:, 1:2][0]  # (3, 1, 4) + (1, 4); x[:, 1:2] pads
        return (z.sin() * x[:][0, ..., :]).sum() + x[0:1, ::1].exp().sum()
    x = torch.randn(1, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mf.grad(f)(x), tf.grad(f)(x))
    assert pads == [] and buffers == [(1, 3, 4)], (pads, buffers)  # (x[:, 1:2] drops some)
    xs = torch.randn(2, 1, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(mf.vmap(mf.grad(f))(xs), tf.vmap(tf.grad(f))(xs))
    assert pads == [] and buffers == [(1, 3, 4)] * 2, (pads, buffers)
    torch.testing.assert_close(mf.hessian(f)(x), tf.hessian(f)(x))
    first = lambda x: x[None, 0]  # noqa: E731
    torch.testing.assert_close(mf.jacrev(first)(x), tf.jacrev(first)(x))


def test_slices_under_two_vmaps_match_torch_func():
    """Cotangents of slices batched by different vmap levels (the inner example's and the
    outer's) meet in one input's gradient."""
    def f(x, w):
        return sum((x[i] * w[i]).sin().sum() for i in range(x.shape[0])) + (x[0] * w).sum()
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ws = torch.randn(2, 5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ours = mf.vmap(mf.vmap(mf.grad(f), in_dims=(None, 0)), in_dims=(None, 0))(x, ws)
    theirs = tf.vmap(tf.vmap(tf.grad(f), in_dims=(None, 0)), in_dims=(None, 0))(x, ws)
    torch.testing.assert_close(ours, theirs)
    xs = ws[:, 0]
    ours = mf.vmap(mf.vmap(mf.grad(f), in_dims=(0, None)), in_dims=(None, 0))(xs, ws[0])
    theirs = tf.vmap(tf.vmap(tf.grad(f), in_dims=(0, None)), in_dims=(None, 0))(xs, ws[0])
    torch.testing.assert_close(ours, theirs)
