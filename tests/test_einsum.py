"""torch.einsum as one primitive (core/einsum.py, NOTE [einsum is one primitive]): every
transform against torch.func, gradients against finite differences, and the forms that keep
torch's composite."""
import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf
from oracle import central_differences

# (equation, operand shapes): contractions, an outer product, reductions (an index only one
# operand has), three operands, the implicit output (upper case before lower case), a scalar
EQUATIONS = [
    ("ij,kj->ik", [(4, 5), (3, 5)]), ("ij,jk", [(3, 4), (4, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("i,i->", [(4,), (4,)]), ("ij->j", [(3, 4)]),
    ("ij,k->ijk", [(2, 3), (4,)]), ("ijk,ik->j", [(2, 3, 4), (2, 4)]),
    ("Naf,Mbf->NMab", [(2, 3, 5), (4, 3, 5)]), ("ij,ij,ij->i", [(2, 3)] * 3),
    ("i,j->", [(2,), (3,)]), ("bA,Ac", [(2, 3), (3, 4)]), (" ij , jk -> ki ", [(2, 3), (3, 2)]),
    # an ellipsis: letters of its own, right-aligned; implicit output, ellipsis first
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 2)]), ("...ij,jk", [(5, 2, 3), (3, 2)]),
    ("bi...,bj...->bij", [(2, 3, 4), (2, 5, 4)]), ("i...->", [(3, 2, 2)]),
]
# forms that keep torch's composite: a diagonal, a broadcasting size-1 dim (in an ellipsis too)
COMPOSITE = [("ii->i", [(3, 3)]), ("ij,ij->i", [(1, 3), (4, 3)]),
             ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 2)])]


def _operands(shapes, seed, batch=()):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, *shape, dtype=torch.float64, generator=g) for shape in shapes]


def _loss(equation):
    return lambda *xs: torch.einsum(equation, *xs).sin().sum()


@pytest.mark.parametrize("equation, shapes", EQUATIONS + COMPOSITE)
def test_grad_vmap_jvp_and_hessian_match_torch_func(equation, shapes):
    xs = _operands(shapes, seed=1)
    argnums = tuple(range(len(xs)))
    f = _loss(equation)
    torch.testing.assert_close(mf.grad(f, argnums=argnums)(*xs), tf.grad(f, argnums=argnums)(*xs))
    torch.testing.assert_close(mf.hessian(f)(*xs), tf.hessian(f)(*xs))
    tangents = tuple(_operands(shapes, seed=2))
    torch.testing.assert_close(mf.jvp(f, tuple(xs), tangents), tf.jvp(f, tuple(xs), tangents))
    batched = _operands(shapes, seed=3, batch=(3,))
    torch.testing.assert_close(mf.vmap(mf.grad(f, argnums=argnums))(*batched),
                               tf.vmap(tf.grad(f, argnums=argnums))(*batched))
    # one operand batched, the others shared
    in_dims = (0,) + (None,) * (len(xs) - 1)
    torch.testing.assert_close(mf.vmap(f, in_dims=in_dims)(batched[0], *xs[1:]),
                               tf.vmap(f, in_dims=in_dims)(batched[0], *xs[1:]))


@pytest.mark.parametrize("equation, shapes", EQUATIONS[:8])
def test_grad_matches_finite_differences(equation, shapes):
    xs = _operands(shapes, seed=4)
    f = _loss(equation)
    grads = mf.grad(f, argnums=tuple(range(len(xs))))(*xs)
    for k in range(len(xs)):
        torch.testing.assert_close(grads[k], central_differences(f, xs, k), rtol=1e-6,
                                   atol=1e-8)


def test_a_contraction_is_one_op_on_the_tape_and_the_composite_forms_are_not():
    x = torch.randn(4, 5)
    with mf.capture_tapes() as tapes:
        mf.grad(lambda x: torch.einsum("ij,kj->ik", x, x).sum())(x)
    assert [entry.prim.name for entry in tapes[0].entries] == ["einsum", "sum"]
    with mf.capture_tapes() as tapes:
        mf.grad(lambda x: torch.einsum("ij,ij->i", x[:1], x).sum())(x)
    assert "einsum" not in [entry.prim.name for entry in tapes[0].entries]


def test_operands_as_a_list_and_the_sublist_format():
    a, b = _operands([(2, 3), (3, 4)], seed=5)
    f_list = lambda a, b: torch.einsum("ij,jk->ik", [a, b]).sum()  # noqa: E731
    f_sublist = lambda a, b: torch.einsum(a, [0, 1], b, [1, 2], [0, 2]).sum()  # noqa: E731
    for f in (f_list, f_sublist):
        torch.testing.assert_close(mf.grad(f, argnums=(0, 1))(a, b),
                                   tf.grad(f, argnums=(0, 1))(a, b))


def test_complex_and_mixed_dtypes_keep_torchs_composite():
    a = torch.randn(2, 3, dtype=torch.complex128)
    b = torch.randn(3, 2, dtype=torch.complex128)
    f = lambda a: torch.einsum("ij,jk->ik", a, b).abs().sum()  # noqa: E731
    torch.testing.assert_close(mf.grad(f)(a), tf.grad(f)(a))
    c = torch.randn(3, 2, dtype=torch.float32)
    with pytest.raises(RuntimeError):  # torch's own error for mixed dtypes
        mf.grad(lambda a: torch.einsum("ij,jk->ik", a, c).sum())(torch.randn(2, 3).double())


def test_jit_replays_a_program_with_einsum():
    x = _operands([(4, 5)], seed=6)[0]
    f = mf.jit(mf.grad(lambda x: torch.einsum("ij,kj->ik", x, x).sin().sum()))
    expected = tf.grad(lambda x: torch.einsum("ij,kj->ik", x, x).sin().sum())(x)
    torch.testing.assert_close(f(x), expected)
    torch.testing.assert_close(f(x + 1), tf.grad(
        lambda x: torch.einsum("ij,kj->ik", x, x).sin().sum())(x + 1))
