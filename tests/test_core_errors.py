"""Misuse raises a TransformError subclass whose message names the call, what was expected,
what was got and the fix; and the engine is usable right after (no level left behind)."""
import subprocess
import sys

import pytest
import torch

import minifunctorch.core as mf
from minifunctorch.core import (
    BatchedControlFlowError,
    InPlaceError,
    MissingRuleError,
    NonScalarOutputError,
    Primitive,
    RandomnessError,
    TransformError,
    TransformUsageError,
    UnsupportedOperationError,
    bind,
    vjp_rules,
)
from minifunctorch.core import dispatch
from minifunctorch.core.errors import (
    ArgnumsError,
    DimOutOfRangeError,
    FunctionOutputError,
    RandomnessOptionError,
    TangentsError,
)

# torch.func scripts its decompositions on first use; torch deprecates torch.jit.script
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

x3 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
batch = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)


def check_engine_still_works():
    """The stack holds only the Torch level, and normal transforms run and are right."""
    assert not dispatch.transform_levels(), dispatch.transform_levels()
    torch.testing.assert_close(mf.grad(lambda x: (x.sin() * x).sum())(x3),
                               x3.sin() + x3 * x3.cos())
    torch.testing.assert_close(mf.vmap(lambda x: x.sum())(batch), batch.sum(1))
    torch.testing.assert_close(mf.jvp(torch.exp, (x3,), (torch.ones(3, dtype=torch.float64),)),
                               (x3.exp(), x3.exp()))


def raises(error_type, pattern, function, *args):
    with pytest.raises(error_type, match=pattern) as info:
        function(*args)
    assert isinstance(info.value, TransformError), "every user error is a TransformError"
    check_engine_still_works()
    return info.value


# --- grad ----------------------------------------------------------------------------------------
def test_grad_of_non_scalar_output():
    def f(x):
        return x * 2
    error = raises(NonScalarOutputError,
                   r"^grad\(f\)\(<inputs>\): grad_and_value\(f\)\(\*args\): Expected f\(\*args\) to "
                   r"return a scalar Tensor, "
                   r"got tensor with 1 dims \(shape \(3,\)\).* Fix: .*jacrev.*%%jacobian",
                   mf.grad(f), x3)
    # torch.func raises RuntimeError; a ValueError as before this package followed torch.func
    assert isinstance(error, RuntimeError) and isinstance(error, ValueError)
    raises(NonScalarOutputError, r"^grad\(<lambda>\)\(<inputs>\): grad_and_value\(f\)\(\*args\): "
           r"Expected f\(\*args\) to return a Tensor, got <class 'tuple'>.*Fix:", mf.grad(lambda x: (x.sum(), x.sum())), x3)


def test_grad_of_non_scalar_output_inside_vmap_and_grad():
    raises(NonScalarOutputError, r"^grad\(<lambda>\)\(<inputs>\): .*\(shape \(2,\)\)",
           mf.vmap(mf.grad(lambda x: x[:2])), batch)
    raises(NonScalarOutputError, r"^grad\(<lambda>\)\(<inputs>\): .*\(shape \(3,\)\)",
           mf.grad(lambda x: mf.grad(lambda y: y * x)(x).sum()), x3)


@pytest.mark.parametrize("argnums, shown, bad", [(2, "2", 2), ((0, 5), r"\(0, 5\)", 5),
                                                 (-3, "-3", -3)])
def test_argnums_out_of_range(argnums, shown, bad):
    def f(x, y):
        return (x * y).sum()
    error = raises(ArgnumsError,
                   rf"^grad\(f, argnums={shown}\)\(<inputs>\): Got argnum={bad}, but only 2 "
                   r"positional inputs\. .*Fix: use argnums between -2 and 1\.",
                   mf.grad(f, argnums=argnums), x3, x3)
    # torch.func's type, and still the old one
    assert isinstance(error, RuntimeError) and isinstance(error, TransformUsageError)


