"""Recurrent layers: nn.LSTM, nn.GRU and nn.RNN as torch's decompositions at the front door,
their cells as primitives (the LSTM's two, the GRU's one), and the single steps of
nn.LSTMCell, nn.GRUCell and nn.RNNCell.

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
import functools

import torch
import torch.nn.functional as F
from torch._decomp.decompositions import (_rnn_helper, gather_params, one_layer_lstm,
                                          rnn_relu_input, rnn_tanh_input)

from . import aten_api, ops, torch_api
from . import primitives as P
from .autograd import vjp_rules, wants_cotangent
from .batching import Batched, BatchedValue, batching_rules, same_shape_batch, to_front
from .errors import UnsupportedOperationError
from .forward import jvp_rules
from .nn import linear
from .tensor import as_tensor, call_with_tensors, unwrap_all
from .values import bind, map_tensors, top_dispatcher

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
# nn.LSTM, nn.GRU and nn.RNN call torch.lstm, torch.gru, torch.rnn_tanh and torch.rnn_relu:
# composites that torch lowers to linear layers and pointwise ops (or, for the LSTM on a CPU,
# to oneDNN's kernel), each of which reached the engine through the aten door, about a dozen
# calls per time step: grad of a GRU of 64 units over 20 steps took 7.6 times torch.func's
# time. torch._decomp's decompositions of them (lstm_impl, gru_impl, rnn_tanh_input,
# rnn_relu_input: the input projection of every step at once, then the cell per step) are
# the same computation in torch calls, which on FuncTensors take the front door and its
# rules; the LSTM's and the GRU's cells are primitives (NOTE [The LSTM cell is two
# primitives]). Two cases keep torch's lowering: dropout between layers in training (torch
# 2.13's decomposition never applies it: its test ``num_layers < i - 1`` is never true), and
# packed sequences, which no transform runs (torch.func's neither: the kernels read the data
# pointers of its wrapped tensors), refused here with the fix.
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


for _name, _decomposition in (("rnn_tanh", rnn_tanh_input), ("rnn_relu", rnn_relu_input)):
    torch_api.register(getattr(torch, _name))(_rnn_at_the_front_door(_name, _decomposition))


# NOTE [The LSTM cell is two primitives]
# Per step, an LSTM computes its gates (i, f, g, o: the four blocks of one linear layer of the
# hidden state plus the input's projection), then c' = sigmoid(f) c + sigmoid(i) tanh(g) and
# h' = sigmoid(o) tanh(c'). As torch ops that is a chunk and ten pointwise ops, each a bind at
# every level, and a chunk's four slices each pad their cotangent back to the gates' shape:
# grad of a 64-unit LSTM over 20 steps took 2.5 times torch.func's time. So the two formulas
# are primitives, lstm_cell (gates, c -> c') and lstm_hidden (gates, c' -> h'), with torch's
# arithmetic in torch's order (LSTMCell in aten/src/ATen/native/RNN.cpp), so the values are
# its bits. A GRU's cell is one primitive the same way (gru_cell: the input's and the hidden
# state's gate blocks r, z, n and the state h -> h'; GRUCell in RNN.cpp).
#
# Each cell is elementwise in its state and in each gate block, so one table of partial
# derivatives per primitive gives both rules (``gated_rules``): the vjp multiplies the
# cotangent by each partial (a gated argument's blocks side by side, a block that does not
# enter is zero), and the jvp sums each partial times its tangent. The table and the rules'
# arithmetic are written in torch calls, and run where their arguments are (``in_torch``):
# on plain tensors as torch's own calls; under vmap on the tensors below with every batch dim
# in front, as the cells' own batching rule (same_shape_batch) runs them, since they read the
# last dim only; on the values of grad and jvp levels (a second derivative) as FuncTensors,
# whose calls those levels differentiate again, so Hessians follow. cuDNN fuses the same
# steps (its backward kernels are the vjps here). A first derivative's vjp keeps the
# activations instead (NOTE [A cell's first derivative keeps its activations]).
def in_torch(formula, *args):
    """``formula(*args)``, written in torch calls that read only the last dim (every leading
    dim is elementwise): directly on plain tensors (and None); on a vmap level's values with
    every batch dim in front, one level down (what same_shape_batch does for a primitive);
    on the values of other levels through the doors (call_with_tensors)."""
    level = top_dispatcher(args)
    if level is None:
        return formula(*args)
    if type(level) is not Batched:
        return call_with_tensors(formula, *args)
    present = [a for a in args if a is not None]
    bdims = [a.bdim if type(a) is BatchedValue and a.dispatcher is level else None
             for a in present]
    lowered = iter(to_front([a.payload if bdim is not None else a
                             for a, bdim in zip(present, bdims)], bdims, expand_unbatched=True))
    out = in_torch(formula, *[None if a is None else next(lowered) for a in args])
    return map_tensors(lambda o: BatchedValue(level, o, 0), out)


def _sum(terms):
    total = None
    for term in terms:
        total = term if total is None else total + term
    return total


def _over_plain_tensors(args) -> bool:
    """Whether every argument is a plain tensor (or None), or vmap values over one."""
    for arg in args:
        while type(arg) is BatchedValue:
            arg = arg.payload
        if arg is not None and type(arg) is not torch.Tensor:
            return False
    return True


# NOTE [A cell's first derivative keeps its activations]
# The partials recompute the gates' sigmoids and tanhs in the backward pass (the forward
# kernel computed them already) and multiply them out element by element: an LSTM step's
# backward was about twenty-five kernels where torch's autograd runs ten. So where a cell's
# arguments are plain tensors, or vmap values over them (a first derivative, per sample or
# not), its vjp runs the cell's formula itself (``saving``: torch's calls in torch's order,
# so the output is the primitive's bits) and keeps the activations, and its backward is what
# torch's autograd of that formula runs: sigmoid_backward and tanh_backward of the kept
# activations (``cotangents``). Values of other levels (a second derivative, a jit trace)
# take the partials, which those levels differentiate again.
def gated_rules(prim, partials, blocks, first_derivative=None):
    """The vjp and jvp rules of a cell primitive from its partial derivatives. ``blocks[k]``
    is the number of gate blocks of argument k (None: elementwise); ``partials(*args)``, in
    torch calls, gives per argument its partial derivative, or for a gated one
    {block: partial} (NOTE [The LSTM cell is two primitives]). ``first_derivative``:
    (saving, cotangents), the vjp over plain tensors (NOTE [A cell's first derivative keeps
    its activations]): ``saving(*args)`` is (output, kept), ``cotangents(wanted, ct, *kept)``
    one cotangent per argument (None where not ``wanted``)."""
    def cotangents(wanted, ct, *args):
        result = []
        for want, n, partial in zip(wanted, blocks, partials(*args)):
            if not want:
                result.append(None)
            elif n is None:
                result.append(ct * partial)
            else:
                zeros = torch.zeros_like(ct) if len(partial) < n else None
                result.append(torch.cat([ct * partial[k] if k in partial else zeros
                                         for k in range(n)], -1))
        return tuple(result)

    def vjp(*args):
        wanted = tuple(wants_cotangent(position, arg) for position, arg in enumerate(args))
        if first_derivative is not None and _over_plain_tensors(args):
            saving, kept_cotangents = first_derivative
            out, kept = in_torch(saving, *args)
            return out, lambda ct: in_torch(
                functools.partial(kept_cotangents, wanted), ct, *kept)
        return bind(prim, *args), lambda ct: in_torch(
            functools.partial(cotangents, wanted), ct, *args)

    def tangent(*primals_and_tangents):
        primals, tangents = primals_and_tangents[:len(blocks)], primals_and_tangents[len(blocks):]
        terms = []
        for dot, n, partial in zip(tangents, blocks, partials(*primals)):
            if dot is not None and n is None:
                terms.append(partial * dot)
            elif dot is not None:
                block_dots = dot.chunk(n, -1)
                terms.extend(block_partial * block_dots[k] for k, block_partial in partial.items())
        return _sum(terms)

    def jvp(primals, tangents):
        return bind(prim, *primals), in_torch(tangent, *primals, *tangents)

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp
    batching_rules[prim] = same_shape_batch(prim)


def _sigmoid_derivative(s):
    return s - s * s  # s (1 - s), at s = sigmoid(x)


def _tanh_derivative(t):
    return 1 - t * t  # at t = tanh(x)


def _lstm_cell_activations(gates):
    """sigmoid(i), sigmoid(f), tanh(g) of the gates' blocks i, f, g."""
    in_gate, forget_gate, cell_gate, _ = gates.chunk(4, -1)
    return in_gate.sigmoid(), forget_gate.sigmoid(), cell_gate.tanh()


