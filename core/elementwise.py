"""Elementwise primitives as data: one derivative formula each, from which every rule follows.

NOTE [A formula written once]
The course writes the rules of ``sin`` by hand, one per transform (autograd.py, forward.py,
batching.py). For an elementwise function they all follow from one fact, the derivative of
the output with respect to each input:
- vjp: ``ct * conj(d)``, summed back to the input's shape where it was broadcast (conj is
  the identity on real numbers; on complex ones it is PyTorch's convention for a holomorphic
  function, applied here once for every formula: NOTE [Complex numbers] in dispatch.py. A
  primitive still takes complex inputs only once it is marked ``complex_ready``, after its
  formula is checked on them: a formula of ``abs`` or ``clamp`` is not holomorphic);
- jvp: ``x_dot * d``, summed over the inputs;
- batching: elementwise, so the batch dim stays where it is (broadcasting moves it).
So each primitive here is one line: a name and a derivative formula written with ``ops``
(and so itself differentiable: second derivatives come free). This is how PyTorch's
``derivatives.yaml`` works: one formula per input, from which autograd's backward and its
forward-mode rules are generated. A formula of ``None`` means a zero derivative (``floor``,
``sign``, comparisons): the primitive is not differentiable. Where derivatives.yaml divides
(``atan``: ``grad / (self * self + 1)``), the line gives the divisor, ``Over(...)``, and the
rules divide: ``ct * (1 / d)`` would round twice, and differ from torch.func in the last bit.

Most formulas are the ones derivatives.yaml states; ``tanh`` and ``sigmoid`` differentiate
with torch's own fused ``tanh_backward`` and ``sigmoid_backward`` kernels, which round once,
so that a training loop stays bit-exact with torch.func.

Each primitive is reachable through both doors: the torch functions with its name (front,
torch_api.py) and its aten and prims ops (back, aten_api.py).
"""
import math

import torch
import torch.nn.functional as F

from . import aten_api, ops, passes, torch_api
from . import primitives as P
from .autograd import conj, sum_to_size, vjp_rules, wants_cotangent
from .batching import batching_rules, broadcasting_batch, elementwise_batch, same_shape_batch
from .fast_code import register_fresh, register_inplace
from .dispatch import complex_ready
from .errors import MissingRuleError, TransformUsageError
from .forward import add_tangents, broadcast_tangent, jvp_rules
from .values import NUMBERS, Value, bind

aten = torch.ops.aten
prims = torch.ops.prims

_SQRT_PI = math.sqrt(math.pi)
_SQRT_2PI = math.sqrt(2 * math.pi)


def _is_tensor(x):
    return isinstance(x, (torch.Tensor, Value))


def _refuse_complex(prim, *args):
    """For families whose rules are written for real numbers only (a clearer message than the
    level's, NOTE [Complex numbers] in dispatch.py)."""
    for a in args:
        if _is_tensor(a) and a.dtype.is_complex:
            raise MissingRuleError(
                f"{prim.name}: derivatives of complex tensors are not supported yet (complex "
                "autograd follows PyTorch's conjugate Wirtinger convention, which these "
                "formulas do not implement). Fix: split into real and imaginary parts."
            )


# --- one input -----------------------------------------------------------------------------------
class Over:
    """A derivative written as 1 / ``denominator(x, out)``: the rules then divide the
    cotangent (or tangent) by it, as derivatives.yaml's ``grad / (...)`` formulas do, where
    multiplying by its reciprocal would round twice (``log1p``: ``grad / (self + 1)``)."""

    def __init__(self, denominator):
        self.denominator = denominator


class Product:
    """A derivative written as factors, ``factors(x, out)`` -> (a, b, ...): the rules multiply
    the cotangent (or tangent) by them one by one, as derivatives.yaml's ``grad * a * b`` does
    (``exp2``: ``grad * result * ln 2``), where multiplying by their product first would round
    differently."""

    def __init__(self, factors):
        self.factors = factors


def _times_each(v, factors):
    for factor in factors:
        v = mul(v, factor)
    return v


def unary_rules(prim, derivative):
    """Register the vjp, jvp and batching rules of an elementwise primitive of one input,
    from ``derivative(x, out, **params)``, the derivative of its output (or ``Over``, or
    ``Product``)."""
    if derivative is None:
        batching_rules[prim] = elementwise_batch(prim)
        return  # not differentiable: the rules of primitives.py say so

    # ct * d, ct / divisor for a formula given as Over(divisor), ct * a * b for Product(a, b)
    if isinstance(derivative, Over):
        combine, formula, conjugate = ops.div, derivative.denominator, conj
    elif isinstance(derivative, Product):
        combine, formula = _times_each, derivative.factors
        conjugate = lambda factors: [conj(f) for f in factors]  # noqa: E731
    else:
        combine, formula, conjugate = ops.mul, derivative, conj

    def vjp(x, **params):
        out = bind(prim, x, **params)
        return out, lambda ct: (combine(ct, conjugate(formula(x, out, **params))),)

    def jvp(primals, tangents, **params):
        (x,), (x_dot,) = primals, tangents
        out = bind(prim, x, **params)
        return out, combine(x_dot, formula(x, out, **params))

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp
    batching_rules[prim] = elementwise_batch(prim)


def unary(name, derivative, *, impl=None, functions=None, aten_ops=None):
    """An elementwise primitive of one input, with its doors. Returns its op."""
    impl = impl or getattr(torch, name)
    prim = P.primitive(name, impl, differentiable=derivative is not None)
    unary_rules(prim, derivative)
    register_inplace(prim)

    def op(x):
        return bind(prim, x)
    op.__name__ = name
    functions = torch_api.torch_functions(name) if functions is None else functions
    torch_api.register(*functions)(op)
    torch_api.register_primitive(prim, *functions)  # NOTE [Functions that are one primitive]
    if aten_ops is None:
        aten_ops = [getattr(packet, "default") for packet in
                    (getattr(aten, name, None), getattr(prims, name, None)) if packet is not None]
    aten_api.register(*aten_ops)(op)
    return op


# the basic ops, under short names: formulas read as math
add, sub, mul, div, neg, exp, log, pow = ops.add, ops.sub, ops.mul, ops.div, ops.neg, ops.exp, ops.log, ops.pow
sin, cos, sign, where, full_like = ops.sin, ops.cos, ops.sign, ops.where, ops.full_like
eq, ne, lt, le, gt, ge = ops.eq, ops.ne, ops.lt, ops.le, ops.gt, ops.ge


def square(v):
    return mul(v, v)


def one_minus_square(v):
    return sub(1, mul(v, v))


