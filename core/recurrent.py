"""Recurrent layers: nn.LSTM, nn.GRU and nn.RNN, run as torch's decompositions at the front door,
and the LSTM's cell as two primitives.

NOTE [LSTM's CPU kernel]
``nn.LSTM`` calls ``torch.lstm``, a composite that torch lowers, on a CPU with oneDNN, to one
``aten.mkldnn_rnn_layer`` per layer and direction: a fused kernel with no derivative formula
that the engine could reuse, and no decomposition in ``torch._decomp``. So ``torch.lstm`` is
computed at the front door (NOTE [GRU and plain RNNs at the front door]) as torch's own
decomposition of the LSTM does when it does not use oneDNN (``lstm_impl`` with
``one_layer_lstm``: the input projection for every step at once, then per step the four gates
from the hidden state), each layer with the cell of NOTE [The LSTM cell is two primitives].
torch.func's LSTM also runs on the unfused path under grad. Where torch's lowering is kept
(dropout between layers in training), its ``mkldnn_rnn_layer`` reaches the aten door, whose
rule below computes the layer as ``one_layer_lstm`` does; the kernel's fourth output, a
workspace for its own backward, is not needed there: an empty tensor stands in for it.
"""
import torch
import torch.nn.functional as F
from torch._decomp.decompositions import (_rnn_helper, gather_params, gru_impl,
                                          one_layer_lstm, rnn_relu_input, rnn_tanh_input)

from . import aten_api, ops, torch_api
from . import primitives as P
from .autograd import vjp_rules, wants_cotangent
from .batching import batching_rules, same_shape_batch
from .errors import UnsupportedOperationError
from .forward import add_tangents, jvp_rules
from .tensor import as_tensor, call_with_tensors, unwrap_all
from .values import bind

aten = torch.ops.aten
_LSTM_MODE = 2  # oneDNN's rnn_kind::LSTM, the only mode torch's CPU LSTM passes


