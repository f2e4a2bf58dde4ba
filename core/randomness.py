"""Random functions under vmap: ``randomness='error' | 'same' | 'different'``.

NOTE [Randomness under vmap]
A random function inside ``vmap`` is ambiguous: should every example get its own numbers, or
share one draw? vmap's ``randomness`` answers, with torch.func's contract:
- ``'error'`` (the default) refuses any random call, with torch.func's wording ("called random
  operation while in randomness error mode");
- ``'same'`` makes one draw for one example and shares it: ``torch.rand(3)`` draws 3 numbers.
  An op whose numbers come from a batched tensor (``torch.bernoulli(p)`` with a batched ``p``)
  has no single draw to share, and is refused;
- ``'different'`` makes ONE draw for the whole batch: ``torch.rand(3)`` is ``torch.rand(B, 3)``
  seen as a batched value, so with the same seed the numbers are bit-equal to torch.func's.
  An unbatched tensor argument is first expanded along a new batch dim (``bernoulli(p)`` draws
  ``B`` samples of ``p``); an in-place fill of an unbatched tensor (``plain.uniform_()``) has no
  room for ``B`` draws, and is refused.
Nested vmaps compose: each level, innermost first, rewrites the call for the level outside it
(a bigger shape, an expanded tensor) and asks that level to make it, so
``vmap(vmap(f, randomness='different'), randomness='different')`` draws ``(B0, B1, *shape)``
at once. With ``chunk_size``, 'different' draws chunk by chunk, and 'same' replays the
generator's state at every chunk, so that every chunk shares the first chunk's draw
(transforms.py). torch.func does this in C++: each vmap interpreter carries a
``RandomnessType`` (Error, Same, Different: ``aten/src/ATen/functorch/Interpreter.h``, read
through ``VmapInterpreterPtr::randomness()``), and the batching rules of
``functorch/BatchRulesRandomness.cpp`` consult it (``check_randomness``, and the factory,
``*_like``, pointwise, multinomial and in-place rules that this file mirrors); the chunks are
``_chunked_vmap`` in ``torch/_functorch/vmap.py``.

How the calls get here: ``torch.rand(3)`` inside a vmapped function receives no wrapped value,
so no FuncTensor sees it; the transform mode does (tensor.py, NOTE [Tensors created inside a
transform]), and it hands every function of ``torch_api.RANDOM_FUNCTIONS`` to ``draw`` before
anything else, plain or batched arguments alike. The table costs other functions nothing (the
mode looks every function up in it once anyway). Each function belongs to a kind with its
own rule: factories (``rand``), ``*_like``, pointwise ops whose numbers come from a tensor
(``bernoulli(p)``, ``poisson``, ``normal(mean, std)``), ``multinomial``, ``randperm``, in-place
fills (``uniform_``) and dropout, which draws its mask with ``bernoulli`` and multiplies.
Python wrappers that draw inside (``F.dropout2d``, ``F.gumbel_softmax``, nn.init's fills) run
with the mode on, so that it sees the draws they make. Random numbers are constants for grad
and jvp (torch declares their derivatives zero), so only the vmap levels take part.
Inside a traced function (jit, trace) the same rules run for the vmaps inside the trace, and
the call they end with at the bottom is recorded as a ``draw`` of the program, made at each
of its calls (NOTE [Random numbers in a traced program] in tracing.py).

Limits. A random aten op called directly on a plain tensor (``torch.ops.aten.bernoulli(t)``)
is no torch function, so the mode never sees it; on a batched value it reaches the back door,
where ``aten_random_op`` gives it the same rule; an in-place fill there
(``empty_like(x).bernoulli_(1 - p)``, how torch's C++ dropout inside
``scaled_dot_product_attention`` draws its mask) gets the in-place rule (``_aten_fill``), and
``aten.native_dropout`` torch's CPU composition. The functional form of an in-place fill
(``torch.ops.aten.uniform(x)``) has no rule in torch.func either: both run it once per example
under 'different', and where torch.func's fallback then ignores 'same' and 'error', this engine
refuses. Dropout follows torch's CPU composition; on CUDA torch uses its fused kernel, so the
masks there are valid draws but not torch.func's numbers.
"""
import types

import torch
import torch.nn.functional as F