# One line per primitive: its name and d out / d x as a function of the input x and the
# output out (derivatives.yaml's formula); Over(...): the formula divides by it, as
# derivatives.yaml's does; None: not differentiable.
tan = unary("tan", lambda x, out: add(square(out), 1))
asin = unary("asin", lambda x, out: rsqrt(one_minus_square(x)))
acos = unary("acos", lambda x, out: neg(rsqrt(one_minus_square(x))))
atan = unary("atan", Over(lambda x, out: add(square(x), 1)))
sinh = unary("sinh", lambda x, out: cosh(x))
cosh = unary("cosh", lambda x, out: sinh(x))
asinh = unary("asinh", lambda x, out: rsqrt(add(square(x), 1)))
# (on complex numbers 1/sqrt(x^2 - 1) is on another branch: derivatives.yaml's
# 1/(sqrt(x + 1) sqrt(x - 1)) is the derivative there)
acosh = unary("acosh", lambda x, out: mul(rsqrt(add(x, 1)), rsqrt(sub(x, 1)))
              if x.dtype.is_complex else rsqrt(sub(square(x), 1)))
atanh = unary("atanh", Over(lambda x, out: one_minus_square(x)))
exp2 = unary("exp2", Product(lambda x, out: (out, math.log(2.0))))
expm1 = unary("expm1", lambda x, out: add(out, 1))
log2 = unary("log2", Over(lambda x, out: mul(x, math.log(2.0))))
log10 = unary("log10", Over(lambda x, out: mul(x, math.log(10.0))))
log1p = unary("log1p", Over(lambda x, out: add(x, 1)))
rsqrt = unary("rsqrt", lambda x, out: mul(pow(out, 3), -0.5))
reciprocal = unary("reciprocal", lambda x, out: neg(square(out)))


def _number_over(y, x):
    """``y / x`` reached through Tensor.__rtruediv__. For a number ``y`` torch computes
    reciprocal(x) * y (_tensor.py), which rounds twice and differs from div(y, x) in the last
    bit; torch.func runs that Python body, and so does this, for the same bits and the same
    derivatives. A tensor ``y`` gets here only because a subclass's reflected operator goes
    first (Python's rule): torch.func, whose tensors are no subclass, divides."""
    if isinstance(y, NUMBERS):
        return mul(reciprocal(x), y)
    return div(y, x)


# (torch.Tensor.__rtruediv__ is torch.Tensor.__rdiv__: one function, under its own name)
torch_api.register(torch.Tensor.__rdiv__)(torch_api.reflected("__rdiv__", _number_over))
erf = unary("erf", lambda x, out: mul(exp(neg(square(x))), 2 / _SQRT_PI))
erfc = unary("erfc", lambda x, out: mul(exp(neg(square(x))), -2 / _SQRT_PI))
erfinv = unary("erfinv", lambda x, out: mul(exp(square(out)), _SQRT_PI / 2),
               aten_ops=[aten.erfinv.default, prims.erf_inv.default])
lgamma = unary("lgamma", lambda x, out: digamma(x))
digamma = unary("digamma", lambda x, out: polygamma(1, x))
i0 = unary("i0", lambda x, out: special_i1(x), aten_ops=[aten.i0.default, prims.bessel_i0.default])
sinc = unary("sinc", lambda x, out: _sinc_derivative(x, out))
frac = unary("frac", lambda x, out: full_like(x, 1))
deg2rad = unary("deg2rad", lambda x, out: full_like(x, math.pi / 180))
rad2deg = unary("rad2deg", lambda x, out: full_like(x, 180 / math.pi))
# (torch.positive(x) is x itself: torch's own function returns it at the back door, so a
# write into the result is a write into x; the primitive serves aten.positive)
positive = unary("positive", lambda x, out: full_like(x, 1), functions=())
# holomorphic formulas, checked on complex inputs (tests/test_complex.py): the conj of the
# vjp makes them complex-correct (NOTE [Complex numbers] in dispatch.py)
complex_ready(*(P.PRIMITIVES[name] for name in (
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "exp2", "expm1",
    "log2", "log10", "log1p", "rsqrt", "reciprocal", "positive", "sinc")))
# conj, conj_physical, angle and sgn are not holomorphic: their rules are in
# complex_numbers.py (NOTE [Complex numbers] in dispatch.py)
# zero derivative wherever there is one
ceil = unary("ceil", None)
floor = unary("floor", None)
round = unary("round", None, aten_ops=[aten.round.default, prims.round.default], functions=())
trunc = unary("trunc", None)
signbit = unary("signbit", None)
isnan = unary("isnan", None)
isinf = unary("isinf", None)
isfinite = unary("isfinite", None)
isposinf = unary("isposinf", None)
isneginf = unary("isneginf", None)
logical_not = unary("logical_not", None)
bitwise_not = unary("bitwise_not", None)


def _sinc_derivative(x, out):
    """d/dx sin(pi x)/(pi x) = (cos(pi x) - sinc(x)) / x, and 0 at x = 0."""
    nonzero = ne(x, 0)
    safe_x = where(nonzero, x, 1.0)
    return where(nonzero, div(sub(cos(mul(x, math.pi)), out), safe_x), 0.0)


# --- special functions (torch.special) ------------------------------------------------------------
def _special(name, derivative, aten_name, *, extra=()):
    function = getattr(torch.special, name)
    return unary(f"special_{name}", derivative, impl=function, functions=(function,),
                 aten_ops=[getattr(aten, aten_name).default, *extra])


def _at_zero(x, value_elsewhere, value_at_zero):
    """A derivative with a removable singularity at 0: ``value_elsewhere(safe_x)`` away from
    0 (computed with x replaced by 1 there, so that no nan appears), ``value_at_zero`` at 0."""
    nonzero = ne(x, 0)
    return where(nonzero, value_elsewhere(where(nonzero, x, 1.0)), value_at_zero)


special_i0e = _special("i0e", lambda x, out: sub(special_i1e(x), mul(sign(x), out)),
                       "special_i0e", extra=[prims.bessel_i0e.default])
special_i1 = _special("i1", lambda x, out: _at_zero(x, lambda s: sub(i0(x), div(out, s)), 0.5),
                      "special_i1", extra=[prims.bessel_i1.default])
special_i1e = _special(
    "i1e", lambda x, out: _at_zero(
        x, lambda s: sub(special_i0e(x), mul(out, add(sign(x), reciprocal(s)))), 0.5),
    "special_i1e", extra=[prims.bessel_i1e.default])
special_ndtr = _special("ndtr", lambda x, out: div(exp(mul(square(x), -0.5)), _SQRT_2PI),
                        "special_ndtr")
special_ndtri = _special("ndtri", lambda x, out: mul(exp(mul(square(out), 0.5)), _SQRT_2PI),
                         "special_ndtri", extra=[prims.ndtri.default])
special_log_ndtr = _special(
    "log_ndtr", lambda x, out: div(exp(sub(mul(square(x), -0.5), out)), _SQRT_2PI),
    "special_log_ndtr")
special_erfcx = _special("erfcx", lambda x, out: sub(mul(mul(x, out), 2), 2 / _SQRT_PI),
                         "special_erfcx", extra=[prims.erfcx.default])
