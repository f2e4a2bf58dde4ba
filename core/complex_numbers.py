"""Complex numbers: the functions that are not holomorphic (conj, real, imag, abs, angle, sgn),
the conversions between a complex tensor and its real and imaginary parts (view_as_real,
view_as_complex, complex, polar), and the list of primitives whose derivatives are checked on
complex numbers.

NOTE [Rules of functions that are not holomorphic]
A function f of z = a + ib that is not holomorphic has a differential with two terms,
``df = (df/dz) dz + (df/dz*) conj(dz)`` (Wirtinger derivatives; NOTE [Complex numbers] in
dispatch.py). Its jvp is that sum; its vjp, in PyTorch's convention, is
``conj(df/dz) ct + (df/dz*) conj(ct)`` (abs: ``df/dz = conj(z) / 2|z|`` and
``df/dz* = z / 2|z|``, so a real ct gives ``ct * sgn(z)``, abs_vjp in autograd.py). Each rule
below is that formula worked out, as FunctionsManual.cpp works out ``angle_backward`` and
``sgn_backward``; conj, real, imag and the views are linear over the reals, so their vjp is
their adjoint for the real inner product ``Re(sum(conj(a) * b))``:
- conj: dz -> conj(dz); its adjoint is conj.
- real, imag: the adjoints put a real cotangent back as ``ct + 0i`` and ``0 + ct i``.
- complex(re, im): the adjoint splits the cotangent into ``real(ct)`` and ``imag(ct)``.
- view_as_real and view_as_complex are each other's inverse and adjoint.
- sgn(z) = z/|z|: ``d sgn = (dz - Re(dz conj(s)) s) / |z|``, which is its own adjoint.
- angle(z): ``d angle = Im(dz conj(z)) / |z|^2``; the adjoint is ``ct * i z / |z|^2``.
On a real tensor, conj is the identity and angle and sgn have zero derivative, as in torch.
The primitives of conj, real, imag, ... live in primitives.py (ops.conj, ops.real, ... are what
rules elsewhere call); this module holds their rules and their doors.
"""
import torch

from . import aten_api, nn, ops, torch_api
from . import primitives as P
from .autograd import sum_to_size, vjp_rules, wants_cotangent
from .batching import batching_rules, broadcasting_batch, elementwise_batch, move_bdim
from .dispatch import complex_ready
from .errors import InvalidOptionError
from .forward import broadcast_tangent, jvp_rules
from .values import bind

aten = torch.ops.aten

sgn_p, angle_p = P.sgn_p, P.angle_p


# --- conj ------------------------------------------------------------------------------------
def _conj_rules(prim):
    def vjp(x):
        return bind(prim, x), lambda ct: (ops.conj(ct),)

    def jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return bind(prim, x), ops.conj(x_dot)
    return vjp, jvp


vjp_rules[P.conj_physical_p], jvp_rules[P.conj_physical_p] = _conj_rules(P.conj_physical_p)
batching_rules[P.conj_physical_p] = elementwise_batch(P.conj_physical_p)
torch_api.register(*torch_api.torch_functions("conj_physical"))(ops.conj)
# NOTE [No lazy conjugates inside the engine]
# torch's x.conj() is aten._conj, a view that only sets a conj bit, which torch's Conjugate
# dispatch key resolves before a kernel reads the data. Inside __torch_dispatch__ (the back
# door) that key is excluded, so a kernel called there on such a view reads the data
# unconjugated (an FFT of a conj view, hfft of a complex tensor, came out wrong under vmap).
# So the engine conjugates physically: aten._conj is conj_physical here (the in-place
# machinery still sees aten._conj's schema, a view).
aten_api.register(aten.conj_physical.default, aten._conj_physical.default,
                  aten._conj.default)(ops.conj)


# --- real, imag and complex ------------------------------------------------------------------
def real_vjp(x):
    return ops.real(x), lambda ct: (ops.complex(ct, ops.zeros_like(ct)),)
vjp_rules[P.real_p] = real_vjp


def real_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return ops.real(x), ops.real(x_dot)
jvp_rules[P.real_p] = real_jvp


