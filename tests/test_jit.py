"""jit (issue 3): trace once per input signature, replay generated code; same numbers as
eager, under and over the other transforms."""
import importlib
import re
import shutil

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch.testing import assert_close

import minifunctorch.core as mf
from minifunctorch.core import Program, TransformError, grad, jit, trace, vmap
from minifunctorch.core.dispatch import transform_levels


@pytest.fixture(autouse=True)
def _no_level_left_behind():
    assert not transform_levels(), "a previous test left a transform level"
    yield
    assert not transform_levels(), f"the test left transform levels: {transform_levels()}"


def rand(seed, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def f(x, y):
    return (torch.tanh(x @ y) * x.sum() + torch.sin(x) @ y).sum()


def xy(seed, dtype=torch.float32):
    return rand(seed, 3, 4, dtype=dtype), rand(seed + 1, 4, dtype=dtype)


class Counter:
    """A function that counts how often Python runs it (only while tracing, under jit)."""

    def __init__(self, function):
        self.function = function
        self.calls = 0
        self.__name__ = function.__name__

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


# --- same numbers as eager ---------------------------------------------------------------------
def test_jit_of_f():
    x, y = xy(0)
    assert_close(jit(f)(x, y), f(x, y))


def test_jit_of_grad():
    x, y = xy(1)
    assert_close(jit(grad(f, argnums=(0, 1)))(x, y), tf.grad(f, argnums=(0, 1))(x, y))


def test_vmap_of_grad_and_jit_of_vmap_of_grad():
    xs, y = rand(2, 5, 3, 4), rand(3, 4)
    expected = tf.vmap(tf.grad(f), in_dims=(0, None))(xs, y)
    assert_close(vmap(grad(f), in_dims=(0, None))(xs, y), expected)
    assert_close(jit(vmap(grad(f), in_dims=(0, None)))(xs, y), expected)


def test_vmap_of_jit():
    xs, y = rand(4, 5, 3, 4), rand(5, 4)
    jf = jit(f)
    assert_close(vmap(jf, in_dims=(0, None))(xs, y), tf.vmap(f, in_dims=(0, None))(xs, y))


def test_grad_of_jit():
    x, y = xy(6)
    jf = jit(f)
    assert_close(grad(jf, argnums=(0, 1))(x, y), tf.grad(f, argnums=(0, 1))(x, y))
    # and the plain call still uses the generated code, with its own signature
    assert_close(jf(x, y), f(x, y))


def test_grad_of_grad_of_jit():
    g = jit(lambda x: torch.sin(x) * x ** 2)
    x = rand(7)
    assert_close(grad(grad(g))(x), tf.grad(tf.grad(lambda x: torch.sin(x) * x ** 2))(x))


def test_jit_of_a_per_example_mlp_gradient():
    def loss(params, x, target):
        w1, b1, w2 = params
        logits = torch.relu(x @ w1 + b1) @ w2
        return F.cross_entropy(logits.unsqueeze(0), target.unsqueeze(0))

    params = (rand(8, 4, 6), rand(9, 6), rand(10, 6, 3))
    xs, targets = rand(11, 5, 4), torch.tensor([0, 2, 1, 1, 0])
    per_example = jit(vmap(grad(loss), in_dims=(None, 0, 0)))
    expected = tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(params, xs, targets)
    assert_close(per_example(params, xs, targets), expected)


def test_jit_of_ops_with_an_optional_array_left_out():
    """A convolution without a bias and nll_loss without class weights bind their primitive
    with None in that place; the trace keeps it as a literal (it refused it before)."""
    def loss(w, x, target):
        logits = F.conv2d(x.unsqueeze(0), w).flatten(1)
        return F.nll_loss(F.log_softmax(logits, 1), target.unsqueeze(0))

    w, xs, targets = rand(0, 4, 3, 3, 3), rand(1, 5, 3, 4, 4), torch.tensor([0, 2, 1, 3, 0])
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    expected = tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(w, xs, targets)
    assert_close(jit(per_example)(w, xs, targets), expected)
    program = trace(per_example)(w, xs, targets)
    assert "convolution" in str(program) and " None " in str(program)
    assert_close(program(w, xs, targets), expected)


# --- the cache ---------------------------------------------------------------------------------
def test_new_shapes_and_dtypes_trace_again():
    jf = jit(f)
    assert jf.cache_size() == 0
    for expected_size, (x, y) in enumerate(
            [xy(0), xy(1, torch.float64), (rand(2, 2, 5), rand(3, 5))], start=1):
        out = jf(x, y)
        assert out.dtype == x.dtype
        assert_close(out, f(x, y))
        assert jf.cache_size() == expected_size
    # a signature seen before does not grow the cache
    jf(*xy(5))
    assert jf.cache_size() == 3


def test_a_repeated_signature_does_not_retrace():
    counted = Counter(f)
    jf = jit(counted)
    for seed in range(4):
        x, y = xy(seed)
        assert_close(jf(x, y), f(x, y))
    assert counted.calls == 1
    assert jf.cache_size() == 1
    jf(*xy(0, torch.float64))
    assert counted.calls == 2


def test_a_repeated_signature_does_not_retrace_under_vmap():
    counted = Counter(f)
    batched = vmap(jit(counted), in_dims=(0, None))
    for seed in range(3):
        xs, y = rand(seed, 5, 3, 4), rand(seed + 10, 4)
        assert_close(batched(xs, y), tf.vmap(f, in_dims=(0, None))(xs, y))
    assert counted.calls == 1


def test_static_arguments_are_part_of_the_signature():
    counted = Counter(lambda x, power, mode: x ** power if mode == "pow" else x * power)
    jf = jit(counted)
    x = rand(0, 3)
    assert_close(jf(x, 2, "pow"), x ** 2)
    assert_close(jf(x, 3, "pow"), x ** 3)
    assert_close(jf(x, 3, "mul"), x * 3)
    assert_close(jf(rand(1, 3), 3, "mul"), rand(1, 3) * 3)
    assert (counted.calls, jf.cache_size()) == (3, 3)


def test_static_numbers_of_different_types_do_not_share_a_trace():
    # 1 == 1.0 == True, but an integer tensor times 1.0 is a float tensor
    jf = jit(lambda i, k: i * k)
    i = torch.arange(3)
    assert jf(i, 1).dtype == torch.int64
    assert jf(i, 1.0).dtype == torch.float32
    assert jf(i, True).dtype == torch.int64
    assert jf.cache_size() == 3


def test_unhashable_static_argument_is_an_error():
    jf = jit(lambda x, options: x * len(options))
    with pytest.raises(TransformError, match=r"^jit\(f\)\(<inputs>\): a non-tensor argument of "
                                             r"type set is static and must be hashable"):
        jf(torch.ones(2), {2.0})


def test_pytree_inputs_and_outputs():
    def model(params, batch, *, scale=1.0):
        hidden = torch.tanh(batch["x"] @ params["w"] + params["b"])
        return {"out": hidden * scale, "stats": (hidden.mean(), hidden.amax())}

    params = {"w": rand(0, 4, 3), "b": rand(1, 3)}
    batch = {"x": rand(2, 5, 4)}
    jf = jit(model)
    got = jf(params, batch, scale=2.0)
    expected = model(params, batch, scale=2.0)
    assert set(got) == {"out", "stats"} and isinstance(got["stats"], tuple)
    assert_close(got, expected)
    # a different static keyword is a different signature
    assert_close(jf(params, batch, scale=3.0), model(params, batch, scale=3.0))
    assert jf.cache_size() == 2


def test_an_error_on_the_first_call_leaves_jit_usable():
    jf = jit(f)
    with pytest.raises(RuntimeError):
        jf(rand(0, 3, 4), rand(1, 5))  # shapes that do not multiply
    assert jf.cache_size() == 0
    x, y = xy(2)
    assert_close(jf(x, y), f(x, y))
    assert jf.cache_size() == 1


def test_an_error_from_data_dependent_control_flow_leaves_jit_usable():
    state = {"branch": True}

    def g(x):
        if state["branch"]:
            if x.sum() > 0:  # needs a concrete value: tracing refuses
                return x
        return -x

    jg = jit(g)
    with pytest.raises(TransformError, match=r"^\w+\(g\)\(<inputs>\): Python needed the "
                                             r"concrete value"):
        jg(torch.ones(3))
    state["branch"] = False
    assert_close(jg(torch.ones(3)), -torch.ones(3))


def test_program_for_and_repr():
    jf = jit(lambda x: torch.sin(x) + torch.sin(x))
    x = torch.ones(3)
    program = jf.program_for(x)
    assert isinstance(program, Program)
    # the replayed program is simplified: the repeated sin is computed once
    assert str(program) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
      c:f32[3] = add b b
  in (c,) }"""
    assert jf.program_for(x) is program
    assert jf.cache_size() == 1
    assert repr(jf) == "jit(<lambda>, backend=None)"


def test_trace_of_jit_inlines_the_simplified_program():
    jf = jit(lambda x: torch.sin(x) + torch.sin(x) * 2)
    x = torch.ones(3)
    assert str(trace(jf)(x)) == str(jf.program_for(x)) == """\
{ lambda ; a:f32[3] .
  let b:f32[3] = sin a
      c:f32[3] = mul b 2
      d:f32[3] = add b c
  in (d,) }"""


def test_captured_tensors_are_constants_of_the_generated_code():
    weight = rand(0, 3)
    jf = jit(lambda x: x * weight)
    assert_close(jf(torch.ones(3)), weight)


def test_jit_inside_a_transform_over_a_captured_transformed_value():
    # the traced program captures x, a value of the enclosing grad: it is evaluated with
    # bind (not the generated code) and never cached
    def outer(x):
        inner = jit(lambda y: (torch.sin(y) * x).sum())
        return inner(torch.ones(3)) + inner(2 * torch.ones(3))

    x = rand(1, 3)
    assert_close(grad(outer)(x), torch.sin(torch.ones(3)) + torch.sin(2 * torch.ones(3)))


def test_unknown_backend_is_an_error():
    with pytest.raises(TransformError, match=r"^jit\(f, backend='xla'\): expected backend=None"):
        jit(f, backend="xla")


def _inductor_unavailable():
    """Why torch.compile's inductor backend cannot run here, or None."""
    if not hasattr(torch, "compile"):
        return "torch.compile is not available in this torch build"
    try:
        importlib.import_module("torch._inductor")
    except Exception as error:  # a build without inductor
        return f"torch._inductor cannot be imported: {error}"
    if not any(shutil.which(compiler) for compiler in ("g++", "c++", "clang++")):
        return "inductor compiles C++ for the CPU, and no C++ compiler is on PATH"
    return None


