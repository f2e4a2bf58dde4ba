"""torch.fft under vmap: one kernel call for the batch (no per-example fallback), equal to
torch.func (NOTE [FFTs: batched by their dims] in core/fft.py); and their derivatives, equal
to torch.func's on every function, norm and dim (NOTE [Derivatives of the FFTs])."""
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core.errors import TransformError

g = torch.Generator().manual_seed(0)
REAL = torch.randn(3, 8, 6, generator=g)
COMPLEX = torch.complex(torch.randn(3, 8, 6, generator=g), torch.randn(3, 8, 6, generator=g))

FUNCTIONS = {
    "rfft": torch.fft.rfft,
    "fft of a real tensor, dim=0": lambda a: torch.fft.fft(a, dim=0),
    "fft2": torch.fft.fft2,
    "fftn, negative and positive dims": lambda a: torch.fft.fftn(a, dim=(-1, 0)),
    "rfftn": torch.fft.rfftn,
    "irfft of rfft, n given": lambda a: torch.fft.irfft(torch.fft.rfft(a), n=6),
    "hfft": lambda a: torch.fft.hfft(a.to(torch.complex64)),
    "ihfft": torch.fft.ihfft,
    "ifft, ortho": lambda a: torch.fft.ifft(a, norm="ortho"),
}


@pytest.mark.parametrize("in_dims", [0, 1, -1])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_vmap_over_real_inputs(name, in_dims):
    f = FUNCTIONS[name]
    with mf.capture_fallbacks() as fallbacks:
        ours = mf.vmap(f, in_dims=in_dims)(REAL)
    torch.testing.assert_close(ours, tf.vmap(f, in_dims=in_dims)(REAL))
    assert not fallbacks, dict(fallbacks)


@pytest.mark.parametrize("name, f", [
    ("fft", torch.fft.fft), ("irfft", torch.fft.irfft), ("ifft2", torch.fft.ifft2),
    ("conj, then a product", lambda z: torch.conj(z) * z), ("angle", torch.angle),
    ("conj_physical", torch.conj_physical),
])
def test_vmap_over_complex_inputs(name, f):
    with mf.capture_fallbacks() as fallbacks:
        ours = mf.vmap(f, in_dims=1)(COMPLEX)
    torch.testing.assert_close(ours, tf.vmap(f, in_dims=1)(COMPLEX))
    assert not fallbacks, dict(fallbacks)


@pytest.mark.parametrize("transform", [
    lambda ft, f: ft.grad(lambda a: f(a).abs().sum())(REAL[0]),
    lambda ft, f: ft.jvp(lambda a: f(a).abs(), (REAL[0],), (REAL[0],)),
    lambda ft, f: ft.vmap(ft.grad(lambda a: f(a).abs().sum()))(REAL),
], ids=["grad", "jvp", "vmap(grad)"])
def test_derivatives_through_the_complex_result(transform):
    torch.testing.assert_close(transform(mf, torch.fft.rfft), transform(tf, torch.fft.rfft))


# every torch.fft function, on its inputs' dtypes, under each norm and a few sizes and dims
_NORMS = [None, "forward", "ortho"]
_DIFFERENTIATED = {
    "fft": (torch.fft.fft, {}), "ifft": (torch.fft.ifft, {}),
    "fft n=5 dim=0": (torch.fft.fft, dict(n=5, dim=0)),
    "rfft": (torch.fft.rfft, {}), "rfft n=7": (torch.fft.rfft, dict(n=7)),
    "irfft": (torch.fft.irfft, {}), "irfft n=9": (torch.fft.irfft, dict(n=9)),
    "irfft n=4 dim=0": (torch.fft.irfft, dict(n=4, dim=0)),
    "hfft": (torch.fft.hfft, {}), "hfft n=7": (torch.fft.hfft, dict(n=7)),
    "ihfft": (torch.fft.ihfft, {}),
    "fft2": (torch.fft.fft2, {}), "ifft2": (torch.fft.ifft2, {}),
    "fftn dims (-1, 0)": (torch.fft.fftn, dict(dim=(-1, 0))), "ifftn": (torch.fft.ifftn, {}),
    "rfft2": (torch.fft.rfft2, {}), "irfft2": (torch.fft.irfft2, {}),
    "rfftn s=(4, 5)": (torch.fft.rfftn, dict(s=(4, 5))),
    "irfftn s=(3, 6)": (torch.fft.irfftn, dict(s=(3, 6))),
    "hfft2": (torch.fft.hfft2, {}), "ihfft2": (torch.fft.ihfft2, {}),
    "hfftn": (torch.fft.hfftn, {}), "ihfftn": (torch.fft.ihfftn, {}),
}


def _fft_inputs(name, dtype):
    g = torch.Generator().manual_seed(1)
    real = torch.randn(4, 6, generator=g, dtype=dtype)
    if name.startswith(("rfft", "ihfft")):
        return [real]
    return [real, torch.complex(real, torch.randn(4, 6, generator=g, dtype=dtype))]


