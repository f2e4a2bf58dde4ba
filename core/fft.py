"""The discrete Fourier transforms (``torch.fft``) under vmap, one kernel call per batch.

NOTE [FFTs: batched by their dims, not yet differentiated]
Every ``torch.fft`` function lowers to one of three aten kernels: ``_fft_r2c`` (real input,
complex output: ``rfft``, ``fft`` of a real tensor), ``_fft_c2c`` (complex to complex) and
``_fft_c2r`` (complex input, real output: ``irfft``, ``hfft``). Each transforms the dims its
``dim`` list names and loops over every other dim, so vmap's rule is the one torch.func's
batching rule for them uses: put the batch dim in front and shift ``dim`` by one. One kernel
call then serves the whole batch, where the per-example fallback called it once per example.

Their derivatives need complex cotangents (PyTorch's conjugate Wirtinger convention, see
``fft_r2c_backward`` in FunctionsManual.cpp), which this engine does not implement yet
(NOTE [Complex numbers] in dispatch.py). So a derivative level refuses the complex result,
never a silent zero: ``rfft`` of a value that grad tracks stops there, with the call.
"""
import torch

from . import aten_api
from . import primitives as P
from .autograd import vjp_rules
from .batching import batching_rules, move_bdim
from .errors import UnsupportedOperationError
from .forward import jvp_rules
from .values import bind

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


def fft_rules(prim):
    """Each kernel is linear over the reals, so its jvp applies it to the tangent; its vjp
    is its adjoint, which takes a complex cotangent. The level's own check then refuses the
    complex result with the call in its message (NOTE [Complex numbers])."""
    def vjp(x, **params):
        def backward(ct):
            raise UnsupportedOperationError(
                f"{_KERNELS[prim]}: its backward takes complex cotangents, and derivatives "
                "of complex numbers are not supported yet. Fix: keep the FFT out of the "
                "differentiated function.")
        return bind(prim, x, **params), backward

    def jvp(primals, tangents, **params):
        (x,), (x_dot,) = primals, tangents
        return bind(prim, x, **params), bind(prim, x_dot, **params)
    return vjp, jvp


for _prim in _KERNELS:
    batching_rules[_prim] = fft_batch(_prim)
    vjp_rules[_prim], jvp_rules[_prim] = fft_rules(_prim)


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