# ~7 s with a warm inductor cache, ~50 s cold (it compiles C++): slow
@pytest.mark.slow
def test_inductor_backend():
    reason = _inductor_unavailable()
    if reason is not None:
        pytest.skip(reason)
    jf = jit(lambda x: torch.sin(x) * 2 + x.sum(), backend="inductor")
    x = rand(0, 8)
    assert_close(jf(x), torch.sin(x) * 2 + x.sum())
    x = rand(1, 8)
    assert_close(jf(x), torch.sin(x) * 2 + x.sum())
    assert jf.cache_size() == 1
    assert repr(jf) == "jit(<lambda>, backend='inductor')"


def test_a_program_with_kept_kernel_outputs_compiles_to_one_graph():
    """NOTE [Kernels with two outputs] (core/nn.py): while dynamo traces an exported program
    (jit's inductor backend), max pooling's indices and the convolution's grad_bias are
    computed, not taken from the cache, whose data pointers and weak references dynamo cannot
    follow (it broke the graph at every take), and pooling keeps its NCHW layout (NOTE [Max
    pooling on the CPU runs channels-last]). Dynamo alone, with its eager backend: no C++."""
    weight, bias = rand(0, 8, 2, 3, 3), rand(1, 8)
    # pooled as (4, 8, 48, 48): the channels-last size; and the convolution (165,888 im2col
    # elements) above the small kernels' limit on either kind of CPU, so that the eager
    # module takes oneDNN as the compiled one does (NOTE [Small convolutions on a CPU])
    xs = rand(2, 4, 2, 50, 50)

    def loss(weight, bias, x):
        h = F.max_pool2d(F.relu(F.conv2d(x, weight, bias)), 2)
        return h.square().sum()
    f = grad(loss, argnums=(0, 1))
    program = trace(f)(weight, bias, xs)
    assert {"max_pool_indices", "convolution_backward_bias"} <= {
        equation.prim.name for equation in program.equations}
    module = program.to_fx()
    explanation = torch._dynamo.explain(module)(weight, bias, xs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, \
        explanation.break_reasons
    assert "channels_last" not in explanation.graphs[0].code
    compiled = torch.compile(module, backend="eager")
    assert_close(compiled(weight, bias, xs), module(weight, bias, xs), rtol=0, atol=0)
    assert_close(compiled(weight, bias, xs), tuple(f(weight, bias, xs)))


# --- the generated code's rewrites: the same bits, faster (fast_code.py) ------------------------
def _reused(f, *args):
    """The source lines of f's program whose equations write into a dead operand."""
    from minifunctorch.core.fast_code import reusable_equations
    program = trace(f)(*args)
    names = program.names()
    return [names[program.equations[i].out] for i in sorted(reusable_equations(program))]


def test_buffer_reuse_takes_only_dead_fresh_intermediates():
    x, row = rand(0, 3, 4), rand(1, 4)
    # sin writes a fresh buffer; mul and exp may reuse it, never x's (the caller's)
    assert _reused(lambda x: (x.sin() * 2).exp(), x) == ["c", "d"]
    # each mul reuses its sin's buffer, and the add the first mul's
    assert _reused(lambda x: x.sin() * 2 + x.sin() * 3, x) == ["c", "e", "f"]
    # b is read again by the add: the mul may not overwrite it (the add may overwrite c)
    assert _reused(lambda x: (lambda y: y * 2 + y)(x.sin()), x) == ["d"]
    # an output is never overwritten, nor is an operand read twice by the same equation
    assert _reused(lambda x: (lambda y: (y, y.cos()))(x.sin()), x) == []
    assert _reused(lambda x: (lambda y: y * y)(x.sin()), x) == []
    # a view of the intermediate may still be read: no reuse once one is taken
    assert _reused(lambda x: (lambda y: (y.reshape(12), y.cos()))(x.sin()), x) == []
    # broadcasting up or promoting: the result does not fit the operand
    assert _reused(lambda x, row: row.sin() + x, x, row) == []
    assert _reused(lambda x: x.sin() * torch.ones(3, 4, dtype=torch.float64), x) == []
    # an op with static parameters is left alone; so is one with no in-place method, and
    # its result is not known to be memory of its own
    assert _reused(lambda x: torch.special.xlogy(x.sin(), x).exp(), x) == ["c", "d"]
    assert _reused(lambda x: torch.clamp(x.sin(), min=0.0), x) == []
    assert _reused(lambda x: torch.maximum(x.sin(), x).exp(), x) == []


def test_number_operands_become_tensors_only_where_the_bits_are_the_same():
    from minifunctorch.core.fast_code import number_operand_tensor

    def numbered(f, x):
        return [number_operand_tensor(eq) for eq in trace(f)(x).equations]

    x = rand(0, 5)
    # x * 1.5 | reciprocal x | (that) * 2 | div(2, x) | x ** 3.0
    mul, _, rdiv, div, power = numbered(lambda x: [x * 1.5, 2 / x, torch.div(2, x), x ** 3.0], x)
    assert mul.dtype == torch.float32 and mul.item() == 1.5 and rdiv.item() == 2
    assert div is None and power is None  # a number first; pow's own kernel for a number
    for dtype in (torch.float16, torch.bfloat16, torch.int64):  # computed with a float32 number
        assert numbered(lambda x: x * 3, x.to(dtype)) == [None]
    assert numbered(lambda x: x * 2 ** 62, x.double())[0].item() == 2.0 ** 62
    complex_x = torch.complex(x, x)
    assert numbered(lambda x: x * 1j, complex_x)[0].dtype == torch.complex64


_REWRITTEN_CASES = {
    "S1 chain under vmap": (lambda x: vmap(lambda r: _chain(r))(x), (rand(0, 10, 10),)),
    "S1 chain under grad": (lambda x: grad(lambda v: _chain(v))(x), (rand(1, 10, 10),)),
    "vmap of grad of an MLP": (
        lambda w, x: vmap(grad(lambda w, x: torch.tanh(x @ w).sum() / 3), in_dims=(None, 0))(w, x),
        (rand(2, 4, 3), rand(3, 5, 4))),
    "numbers on both sides": (lambda x: (1.5 - x * 2) / 3 + 2 / (x + 4) - x ** 2.0,
                              (rand(4, 7, dtype=torch.float64),)),
    "complex": (lambda x: (x * 1j + 2).exp() * 0.5, (torch.complex(rand(5, 6), rand(6, 6)),)),
}


def _chain(x):
    for _ in range(5):
        x = torch.tanh(torch.sin(x) * 1.1) + 0.1
    return x.sum()


@pytest.mark.parametrize("name", sorted(_REWRITTEN_CASES))
def test_rewritten_code_gives_the_same_bits_and_leaves_inputs_alone(name):
    f, args = _REWRITTEN_CASES[name]
    program = trace(f)(*args)
    source, _ = program.python_source(reuse_buffers=True, number_tensors=True)
    assert re.search(r" = \w+\.\w+_\(", source), f"no buffer is reused:\n{source}"
    assert "_number0" in source, f"no number operand is a tensor:\n{source}"
    copies = [a.clone() for a in args]
    plain = program.compile_python()(*args)
    rewritten = program.compile_python(reuse_buffers=True, number_tensors=True)(*args)
    assert all(torch.equal(a, c) for a, c in zip(args, copies))
    assert len(plain) == len(rewritten)
    assert all(torch.equal(p, r) for p, r in zip(plain, rewritten))
    assert all(torch.equal(p, r) for p, r in zip(plain, (jit(f)(*args),)))


def test_jit_code_that_reuses_buffers_steps_aside_for_torch_autograd():
    # autograd keeps intermediates for its backward: where it records, jit runs the code
    # without reuse, and backward works
    f = jit(lambda x: (torch.tanh(torch.sin(x) * 2) + 1).exp().sum())
    x = rand(0, 6).requires_grad_()
    f(x).backward()
    expected = torch.autograd.grad((torch.tanh(torch.sin(x) * 2) + 1).exp().sum(), x)[0]
    assert torch.equal(x.grad, expected)
    with torch.no_grad():
        assert torch.equal(f(x), (torch.tanh(torch.sin(x) * 2) + 1).exp().sum())
    weight = rand(1, 6).requires_grad_()  # a captured constant that autograd tracks
    g = jit(lambda x: (torch.sin(x * weight) * 2).exp().sum())
    g(rand(2, 6)).backward()
    expected = torch.autograd.grad((torch.sin(rand(2, 6) * weight) * 2).exp().sum(), weight)[0]
    assert torch.equal(weight.grad, expected)


def test_complex_numbers_are_literals_of_programs():
    # trace refused `x * 1j`; a non-finite complex number is no Python literal, (1+infj)
    f = lambda x: x * 1j + complex(1.0, float("inf"))  # noqa: E731
    x = torch.complex(rand(0, 4), rand(1, 4))
    program = trace(f)(x)
    assert "mul a 1j" in str(program)
    same = dict(rtol=0, atol=0, equal_nan=True)
    assert_close(jit(f)(x), f(x), **same)
    assert_close(program.to_fx()(x)[0], f(x), **same)


# --- indices out of range are refused at every replay --------------------------------------
_INDEXED = {
    "embedding": (lambda w, i: F.embedding(i, w), IndexError),
    "index_select": (lambda w, i: w.index_select(0, i), IndexError),
    "index_add": (lambda w, i: w.index_add(0, i, torch.ones(len(i), 3)), RuntimeError),
    "index_copy": (lambda w, i: w.index_copy(0, i, torch.ones(len(i), 3)), IndexError),
    "embedding_bag": (lambda w, i: F.embedding_bag(i[None], w), RuntimeError),
}


@pytest.mark.parametrize("transform", ["plain", "grad", "vmap"])
@pytest.mark.parametrize("name", sorted(_INDEXED))
def test_a_program_refuses_indices_out_of_range_at_each_call(name, transform):
    """NOTE [Indices out of range are read, not wrapped]: a trace has no index values, so
    the check is a step of the program; a replay with a negative or too large index raises
    as eager code does, with torch's exception type (advanced indexing would read -1 from
    the end)."""
    f, error = _INDEXED[name]
    if transform == "grad":
        f = mf.grad(lambda w, i, f=f: f(w, i).sum())
    elif transform == "vmap":
        f = mf.vmap(f, in_dims=(None, 0))
    batched = transform == "vmap"
    w = torch.randn(5, 3)
    program = mf.jit(f)
    good = torch.tensor([[4, 0]]) if batched else torch.tensor([4, 0])
    torch.testing.assert_close(program(w, good), f(w, good))
    for bad in ([-1, 2], [5, 1]):
        bad = torch.tensor([bad]) if batched else torch.tensor(bad)
        with pytest.raises(error, match="out of|not in the valid range"):
            f(w, bad)  # (torch's own error where no transform runs)
        with pytest.raises(error, match="out of|not in the valid range"):
            program(w, bad)
    torch.testing.assert_close(program(w, good), f(w, good))


# --- random numbers: a program draws anew at each call ----------------------------------------
_RANDOM = {
    "rand": lambda x: x + torch.rand(3),
    "rand_like": lambda x: x + torch.rand_like(x),
    "randint": lambda x: x + torch.randint(0, 5, (3,)),
    "bernoulli": lambda x: torch.bernoulli(x * 0.5),
    "normal": lambda x: torch.normal(x, 1.0),
    "uniform_": lambda x: x.clone().uniform_(),
    "a fill of a new tensor": lambda x: x * torch.empty(3).uniform_(-1, 1),
    "randperm": lambda x: x * torch.randperm(3),
    "multinomial": lambda x: torch.multinomial(x.abs() + 0.1, 2).float(),
    "dropout": lambda x: F.dropout(x, 0.5),
    "aten_bernoulli": lambda x: torch.ops.aten.bernoulli.p(x, 0.5),
    "vmap_different": vmap(lambda x: x + torch.rand(()), randomness="different"),
    "vmap_same": vmap(lambda x: x + torch.rand(()), randomness="same"),
}


@pytest.mark.parametrize("backend", [None, pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(_RANDOM))
def test_random_draws_are_made_anew_at_each_call_as_eager_torch_makes_them(name, backend):
    """NOTE [Random numbers in a traced program]: the draws were refused (one draw replayed
    at every call would be silently wrong); now each call draws, the same numbers as eager
    torch from the same seed (under inductor, numbers of its own)."""
    if backend == "inductor" and _inductor_unavailable() is not None:
        pytest.skip(_inductor_unavailable())
    f, x = _RANDOM[name], torch.arange(1.0, 4.0) / 4
    jitted = jit(f, backend=backend)
    torch.manual_seed(0)
    ours = [jitted(x) for _ in range(3)]
    torch.manual_seed(0)
    eager = [f(x) for _ in range(3)]
    if backend is None:
        for mine, theirs in zip(ours, eager):
            assert torch.equal(mine, theirs)
    assert any(not torch.equal(ours[0], later) for later in ours[1:]), "each call draws"
    assert jitted.cache_size() == 1
    program = jitted.program_for(x)
    assert any(equation.prim.name == "draw" for equation in program.equations)


def test_a_jitted_training_step_with_dropout_matches_torch_func():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 2)).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = rand(0, 5, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])

    def loss(api):
        return lambda p, x, y: F.cross_entropy(api.functional_call(model, p, (x,)), y)
    step = jit(mf.grad_and_value(loss(mf)))
    torch.manual_seed(1)
    ours = [step(params, x, y) for _ in range(3)]
    torch.manual_seed(1)
    theirs = [tf.grad_and_value(loss(tf))(params, x, y) for _ in range(3)]
    assert_close(ours, theirs)
    torch.manual_seed(2)  # grad of a jitted function that draws
    jitted_grad = grad(jit(lambda x: (F.dropout(x, 0.4) * x).sum()))(x)
    torch.manual_seed(2)
    assert_close(jitted_grad, tf.grad(lambda x: (F.dropout(x, 0.4) * x).sum())(x))