from . import aten_api, batching, pytree
from . import primitives as P
from . import tensor as tensor_module
from .batching import Batched, BatchedValue, move_bdim
from .dispatch import transform_levels
from .errors import InPlaceError, RandomnessError, UnsupportedOperationError
from .ops import expand, getitem, reshape, stack
from .tensor import FuncTensor, _write, as_tensor, as_tensors, unwrap, user_code
from .torch_api import RANDOM_FUNCTIONS
from .values import Value, bind

# torch.func's own wording, which the messages give right after the call (people search for
# it; NOTE [Messages: the call, torch.func's words, the cause, the fix] in
# transforms.py)
ERROR_MODE = ("vmap: called random operation while in randomness error mode. Please either use "
              "the 'same' or 'different' randomness flags on vmap or perform the randomness "
              "operation out of vmap")
SAME_BATCHED = "Vmap does not currently support same randomness with a batched tensor input."
INPLACE_UNBATCHED = ("vmap: Cannot ask for different inplace randomness on an unbatched tensor. "
                     "This will appear like same randomness.")
OUT_VARIANT = ("vmap: We do not support calling out variants of random operations inside of vmap. "
               "Please use non-out variants as a workaround")


def draw(func, args, kwargs):
    """A random function called while a transform runs user code (the transform mode hands
    it over): its numbers, following the ``randomness`` of every vmap level running. Returns
    NotImplemented when no vmap is running (the mode then treats it as any other function).

    >>> import torch
    >>> from minifunctorch.core import vmap
    >>> _ = torch.manual_seed(0)
    >>> drawn = vmap(lambda x: x + torch.rand(2), randomness="different")(torch.zeros(3, 2))
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(drawn, torch.rand(3, 2))     # one draw of shape (3, 2)
    True
    >>> _ = torch.manual_seed(0)
    >>> shared = vmap(lambda x: x + torch.rand(2), randomness="same")(torch.zeros(3, 2))
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(shared, torch.rand(2).expand(3, 2))   # one draw, shared
    True
    """
    recording = _recording()
    levels = _levels_followed(recording)
    if recording is None and not levels:
        return NotImplemented
    kind, name = _KINDS[func]
    if kwargs.get("out") is not None:
        raise InPlaceError(
            f"{levels[-1].call}: {OUT_VARIANT}. {name}(..., out=...) would write random "
            "numbers into a tensor of its own. Fix: use the returned value "
            f"(y = {name}(...)), and copy it where needed."
        )
    return kind(levels, func, name, args, dict(kwargs))


# --- helpers ---------------------------------------------------------------------------------
def _name(func):
    return torch.overrides.resolve_name(func) or getattr(func, "__qualname__", str(func))


def _at(level, value):
    """``value`` seen by ``level``'s rule: (its payload with the batch dim in front, True), or
    (the value itself, False) when it is the same for every example of ``level``. Values of
    the levels above (grad, jvp) are lowered: random numbers are constants for them."""
    value = _down_to(level, value)
    if isinstance(value, BatchedValue) and value.dispatcher is level:
        return move_bdim(value.payload, value.bdim, 0), True
    return value, False


def _batched(level, value):
    """A draw with the batch in front, as a value of ``level``."""
    return level.wrap_input(value, 0)


def _with_batch(level, value):
    """An unbatched tensor broadcast along a new front batch dim (torch.func's expand)."""
    return expand(value, level.length, *value.shape)


def _plain(value):
    """The tensor under a value of a level that is not vmap's (a constant for random ops)."""
    value = unwrap(value)
    while isinstance(value, Value):
        value = value.dispatcher.lower(value)
    return value


def _bottom(func, args, kwargs):
    """``func`` below every vmap level: torch's own call (a grad or jvp level still running
    sees it through its FuncTensor, and keeps the numbers as constants). While a program is
    recorded, a call on tensors it does not trace is recorded as a draw (NOTE [Random numbers
    in a traced program] in tracing.py); one on traced values reaches the trace through the
    back door, as a random aten op."""
    recording = _recording()
    if recording is not None and not any(
            isinstance(unwrap(leaf), Value) for leaf in pytree.tree_leaves((args, kwargs))):
        return recording.record_draw(_name(func), tuple(unwrap(a) for a in args), kwargs)
    return unwrap(func(*as_tensors(args), **as_tensors(kwargs)))


def _recording():
    """The level recording a traced program, if one runs (NOTE [Random numbers in a traced
    program] in tracing.py), else None."""
    return next((level for level in reversed(transform_levels())
                 if level.records_a_program), None)


