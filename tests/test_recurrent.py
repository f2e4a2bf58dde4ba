"""nn.LSTM, nn.GRU and nn.RNN under the transforms (core/recurrent.py: NOTE [LSTM's CPU
kernel], NOTE [GRU and plain RNNs at the front door], NOTE [The LSTM cell is two
primitives]).

On the CPU in float32, torch runs the LSTM as oneDNN's fused ``mkldnn_rnn_layer``
(NOTE [LSTM's CPU kernel]); in float64 it runs its unfused composition, on which torch.func
has every transform. The oracles: torch.func in float32 where it runs (grad), the loop of
torch.func's grads for per-sample gradients (torch.func's vmap has no rule for the
recurrent ops), and torch.func's jvp of the same module in float64 (its float32 jvp refuses
the fused kernel).
"""
import copy

import pytest
import torch
import torch.func as tf
import torch.nn as nn

import minifunctorch.core as mf
from oracle import aten_calls, central_differences

CONFIGS = {
    "lstm": (nn.LSTM, {}),
    "lstm_batch_first": (nn.LSTM, {"batch_first": True}),
    "lstm_2_layers_bidirectional": (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    "lstm_no_bias": (nn.LSTM, {"bias": False, "batch_first": True}),
    "lstm_projection": (nn.LSTM, {"proj_size": 2}),
    "gru": (nn.GRU, {"batch_first": True, "num_layers": 2}),
    "gru_bidirectional_no_bias": (nn.GRU, {"bidirectional": True, "bias": False}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu", "bidirectional": True}),
    "rnn_tanh_2_layers": (nn.RNN, {"num_layers": 2, "batch_first": True}),
}


def _module(name, dtype=torch.float32):
    cls, options = CONFIGS[name]
    torch.manual_seed(0)
    return cls(3, 4, **options).to(dtype)


def _weighted_sum(out):
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * weights).sum()


def _params(module):
    return {k: v.detach() for k, v in module.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_grad_of_the_parameters_matches_torch_func(name):
    module = _module(name)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))

    def loss(api):
        return lambda p: _weighted_sum(api.functional_call(module, p, (x,))[0])
    ours = mf.grad(loss(mf))(_params(module))
    theirs = tf.grad(loss(tf))(_params(module))
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_per_sample_gradients_match_a_loop_of_torch_func_grads(name):
    module = _module(name)
    xs = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(2))

    def loss(api):
        return lambda p, x: _weighted_sum(api.functional_call(module, p, (x,))[0])
    params = _params(module)
    ours = mf.vmap(mf.grad(loss(mf)), in_dims=(None, 0))(params, xs)
    for i, x in enumerate(xs):
        theirs = tf.grad(loss(tf))(params, x)
        for key in theirs:
            torch.testing.assert_close(ours[key][i], theirs[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_jvp_matches_torch_func_in_float64(name):
    module = _module(name)
    module64 = copy.deepcopy(module).double()
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(3))
    params = _params(module)
    tangents = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(4))
                for k, v in params.items()}
    out, out_dot = mf.jvp(lambda p: mf.functional_call(module, p, (x,))[0],
                          (params,), (tangents,))
    out64, out_dot64 = tf.jvp(lambda p: tf.functional_call(module64, p, (x.double(),))[0],
                              (_params(module64),), ({k: t.double() for k, t in tangents.items()},))
    torch.testing.assert_close(out, out64.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_dot, out_dot64.float(), rtol=1e-4, atol=1e-4)


def test_vmap_of_an_lstm_over_sequences_is_the_loop():
    module = _module("lstm_batch_first")
    xs = torch.randn(3, 2, 5, 3, generator=torch.Generator().manual_seed(5))
    out, (h, c) = mf.vmap(module)(xs)
    for i, x in enumerate(xs):
        expected, (h_i, c_i) = module(x)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h[i], h_i, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c[i], c_i, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN, nn.LSTM])
def test_a_packed_sequence_is_refused_with_the_fix(cls):
    """NOTE [GRU and plain RNNs at the front door]: no transform runs a packed sequence
    (torch.func's grad fails inside the kernel); the engine says so, and what to do."""
    from torch.nn.utils.rnn import pack_padded_sequence
    module = cls(3, 4)
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(5))

    def loss(p):
        out, _ = mf.functional_call(module, p, (pack_padded_sequence(x, torch.tensor([5, 3])),))
        return out.data.sum()
    with pytest.raises(mf.TransformError, match="packed sequence .* Fix: pass the padded batch"):
        mf.grad(loss)(_params(module))


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN, nn.LSTM])
def test_dropout_between_layers_is_drawn_under_vmap(cls):
    """In training, dropout between layers keeps torch's lowering (torch 2.13's decomposition
    drops it), so vmap draws it as its randomness says: refused in 'error' mode, one mask for
    every example with 'same'."""
    torch.manual_seed(0)
    module = cls(3, 4, num_layers=2, dropout=0.5).train()
    params = _params(module)
    xs = torch.ones(3, 5, 2, 3)

    def f(x):
        return mf.functional_call(module, params, (x,))[0]
    with pytest.raises(mf.TransformError, match="randomness"):
        mf.vmap(f)(xs)
    same = mf.vmap(f, randomness="same")(xs)
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    different = mf.vmap(f, randomness="different")(xs)
    assert not torch.equal(different[0], different[1])