def test_a_program_keeps_every_draw_in_order():
    x = torch.ones(3)
    program = jit(lambda x: x + torch.rand(3) - torch.rand(3)).program_for(x)
    assert [eq.prim.name for eq in program.equations].count("draw") == 2, "never shared"
    jitted = jit(lambda x: (torch.rand(4), x * 2)[1])  # a draw nothing reads still draws
    torch.manual_seed(3)
    jitted(x)
    after_ours = torch.rand(1)
    torch.manual_seed(3)
    torch.rand(4)
    assert torch.equal(after_ours, torch.rand(1))
    assert "draw" in jitted.program_for(x).python_source()[0]


DRAWS = {
    "dropout": lambda r: F.dropout(r, 0.5, training=True) * r.sum(),
    "rand": lambda r: r + torch.rand(4),
    "bernoulli_of_a_traced_tensor": lambda r: torch.bernoulli(r.sigmoid()),  # (an aten draw)
    "randn_like": lambda r: torch.randn_like(r) * r,
    "dropout1d": lambda r: F.dropout1d(r.reshape(2, 2), 0.5, training=True),
    "fill": lambda r: r.clone().uniform_() + r,  # (an in-place fill of a batched tensor)
    "bernoulli_fill": lambda r: torch.empty_like(r).bernoulli_(0.3) * r,
}


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
@pytest.mark.parametrize("name", list(DRAWS))
def test_a_programs_draws_follow_an_outer_vmap(name, randomness):
    """NOTE [A program's draw under an outer vmap]: vmap(jit(f)) gives vmap(f)'s numbers and
    torch.func's from the same seed, or raises where they raise (the same error class)."""
    f, x = DRAWS[name], torch.randn(3, 4)
    runs = [lambda: vmap(jit(f), randomness=randomness)(x),
            lambda: vmap(f, randomness=randomness)(x),
            lambda: tf.vmap(f, randomness=randomness)(x)]
    results = []
    for run in runs:
        torch.manual_seed(0)
        try:
            results.append(run())
        except Exception as error:  # noqa: BLE001 - compared below
            results.append(error)
    ours, eager, theirs = results
    if isinstance(theirs, Exception):
        assert isinstance(ours, mf.RandomnessError) and isinstance(eager, mf.RandomnessError)
        # the same first sentence (the rest names the call the program recorded: dropout's
        # is torch.bernoulli)
        assert str(ours).split(". ")[0] == str(eager).split(". ")[0], (ours, eager)
    else:
        assert torch.equal(ours, eager) and torch.equal(ours, theirs)