def _check(level, name, batched=False):
    """torch.func's check_randomness: 'error' refuses, and 'same' refuses a batched input."""
    if level.randomness == "error":
        raise RandomnessError(
            f"{level.call}: {ERROR_MODE}. {name} draws random numbers under vmap with "
            "randomness='error'. Fix: pass randomness='different' (independent draws per "
            "example) or 'same' (one draw shared by the batch) to vmap, or draw the random "
            "numbers outside of vmap."
        )
    if batched and level.randomness == "same":
        raise RandomnessError(
            f"{level.call}: {SAME_BATCHED} {name} got a tensor that varies over the batch "
            "under randomness='same', so there is no single draw to share. Fix: pass "
            f"randomness='different', or give {name} a tensor that is the same for every "
            "example."
        )


# --- factories: torch.rand(2, 3), torch.randint(10, (2, 3)), torch.normal(0., 1., (2, 3)) -----
def _split_size(func, args, kwargs):
    """(arguments before the size, the size) of a factory call; the size is taken out (and
    given back as ``size=``, which every overload accepts)."""
    if "size" in kwargs:
        return tuple(args), tuple(kwargs.pop("size"))
    if func in (torch.rand, torch.randn):
        if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
            return (), tuple(args[0])
        return (), tuple(args)
    return tuple(args[:-1]), tuple(args[-1])  # randint(high, size), normal(mean, std, size)


def _factory(levels, func, name, args, kwargs):
    front, size = _split_size(func, args, kwargs)
    return _factory_at(levels, func, name, front, size, kwargs)


def _factory_at(levels, func, name, front, size, kwargs):
    if not levels:
        return _bottom(func, front, dict(kwargs, size=size))
    level, outer = levels[-1], levels[:-1]
    _check(level, name)
    if level.randomness == "same":
        return _factory_at(outer, func, name, front, size, kwargs)
    return _batched(level, _factory_at(outer, func, name, front, (level.length, *size), kwargs))


def _normal(levels, func, name, args, kwargs):
    """torch.normal's overloads: floats and a size (a factory), or tensor mean and/or std."""
    mean = args[0] if args else kwargs.pop("mean")
    std = args[1] if len(args) > 1 else kwargs.pop("std", 1.0)
    rest = tuple(args[2:])
    mean_is_tensor, std_is_tensor = isinstance(mean, torch.Tensor), isinstance(std, torch.Tensor)
    if not mean_is_tensor and not std_is_tensor:
        if not rest and "size" not in kwargs:
            return NotImplemented  # normal(0., 1.) without a size: torch's own error
        return _factory(levels, func, name, (mean, std, *rest), kwargs)
    if mean_is_tensor and std_is_tensor:
        return _binary_pointwise(levels, func, name, mean, std, rest, kwargs)
    position = 0 if mean_is_tensor else 1
    return _pointwise(levels, func, name, (mean, std, *rest), kwargs, position)


def _randperm(levels, func, name, args, kwargs):
    if not levels:
        return _bottom(func, args, kwargs)
    level, outer = levels[-1], levels[:-1]
    _check(level, name)
    if level.randomness == "same":
        return _randperm(outer, func, name, args, kwargs)
    # a permutation cannot be drawn for a batch at once: one draw per example, as torch.func
    return _batched(level, stack([_randperm(outer, func, name, args, kwargs)
                                  for _ in range(level.length)], 0))


# --- *_like: only the shape of the tensor matters ---------------------------------------------
def _like(levels, func, name, args, kwargs):
    if not args:
        args = (kwargs.pop("input"),)
    return _like_at(levels, func, name, tuple(args), kwargs)


def _like_at(levels, func, name, args, kwargs):
    if not levels:
        return _bottom(func, args, kwargs)
    level, outer = levels[-1], levels[:-1]
    _check(level, name)
    x, batched = _at(level, args[0])
    if level.randomness == "same":
        if batched:
            x = getitem(x, 0)  # the shape of one example
        return _like_at(outer, func, name, (x, *args[1:]), kwargs)
    if not batched:
        x = _with_batch(level, x)
    return _batched(level, _like_at(outer, func, name, (x, *args[1:]), kwargs))


# --- pointwise ops whose numbers come from a tensor: bernoulli(p), poisson, normal ------------
def _unary(levels, func, name, args, kwargs):
    if not args:
        args = (kwargs.pop("input"),)
    return _pointwise(levels, func, name, tuple(args), kwargs, 0)


