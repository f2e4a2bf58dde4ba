"""vmap over nested tensors (NOTE [vmap over a nested tensor] in core/transforms.py), against
torch.func and against the loop over the components."""
import warnings

import pytest
import torch
import torch.func as tf

import minifunctorch.core as mf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's prototype warnings


def nested(*shapes, layout=torch.strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(*s, generator=g) for s in shapes],
                                      layout=layout)


def assert_same(ours, theirs):
    assert type(ours) is torch.Tensor or ours.is_nested
    assert ours.is_nested == theirs.is_nested
    if ours.is_nested:
        ours, theirs = ours.unbind(), theirs.unbind()
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
    else:
        torch.testing.assert_close(ours, theirs)


def both(f, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mf.vmap(f, **options)(*args), tf.vmap(f, **options)(*args)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_unary(layout):
    x = nested((2, 3), (4, 3), (1, 3), layout=layout)
    ours, theirs = both(lambda x: x.sin() * 5.0 + 4.0, x)
    assert_same(ours, theirs)
    assert ours.layout == torch.strided  # as torch.func's fallback returns it
    for component, example in zip(ours.unbind(), x.unbind()):
        torch.testing.assert_close(component, example.sin() * 5.0 + 4.0)


def test_binary_of_two_nested_tensors():
    x, y = nested((2, 3), (4, 3), seed=1), nested((3, 5), (3, 2), seed=2)
    assert_same(*both(lambda x, y: x @ y, x, y))


@pytest.mark.parametrize("in_dims, y", [
    ((0, None), torch.randn(3, 4)),
    ((0, 0), torch.randn(2, 3, 4)),
    ((0, 1), torch.randn(3, 2, 4)),
], ids=["unbatched", "batched at 0", "batched at 1"])
def test_nested_with_a_dense_input(in_dims, y):
    x = nested((2, 3), (5, 3))
    f = lambda x, y: x * y.sum()  # noqa: E731 (torch.func runs this one for bdim 1)
    assert_same(*both(f, x, y, in_dims=in_dims))
    ours = mf.vmap(lambda x, y: x @ y, in_dims=in_dims)(x, y)
    for i, (component, example) in enumerate(zip(ours.unbind(), x.unbind())):
        y_i = y if in_dims[1] is None else y.select(in_dims[1], i)
        torch.testing.assert_close(component, example @ y_i)


def test_reductions_and_several_outputs():
    x = nested((2, 3), (4, 3))
    assert_same(*both(lambda x: x.sum(), x))
    ours, theirs = both(lambda x: (x.sum(0), x.cos()), x)
    for a, b in zip(ours, theirs):
        assert_same(a, b)


def test_an_output_that_does_not_vary_is_expanded():
    ours, theirs = both(lambda x: torch.ones(3), nested((2, 3), (4, 3)))
    assert not ours.is_nested and ours.shape == (2, 3)
    assert_same(ours, theirs)


def test_the_function_sees_dense_components():
    seen = []
    mf.vmap(lambda x: seen.append((x.is_nested, tuple(x.shape))) or x)(nested((2, 3), (4, 3)))
    assert seen == [(False, (2, 3)), (False, (4, 3))]


def test_cat_of_components():
    x, y = nested((2, 3), (4, 3), seed=3), nested((1, 3), (2, 3), seed=4)
    assert_same(*both(lambda x, y: torch.cat([x, y], 0), x, y))


def test_requires_grad_propagates_through_the_components():
    x = nested((2, 3), (4, 3)).requires_grad_()
    out = mf.vmap(lambda x: x.sin())(x)
    assert out.requires_grad
    out.unbind()[1].sum().backward()
    expected = torch.cat([torch.zeros(2, 3), nested((2, 3), (4, 3)).unbind()[1].cos()])
    torch.testing.assert_close(torch.cat(x.grad.unbind()), expected)


def test_grad_inside_vmap_over_a_nested_tensor():
    # torch.func raises here ("sizes() is not supported for batched nested tensors"); this
    # engine runs each component through grad, which the loop confirms
    x = nested((2, 3), (4, 3))
    ours = mf.vmap(mf.grad(lambda x: x.sin().sum()))(x)
    for component, example in zip(ours.unbind(), x.unbind()):
        torch.testing.assert_close(component, example.cos())


@pytest.mark.parametrize("call, error, message", [
    (lambda x: mf.vmap(lambda x: x, in_dims=1)(x), RuntimeError,
     "Nested tensors can only be vmapped over dim=0"),
    (lambda x: mf.vmap(lambda x: x, out_dims=1)(x), RuntimeError,
     "Nested tensors can only be vmapped over dim=0"),
    (lambda x: mf.vmap(mf.vmap(lambda x: x.sin()))(x), RuntimeError,
     "Only one level of vmap is supported"),
    (lambda x: mf.vmap(lambda x, y: x, in_dims=(0, 0))(x, torch.randn(3, 2)), ValueError,
     "same size in the mapped dimension"),
], ids=["in_dims", "out_dims", "nested vmap", "sizes"])
def test_errors_in_torch_funcs_words(call, error, message):
    # (the exception types torch.func raises in these cases)
    x = nested((2, 3), (4, 3))
    with pytest.raises(error, match=message) as raised:
        call(x)
    assert isinstance(raised.value, mf.TransformError)
    assert "Fix:" in str(raised.value)
    # and the next call works (no level left behind)
    assert_same(*both(lambda x: x * 2, x))


def test_in_place_write_to_a_component_is_refused():
    x = nested((2, 3), (4, 3))
    with pytest.raises(mf.NestedTensorError, match="in-place write"):
        mf.vmap(lambda x: x.mul_(2))(x)
    torch.testing.assert_close(x.unbind()[0], nested((2, 3), (4, 3)).unbind()[0])


def test_elementwise_results_under_vmap_keep_their_payloads_metadata():
    """NOTE [An elementwise result's metadata, from its operand's] (batching.py): the kept
    (shape, dtype, device) of an elementwise result is what its payload says, also where the
    op changes the dtype, the device or (view_as_real) the rank."""
    from minifunctorch.core import Torch
    from minifunctorch.core import primitives as P
    from minifunctorch.core.batching import Batched, BatchedValue

    level = Batched(Torch(), length=3)
    real = BatchedValue(level, torch.randn(2, 3, 4), 1)
    twin = BatchedValue(level, torch.randn(2, 3, 4), 1)
    complex_ = BatchedValue(level, torch.randn(3, 4, dtype=torch.complex64), 0)
    calls = [(P.sin_p, (real,), {}), (P.ge_p, (real, 0.5), {}), (P.mul_p, (real, twin), {}),
             (P.convert_p, (real,), {"dtype": torch.float64}),
             (P.to_device_p, (real,), {"device": torch.device("meta")}),
             (P.view_as_real_p, (complex_,), {})]
    for value in (real, twin, complex_):
        value.metadata()  # known before the op, as under grad
    for prim, args, params in calls:
        out = level.apply(prim, *args, **params)
        fresh = BatchedValue(level, out.payload, out.bdim)
        assert out.metadata() == fresh.metadata(), prim.name
