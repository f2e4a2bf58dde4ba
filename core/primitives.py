"""Primitives: the operations every transform knows how to handle.

NOTE [Primitives are data]
A primitive is a name plus a torch implementation. It knows nothing about derivatives or
batching: each transform keeps its own rule table keyed by primitive, in its own module
(``vjp_rules`` in autograd.py, ``jvp_rules`` in forward.py, ``batching_rules`` in
batching.py), and each rule is registered right under its function. This is JAX's layout
(``ad.primitive_jvps[sin_p] = ...``). To add an operation, add a primitive here and one rule
to each table; ``tests/test_rules_complete.py`` names any rule that is missing.

Tensor arguments are positional; everything static (dims, shapes, flags) is a keyword
parameter, already normalized (dims are tuples of non-negative ints), so that rules and
programs never re-parse user arguments.

NOTE [Shape rules by meta evaluation]
A primitive's shape/dtype rule runs its torch implementation on "meta" tensors: tensors with
a shape and a dtype but no storage. This is how PyTorch itself derives shapes (meta kernels),
it is exact, including broadcasting and type promotion, and it costs no arithmetic.
"""
import torch
from torch.utils._python_dispatch import _disable_current_modes


class Primitive:
    """An operation: a name, a torch implementation and a shape/dtype rule.

    >>> from minifunctorch.core.primitives import sin_p
    >>> import torch
    >>> sin_p.impl(torch.zeros(2))
    tensor([0., 0.])
    >>> sin_p.shape_rule(torch.zeros(3, 2))
    (torch.Size([3, 2]), torch.float32)
    """

    __slots__ = ("name", "impl", "differentiable", "effectful")

    def __init__(self, name, impl, *, differentiable=True, effectful=False):
        self.name = name
        self.impl = impl
        # A non-differentiable primitive (comparisons, ones_like, ...) has outputs whose
        # derivative is zero whatever its inputs: its jvp and vjp rules say so.
        self.differentiable = differentiable
        # An effectful one does more than compute its output (a check that may raise): a
        # program keeps it even where nothing reads its output (passes.eliminate_dead_code).
        self.effectful = effectful

    def shape_rule(self, *args, **params):
        """The (shape, dtype) of the result, from the shapes and dtypes of the arguments."""
        meta_args = [_to_meta(a) for a in args]
        out = self.impl(*meta_args, **params)
        return out.shape, out.dtype

    def __repr__(self):
        return self.name


def _to_meta(value):
    shape = getattr(value, "shape", None)
    if shape is None:
        return value  # a Python number
    return torch.empty(tuple(shape), dtype=value.dtype, device="meta")


PRIMITIVES: dict[str, Primitive] = {}


def primitive(name, impl, *, differentiable=True, effectful=False) -> Primitive:
    """Create and register a built-in primitive."""
    assert name not in PRIMITIVES, f"primitive {name!r} is defined twice"
    prim = Primitive(name, impl, differentiable=differentiable, effectful=effectful)
    PRIMITIVES[name] = prim
    return prim


# --- elementwise, one input ---------------------------------------------------------------
neg_p = primitive("neg", torch.neg)
exp_p = primitive("exp", torch.exp)
log_p = primitive("log", torch.log)
sin_p = primitive("sin", torch.sin)
cos_p = primitive("cos", torch.cos)
tanh_p = primitive("tanh", torch.tanh)
sigmoid_p = primitive("sigmoid", torch.sigmoid)
relu_p = primitive("relu", torch.relu)
abs_p = primitive("abs", torch.abs)
sqrt_p = primitive("sqrt", torch.sqrt)
sign_p = primitive("sign", torch.sign, differentiable=False)