def _lstm_hidden_activations(gates, cy):
    """sigmoid(o) of the gates' block o, and tanh(c')."""
    return gates.chunk(4, -1)[3].sigmoid(), cy.tanh()


def _lstm_cell_saving(gates, cx):
    """c' and what its first derivative keeps (NOTE [A cell's first derivative keeps its
    activations])."""
    i, f, g = _lstm_cell_activations(gates)
    return f * cx + i * g, (i, f, g, cx)


def _lstm_hidden_saving(gates, cy):
    o, t = _lstm_hidden_activations(gates, cy)
    return o * t, (o, t)


lstm_cell_p = P.primitive("lstm_cell", lambda gates, cx: _lstm_cell_saving(gates, cx)[0])
lstm_hidden_p = P.primitive("lstm_hidden", lambda gates, cy: _lstm_hidden_saving(gates, cy)[0])


def _lstm_cell_cotangents(wanted, ct, i, f, g, cx):
    gates_ct = None
    if wanted[0]:  # the blocks i, f, g, and nothing for o
        gates_ct = torch.cat([aten.sigmoid_backward(ct * g, i), aten.sigmoid_backward(ct * cx, f),
                              aten.tanh_backward(ct * i, g), torch.zeros_like(ct)], -1)
    return gates_ct, ct * f if wanted[1] else None