def _pointwise(levels, func, name, args, kwargs, position):
    if not levels:
        return _bottom(func, args, kwargs)
    level, outer = levels[-1], levels[:-1]
    x, batched = _at(level, args[position])
    _check(level, name, batched)
    if level.randomness == "different" and not batched:
        x = _with_batch(level, x)
    args = (*args[:position], x, *args[position + 1:])
    out = _pointwise(outer, func, name, args, kwargs, position)
    return out if level.randomness == "same" else _batched(level, out)


def _binary_pointwise(levels, func, name, first, second, rest, kwargs):
    """normal(mean, std) and binomial(count, prob) with two tensors: 'different' expands the
    first one when it is not batched; the batched ones get their batch dims in front, and
    the same number of example dims."""
    if not levels:
        return _bottom(func, (first, second, *rest), kwargs)
    level, outer = levels[-1], levels[:-1]
    first, first_batched = _at(level, first)
    second, second_batched = _at(level, second)
    _check(level, name, first_batched or second_batched)
    if level.randomness == "same":
        return _binary_pointwise(outer, func, name, first, second, rest, kwargs)
    if not first_batched:  # (as torch.func: torch's draws follow the first one's layout)
        first, first_batched = _with_batch(level, first), True
    rank = max(first.dim() - first_batched, second.dim() - second_batched)
    first, second = (_padded(v, rank) if batched else v
                     for v, batched in ((first, first_batched), (second, second_batched)))
    return _batched(level, _binary_pointwise(outer, func, name, first, second, rest, kwargs))


def _padded(value, rank):
    """A value with its batch dim in front, given ``rank`` example dims (1s after the batch
    dim), so that it lines up with another operand as torch broadcasts."""
    missing = rank + 1 - value.dim()
    return value if missing <= 0 else reshape(value, value.shape[0], *[1] * missing,
                                              *value.shape[1:])


def _binomial(levels, func, name, args, kwargs):
    count = args[0] if args else kwargs.pop("count")
    prob = args[1] if len(args) > 1 else kwargs.pop("prob")
    return _binary_pointwise(levels, func, name, count, prob, tuple(args[2:]), kwargs)


def _refused(levels, func, name, args, kwargs):
    """rrelu draws its slopes inside one aten op that torch.func has no rule for (and that a
    program could not record as a draw: its result depends on the input)."""
    if not levels:  # (draw hands it over with no vmap only while a program is recorded)
        training = args[3] if len(args) > 3 else kwargs.get("training", False)
        if not training:
            return NotImplemented  # eval mode draws nothing: a fixed slope
        raise UnsupportedOperationError(
            f"{_recording().call}: {name} draws random slopes inside one aten op, which a "
            "traced program cannot record apart from the input it multiplies. Fix: use "
            "F.leaky_relu with a fixed slope, rrelu in eval mode (training=False), or call "
            "it outside jit.")
    raise RandomnessError(
        f"{levels[-1].call}: vmap: we do not yet support aten::rrelu. {name} draws random "
        "slopes (and torch.func refuses it under vmap even in eval mode). Fix: use "
        "F.leaky_relu with a fixed slope, or call rrelu outside of vmap."
    )


def _multinomial(levels, func, name, args, kwargs):
    if not levels:
        return _bottom(func, args, kwargs)
    level, outer = levels[-1], levels[:-1]
    probs, batched = _at(level, args[0] if args else kwargs.pop("input"))
    args = args[1:] if args else ()
    _check(level, name, batched)
    if level.randomness == "same":
        return _multinomial(outer, func, name, (probs, *args), kwargs)
    rows = probs.dim() - batched == 2  # (B, M, S) draws as (B * M, S)
    if not batched:
        probs = _with_batch(level, probs)
    if rows:
        probs = reshape(probs, -1, probs.shape[-1])
    out = _multinomial(outer, func, name, (probs, *args), kwargs)
    if rows:
        out = reshape(out, level.length, -1, out.shape[-1])
    return _batched(level, out)


# --- in-place fills: x.uniform_(), x.bernoulli_(p), ... --------------------------------------
def _in_place(levels, func, name, args, kwargs):
    target, extra = args[0], tuple(args[1:])
    new_value = _fill(levels, func, name, unwrap(target), extra, kwargs)
    if type(target) is FuncTensor:
        return _write(target, new_value, f"{name}(...)")
    if isinstance(new_value, Value):
        return _write(target, new_value, f"{name}(...)")  # refuses, with the engine's message
    return torch.Tensor.copy_(target, new_value)