# --- elementwise, two inputs with broadcasting (either may be a Python number) -------------
# NOTE [Number operands as tensors]
# ``b * 1.1`` costs about 4 µs on a small tensor, ``b * c`` about 1.3 µs: torch wraps the number
# in a float64 tensor on every call, then converts it to b's dtype inside the kernel. A 0-d CPU
# tensor of b's dtype that holds the same number is what the kernel then reads, converted the
# same way ahead of time, so the bits are the same; add, sub, mul and div take one, made once
# and kept (``number_tensor``). Only where that holds:
# - the number second (``2 / a`` is Python's reciprocal(a) * 2, and ``pow`` has a kernel of
#   its own for a number exponent): an int, a float or a complex, not a bool;
# - a tensor of float32/64 or complex (half and bfloat16 compute with the number in float32,
#   which a 0-d tensor of their own dtype would round first; an int tensor times a float is
#   a float), complex for a complex number;
# - not zero (the kept ``0.0`` would stand for ``-0.0``, which adds differently); an int in
#   int64's range (torch refuses some larger ones, which a float64 tensor would hold) and,
#   for a float32 result, one that a double holds exactly (a larger one could round twice).
# jit's generated code binds its literals the same way (fast_code.py). In C++ torch.func pays
# nothing for this; a Python engine pays the wrapping on every op of every level.
# The kept tensor is made with torch's function and dispatch modes off: the first use of a
# number may come while a transform's mode is on (a trace computes each op's metadata on meta
# tensors inside the user's function), and a tensor made there would be that mode's value,
# kept for every later call.
NUMBER_TENSOR_DTYPES = frozenset({torch.float32, torch.float64, torch.complex64,
                                  torch.complex128})
_NUMBER_TYPES = (int, float, complex)
_number_tensors: dict = {}  # (number, dtype) -> 0-d CPU tensor, never written to


def number_tensor(number, dtype):
    """The kept 0-d CPU tensor of ``dtype`` holding ``number``, or None where it would not give
    torch's bits (NOTE [Number operands as tensors])."""
    if type(number) not in _NUMBER_TYPES:  # a bool would find the kept 1 and 0
        return None
    key = (number, dtype)
    tensor = _number_tensors.get(key)
    if tensor is None:
        if (dtype not in NUMBER_TENSOR_DTYPES or number == 0
                or (type(number) is complex and not dtype.is_complex)
                or (type(number) is int and not -2 ** 63 <= number < 2 ** 63)
                or (type(number) is int and abs(number) > 2 ** 53
                    and dtype in (torch.float32, torch.complex64))):
            return None
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            tensor = torch.tensor(number, dtype=dtype)
        assert type(tensor) is torch.Tensor, f"a kept number tensor is a {type(tensor)}"
        if len(_number_tensors) >= 1024:  # a loop over many numbers: start again
            _number_tensors.clear()
        _number_tensors[key] = tensor
    return tensor


def _number_second_as_tensor(torch_function):
    """``torch_function(x, y)``, with a number ``y`` passed as its kept 0-d tensor."""
    def impl(x, y, **params):
        if type(y) in _NUMBER_TYPES and not params:
            dtype = getattr(x, "dtype", None)
            y_tensor = _number_tensors.get((y, dtype))  # number_tensor's lookup, written out
            if y_tensor is None:
                y_tensor = number_tensor(y, dtype)
            if y_tensor is not None:
                return torch_function(x, y_tensor)
        return torch_function(x, y, **params)
    impl.__name__ = torch_function.__name__
    return impl


add_p = primitive("add", _number_second_as_tensor(torch.add))
sub_p = primitive("sub", _number_second_as_tensor(torch.sub))
mul_p = primitive("mul", _number_second_as_tensor(torch.mul))
div_p = primitive("div", _number_second_as_tensor(torch.div))
# the primitives whose number operand (the second) may be a kept 0-d tensor
NUMBER_OPERAND_PRIMS = frozenset({add_p, sub_p, mul_p, div_p})
# division that rounds (floor, trunc): its derivative is zero, as derivatives.yaml says
div_rounding_p = primitive(
    "div_rounding", lambda x, y, *, rounding_mode: torch.div(x, y, rounding_mode=rounding_mode),
    differentiable=False)
pow_p = primitive("pow", torch.pow)
eq_p = primitive("eq", torch.eq, differentiable=False)
ne_p = primitive("ne", torch.ne, differentiable=False)
lt_p = primitive("lt", torch.lt, differentiable=False)
le_p = primitive("le", torch.le, differentiable=False)
gt_p = primitive("gt", torch.gt, differentiable=False)
ge_p = primitive("ge", torch.ge, differentiable=False)
where_p = primitive("where", torch.where)