def test_a_programs_draws_under_outer_vmaps_composed():
    """Chunks, nested vmaps, grad around them, and a trace recording around the vmap (its
    program replays the batched draw) give torch.func's numbers from the same seed."""
    f = DRAWS["dropout"]
    x, xx = torch.randn(3, 4), torch.randn(2, 3, 4)
    recorded = trace(vmap(jit(f), randomness="different"))(x)
    pairs = [
        (lambda: vmap(jit(f), randomness="different", chunk_size=2)(x),
         lambda: tf.vmap(f, randomness="different", chunk_size=2)(x)),
        (lambda: vmap(jit(f), randomness="same", chunk_size=2)(x),
         lambda: tf.vmap(f, randomness="same", chunk_size=2)(x)),
        (lambda: vmap(vmap(jit(f), randomness="same"), randomness="different")(xx),
         lambda: tf.vmap(tf.vmap(f, randomness="same"), randomness="different")(xx)),
        (lambda: grad(lambda x: vmap(jit(f), randomness="different")(x).sum())(x),
         lambda: tf.grad(lambda x: tf.vmap(f, randomness="different")(x).sum())(x)),
        (lambda: jit(vmap(jit(f), randomness="different"))(x),
         lambda: tf.vmap(f, randomness="different")(x)),
        (lambda: recorded(x), lambda: tf.vmap(f, randomness="different")(x)),
    ]
    for ours, theirs in pairs:
        torch.manual_seed(0)
        mine = ours()
        torch.manual_seed(0)
        assert_close(mine, theirs(), rtol=0, atol=0)
    assert [eq.prim.name for eq in recorded.equations].count("draw") == 1
    # a jitted function that draws, called with plain tensors inside the vmapped function
    # (a warm cache entry of the fast path included): it draws per example, as eager code
    noise = jit(lambda ones: ones * torch.rand(4))
    noise(torch.ones(4))
    for _ in range(2):
        torch.manual_seed(0)
        mine = vmap(lambda r: r + noise(torch.ones(4)), randomness="different")(x)
        torch.manual_seed(0)
        assert torch.equal(mine, tf.vmap(lambda r: r + torch.ones(4) * torch.rand(4),
                                         randomness="different")(x))
    # a fill of a tensor that is the same for every example: eager vmap refuses it under
    # 'different'; the program cannot tell it from a batched one, and draws per example
    unbatched_fill = lambda r: r + torch.empty(4).uniform_()  # noqa: E731
    torch.manual_seed(0)
    mine = vmap(jit(unbatched_fill), randomness="different")(x)
    torch.manual_seed(0)
    assert torch.equal(mine, x + torch.rand(3, 4))