def imag_vjp(x):
    return ops.imag(x), lambda ct: (ops.complex(ops.zeros_like(ct), ct),)
vjp_rules[P.imag_p] = imag_vjp


def imag_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return ops.imag(x), ops.imag(x_dot)
jvp_rules[P.imag_p] = imag_jvp


def complex_vjp(re, im):
    def backward(ct):
        return (sum_to_size(ops.real(ct), ops.shape_of(re)) if wants_cotangent(0, re) else None,
                sum_to_size(ops.imag(ct), ops.shape_of(im)) if wants_cotangent(1, im) else None)
    return ops.complex(re, im), backward
vjp_rules[P.complex_p] = complex_vjp


def complex_jvp(primals, tangents):
    (re, im), (re_dot, im_dot) = primals, tangents
    out = ops.complex(re, im)
    re_dot = ops.zeros_like(re) if re_dot is None else re_dot
    im_dot = ops.zeros_like(im) if im_dot is None else im_dot
    return out, broadcast_tangent(ops.complex(re_dot, im_dot), ops.shape_of(out))
jvp_rules[P.complex_p] = complex_jvp

for _prim in (P.real_p, P.imag_p):
    batching_rules[_prim] = elementwise_batch(_prim)
batching_rules[P.complex_p] = broadcasting_batch(P.complex_p)


def real(x):
    """``torch.real``: a complex tensor's real part; a real tensor itself."""
    return ops.real(x) if x.dtype.is_complex else x


# real and imag are views of their input (torch_api's VIEWS): a write through one reaches the
# base, whose dtype differs, which tensor.py refuses rather than losing the write
torch_api.register(torch.real, torch.Tensor.real.__get__, view=torch_api._always)(real)
torch_api.register(torch.imag, torch.Tensor.imag.__get__, view=torch_api._always)(ops.imag)
@torch_api.register(torch.complex)
@aten_api.register(aten.complex.default)
def complex(real, imag, *, out=None):
    """``torch.complex``, with torch's checks: two floating tensors of one dtype (under vmap
    the batching rule would otherwise promote them, where torch raises)."""
    floating = (torch.float16, torch.float32, torch.float64)
    if real.dtype not in floating or imag.dtype not in floating:
        raise InvalidOptionError(
            f"torch.complex(real, imag): Expected both inputs to be Half, Float or Double "
            f"tensors but got {real.dtype} and {imag.dtype}. Fix: convert both to one "
            "floating dtype.")
    if real.dtype != imag.dtype:
        raise InvalidOptionError(
            f"torch.complex(real, imag): Expected object of scalar type {real.dtype} but got "
            f"scalar type {imag.dtype} for second argument (torch does not promote here). Fix: "
            "convert one (imag.to(real.dtype)).")
    return ops.complex(real, imag)


@torch_api.register(torch.polar)
@aten_api.register(aten.polar.default)
def polar(abs, angle):
    return ops.complex(ops.mul(abs, ops.cos(angle)), ops.mul(abs, ops.sin(angle)))


# --- view_as_real and view_as_complex -------------------------------------------------------
def view_as_real_vjp(x):
    return ops.view_as_real(x), lambda ct: (ops.view_as_complex(ct),)
vjp_rules[P.view_as_real_p] = view_as_real_vjp


def view_as_complex_vjp(x):
    return ops.view_as_complex(x), lambda ct: (ops.view_as_real(ct),)
vjp_rules[P.view_as_complex_p] = view_as_complex_vjp


def _linear_jvp(prim):
    def jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return bind(prim, x), bind(prim, x_dot)
    return jvp


jvp_rules[P.view_as_real_p] = _linear_jvp(P.view_as_real_p)
jvp_rules[P.view_as_complex_p] = _linear_jvp(P.view_as_complex_p)
# view_as_real adds a last dim of 2: the batch dim stays where it is
batching_rules[P.view_as_real_p] = elementwise_batch(P.view_as_real_p)


def view_as_complex_batch(values, bdims):
    """view_as_complex reads the last dim as (real, imag): a batch dim there moves to the
    front first."""
    (x,), (bdim,) = values, bdims
    if bdim == len(ops.shape_of(x)) - 1:
        x, bdim = move_bdim(x, bdim, 0), 0
    return ops.view_as_complex(x), bdim