def test_argnums_of_the_wrong_type():
    raises(ArgnumsError, r"^grad\(<lambda>, argnums=1\.5\)\(<inputs>\): argnums must be int or "
           r"Tuple\[int, \.\.\.\], got: <class 'float'>\. .*Fix:",
           mf.grad(lambda x: x.sum(), argnums=1.5), x3)
    raises(ArgnumsError, r"^jacrev\(<lambda>\)\(<inputs>\): Got argnum=3, but only 1 positional",
           mf.jacrev(lambda x: x, argnums=3), x3)
    raises(ArgnumsError, r"^grad\(<lambda>, argnums=\(0, 0\)\)\(<inputs>\): argnums elements must "
           r"be unique, got \(0, 0\).*Fix:", mf.grad(lambda x, y: x.sum(), argnums=(0, 0)), x3, x3)


def test_has_aux_without_a_pair():
    raises(FunctionOutputError, r"^grad\(<lambda>\)\(<inputs>\): grad_and_value\(f\)\(\*args\): "
           r"output of function f should be a tuple: \(output, aux\) if has_aux is True.*Fix:",
           mf.grad(lambda x: x.sum(), has_aux=True), x3)


def test_grad_of_a_non_tensor_argument():
    raises(TransformUsageError, r"^grad\(<lambda>\)\(<inputs>\): Thing passed to transform API "
           r"must be Tensor, got <class 'float'>: argument 0 holds a float.*Fix:",
           mf.grad(lambda x: x * 2), 3.0)


# --- vmap ----------------------------------------------------------------------------------------
def test_in_dims_not_matching_the_number_of_inputs():
    def f(x, y):
        return x + y
    raises(TransformUsageError,
           r"^vmap\(f, in_dims=\(0,\)\)\(<inputs>\): in_dims is not compatible with the "
           r"structure of `inputs`.*Fix:",
           mf.vmap(f, in_dims=(0,)), batch, batch)


def test_in_dims_not_matching_the_structure_of_an_input():
    def f(tree):
        return tree["a"]
    raises(TransformUsageError,
           r"^vmap\(f, in_dims=\(\{'b': 0\},\)\)\(<inputs>\): in_dims is not compatible with "
           r"the structure of `inputs`\. in_dims has structure \(\{'b': \*\},\) but inputs has "
           r"structure \(\{'a': \*\},\)\. Fix:",
           mf.vmap(f, in_dims=({"b": 0},)), {"a": batch})
    raises(TransformUsageError,
           r"^vmap\(f, in_dims=\(\(0, 0\),\)\)\(<inputs>\): in_dims is not compatible with the "
           r"structure of `inputs`",
           mf.vmap(f, in_dims=((0, 0),)), batch)


def test_in_dim_out_of_range():
    raises(TransformUsageError, r"^vmap\(<lambda>, in_dims=2\)\(<inputs>\): Got in_dim=2 for some "
           r"input, but that input is a Tensor of dimensionality 2 so expected in_dim to satisfy "
           r"-2 <= in_dim < 2\. The input has shape \(2, 3\)\. Fix: use a dim in \[-2, 1\]",
           mf.vmap(lambda x: x, in_dims=2), batch)


def test_inconsistent_batch_sizes():
    error = raises(TransformUsageError,
                   r"^vmap\(add\)\(<inputs>\): Expected all tensors to have the same size in the "
                   r"mapped dimension, got sizes \[2, 4\] for the mapped dimension: size 2 for "
                   r"input\(s\) \[0\], size 4 for input\(s\) \[1\]\. Fix:",
                   mf.vmap(torch.add), batch, torch.ones(4, 3, dtype=torch.float64))
    assert isinstance(error, ValueError)


def test_vmap_with_no_batched_input():
    raises(TransformUsageError, r"^vmap\(add, in_dims=\(None, None\)\)\(<inputs>\): Expected at "
           r"least one Tensor to vmap over: in_dims is None for every input\. Fix:",
           mf.vmap(torch.add, in_dims=(None, None)), x3, x3)
    # as in torch.func, in_dims=None is not an accepted in_dims at all
    raises(TransformUsageError, r"^vmap\(add, in_dims=None\)\(<inputs>\): expected `in_dims` to be "
           r"int or a \(potentially nested\) tuple .*got: <class 'NoneType'>\. Fix:",
           mf.vmap(torch.add, in_dims=None), x3, x3)


