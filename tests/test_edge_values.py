"""Gradients at 0, -0, +-inf and NaN for every op of the table (tests/op_table.py), against
torch.func: the first argument is filled with those values, the others are the table's
samples. Where torch.func raises, we raise a TransformError; otherwise the gradients agree,
NaNs in the same places."""
import functools
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
import torch.func as tf
from op_table import OPS

import minifunctorch.core as mf

SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 0.5]
CASES = [case for case in OPS
         if (args := case.sample()) and isinstance(args[0], torch.Tensor)
         and args[0].is_floating_point() and args[0].numel() > 0]


def special_values(like):
    values = itertools.islice(itertools.cycle(SPECIAL), like.numel())
    return torch.tensor(list(values), dtype=like.dtype).reshape(like.shape)


def _output_and_loss(case, args):
    """A case's function of its first argument (its first output) and a scalar of it (0 for
    an integer output, which has no derivative), the other arguments the sample's."""
    rest = args[1:]

    def f(a):
        out = case.fn(a, *rest)
        return out[0] if isinstance(out, (tuple, list)) else out

    def f_sum(a):
        out = f(a)
        return out.sum() if out.is_floating_point() else out.float().sum() * 0
    return f, f_sum


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_gradient_at_special_values_as_torch_func(case):
    args = case.sample()
    _, f = _output_and_loss(case, args)
    x = special_values(args[0])
    try:
        theirs = tf.grad(f)(x)
    except Exception as error:  # noqa: BLE001 - torch.func refuses: so must we
        with pytest.raises(Exception) as ours:
            mf.grad(f)(x)
        assert isinstance(ours.value, (mf.TransformError, type(error))), ours.value
        return
    ours = mf.grad(f)(x)
    assert type(ours) is torch.Tensor and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, equal_nan=True)


# NOTE [Zero tangents times infinity]
# jvp(f, (x,), (x_dot,)) where f multiplies x by a tensor that has no tangent (a weight f
# closes over): torch's forward-mode formulas take the missing tangent as a zero tensor, and
# for some ops compute its product with the primal anyway, so an inf or nan in x turns that
# term into nan (matmul and linear compute ``x @ 0``; mse_loss ``(x - y) * 0``; mul does not,
# its zero tensor short-cuts). The engine's missing tangents are symbolic zeros (None: the
# docstring of core/forward.py), as in JAX: a term with a missing tangent is not computed,
# and the output's tangent is the derivative along x_dot alone (-inf, or a number, where
# torch.func gives nan). Matching torch would cost one more product per such op in every jvp,
# jacfwd and hvp. (README.md lists this among the differences from torch.func.)
_ZERO_TANGENT_TIMES_INF = ("torch.func computes the missing tangent's term, inf * 0 = nan "
                           "(NOTE [Zero tangents times infinity])")
KNOWN_TANGENTS = {name: _ZERO_TANGENT_TIMES_INF for name in (
    "matmul_1d_2d", "matmul_2d_1d", "matmul_2d_2d", "matmul_batched", "matmul_broadcast_3d_2d",
    "matmul_broadcast_2d_3d", "matmul_broadcast_4d", "matmul_1d_3d", "matmul_3d_1d",
    "matmul_operator", "matmul_outer", "mm", "mv", "bmm", "linear", "linear_no_bias",
    "linear_1d", "linear_3d", "linear_broadcast_bias", "linear_vector_weight", "mse_loss_none",
    "mlp")}


@pytest.mark.parametrize("case", [
    pytest.param(case, id=case.name, marks=pytest.mark.xfail(
        strict=True, reason=KNOWN_TANGENTS[case.name]) if case.name in KNOWN_TANGENTS else ())
    for case in CASES])