def _fill(levels, func, name, x, extra, kwargs):
    """The new value of ``x`` after the in-place fill ``func`` (computed on a fresh tensor
    with ``x``'s strides, so that the numbers land where torch.func's in-place fill puts
    them)."""
    if not levels:
        recording = _recording()
        if recording is not None:  # NOTE [Random numbers in a traced program]
            return _recorded_fill(recording, func, x, extra, kwargs)
        x = _plain(x)
        fresh = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        func(fresh, *[_plain(e) for e in extra], **kwargs)
        return fresh
    level, outer = levels[-1], levels[:-1]
    x, batched = _at(level, x)
    p, p_batched = (_at(level, extra[0]) if extra and isinstance(extra[0], (torch.Tensor, Value))
                    else (None, False))
    _check(level, name, p_batched)
    if p_batched and not batched:
        raise InPlaceError(
            f"{level.call}: vmap: inplace bernoulli(self, *extra_args) is not possible because "
            "there exists a Tensor `other` in extra_args that has more elements than `self`. "
            f"{name} writes a draw from a batched p into a tensor that is the same for every "
            "example. Fix: use the out-of-place torch.bernoulli(p)."
        )
    if level.randomness == "different" and not batched:
        raise RandomnessError(
            f"{level.call}: {INPLACE_UNBATCHED} {name} fills a tensor that is the same for "
            "every example, which cannot hold a draw per example. Fix: fill a batched tensor "
            "(torch.empty_like of a batched input), use an out-of-place random function, or "
            "pass randomness='same'."
        )
    if p is not None:
        if p_batched:  # p's example dims lined up with x's
            p = _padded(p, x.dim() - batched)
        extra = (p, *extra[1:])
    if level.randomness == "same" and batched:
        # one draw of one example's shape, written into every example
        shape = x.shape[1:]
        return _fill(outer, func, name, torch.empty(shape, dtype=x.dtype, device=x.device),
                     extra, kwargs)
    out = _fill(outer, func, name, x, extra, kwargs)
    return _batched(level, out) if batched else out


def _recorded_fill(recording, func, x, extra, kwargs):
    """An in-place fill while a program is recorded: a draw that fills a fresh tensor of x's
    shape (contiguous where x is a traced value), made anew at each call of the program."""
    x = _down_to(recording, x)
    if isinstance(x, Value):
        shape, dtype, device = x.metadata()
        stride = torch.empty(shape, device="meta").stride()
    else:
        shape, stride, dtype, device = x.shape, x.stride(), x.dtype, x.device
    extra = tuple(_down_to(recording, e) for e in extra)
    return recording.record_draw(f"fill:{_name(func)}", (tuple(shape), stride, *extra),
                                 dict(kwargs, dtype=dtype, device=device))


def _down_to(level, value):
    """``value`` seen by ``level``: the values of the levels above it lowered (random numbers
    are constants for grad and jvp)."""
    value = unwrap(value)
    while isinstance(value, Value) and value.dispatcher.level > level.level:
        value = value.dispatcher.lower(value)
    return value


def _fresh_fill(function):
    """The callable of a recorded fill: a fresh tensor, filled by ``function``."""
    def fill(shape, stride, *extra, dtype, device, **kwargs):
        fresh = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        function(fresh, *extra, **kwargs)
        return fresh
    return fill


def _aten_fill(func, target, *extra, **kwargs):
    """An in-place random aten op at the back door under vmap: torch's own C++ draws masks
    this way (``empty_like(x).bernoulli_(1 - p)`` in CPU dropout, and so in
    ``scaled_dot_product_attention`` and multi-head attention). Its functional overload
    (``bernoulli.p``) would read the tensor as probabilities, and refuse a batched one under
    'same'; torch.func gives it the in-place rule, which this is: one draw of one example's
    shape under 'same', a draw per example under 'different'. Outside vmap the functional
    overload runs (NotImplemented)."""
    levels = _levels_followed(_recording())
    if not levels:
        return NotImplemented
    return _fill(levels, func, str(func), target, extra, kwargs)


def _register_aten_fills():
    aten = torch.ops.aten
    for op in (aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default,
               aten.normal_.default, aten.random_.default, aten.random_.to,
               getattr(aten.random_, "from"),  # (a Python keyword)
               aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default,
               aten.cauchy_.default):
        aten_api.IN_PLACE_ONLY[op] = _aten_fill


# --- dropout: a bernoulli mask, then arithmetic -------------------------------------------------
_ALPHA = 1.7580993408473766  # SELU's alpha, which alpha dropout keeps the statistics of