def _lstm_hidden_cotangents(wanted, ct, o, t):
    gates_ct = None
    if wanted[0]:  # nothing for the blocks i, f, g; then o
        zeros = ct.new_zeros((*ct.shape[:-1], 3 * ct.shape[-1]))
        gates_ct = torch.cat([zeros, aten.sigmoid_backward(ct * t, o)], -1)
    return gates_ct, aten.tanh_backward(ct * o, t) if wanted[1] else None


def lstm_cell_partials(gates, cx):
    """c' = sigmoid(f) c + sigmoid(i) tanh(g): by the gates' blocks i, f, g, and by c."""
    i, f, g = _lstm_cell_activations(gates)
    return ({0: g * _sigmoid_derivative(i), 1: cx * _sigmoid_derivative(f),
             2: i * _tanh_derivative(g)}, f)


def lstm_hidden_partials(gates, cy):
    """h' = sigmoid(o) tanh(c'): by the gates' block o, and by c'."""
    o, t = _lstm_hidden_activations(gates, cy)
    return {3: t * _sigmoid_derivative(o)}, o * _tanh_derivative(t)


gated_rules(lstm_cell_p, lstm_cell_partials, blocks=(4, None),
            first_derivative=(_lstm_cell_saving, _lstm_cell_cotangents))
gated_rules(lstm_hidden_p, lstm_hidden_partials, blocks=(4, None),
            first_derivative=(_lstm_hidden_saving, _lstm_hidden_cotangents))


def _gru_cell_activations(input_gates, hidden_gates):
    """r, z and n (GRUCell's arithmetic in its order), and the hidden state's block n."""
    input_r, input_z, input_n = input_gates.chunk(3, -1)
    hidden_r, hidden_z, hidden_n = hidden_gates.chunk(3, -1)
    r = (hidden_r + input_r).sigmoid()
    z = (hidden_z + input_z).sigmoid()
    n = (input_n + hidden_n * r).tanh()
    return r, z, n, hidden_n


def _gru_cell_saving(input_gates, hidden_gates, hx):
    """h' and what its first derivative keeps."""
    r, z, n, hidden_n = _gru_cell_activations(input_gates, hidden_gates)
    hx_minus_n = hx - n
    return hx_minus_n * z + n, (r, z, n, hx_minus_n, hidden_n)


gru_cell_p = P.primitive("gru_cell", lambda *args: _gru_cell_saving(*args)[0])


def _gru_cell_cotangents(wanted, ct, r, z, n, hx_minus_n, hidden_n):
    input_ct = hidden_ct = None
    if wanted[0] or wanted[1]:
        n_ct = aten.tanh_backward(ct - ct * z, n)  # (n enters h' twice: + n and (h - n) z)
        r_ct = aten.sigmoid_backward(n_ct * hidden_n, r)
        z_ct = aten.sigmoid_backward(ct * hx_minus_n, z)
        if wanted[0]:
            input_ct = torch.cat([r_ct, z_ct, n_ct], -1)
        if wanted[1]:
            hidden_ct = torch.cat([r_ct, z_ct, n_ct * r], -1)
    return input_ct, hidden_ct, ct * z if wanted[2] else None


def gru_cell_partials(input_gates, hidden_gates, hx):
    """h' = (h - n) z + n, with r = sigmoid(r_in + r_h), z = sigmoid(z_in + z_h) and
    n = tanh(n_in + r n_h): by the input's gate blocks, the hidden state's, and by h."""
    r, z, n, hidden_n = _gru_cell_activations(input_gates, hidden_gates)
    by_z = (hx - n) * _sigmoid_derivative(z)
    by_n = (1 - z) * _tanh_derivative(n)  # d h' / d n_in
    by_r = by_n * hidden_n * _sigmoid_derivative(r)
    return {0: by_r, 1: by_z, 2: by_n}, {0: by_r, 1: by_z, 2: by_n * r}, z


gated_rules(gru_cell_p, gru_cell_partials, blocks=(3, 3, None),
            first_derivative=(_gru_cell_saving, _gru_cell_cotangents))