special_entr = _special("entr", lambda x, out: neg(add(log(x), 1)), "special_entr")
special_spherical_bessel_j0 = _special("spherical_bessel_j0", None,
                                       "special_spherical_bessel_j0",
                                       extra=[prims.spherical_bessel_j0.default])
# NOTE [Functions torch does not differentiate]
# derivatives.yaml marks these outputs as not differentiable, so torch (and torch.func)
# gives them a zero derivative rather than an error: so do we, as the oracle does.
for _name in ("bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0",
              "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
              "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "airy_ai"):
    _function = getattr(torch.special, _name)
    _prim = P.primitive(f"special_{_name}", _function, differentiable=False)
    batching_rules[_prim] = elementwise_batch(_prim)
    _op = (lambda prim: lambda x: bind(prim, x))(_prim)
    torch_api.register(_function)(_op)
    aten_api.register(getattr(aten, f"special_{_name}").default)(_op)


# torch.special's aliases
for _alias, _op in (("expm1", expm1), ("exp2", exp2), ("log1p", log1p), ("erf", erf),
                    ("erfc", erfc), ("erfinv", erfinv), ("i0", i0), ("sinc", sinc),
                    ("gammaln", lgamma), ("digamma", digamma),
                    ("psi", digamma), ("expit", ops.sigmoid)):
    torch_api.register(getattr(torch.special, _alias))(_op)


# --- one input, with parameters -------------------------------------------------------------------
def parametrized(name, impl, derivative):
    """An elementwise primitive of one input with static parameters (``impl(x, **params)``),
    and its op, which takes them as keywords. Its doors are registered by the caller, whose
    signature matches torch's."""
    prim = P.primitive(name, impl, differentiable=derivative is not None)
    unary_rules(prim, derivative)
    return lambda x, **params: bind(prim, x, **params)


_polygamma = parametrized("polygamma", lambda x, *, n: torch.polygamma(n, x),
                          lambda x, out, *, n: polygamma(n + 1, x))


@torch_api.register(torch.polygamma, torch.special.polygamma)
@aten_api.register(aten.polygamma.default)
def polygamma(n, x):
    return _polygamma(x, n=int(n))


torch_api.register(torch.Tensor.polygamma)(lambda x, n: polygamma(n, x))


def _mvlgamma_derivative(x, out, *, p):
    # sum_i digamma(x - i / 2), as torch's mvlgamma_backward: x plus the offsets
    # -(p - 1) / 2, ..., -1/2, 0 (adding +0 turns -0 into +0, where digamma is -inf)
    offsets = torch.arange(-p / 2 + 0.5, 0.5, 0.5, dtype=x.dtype, device=x.device)
    return ops.sum(digamma(add(ops.unsqueeze(x, -1), offsets)), -1)


_mvlgamma = parametrized("mvlgamma", lambda x, *, p: torch.mvlgamma(x, p), _mvlgamma_derivative)


@torch_api.register(torch.mvlgamma, torch.Tensor.mvlgamma, torch.special.multigammaln)
@aten_api.register(aten.mvlgamma.default)
def mvlgamma(x, p):
    return _mvlgamma(x, p=int(p))


def _logit_divisor(x, out, *, eps):
    # derivatives.yaml's infinitely differentiable form (grad mode is on in torch.func's
    # transforms): grad / (x (1 - x)) where x is in [eps, 1 - eps] (in [0, 1] without eps),
    # else 0 with eps and nan without; dividing by inf or nan there gives the same
    low, high, elsewhere = (0.0, 1.0, math.nan) if eps is None else (eps, 1 - eps, math.inf)
    return where(logical_and(ge(x, low), le(x, high)), mul(x, sub(1, x)), elsewhere)


_logit = parametrized("logit", lambda x, *, eps: torch.logit(x, eps), Over(_logit_divisor))


@torch_api.register(*torch_api.torch_functions("logit"), torch.special.logit)
@aten_api.register(aten.logit.default)
def logit(x, eps=None):
    return _logit(x, eps=eps)


_round_decimals = parametrized("round_decimals",
                               lambda x, *, decimals: torch.round(x, decimals=decimals), None)


@torch_api.register(*torch_api.torch_functions("round"), torch.special.round)
@aten_api.register(aten.round.decimals)
def round_(x, *, decimals=0):
    return round(x) if decimals == 0 else _round_decimals(x, decimals=decimals)


def _nan_to_num_derivative(x, out, *, nan, posinf, neginf):
    return where(isfinite(x), 1.0, 0.0)


_nan_to_num = parametrized(
    "nan_to_num", lambda x, *, nan, posinf, neginf: torch.nan_to_num(x, nan, posinf, neginf),
    _nan_to_num_derivative)


@torch_api.register(*torch_api.torch_functions("nan_to_num"))
@aten_api.register(aten.nan_to_num.default)
def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    return _nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)


# clamp with number bounds (tensor bounds are a where of comparisons)
def _clamp_derivative(x, out, *, min, max):
    inside = None
    if min is not None:
        inside = ge(x, min)
    if max is not None:
        below = le(x, max)
        inside = below if inside is None else logical_and(inside, below)
    return where(inside, 1.0, 0.0)


_clamp = parametrized("clamp", lambda x, *, min, max: torch.clamp(x, min, max), _clamp_derivative)


@torch_api.register(*torch_api.torch_functions("clamp"), *torch_api.torch_functions("clip"))
@aten_api.register(aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clip.Tensor)
def clamp(x, min=None, max=None):
    if min is None and max is None:
        raise TransformUsageError("clamp(x): expected min or max (or both), got neither. Fix: "
                                  "pass a bound.")
    if (min is None or isinstance(min, (int, float))) and (
            max is None or isinstance(max, (int, float))):
        return _clamp(x, min=min, max=max)
    # tensor bounds take part in type promotion (clamp(int, float_min) is float, as in torch)
    dtype = ops.result_dtype(x, *[b for b in (min, max) if b is not None])
    x = ops.convert(x, dtype)
    lo = None if min is None else ops.convert(min, dtype)
    hi = None if max is None else ops.convert(max, dtype)
    return _clamp_to_tensors(x, lo, hi)


def _clamp_to_tensors(x, lo, hi):
    """NOTE [clamp with tensor bounds]
    Each element is x, the lower bound or the upper bound, chosen by masks that are torch's
    own (its clamp backward gives the gradient to x where lo <= x <= hi, to lo where
    x < lo < hi, to hi where x > hi or hi < lo), so that the vjp of the ``where`` is torch's,
    ties included. The value is torch's max-then-min wherever no mask holds (x below
    lo == hi) and wherever it is NaN: a NaN in x or in a bound propagates, as in torch's
    kernel, and there no input gets a gradient (torch's backward gives one to an input that
    a mask picks, though the output is NaN). torch's jvp formula picks by other masks at ties
    (``clamp_jvp``: the bound's tangent where x equals a lone bound), so a forward-mode
    derivative exactly at a tie may differ from torch.func's by that choice."""
    if lo is not None and hi is not None:
        keep = logical_and(ops.ge(x, lo), ops.le(x, hi))
        to_lo = logical_and(lt(x, lo), lt(lo, hi))
        to_hi = logical_or(gt(x, hi), lt(hi, lo))
        exact = minimum(maximum(x, lo), hi)
    elif lo is not None:
        keep, to_lo, to_hi, exact = ops.ge(x, lo), lt(x, lo), None, maximum(x, lo)
    else:
        keep, to_lo, to_hi, exact = ops.le(x, hi), None, gt(x, hi), minimum(x, hi)
    exact = ops.detach(exact)
    out = exact
    if to_hi is not None:
        out = where(to_hi, hi, out)
    if to_lo is not None:
        out = where(to_lo, lo, out)
    out = where(keep, x, out)
    if not x.dtype.is_floating_point:
        return out
    return where(ops.ne(exact, exact), exact, out)