def _dropout_kind(feature, alpha, in_place):
    """torch.dropout & co. (what F.dropout calls), as torch composes them on the CPU: a
    bernoulli mask drawn for one example's shape (or its feature shape), scaled, multiplied
    in; alpha dropout also shifts. Only the mask's draw follows the randomness mode, so
    'same' works on a batched input (one mask for all)."""
    def kind(levels, func, name, args, kwargs):
        positional = dict(zip(("input", "p", "train"), args), **kwargs)
        x, p, train = positional["input"], positional["p"], positional["train"]
        if (not train or p == 0) and 0 <= p <= 1:
            return x  # torch returns the input itself (an eval-mode nn.Dropout costs nothing)
        if not 0 < p < 1 or x.numel() == 0 or (feature and x.dim() < 2):
            return NotImplemented  # no numbers are drawn (or torch reports the argument)
        shape = (x.shape[0], x.shape[1], *[1] * (x.dim() - 2)) if feature else x.shape
        # bernoulli(base, p) reads only base's shape, dtype and device: one zero, expanded,
        # holds no memory of that shape (nor does a program that records the draw)
        base = torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)
        noise = as_tensor(_pointwise(levels, torch.bernoulli, name, (base, 1 - p), {}, 0))
        with user_code():  # the arithmetic goes through the engine like user code
            if alpha:
                a = 1.0 / ((_ALPHA * _ALPHA * p + 1) * (1 - p)) ** 0.5
                shift = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
                noise.mul_(a)
                out = x.mul_(noise) if in_place else x.mul(noise)
                return out.add_(shift)
            noise.div_(1 - p)
            return x.mul_(noise) if in_place else x.mul(noise)
    return kind


@aten_api.register(torch.ops.aten.native_dropout.default)
def native_dropout(x, p, train):
    """``aten.native_dropout`` (where torch's decompositions and C++ code lower dropout) as
    torch's CPU kernel computes it: a mask drawn with ``bernoulli_`` on an empty tensor like
    the input, then ``input * mask * (1 / (1 - p))``, and the mask as booleans. The draw is
    the front door's in-place fill, so under vmap it follows ``randomness`` as F.dropout does
    (torch._decomp's version compares ``rand_like`` with p: other numbers than torch's)."""
    with user_code():
        x = as_tensor(x)
        if train is False:
            return unwrap(x.clone()), unwrap(torch.ones_like(x, dtype=torch.bool))
        mask = torch.empty_like(x).bernoulli_(1 - p)
        out = x.mul(mask).mul(0.0 if p == 1 else 1 / (1 - p))
        return unwrap(out), unwrap(mask.to(torch.bool))


def _functional_body(func):
    """``F.dropout2d`` & co. (and nn.init's fills) without their own torch-function check, so
    that the transform mode sees the ``torch.feature_dropout`` or ``Tensor.uniform_`` they
    call: while the mode handles a call it is off, and would miss every call made inside."""
    module_globals = dict(func.__globals__, has_torch_function_unary=lambda *a: False,
                          torch=_TorchWithoutChecks())
    body = types.FunctionType(func.__code__, module_globals, func.__name__, func.__defaults__)
    body.__kwdefaults__ = func.__kwdefaults__

    def kind(levels, func, name, args, kwargs):
        with user_code():
            return body(*args, **kwargs)
    return kind


class _TorchWithoutChecks:
    """``torch`` as seen by a function body above, whose ``torch.overrides`` check finds no
    torch function to call (nn.init asks ``torch.overrides.has_torch_function_variadic``)."""
    overrides = types.SimpleNamespace(has_torch_function_variadic=lambda *a: False)

    def __getattr__(self, name):
        return getattr(torch, name)


# --- the back door: random aten ops on batched values -------------------------------------------
def aten_random_op(level, name, values, kwargs):
    """A random aten op that reached the back door with a value of vmap ``level``
    (``torch.ops.aten.bernoulli(x)``, or an op inside a decomposition): the front door's rule
    for it, or NotImplemented for an op without one (``Batched.random_op`` then runs it once
    per example, or refuses). As at the front door, every vmap running takes part, the ones
    inside ``level`` too (for them the value is the same for every example). No engine code
    of an inner vmap reaches here with an op of this table: its per-example loop runs only
    the ops that have no rule here."""
    entry = _ATEN_KINDS.get(name)
    levels = [other for other in transform_levels() if isinstance(other, Batched)]
    if entry is None or level not in levels:  # (a Batched level of the explicit API)
        return NotImplemented
    kind, op = entry
    return kind(levels, op, name, as_tensors(tuple(values)), dict(as_tensors(kwargs)))