def _gru_step(input_gates, hidden_gates, hx):
    """h' from the gates and the state, FuncTensors in and out."""
    return as_tensor(bind(gru_cell_p, *unwrap_all((input_gates, hidden_gates, hx))))


def _one_layer_gru(input, hx, params, has_biases, reverse=False):
    """``one_layer_rnn`` of torch._decomp with ``gru_cell``, the cell one primitive
    (NOTE [The LSTM cell is two primitives]); ``params`` are (w_ih, w_hh[, b_ih, b_hh])."""
    weight_ih, weight_hh = params[0], params[1]
    bias_ih, bias_hh = (params[2], params[3]) if has_biases else (None, None)
    steps = F.linear(input, weight_ih, bias_ih).unbind(0)
    outputs = []
    for step_gates in (reversed(steps) if reverse else steps):
        hx = _gru_step(step_gates, F.linear(hx, weight_hh, bias_hh), hx)
        outputs.append(hx)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs), hx


def _gru_layers(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first):
    """torch._decomp's GRU (``gru_impl``), each layer ``_one_layer_gru``."""
    params = gather_params(params, has_biases, False)
    out, final = _rnn_helper(input, hx.unbind(0), params, has_biases, num_layers, dropout,
                             train, bidirectional, batch_first, _one_layer_gru)
    return out, torch.stack(final)


torch_api.register(torch.gru)(_rnn_at_the_front_door("gru", _gru_layers))


def _lstm_cell_values(gates, cx):
    """(h', c') from the gates and the cell state, engine values in and out."""
    cy = bind(lstm_cell_p, gates, cx)
    return bind(lstm_hidden_p, gates, cy), cy


def _lstm_step(gates, cx):
    """(h', c') from the gates and the cell state, FuncTensors in and out."""
    hy, cy = _lstm_cell_values(*unwrap_all((gates, cx)))
    return as_tensor(hy), as_tensor(cy)


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


# --- single steps: nn.LSTMCell, nn.GRUCell, nn.RNNCell -----------------------------------------
# torch.lstm_cell and its kin are composites that reached the aten door op by op: a loop of
# nn.LSTMCell under grad took 6.4 times torch.func's time, nn.GRUCell's 7.2. Here they are
# the steps above (gates from both linear layers, then the cell primitives), in torch's order
# (RNN.cpp: the hidden state's linear layer, plus the input's). Shapes other than torch's
# (batch, features) pairs keep torch's own path, which checks them and says what is wrong.
def _cell_shapes_fit(input, states, weight_ih, weight_hh, gates):
    """Whether the step has torch's shapes: a (batch, features) input, (batch, hidden)
    states, and ``gates`` blocks of ``hidden`` rows in each weight."""
    input_shape, ih_shape, hh_shape = (ops.shape_of(v) for v in (input, weight_ih, weight_hh))
    if len(input_shape) != 2 or len(ih_shape) != 2 or len(hh_shape) != 2:
        return False
    hidden = hh_shape[1]
    return (input_shape[1] == ih_shape[1] and ih_shape[0] == hh_shape[0] == gates * hidden
            and all(ops.shape_of(s) == (input_shape[0], hidden) for s in states))


def _gates(input, hx, weight_ih, weight_hh, bias_ih, bias_hh):
    """The hidden state's linear layer plus the input's (RNN.cpp's order)."""
    return ops.add(linear(hx, weight_hh, bias_hh), linear(input, weight_ih, bias_ih))


@torch_api.register(torch.lstm_cell)
def lstm_cell(input, hx, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
    if len(hx) != 2 or not _cell_shapes_fit(input, hx, weight_ih, weight_hh, 4):
        return NotImplemented
    return _lstm_cell_values(_gates(input, hx[0], weight_ih, weight_hh, bias_ih, bias_hh), hx[1])


@torch_api.register(torch.gru_cell)
def gru_cell(input, hx, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
    if not _cell_shapes_fit(input, (hx,), weight_ih, weight_hh, 3):
        return NotImplemented
    return bind(gru_cell_p, linear(input, weight_ih, bias_ih), linear(hx, weight_hh, bias_hh),
                hx)


def _rnn_cell(name, nonlinearity):
    def rnn_cell(input, hx, weight_ih, weight_hh, bias_ih=None, bias_hh=None):
        if not _cell_shapes_fit(input, (hx,), weight_ih, weight_hh, 1):
            return NotImplemented
        return nonlinearity(_gates(input, hx, weight_ih, weight_hh, bias_ih, bias_hh))
    torch_api.register(getattr(torch, name))(rnn_cell)


_rnn_cell("rnn_tanh_cell", ops.tanh)
_rnn_cell("rnn_relu_cell", ops.relu)
