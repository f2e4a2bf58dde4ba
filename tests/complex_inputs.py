"""Complex inputs for the complex-derivative tests (test_complex.py, test_complex_tail.py,
test_nn_complex.py): seeded, with real and imaginary parts of order 1."""
import torch


def complex_tensor(shape, seed, dtype):
    """A complex tensor of ``shape`` (complex64 or complex128), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    real_dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    re = torch.randn(shape, generator=g, dtype=real_dtype) * 0.7 + 0.3
    im = torch.randn(shape, generator=g, dtype=real_dtype) * 0.7
    return torch.complex(re, im)


def like(v, seed):
    """A random cotangent or tangent of ``v``'s shape and dtype."""
    if v.dtype.is_complex:
        return complex_tensor(v.shape, seed, v.dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v.shape, generator=g, dtype=v.dtype)


def tolerances(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype in (torch.complex64, torch.float32) else \
        dict(rtol=1e-9, atol=1e-9)
