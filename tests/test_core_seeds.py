"""The worked examples of the reference documents, on minifunctorch's engine.

simple_functorch: the explicit dispatcher API (``d.mul(d.add(a, b), b)``), higher-order
gradients with ``create_graph=True`` and with two stacked Autograd levels (the duplicated
tape), per-sample gradients with ``Autograd(Batched(Autograd(Torch())))``, and the Logger.
Autodidax: jvp of sin, ``deriv`` applied four times, Python control flow under jvp, vmap of
``add_one_to_a_scalar``, jacfwd of sin. torch.func (or a closed form) is the oracle.
"""
import math

import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core import Autograd, Batched, Logger, Torch, label, reset_names
from minifunctorch.core import FuncTensor

# torch.func scripts its decompositions on first use; torch deprecates torch.jit.script
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64


def plain(value):
    """The concrete tensor under a value of the explicit API (its payloads, all the way)."""
    while isinstance(value, FuncTensor):
        value = value.payload
    return value


def simple(d, a, b):
    return d.mul(d.add(a, b), b)


def inputs(shape=(4,), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (label(torch.rand(shape, generator=g, dtype=DTYPE), "a"),
            label(torch.rand(shape, generator=g, dtype=DTYPE), "b"))


def run_gradients(d2, d1, a, b):
    """L0 = sum(simple(a, b)) on d2; L1 = |dL0/da|^2 + |dL0/db|^2 on d1; dL1/d(a, b)."""
    L0 = d2.sum(simple(d2, a, b), name="L0")
    dL0_da, dL0_db = d2.grad(L0, [a, b])
    L1 = d1.sum(d1.add(d1.mul(dL0_da, dL0_da), d1.mul(dL0_db, dL0_db)), name="L1")
    return d1.grad(L1, [a, b])


def L1_reference(a, b):
    dL0_da, dL0_db = tf.grad(lambda a, b: ((a + b) * b).sum(), argnums=(0, 1))(a, b)
    return (dL0_da * dL0_da + dL0_db * dL0_db).sum()


# --- simple_functorch ----------------------------------------------------------------------------
def test_readme_example_matches_torch_func():
    a, b = label(torch.rand(4)), label(torch.rand(4))
    d = Autograd(Torch())
    loss = d.mul(d.add(a, b), b)
    da, db = d.grad(d.sum(loss), [a, b])
    expected = tf.grad(lambda a, b: ((a + b) * b).sum(), argnums=(0, 1))(a, b)
    torch.testing.assert_close((da, db), expected)
    torch.testing.assert_close((da, db), (b, a + 2 * b))  # the closed form


def test_first_order_gradients():
    a, b = inputs()
    d = Autograd(Torch())
    da, db = d.grad(d.sum(simple(d, a, b)), [a, b])
    assert type(da) is torch.Tensor and type(db) is torch.Tensor
    torch.testing.assert_close((da, db), (b, a + 2 * b))


def test_the_seeds_first_example_as_the_seed_writes_it():
    # the loss has dims: the backward pass starts from ones, the gradient of its sum
    a, b = inputs()
    d = Autograd(Torch())
    loss = simple(d, a, b)
    da, db = d.grad(loss, [a, b])
    torch.testing.assert_close((da, db), (b, a + 2 * b))
    with pytest.raises(mf.NonScalarOutputError):  # torch.func's grad keeps its scalar check
        mf.grad(lambda a: (a + b) * b)(a)


def test_higher_order_with_create_graph():
    a, b = inputs()
    d = Autograd(Torch(), create_graph=True)
    dL1_da, dL1_db = run_gradients(d, d, a, b)
    expected = tf.grad(L1_reference, argnums=(0, 1))(a, b)
    torch.testing.assert_close((plain(dL1_da), plain(dL1_db)), expected)
    # one tape holds the forward, the first backward (differentiable) and L1
    ops = [entry.prim.name for entry in d.tape]
    outputs = [entry.output for entry in d.tape]
    assert outputs[:3] == [outputs[0], outputs[1], "L0"] and ops[:3] == ["add", "mul", "sum"]
    assert "L1" in outputs
    first_backward = ops[3:outputs.index("L1")]
    assert first_backward[:2] == ["mul", "mul"] and "add" in first_backward, first_backward
    # the backward ops of L0 read the forward's values: mul(ct, b) and mul(ct, a + b)
    backward_inputs = {name for entry in d.tape.entries[3:5] for name in entry.input_labels}
    assert {"b", outputs[0]} <= backward_inputs


def test_higher_order_with_stacked_levels_duplicates_the_tape():
    a, b = inputs()
    d1 = Autograd(Torch(), name="Autograd1")
    d2 = Autograd(d1, name="Autograd2")
    stacked = run_gradients(d2, d1, a, b)
    assert all(type(g) is torch.Tensor for g in stacked)
    a2, b2 = inputs()
    d = Autograd(Torch(), create_graph=True)
    with_create_graph = [plain(g) for g in run_gradients(d, d, a2, b2)]
    torch.testing.assert_close(list(stacked), with_create_graph)  # the same numbers
    torch.testing.assert_close(tuple(stacked), tf.grad(L1_reference, argnums=(0, 1))(a, b))
    # d2 recorded the forward; d1 recorded the same entries (same names) and then more
    d2_entries = [entry.format() for entry in d2.tape]
    d1_entries = [entry.format() for entry in d1.tape]
    assert [e.prim.name for e in d2.tape] == ["add", "mul", "sum"]
    assert d1_entries[:3] == d2_entries
    assert d2_entries[0].startswith(d2.tape.entries[0].output) and " add a b" in d2_entries[0]
    assert len(d1_entries) > len(d2_entries) and d1.tape.entries[-1].output == "L1"


def run_batched_gradients(d3, d1, va, vb):
    """Per-example L0 on d3 (inside the batch), then L1 over the whole batch on d1."""
    L0 = d3.sum(simple(d3, va, vb), dim=0, name="L0")
    dL0_da, dL0_db = d3.grad(L0, [va, vb])
    L1 = d1.sum(d1.add(d1.mul(dL0_da, dL0_da), d1.mul(dL0_db, dL0_db)), name="L1")
    return d1.grad(L1, [va, vb])


def L1_batched_reference(a, b):
    """grad of the sum of squares of vmap(grad(L0))."""
    dL0_da, dL0_db = tf.vmap(tf.grad(lambda a, b: ((a + b) * b).sum(), argnums=(0, 1)))(a, b)
    return (dL0_da * dL0_da + dL0_db * dL0_db).sum()


def _named_stack():
    d1 = Autograd(Torch(), name="Autograd1")
    d3 = Autograd(Batched(d1, length=2, name="Batched2"), name="Autograd3")
    return d3, d1


def _one_constructor_stack():
    d3 = Autograd(Batched(Autograd(Torch()), length=2))
    return d3, d3.inner.inner


@pytest.mark.parametrize("make_stack", [_named_stack, _one_constructor_stack],
                         ids=["named", "one_constructor"])
def test_batched_gradients_per_sample(make_stack):
    va, vb = inputs((2, 4), seed=3)
    d3, d1 = make_stack()
    dva, dvb = run_batched_gradients(d3, d1, va, vb)
    assert type(dva) is torch.Tensor and dva.shape == (2, 4)
    torch.testing.assert_close((dva, dvb), tf.grad(L1_batched_reference, argnums=(0, 1))(va, vb))
    # closed form: dL0/da = b, dL0/db = a + 2b, so L1 = sum(b^2 + (a + 2b)^2)
    torch.testing.assert_close((dva, dvb), (2 * (va + 2 * vb), 2 * vb + 4 * (va + 2 * vb)))
    # d3 is inside the batch: its tape has per-example shapes; d1's tape has the batch
    assert [e.out_shape for e in d3.tape.entries] == [(4,), (4,), ()]
    assert d1.tape.entries[0].out_shape == (2, 4) and d1.tape.entries[-1].output == "L1"


def test_logger_prints_each_operation(capsys):
    reset_names()
    a, b = label(torch.rand(4)), label(torch.rand(4))  # v0, v1
    d = Logger(Torch())
    out = simple(d, a, b)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["v2: (4,) = v0 + v1", "v3: (4,) = v2 * v1"]
    torch.testing.assert_close(plain(out), (a + b) * b)
    d.sum(out)
    assert capsys.readouterr().out.strip() == "v4: () = sum(v3, dim=(0,), keepdim=False)"


def test_logger_prints_the_name_given_to_an_operation(capsys):
    reset_names()
    a, b = label(torch.rand(4)), label(torch.rand(4))
    d = Logger(Torch())
    d.sum(simple(d, a, b), name="total")
    last_line = capsys.readouterr().out.splitlines()[-1]
    assert last_line == "total: () = sum(v3, dim=(0,), keepdim=False)"
    # below an Autograd level too: the Logger line and the tape use the same name
    a2, b2 = inputs()
    d2 = Autograd(Logger(Torch(), name="Torch"))
    d2.sum(simple(d2, a2, b2), name="L0")
    assert capsys.readouterr().out.splitlines()[-1].startswith("Torch L0: () = sum(")
    assert d2.tape.entries[-1].output == "L0"


def test_logger_below_autograd_shows_the_backward_ops(capsys):
    a, b = inputs()
    d = Autograd(Logger(Torch(), name="Torch"))
    loss = d.sum(simple(d, a, b), name="L0")
    forward = capsys.readouterr().out.splitlines()
    assert len(forward) == 3 and all(line.startswith("Torch ") for line in forward)
    assert forward[-1].startswith("Torch ") and ": () = sum(" in forward[-1]
    d.grad(loss, [a, b])
    backward = capsys.readouterr().out.splitlines()
    assert any(" * b" in line for line in backward), backward


# --- Autodidax -----------------------------------------------------------------------------------
def scalar(value):
    return torch.tensor(value, dtype=DTYPE)


def test_jvp_of_sin():
    def f(x):
        y = torch.sin(x) * 2
        return -y + x
    y, y_dot = mf.jvp(f, (scalar(3.0),), (scalar(1.0),))
    assert math.isclose(y.item(), 2.7177599838802657, rel_tol=1e-12)
    assert math.isclose(y_dot.item(), 2.979984993200891, rel_tol=1e-12)
    out, tangent = mf.jvp(torch.sin, (scalar(3.0),), (scalar(1.0),))
    torch.testing.assert_close((out, tangent), (torch.sin(scalar(3.0)), torch.cos(scalar(3.0))))


def deriv(f):
    return lambda x: mf.jvp(f, (x,), (scalar(1.0),))[1]


def test_deriv_four_times():
    x = scalar(3.0)
    expected = [torch.cos(x), -torch.sin(x), -torch.cos(x), torch.sin(x)]
    f = torch.sin
    for order, value in enumerate(expected, start=1):
        f = deriv(f)
        torch.testing.assert_close(f(x), value, msg=f"derivative {order} of sin")
    assert math.isclose(deriv(deriv(torch.sin))(x).item(), -0.1411200080598672, rel_tol=1e-12)


def test_python_control_flow_under_jvp():
    def f(x):
        if x > 0.0:  # Python control flow on a concrete primal
            return 2.0 * x
        return x
    assert deriv(f)(scalar(3.0)).item() == 2.0
    assert deriv(f)(scalar(-3.0)).item() == 1.0


def test_vmap_of_add_one_to_a_scalar():
    def add_one_to_a_scalar(value):
        assert value.ndim == 0, "vmap hides the batch dim"
        return 1 + value
    vector_in = torch.arange(3.0, dtype=DTYPE)
    vector_out = mf.vmap(add_one_to_a_scalar, (0,), 0)(vector_in)
    torch.testing.assert_close(vector_out, torch.tensor([1.0, 2.0, 3.0], dtype=DTYPE))


def test_jacfwd_of_sin():
    x = torch.arange(3.0, dtype=DTYPE)
    torch.testing.assert_close(mf.jacfwd(torch.sin)(x), torch.diag(torch.cos(x)))

    def jacfwd_by_hand(f, x):  # Autodidax's definition: vmap of jvp over identity columns
        push_forward = lambda v: mf.jvp(f, (x,), (v,))[1]  # noqa: E731
        return mf.vmap(push_forward, (0,), 0)(torch.eye(x.numel(), dtype=DTYPE))
    torch.testing.assert_close(jacfwd_by_hand(torch.sin, x), tf.jacfwd(torch.sin)(x))


def test_jvp_takes_tensors_not_numbers():
    with pytest.raises(mf.TransformUsageError, match=r"jvp\(sin\)\(<inputs>\).*tensors"):
        mf.jvp(torch.sin, (3.0,), (1.0,))


# --- the explicit API of the other levels --------------------------------------------------------
def test_explicit_forward_level():
    d = mf.Forward(Torch())
    x = d.wrap_input(torch.tensor([0.0, 1.0], dtype=DTYPE), torch.tensor([1.0, 2.0], dtype=DTYPE))
    y = d.mul(d.sin(x), x)
    expected = tf.jvp(lambda v: torch.sin(v) * v, (x.payload,), (x.tangent,))
    torch.testing.assert_close((y.payload, y.tangent), expected)


def test_explicit_batched_level():
    d = Batched(Torch(), length=3)
    xs = torch.arange(6.0, dtype=DTYPE).reshape(3, 2)
    assert d.size(xs) == (2,) and d.dim(xs) == 1  # the batch dim is hidden
    torch.testing.assert_close(d.sum(xs).payload, xs.sum(1))
    torch.testing.assert_close(d.unsqueeze(xs, 0).payload, xs.unsqueeze(1))
    with pytest.raises(mf.TransformUsageError, match=r"^Batched: .*batch along dim 0 of size 3, "
                       r"got shape \(4, 2\)\. Fix: stack the examples along dim 0\."):
        d.sum(torch.ones(4, 2))


def test_explicit_autograd_grad_of_an_unused_input_is_zero():
    a, b = inputs()
    d = Autograd(Torch())
    # an input the loss does not depend on gets a zero gradient
    c = label(torch.ones(4, dtype=DTYPE), "c")
    da, dc = d.grad(d.sum(simple(d, a, b)), [a, c])
    torch.testing.assert_close((da, dc), (b, torch.zeros(4, dtype=DTYPE)))
