"""The discrete Fourier transforms (``torch.fft``): one kernel call per batch under vmap, and
their derivatives.

NOTE [FFTs: batched by their dims]
Every ``torch.fft`` function lowers to one of three aten kernels: ``_fft_r2c`` (real input,
complex output: ``rfft``, ``fft`` of a real tensor), ``_fft_c2c`` (complex to complex) and
``_fft_c2r`` (complex input, real output: ``irfft``, ``hfft``). Each transforms the dims its
``dim`` list names and loops over every other dim, so vmap's rule is the one torch.func's
batching rule for them uses: put the batch dim in front and shift ``dim`` by one. One kernel
call then serves the whole batch, where the per-example fallback called it once per example.

Their derivatives take complex cotangents (NOTE [Complex numbers] in dispatch.py); the rules
are in NOTE [Derivatives of the FFTs] below.
"""
import torch

from . import aten_api, ops, torch_api
from . import primitives as P
from .autograd import vjp_rules
from .batching import Batched, batching_rules, move_bdim
from .dispatch import complex_ready
from .forward import jvp_rules
from .tensor import runner
from .values import Value, bind, top_dispatcher

aten = torch.ops.aten


def _r2c(x, *, dim, normalization, onesided):
    return aten._fft_r2c(x, list(dim), normalization, onesided)


def _c2c(x, *, dim, normalization, forward):
    return aten._fft_c2c(x, list(dim), normalization, forward)


def _c2r(x, *, dim, normalization, last_dim_size):
    return aten._fft_c2r(x, list(dim), normalization, last_dim_size)


fft_r2c_p = P.primitive("fft_r2c", _r2c)
fft_c2c_p = P.primitive("fft_c2c", _c2c)
fft_c2r_p = P.primitive("fft_c2r", _c2r)
_KERNELS = {fft_r2c_p: "torch.fft (aten._fft_r2c)", fft_c2c_p: "torch.fft (aten._fft_c2c)",
            fft_c2r_p: "torch.fft (aten._fft_c2r)"}


def fft_batch(prim):
    """The batch dim in front, every transformed dim one further back."""
    def rule(values, bdims, *, dim, **params):
        (x,), (bdim,) = values, bdims
        x = move_bdim(x, bdim, 0)
        rank = x.dim() - 1  # one example's rank
        return bind(prim, x, dim=tuple(d % rank + 1 for d in dim), **params), 0
    return rule


# NOTE [Derivatives of the FFTs]
# Each kernel is linear over the reals, so its jvp applies the same kernel to the tangent. Its
# vjp is its adjoint for the real inner product Re(sum(conj(a) * b)), what PyTorch's
# convention asks of a linear map (NOTE [Complex numbers] in dispatch.py); the math is the
# one of ``fft_r2c_backward`` and ``fft_c2r_backward`` in FunctionsManual.cpp:
# - c2c: the DFT matrix F (with its scale 1, 1/sqrt(n) or 1/n) is symmetric, so its adjoint
#   is conj(F): the transform in the other direction, with the same normalization.
# - r2c: a real x gives F x, or its first n//2 + 1 entries along the last dim (onesided).
#   The adjoint puts zeros in the dropped entries, applies conj(F) (a c2c the other way),
#   and keeps the real part, as x is real.
# - c2r: a half spectrum X of m entries gives the real signal of the Hermitian spectrum that
#   X extends; entries 1 .. n - m appear twice in that spectrum (as X[k] and conj(X[k]) at
#   n - k), the others once. The adjoint is an r2c of the real cotangent (the same
#   normalization, the other direction), with those entries doubled.
def _zero_padded(ct, dim, size):
    """``ct`` with zeros after its entries along ``dim``, up to ``size`` entries."""
    shape = list(ops.shape_of(ct))
    if shape[dim] == size:
        return ct
    index = (slice(None),) * dim + (slice(0, shape[dim]),)
    shape[dim] = size
    return bind(P.scatter_index_p, ct, index=index, shape=tuple(shape))


def r2c_vjp(x, *, dim, normalization, onesided):
    x_shape, x_dtype = ops.shape_of(x), x.dtype

    def backward(ct):
        if onesided:
            ct = _zero_padded(ct, dim[-1], x_shape[dim[-1]])
        full = bind(fft_c2c_p, ct, dim=dim, normalization=normalization, forward=False)
        return (ops.convert(ops.real(full), x_dtype),)
    return bind(fft_r2c_p, x, dim=dim, normalization=normalization, onesided=onesided), backward


def c2c_vjp(x, *, dim, normalization, forward):
    return (bind(fft_c2c_p, x, dim=dim, normalization=normalization, forward=forward),
            lambda ct: (bind(fft_c2c_p, ct, dim=dim, normalization=normalization,
                             forward=not forward),))


def c2r_vjp(x, *, dim, normalization, last_dim_size):
    x_shape = ops.shape_of(x)
    last = dim[-1]
    m = x_shape[last]

    def backward(ct):
        half = bind(fft_r2c_p, ct, dim=dim, normalization=normalization, onesided=True)
        twice = last_dim_size - m  # entries 1 .. twice appear twice in the full spectrum
        if twice <= 0:
            return (half,)
        scale = torch.ones(m, dtype=ct.dtype, device=ct.device)
        scale[1:1 + twice] = 2
        scale = scale.reshape((m,) + (1,) * (len(x_shape) - 1 - last))
        return (ops.mul(half, scale),)
    out = bind(fft_c2r_p, x, dim=dim, normalization=normalization, last_dim_size=last_dim_size)
    return out, backward


def _fft_jvp(prim):
    def jvp(primals, tangents, **params):
        (x,), (x_dot,) = primals, tangents
        return bind(prim, x, **params), bind(prim, x_dot, **params)
    return jvp


vjp_rules[fft_r2c_p], vjp_rules[fft_c2c_p], vjp_rules[fft_c2r_p] = r2c_vjp, c2c_vjp, c2r_vjp
for _prim in _KERNELS:
    batching_rules[_prim] = fft_batch(_prim)
    jvp_rules[_prim] = _fft_jvp(_prim)
complex_ready(*_KERNELS)


@aten_api.register(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    return bind(fft_r2c_p, x, dim=tuple(dim), normalization=normalization, onesided=onesided)


@aten_api.register(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    return bind(fft_c2c_p, x, dim=tuple(dim), normalization=normalization, forward=forward)


@aten_api.register(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    return bind(fft_c2r_p, x, dim=tuple(dim), normalization=normalization,
                last_dim_size=last_dim_size)


# NOTE [istft under vmap: example by example]
# torch's istft (a composite of the FFT kernels above) checks the window's overlap-add with
# ``aten.equal`` on numbers it computed from the window: with a window batched by vmap those
# numbers are batched too, and Python cannot read one answer from them. torch.func runs istft
# example by example (its per-example fallback), so that each example makes its own check;
# so does this vmap, and the fallback report lists it. Under grad, jvp, or a vmap with no
# batched value here, torch's composite runs as before (the op declines the call).
@torch_api.register(torch.istft, torch.Tensor.istft)
def istft(x, *args, **kwargs):
    top = top_dispatcher([v for v in (x, *args, *kwargs.values()) if isinstance(v, Value)])
    if not isinstance(top, Batched):
        return NotImplemented
    return top.unknown_op(str(aten.istft.default), runner(torch.istft), [x, *args], kwargs)