def test_draws_a_program_cannot_follow_are_refused():
    x = torch.randn(5, 3)
    with pytest.raises(mf.UnsupportedOperationError, match=r"^trace\(<lambda>\)\(<inputs>\): "
                                                           r"torch\.rand\(\.\.\., generator"):
        jit(lambda x: x + torch.rand(3, generator=torch.Generator()))(x)
    functional_fill = lambda r: torch.ops.aten.uniform(r, 0.0, 1.0)  # noqa: E731
    with pytest.raises(mf.RandomnessError, match=r"^vmap\(<lambda>\)\(<inputs>\): the "
                                                 r"traced program draws random numbers "
                                                 r"\(aten\.uniform\.default\) in code made "
                                                 r"for one call \(a random aten op without a "
                                                 r"rule.*Fix: put the vmap inside"):
        vmap(jit(functional_fill), randomness="different")(x)
    with pytest.raises(mf.UnsupportedOperationError, match=r"^trace\(<lambda>\)\(<inputs>\): "
                                                           r"torch\.nn\.functional\.rrelu draws "
                                                           r"random slopes .*Fix: "):
        jit(lambda x: F.rrelu(x, training=True))(x)
    assert_close(jit(F.rrelu)(x), F.rrelu(x)), "in eval mode it draws nothing"
    assert_close(jit(vmap(lambda r: r * 2))(x), x * 2), "the next call works"