# --- NOTE [The LSTM cell is two primitives] ----------------------------------------------------
CELL_CONFIGS = ["lstm", "lstm_2_layers_bidirectional", "lstm_projection", "gru",
                "gru_bidirectional_no_bias"]


@pytest.mark.parametrize("name", CELL_CONFIGS)
def test_hessian_of_an_lstm_or_gru_matches_torch_func_in_float64(name):
    """The cell primitives' rules are ops, differentiated again: second derivatives follow."""
    module = _module(name, torch.float64)
    x = torch.randn(4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = _params(module)

    def loss(api):
        return lambda x: _weighted_sum(api.functional_call(module, params, (x,))[0]) ** 2
    ours = mf.hessian(loss(mf))(x)
    torch.testing.assert_close(ours, tf.hessian(loss(tf))(x))
    torch.testing.assert_close(mf.jacrev(mf.jacfwd(loss(mf)))(x), ours)


@pytest.mark.parametrize("name", CELL_CONFIGS)
def test_grad_of_an_lstm_or_gru_matches_finite_differences(name):
    module = _module(name, torch.float64)
    x = torch.randn(3, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    params = _params(module)

    def loss(x):
        return _weighted_sum(mf.functional_call(module, params, (x,))[0])
    torch.testing.assert_close(mf.grad(loss)(x), central_differences(loss, (x,), 0), rtol=1e-6,
                               atol=1e-8)


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_per_sample_hessians_and_nested_vmaps_match_torch_func_in_float64(name):
    """The cells' backward formulas under vmap (batch dims in front) and under grad (through
    the doors), nested."""
    module = _module(name, torch.float64)
    xs = torch.randn(3, 4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    params = _params(module)

    def loss(api):
        return lambda x: api.functional_call(module, params, (x,))[0].sin().sum()
    hessians = mf.vmap(mf.hessian(loss(mf)))(xs)
    grads = mf.vmap(mf.vmap(mf.grad(loss(mf))))(torch.stack([xs, xs.cos()]))
    for i, x in enumerate(xs):
        torch.testing.assert_close(hessians[i], tf.hessian(loss(tf))(x))
        torch.testing.assert_close(grads[1, i], tf.grad(loss(tf))(x.cos()))


def test_the_lstm_cell_is_two_primitives_on_the_tape():
    """Per step: the step's slice of the input's projection, the hidden state's linear layer,
    their sum and the two cell primitives; no chunk of the gates, no pointwise ops of its
    own."""
    module = _module("lstm")
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(8))
    params = _params(module)
    with mf.capture_tapes() as tapes:
        mf.grad(lambda p: _weighted_sum(mf.functional_call(module, p, (x,))[0]))(params)
    names = [entry.prim.name for entry in tapes[0].entries]
    assert names.count("lstm_cell") == names.count("lstm_hidden") == 5, names
    assert names.count("getitem") == 5 and names.count("linear") == 1 + 5, names
    assert not {"sigmoid", "tanh", "split", "mul"} & set(names[:-2]), names


def test_the_gru_cell_is_one_primitive_on_the_tape():
    module = _module("gru")  # two layers
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(8))
    params = _params(module)
    with mf.capture_tapes() as tapes:
        mf.grad(lambda p: _weighted_sum(mf.functional_call(module, p, (x,))[0]))(params)
    names = [entry.prim.name for entry in tapes[0].entries]
    assert names.count("gru_cell") == 2 * 5, names
    assert not {"sigmoid", "tanh", "split", "mul"} & set(names[:-2]), names


@pytest.mark.parametrize("name, activations", [("lstm", {"sigmoid": 3, "tanh": 2}),
                                               ("gru", {"sigmoid": 2, "tanh": 1})])
@pytest.mark.parametrize("per_sample", [False, True])
def test_a_cells_first_derivative_keeps_its_activations(name, activations, per_sample):
    """NOTE [A cell's first derivative keeps its activations]: per step and layer, each
    sigmoid and tanh of the forward runs once, and the backward pass runs torch's
    sigmoid_backward and tanh_backward on them (not the partials, which compute them again)."""
    module = _module(name)  # the GRU has two layers, and takes its batch first
    xs = torch.randn(3, 2, 5, 3, generator=torch.Generator().manual_seed(9))
    steps, layers = (5 if module.batch_first else 2), module.num_layers
    params = _params(module)

    def loss(api):
        return lambda p, x: _weighted_sum(api.functional_call(module, p, (x,))[0])
    transform = mf.vmap(mf.grad(loss(mf)), in_dims=(None, 0)) if per_sample else mf.grad(loss(mf))
    calls, ours = aten_calls(lambda: transform(params, xs if per_sample else xs[0]))
    for activation, per_step in activations.items():
        assert calls.get(f"aten::{activation}") == per_step * steps * layers, calls
        assert calls.get(f"aten::{activation}_backward") == per_step * steps * layers, calls
    theirs = [tf.grad(loss(tf))(params, x) for x in (xs if per_sample else xs[:1])]
    expected = {k: torch.stack([t[k] for t in theirs]) if per_sample else theirs[0][k]
                for k in params}
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_an_lstm_under_vmap_of_jvp_matches_a_loop_of_torch_func_jvps_in_float64():
    module = _module("lstm_2_layers_bidirectional", torch.float64)
    xs = torch.randn(3, 4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    x_dots = torch.randn(xs.shape, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(10))
    params = _params(module)

    def f(api):
        return lambda x, x_dot: api.jvp(
            lambda x: api.functional_call(module, params, (x,))[0], (x,), (x_dot,))
    outs, out_dots = mf.vmap(f(mf))(xs, x_dots)
    for i, (x, x_dot) in enumerate(zip(xs, x_dots)):  # (torch.func's vmap has no LSTM rule)
        out, out_dot = f(tf)(x, x_dot)
        torch.testing.assert_close(outs[i], out)
        torch.testing.assert_close(out_dots[i], out_dot)


# --- single steps: nn.LSTMCell, nn.GRUCell, nn.RNNCell -------------------------------------------
CELLS = {"lstm_cell": (nn.LSTMCell, {}), "gru_cell": (nn.GRUCell, {}),
         "rnn_tanh_cell": (nn.RNNCell, {}), "rnn_relu_cell": (nn.RNNCell, {"nonlinearity": "relu"}),
         "gru_cell_no_bias": (nn.GRUCell, {"bias": False})}


def _cell(name, dtype=torch.float32):
    cls, options = CELLS[name]
    torch.manual_seed(0)
    return cls(3, 4, **options).to(dtype)


def _unrolled(api, cell, params, xs):
    """A loop of the cell over the steps of ``xs`` (steps, batch, features), its outputs'
    weighted sum; the LSTM carries (h, c)."""
    state = None
    outputs = []
    for x in xs:
        state = api.functional_call(cell, params, (x, state))
        outputs.append(state[0] if isinstance(state, tuple) else state)
    return _weighted_sum(torch.stack(outputs))


@pytest.mark.parametrize("name", sorted(CELLS))
def test_grad_of_a_loop_of_cells_matches_torch_func(name):
    cell = _cell(name)
    xs = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(11))
    params = _params(cell)
    ours = mf.grad(lambda p, xs: _unrolled(mf, cell, p, xs), argnums=(0, 1))(params, xs)
    theirs = tf.grad(lambda p, xs: _unrolled(tf, cell, p, xs), argnums=(0, 1))(params, xs)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_hessian_of_a_loop_of_cells_matches_torch_func_in_float64(name):
    cell = _cell(name, torch.float64)
    xs = torch.randn(3, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    params = _params(cell)
    ours = mf.hessian(lambda xs: _unrolled(mf, cell, params, xs) ** 2)(xs)
    theirs = tf.hessian(lambda xs: _unrolled(tf, cell, params, xs) ** 2)(xs)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("name", ["lstm_cell", "gru_cell"])
def test_per_sample_gradients_of_unbatched_cells_match_a_loop(name):
    """Each example is one sequence of 1-D steps (the module adds and removes the batch dim)."""
    cell = _cell(name)
    # (examples, steps, features)
    xs = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(13))
    params = _params(cell)

    def loss(api):
        return lambda p, x: _unrolled(api, cell, p, x)
    ours = mf.vmap(mf.grad(loss(mf)), in_dims=(None, 0))(params, xs)
    for i, x in enumerate(xs):
        theirs = tf.grad(loss(tf))(params, x)
        for key in theirs:
            torch.testing.assert_close(ours[key][i], theirs[key], rtol=1e-4, atol=1e-5)


def test_a_cell_of_mismatched_shapes_gets_torchs_error():
    cell = _cell("lstm_cell")
    h = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="batch size"):
        mf.grad(lambda x: cell(x, (h, h))[0].sum())(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="inconsistent hidden_size"):  # a cell state too wide
        mf.grad(lambda x: cell(x, (h, torch.zeros(3, 5)))[0].sum())(torch.randn(3, 3))
