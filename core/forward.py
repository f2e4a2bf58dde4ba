"""Forward mode: the Forward level (JVP) and the JVP rules.

A value of a Forward level carries a primal and a tangent. ``None`` is a symbolic zero
tangent: a constant has one, and a rule that receives only zeros is never called (the
primitive runs on the primals alone, one level down). In JAX this is ``JVPTrace``.

A rule takes the primals and the tangents as tuples and returns ``(out, out_dot)``.
"""

import math

import torch

from . import ops
from . import primitives as P
from .dispatch import (Dispatcher, complex_derivatives, complex_not_supported, has_complex,
                       name_of, nondifferentiable_outputs)
from .errors import missing_rule_error
from .grad_mode import FORWARD, floors
from .values import Value, bind

jvp_rules: dict = {}
_is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled
_set_fwd_grad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled


class ForwardValue(Value):
    """A value of a Forward level: ``payload`` is the primal, ``tangent`` its tangent."""

    __slots__ = ("tangent",)

    def __init__(self, dispatcher, primal, tangent, name=None):
        self.dispatcher = dispatcher  # (Value.__init__ written out: this is the hot path)
        self.payload = primal
        self._name = name
        self._metadata = None
        self.tangent = tangent


class Forward(Dispatcher):
    """Forward-mode (JVP) level.

    >>> import torch
    >>> from minifunctorch.core import Forward, Torch
    >>> d = Forward(Torch())
    >>> x = d.wrap_input(torch.tensor(0.0), torch.tensor(1.0))
    >>> y = d.sin(x)
    >>> y.payload, y.tangent   # sin(0) and cos(0) * 1
    (tensor(0.), tensor(1.))
    """

    transform_name = "jvp"
    differentiates = True
    # the forward grad mode found when the level started running the user's function
    # (grad_mode.py; torch.no_grad does not stop forward mode, _set_fwd_grad_enabled does)
    prev_fwd_grad_mode = True
    obeys_grad_mode = False  # set by grad_mode.level_scope; never for the explicit API

    def __init__(self, inner, *, name="Forward", call=None):
        super().__init__(inner, name=name, call=call)

    def apply(self, prim, *args, **params):
        # NOTE [Grad modes and transform levels] (grad_mode.py)
        if not _is_fwd_grad_enabled() and self.obeys_grad_mode:
            return bind(prim, *self._primals(args), **params)
        if self.level < floors[FORWARD]:  # below a level entered with forward grad off
            with _set_fwd_grad_enabled(False):
                return bind(prim, *self._primals(args), **params)
        primals, tangents = [], []
        for a in args:
            if isinstance(a, ForwardValue) and a.dispatcher is self:
                primals.append(a.payload)
                tangents.append(a.tangent)
            else:
                primals.append(a)
                tangents.append(None)
        if not prim.differentiable or all(t is None for t in tangents):
            return bind(prim, *primals, **params)
        rule = jvp_rules.get(prim)
        if rule is None:
            raise missing_rule_error(prim, "jvp", "jvp")
        complex_ok = prim in complex_derivatives  # NOTE [Complex numbers] (dispatch.py)
        if not complex_ok and has_complex(primals):
            raise complex_not_supported(self, prim, gives=False)
        if self.prev_fwd_grad_mode:
            out, out_dot = rule(primals, tangents, **params)
        else:  # entered with forward grad off: the levels below, outside it, see nothing
            with _set_fwd_grad_enabled(False):
                out, out_dot = rule(primals, tangents, **params)
        if out_dot is None:
            return out
        out_dtype = out.dtype
        if not complex_ok and out_dtype.is_complex:
            raise complex_not_supported(self, prim)
        if out_dot.dtype is not out_dtype:  # NOTE [A tangent takes its value's dtype]
            out_dot = ops.in_value_dtype(out_dot, out_dtype)
        return ForwardValue(self, out, out_dot)

    def _primals(self, args):
        return [a.payload if isinstance(a, ForwardValue) and a.dispatcher is self else a
                for a in args]

    def wrap_input(self, primal, tangent, name=None):
        return ForwardValue(self, primal, tangent, name)

    def wrap_adopted(self, payload, original):
        return ForwardValue(self, payload, None, name_of(original))

    def unknown_op(self, name, run, values, kwargs):
        """An aten op without a rule: fine if its outputs cannot carry a tangent."""
        return nondifferentiable_outputs(self, name, run, values, kwargs)