def test_out_dims_errors():
    raises(TransformUsageError,
           r"^vmap\(<lambda>\)\(<inputs>\): out_dims is not compatible with the structure of "
           r"`outputs`\. out_dims has structure \(\*, \*\) but outputs has structure \*\. Fix: give "
           r"one dim per output",
           mf.vmap(lambda x: x, out_dims=(0, 0)), batch)
    raises(TransformUsageError, r"^vmap\(<lambda>\)\(<inputs>\): `<lambda>` can not return a "
           r"BatchedTensor when out_dim is None: .*Fix:",
           mf.vmap(lambda x: x, out_dims=None), batch)
    raises(TransformUsageError, r"^vmap\(<lambda>\)\(<inputs>\): `out_dims` must be an int, None "
           r"or a python collection of ints .*Fix:", mf.vmap(lambda x: x, out_dims="0"), batch)
    error = raises(DimOutOfRangeError, r"^vmap\(<lambda>\)\(<inputs>\): Dimension out of range "
                   r"\(expected to be in range of \[-2, 1\], but got 3\).*Fix:",
                   mf.vmap(lambda x: x, out_dims=3), batch)
    assert isinstance(error, IndexError)


def test_vmap_options_are_checked():
    with pytest.raises(RandomnessOptionError, match=r"randomness='sometimes'\): Only allowed "
                       r"values for randomness are 'error', 'different', or 'same'\. Got "
                       r"sometimes\. Fix:") as info:
        mf.vmap(lambda x: x, randomness="sometimes")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, TransformUsageError)
    with pytest.raises(TransformUsageError, match=r"chunk_size=0\): vmap: chunk_size should be "
                       r"None or greater than 0\. \(got 0\).*Fix: pass a positive int"):
        mf.vmap(lambda x: x, chunk_size=0)
    check_engine_still_works()


def test_python_control_flow_on_a_batched_value():
    def f(x):
        return x if x.sum() > 0 else -x
    error = raises(BatchedControlFlowError, r"^vmap\(f\)\(<inputs>\): .*Python asked for a concrete "
                   r"value \(bool\(\), \.item\(\).*on a value batched by vmap.*Fix: use "
                   r"torch\.where", mf.vmap(f), batch)
    assert isinstance(error, RuntimeError)


def test_item_on_a_batched_value():
    raises(BatchedControlFlowError, r"^vmap\(<lambda>\)\(<inputs>\): .*\.item\(\).* on a value batched by vmap",
           mf.vmap(lambda x: x * x.sum().item()), batch)
    raises(BatchedControlFlowError, r"on a value batched by vmap",
           mf.vmap(lambda x: x * float(x[0])), batch)


def test_control_flow_is_fine_on_unbatched_values_inside_vmap():
    weights = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)

    def f(x):
        return x * weights if weights.sum() > 0 else x  # weights is not batched
    torch.testing.assert_close(mf.vmap(f)(batch), batch * weights)


def test_random_function_inside_vmap_with_randomness_error():
    raises(RandomnessError, r"^vmap\(<lambda>\)\(<inputs>\): vmap: called random operation "
           r"while in randomness error mode\. .* torch\.rand draws random numbers under vmap "
           r"with randomness='error'\. Fix: pass randomness='different'",
           mf.vmap(lambda x: x + torch.rand(3)), batch)
    raises(RandomnessError, r"torch\.randn_like draws random numbers under vmap with "
           r"randomness='error'", mf.vmap(lambda x: x + torch.randn_like(x)), batch)
    # the guards are gone afterwards
    assert torch.rand(2).shape == (2,)


def test_random_function_under_grad_is_a_constant_as_in_torch_func():
    """Random numbers do not depend on the input: under grad they are constants."""
    def f(x):
        return (torch.rand_like(x) * x).sum()
    torch.manual_seed(0)
    ours = mf.grad(f)(x3)
    torch.manual_seed(0)
    torch.testing.assert_close(ours, torch.func.grad(f)(x3))


# --- missing rules and unsupported functions -----------------------------------------------------
@pytest.fixture
def vjp_only_primitive():
    """A primitive with an impl and a vjp rule, and nothing else."""
    double_p = Primitive("double", lambda x: x * 2)
    vjp_rules[double_p] = lambda x: (bind(double_p, x), lambda ct: (mf.ops.mul(ct, 2),))
    yield double_p
    del vjp_rules[double_p]