@pytest.mark.parametrize("norm", _NORMS, ids=["backward", "forward", "ortho"])
@pytest.mark.parametrize("name", sorted(_DIFFERENTIATED))
def test_vjp_and_jvp_of_every_fft(name, norm):
    fn, kwargs = _DIFFERENTIATED[name]
    f = lambda a: fn(a, norm=norm, **kwargs)  # noqa: E731
    for dtype in (torch.float32, torch.float64):
        for x in _fft_inputs(name, dtype):
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}
            out, vjp_fn = mf.vjp(f, x)
            ref_out, ref_vjp_fn = tf.vjp(f, x)
            ct = torch.randn_like(ref_out)
            (ours,), (theirs,) = vjp_fn(ct), ref_vjp_fn(ct)
            assert ours.dtype == theirs.dtype
            torch.testing.assert_close(ours, theirs, **tol)
            t = torch.randn_like(x)
            torch.testing.assert_close(mf.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)), **tol)


@pytest.mark.parametrize("name", ["rfft", "irfft n=9", "fft2", "hfft", "ihfft2"])
def test_jacrev_jacfwd_and_vmap_of_vjp_of_ffts(name):
    fn, kwargs = _DIFFERENTIATED[name]
    x = _fft_inputs(name, torch.float64)[-1]
    f = lambda a: torch.view_as_real(fn(a, **kwargs)) if fn(a, **kwargs).is_complex() \
        else fn(a, **kwargs)  # noqa: E731
    if not x.is_complex():
        torch.testing.assert_close(mf.jacrev(f)(x), tf.jacrev(f)(x))
        torch.testing.assert_close(mf.jacfwd(f)(x), tf.jacfwd(f)(x))
    xs = torch.stack([x, x * 2, x.flip(0)])
    cts = torch.randn_like(torch.stack([f(x)] * 3))
    vjp_of = lambda ft: lambda a, ct: ft.vjp(f, a)[1](ct)  # noqa: E731
    torch.testing.assert_close(mf.vmap(vjp_of(mf))(xs, cts), tf.vmap(vjp_of(tf))(xs, cts))


def test_hessian_through_an_fft():
    x = REAL[0, 0].double()
    f = lambda a: torch.fft.rfft(a.sin()).abs().pow(2).sum()  # noqa: E731
    torch.testing.assert_close(mf.hessian(f)(x), tf.hessian(f)(x))


def test_a_constant_spectrum_in_a_differentiated_function():
    """A complex value that no transform tracks is a constant: irfft of it is fine."""
    spectrum = torch.fft.rfft(torch.ones(6))
    f = lambda a: (a * torch.fft.irfft(spectrum, n=6)).sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(f)(REAL[0, 0]), tf.grad(f)(REAL[0, 0]))


@pytest.mark.parametrize("f", [torch.angle, torch.conj_physical], ids=["angle", "conj_physical"])
def test_angle_and_conj_physical_of_real_tensors_differentiate_as_torch_func(f):
    x = torch.tensor([-1.5, 0.0, 2.0, -0.25], dtype=torch.float64)
    scalar = lambda a: (f(a) * a).sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(scalar)(x), tf.grad(scalar)(x))
    torch.testing.assert_close(mf.jvp(f, (x,), (x,)), tf.jvp(f, (x,), (x,)))


@pytest.mark.parametrize("window_batched", [False, True])
def test_istft_under_vmap_runs_example_by_example(window_batched):
    # NOTE [istft under vmap: example by example]: torch's istft checks its window with
    # aten.equal, so a batched window needs each example's own call, as in torch.func
    torch.manual_seed(0)
    spectra = torch.randn(3, 6, 5, dtype=torch.complex64)
    windows = torch.rand(3, 10) + 0.5 if window_batched else torch.rand(10) + 0.5
    in_dims = (0, 0 if window_batched else None)
    f = lambda s, w: torch.istft(s, 10, window=w, center=True, onesided=True)  # noqa: E731
    with mf.capture_fallbacks() as used:
        ours = mf.vmap(f, in_dims)(spectra, windows)
    torch.testing.assert_close(ours, tf.vmap(f, in_dims)(spectra, windows))
    assert used.get("aten.istft.default") == 1
    # a window of zeros fails torch's check, example by example
    bad = windows.clone() if window_batched else torch.stack([windows] * 3)
    bad[1] = 0
    with pytest.raises(RuntimeError, match="window overlap add min"):
        mf.vmap(f, (0, 0))(spectra, bad)
    # under grad (inside or outside the vmap) torch's composite runs, differentiably
    loss = lambda s, w: f(s, w).pow(2).sum()  # noqa: E731
    def batch_loss(api):
        return lambda s: api.vmap(f, in_dims)(s, windows).pow(2).sum()
    torch.testing.assert_close(mf.grad(batch_loss(mf))(spectra), tf.grad(batch_loss(tf))(spectra))
    if not window_batched:
        torch.testing.assert_close(mf.vmap(mf.grad(loss), in_dims)(spectra, windows),
                                   tf.vmap(tf.grad(loss), in_dims)(spectra, windows))