@torch_api.register(*torch_api.torch_functions("clamp_min"))
@aten_api.register(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(x, min):
    return clamp(x, min, None)


@torch_api.register(*torch_api.torch_functions("clamp_max"))
@aten_api.register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(x, max):
    return clamp(x, None, max)


torch_api.register_in_place(torch.Tensor.clamp_, torch.Tensor.clip_)(clamp)


# --- activations (torch.nn.functional) ------------------------------------------------------------
def _silu_factors(x, out):
    # derivatives.yaml's infinitely differentiable form, which torch.func's transforms use
    # (grad mode is on in them): grad * s * (1 + x * (1 - s))
    s = ops.sigmoid(x)
    return s, add(mul(x, sub(1, s)), 1)


_silu = parametrized("silu", F.silu, Product(_silu_factors))


@torch_api.register_activation(F.silu)
@aten_api.register(aten.silu.default)
def silu(x):
    return _silu(x)


def _mish_derivative(x, out):
    # derivatives.yaml's infinitely differentiable form (grad mode is on in torch.func's
    # transforms), whose softplus is log1p(exp(x)), without softplus's threshold
    tanh_softplus = ops.tanh(log1p(exp(x)))
    return add(tanh_softplus, mul(mul(x, ops.sigmoid(x)), one_minus_square(tanh_softplus)))


_mish = parametrized("mish", F.mish, _mish_derivative)


@torch_api.register_activation(F.mish)
@aten_api.register(aten.mish.default)
def mish(x):
    return _mish(x)


def _gelu_derivative(x, out, *, approximate):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        t = ops.tanh(mul(add(x, mul(pow(x, 3), 0.044715)), k))
        inner_derivative = mul(add(mul(square(x), 3 * 0.044715), 1), k)
        return add(mul(add(t, 1), 0.5),
                   mul(mul(mul(x, 0.5), one_minus_square(t)), inner_derivative))
    cdf = mul(add(erf(mul(x, math.sqrt(0.5))), 1), 0.5)
    pdf = div(exp(mul(square(x), -0.5)), _SQRT_2PI)
    return add(cdf, mul(x, pdf))


def _gelu_second_derivative(x, *, approximate):
    if approximate == "tanh":
        # (1 - t^2) (u' - x t u'^2 + x u'' / 2), with u = k (x + 0.044715 x^3), t = tanh(u)
        k = math.sqrt(2 / math.pi)
        t = ops.tanh(mul(add(x, mul(pow(x, 3), 0.044715)), k))
        u1 = mul(add(mul(square(x), 3 * 0.044715), 1), k)
        u2 = mul(x, 6 * 0.044715 * k)
        return mul(one_minus_square(t),
                   add(sub(u1, mul(mul(x, t), square(u1))), mul(mul(x, u2), 0.5)))
    # pdf(x) (2 - x^2)
    pdf = div(exp(mul(square(x), -0.5)), _SQRT_2PI)
    return mul(pdf, sub(2, square(x)))


_gelu = parametrized("gelu", lambda x, *, approximate: F.gelu(x, approximate=approximate),
                     _gelu_derivative)


@torch_api.register(F.gelu)
@aten_api.register(aten.gelu.default)
def gelu(x, approximate="none"):
    return _gelu(x, approximate=approximate)


def _softplus_derivative(x, out, *, beta, threshold):
    scaled = mul(x, beta)
    return where(gt(scaled, threshold), 1.0, ops.sigmoid(scaled))


_softplus = parametrized("softplus",
                         lambda x, *, beta, threshold: F.softplus(x, beta, threshold),
                         _softplus_derivative)


@torch_api.register(F.softplus)
@aten_api.register(aten.softplus.default)
def softplus(x, beta=1.0, threshold=20.0):
    return _softplus(x, beta=beta, threshold=threshold)


def _elu_derivative(x, out, *, alpha, scale, input_scale):
    return where(gt(x, 0), scale, mul(exp(mul(x, input_scale)), alpha * scale * input_scale))


_elu = parametrized("elu", lambda x, *, alpha, scale, input_scale: aten.elu(x, alpha, scale,
                                                                            input_scale),
                    _elu_derivative)


@aten_api.register(aten.elu.default)
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return _elu(x, alpha=alpha, scale=scale, input_scale=input_scale)


torch_api.register_activation(F.elu)(lambda x, alpha=1.0: elu(x, alpha))
torch_api.register_activation(F.selu)(
    lambda x: elu(x, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946))
torch_api.register(torch.selu)(
    lambda x: elu(x, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946))
torch_api.register_activation(F.celu)(lambda x, alpha=1.0: elu(x, alpha, 1.0, 1.0 / alpha))
torch_api.register(torch.celu)(lambda x, alpha=1.0: elu(x, alpha, 1.0, 1.0 / alpha))

_leaky_relu = parametrized(
    "leaky_relu", lambda x, *, negative_slope: F.leaky_relu(x, negative_slope),
    # (the slope in x's dtype: where of two numbers would make it float32, 0.01 rounded)
    lambda x, out, *, negative_slope: where(gt(x, 0), 1.0, full_like(x, negative_slope)))


@torch_api.register_activation(F.leaky_relu)
@aten_api.register(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    return _leaky_relu(x, negative_slope=negative_slope)


_hardtanh = parametrized(
    "hardtanh", lambda x, *, min_val, max_val: F.hardtanh(x, min_val, max_val),
    # (0 at a NaN, as torch's vectorized hardtanh_backward gives; its scalar loop, which
    # takes the elements past the last full vector, gives 1 there: torch 2.13 on a CPU)
    lambda x, out, *, min_val, max_val: where(logical_and(gt(x, min_val), lt(x, max_val)),
                                              1.0, 0.0))


@torch_api.register_activation(F.hardtanh)
@aten_api.register(aten.hardtanh.default)
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return _hardtanh(x, min_val=min_val, max_val=max_val)


torch_api.register_activation(F.relu6)(lambda x: hardtanh(x, 0.0, 6.0))

_hardsigmoid = parametrized(
    "hardsigmoid", F.hardsigmoid,
    # (1/6 as a float32, in every dtype: torch's hardsigmoid_backward computes with 1.0f / 6)
    lambda x, out: where(logical_and(gt(x, -3.0), lt(x, 3.0)), 1 / 6, 0.0))
torch_api.register_activation(F.hardsigmoid)(_hardsigmoid)
aten_api.register(aten.hardsigmoid.default)(_hardsigmoid)

_hardswish = parametrized(
    "hardswish", F.hardswish,
    # hardswish_backward's pieces: 0 up to -3, x / 3 + 1/2 below 3, 1 from 3 on
    lambda x, out: where(le(x, -3.0), 0.0, where(lt(x, 3.0), add(div(x, 3.0), 0.5), 1.0)))
torch_api.register_activation(F.hardswish)(_hardswish)
aten_api.register(aten.hardswish.default)(_hardswish)


def _outside(x, out, *, lambd):
    return where(logical_or(lt(x, -lambd), gt(x, lambd)), 1.0, 0.0)


_hardshrink = parametrized("hardshrink", lambda x, *, lambd: F.hardshrink(x, lambd), _outside)
_softshrink = parametrized("softshrink", lambda x, *, lambd: F.softshrink(x, lambd), _outside)
torch_api.register(F.hardshrink, *torch_api.torch_functions("hardshrink"))(
    lambda x, lambd=0.5: _hardshrink(x, lambd=lambd))
aten_api.register(aten.hardshrink.default)(lambda x, lambd=0.5: _hardshrink(x, lambd=lambd))
torch_api.register(F.softshrink)(lambda x, lambd=0.5: _softshrink(x, lambd=lambd))
aten_api.register(aten.softshrink.default)(lambda x, lambd=0.5: _softshrink(x, lambd=lambd))

_threshold = parametrized(
    "threshold", lambda x, *, threshold, value: F.threshold(x, threshold, value),
    # threshold_backward's mask: 0 where x <= threshold, so 1 at a nan
    lambda x, out, *, threshold, value: where(le(x, threshold), 0.0, 1.0))
torch_api.register_activation(F.threshold)(
    lambda x, threshold, value: _threshold(x, threshold=threshold, value=value))
torch_api.register(torch.threshold)(
    lambda x, threshold, value: _threshold(x, threshold=threshold, value=value))
aten_api.register(aten.threshold.default)(
    lambda x, threshold, value: _threshold(x, threshold=threshold, value=value))

_log_sigmoid = parametrized("log_sigmoid", F.logsigmoid, lambda x, out: ops.sigmoid(neg(x)))
torch_api.register(F.logsigmoid)(_log_sigmoid)
# the second output is a buffer that only torch's own backward reads
aten_api.register(aten.log_sigmoid_forward.default)(
    lambda x: (_log_sigmoid(x), torch.empty(0, dtype=x.dtype, device=x.device)))


# --- two inputs, with broadcasting ----------------------------------------------------------------
def _as_tensor_like(v, like):
    """A Python number as a 0-d tensor of ``like``'s dtype, for derivative formulas."""
    if _is_tensor(v):
        return v
    return torch.tensor(v, dtype=like.dtype, device=like.device)


class OfGrad:
    """A partial derivative written as what it does to the incoming gradient (or tangent),
    ``apply(grad, x, y, out)``, in derivatives.yaml's order: hypot's ``grad * self / result``
    is (grad * x) / out, where grad * (x / out) rounds differently. For real inputs (no conj
    is taken: a primitive with one is not complex_ready), unless it ``conjugates``."""

    def __init__(self, apply, *, conjugates=False):
        self.apply = apply
        # whether ``apply`` takes ``conjugate`` (True for a vjp): for a complex_ready primitive,
        # whose vjp multiplies by the conjugate derivative (NOTE [Complex numbers])
        self.conjugates = conjugates


def binary_rules(prim, dx, dy):
    """Register the rules of an elementwise primitive of two broadcasting inputs, from the
    derivatives of its output with respect to each (``None``: zero; ``NotImplemented``:
    torch has no formula either, so asking for that derivative is refused; ``OfGrad``: what
    the derivative does to a gradient)."""
    def times(g, formula, which, x, y, out, params, conjugate):
        """g times the partial derivative (conjugated, for a vjp)."""
        if formula is NotImplemented:
            raise MissingRuleError(
                f"{prim.name}: the derivative with respect to its {which} argument is not "
                "implemented (torch has no formula for it either). Fix: differentiate with "
                "respect to the other argument only."
            )
        like = x if _is_tensor(x) else y
        x, y = _as_tensor_like(x, like), _as_tensor_like(y, like)
        if isinstance(formula, OfGrad):
            if formula.conjugates:
                return formula.apply(g, x, y, out, conjugate=conjugate, **params)
            return formula.apply(g, x, y, out, **params)
        derivative = formula(x, y, out, **params)
        return mul(g, conj(derivative) if conjugate else derivative)

    def vjp(x, y, **params):
        out = bind(prim, x, y, **params)

        def backward(ct):
            x_bar = y_bar = None
            if dx is not None and wants_cotangent(0, x):
                x_bar = sum_to_size(times(ct, dx, "first", x, y, out, params, True),
                                    ops.shape_of(x))
            if dy is not None and wants_cotangent(1, y):
                y_bar = sum_to_size(times(ct, dy, "second", x, y, out, params, True),
                                    ops.shape_of(y))
            return x_bar, y_bar
        return out, backward

    def jvp(primals, tangents, **params):
        (x, y), (x_dot, y_dot) = primals, tangents
        out = bind(prim, x, y, **params)
        out_dot = None
        if dx is not None and x_dot is not None:
            out_dot = times(x_dot, dx, "first", x, y, out, params, False)
        if dy is not None and y_dot is not None:
            out_dot = add_tangents(out_dot, times(y_dot, dy, "second", x, y, out, params, False))
        if out_dot is None:
            out_dot = ops.zeros_like(out)
        return out, broadcast_tangent(out_dot, ops.shape_of(out))

    if dx is not None or dy is not None:
        vjp_rules[prim] = vjp
        jvp_rules[prim] = jvp
    batching_rules[prim] = broadcasting_batch(prim)


_OVERLOADS = ("default", "Tensor", "Scalar", "other", "Scalar_Other", "self", "Scalar_Tensor",
              "Tensor_Scalar", "Tensor_Tensor", "self_scalar", "other_scalar")


def binary(name, dx, dy, *, impl=None, functions=None, aten_ops=None):
    """An elementwise primitive of two broadcasting inputs, with its doors. Returns its op."""
    impl = impl or getattr(torch, name)
    prim = P.primitive(name, impl, differentiable=dx is not None or dy is not None)
    binary_rules(prim, dx, dy)
    register_inplace(prim)

    def op(x, y):
        return bind(prim, x, y)
    op.__name__ = name
    torch_api.register(*(torch_api.torch_functions(name) if functions is None else functions))(op)
    if aten_ops is None:
        aten_ops = [getattr(packet, overload)
                    for packet in (getattr(aten, name, None), getattr(prims, name, None))
                    if packet is not None
                    for overload in _OVERLOADS if overload in packet.overloads()]
    aten_api.register(*aten_ops)(op)
    return op


def _atan2_r(x, y):
    """atan2_backward's recip (FunctionsManual.cpp): 1 / (x^2 + y^2), and 0 where that is
    0, so that the gradient at the origin is a signed 0 (torch's), not 0 * inf."""
    denominator = add(square(x), square(y))
    return where(eq(denominator, 0), 0.0, reciprocal(denominator))


def _shared_on_ties(x, y, passed_over):
    """maximum and minimum: an input gets the whole cotangent unless the other one was chosen
    (``passed_over``), and ties share it evenly. derivatives.yaml's words, which also give
    both inputs the whole cotangent where one is nan (no comparison holds there). (Their jvp
    is derivatives.yaml's formula: _chosen_jvp.)"""
    return where(eq(x, y), 0.5, where(passed_over, 0.0, 1.0))


def _picks_x(x, y, compare):
    """fmax and fmin pick x where it wins or y is nan (ties are not shared, as in torch)."""
    return logical_or(compare(x, y), isnan(y))


def _igamma_dy(x, y):
    """d/dy of the regularized lower incomplete gamma: y^(x-1) e^(-y) / Gamma(x)."""
    return exp(sub(sub(mul(sub(x, 1), log(y)), y), lgamma(x)))


# One line per primitive: name, d out / d x, d out / d y, as functions of (x, y, out).
atan2 = binary("atan2", OfGrad(lambda g, x, y, out: mul(mul(g, y), _atan2_r(x, y))),
               OfGrad(lambda g, x, y, out: mul(mul(g, neg(x)), _atan2_r(x, y))))
hypot = binary("hypot", OfGrad(lambda g, x, y, out: div(mul(g, x), out)),
               OfGrad(lambda g, x, y, out: div(mul(g, y), out)))
# lerp with a number for its weight (torch.lerp(start, end, 0.3): a moving average's step):
# an elementwise primitive of its two tensors, the weight a parameter, with derivatives.yaml's
# formulas (grad * (1 - weight), grad * weight). With a tensor (or complex) weight the op
# declines, and torch's lowering runs it. (Through that lowering, at the aten door, grad of
# a lerp of two 256x256 tensors took 3.4 times torch.func's time.)
lerp_p = P.primitive("lerp", lambda start, end, *, weight: torch.lerp(start, end, weight))
binary_rules(lerp_p, lambda x, y, out, *, weight: 1 - weight,
             lambda x, y, out, *, weight: weight)


def lerp_jvp(primals, tangents, *, weight):
    """Linear in its tensors: the lerp of their tangents (torch's own forward formula)."""
    (start, end), (start_dot, end_dot) = primals, tangents
    out = bind(lerp_p, start, end, weight=weight)
    start_dot = ops.zeros_like(start) if start_dot is None else start_dot
    end_dot = ops.zeros_like(end) if end_dot is None else end_dot
    return out, broadcast_tangent(bind(lerp_p, start_dot, end_dot, weight=weight),
                                  ops.shape_of(out))
jvp_rules[lerp_p] = lerp_jvp
complex_ready(lerp_p)  # (a real weight: the formulas' conjugates are themselves)


@torch_api.register(*torch_api.torch_functions("lerp"))
def lerp(start, end, weight):
    if _is_tensor(weight) or isinstance(weight, complex):
        return NotImplemented
    return bind(lerp_p, start, end, weight=float(weight))


maximum = binary("maximum", lambda x, y, out: _shared_on_ties(x, y, lt(x, y)),
                 lambda x, y, out: _shared_on_ties(x, y, gt(x, y)))
minimum = binary("minimum", lambda x, y, out: _shared_on_ties(x, y, gt(x, y)),
                 lambda x, y, out: _shared_on_ties(x, y, lt(x, y)))
fmax = binary("fmax", lambda x, y, out: where(_picks_x(x, y, ge), 1.0, 0.0),
              lambda x, y, out: where(_picks_x(x, y, ge), 0.0, 1.0))
fmin = binary("fmin", lambda x, y, out: where(_picks_x(x, y, le), 1.0, 0.0),
              lambda x, y, out: where(_picks_x(x, y, le), 0.0, 1.0))
copysign = binary("copysign", lambda x, y, out: _at_zero(x, lambda s: div(out, s), 0.0), None)
fmod = binary("fmod", lambda x, y, out: full_like(out, 1),
              lambda x, y, out: neg(div_rounding(x, y, "trunc")))
remainder = binary("remainder", lambda x, y, out: full_like(out, 1),
                   lambda x, y, out: neg(div_rounding(x, y, "floor")))


def _over_one_plus_exp(a, b):
    """logaddexp's partial derivatives as derivatives.yaml writes them: grad / (1 + exp(b - a)),
    the denominator conjugated in a vjp (logaddexp is holomorphic)."""
    def apply(g, x, y, out, conjugate):
        denominator = add(exp(sub(b(x, y), a(x, y))), 1)
        return div(g, conj(denominator) if conjugate else denominator)
    return OfGrad(apply, conjugates=True)


logaddexp = binary("logaddexp", _over_one_plus_exp(lambda x, y: x, lambda x, y: y),
                   _over_one_plus_exp(lambda x, y: y, lambda x, y: x))
logaddexp2 = binary("logaddexp2",
                    OfGrad(lambda g, x, y, out: div(g, add(pow(2.0, sub(y, x)), 1))),
                    OfGrad(lambda g, x, y, out: div(g, add(pow(2.0, sub(x, y)), 1))))


def _x_log_dx(log_of_grad, bound):
    """xlogy's and xlog1py's derivative in x, as derivatives.yaml writes it:
    xlogy(grad, y), 0 where x == 0 and y <= bound (where log(y) is -inf or nan; at x == 0
    with a y above it the derivative is log(y) as anywhere else)."""
    return OfGrad(lambda g, x, y, out: where(logical_and(eq(x, 0), le(y, bound)), 0.0,
                                             log_of_grad(g, y)))


xlogy = binary("xlogy", _x_log_dx(lambda g, y: xlogy(g, y), 0),
               OfGrad(lambda g, x, y, out: div(mul(g, x), y)),
               functions=(*torch_api.torch_functions("xlogy"), torch.special.xlogy))
special_xlog1py = binary(
    "special_xlog1py", _x_log_dx(lambda g, y: special_xlog1py(g, y), -1),
    OfGrad(lambda g, x, y, out: div(mul(g, x), add(y, 1))), impl=torch.special.xlog1py,
    functions=(torch.special.xlog1py,))
special_zeta = binary("special_zeta", NotImplemented,
                      lambda x, y, out: neg(mul(x, special_zeta(add(x, 1), y))),
                      impl=torch.special.zeta, functions=(torch.special.zeta,),
                      aten_ops=[aten.special_zeta.default, aten.special_zeta.self_scalar,
                                aten.special_zeta.other_scalar, prims.zeta.default])
igamma = binary("igamma", NotImplemented, lambda x, y, out: _igamma_dy(x, y),
                functions=(*torch_api.torch_functions("igamma"), torch.special.gammainc))
igammac = binary("igammac", NotImplemented, lambda x, y, out: neg(_igamma_dy(x, y)),
                 functions=(*torch_api.torch_functions("igammac"), torch.special.gammaincc))
complex_ready(P.PRIMITIVES["logaddexp"])  # holomorphic, checked (NOTE [Complex numbers])


# atan2's jvp is derivatives.yaml's own, (y x_dot - x y_dot) / (x^2 + y^2) with a missing
# tangent left out, not the sum of its vjp's terms (which round differently)
def _atan2_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents
    out = bind(P.PRIMITIVES["atan2"], x, y)
    numerator = add_tangents(None if x_dot is None else mul(y, x_dot),
                             None if y_dot is None else neg(mul(x, y_dot)))
    out_dot = div(numerator, add(square(x), square(y)))
    return out, broadcast_tangent(out_dot, ops.shape_of(out))


jvp_rules[P.PRIMITIVES["atan2"]] = _atan2_jvp


# maximum's and minimum's jvp is derivatives.yaml's own as well: y_dot + w (x_dot - y_dot),
# w = 1/2 on ties, else whether x is chosen, so the second input's tangent where either is
# nan (its vjp gives both inputs the whole cotangent there: _shared_on_ties)
def _chosen_jvp(prim, x_chosen, *, ties_shared=True):
    def jvp(primals, tangents):
        (x, y), (x_dot, y_dot) = primals, tangents
        out = bind(prim, x, y)
        w = where(x_chosen(x, y), 1.0, 0.0)
        if ties_shared:
            w = where(eq(x, y), 0.5, w)
        if y_dot is None:
            out_dot = mul(w, x_dot)
        else:
            out_dot = add(y_dot, mul(w, sub(x_dot, y_dot) if x_dot is not None else neg(y_dot)))
        return out, broadcast_tangent(out_dot, ops.shape_of(out))
    return jvp


jvp_rules[P.PRIMITIVES["maximum"]] = _chosen_jvp(P.PRIMITIVES["maximum"], gt)
jvp_rules[P.PRIMITIVES["minimum"]] = _chosen_jvp(P.PRIMITIVES["minimum"], lt)
# fmax and fmin: x is chosen where it wins or y is nan, ties not shared; derivatives.yaml's
# jvp formulas give fmax's ties to y and fmin's to x (their vjps give both theirs to x)
jvp_rules[P.PRIMITIVES["fmax"]] = _chosen_jvp(
    P.PRIMITIVES["fmax"], lambda x, y: _picks_x(x, y, gt), ties_shared=False)
jvp_rules[P.PRIMITIVES["fmin"]] = _chosen_jvp(
    P.PRIMITIVES["fmin"], lambda x, y: _picks_x(x, y, le), ties_shared=False)
# zero derivative wherever there is one
# nextafter(x, y) moves x by one ulp toward y: torch differentiates it as x itself, except
# where x == y (the result is y then) and in y not at all
nextafter = binary("nextafter", lambda x, y, out: where(eq(x, y), 0.0, 1.0), None)
heaviside = binary("heaviside", None, None)
floor_divide = binary("floor_divide", None, None)
logical_and = binary("logical_and", None, None)
logical_or = binary("logical_or", None, None)
logical_xor = binary("logical_xor", None, None)
bitwise_and = binary("bitwise_and", None, None)
bitwise_or = binary("bitwise_or", None, None)
bitwise_xor = binary("bitwise_xor", None, None)
bitwise_left_shift = binary("bitwise_left_shift", None, None)
bitwise_right_shift = binary("bitwise_right_shift", None, None)
gcd = binary("gcd", None, None)
lcm = binary("lcm", None, None)
# the orthogonal polynomials p_n(x), n a tensor or a number: not differentiable either
for _name in ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
              "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
              "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
              "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
              "laguerre_polynomial_l", "legendre_polynomial_p"):
    binary(f"special_{_name}", None, None, impl=getattr(torch.special, _name),
           functions=(getattr(torch.special, _name),),
           aten_ops=[getattr(getattr(aten, f"special_{_name}"), overload)
                     for overload in ("default", "x_scalar", "n_scalar")])

def div_rounding(x, y, rounding_mode):
    return ops.div(x, y, rounding_mode=rounding_mode)


# --- tanh and sigmoid: torch's fused backward kernels ---------------------------------------------
# tanh_backward(ct, y) = ct * (1 - y^2) and sigmoid_backward(ct, y) = ct * y * (1 - y), each
# rounded once. They are primitives of their own, differentiable in both arguments.
tanh_backward_p = P.primitive("tanh_backward", aten.tanh_backward)
sigmoid_backward_p = P.primitive("sigmoid_backward", aten.sigmoid_backward)
binary_rules(tanh_backward_p, lambda ct, y, out: one_minus_square(y),
             lambda ct, y, out: mul(mul(ct, y), -2))
binary_rules(sigmoid_backward_p, lambda ct, y, out: mul(y, sub(1, y)),
             lambda ct, y, out: mul(ct, sub(1, mul(y, 2))))
passes.keeps_diagonal.update({tanh_backward_p, sigmoid_backward_p})  # (0 where ct is 0)
aten_api.register(aten.tanh_backward.default)(lambda ct, y: bind(tanh_backward_p, ct, y))
aten_api.register(aten.sigmoid_backward.default)(lambda ct, y: bind(sigmoid_backward_p, ct, y))


def fused_backward_rules(prim, backward_prim, **params):
    """The vjp and jvp rules of a primitive whose derivative torch computes with a fused
    kernel of the incoming cotangent (or tangent) and the output: ``backward_prim(ct, out)``.
    On complex numbers the kernel is the vjp, ``ct * conj(d)``, so the jvp ``x_dot * d`` is
    ``conj(kernel(conj(x_dot), out))`` (as derivatives.yaml's auto_element_wise does)."""
    def vjp(x):
        out = bind(prim, x)
        return out, lambda ct: (bind(backward_prim, ct, out, **params),)

    def jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        out = bind(prim, x)
        if out.dtype.is_complex:
            return out, conj(bind(backward_prim, conj(x_dot), out, **params))
        return out, bind(backward_prim, x_dot, out, **params)

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp


fused_backward_rules(P.tanh_p, tanh_backward_p)
fused_backward_rules(P.sigmoid_p, sigmoid_backward_p)


# relu's backward is threshold_backward(ct, out, 0): ct where out > 0, else 0. torch's fused
# kernel is many times faster than a where over a boolean mask, and is what torch.func uses.
threshold_backward_p = P.primitive(
    "threshold_backward",
    lambda ct, y, *, threshold: aten.threshold_backward(ct, y, threshold))
binary_rules(threshold_backward_p,
             lambda ct, y, out, *, threshold: where(gt(y, threshold), 1.0, 0.0), None)
aten_api.register(aten.threshold_backward.default)(
    lambda ct, y, threshold: bind(threshold_backward_p, ct, y, threshold=threshold))
passes.keeps_diagonal.add(threshold_backward_p)  # (0 where ct is 0)


fused_backward_rules(P.relu_p, threshold_backward_p, threshold=0)
register_fresh(tanh_backward_p, sigmoid_backward_p, threshold_backward_p)  # (fast_code.py)


# NOTE [gelu differentiates with torch's kernel]
# gelu's backward is torch's fused kernel ``gelu_backward(ct, x)``, as in derivatives.yaml and
# so in torch.func: one op per backward, rounded once, where the formula written with ops
# (eight of them) differed from torch.func's gradient in the last bit. The kernel is a
# primitive of its own, linear in ct: its derivative in ct is gelu's derivative, and in x, ct
# times the second derivative (derivatives.yaml's gelu_double_backward). The jvp is the same
# kernel of the tangent, as derivatives.yaml's auto_element_wise makes it. softplus, elu (so
# selu and celu) and logsigmoid are done the same way, with ``softplus_backward``,
# ``elu_backward`` and ``log_sigmoid_backward``.
# (silu and mish are not: with grad mode on, which it is inside torch.func's transforms,
# derivatives.yaml picks their infinitely differentiable formulas, not the kernels.)
def fused_backward_of_input_rules(prim, backward_prim):
    """vjp and jvp of an activation whose derivative torch computes with a fused kernel of the
    cotangent (or tangent) and the input, ``backward_prim(ct, x, **params)``. (Complex inputs
    never reach it: the levels refuse them for a primitive not marked complex_ready.)"""
    # (the kernel wants one dtype: a cotangent is cast as torch's engine casts it)
    def vjp(x, **params):
        out = bind(prim, x, **params)
        return out, lambda ct: (bind(backward_prim, ops.convert(ct, x.dtype), x, **params),)

    def jvp(primals, tangents, **params):
        (x,), (x_dot,) = primals, tangents
        return (bind(prim, x, **params),
                bind(backward_prim, ops.convert(x_dot, x.dtype), x, **params))

    vjp_rules[prim] = vjp
    jvp_rules[prim] = jvp


gelu_backward_p = P.primitive(
    "gelu_backward",
    lambda ct, x, *, approximate: aten.gelu_backward(ct, x, approximate=approximate))
binary_rules(gelu_backward_p,
             lambda ct, x, out, *, approximate: _gelu_derivative(x, None, approximate=approximate),
             lambda ct, x, out, *, approximate: mul(ct, _gelu_second_derivative(
                 x, approximate=approximate)))
fused_backward_of_input_rules(P.PRIMITIVES["gelu"], gelu_backward_p)
register_fresh(gelu_backward_p)
# the CPU kernel (oneDNN, for float32) does not broadcast: an unbatched operand is expanded
batching_rules[gelu_backward_p] = same_shape_batch(gelu_backward_p)
aten_api.register(aten.gelu_backward.default)(
    lambda ct, x, approximate="none": bind(gelu_backward_p, ct, x, approximate=approximate))


def _softplus_second_derivative(x, *, beta, threshold):
    # derivatives.yaml's softplus_double_backward: times (beta x < threshold) as a number, so
    # 0 at the threshold itself (where the first derivative still takes the sigmoid) and NaN
    # at a NaN
    scaled = mul(x, beta)
    s = ops.sigmoid(scaled)
    return mul(mul(mul(s, sub(1, s)), beta), ops.convert(lt(scaled, threshold), x.dtype))


softplus_backward_p = P.primitive(
    "softplus_backward",
    lambda ct, x, *, beta, threshold: aten.softplus_backward(ct, x, beta, threshold))
binary_rules(softplus_backward_p,
             lambda ct, x, out, **params: _softplus_derivative(x, None, **params),
             lambda ct, x, out, **params: mul(ct, _softplus_second_derivative(x, **params)))
fused_backward_of_input_rules(P.PRIMITIVES["softplus"], softplus_backward_p)
aten_api.register(aten.softplus_backward.default)(
    lambda ct, x, beta, threshold: bind(softplus_backward_p, ct, x, beta=beta,
                                        threshold=threshold))


def _elu_second_derivative(x, *, alpha, scale, input_scale):
    # derivatives.yaml's elu_double_backward: times (x < 0), so 0 at 0 (where the first
    # derivative takes the exponential's side). At a NaN this gives 0; torch's own answer
    # there is 0 or NaN, by whether the element falls in a vectorized block of its kernel.
    return where(lt(x, 0), mul(exp(mul(x, input_scale)),
                               alpha * scale * input_scale * input_scale), 0.0)


elu_backward_p = P.primitive(
    "elu_backward",
    lambda ct, x, *, alpha, scale, input_scale: aten.elu_backward(ct, alpha, scale, input_scale,
                                                                  False, x))
binary_rules(elu_backward_p, lambda ct, x, out, **params: _elu_derivative(x, None, **params),
             lambda ct, x, out, **params: mul(ct, _elu_second_derivative(x, **params)))
fused_backward_of_input_rules(P.PRIMITIVES["elu"], elu_backward_p)
register_fresh(softplus_backward_p, elu_backward_p)


# logsigmoid's kernel reads a buffer that torch's forward fills (on the CPU; on CUDA it is
# empty): the primitive computes it again from x, one elementwise pass, so that it is a
# function of (ct, x) alone. The kernel's operands have one shape (it writes the buffer's).
log_sigmoid_backward_p = P.primitive(
    "log_sigmoid_backward",
    lambda ct, x: aten.log_sigmoid_backward(ct, x, aten.log_sigmoid_forward(x)[1]))
binary_rules(log_sigmoid_backward_p, lambda ct, x, out: ops.sigmoid(neg(x)),
             lambda ct, x, out: mul(ct, neg(mul(ops.sigmoid(x), ops.sigmoid(neg(x))))))
fused_backward_of_input_rules(P.PRIMITIVES["log_sigmoid"], log_sigmoid_backward_p)
batching_rules[log_sigmoid_backward_p] = same_shape_batch(log_sigmoid_backward_p)
aten_api.register(aten.log_sigmoid_backward.default)(
    lambda ct, x, buffer: bind(log_sigmoid_backward_p, ct, x))
register_fresh(log_sigmoid_backward_p)


@aten_api.register(aten.elu_backward.default)
def _elu_backward(ct, alpha, scale, input_scale, is_result, self_or_result):
    if not is_result:
        return bind(elu_backward_p, ct, self_or_result, alpha=alpha, scale=scale,
                    input_scale=input_scale)
    # from the result: (out + alpha * scale) * input_scale where it is not positive
    out = self_or_result
    return mul(ct, where(gt(out, 0), scale, mul(add(out, alpha * scale), input_scale)))