def test_a_recorded_dropout_holds_no_constant_of_the_inputs_size():
    """Dropout's draw reads only a shape (bernoulli of a base tensor): the program's constant
    for it is one zero, expanded, not an uninitialized tensor of the input's size."""
    x = torch.randn(256, 1024)
    program = trace(lambda x: F.dropout(x, 0.5, training=True))(x)
    held = [value for _, value in program.constants]
    assert held and all(c.untyped_storage().nbytes() <= 8 for c in held), held
    assert all(torch.equal(c, torch.zeros_like(c)) for c in held)


def test_dropout_in_eval_mode_traces_as_the_identity():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)).eval()
    x = torch.randn(2, 3)
    assert_close(jit(model)(x), model(x))
    assert_close(jit(lambda x: F.dropout(x, 0.5, training=False))(x), x)


# --- writes into the caller's tensors ----------------------------------------------------------
def _running_stats(x, stats, count):
    stats.mul_(0.9).add_(0.1 * x.mean(0))
    count += 1  # an in-place add on a 0-d tensor
    stats[0] = stats[0] * 2  # through a view
    return x - stats


def _sgd_step(params, x):
    def loss(params, x):
        return ((x @ params["w"] + params["b"]) ** 2).sum()
    g = grad(loss)(params, x)
    with torch.no_grad():
        for k in params:
            params[k].sub_(0.1 * g[k])
    return loss(params, x)


def test_a_traced_function_that_writes_its_inputs_writes_them_at_every_call():
    """NOTE [A traced function that writes its inputs]: the replay used to return the right
    outputs and leave the caller's tensors as they were."""
    jitted = jit(_running_stats)
    eager_stats, eager_count = torch.zeros(3), torch.tensor(0)
    ours_stats, ours_count = torch.zeros(3), torch.tensor(0)
    for seed in range(3):
        x = rand(seed, 4, 3)
        assert_close(jitted(x, ours_stats, ours_count), _running_stats(x, eager_stats, eager_count))
        assert_close(ours_stats, eager_stats)
        assert_close(ours_count, eager_count)
    assert eager_count.item() == 3 and jitted.cache_size() == 1
    program = jitted.program_for(rand(0, 4, 3), ours_stats, ours_count)
    assert program.writes and str(program).splitlines()[-1].endswith(
        " writes b <- " + program.names()[program.outputs[program.writes[0][1]]] + ", c <- "
        + program.names()[program.outputs[program.writes[1][1]]] + " }")
    assert "writes" in program._repr_html_()
    stats = torch.zeros(3)  # trace(f) gives a program that writes as well
    trace(_running_stats)(rand(0, 4, 3), torch.zeros(3), torch.tensor(0))(
        rand(0, 4, 3), stats, torch.tensor(0))
    assert_close(stats, _stats_after(rand(0, 4, 3)))


def _stats_after(x):
    stats = torch.zeros(3)
    _running_stats(x, stats, torch.tensor(0))
    return stats