def test_tangent_at_special_values_as_torch_func(case):
    """The forward-mode twin of the test above: jvp at 0, -0, +-inf and NaN, where
    derivatives.yaml's jvp formulas are not always the vjp's (x.max()'s ties share by ``==``
    forward and count NaNs as ties backward)."""
    args = case.sample()
    f, _ = _output_and_loss(case, args)
    x = special_values(args[0])
    x_dot = torch.linspace(-1.5, 2.0, x.numel(), dtype=x.dtype).reshape(x.shape)
    try:
        theirs = tf.jvp(f, (x,), (x_dot,))[1]
    except Exception as error:  # noqa: BLE001 - torch.func refuses: so must we
        with pytest.raises(Exception) as ours:
            mf.jvp(f, (x,), (x_dot,))
        assert isinstance(ours.value, (mf.TransformError, type(error))), ours.value
        return
    ours = mf.jvp(f, (x,), (x_dot,))[1]
    assert type(ours) is torch.Tensor and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, equal_nan=True)


# (case, transform) -> reason, for the transforms of the test below
_TORCH_FUNC_IS_NOT_JVP = ("torch.func's vmap of jvp gives nan where its jvp of each example "
                          "gives a number (its batched dot multiplies by a zero tangent: NOTE "
                          "[Zero tangents times infinity]); the engine gives the number")
KNOWN_COMPOSED = {
    **{(name, "jvp_grad"): _ZERO_TANGENT_TIMES_INF
       for name in ("trace_of_product", "mse_loss_sum", "mse_loss_none", "mlp")},
    ("mse_loss", "jvp_grad"): "torch.func raises 'ZeroTensors are immutable' (a torch bug); "
                              "the engine computes the hvp, 2 t / numel",
    ("matmul_1d_1d", "vmap_jvp"): _TORCH_FUNC_IS_NOT_JVP,
    ("dot", "vmap_jvp"): _TORCH_FUNC_IS_NOT_JVP,
}
COMPOSED = ["vmap_grad", "vmap_jvp", "jacrev", "jvp_grad", "grad_grad"]


@pytest.mark.parametrize("case, transform", [
    pytest.param(case, transform, id=f"{case.name}-{transform}", marks=pytest.mark.xfail(
        strict=True, reason=KNOWN_COMPOSED[case.name, transform])
        if (case.name, transform) in KNOWN_COMPOSED else ())
    for case in CASES for transform in COMPOSED
    if not (transform == "vmap_jvp" and case.name in KNOWN_TANGENTS)])
def test_composed_transforms_at_special_values_as_torch_func(case, transform):
    """The two tests above under vmap (three examples: the special values, flipped, and
    ones), as a Jacobian, and as a Hessian-vector product (jvp of grad, and grad of grad),
    where the batching rules and the derivatives of the derivative formulas meet the same
    values."""
    args = case.sample()
    f, f_sum = _output_and_loss(case, args)

    x = special_values(args[0])
    xs = torch.stack([x, x.flip(0) if x.dim() else x, torch.ones_like(x)])
    xs_dot = torch.linspace(-1.5, 2.0, xs.numel(), dtype=x.dtype).reshape(xs.shape)
    runs = {
        "vmap_grad": lambda api: api.vmap(api.grad(f_sum))(xs),
        "vmap_jvp": lambda api: api.vmap(lambda x, t: api.jvp(f, (x,), (t,))[1])(xs, xs_dot),
        "jacrev": lambda api: api.jacrev(f)(x),
        "jvp_grad": lambda api: api.jvp(api.grad(f_sum), (x,), (xs_dot[0],))[1],
        "grad_grad": lambda api: api.grad(lambda x: (api.grad(f_sum)(x) * xs_dot[0]).sum())(x),
    }
    try:
        theirs = runs[transform](tf)
    except Exception as error:  # noqa: BLE001 - torch.func refuses: so must we
        with pytest.raises(Exception) as ours:
            runs[transform](mf)
        assert isinstance(ours.value, (mf.TransformError, type(error))), ours.value
        return
    ours = runs[transform](mf)
    assert type(ours) is torch.Tensor and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("transform", ["forward", "grad"])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_jit_at_special_values_is_eager_bit_for_bit(case, transform):
    """A program replays what eager code computes, at 0, -0, +-inf and nan too: the passes
    keep IEEE arithmetic (NOTE [Zero times infinity] in core/passes.py)."""
    args = case.sample()
    f, f_sum = _output_and_loss(case, args)

    function = f if transform == "forward" else mf.grad(f_sum)
    x = special_values(args[0])
    try:
        eager = function(x)
    except Exception as error:  # noqa: BLE001 - eager code raises: so must the program
        with pytest.raises(Exception) as ours:
            mf.jit(function)(x)
        assert isinstance(ours.value, (mf.TransformError, type(error))), ours.value
        return
    torch.testing.assert_close(mf.jit(function)(x), eager, equal_nan=True, rtol=0, atol=0)


