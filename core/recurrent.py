"""Recurrent layers: nn.LSTM on the CPU; nn.GRU and nn.RNN at the front door.

NOTE [LSTM's CPU kernel]
``nn.LSTM`` calls ``torch.lstm``, a composite that torch lowers, on a CPU with oneDNN, to one
``aten.mkldnn_rnn_layer`` per layer and direction: a fused kernel with no derivative formula
that the engine could reuse, and no decomposition in ``torch._decomp``. (nn.GRU and nn.RNN
lower to linear layers and pointwise ops, which the tables already cover.) The rule below
computes the layer as torch's own decomposition of the LSTM does when it does not use oneDNN
(``one_layer_lstm`` in ``torch._decomp.decompositions``: the input projection for every
step at once, then per step the four gates from the hidden state), on the engine's values,
so every transform differentiates and batches it through those ops. torch.func's LSTM also
runs on the unfused path under grad. The kernel's fourth output, a workspace for its own
backward, is not needed here: an empty tensor stands in for it.
"""
import torch
from torch._decomp.decompositions import (gru_impl, one_layer_lstm, rnn_relu_input,
                                          rnn_tanh_input)

from . import aten_api, torch_api
from .errors import UnsupportedOperationError
from .tensor import call_with_tensors

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


@torch_api.register(torch.lstm)
def lstm(input, second, *args):
    """torch's own lowering (NOTE [LSTM's CPU kernel]), but for a packed sequence."""
    if _is_packed(second):
        raise _refuse_packed("lstm")
    return NotImplemented
