"""A Jacobian's identity basis computed with by its diagonal under vmap (core/diagonals.py),
checked against torch.func: the same bits where the shortcut is taken, torch.func's NaNs
where it must not be, and the cases that fall back to the dense computation."""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import minifunctorch.core as mf
from minifunctorch.core import diagonals, passes

# torch.func scripts its decompositions on first use (torch deprecates torch.jit.script)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

N = diagonals.MIN_ROWS + 44  # a basis large enough for the shortcut


@pytest.fixture
def shortcuts(monkeypatch):
    """The number of times known_diagonal answered with a diagonal, during the test."""
    taken = []
    known = diagonals.known_diagonal

    def counting(t):
        d = known(t)
        if d is not None:
            taken.append(t.shape)
        return d
    monkeypatch.setattr(diagonals, "known_diagonal", counting)
    return taken


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("activation", [torch.tanh, torch.sigmoid, torch.relu, torch.sin])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_jacfwd_and_tall_jacrev_are_torch_funcs_bits(shortcuts, activation, dtype):
    # jacfwd's basis meets sin (a mul by cos), then a matmul; jacrev's meets the activation's
    # backward kernel (tanh_backward, threshold_backward, ...), then the matmul's pullback
    a = randn(16, N, dtype=dtype) / N ** 0.5
    b = randn(N, 16, seed=1, dtype=dtype) / 4

    def wide(x):
        return activation(a @ torch.sin(x))

    def tall(x):
        return activation(b @ torch.sin(x))
    x_wide, x_tall = randn(N, seed=2, dtype=dtype), randn(16, seed=3, dtype=dtype)
    for jacobian, f, x in ((mf.jacfwd, wide, x_wide), (mf.jacrev, tall, x_tall)):
        ours = jacobian(f)(x)
        theirs = getattr(tf, jacobian.__name__)(f)(x)
        assert type(ours) is torch.Tensor and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()
        # an elementwise op and a matmul by the diagonal
        assert len(shortcuts) == 2, (jacobian.__name__, shortcuts)
        shortcuts.clear()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_matrix_with_inf_or_nan_is_multiplied_densely_as_in_torch_func(shortcuts, bad):
    # 0 * inf is NaN: in the dense product a NaN or inf of the matrix spreads along a column
    a = randn(8, N)
    a[3, 5] = bad

    def f(x):
        return torch.tanh(a @ torch.sin(x))
    x = randn(N, seed=1)
    ours, theirs = mf.jacfwd(f)(x), tf.jacfwd(f)(x)
    assert theirs.isnan().sum() > 1  # (the point of the test: torch.func spreads it)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    # a NaN in the elementwise operand: diag(p(d, y)) would keep the zeros that are NaN
    # in the dense op. (Not inf: then torch.func's matmul pushes inf * m[7] forward as NaN,
    # where torch's own mm of the same dense operands, with or without this shortcut, gives
    # inf; a difference of BLAS paths that this test is not about.)
    y = randn(N, seed=2)
    y[7] = float("nan")
    m = randn(N, 4, seed=3)
    ours, theirs = mf.jacfwd(lambda x: (x * y) @ m)(x), tf.jacfwd(lambda x: (x * y) @ m)(x)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)


def test_a_matrix_is_a_known_diagonal_only_while_nothing_wrote_into_it():
    d = torch.arange(1.0, N + 1)
    matrix = diagonals.diagonal_matrix(d)
    assert torch.equal(matrix, torch.diag(d))
    assert diagonals.known_diagonal(matrix) is d
    matrix.add_(1)  # now dense: 1 off the diagonal
    assert diagonals.known_diagonal(matrix) is None
    eye = passes.identity_basis(N, torch.float32, torch.device("cpu"))
    assert torch.equal(diagonals.known_diagonal(eye), torch.ones(N))
    eye[0, 1] = 2.0
    assert diagonals.known_diagonal(eye) is None
    # an identity that the engine did not make (it may be written later), a small one, a
    # meta tensor: none is read by its diagonal
    assert diagonals.known_diagonal(torch.eye(N)) is None
    assert diagonals.known_diagonal(passes.identity_basis(8, torch.float32, "cpu")) is None
    assert diagonals.known_diagonal(
        passes.identity_basis(N, torch.float32, torch.device("meta"))) is None


def test_operands_that_the_dense_op_refuses_or_promotes_take_the_dense_path(shortcuts):
    x = randn(N)
    a64 = randn(4, N, dtype=torch.float64)
    # torch.func refuses the float64 @ float32 product; so does the dense path here
    with pytest.raises(RuntimeError) as theirs:
        tf.jacfwd(lambda x: a64 @ torch.sin(x))(x)
    with pytest.raises(RuntimeError) as ours:
        mf.jacfwd(lambda x: a64 @ torch.sin(x))(x)
    assert "dtype" in str(ours.value) and "dtype" in str(theirs.value)
    # a float64 vector times the float32 basis promotes to float64, as in torch.func
    y64 = randn(N, seed=1, dtype=torch.float64)
    ours, theirs = mf.jacfwd(lambda x: x * y64)(x), tf.jacfwd(lambda x: x * y64)(x)
    assert ours.dtype == theirs.dtype == torch.float64 and torch.equal(ours, theirs)


def test_under_an_outer_vmap_and_through_a_layer(shortcuts):
    # per-example Jacobians of an MLP's output layer (the basis meets F.linear's pullback)
    w, bias = randn(N, 8) / 3, randn(N, seed=1)

    def f(h):
        return torch.tanh(F.linear(h, w, bias))
    hs = randn(3, 8, seed=2)
    ours, theirs = mf.vmap(mf.jacrev(f))(hs), tf.vmap(tf.jacrev(f))(hs)
    torch.testing.assert_close(ours, theirs)
    ours, theirs = mf.jacrev(f)(hs[0]), tf.jacrev(f)(hs[0])
    torch.testing.assert_close(ours, theirs)