# NOTE [A tangent takes its value's dtype]
# A rule computes the tangent from the input tangents, so an operand that is not
# differentiated but raises the result's dtype leaves its mark on the value only: ``x + y``
# with x float32 (differentiated) and y a float64 constant is float64, and its tangent would
# be x_dot, float32; ``x + 1j`` is complex with a real tangent. torch's forward AD gives
# every tangent its primal's dtype, and so does torch.func's jvp: Forward.apply casts it with
# ops.in_value_dtype, the cast reverse mode gives cotangents (NOTE [A cotangent takes its
# value's dtype] in autograd.py).


# --- helpers: tangent arithmetic with symbolic zeros ------------------------------------------
def add_tangents(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ops.add(a, b)


def sub_tangents(a, b):
    """a - b, either a symbolic zero (None)."""
    if b is None:
        return a
    return ops.neg(b) if a is None else ops.sub(a, b)


def scale_tangent(tangent, factor):
    return None if tangent is None else ops.mul(tangent, factor)


def broadcast_tangent(tangent, shape):
    """A tangent broadcast to the output's shape (a lone tangent of a broadcast input)."""
    if tangent is None or ops.shape_of(tangent) == tuple(shape):
        return tangent
    return ops.expand(tangent, *shape)


def nondifferentiable_jvp(prim):
    def jvp(primals, tangents, **params):
        return bind(prim, *primals, **params), None
    return jvp


for _prim in P.PRIMITIVES.values():
    if not _prim.differentiable:
        jvp_rules[_prim] = nondifferentiable_jvp(_prim)


def linear_jvp(prim, *, refuse_others=None):
    """For ops that are linear in their first argument: the tangent goes through the same op.
    ``refuse_others``: called (to raise) when another argument carries a tangent, for an op
    whose derivative in the others is not implemented (a torch backward kernel)."""
    def jvp(primals, tangents, **params):
        x_dot = tangents[0]
        out = bind(prim, *primals, **params)
        if refuse_others is not None and any(t is not None for t in tangents[1:]):
            refuse_others()
        return out, None if x_dot is None else bind(prim, x_dot, *primals[1:], **params)
    return jvp


for _prim in (P.neg_p, P.sum_p, P.mean_p, P.permute_p, P.reshape_p, P.unsqueeze_p,
              P.squeeze_p, P.expand_p, P.getitem_p, P.scatter_index_p, P.diagonal_p,
              P.diagonal_scatter_p, P.diag_embed_p, P.gather_p, P.scatter_add_p,
              P.clone_p, P.to_device_p, P.no_grad_p):
    jvp_rules[_prim] = linear_jvp(_prim)  # (no_grad: its tangent is itself no_grad's)


def convert_jvp(primals, tangents, *, dtype):
    (x,), (x_dot,) = primals, tangents
    out = bind(P.convert_p, x, dtype=dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        return out, None  # x.long(), x.bool(): the result carries no tangent
    return out, bind(P.convert_p, x_dot, dtype=dtype)
jvp_rules[P.convert_p] = convert_jvp


# --- elementwise -------------------------------------------------------------------------------
def exp_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = ops.exp(x)
    return out, ops.mul(x_dot, out)
jvp_rules[P.exp_p] = exp_jvp


def log_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return ops.log(x), ops.div(x_dot, x)
jvp_rules[P.log_p] = log_jvp


def sin_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return ops.sin(x), ops.mul(x_dot, ops.cos(x))
jvp_rules[P.sin_p] = sin_jvp


def cos_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return ops.cos(x), ops.neg(ops.mul(x_dot, ops.sin(x)))
jvp_rules[P.cos_p] = cos_jvp


def tanh_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = ops.tanh(x)
    return out, ops.mul(x_dot, ops.sub(1, ops.mul(out, out)))
jvp_rules[P.tanh_p] = tanh_jvp


def sigmoid_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = ops.sigmoid(x)
    return out, ops.mul(x_dot, ops.mul(out, ops.sub(1, out)))
jvp_rules[P.sigmoid_p] = sigmoid_jvp


def relu_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = ops.relu(x)
    return out, ops.where(ops.gt(out, 0), x_dot, 0.0)
jvp_rules[P.relu_p] = relu_jvp


def abs_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    if x.dtype.is_complex:  # d|z| = Re(conj(sgn z) dz) (NOTE [Complex numbers])
        return ops.abs(x), ops.real(ops.mul(x_dot, ops.conj(ops.sgn(x))))
    return ops.abs(x), ops.mul(x_dot, ops.sign(x))
jvp_rules[P.abs_p] = abs_jvp


def sqrt_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = ops.sqrt(x)
    return out, ops.div(x_dot, ops.mul(out, 2))
jvp_rules[P.sqrt_p] = sqrt_jvp


# --- broadcasting binary ops -------------------------------------------------------------------
def add_jvp(primals, tangents):
    out = ops.add(*primals)
    return out, broadcast_tangent(add_tangents(*tangents), ops.shape_of(out))
jvp_rules[P.add_p] = add_jvp


def sub_jvp(primals, tangents):
    out = ops.sub(*primals)
    x_dot, y_dot = tangents
    out_dot = add_tangents(x_dot, None if y_dot is None else ops.neg(y_dot))
    return out, broadcast_tangent(out_dot, ops.shape_of(out))
jvp_rules[P.sub_p] = sub_jvp


def mul_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents
    out = ops.mul(x, y)
    out_dot = add_tangents(scale_tangent(x_dot, y), scale_tangent(y_dot, x))
    return out, broadcast_tangent(out_dot, ops.shape_of(out))
jvp_rules[P.mul_p] = mul_jvp


def div_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents
    out = ops.div(x, y)
    # derivatives.yaml's (self_t - other_t * result) / other, rounded as torch.func rounds it
    if y_dot is None:
        out_dot = ops.div(x_dot, y)
    elif x_dot is None:
        out_dot = ops.neg(ops.div(ops.mul(y_dot, out), y))
    else:
        out_dot = ops.div(ops.sub(x_dot, ops.mul(y_dot, out)), y)
    return out, broadcast_tangent(out_dot, ops.shape_of(out))
jvp_rules[P.div_p] = div_jvp


def pow_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents
    out = ops.pow(x, y)
    x_part = y_part = None
    if x_dot is not None:
        if isinstance(y, (int, float)):
            x_part = None if y == 0 else ops.mul(x_dot, ops.mul(ops.power(x, y - 1), y))
        else:
            x_part = ops.mul(x_dot, ops.pow_base_derivative(x, y))
    if y_dot is not None:
        y_part = ops.mul(y_dot, ops.pow_exponent_derivative(x, y, out))
    return out, broadcast_tangent(add_tangents(x_part, y_part), ops.shape_of(out))
jvp_rules[P.pow_p] = pow_jvp


def where_jvp(primals, tangents):
    (condition, x, y), (_, x_dot, y_dot) = primals, tangents
    out = ops.where(condition, x, y)
    out_dot = ops.where(condition, 0.0 if x_dot is None else x_dot,
                        0.0 if y_dot is None else y_dot)
    return out, broadcast_tangent(out_dot, ops.shape_of(out))
jvp_rules[P.where_p] = where_jvp


# --- reductions --------------------------------------------------------------------------------
def _extremum_jvp(prim):
    def jvp(primals, tangents, *, dim, keepdim):
        (x,), (x_dot,) = primals, tangents
        out = bind(prim, x, dim=dim, keepdim=keepdim)
        is_extremum = ops.eq(x, ops.reshape(out, *ops.keepdim_shape(ops.shape_of(x), dim)))
        count = ops.sum(is_extremum, dim, keepdim=keepdim)
        picked = ops.sum(ops.mul(x_dot, is_extremum), dim, keepdim=keepdim)
        return out, ops.div(picked, count)
    return jvp


jvp_rules[P.amax_p] = _extremum_jvp(P.amax_p)
jvp_rules[P.amin_p] = _extremum_jvp(P.amin_p)


def logsumexp_tangent(x, x_dot, dim, keepdim):
    """NOTE [The tangent of logsumexp, as PyTorch computes it]
    d logsumexp(x) = sum(x_dot * w) / sum(w), with w = exp(x - m) and m the largest (real
    part of an) entry along dim: FunctionsManual.cpp's logsumexp_jvp, which torch's forward
    formulas of softmax and log_softmax use too. Written this way, and not as
    sum(x_dot * softmax), it rounds as torch.func does: a tangent constant along dim gives a
    log_softmax tangent of exactly 0 (its sum(w) / sum(w) is 1), where exp(out) sums to
    1 +- an ulp. On complex numbers exp(x - out) would also lose the phase where |Im x| is
    large (out's imaginary part is wrapped into (-pi, pi], and x - out rounds it). m cancels,
    so it is held constant."""
    if x.dtype.is_complex:
        m = ops.amax(ops.real(x), dim, keepdim=True)
    elif ops.shape_of(x) and math.prod(ops.shape_of(x)) == 0:
        m = None  # amax of nothing fails; the sums are empty either way
    else:
        m = ops.amax(x, dim, keepdim=True)
    weights = ops.exp(x if m is None else ops.sub(x, ops.detach(m)))
    return ops.div(ops.sum(ops.mul(weights, x_dot), dim, keepdim=keepdim),
                   ops.sum(weights, dim, keepdim=keepdim))


def logsumexp_jvp(primals, tangents, *, dim, keepdim):
    (x,), (x_dot,) = primals, tangents
    return (bind(P.logsumexp_p, x, dim=dim, keepdim=keepdim),
            logsumexp_tangent(x, x_dot, dim, keepdim))
jvp_rules[P.logsumexp_p] = logsumexp_jvp


def softmax_jvp(primals, tangents, *, dim):
    (x,), (x_dot,) = primals, tangents
    out = bind(P.softmax_p, x, dim=dim)
    return out, ops.mul(out, ops.sub(x_dot, logsumexp_tangent(x, x_dot, (dim,), True)))
jvp_rules[P.softmax_p] = softmax_jvp


def log_softmax_jvp(primals, tangents, *, dim):
    (x,), (x_dot,) = primals, tangents
    out = bind(P.log_softmax_p, x, dim=dim)
    return out, ops.sub(x_dot, logsumexp_tangent(x, x_dot, (dim,), True))
jvp_rules[P.log_softmax_p] = log_softmax_jvp


def softmax_kernel_vjp_jvp(prim, through_out):
    """The jvp of a softmax kernel's vjp, y = prim(ct, out): linear in ct, so the same kernel
    of ct_dot, plus ``through_out(ct, out, out_dot, dim)``, the derivative through out."""
    def jvp(primals, tangents, *, dim):
        (ct, out), (ct_dot, out_dot) = primals, tangents
        y = bind(prim, ct, out, dim=dim)
        y_dot = None if ct_dot is None else bind(  # (the kernel wants one dtype)
            prim, ops.convert(ct_dot, out.dtype), out, dim=dim)
        if out_dot is not None:
            y_dot = add_tangents(y_dot, through_out(ct, out, out_dot, dim))
        return y, ops.zeros_like(y) if y_dot is None else y_dot
    return jvp


def _softmax_backward_through_out(ct, out, out_dot, dim):
    # y = out * (ct - sum(ct * out)): out_dot * (ct - sum(ct * out)) - out * sum(ct * out_dot)
    inner = ops.sum(ops.mul(ct, out), dim, keepdim=True)
    return ops.sub(ops.mul(out_dot, ops.sub(ct, inner)),
                   ops.mul(out, ops.sum(ops.mul(ct, out_dot), dim, keepdim=True)))


def _log_softmax_backward_through_out(ct, out, out_dot, dim):
    # y = ct - exp(out) * sum(ct): -out_dot * exp(out) * sum(ct)
    return ops.neg(ops.mul(ops.mul(out_dot, ops.exp(out)), ops.sum(ct, dim, keepdim=True)))


jvp_rules[P.softmax_backward_p] = softmax_kernel_vjp_jvp(P.softmax_backward_p,
                                                         _softmax_backward_through_out)
jvp_rules[P.log_softmax_backward_p] = softmax_kernel_vjp_jvp(P.log_softmax_backward_p,
                                                             _log_softmax_backward_through_out)


# --- linear algebra and concatenation ----------------------------------------------------------
def matmul_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents
    out = ops.matmul(x, y)
    out_dot = add_tangents(None if x_dot is None else ops.matmul(x_dot, y),
                           None if y_dot is None else ops.matmul(x, y_dot))
    return out, broadcast_tangent(out_dot, ops.shape_of(out))
jvp_rules[P.matmul_p] = matmul_jvp


def cat_jvp(primals, tangents, *, dim):
    out = bind(P.cat_p, *primals, dim=dim)
    dots = [ops.zeros_like(x) if t is None else t for x, t in zip(primals, tangents)]
    return out, bind(P.cat_p, *dots, dim=dim)
jvp_rules[P.cat_p] = cat_jvp