def batched_random_op(level, name, run, values, kwargs):
    """``Batched.random_op``: a random aten op on values of vmap ``level``. Its draws follow
    vmap's ``randomness``: the front door's rule where there is one, else independent draws
    per example ('different'), or a refusal."""
    drawn = aten_random_op(level, name, values, kwargs)
    if drawn is not NotImplemented:
        return drawn
    if level.randomness == "different":
        return level.unknown_op(name, run, values, kwargs)  # independent draws per example
    if level.randomness == "error":
        raise RandomnessError(
            f"{level.call}: {ERROR_MODE}. The random operation {name} was called under "
            "vmap with randomness='error'. Fix: pass randomness='different' (independent "
            "draws per example) to vmap, or draw the random numbers outside of vmap."
        )
    raise RandomnessError(
        f"{level.call}: {SAME_BATCHED} The random operation {name} on a batched value is "
        "not supported with randomness='same'. Fix: pass randomness='different', or draw "
        "the random numbers outside of vmap."
    )


batching.random_op_rule = batched_random_op


def _draw_in_a_program(arrays, params):
    """NOTE [A program's draw under an outer vmap]
    A program records a random call as one ``draw`` of the shapes it saw
    (NOTE [Random numbers in a traced program] in tracing.py): ``vmap(jit(f))`` traces f for
    one example, so its draw is one example's. Run on the values of a vmap outside the
    trace, the draw is the random function's call again, handed to that function's rule
    here as the transform mode hands an eager call: it follows vmap's ``randomness``, and
    with the same seed gives the numbers of ``vmap(f)`` itself (dropout's mask is a
    ``bernoulli`` draw; 'different' draws every example's at once). A random aten op
    (``torch.bernoulli(p)`` of a traced ``p`` is recorded as ``aten.bernoulli.default``) takes
    the back door's rule for it (``aten_random_op``), and an in-place fill, which a program
    records as a fresh tensor filled, the in-place rule (``_fill_in_a_program``). A trace
    recording around the vmap records the draws these rules make. A random aten op without
    a rule keeps the recorded call, refused under a vmap (``_draw_batch``, ``_guard_draw``).
    jit evaluates a program that draws this way whenever a vmap runs, also when the vmapped
    function passes it plain tensors only (``jit._draws_under_a_vmap``). In torch.func,
    make_fx's graph of a random op is an aten call, and vmap over the replay sees it as it
    would in eager code."""
    call = params["call"]
    levels = _levels_followed(_recording())
    if not levels:
        return bind(P.draw_p, *arrays, **params)
    args = list(params["args"])
    for position, array in zip(params["arrays_at"], arrays):
        args[position] = as_tensor(array)
    kwargs = dict(params["kwargs"])
    function = P.RANDOM_CALLS.get(call.removeprefix("fill:"))
    if call.startswith("fill:"):
        return unwrap(_fill_in_a_program(levels, function, args, kwargs))
    if function in _KINDS:  # a torch function, as the transform mode hands it over
        return unwrap(draw(function, tuple(args), kwargs))
    if call in _ATEN_KINDS:  # an aten op, as the back door hands it over
        kind, op = _ATEN_KINDS[call]
        return unwrap(kind(levels, op, call, tuple(args), kwargs))
    return bind(P.draw_p, *arrays, **params)  # (refused: _draw_batch, _guard_draw)


def _fill_in_a_program(levels, function, args, kwargs):
    """A recorded in-place fill (``x.uniform_()``: a fresh tensor of one example's shape,
    filled) under vmaps: the fill of a tensor batched at every level that draws per example
    ('different'), as the eager fill of a batched tensor is (the common case: a tensor made
    from the inputs), one example's at the others. The program does not know whether the
    tensor it filled was batched: a fill of a tensor that is the same for every example
    (``torch.empty(3).uniform_()``), which eager vmap refuses under 'different', draws per
    example here."""
    shape, _, *extra = args
    dtype, device = kwargs.pop("dtype"), kwargs.pop("device")
    spread = [level for level in levels if level.randomness == "different"]
    target = torch.empty((*[level.length for level in spread], *shape), dtype=dtype,
                         device=device)
    for level in spread:
        target = _batched(level, target)
    return _fill(levels, function, _name(function), target, tuple(extra), kwargs)