@pytest.mark.parametrize("backend", [None, pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_jitted_sgd_step_updates_the_parameters_as_eager_does(backend):
    if backend == "inductor" and _inductor_unavailable() is not None:
        pytest.skip(_inductor_unavailable())
    step = jit(_sgd_step, backend=backend)
    x = rand(0, 4, 3)
    ours = {"w": torch.ones(3, 1, requires_grad=True), "b": torch.zeros(1, requires_grad=True)}
    eager = {k: v.detach().clone().requires_grad_() for k, v in ours.items()}
    for _ in range(3):
        assert_close(step(ours, x), _sgd_step(eager, x))
        for k in ours:
            assert_close(ours[k], eager[k])
    assert not torch.equal(ours["w"], torch.ones(3, 1)), "the parameters moved"


def test_a_jitted_function_that_writes_its_input_under_grad_and_vmap():
    def f(x, buf):
        buf.copy_(x * 3)
        return (buf * x).sum()
    jitted = jit(f)
    ours, eager = torch.zeros(2), torch.zeros(2)
    assert_close(grad(jitted)(torch.tensor([1.0, 2.0]), ours),
                 tf.grad(f)(torch.tensor([1.0, 2.0]), eager))
    assert_close(ours, eager)
    ours, eager = torch.zeros(3, 2), torch.zeros(3, 2)
    assert_close(vmap(jitted)(rand(1, 3, 2), ours), tf.vmap(f)(rand(1, 3, 2), eager))
    assert_close(ours, eager)


def test_a_write_into_an_argument_that_another_argument_aliases_is_refused():
    """NOTE [A write into an argument that another argument aliases]: the program read the
    second argument as it was before the write, silently (eager torch sees the write)."""
    def f(a, b):
        a.add_(1)
        return a * b

    def g(a, b):
        a.mul_(2)
        return b.sum()
    x = torch.ones(4)
    for call, args in ((jit(f), (x, x)), (jit(g), (x[:2], x)), (jit(f), (x[1:], x[:3])),
                       (trace(f)(torch.ones(4), torch.ones(4)), (x, x))):
        with pytest.raises(mf.UnsupportedOperationError,
                           match=r"writes in place into its tensor argument 0, which shares "
                                 r"memory with argument 1.*Fix: pass a copy"):
            call(*args)
        assert x.tolist() == [1.0] * 4, "nothing was written"
    # memory that does not overlap, an alias that the program never reads, and aliases
    # without writes run as in eager torch
    for fn, make in ((g, lambda t: (t[:2], t[2:])), (lambda a, b: a.add_(1) * 2, lambda t: (t, t)),
                     (lambda a, b: a * b, lambda t: (t, t))):
        ours, eager = torch.ones(4), torch.ones(4)
        assert_close(jit(fn)(*make(ours)), fn(*make(eager)))
        assert_close(ours, eager)


def test_an_in_place_op_that_reshapes_a_traced_input_is_refused():
    def f(x):
        x.unsqueeze_(0)
        return x * 2
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^trace\(f\)\(<inputs>\): an in-place op that changes an input's "
                             r"shape .*Fix: "):
        jit(f)(torch.ones(3))
    assert jit(lambda x: x.sin())(torch.ones(3)).shape == (3,), "the next call works"


# --- writes into tensors the traced function closes over ---------------------------------------
_CAPTURED = {
    "add_": lambda state, x: state.add_(1),
    "setitem through a view": lambda state, x: state.__setitem__(0, 5.0),
    "a view's add_": lambda state, x: state[1:].add_(2.0),
    "+=": lambda state, x: state.__iadd__(1),
    "out=": lambda state, x: torch.add(state, 1, out=state),
}


@pytest.mark.parametrize("name", sorted(_CAPTURED))
def test_a_write_into_a_tensor_the_traced_function_closes_over_is_refused(name):
    """NOTE [A traced function that writes a tensor it closes over]: the write would run once,
    when traced, and every later call would skip it silently."""
    state = torch.zeros(3)

    def f(x):
        _CAPTURED[name](state, x)
        return x * 2
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^trace\(f\)\(<inputs>\): .* writes in place into a tensor that "
                             r"the traced function closes over.*Fix: pass the tensor as an "
                             r"argument"):
        jit(f)(torch.ones(3))
    assert state.tolist() == [0.0, 0.0, 0.0], "nothing was written"
    # the same write outside a trace, and inside grad, runs as in eager torch
    _CAPTURED[name](state, None)
    assert not torch.equal(state, torch.zeros(3))
    assert grad(lambda x: f(x).sum())(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


class _Marked(torch.Tensor):
    """A tensor subclass with memory of its own (``as_subclass``)."""


def test_a_write_into_a_tensor_subclass_the_traced_function_closes_over_is_refused():
    state = torch.zeros(3).as_subclass(_Marked)
    weight = torch.arange(3.0).as_subclass(_Marked)

    def f(x):
        state.add_(1)
        return x * 2

    def g(x):  # one the function makes may be written, as a plain one may
        made = weight * 2
        made.add_(1)
        return x * made
    with pytest.raises(mf.UnsupportedOperationError, match=r"^trace\(f\)\(<inputs>\): Tensor"
                                                           r"\.add_\(\.\.\.\) writes in place "
                                                           r"into a tensor that the traced"):
        jit(f)(torch.ones(3))
    assert state.tolist() == [0.0, 0.0, 0.0], "nothing was written"
    assert_close(jit(g)(torch.ones(3)).as_subclass(torch.Tensor), torch.tensor([1.0, 3.0, 5.0]))
    assert weight.tolist() == [0.0, 1.0, 2.0]


def test_tensors_the_traced_function_creates_may_be_written():
    weight = torch.arange(3.0)

    def f(x):
        masked = weight.clone()
        masked[0] = 0.0               # copies made inside: their writes are part of the trace
        shifted = weight * 2
        shifted.add_(1)
        shifted[1:].mul_(3)
        return x * masked + shifted
    jitted = jit(f)
    for seed in range(3):
        x = rand(seed, 3)
        assert_close(jitted(x), f(x))
    assert weight.tolist() == [0.0, 1.0, 2.0]


def test_a_thread_that_traces_does_not_refuse_another_threads_writes():
    import threading
    captured = torch.zeros(2)
    results = {}

    def other_thread():
        try:  # a plain write inside grad, outside any trace: allowed
            results["other"] = grad(lambda x: (captured.add_(1), (x * 2).sum())[1])(torch.ones(2))
        except Exception as error:  # noqa: BLE001 (reported below)
            results["other"] = error

    def f(x):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        return x * 2
    assert_close(jit(f)(torch.ones(2)), torch.full((2,), 2.0))
    assert not isinstance(results["other"], Exception), results["other"]
    assert captured.tolist() == [1.0, 1.0]


# --- grad modes inside a traced function --------------------------------------------------------
def _with_a_no_grad_region(x):
    with torch.no_grad():
        shift = x * 2                       # a constant for every derivative
        with torch.enable_grad():
            back_on = x.sin()               # recorded again
    with torch.set_grad_enabled(False):
        scale = x.exp()
    return (shift * x + back_on + scale).sum()


def test_a_no_grad_region_of_the_traced_function_stays_a_constant():
    """NOTE [A no_grad region in a traced function]: the program used to differentiate
    through it, under grad(jit(f)) and under torch's autograd over the replay alike."""
    jitted = jit(_with_a_no_grad_region)
    x = rand(0, 3)
    assert_close(grad(jitted)(x), tf.grad(_with_a_no_grad_region)(x))
    assert_close(mf.hessian(jitted)(x), tf.hessian(_with_a_no_grad_region)(x))
    leaf = x.clone().requires_grad_()
    jitted(leaf).backward()
    eager = x.clone().requires_grad_()
    _with_a_no_grad_region(eager).backward()
    assert_close(leaf.grad, eager.grad)
    with torch.no_grad():  # a first call under no_grad traces the same program
        fresh = jit(_with_a_no_grad_region)
        assert not fresh(x.clone().requires_grad_()).requires_grad
    assert_close(grad(fresh)(x), tf.grad(_with_a_no_grad_region)(x))
    tangent = torch.ones(3)
    assert_close(mf.jvp(jitted, (x,), (tangent,)), tf.jvp(_with_a_no_grad_region, (x,), (tangent,)))
    assert sum(eq.prim.name == "no_grad" for eq in jitted.program_for(x).equations) == 2


# --- batch norm in training mode inside a traced function ---------------------------------------
def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
                               torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 4 * 4, 2)).double()


