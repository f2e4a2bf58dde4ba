"""Recurrent layers: nn.LSTM on the CPU.

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
from torch._decomp.decompositions import one_layer_lstm

from . import aten_api
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