# --- reductions (dim is a tuple of non-negative ints) ---------------------------------------
sum_p = primitive("sum", lambda x, *, dim, keepdim: torch.sum(x, dim, keepdim=keepdim))
mean_p = primitive("mean", lambda x, *, dim, keepdim: torch.mean(x, dim, keepdim=keepdim))
amax_p = primitive("amax", lambda x, *, dim, keepdim: torch.amax(x, dim, keepdim=keepdim))
amin_p = primitive("amin", lambda x, *, dim, keepdim: torch.amin(x, dim, keepdim=keepdim))
logsumexp_p = primitive(
    "logsumexp", lambda x, *, dim, keepdim: torch.logsumexp(x, dim, keepdim=keepdim)
)
softmax_p = primitive("softmax", lambda x, *, dim: torch.softmax(x, dim))
log_softmax_p = primitive("log_softmax", lambda x, *, dim: torch.log_softmax(x, dim))


# NOTE [Softmax derivatives are torch's fused kernels]
# The vjp of softmax and log_softmax is one kernel call in torch (``_softmax_backward_data``,
# ``_log_softmax_backward_data``), of the cotangent and the forward's output. torch.func uses
# these kernels, under vmap too (it moves the batch dims to the front and calls the kernel),
# so rules that call them are bit-exact with it, and each backward is one op at every level
# where the formula written with ops was four. Each kernel is a primitive of its own with its
# own rules, so that second derivatives go through it (derivatives.yaml states the same
# formulas for these two ops).
def softmax_backward(ct, out, *, dim):
    """``out * (ct - sum(ct * out, dim))``, torch's kernel (rounds as torch.func does)."""
    return torch._softmax_backward_data(ct, out, dim, out.dtype)


def log_softmax_backward(ct, out, *, dim):
    """``ct - exp(out) * sum(ct, dim)``, torch's kernel (rounds as torch.func does)."""
    return torch._log_softmax_backward_data(ct, out, dim, out.dtype)


softmax_backward_p = primitive("softmax_backward", softmax_backward)
log_softmax_backward_p = primitive("log_softmax_backward", log_softmax_backward)

# --- linear algebra -------------------------------------------------------------------------
matmul_p = primitive("matmul", torch.matmul)

# --- shape ----------------------------------------------------------------------------------
permute_p = primitive("permute", lambda x, *, dims: x.permute(dims))
reshape_p = primitive("reshape", lambda x, *, shape: x.reshape(shape))
unsqueeze_p = primitive("unsqueeze", lambda x, *, dim: x.unsqueeze(dim))
squeeze_p = primitive("squeeze", lambda x, *, dim: x.squeeze(dim))
expand_p = primitive("expand", lambda x, *, shape: x.expand(shape))
cat_p = primitive("cat", lambda *xs, dim: torch.cat(xs, dim))
# Basic indexing: `index` is a tuple of ints, slices and None (no Ellipsis, no tensors).
getitem_p = primitive("getitem", lambda x, *, index: x[index])


def _scatter_index(x, *, index, shape):
    out = x.new_zeros(shape)
    out[index] = x
    return out


# The transpose of getitem: zeros of `shape`, with x written at `index`.
scatter_index_p = primitive("scatter_index", _scatter_index)
diagonal_p = primitive(
    "diagonal",
    lambda x, *, offset, dim1, dim2: torch.diagonal(x, offset, dim1, dim2),
)
diag_embed_p = primitive(
    "diag_embed",
    lambda x, *, offset, dim1, dim2: torch.diag_embed(x, offset, dim1, dim2),
)
gather_p = primitive("gather", lambda x, index, *, dim: torch.gather(x, dim, index))


def _scatter_add(x, index, *, dim, shape):
    return x.new_zeros(shape).scatter_add_(dim, index, x)


# The transpose of gather: zeros of `shape`, with x summed into the places `index` names.
scatter_add_p = primitive("scatter_add", _scatter_add)