@pytest.mark.parametrize("backend", [None, pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_jitted_training_step_with_batch_norm_updates_the_buffers_as_eager_does(backend):
    """NOTE [Running statistics in a traced function]: the running statistics used to need
    a concrete input ("Python needed the concrete value of a traced tensor")."""
    if backend == "inductor" and _inductor_unavailable() is not None:
        pytest.skip(_inductor_unavailable())
    import copy
    model = _bn_model()
    eager = copy.deepcopy(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def loss(params, buffers, x, y):
        return F.cross_entropy(mf.functional_call(model, (params, buffers), (x,)), y)
    step = jit(mf.grad_and_value(loss), backend=backend)
    for seed in range(3):
        x, y = rand(seed, 4, 2, 6, 6, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
        grads, value = step(params, buffers, x, y)
        eager_value = F.cross_entropy(eager(x), y)
        eager_grads = torch.autograd.grad(eager_value, list(eager.parameters()))
        assert_close(value, eager_value)
        for (name, ours), theirs in zip(grads.items(), eager_grads):
            assert_close(ours, theirs, msg=name)
        for name, theirs in eager.named_buffers():
            assert_close(buffers[name], theirs, msg=name)
    assert buffers["1.num_batches_tracked"].item() == 3
    assert step.cache_size() == 1, "one trace, replayed: the buffers move at every call"


def test_batch_norm_of_the_functional_and_torch_forms_under_jit_with_keywords():
    x = rand(1, 5, 3, dtype=torch.float64)

    def functional_form(x, mean, var):
        return F.batch_norm(x, running_mean=mean, running_var=var, training=True, momentum=0.3)

    def torch_form(x, mean, var):
        return torch.batch_norm(x, None, None, mean, var, True, 0.2, 1e-5, False)
    for fn in (functional_form, torch_form):
        ours = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        theirs = tuple(t.clone() for t in ours)
        jitted = jit(fn)
        for _ in range(2):
            assert_close(jitted(x, *ours), fn(x, *theirs))
            assert_close(ours, theirs)
        assert not torch.equal(ours[0], torch.zeros(3)), "the statistics moved"


def test_batch_norm_statistics_a_traced_function_cannot_update_are_refused():
    mean, var = torch.zeros(3), torch.ones(3)
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^trace\(<lambda>\)\(<inputs>\): batch_norm\(\.\.\., "
                             r"training=True\) inside a traced function: .*closes over.*Fix: "
                             r"pass the buffers as arguments"):
        jit(lambda x: F.batch_norm(x, mean, var, training=True))(torch.randn(4, 3))
    assert mean.tolist() == [0.0] * 3 and var.tolist() == [1.0] * 3, "nothing was written"
    with pytest.raises(mf.UnsupportedOperationError, match=r"under vmap .*Fix: "):
        jit(vmap(lambda x, m, v: F.batch_norm(x, m, v, training=True)))(
            torch.randn(2, 4, 3), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^trace\(<lambda>\)\(<inputs>\): native_batch_norm\(\.\.\., "
                             r"training=True\) .*Fix: "):
        jit(lambda x, m, v: torch.ops.aten._native_batch_norm_legit(
            x, None, None, m, v, True, 0.1, 1e-5)[0])(torch.randn(4, 3), mean, var)
    assert jit(lambda x: x * 2)(torch.ones(2)).tolist() == [2.0, 2.0], "the next call works"


# --- shapes that depend on the data -------------------------------------------------------------
_DATA_SHAPED = {
    "x[mask]": lambda x: x[x > 0],
    "masked_select": lambda x: x.masked_select(x > 0),
    "nonzero": torch.nonzero,
    "argwhere": torch.argwhere,
    "unique": torch.unique,
    "bincount": lambda x: torch.bincount((x.abs() * 3).long()),
    "repeat_interleave": lambda x: torch.repeat_interleave(x, (x.abs() * 3).long()),
}


@pytest.mark.parametrize("name", sorted(_DATA_SHAPED))
def test_an_op_whose_shape_depends_on_the_data_is_refused_in_words_that_say_so(name):
    """NOTE [Shapes that depend on the data]: these used to fail with the trace's general
    words about Python needing a concrete value, or as an aten op without a rule."""
    with pytest.raises(mf.UnsupportedOperationError,
                       match=r"^trace\(<lambda>\)\(<inputs>\): .* returns as many elements as "
                             r"the data says, and a traced program has one fixed shape .*Fix: "
                             r"use a fixed-shape formulation \(torch\.where"):
        jit(lambda x: _DATA_SHAPED[name](x) * 2)(rand(0, 5))
    # a mask that the function closes over has one count: it traces, as in eager
    mask = torch.tensor([True, False, True, True, False])
    x = rand(1, 5)
    assert_close(jit(lambda x: x[mask] * 2)(x), x[mask] * 2)