BINARY = {"maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax,
          "fmin": torch.fmin, "atan2": torch.atan2, "hypot": torch.hypot,
          "copysign": torch.copysign, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
          "pow": torch.pow, "xlogy": torch.xlogy, "xlog1py": torch.special.xlog1py,
          "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2,
          "nextafter": torch.nextafter, "fmod": torch.fmod, "remainder": torch.remainder}


@pytest.mark.parametrize("name", list(BINARY))
def test_both_operands_at_special_values_as_torch_func(name):
    # every pair of special values, in both arguments: the vjp of each and the jvp, as
    # torch.func gives them (maximum's vjp gives both inputs the whole cotangent where one is
    # nan, its jvp the second input's tangent: derivatives.yaml's two formulas)
    op = BINARY[name]
    pairs = list(itertools.product(SPECIAL, repeat=2))
    x = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    y = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    x_dot = torch.linspace(-1.5, 2.0, len(pairs), dtype=torch.float64)
    y_dot = torch.linspace(0.25, -3.0, len(pairs), dtype=torch.float64)
    for argnums in (0, 1, (0, 1)):
        ours = mf.grad(lambda x, y: op(x, y).sum(), argnums=argnums)(x, y)
        theirs = tf.grad(lambda x, y: op(x, y).sum(), argnums=argnums)(x, y)
        torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    for tangents in ((x_dot, y_dot), (x_dot, torch.zeros_like(y)), (torch.zeros_like(x), y_dot)):
        ours = mf.jvp(op, (x, y), tangents)[1]
        theirs = tf.jvp(op, (x, y), tangents)[1]
        torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)


ACTIVATIONS = {
    **{name: getattr(torch.nn.functional, name) for name in (
        "elu", "selu", "celu", "gelu", "silu", "softplus", "hardswish", "hardsigmoid",
        "softshrink", "hardshrink", "mish", "logsigmoid", "tanhshrink", "relu", "leaky_relu",
        "softsign", "sigmoid", "tanh")},
    "threshold": lambda x: torch.nn.functional.threshold(x, 0.5, -1.0),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "rrelu_eval": lambda x: torch.nn.functional.rrelu(x, training=False),
    "softplus_beta": lambda x: torch.nn.functional.softplus(x, beta=2.0, threshold=5.0),
}
# (not hardtanh and relu6: at a nan, torch's own kernel gives 0 or 1 depending on whether the
# element falls in a vectorized block or the scalar tail)
# At a nan, torch's own hardswish derivatives (backward and forward-mode) depend on the CPU:
# nan on an AVX2 one (an AMD EPYC), a number on the machines this test ran on before, which
# is what the engine gives everywhere; compared without the nan
NAN_BY_THE_CPU = {"hardswish"}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_at_their_kinks_and_special_values_as_torch_func(name):
    # float64: a slope kept as a float32 number (leaky_relu's 0.01) shows in the 8th digit;
    # the kinks (hardswish at +-3, threshold at its threshold) and nan take torch's side
    f = ACTIVATIONS[name]
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 6.0,
                      -6.0, 0.5, 3.0, -3.0, 20.0, -20.0], dtype=torch.float64)
    if name in NAN_BY_THE_CPU:
        x = x[1:]
    ours, theirs = mf.grad(lambda x: f(x).sum())(x), tf.grad(lambda x: f(x).sum())(x)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    t = torch.linspace(-1, 1, len(x), dtype=torch.float64)
    ours, theirs = mf.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1]
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)