batching_rules[P.view_as_complex_p] = view_as_complex_batch

torch_api.register(torch.view_as_real, view=torch_api._always)(ops.view_as_real)
torch_api.register(torch.view_as_complex, view=torch_api._always)(ops.view_as_complex)
aten_api.register(aten.view_as_real.default)(ops.view_as_real)
aten_api.register(aten.view_as_complex.default)(ops.view_as_complex)


# --- sgn and angle: zero derivative on real numbers ---------------------------------------
def _sgn_derivative(z, s, dz):
    """(dz - Re(dz conj(s)) s) / |z|, and 0 where z = 0 (NOTE [Rules of functions that are
    not holomorphic]); the same formula gives the jvp and the vjp."""
    a = ops.abs(z)
    return ops.where(ops.eq(a, 0), 0.0,
                     ops.div(ops.sub(dz, ops.mul(ops.real(ops.mul(dz, ops.conj(s))), s)), a))


def sgn_vjp(x):
    out = bind(sgn_p, x)
    if not x.dtype.is_complex:
        return out, lambda ct: (None,)
    return out, lambda ct: (_sgn_derivative(x, out, ct),)
vjp_rules[sgn_p] = sgn_vjp


def sgn_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = bind(sgn_p, x)
    return out, _sgn_derivative(x, out, x_dot) if x.dtype.is_complex else None
jvp_rules[sgn_p] = sgn_jvp


def angle_vjp(x):
    out = bind(angle_p, x)
    if not x.dtype.is_complex:
        return out, lambda ct: (None,)

    def backward(ct):  # ct * i z / |z|^2, 0 at z = 0
        a = ops.abs(x)
        return (ops.where(ops.eq(a, 0), 0.0, ops.div(ops.mul(ops.mul(ct, x), 1j),
                                                     ops.mul(a, a))),)
    return out, backward
vjp_rules[angle_p] = angle_vjp


def angle_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = bind(angle_p, x)
    if not x.dtype.is_complex:
        return out, None
    a = ops.abs(x)
    return out, ops.where(ops.eq(a, 0), 0.0,
                          ops.div(ops.imag(ops.mul(x_dot, ops.conj(x))), ops.mul(a, a)))
jvp_rules[angle_p] = angle_jvp

for _prim, _name in ((sgn_p, "sgn"), (angle_p, "angle")):
    batching_rules[_prim] = elementwise_batch(_prim)
    _op = (lambda prim: lambda x: bind(prim, x))(_prim)
    torch_api.register(*torch_api.torch_functions(_name))(_op)
    aten_api.register(getattr(aten, _name).default)(_op)


# --- the primitives checked on complex numbers ---------------------------------------------
# (NOTE [Complex numbers] in dispatch.py: each is compared with torch.func on complex64 and
# complex128 inputs in tests/test_complex.py; a primitive not listed here is refused)
complex_ready(
    # this module
    P.conj_physical_p, P.real_p, P.imag_p, P.complex_p, P.view_as_real_p,
    P.view_as_complex_p, sgn_p, angle_p,
    # the course's rules (autograd.py, forward.py), with conj where the formula needs it
    P.neg_p, P.exp_p, P.log_p, P.sin_p, P.cos_p, P.tanh_p, P.sigmoid_p, P.sqrt_p, P.abs_p,
    P.add_p, P.sub_p, P.mul_p, P.div_p, P.pow_p, P.where_p, P.matmul_p,
    P.logsumexp_p,
    # linear and structural: their adjoint needs no conj
    P.sum_p, P.mean_p, P.permute_p, P.reshape_p, P.unsqueeze_p, P.squeeze_p, P.expand_p,
    P.cat_p, P.getitem_p, P.scatter_index_p, P.diagonal_p, P.diagonal_scatter_p,
    P.diag_embed_p, P.gather_p, P.scatter_add_p, P.clone_p, P.to_device_p, P.convert_p,
    P.no_grad_p,
    # nn.py's padding by a constant, linear in x (what fft(x, n) does for n > size), marked
    # here to leave nn.py's hot paths alone
    nn.constant_pad_nd_p,
)