def test_op_without_a_batching_rule_under_vmap(vjp_only_primitive):
    double_p = vjp_only_primitive
    torch.testing.assert_close(mf.grad(lambda x: bind(double_p, x).sum())(x3),
                               torch.full((3,), 2.0, dtype=torch.float64))
    error = raises(MissingRuleError, r"vmap.*'double' has no batching rule.*custom_vjp",
                   mf.vmap(lambda x: bind(double_p, x)), batch)
    assert isinstance(error, NotImplementedError)
    raises(MissingRuleError, r"jvp.*'double' has no jvp rule.*custom_vjp",
           mf.jvp, lambda x: bind(double_p, x), (x3,), (x3,))


def test_op_without_a_vjp_rule_under_grad():
    triple_p = Primitive("triple", lambda x: x * 3)
    raises(MissingRuleError, r"grad.*'triple' has no vjp rule.*custom_vjp",
           mf.grad(lambda x: bind(triple_p, x).sum()), x3)


@torch.library.custom_op("minifunctorch_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An aten op that no table knows and torch cannot decompose."""
    return x * 2


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_without_rule_or_decomposition_is_refused_by_name():
    error = raises(MissingRuleError, r"^grad\(<lambda>\)\(<inputs>\): minifunctorch_test\.opaque"
                   r"\.default is not supported: it has no grad rule here.*Fix:",
                   mf.grad(lambda x: opaque(x).sum()), x3)
    assert isinstance(error, NotImplementedError)
    raises(MissingRuleError, r"^jvp\(<lambda>\)\(<inputs>\): minifunctorch_test\.opaque",
           mf.jvp, lambda x: opaque(x), (x3,), (x3,))
    # vmap runs it example by example, and says so
    with mf.capture_fallbacks() as used:
        torch.testing.assert_close(mf.vmap(opaque)(batch), batch * 2)
    assert used == {"minifunctorch_test.opaque.default": 1}
    # and the next call works
    torch.testing.assert_close(mf.grad(lambda x: x.sin().sum())(x3), x3.cos())


# --- in-place operations -------------------------------------------------------------------------
def test_in_place_methods_on_values_match_torch_func():
    def f(x):
        y = x * 1
        y.add_(1).mul_(x)
        return y.sum()
    torch.testing.assert_close(mf.grad(f)(x3), torch.func.grad(f)(x3))
    torch.testing.assert_close(mf.vmap(lambda x: (x * 1).mul_(2))(batch), batch * 2)


def test_in_place_writes_to_inputs_reach_the_caller_as_in_torch_func():
    # torch.func's grad refuses an in-place op on its input (a leaf that requires grad); so
    # does this one where a recorded op reads the input (add_'s own add here), and the
    # caller's tensor is left as it was (_refuse_writes_a_tape_reads in core/transforms.py)
    ours = x3.clone()
    raises(mf.UnsupportedOperationError, r"a leaf Variable that requires grad is being used in "
           r"an in-place operation", mf.grad(lambda x: (x.add_(1) ** 2).sum()), ours)
    torch.testing.assert_close(ours, x3)
    # a write that replaces the input before any use reaches the caller
    torch.testing.assert_close(mf.grad(lambda x: (x.copy_(x3 * 2) * 3).sum())(ours),
                               torch.zeros_like(x3))
    torch.testing.assert_close(ours, x3 * 2)
    ours, theirs = batch.clone(), batch.clone()
    torch.testing.assert_close(mf.vmap(lambda x: x.mul_(2), in_dims=1)(ours),
                               torch.func.vmap(lambda x: x.mul_(2), in_dims=1)(theirs))
    torch.testing.assert_close(ours, theirs)


def test_item_assignment_matches_torch_func():
    def f(x):
        y = x.clone()
        y[0] = 1.0
        y[1:] = x[1:] ** 2
        return y.sum()
    torch.testing.assert_close(mf.grad(f)(x3), torch.func.grad(f)(x3))
    torch.testing.assert_close(mf.vmap(mf.grad(f))(batch), torch.func.vmap(torch.func.grad(f))(batch))


def test_writing_a_value_into_a_tensor_created_outside_is_refused():
    outside = torch.zeros(3, dtype=torch.float64)

    def f(x):
        outside[0] = x[0]
        return outside.sum()
    raises(InPlaceError, r"Tensor\.__setitem__\(\.\.\.\): .*this writes a value of a transform "
           r"into a tensor created outside the transform.*Fix:", mf.grad(f), x3)
    assert outside.eq(0).all(), "the outside tensor is untouched"


def test_out_argument_on_a_wrapped_value():
    raises(InPlaceError, r"torch\.sin\(\.\.\., out=\.\.\.\).*Fix:",
           mf.grad(lambda x: torch.sin(x, out=torch.empty(3)).sum()), x3)


# --- jvp and vjp shapes --------------------------------------------------------------------------
def test_jvp_with_mismatched_tangent_shape():
    raises(TangentsError, r"^jvp\(sin\)\(<inputs>\): Trying to set a forward gradient that has a "
           r"different size than that of the original Tensor, this is not supported\. Tensor is "
           r"of size \[3\] while the given forward gradient is of size \[4\]\. Fix:",
           mf.jvp, torch.sin, (x3,), (torch.ones(4, dtype=torch.float64),))


def test_jvp_with_mismatched_structures():
    raises(TangentsError, r"^jvp\(<lambda>\)\(<inputs>\): jvp\(f, primals, tangents\): Expected "
           r"primals and tangents to have "
           r"the same python structure\. .*Got primals with structure \(\*, \*\) and tangents "
           r"with structure \(\*,\)\. Fix:",
           mf.jvp, lambda x, y: x * y, (x3, x3), (x3,))
    error = raises(TangentsError, r"^jvp\(sin\)\(<inputs>\): jvp\(f, primals, tangents\): Expected "
                   r"primals to be a tuple\. E\.g\. "
                   r"it should be valid to call f\(\*primals\)\. Got <class 'torch\.Tensor'>\. Fix:",
                   mf.jvp, torch.sin, x3, x3)
    assert isinstance(error, RuntimeError) and isinstance(error, TransformUsageError)


def test_vjp_fn_with_wrong_cotangent_shape():
    _, vjp_fn = mf.vjp(torch.sin, x3)
    raises(TangentsError, r"^vjp_fn\(cotangents\): Mismatch in shape: grad_output\[0\] has a shape "
           r"of torch\.Size\(\[4\]\) and output\[0\] has a shape of torch\.Size\(\[3\]\)\. Fix:",
           vjp_fn, torch.ones(4, dtype=torch.float64))
    raises(TangentsError, r"^vjp_fn\(cotangents\): Expected pytree structure of cotangents to be "
           r"the same as pytree structure of outputs to the function\. cotangents: \(\*,\), "
           r"primal output: \*\. Fix:", vjp_fn, (torch.ones(3, dtype=torch.float64),))
    # the vjp function still works after misuse
    torch.testing.assert_close(vjp_fn(torch.ones(3, dtype=torch.float64)), (x3.cos(),))


# --- custom_vjp misuse ---------------------------------------------------------------------------
def test_custom_vjp_without_backward_and_with_a_bad_backward():
    @mf.custom_vjp
    def f(x):
        return x * 2
    raises(TransformUsageError, r"^f\(\.\.\.\): this custom_vjp function has no backward yet\. "
           r"Fix: call f\.defvjp", mf.grad(lambda x: f(x).sum()), x3)
    f.defvjp(lambda x: (x * 2, ()), lambda saved, ct: ct * 2)  # not a tuple
    raises(TransformUsageError, r"^f: the custom backward must return a tuple with one "
           r"cotangent per argument \(1\), got", mf.grad(lambda x: f(x).sum()), x3)


# --- the stack after errors ----------------------------------------------------------------------
def test_errors_deep_in_nested_transforms_leave_no_level():
    def inner(x):
        raise ValueError("user code failed")

    for transform in (lambda f: mf.grad(mf.vmap(f)), lambda f: mf.vmap(mf.jacrev(f)),
                      lambda f: mf.jacfwd(mf.grad(f)), lambda f: mf.hessian(f)):
        with pytest.raises(ValueError, match="user code failed"):
            transform(inner)(batch)
        check_engine_still_works()


def test_a_none_output_with_out_dim_none_keeps_the_dims_aligned():
    """None is a leaf when out_dims are matched to outputs, as torch.func counts it."""
    def f(a):
        return None, a * 2
    torch.testing.assert_close(mf.vmap(f, out_dims=(None, 1))(batch)[1],
                               torch.func.vmap(f, out_dims=(None, 1))(batch)[1])
    assert mf.vmap(f, out_dims=(None, 1))(batch)[0] is None
    torch.testing.assert_close(mf.vmap(f, out_dims=(None, 1), chunk_size=1)(batch)[1],
                               batch.T * 2)
