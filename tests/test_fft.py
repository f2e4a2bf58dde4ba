"""torch.fft under vmap: one kernel call for the batch (no per-example fallback), equal to
torch.func; derivatives refused at the complex result, never a silent zero
(NOTE [FFTs: batched by their dims, not yet differentiated] in core/fft.py)."""
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
    lambda f: mf.grad(lambda a: f(a).abs().sum())(REAL[0]),
    lambda f: mf.jvp(lambda a: f(a).abs(), (REAL[0],), (REAL[0],)),
    lambda f: mf.vmap(mf.grad(lambda a: f(a).abs().sum()))(REAL),
], ids=["grad", "jvp", "vmap(grad)"])
def test_derivatives_stop_at_the_complex_result_with_the_call(transform):
    with pytest.raises(TransformError, match=r"^(grad|jvp)\(<lambda>\)\(<inputs>\): fft_r2c "
                                             r"gives a complex result"):
        transform(torch.fft.rfft)
    assert mf.grad(lambda a: (a * 2).sum())(REAL[0]).shape == REAL[0].shape  # still works


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