P.draw_in_a_program = _draw_in_a_program


def _draw_batch(values, bdims, *, call, **params):
    """A program's random aten op without a rule (NOTE [A program's draw under an outer
    vmap]) on batched operands: recorded for one call, not for vmap's ``randomness``."""
    _refuse_draw_under_vmap(call, _vmap_levels()[-1])


def _guard_draw(call):
    """The same, for a draw without batched operands (``torch.rand(3)``), which no vmap
    level sees: refused while a vmap runs, unless a trace is being recorded inside it."""
    levels = _vmap_levels()
    if levels and _recording() is None:
        _refuse_draw_under_vmap(call, levels[-1])


P.DRAW_GUARDS.append(_guard_draw)


def _levels_followed(recording):
    """The vmap levels whose ``randomness`` a draw follows: every one running, or, while a
    program is recorded, those inside the trace (the vmaps outside it see the program's
    draw instead: ``_draw_batch``)."""
    levels = _vmap_levels()
    if recording is None:
        return levels
    return [level for level in levels if level.level > recording.level]


def _refuse_draw_under_vmap(call, level):
    raise RandomnessError(
        f"{level.call}: the traced program draws random numbers ({call}) in code made for "
        "one call (a random aten op without a rule of its own, or the program's generated "
        "code run under vmap), which does not follow vmap's randomness. Fix: put the vmap "
        "inside the traced function (jit(vmap(f, randomness='different'))), where the draws "
        "follow it, or draw the numbers outside and pass them in.")


batching.batching_rules[P.draw_p] = _draw_batch


def _aten_kinds():
    aten = torch.ops.aten
    kinds = {}
    for kind, ops in [
        (_unary, [aten.bernoulli.default, aten.bernoulli.p, aten.poisson.default,
                  aten._standard_gamma.default, aten._sample_dirichlet.default]),
        (_normal, [aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor]),
        (_binomial, [aten.binomial.default]),
        (_multinomial, [aten.multinomial.default]),
        (_like, [aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                 aten.randint_like.low_dtype]),
    ]:
        for op in ops:
            kinds[str(op)] = (kind, op)
    return kinds


def _vmap_levels():
    """The vmap levels running now in this thread, outermost first."""
    return [level for level in transform_levels() if isinstance(level, Batched)]


# NOTE [Random draws inside torch's own Python code] (tensor.py)
tensor_module.vmap_running = lambda: bool(_vmap_levels())


# --- the table --------------------------------------------------------------------------------
_KINDS = {}


def _register(kind, *funcs):
    for func in funcs:
        _KINDS[func] = (kind, _name(func))
        RANDOM_FUNCTIONS[func] = draw
        P.RANDOM_CALLS[_name(func)] = func  # NOTE [Random numbers in a traced program]
        if kind is _in_place:
            P.RANDOM_CALLS[f"fill:{_name(func)}"] = _fresh_fill(func)


_register(_factory, torch.rand, torch.randn, torch.randint)
_register(_normal, torch.normal)
_register(_randperm, torch.randperm)
_register(_like, torch.rand_like, torch.randn_like, torch.randint_like)
_register(_unary, torch.bernoulli, torch.Tensor.bernoulli, torch.poisson, torch._standard_gamma,
          torch._sample_dirichlet)
_register(_binomial, torch.binomial)
_register(_refused, torch.rrelu, torch.rrelu_, F.rrelu, F.rrelu_)
_register(_multinomial, torch.multinomial, torch.Tensor.multinomial)
_register(_in_place, torch.Tensor.random_, torch.Tensor.uniform_, torch.Tensor.normal_,
          torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
          torch.Tensor.cauchy_, torch.Tensor.bernoulli_)
for _feature in (False, True):
    for _alpha in (False, True):
        _base = ("feature_" if _feature else "") + ("alpha_" if _alpha else "") + "dropout"
        _register(_dropout_kind(_feature, _alpha, False), getattr(torch, _base))
        _register(_dropout_kind(_feature, _alpha, True), getattr(torch, _base + "_"))
for _func in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
              F.feature_alpha_dropout, F.gumbel_softmax, torch.nn.init.uniform_,
              torch.nn.init.normal_, torch.nn.init.kaiming_uniform_):
    _register(_functional_body(_func), _func)
_ATEN_KINDS = _aten_kinds()
_register_aten_fills()