# (mish, logsigmoid, softsign and tanh-approximated gelu differ from torch.func's second
# derivatives in the last bit: their formulas are rounded in another order; hardsigmoid's
# torch.func refuses)
SECOND_ORDER_EXACT = ["elu", "selu", "celu", "softplus", "softplus_beta", "gelu", "silu", "hardswish", "softshrink", "hardshrink", "tanhshrink", "relu",
                      "leaky_relu", "sigmoid", "tanh", "threshold"]


@pytest.mark.parametrize("name", SECOND_ORDER_EXACT)
def test_second_derivatives_at_the_kinks_as_torch_func(name):
    # derivatives.yaml's elu_double_backward and softplus_double_backward are 0 at the kink
    # itself (elu's x = 0, softplus's beta x = threshold: 20, and 2.5 for beta 2 and threshold
    # 5), where the first derivative still takes the curved side. (At a NaN torch's own
    # answer depends on whether the element falls in a vectorized block of the kernel, as
    # for hardtanh: not compared.)
    f = ACTIVATIONS[name]
    x = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 6.0, -6.0, 0.5, 3.0,
                      -3.0, 20.0, -20.0, 2.5], dtype=torch.float64)
    ours, theirs = mf.vmap(mf.grad(mf.grad(f)))(x), tf.vmap(tf.grad(tf.grad(f)))(x)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    ours = mf.hessian(lambda x: f(x).sum())(x)
    torch.testing.assert_close(ours, tf.hessian(lambda x: f(x).sum())(x), equal_nan=True,
                               rtol=0, atol=0)


# --- OpInfo entries at special values (tools/edge_values.py) ---------------------------------
@functools.cache
def _edge_values_tool():
    """tools/edge_values.py as a module, loaded once for all the entries below (running it
    puts tests/ on sys.path and builds its tables)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "edge_values.py"
    spec = importlib.util.spec_from_file_location("edge_values", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The entries whose differences at special values were bugs, fixed (the whole sweep is `make
# edge-values`, docs/EDGE-VALUES.md): prod beside a zero, cumprod at an inf, the margin losses
# at a margin of 0, huber and smooth_l1 at an inf, binary_cross_entropy at 0 and 1, prelu's
# weight at +inf, logcumsumexp of one number, mvlgamma at -0, renorm of a slice with a nan,
# interpolation at an inf or nan (NOTE [Interpolation is a linear kernel and its transpose]).
FIXED_AT_SPECIAL_VALUES = (
    "nn.functional.interpolate.bilinear", "nn.functional.interpolate.bicubic",
    "nn.functional.interpolate.trilinear", "_upsample_bilinear2d_aa",
    "prod", "masked.prod", "nn.functional.multi_margin_loss",
    "nn.functional.multilabel_margin_loss", "nn.functional.huber_loss",
    "nn.functional.smooth_l1_loss", "nn.functional.binary_cross_entropy",
    "nn.functional.prelu", "logcumsumexp", "mvlgamma.mvlgamma_p_1", "mvlgamma.mvlgamma_p_3",
    "renorm")


@pytest.mark.parametrize("entry", FIXED_AT_SPECIAL_VALUES)
def test_opinfo_entry_at_special_values_has_no_unexplained_difference(entry):
    """NOTE [Where torch disagrees with itself at special values] (tools/edge_values.py):
    every difference from torch.func is eager torch's answer or has a written reason."""
    tool = _edge_values_tool()
    rows = tool.sweep([entry], log=None)
    unexplained = [row for row in rows if row[4] in ("unexplained", "refused")]
    assert not unexplained, unexplained