# --- creation and conversion ----------------------------------------------------------------
full_like_p = primitive(
    "full_like",
    lambda x, *, fill_value, dtype=None: torch.full_like(x, fill_value, dtype=dtype),
    differentiable=False,
)
clone_p = primitive("clone", torch.clone)
convert_p = primitive("convert", lambda x, *, dtype: x.to(dtype))
# (a meta tensor, as a shape rule or a trace sees it, stays on meta: only its type matters)
to_device_p = primitive("to_device",
                        lambda x, *, device: x if x.device.type == "meta" else x.to(device))
# Identity whose derivative is zero: `x.detach()` inside a transform (JAX's stop_gradient).
detach_p = primitive("detach", lambda x: x.detach(), differentiable=False)
# Identity that reverse mode does not differentiate and forward mode does: a value computed
# under ``torch.no_grad()`` in a traced function (NOTE [A no_grad region in a traced
# function] in tracing.py). torch.no_grad stops torch's autograd, not its forward AD.
no_grad_p = primitive("no_grad", lambda x: x.detach())


# --- random draws in a traced program (NOTE [Random numbers in a traced program] in tracing.py)
# The callables a draw may name: torch's random functions by name ("torch.bernoulli"), filled
# in by randomness.py; "fill:<name>" for an in-place fill of a fresh tensor; aten ops by their
# own name ("aten.bernoulli.p").
RANDOM_CALLS: dict = {}
# Called with a draw's ``call`` before it draws; each may refuse (randomness.py's: a draw
# that a vmap running around the program would have to follow)
DRAW_GUARDS: list = []
# How a program run on transform values makes a draw (program.evaluate_flat), set by
# randomness.py: through the random function's own rule, which follows the ``randomness`` of a
# vmap running around the program (NOTE [A program's draw under an outer vmap]); until it is
# set, ``bind`` of the recorded call.
draw_in_a_program = None


def aten_op_named(name):
    """``"aten.bernoulli.p"`` -> the aten op of that name (None for another name)."""
    namespace, _, rest = name.partition(".")
    packet_name, _, overload = rest.partition(".")
    if namespace != "aten" or not overload:
        return None
    packet = getattr(torch.ops.aten, packet_name, None)
    return getattr(packet, overload, None) if packet is not None else None


def random_call(name):
    """The callable a draw's ``call`` parameter names."""
    function = RANDOM_CALLS.get(name) or aten_op_named(name)
    assert function is not None, f"no random function is known as {name!r}"
    return function


def draw(*arrays, call, args, kwargs, arrays_at):
    """``call(*args, **kwargs)`` with ``arrays`` put back at the positions ``arrays_at`` of
    ``args``: the same torch call, made anew each time a program runs."""
    for guard in DRAW_GUARDS:
        guard(call)
    args = list(args)
    for position, array in zip(arrays_at, arrays):
        args[position] = array
    return random_call(call)(*args, **dict(kwargs))


# Effectful: each draw advances torch's generator, as the same call in eager mode does, so a
# program keeps every draw, in order, even one whose numbers nothing reads, and never shares
# two (passes.py). Not differentiable: torch declares the derivatives of random numbers zero.
draw_p = primitive("draw", draw, differentiable=False, effectful=True)


# --- complex numbers (their rules: complex_numbers.py) --------------------------------------
conj_physical_p = primitive("conj_physical", torch.conj_physical)
real_p = primitive("real", torch.real)
imag_p = primitive("imag", torch.imag)
sgn_p = primitive("sgn", torch.sgn)
angle_p = primitive("angle", torch.angle)
complex_p = primitive("complex", torch.complex)
view_as_real_p = primitive("view_as_real", torch.view_as_real)
# (contiguous: a rule may hand it a cotangent with any strides; torch wants the last dim dense)
view_as_complex_p = primitive("view_as_complex", lambda x: torch.view_as_complex(x.contiguous()))


def _diagonal_scatter(x, *, offset, dim1, dim2, shape):
    return torch.diagonal_scatter(x.new_zeros(shape), x, offset, dim1, dim2)


# The transpose of diagonal: zeros of `shape`, with x written on the chosen diagonal.
diagonal_scatter_p = primitive("diagonal_scatter", _diagonal_scatter)