@aten_api.register(aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer(input, weight_ih, weight_hh, bias_ih, bias_hh, hx, cx, reverse,
                     batch_sizes, mode, hidden_size, num_layers, has_biases, bidirectional,
                     batch_first, train):
    if mode != _LSTM_MODE or batch_sizes:
        raise UnsupportedOperationError(
            f"aten.mkldnn_rnn_layer(..., mode={mode}, batch_sizes={list(batch_sizes)}): only "
            "the LSTM mode on padded (not packed) sequences is supported inside transforms. "
            "Fix: pad the sequences (torch.nn.utils.rnn.pad_packed_sequence) before the LSTM.")

    def layer(input, weight_ih, weight_hh, bias_ih, bias_hh, hx, cx):
        # the input comes time-first (torch has moved a batch-first input's dims already:
        # batch_first only records that it did); the states are (batch, hidden) from torch's
        # C++ LSTM and (1, batch, hidden) from its Python decomposition
        layered = hx.dim() == 3
        if layered:
            hx, cx = hx.squeeze(0), cx.squeeze(0)
        params = [weight_ih, weight_hh] + ([bias_ih, bias_hh] if has_biases else [])
        out, (hy, cy) = one_layer_lstm(input, (hx, cx), params, has_biases, reverse=reverse)
        if layered:
            hy, cy = hy.unsqueeze(0), cy.unsqueeze(0)
        workspace = torch.empty(0, dtype=torch.uint8, device=out.device)
        return out, hy, cy, workspace
    return call_with_tensors(layer, input, weight_ih, weight_hh, bias_ih, bias_hh, hx, cx)


# NOTE [GRU and plain RNNs at the front door]
# nn.GRU and nn.RNN call torch.gru, torch.rnn_tanh and torch.rnn_relu: composites that torch
# lowers to linear layers and pointwise ops, each of which reached the engine through the
# aten door, about a dozen calls per time step: grad of a GRU of 64 units over 20 steps took
# 7.6 times torch.func's time. torch._decomp's decompositions of them (gru_impl,
# rnn_tanh_input, rnn_relu_input: the input projection of every step at once, then the cell
# per step) are the same computation in torch calls, which on FuncTensors take the front
# door and its rules. Two cases keep torch's lowering: dropout between layers in training
# (torch 2.13's decomposition never applies it: its test ``num_layers < i - 1`` is never
# true), and packed sequences, which no transform runs (torch.func's neither: the kernels read
# the data pointers of its wrapped tensors), refused here with the fix.
def _is_packed(second):
    """The packed overloads take (data, batch_sizes, ...): int64 batch sizes second, where
    the padded ones take the hidden state."""
    return getattr(second, "dtype", None) is torch.int64


def _refuse_packed(name):
    return UnsupportedOperationError(
        f"torch.{name}(data, batch_sizes, ...): a packed sequence (nn.utils.rnn.PackedSequence) "
        "is not supported inside transforms (nor inside torch.func's). Fix: pass the padded "
        "batch (pad_packed_sequence) and read each sequence's outputs up to its length.")


def _rnn_at_the_front_door(name, decomposition):
    def rnn(input, hx, params, has_biases, num_layers, dropout, train, *args):
        if _is_packed(hx):
            raise _refuse_packed(name)
        if train and dropout > 0 and num_layers > 1:
            return NotImplemented
        return call_with_tensors(decomposition, input, hx, list(params), has_biases,
                                 num_layers, dropout, train, *args)
    return rnn


for _name, _decomposition in (("gru", gru_impl), ("rnn_tanh", rnn_tanh_input),
                              ("rnn_relu", rnn_relu_input)):
    torch_api.register(getattr(torch, _name))(_rnn_at_the_front_door(_name, _decomposition))


# NOTE [The LSTM cell is two primitives]
# Per step, an LSTM computes its gates (i, f, g, o: the four blocks of one linear layer of the
# hidden state plus the input's projection), then c' = sigmoid(f) c + sigmoid(i) tanh(g) and
# h' = sigmoid(o) tanh(c'). As torch ops that is a chunk and ten pointwise ops, each a bind at
# every level, and a chunk's four slices each pad their cotangent back to the gates' shape:
# grad of a 64-unit LSTM over 20 steps took 2.5 times torch.func's time. So the two formulas
# are primitives, lstm_cell (gates, c -> c') and lstm_hidden (gates, c' -> h'), with torch's
# arithmetic in torch's order (LSTMCell in aten/src/ATen/native/RNN.cpp), so the values are
# its bits. Each is elementwise in its state and in each gate block, so one table of partial
# derivatives per primitive, written once in ops, gives both rules: the vjp multiplies the
# cotangent by each partial (the gate blocks side by side, a block that does not enter is
# zero), and the jvp sums each partial times its tangent. Being ops, the partials are
# differentiated and batched again by the levels below, so Hessians follow. Under vmap the
# batch dim goes in front of every argument (same_shape_batch): the formulas read the last
# dim only. cuDNN's LSTM fuses the same step (its backward kernel is the vjp here).
def _gate_blocks(gates):
    """The four gate blocks (i, f, g, o) of an LSTM's gates, along the last dim."""
    if type(gates) is torch.Tensor:
        return gates.chunk(4, -1)
    size = ops.shape_of(gates)[-1] // 4
    return [ops.getitem(gates, (Ellipsis, slice(k * size, (k + 1) * size))) for k in range(4)]


def _lstm_cell_impl(gates, cx):
    in_gate, forget_gate, cell_gate, _ = gates.chunk(4, -1)
    return forget_gate.sigmoid() * cx + in_gate.sigmoid() * cell_gate.tanh()


def _lstm_hidden_impl(gates, cy):
    return gates.chunk(4, -1)[3].sigmoid() * cy.tanh()


lstm_cell_p = P.primitive("lstm_cell", _lstm_cell_impl)
lstm_hidden_p = P.primitive("lstm_hidden", _lstm_hidden_impl)


def _sigmoid_derivative(s):
    return ops.sub(s, ops.mul(s, s))  # s (1 - s), at s = sigmoid(x)


def _tanh_derivative(t):
    return ops.sub(1, ops.mul(t, t))  # 1 - t^2, at t = tanh(x)


def lstm_cell_partials(gates, cx):
    """{gate block: d c' / d block}, d c' / d c."""
    in_gate, forget_gate, cell_gate, _ = _gate_blocks(gates)
    i, f, g = ops.sigmoid(in_gate), ops.sigmoid(forget_gate), ops.tanh(cell_gate)
    return {0: ops.mul(g, _sigmoid_derivative(i)), 1: ops.mul(cx, _sigmoid_derivative(f)),
            2: ops.mul(i, _tanh_derivative(g))}, f


def lstm_hidden_partials(gates, cy):
    """{gate block: d h' / d block}, d h' / d c'."""
    o, t = ops.sigmoid(_gate_blocks(gates)[3]), ops.tanh(cy)
    return {3: ops.mul(t, _sigmoid_derivative(o))}, ops.mul(o, _tanh_derivative(t))


def gated_rules(prim, partials):
    """The vjp and jvp rules of a primitive of (gates, state) from its partial derivatives
    (NOTE [The LSTM cell is two primitives])."""
    def vjp(gates, state):
        def backward(ct):
            blocks, state_partial = partials(gates, state)
            ct_gates = ct_state = None
            if wants_cotangent(0, gates):
                zeros = ops.zeros_like(ct)
                ct_gates = ops.cat([ops.mul(ct, blocks[k]) if k in blocks else zeros
                                    for k in range(4)], -1)
            if wants_cotangent(1, state):
                ct_state = ops.mul(ct, state_partial)
            return ct_gates, ct_state
        return bind(prim, gates, state), backward

    def jvp(primals, tangents):
        (gates, state), (gates_dot, state_dot) = primals, tangents
        blocks, state_partial = partials(gates, state)
        out_dot = None
        if gates_dot is not None:
            gate_dots = _gate_blocks(gates_dot)
            for k, partial in blocks.items():
                out_dot = add_tangents(out_dot, ops.mul(partial, gate_dots[k]))
        if state_dot is not None:
            out_dot = add_tangents(out_dot, ops.mul(state_partial, state_dot))
        return bind(prim, gates, state), out_dot

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp
    batching_rules[prim] = same_shape_batch(prim)


gated_rules(lstm_cell_p, lstm_cell_partials)
gated_rules(lstm_hidden_p, lstm_hidden_partials)


def _lstm_step(gates, cx):
    """(h', c') from the gates and the cell state, FuncTensors in and out."""
    gates, cx = unwrap_all((gates, cx))
    cy = bind(lstm_cell_p, gates, cx)
    return as_tensor(bind(lstm_hidden_p, gates, cy)), as_tensor(cy)


def _one_layer_lstm(input, hidden, params, has_biases, reverse=False):
    """``one_layer_lstm`` of torch._decomp, with the cell of NOTE [The LSTM cell is two
    primitives]; ``params`` are (w_ih, w_hh[, b_ih, b_hh][, w_hr])."""
    weight_ih, weight_hh = params[0], params[1]
    bias_ih, bias_hh = (params[2], params[3]) if has_biases else (None, None)
    weight_hr = params[-1] if len(params) in (3, 5) else None  # the projection (proj_size)
    hx, cx = hidden
    steps = F.linear(input, weight_ih, bias_ih).unbind(0)
    outputs = []
    for step_gates in (reversed(steps) if reverse else steps):
        hx, cx = _lstm_step(F.linear(hx, weight_hh, bias_hh) + step_gates, cx)
        if weight_hr is not None:
            hx = F.linear(hx, weight_hr)
        outputs.append(hx)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs), (hx, cx)


def _lstm_layers(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first):
    """torch._decomp's LSTM (``lstm_impl``), every layer the unfused one (its own choice of
    layer would take the oneDNN kernel on a CPU)."""
    params = gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    out, final = _rnn_helper(input, list(zip(hx[0], hx[1])), params, has_biases, num_layers,
                             dropout, train, bidirectional, batch_first, _one_layer_lstm)
    hy, cy = zip(*final)
    return out, torch.stack(hy), torch.stack(cy)


torch_api.register(torch.lstm)(_rnn_at_the_front_door("lstm", _lstm_layers))
