"""Reverse mode: the Autograd level, its Tape, and the VJP rules.

NOTE [Differentiator closures]
A VJP rule is written the way TorchScript's symbolic gradients are: a forward that computes
the result and returns a backward closure over what it saved,

    def sin_vjp(x):
        return ops.sin(x), lambda ct: (ops.mul(ct, conj(ops.cos(x))),)

The closure returns one cotangent per argument (``None`` for a symbolic zero, and for
arguments that are numbers or integer indices). Broadcasting is undone with ``sum_to_size``.

NOTE [Two ways to higher order]
With ``create_graph=False`` (the default) a rule runs on the payloads, so the forward and
the backward ops reach the level *below*; a second Autograd level stacked on top records them
on its own tape (the seed's duplicated tapes, and what ``grad(grad(f))`` does).
With ``create_graph=True`` the backward ops run on *this* level and are appended to this
tape, so one tape holds the forward, the backward, and whatever uses the gradients (what
PyTorch's ``backward(create_graph=True)`` does). The rule is then called on this level's
values, with recording paused while its forward runs: the tape entry for the primitive
stands for all of it. A rule's backward is differentiable through the inputs and the output
it saved, which is what every rule here saves (as PyTorch's derivatives.yaml does).
In JAX, the backward pass over such a tape is ``backward_pass``.
"""
import contextlib
import functools
import math

import torch

from . import ops, torch_api
from . import primitives as P
from . import tensor as tensor_module
from .dispatch import (
    Dispatcher,
    complex_derivatives,
    complex_not_supported,
    cyclic_gc_paused,
    name_of,
    nondifferentiable_outputs,
    transform_levels,
)
from .errors import (
    AnomalyError,
    NonScalarOutputError,
    TransformUsageError,
    UnsupportedOperationError,
    missing_rule_error,
)
from . import grad_mode
from .grad_mode import REVERSE, floors
from .names import fresh_name
from .printing import format_equation, type_string
from .tensor import as_tensor, engine_code, unwrap
from .values import NUMBERS, Value, bind, bottom_tensor, top_dispatcher

vjp_rules: dict = {}
_is_grad_enabled = torch.is_grad_enabled


class AutogradValue(Value):
    """A value of an Autograd level: its payload, plus a name that the tape refers to."""

    __slots__ = ()
    requires_grad = True  # what a FuncTensor showing it says, as inside torch.func's grad


def _check_for_nan(call, entry, input_cts):
    """NOTE [Anomaly detection]
    Under ``torch.autograd.set_detect_anomaly(True)`` torch checks what each backward function
    returns and raises at the first NaN, naming the function (``SqrtBackward0``); torch.func's
    transforms, which run on torch's autograd, inherit the check. Here the vjp rules are the
    backward functions, so the backward pass makes the same check on each rule's cotangents
    (all examples of a batched one at once), with torch's words and its way of naming the
    function after the op; ``detect_anomaly(check_nan=False)``, which torch's own tracers
    enter, keeps the check off."""
    for position, ct in enumerate(input_cts):
        if ct is None or not isinstance(ct, (torch.Tensor, Value)):
            continue
        plain = bottom_tensor(ct)
        if plain.device.type == "meta" or not (plain.dtype.is_floating_point
                                               or plain.dtype.is_complex):
            continue
        if bool(torch.isnan(plain).any()):
            name = "".join(part.capitalize() for part in entry.prim.name.split("_"))
            raise AnomalyError(
                f"{call}: Function '{name}Backward0' returned nan values in its {position}th "
                f"output (the vjp rule of {entry.prim.name}, for the value {entry.output}). Fix: "
                "find where the forward pass leaves the function's domain (sqrt or log of a "
                "negative number, 0/0); torch.autograd.set_detect_anomaly(False) turns the "
                "check off.")


class TapeEntry:
    """One recorded primitive: what ran, on which names, and its backward closure."""

    __slots__ = ("prim", "params", "inputs", "_labels", "args", "output", "out_shape",
                 "out_dtype", "backward", "mixed_dtypes")

    def __init__(self, prim, params, inputs, input_labels, args, output, out_shape, out_dtype,
                 backward, mixed_dtypes=True):
        self.prim = prim
        self.params = params
        self.inputs = inputs  # a name per argument; None where the argument is a constant
        # names of all arguments, constants included (a number may be kept as itself: it is
        # written as a literal only if the entry is shown, not on the hot path)
        self._labels = input_labels
        self.args = args
        self.output = output
        self.out_shape = out_shape
        self.out_dtype = out_dtype
        self.backward = backward
        # whether an input's dtype may differ from the output's: then the cotangents the
        # backward makes are cast (NOTE [A cotangent takes its value's dtype])
        self.mixed_dtypes = mixed_dtypes

    @property
    def input_labels(self) -> list:
        """The names of all arguments, constants included (a number as its literal)."""
        return [label if type(label) is str else repr(label) for label in self._labels]

    @property
    def saved(self) -> dict:
        """What the backward closure captured, by variable name (the saved context)."""
        backward = self.backward
        if isinstance(backward, functools.partial):  # custom_vjp: the saved values
            return {"saved": backward.args[1]}
        closure = getattr(backward, "__closure__", None) or ()
        names = backward.__code__.co_freevars if closure else ()
        return {n: c.cell_contents for n, c in zip(names, closure)}

    def format(self) -> str:
        """``v3:f32[4] = mul v1 v2``, the notation of programs."""
        return format_equation(self.output, type_string(self.out_dtype, self.out_shape),
                               self.prim.name, self.input_labels, self.params)

    def __repr__(self):
        return f"TapeEntry({self.format()})"


class BackwardStep:
    """One step of a backward pass: the entry propagated, its incoming cotangent, and what it
    contributed to each input (``(name, contribution, gradient so far)`` triples).
    Step 0 of every pass is the seed ``dL/dL = 1`` (``index`` is None)."""

    __slots__ = ("index", "entry", "cotangent", "contributions")

    def __init__(self, index, entry, cotangent, contributions):
        self.index = index
        self.entry = entry
        self.cotangent = cotangent
        self.contributions = contributions

    def __repr__(self):
        what = "seed" if self.entry is None else self.entry.format()
        return f"BackwardStep({what}, contributions to {[c[0] for c in self.contributions]})"


def _add_slice_in_place(entry, ct, gradients, owned):
    """NOTE [Slices' cotangents are added in place]
    A slice's vjp pads its cotangent with zeros to its input's shape, and the pass adds the
    pads up: ``for x_t in x`` over T steps (an RNN's loop, an unbind) made T full-size pads
    and T full-size sums, time and memory quadratic in T (grad of an LSTM over 800 steps
    took 3 times torch.func's, whose unbind backward is one stack). So in a pass that keeps
    no steps (the transforms' passes; the stepper's keeps each partial sum), a cotangent of a
    basic slice (ints and slices) that is a plain tensor, or a vmap level's value over one
    (per-sample gradients), is added into the slice of one buffer that the pass made for the
    input (zeros, or a copy of what the input had got so far; under vmap with the batch dim
    in front): the same sums, each the size of its slice. The buffer is the input's gradient
    from then on; once another contribution replaces it, a later slice starts a new one.
    Returns whether the contribution was made here."""
    name = entry.inputs[0]
    if name is None:
        return True  # (an input that wants no cotangent)
    index = entry.params["index"]
    if not all(type(item) is int or type(item) is slice for item in index):
        return False
    shape, dtype, device = entry.args[0].metadata()
    if _keeps_every_element(entry.out_shape, shape):
        return False  # (its vjp is a reshape: no buffer to add into)
    level = None
    if type(ct) is not torch.Tensor:
        if not (isinstance(ct, Value) and _batched_over_a_tensor(ct)):
            return False
        level, ct = ct.dispatcher, ct.payload.movedim(ct.bdim, 0)
    if ct.dtype != dtype or dtype.is_complex:
        return False
    buffer = owned.get(name)
    if (buffer is not None and type(buffer) is not torch.Tensor and level is not None
            and buffer.dispatcher is not level):
        return False  # (batched by another vmap level: the pad's path sums the two)
    if buffer is None or (level is not None and type(buffer) is torch.Tensor):
        previous = gradients.get(name) if buffer is None else buffer
        batch = None if level is None else ct.shape[0]
        payload = _buffer_from(previous, shape, dtype, device, batch, level)
        if payload is None:
            return False
        buffer = payload if level is None else _batched_value(level, payload)
        gradients[name] = owned[name] = buffer
    if type(buffer) is torch.Tensor:
        buffer[index] += ct
    else:  # the batch dim in front; a plain ct is the same for every example
        buffer.payload[(slice(None),) + index] += ct
    return True


def _keeps_every_element(out_shape, x_shape) -> bool:
    """Whether a basic index whose result has ``out_shape`` keeps every element of a tensor
    of ``x_shape``: ints and slices (whose steps are positive) then keep them in their order,
    and the index is a reshape."""
    return math.prod(out_shape) == math.prod(x_shape)


def _batched_over_a_tensor(value):
    return (getattr(value.dispatcher, "transform_name", None) == "vmap"
            and type(value.payload) is torch.Tensor)


def _batched_value(level, payload):
    """A value of vmap level ``level`` with its batch dim in front of ``payload``."""
    return level.wrap_input(payload, 0)


def _buffer_from(previous, shape, dtype, device, batch, level):
    """A buffer to add slices into: zeros, or a copy of ``previous`` (the input's gradient so
    far); with ``batch``, the examples of vmap level ``level`` in front (a plain previous is
    every example's). None where ``previous`` is of another kind (a value of another
    level)."""
    if previous is None:
        full = shape if batch is None else (batch, *shape)
        return torch.zeros(full, dtype=dtype, device=device)
    if type(previous) is torch.Tensor:
        if batch is None:
            return previous.clone()
        return previous.unsqueeze(0).expand(batch, *previous.shape).clone()
    if (batch is not None and isinstance(previous, Value) and _batched_over_a_tensor(previous)
            and previous.dispatcher is level):
        return previous.payload.movedim(previous.bdim, 0).clone()
    return None


class Tape:
    """The entries an Autograd level recorded, and the steps of its last backward pass.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> d = Autograd(Torch())
    >>> a, b = label(torch.tensor([1.0, 2.0]), "a"), label(torch.tensor([3.0, 4.0]), "b")
    >>> loss = d.sum(d.mul(a, b), name="L")
    >>> print(d.tape)
    v0:f32[2] = mul a b
    L:f32[] = sum v0 dim=(0,) keepdim=False
    >>> d.grad(loss, [a, b])
    [tensor([3., 4.]), tensor([1., 2.])]
    >>> len(d.tape.steps)  # the seed, then one step per entry
    3
    """

    def __init__(self, level_name="Autograd", call=None):
        self.level_name = level_name
        self.call = call or level_name  # how messages name the transform call
        self.entries: list[TapeEntry] = []
        self.passes: list[list[BackwardStep]] = []
        self._constant_labels: dict[int, str] = {}
        self.hooks: dict[str, list] = {}  # name -> Tensor.register_hook's functions

    def label_of_constant(self, value) -> str:
        """How the tape names an argument that is not one of its own values: a number as a
        literal, a labelled tensor or a value of another level by its name, any other tensor
        as c0, c1, ... in the order the tape first saw it (the tensor itself is not touched);
        an optional array left out (a convolution's bias) is None, as in programs."""
        if isinstance(value, NUMBERS) or value is None:
            return repr(value)
        if isinstance(value, Value):
            return value.name
        name = getattr(value, "t_name", None)
        if name is None:
            name = self._constant_labels.get(id(value))
            if name is None:
                name = self._constant_labels[id(value)] = f"c{len(self._constant_labels)}"
        return name

    @property
    def steps(self) -> list[BackwardStep]:
        """The steps of the most recent backward pass."""
        return self.passes[-1] if self.passes else []

    def record(self, entry: TapeEntry) -> None:
        self.entries.append(entry)

    def backward(self, seeds: dict, *, record_steps: bool = True) -> dict:
        """Propagate cotangents from ``seeds`` (name -> cotangent) back over the tape.

        Returns the gradient map: name -> accumulated cotangent. Entries whose output got no
        cotangent are skipped (a symbolic zero); fan-in is summed as it arrives.
        """
        with cyclic_gc_paused():
            return self._backward(seeds, record_steps)

    def _backward(self, seeds, record_steps):
        start = len(_deferred_checks)
        try:
            gradients = self._propagate(seeds, record_steps)
            _run_deferred_checks(_deferred_checks[start:])
        finally:
            del _deferred_checks[start:]
        return gradients

    def _propagate(self, seeds, record_steps):
        # NOTE [A cotangent takes its value's dtype]
        # torch's autograd engine casts each gradient it hands on to the dtype of the tensor it
        # is the gradient of (validate_outputs in engine.cpp): in (tanh(x) * y).sum() with x
        # float32 and y float64, tanh's backward gets a float32 cotangent, rounded once there.
        # Computing on in float64 and casting at the end is more precise, and differs from
        # torch.func in the last bit; so contributions are cast as they are made (and a seed
        # when it is used), each to its value's dtype. (A complex cotangent of a real value is
        # left to real_cotangents_of, which takes its real part.)
        check_nan = torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        gradients = dict(seeds)
        steps = [BackwardStep(None, None, None, [(n, ct, ct) for n, ct in seeds.items()])]
        entries, hooks = self.entries, self.hooks
        slices_in_place = not record_steps and not check_nan
        owned = {}  # name -> the gradient buffer this pass made for it, that slices add into
        for index in range(len(entries) - 1, -1, -1):
            entry = entries[index]
            output = entry.output
            ct = gradients.get(output)
            if ct is None:
                continue
            if output in seeds:
                ct = ops.in_value_dtype(ct, entry.out_dtype)
            if hooks:
                ct = gradients[output] = self._hooked(output, ct)
            if (slices_in_place and entry.prim is P.getitem_p
                    and _add_slice_in_place(entry, ct, gradients, owned)):
                continue
            _needs_stack.append(entry.inputs)
            try:
                input_cts = entry.backward(ct)
            finally:
                _needs_stack.pop()
            assert len(input_cts) == len(entry.inputs), (
                f"the vjp rule of {entry.prim.name} returned {len(input_cts)} cotangents for "
                f"{len(entry.inputs)} arguments"
            )
            if check_nan:
                _check_for_nan(self.call, entry, input_cts)
            contributions = [] if record_steps else None
            for name, input_ct, arg in zip(entry.inputs, input_cts, entry.args):
                if name is None or input_ct is None:
                    continue
                if entry.mixed_dtypes and isinstance(arg, Value):
                    input_ct = ops.in_value_dtype(input_ct, arg.metadata()[1])
                previous = gradients.get(name)
                total = input_ct if previous is None else ops.add(previous, input_ct)
                gradients[name] = total
                if owned:
                    owned.pop(name, None)
                if record_steps:
                    contributions.append((name, input_ct, total))
            if record_steps:
                steps.append(BackwardStep(index, entry, ct, contributions))
        if self.hooks:  # the transform's inputs, which no entry produced
            produced = {entry.output for entry in self.entries}
            for name in self.hooks.keys() - produced:
                if name in gradients:
                    gradients[name] = self._hooked(name, gradients[name])
        if record_steps:
            self.passes.append(steps)
        return gradients

    def _hooked(self, name, ct):
        """NOTE [Gradient hooks]
        ``y.register_hook(fn)`` inside grad: when y's cotangent is complete (every use of y
        comes later on the tape, so its backward steps have all run), ``fn`` sees it and may
        return a replacement, which the rest of the pass propagates; several hooks run in the
        order they were registered. torch's autograd runs a tensor's hooks at the same point
        (``tensor_pre_hooks`` of its grad_fn), and torch.func's grad inherits them."""
        for hook in self.hooks.get(name, ()):
            with tensor_module.user_code():
                replaced = hook(as_tensor(ct))
            if replaced is not None:
                replaced = unwrap(replaced)
                if tuple(replaced.shape) != tuple(ops.shape_of(ct)):
                    raise TransformUsageError(
                        f"{self.call}: a hook registered with register_hook returned a "
                        f"gradient of shape {tuple(replaced.shape)} for a tensor of shape "
                        f"{tuple(ops.shape_of(ct))} (torch: hook 'hook' has changed the size "
                        "of value). Fix: return a tensor of the gradient's shape, or None.")
                ct = replaced
        return ct

    def gradient_map(self, step: int | None = None, backward_pass: int = -1) -> dict:
        """The gradient map after ``step`` of a backward pass (the last step by default):
        name -> (gradient so far, [indices of the entries that contributed, or 'seed'])."""
        steps = self.passes[backward_pass] if self.passes else []
        last = len(steps) - 1 if step is None else step
        result = {}
        for position in range(last + 1):
            entry_index = steps[position].index
            for name, _, total in steps[position].contributions:
                sources = result[name][1] if name in result else []
                result[name] = (total, sources + ["seed" if entry_index is None else entry_index])
        return result

    def __len__(self):
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __str__(self):
        return "\n".join(entry.format() for entry in self.entries)

    def __repr__(self):
        return f"<Tape of {self.level_name}: {len(self.entries)} entries>"

    def _repr_pretty_(self, printer, cycle):
        printer.text(f"{self.level_name} tape ({len(self.entries)} entries)\n{self}")


_active_captures: list[list] = []

# NOTE [needs_input_grad]
# While a backward closure runs, ``needs_input_grad(i)`` says whether the entry being
# propagated wants a cotangent for its argument i: a constant (a captured weight, the input
# x of a per-sample gradient) does not. It is PyTorch's ``ctx.needs_input_grad``. Rules whose
# cotangents cost real work (matmul, mul, ...) skip the ones nobody wants; other rules may
# ignore it, and a cotangent computed anyway is dropped. Outside a backward pass (a rule
# called by hand) every argument that is a tensor wants one.
_needs_stack: list = []

# NOTE [A check over several outputs of one kernel]
# A few checks need the cotangents of several outputs of one kernel at once, while each output
# is its own primitive with its own backward (NOTE [One kernel call, several primitives] in
# linalg.py). An SVD's loss must not depend on the phases of its singular pairs, and torch
# checks Im diag(U^H gU) + Im diag(V^H gV) = 0, a sum over U's and V's cotangents. So such a
# backward files its part with ``defer_check(key, part, check)``; once the backward pass is
# over, the parts filed under one key are summed and ``check`` runs on the total (torch makes
# the check inside its one svd_backward, which gets both cotangents).
_deferred_checks: list = []


def defer_check(key, part, check):
    _deferred_checks.append((key, part, check))


def _run_deferred_checks(filed):
    totals = {}
    for key, part, check in filed:
        total, _ = totals.get(key, (None, check))
        totals[key] = (part if total is None else total + part, check)
    for total, check in totals.values():
        check(total)


def needs_input_grad(position: int) -> bool:
    """Whether argument ``position`` of the entry being propagated wants a cotangent."""
    return not _needs_stack or _needs_stack[-1][position] is not None


def wants_cotangent(position: int, value) -> bool:
    """A tensor argument that the current backward pass wants a cotangent for."""
    return not isinstance(value, NUMBERS) and needs_input_grad(position)


@contextlib.contextmanager
def capture_tapes():
    """Collect the tapes of every Autograd level created inside the block, outermost first.

    >>> import torch
    >>> from minifunctorch.core import capture_tapes, grad
    >>> with capture_tapes() as tapes:
    ...     _ = grad(lambda x: (x.sin() * x).sum())(torch.ones(3))
    >>> [len(t) for t in tapes]
    [3]
    """
    tapes: list[Tape] = []
    _active_captures.append(tapes)
    try:
        yield tapes
    finally:
        _active_captures.remove(tapes)


class Autograd(Dispatcher):
    """Reverse-mode level: runs each primitive below it and records a tape entry.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch, label
    >>> a, b = label(torch.tensor([1.0, 2.0])), label(torch.tensor([3.0, 4.0]))
    >>> d = Autograd(Torch())
    >>> loss = d.sum(d.mul(d.add(a, b), b))
    >>> d.grad(loss, [a, b])
    [tensor([3., 4.]), tensor([ 7., 10.])]
    """

    transform_name = "grad"
    differentiates = True
    # the grad mode found when the level started running the user's function, and whether it
    # did (grad_mode.level_scope); a level of the explicit API is never entered, and records
    # whatever the grad mode
    prev_grad_mode = True
    obeys_grad_mode = False

    def __init__(self, inner, *, name="Autograd", create_graph=False, record_steps=True,
                 call=None):
        super().__init__(inner, name=name, call=call)
        self.create_graph = create_graph
        self.tape = Tape(self.name, self.call)
        self.record_steps = record_steps or bool(_active_captures)
        self._paused = 0  # > 0 while a rule's forward runs under create_graph
        for tapes in _active_captures:
            tapes.append(self.tape)

    def _payloads(self, args):
        return [a.payload if type(a) is AutogradValue and a.dispatcher is self else a
                for a in args]

    def apply(self, prim, *args, **params):
        if self._paused or not prim.differentiable:
            out = bind(prim, *self._payloads(args), **params)
            return AutogradValue(self, out) if self._paused else out
        # NOTE [Grad modes and transform levels] (grad_mode.py)
        if not _is_grad_enabled() and self.obeys_grad_mode and grad_mode.grad_off():
            return bind(prim, *self._payloads(args), **params)
        if self.level < floors[REVERSE]:  # below a level entered under no_grad
            with grad_mode.no_grad():
                return bind(prim, *self._payloads(args), **params)
        rule = vjp_rules.get(prim)
        if rule is None:
            raise missing_rule_error(prim, "vjp", "grad")
        # (this is the hot path of every op under grad: the loop also finds the inputs'
        # dtypes, from which the checks below follow, instead of a pass per check)
        payloads, inputs, labels = [], [], []
        in_dtype = None  # the differentiated inputs' dtype; mixed if they differ
        mixed_dtypes = takes_complex = False
        for a in args:
            if type(a) is AutogradValue and a.dispatcher is self:
                payloads.append(a.payload)
                name = a._name
                if name is None:
                    name = a.name
                inputs.append(name)
                labels.append(name)
                dtype = a.metadata()[1]
                if dtype is not in_dtype:
                    if in_dtype is not None:
                        mixed_dtypes = True
                    in_dtype = dtype
                    takes_complex = takes_complex or dtype.is_complex
            elif type(a) in NUMBERS:  # its label is itself (TapeEntry.input_labels)
                payloads.append(a)
                inputs.append(None)
                labels.append(a)
            else:
                payloads.append(a)
                inputs.append(None)
                labels.append(self.tape.label_of_constant(a))
                dtype = getattr(a, "dtype", None)
                takes_complex = takes_complex or (dtype is not None and dtype.is_complex)
        complex_ok = prim in complex_derivatives  # NOTE [Complex numbers] (dispatch.py)
        if takes_complex and not complex_ok:
            raise complex_not_supported(self, prim, gives=False)
        if self.create_graph:
            self._paused += 1
            try:
                out, backward = rule(*args, **params)
            finally:
                self._paused -= 1
            if not (type(out) is AutogradValue and out.dispatcher is self):
                out = AutogradValue(self, out)
        elif self.prev_grad_mode:
            out_payload, backward = rule(*payloads, **params)
            out = AutogradValue(self, out_payload)
        else:  # entered under no_grad: the levels below, outside it, record nothing
            with grad_mode.no_grad():
                out_payload, backward = rule(*payloads, **params)
            out = AutogradValue(self, out_payload)
        name = out.name
        if name in inputs:  # a rule returned its input unchanged: keep names distinct
            name = out._name = fresh_name()
        out_shape, dtype, _ = out.metadata()
        mixed_dtypes = mixed_dtypes or dtype is not in_dtype
        if dtype.is_complex:
            if not complex_ok:
                raise complex_not_supported(self, prim)
            backward = real_cotangents_of(payloads, inputs, backward)
        self.tape.entries.append(TapeEntry(prim, params, inputs, labels, args, name, out_shape,
                                           dtype, backward, mixed_dtypes))
        return out

    def wrap_adopted(self, payload, original):
        return AutogradValue(self, payload, name_of(original))

    def renamed(self, old_name, new_name):
        for entry in reversed(self.tape.entries):
            if entry.output == old_name:
                entry.output = new_name
                return

    def wrap_input(self, value, name=None):
        """Make ``value`` an input of this level (what ``grad`` does to its arguments)."""
        return AutogradValue(self, value, name)

    def grad(self, loss, inputs):
        """The gradients of ``loss`` with respect to ``inputs`` (the seed's explicit API).

        Inputs are matched by name. With ``create_graph=False`` the gradients are values of
        the level below; with ``create_graph=True`` they are values of this level and can be
        differentiated again on the same tape.

        As in the seed, the backward pass starts from ones of the loss's shape, so a loss with
        dims gives the gradient of its sum (the torch.func-style ``grad`` keeps its check that
        the output is a scalar).
        """
        loss = self.adopt(loss)
        seed = ops.ones_like(loss if self.create_graph else loss.payload)
        gradients = self.tape.backward({loss.name: seed}, record_steps=self.record_steps)
        result = []
        for x in inputs:
            g = gradients.get(name_of(x))
            if g is None:
                adopted = self.adopt(x)
                g = ops.zeros_like(adopted if self.create_graph else adopted.payload)
            result.append(as_tensor(g))
        return result

    def unknown_op(self, name, run, values, kwargs):
        """An aten op without a rule: fine if its outputs cannot carry a derivative."""
        return nondifferentiable_outputs(self, name, run, values, kwargs)


# --- writes into tensors that a tape may read --------------------------------------------------
def refuse_write_to_recorded(target, call):
    """NOTE [A tape has no version counter]
    A backward closure keeps the tensors its rule needs (``exp``'s vjp reads its output,
    ``x * w``'s reads ``w``), and reads them when the backward pass runs. An in-place write
    into one of them in between would make the gradient use the new numbers. torch counts
    the writes into each tensor (its version counter) and raises at the backward pass; the
    tapes here count nothing, so a write that could reach a recorded op is refused up front:
    the write of an in-place torch function into a plain tensor inside a transform (a tensor
    the function closed over, ``w.add_(1)``; ``torch.embedding_renorm_`` under
    ``F.embedding(..., max_norm=...)``), when the storage of ``target`` (a tensor, or an
    engine value whose plain tensor is written) is that of an argument of an op some running
    tape recorded, or ``target`` is the output of one. Never a silently wrong gradient."""
    levels = [level for level in transform_levels() if isinstance(level, Autograd)
              and level.tape.entries]
    if not levels:
        return
    bottom = bottom_tensor(target)
    if bottom.device.type == "meta":
        return
    storage = bottom.untyped_storage().data_ptr()
    names = set()
    value = target
    while isinstance(value, Value):
        names.add(value.name)
        value = value.payload

    def shares_storage(arg):
        if isinstance(arg, (list, tuple)):
            return any(shares_storage(item) for item in arg)
        if not isinstance(arg, (Value, torch.Tensor)):
            return False
        arg = bottom_tensor(arg)
        return arg.device.type != "meta" and arg.untyped_storage().data_ptr() == storage

    for level in levels:
        for entry in level.tape.entries:
            if entry.output in names or any(shares_storage(a) for a in entry.args):
                raise UnsupportedOperationError(
                    f"{level.call}: {call} writes in place into a tensor that "
                    f"{level.transform_name} recorded an op on ({entry.prim.name}), whose "
                    "backward pass may read it: the gradient would use the new numbers (torch "
                    "raises at the backward pass: 'one of the variables needed for gradient "
                    "computation has been modified by an inplace operation'). Fix: write "
                    "before the tensor's first use inside the transform, write into a copy "
                    "(t = t.clone()), or do the write outside the transform.")


tensor_module.plain_write_guards.append(refuse_write_to_recorded)


# --- helpers ---------------------------------------------------------------------------------
def real_cotangents_of(payloads, inputs, backward):
    """The backward of an op with a complex result, where the tracked inputs that are real get
    the real part of their cotangent (NOTE [Complex numbers] in dispatch.py)."""
    real = [i for i, (p, name) in enumerate(zip(payloads, inputs))
            if name is not None and not p.dtype.is_complex]
    if not real:
        return backward

    def backward_of_real_inputs(ct):
        cts = list(backward(ct))
        for i in real:
            if cts[i] is not None and cts[i].dtype.is_complex:
                cts[i] = ops.real(cts[i])
        return tuple(cts)
    return backward_of_real_inputs


def conj(v):
    """The complex conjugate; a real tensor (or number) is returned as it is."""
    if isinstance(v, complex):
        return v.conjugate()
    dtype = getattr(v, "dtype", None)
    if dtype is not None and dtype.is_complex:
        return ops.conj(v)
    return v


def sum_to_size(ct, shape):
    """Undo broadcasting: sum ``ct`` down to ``shape`` (TorchScript's ``sum_to_size``).

    Leading dims that broadcasting added are summed away; dims where ``shape`` has size 1
    are summed with keepdim.
    """
    if ct is None:
        return None
    shape = tuple(shape)
    ct_shape = ops.shape_of(ct)
    if ct_shape == shape:
        return ct
    lead = len(ct_shape) - len(shape)
    if lead:
        ct = ops.sum(ct, tuple(range(lead)))
    stretched = tuple(i for i, size in enumerate(shape) if size == 1 and ct_shape[lead + i] != 1)
    if stretched:
        ct = ops.sum(ct, stretched, keepdim=True)
    return ct


def nondifferentiable_vjp(prim):
    """The rule of a primitive whose output has zero derivative."""
    def vjp(*args, **params):
        return bind(prim, *args, **params), lambda ct: (None,) * len(args)
    return vjp


for _prim in P.PRIMITIVES.values():
    if not _prim.differentiable:
        vjp_rules[_prim] = nondifferentiable_vjp(_prim)


# --- elementwise -------------------------------------------------------------------------------
def neg_vjp(x):
    return ops.neg(x), lambda ct: (ops.neg(ct),)
vjp_rules[P.neg_p] = neg_vjp


def exp_vjp(x):
    out = ops.exp(x)
    return out, lambda ct: (ops.mul(ct, conj(out)),)
vjp_rules[P.exp_p] = exp_vjp


def log_vjp(x):
    return ops.log(x), lambda ct: (ops.div(ct, conj(x)),)
vjp_rules[P.log_p] = log_vjp


def sin_vjp(x):
    return ops.sin(x), lambda ct: (ops.mul(ct, conj(ops.cos(x))),)
vjp_rules[P.sin_p] = sin_vjp


def cos_vjp(x):
    return ops.cos(x), lambda ct: (ops.neg(ops.mul(ct, conj(ops.sin(x)))),)
vjp_rules[P.cos_p] = cos_vjp


def tanh_vjp(x):
    out = ops.tanh(x)
    return out, lambda ct: (ops.mul(ct, ops.sub(1, ops.mul(out, out))),)
vjp_rules[P.tanh_p] = tanh_vjp


def sigmoid_vjp(x):
    out = ops.sigmoid(x)
    return out, lambda ct: (ops.mul(ct, ops.mul(out, ops.sub(1, out))),)
vjp_rules[P.sigmoid_p] = sigmoid_vjp


def relu_vjp(x):
    out = ops.relu(x)
    return out, lambda ct: (ops.where(ops.gt(out, 0), ct, 0.0),)
vjp_rules[P.relu_p] = relu_vjp


def abs_vjp(x):
    # d|z| = Re(conj(sgn z) dz): the cotangent of a complex z is ct * sgn(z)
    # (FunctionsManual.cpp's abs_backward); on real numbers sgn is sign
    sign = ops.sgn if x.dtype.is_complex else ops.sign
    return ops.abs(x), lambda ct: (ops.mul(ct, sign(x)),)
vjp_rules[P.abs_p] = abs_vjp


def sqrt_vjp(x):
    out = ops.sqrt(x)
    return out, lambda ct: (ops.div(ct, ops.mul(conj(out), 2)),)
vjp_rules[P.sqrt_p] = sqrt_vjp


# --- broadcasting binary ops: each cotangent is summed back to its input's shape ---------------
def add_vjp(x, y):
    def backward(ct):
        return (sum_to_size(ct, ops.shape_of(x)) if wants_cotangent(0, x) else None,
                sum_to_size(ct, ops.shape_of(y)) if wants_cotangent(1, y) else None)
    return ops.add(x, y), backward
vjp_rules[P.add_p] = add_vjp


def sub_vjp(x, y):
    def backward(ct):
        return (sum_to_size(ct, ops.shape_of(x)) if wants_cotangent(0, x) else None,
                sum_to_size(ops.neg(ct), ops.shape_of(y)) if wants_cotangent(1, y) else None)
    return ops.sub(x, y), backward
vjp_rules[P.sub_p] = sub_vjp


def mul_vjp(x, y):
    def backward(ct):
        return (sum_to_size(ops.mul(ct, conj(y)), ops.shape_of(x)) if wants_cotangent(0, x) else None,
                sum_to_size(ops.mul(ct, conj(x)), ops.shape_of(y)) if wants_cotangent(1, y) else None)
    return ops.mul(x, y), backward
vjp_rules[P.mul_p] = mul_vjp


def div_vjp(x, y):
    def backward(ct):
        x_bar = sum_to_size(ops.div(ct, conj(y)), ops.shape_of(x)) if wants_cotangent(0, x) else None
        y_bar = None
        if wants_cotangent(1, y):
            # derivatives.yaml's -grad * ((self / other) / other).conj(), in its order: the
            # same bits as torch.func (-(ct * x) / (y * y) rounds differently)
            y_bar = sum_to_size(ops.mul(ops.neg(ct), conj(ops.div(ops.div(x, y), y))),
                                ops.shape_of(y))
        return x_bar, y_bar
    return ops.div(x, y), backward
vjp_rules[P.div_p] = div_vjp


def pow_vjp(x, y):
    out = ops.pow(x, y)

    def backward(ct):
        x_bar = y_bar = None
        if wants_cotangent(0, x):
            if isinstance(y, (int, float)):
                x_bar = None if y == 0 else ops.mul(ct, conj(ops.mul(ops.power(x, y - 1), y)))
            else:
                x_bar = sum_to_size(ops.mul(ct, conj(ops.pow_base_derivative(x, y))),
                                    ops.shape_of(x))
        if wants_cotangent(1, y):
            y_bar = sum_to_size(ops.mul(ct, conj(ops.pow_exponent_derivative(x, y, out))),
                                ops.shape_of(y))
        return x_bar, y_bar
    return out, backward
vjp_rules[P.pow_p] = pow_vjp


def where_vjp(condition, x, y):
    def backward(ct):
        return (None,
                sum_to_size(ops.where(condition, ct, 0.0), ops.shape_of(x)) if wants_cotangent(1, x) else None,
                sum_to_size(ops.where(condition, 0.0, ct), ops.shape_of(y)) if wants_cotangent(2, y) else None)
    return ops.where(condition, x, y), backward
vjp_rules[P.where_p] = where_vjp


# --- reductions --------------------------------------------------------------------------------
def expand_back(ct, x_shape, dim, keepdim):
    """Put reduced dims back (size 1) and broadcast ``ct`` to ``x_shape``."""
    if not keepdim and dim != tuple(range(len(dim))):
        # expand can only add leading dims: put inner reduced dims back as size 1 first
        ct = ops.reshape(ct, *ops.keepdim_shape(x_shape, dim))
    return ops.expand(ct, *x_shape)


def sum_vjp(x, *, dim, keepdim):
    x_shape = ops.shape_of(x)
    return (bind(P.sum_p, x, dim=dim, keepdim=keepdim),
            lambda ct: (expand_back(ct, x_shape, dim, keepdim),))
vjp_rules[P.sum_p] = sum_vjp


def mean_vjp(x, *, dim, keepdim):
    x_shape = ops.shape_of(x)
    count = math.prod(x_shape[d] for d in dim)
    return (bind(P.mean_p, x, dim=dim, keepdim=keepdim),
            lambda ct: (expand_back(ops.div(ct, count), x_shape, dim, keepdim),))
vjp_rules[P.mean_p] = mean_vjp


def _extremum_vjp(prim):
    def vjp(x, *, dim, keepdim):
        out = bind(prim, x, dim=dim, keepdim=keepdim)
        unreduced = ops.keepdim_shape(ops.shape_of(x), dim)

        def backward(ct):
            # ties share the gradient evenly, as in PyTorch
            is_extremum = ops.eq(x, ops.reshape(out, *unreduced))
            count = ops.sum(is_extremum, dim, keepdim=True)
            return (ops.div(ops.mul(ops.reshape(ct, *unreduced), is_extremum), count),)
        return out, backward
    return vjp


vjp_rules[P.amax_p] = _extremum_vjp(P.amax_p)
vjp_rules[P.amin_p] = _extremum_vjp(P.amin_p)


def logsumexp_vjp(x, *, dim, keepdim):
    out = bind(P.logsumexp_p, x, dim=dim, keepdim=keepdim)
    unreduced = ops.keepdim_shape(ops.shape_of(x), dim)

    def backward(ct):
        softmax = ops.exp(ops.sub(x, ops.reshape(out, *unreduced)))
        # holomorphic: the conj of the derivative on complex numbers (logsumexp_backward)
        return (ops.mul(ops.reshape(ct, *unreduced), conj(softmax)),)
    return out, backward
vjp_rules[P.logsumexp_p] = logsumexp_vjp


def softmax_vjp(x, *, dim):
    out = bind(P.softmax_p, x, dim=dim)
    # out * (ct - sum(ct * out)), torch's one kernel (NOTE [Softmax derivatives are torch's
    # fused kernels] in primitives.py). The kernel wants the cotangent in the output's dtype
    # (a float64 factor downstream makes it float64); torch's engine casts it so too.
    return out, lambda ct: (bind(P.softmax_backward_p, ops.convert(ct, out.dtype), out,
                                 dim=dim),)
vjp_rules[P.softmax_p] = softmax_vjp


def log_softmax_vjp(x, *, dim):
    out = bind(P.log_softmax_p, x, dim=dim)
    # ct - exp(out) * sum(ct), torch's one kernel
    return out, lambda ct: (bind(P.log_softmax_backward_p, ops.convert(ct, out.dtype), out,
                                 dim=dim),)
vjp_rules[P.log_softmax_p] = log_softmax_vjp


def softmax_backward_vjp(ct, out, *, dim):
    """y = out * ct - out * sum(out * ct): linear in ct, whose cotangent is the same kernel;
    derivatives.yaml's softmax_double_backward for out."""
    y = bind(P.softmax_backward_p, ct, out, dim=dim)

    def backward(g):
        g_ct = g_out = None
        if needs_input_grad(0):
            g_ct = bind(P.softmax_backward_p, ops.convert(g, out.dtype), out, dim=dim)
        if needs_input_grad(1):
            g_out = ops.sub(ops.sub(ops.mul(ct, g),
                                    ops.mul(ops.sum(ops.mul(out, ct), dim, keepdim=True), g)),
                            ops.mul(ct, ops.sum(ops.mul(out, g), dim, keepdim=True)))
        return g_ct, g_out
    return y, backward
vjp_rules[P.softmax_backward_p] = softmax_backward_vjp


def log_softmax_backward_vjp(ct, out, *, dim):
    """y = ct - exp(out) * sum(ct), in derivatives.yaml's order of operations."""
    y = bind(P.log_softmax_backward_p, ct, out, dim=dim)

    def backward(g):
        g_ct = g_out = None
        if needs_input_grad(0):
            g_ct = ops.sub(g, ops.sum(ops.mul(g, ops.exp(out)), dim, keepdim=True))
        if needs_input_grad(1):
            g_out = ops.mul(ops.mul(ops.neg(ops.sum(ct, dim, keepdim=True)), ops.exp(out)), g)
        return g_ct, g_out
    return y, backward
vjp_rules[P.log_softmax_backward_p] = log_softmax_backward_vjp


# --- linear algebra ----------------------------------------------------------------------------
def matmul_vjp(x, y):
    x_rank, y_rank = len(ops.shape_of(x)), len(ops.shape_of(y))

    def backward(ct):
        want_x, want_y = needs_input_grad(0), needs_input_grad(1)
        if x_rank == 1 and y_rank == 1:  # a dot product: ct is a scalar
            return ((ops.mul(ct, conj(y)) if want_x else None),
                    (ops.mul(ct, conj(x)) if want_y else None))
        if x_rank == 2 and y_rank == 1:  # matrix @ vector: an outer product and ct @ x
            return (ops.mul(ops.unsqueeze(ct, 1), ops.unsqueeze(conj(y), 0)) if want_x else None,
                    ops.matmul(ct, conj(x)) if want_y else None)
        if x_rank == 1 and y_rank == 2:  # vector @ matrix: y @ ct and an outer product
            return (ops.matmul(conj(y), ct) if want_x else None,
                    ops.mul(ops.unsqueeze(conj(x), 1), ops.unsqueeze(ct, 0)) if want_y else None)
        # view vectors as matrices, so that both cotangents are matrix products (each
        # operand is reshaped only where the cotangent that needs it is wanted)
        ct_matrix = ops.unsqueeze(ct, -2) if x_rank == 1 else ct
        ct_matrix = ops.unsqueeze(ct_matrix, -1) if y_rank == 1 else ct_matrix
        x_bar = y_bar = None
        if want_x:
            y_matrix = ops.unsqueeze(y, 1) if y_rank == 1 else y
            # the adjoint: the conjugate transpose (a no-op conj on real numbers)
            x_bar = sum_to_size(ops.matmul(ct_matrix, conj(ops.transpose(y_matrix, -1, -2))),
                                (1, x.shape[0]) if x_rank == 1 else ops.shape_of(x))
            x_bar = ops.reshape(x_bar, *ops.shape_of(x))
        if want_y:
            x_matrix = ops.unsqueeze(x, 0) if x_rank == 1 else x
            y_bar = sum_to_size(ops.matmul(conj(ops.transpose(x_matrix, -1, -2)), ct_matrix),
                                (y.shape[0], 1) if y_rank == 1 else ops.shape_of(y))
            y_bar = ops.reshape(y_bar, *ops.shape_of(y))
        return x_bar, y_bar
    return ops.matmul(x, y), backward
vjp_rules[P.matmul_p] = matmul_vjp


# --- shape -------------------------------------------------------------------------------------
def permute_vjp(x, *, dims):
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    return bind(P.permute_p, x, dims=dims), lambda ct: (bind(P.permute_p, ct, dims=inverse),)
vjp_rules[P.permute_p] = permute_vjp


def _reshape_back_vjp(prim):
    """Rules of the ops whose backward is a reshape to the input's shape."""
    def vjp(x, **params):
        x_shape = ops.shape_of(x)  # (x's own shape: bound without ops.reshape's checks)
        return bind(prim, x, **params), lambda ct: (bind(P.reshape_p, ct, shape=x_shape),)
    return vjp


vjp_rules[P.reshape_p] = _reshape_back_vjp(P.reshape_p)
vjp_rules[P.unsqueeze_p] = _reshape_back_vjp(P.unsqueeze_p)
vjp_rules[P.squeeze_p] = _reshape_back_vjp(P.squeeze_p)


def expand_vjp(x, *, shape):
    x_shape = ops.shape_of(x)
    return bind(P.expand_p, x, shape=shape), lambda ct: (sum_to_size(ct, x_shape),)
vjp_rules[P.expand_p] = expand_vjp


def cat_vjp(*xs, dim):
    sizes = [ops.shape_of(x)[dim] for x in xs]

    def backward(ct):
        pieces, start = [], 0
        for size in sizes:
            pieces.append(ops.getitem(ct, (slice(None),) * dim + (slice(start, start + size),)))
            start += size
        return tuple(pieces)
    return bind(P.cat_p, *xs, dim=dim), backward
vjp_rules[P.cat_p] = cat_vjp


def getitem_vjp(x, *, index):
    x_shape = ops.shape_of(x)
    out = bind(P.getitem_p, x, index=index)
    if _keeps_every_element(ops.shape_of(out), x_shape):
        # (x[None], x[0] of a dim of one, x[:]: the elements in their order, so the cotangent
        # is ct reshaped, a view, where a scatter would fill zeros and copy every element in)
        return out, lambda ct: (ops.reshape(ct, *x_shape),)
    return out, lambda ct: (bind(P.scatter_index_p, ct, index=index, shape=x_shape),)
vjp_rules[P.getitem_p] = getitem_vjp


def scatter_index_vjp(x, *, index, shape):
    return (bind(P.scatter_index_p, x, index=index, shape=shape),
            lambda ct: (bind(P.getitem_p, ct, index=index),))
vjp_rules[P.scatter_index_p] = scatter_index_vjp


def diagonal_vjp(x, *, offset, dim1, dim2):
    x_shape = ops.shape_of(x)
    return (bind(P.diagonal_p, x, offset=offset, dim1=dim1, dim2=dim2),
            lambda ct: (bind(P.diagonal_scatter_p, ct, offset=offset, dim1=dim1, dim2=dim2,
                             shape=x_shape),))
vjp_rules[P.diagonal_p] = diagonal_vjp


def diagonal_scatter_vjp(x, *, offset, dim1, dim2, shape):
    return (bind(P.diagonal_scatter_p, x, offset=offset, dim1=dim1, dim2=dim2, shape=shape),
            lambda ct: (bind(P.diagonal_p, ct, offset=offset, dim1=dim1, dim2=dim2),))
vjp_rules[P.diagonal_scatter_p] = diagonal_scatter_vjp


def diag_embed_vjp(x, *, offset, dim1, dim2):
    return (bind(P.diag_embed_p, x, offset=offset, dim1=dim1, dim2=dim2),
            lambda ct: (bind(P.diagonal_p, ct, offset=offset, dim1=dim1, dim2=dim2),))
vjp_rules[P.diag_embed_p] = diag_embed_vjp


def gather_vjp(x, index, *, dim):
    x_shape = ops.shape_of(x)
    return (bind(P.gather_p, x, index, dim=dim),
            lambda ct: (bind(P.scatter_add_p, ct, index, dim=dim, shape=x_shape), None))
vjp_rules[P.gather_p] = gather_vjp


def scatter_add_vjp(x, index, *, dim, shape):
    return (bind(P.scatter_add_p, x, index, dim=dim, shape=shape),
            lambda ct: (bind(P.gather_p, ct, index, dim=dim), None))
vjp_rules[P.scatter_add_p] = scatter_add_vjp


def clone_vjp(x):
    return ops.clone(x), lambda ct: (ct,)
vjp_rules[P.clone_p] = clone_vjp


def no_grad_vjp(x):
    return bind(P.no_grad_p, x), lambda ct: (None,)
vjp_rules[P.no_grad_p] = no_grad_vjp


def to_device_vjp(x, *, device):
    x_device = x.device
    return (bind(P.to_device_p, x, device=device),
            lambda ct: (bind(P.to_device_p, ct, device=x_device),))
vjp_rules[P.to_device_p] = to_device_vjp


def convert_vjp(x, *, dtype):
    x_dtype = x.dtype
    out = bind(P.convert_p, x, dtype=dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        return out, lambda ct: (None,)  # x.long(), x.bool(): no derivative flows back
    if dtype.is_complex and not x_dtype.is_complex:
        # a real tensor promoted to complex: its cotangent is the real part (NOTE [Complex
        # numbers]); complex to real (which torch warns drops the imaginary part) is refused
        return out, lambda ct: (ops.convert(ops.real(ct), x_dtype),)
    return out, lambda ct: (ops.convert(ct, x_dtype),)
vjp_rules[P.convert_p] = convert_vjp


# --- torch.autograd.grad inside transforms -------------------------------------------------------
# NOTE [torch.autograd.grad inside transforms]
# torch.func lets user code call ``torch.autograd.grad`` in two places, and so does the engine:
# 1. On a graph of plain tensors (tensors that require grad, made outside the transform or
#    inside it by a factory such as ``torch.ones(3, requires_grad=True)``), with cotangents
#    (``grad_outputs``) that may be values of a transform: ``vmap(lambda v:
#    torch.autograd.grad(out, w, v))(vs)`` computes one vector-Jacobian product per example.
#    torch's own autograd engine runs the backward pass; its backward kernels receive the
#    cotangents as FuncTensors, so every aten op they call comes through the back door, and
#    the batching rules batch it (what functorch calls "batched gradients").
# 2. On values of a grad or vjp level, while its function runs: ``grad(lambda x:
#    torch.autograd.grad(loss(x), x, create_graph=True)[0].sum())``. The level's tape is the
#    graph: the cotangents are propagated over it from the outputs' names to the inputs'.
#    With ``create_graph=False`` the pass runs under ``no_grad`` (torch's engine runs it with
#    grad mode set to ``create_graph``), so its result is a constant for every level, as in
#    torch.func. With ``create_graph=True`` the result must be differentiable at the level
#    itself, but the tape's backward closures compute one level down (NOTE [Two ways to higher
#    order]); so the forward is replayed: each recorded rule runs again on the level's own
#    values, its ops recorded on the tape, and the backward pass runs over the replayed
#    closures, recording its ops too. Every intermediate a replayed closure uses is then a
#    recorded value, so second derivatives are exact for every rule (at the cost of computing
#    the forward twice, only for this call).
# Outputs that are values of vmap or jvp (a batched loss) have no graph in torch.func either,
# which raises "element 0 of tensors does not require grad"; the engine refuses them in the
# same words. ``Tensor.backward()`` inside a transform is refused, as in torch.func.
def autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                  only_inputs=True, allow_unused=None, is_grads_batched=False,
                  materialize_grads=False):
    """``torch.autograd.grad`` called inside a transform (NOTE [torch.autograd.grad inside
    transforms]). Arguments are engine values or plain tensors; returns a tuple of them.

    >>> import torch
    >>> from minifunctorch.core import grad, vmap
    >>> grad(lambda x: torch.autograd.grad((x ** 3).sum(), x, create_graph=True)[0].sum())(
    ...     torch.tensor([1.0, 2.0]))     # d/dx of 3 x^2
    tensor([ 6., 12.])
    >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> vmap(lambda v: torch.autograd.grad(w ** 2, w, v)[0])(torch.eye(2))
    tensor([[2., 0.],
            [0., 4.]])
    """
    call = "torch.autograd.grad(outputs, inputs, ...)"
    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    ins = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if grad_outputs is None:
        cts = [None] * len(outs)
    elif isinstance(grad_outputs, (list, tuple)):
        cts = list(grad_outputs)
    else:
        cts = [grad_outputs]
    if len(cts) != len(outs):
        raise TransformUsageError(
            f"{call}: grad_outputs must have the same length as outputs, got {len(cts)} and "
            f"{len(outs)}. Fix: give one cotangent (or None) per output."
        )
    if is_grads_batched:
        raise UnsupportedOperationError(
            f"{call}: is_grads_batched=True inside a minifunctorch transform is not supported. "
            "Fix: call torch.autograd.grad under vmap over the cotangents instead."
        )
    top = top_dispatcher(outs)
    if top is None:
        return _grad_of_plain_graph(outs, ins, cts, retain_graph, create_graph, allow_unused,
                                    materialize_grads, call)
    if not isinstance(top, Autograd):
        raise UnsupportedOperationError(
            f"{call}: element 0 of tensors does not require grad and does not have a grad_fn: "
            f"the outputs are values of a {top.transform_name} transform ({top.call}), which "
            "records no graph that torch.autograd.grad could differentiate (torch.func "
            "refuses this too). Fix: differentiate with grad or vjp inside the transform, or "
            "build the graph from plain tensors that require grad and batch only the "
            "grad_outputs."
        )
    seeds = {}
    for position, (o, ct) in enumerate(zip(outs, cts)):
        if not (type(o) is AutogradValue and o.dispatcher is top):
            raise UnsupportedOperationError(
                f"{call}: element {position} of tensors does not require grad and does not "
                f"have a grad_fn: it is not a value recorded by {top.call} (it does not depend "
                "on the transform's inputs, or was computed under no_grad). Fix: "
                "differentiate outputs computed from the inputs with grad enabled."
            )
        if ct is None:
            if o.dtype.is_complex:
                raise NonScalarOutputError(
                    f"{call}: grad can be implicitly created only for real scalar outputs but "
                    f"got {o.dtype} (output {position}). Fix: pass grad_outputs, or "
                    "differentiate a real number (out.real, out.abs())."
                )
            if tuple(o.shape) != ():
                raise TransformUsageError(
                    f"{call}: grad can be implicitly created only for scalar outputs; output "
                    f"{position} has shape {tuple(o.shape)}. Fix: pass grad_outputs."
                )
            ct = ops.ones_like(o.payload)
        elif tuple(ct.shape) != tuple(o.shape):
            raise TransformUsageError(
                f"{call}: Mismatch in shape: grad_output[{position}] has a shape of "
                f"{tuple(ct.shape)} and output[{position}] has a shape of {tuple(o.shape)}. "
                "Fix: give each cotangent its output's shape."
            )
        name = o.name
        seeds[name] = ct if name not in seeds else ops.add(seeds[name], ct)
    if create_graph:
        with torch.enable_grad():
            if top.create_graph:  # an explicit level that already records its backward
                gradients = top.tape.backward(seeds, record_steps=top.record_steps)
            else:
                gradients = _replayed_backward(top, seeds, call)
    else:
        seeds = {name: top.lower_own(ct) for name, ct in seeds.items()}
        with grad_mode.no_grad():
            gradients = top.tape.backward(seeds, record_steps=top.record_steps)
    result = []
    for position, x in enumerate(ins):
        own = type(x) is AutogradValue and x.dispatcher is top
        g = gradients.get(x.name) if own else None
        if g is None:
            g = _unused_input(x, position, allow_unused, materialize_grads, call)
        result.append(g)
    return tuple(result)


def _unused_input(x, position, allow_unused, materialize_grads, call):
    if materialize_grads:
        return ops.zeros_like(x.payload if isinstance(x, AutogradValue) else x)
    if allow_unused:
        return None
    raise TransformUsageError(
        f"{call}: One of the differentiated Tensors appears to not have been used in the graph "
        f"(input {position}). Set allow_unused=True if this is the desired behavior. (Inside a "
        "grad or vjp transform, the graph holds the values computed from that transform's "
        "inputs.)"
    )


def _replayed_backward(level, seeds, call):
    """The backward pass of ``level``'s tape, recorded on the tape itself: the forward rules run
    again on the level's own values (NOTE [torch.autograd.grad inside transforms])."""
    replayed = []
    env = {}
    for entry in list(level.tape.entries):  # a copy: the replay appends to the tape
        rule = vjp_rules.get(entry.prim)
        if rule is None:
            raise missing_rule_error(entry.prim, "vjp", call)
        args = [arg if name is None else env.get(name, arg)
                for name, arg in zip(entry.inputs, entry.args)]
        out, backward = rule(*args, **entry.params)
        env[entry.output] = out
        replayed.append((entry, backward))
    gradients = dict(seeds)
    with cyclic_gc_paused():
        for entry, backward in reversed(replayed):
            ct = gradients.get(entry.output)
            if ct is None:
                continue
            _needs_stack.append(entry.inputs)
            try:
                input_cts = backward(ct)
            finally:
                _needs_stack.pop()
            for name, input_ct in zip(entry.inputs, input_cts):
                if name is None or input_ct is None:
                    continue
                previous = gradients.get(name)
                gradients[name] = input_ct if previous is None else ops.add(previous, input_ct)
    return gradients


def _grad_of_plain_graph(outs, ins, cts, retain_graph, create_graph, allow_unused,
                         materialize_grads, call):
    """Case 1 of the NOTE: torch's engine on plain tensors, the cotangents shown as
    FuncTensors (their backward ops reach the back door)."""
    plain_inputs, positions = [], []
    for position, x in enumerate(ins):
        if isinstance(x, Value):
            # a value of a transform is not a node of torch's graph of plain tensors
            continue
        plain_inputs.append(x)
        positions.append(position)
    found = ()
    if plain_inputs:
        with engine_code():
            found = torch.autograd.grad(
                outs, plain_inputs, grad_outputs=[as_tensor(ct) for ct in cts],
                retain_graph=retain_graph, create_graph=create_graph,
                allow_unused=allow_unused, materialize_grads=materialize_grads)
    result = [None] * len(ins)
    for position, g in zip(positions, found):
        result[position] = unwrap(g)
    for position, x in enumerate(ins):
        if isinstance(x, Value):
            result[position] = _unused_input(x, position, allow_unused, materialize_grads, call)
    return tuple(result)


torch_api.register(torch.autograd.grad)(autograd_grad)


@torch_api.register(torch.Tensor.requires_grad_)
def requires_grad_(x, requires_grad=True):
    """NOTE [requires_grad_ inside a transform]
    torch.func refuses it on any tensor inside a transformed function. Here a tensor made
    inside the function is a FuncTensor, so ``copy.deepcopy(model)`` inside vmap, which
    torch.func runs (an nn.Parameter of a plain tensor needs no requires_grad_ call), calls
    requires_grad_ on one (the Parameter of a tensor subclass does): under vmap alone, the
    flag of a tensor that no level owns is set, as torch would; a value of a transform, and
    any tensor under grad, vjp or jvp (where a detached value no longer tells that it came
    from the transform's inputs) get torch.func's refusal."""
    if isinstance(x, Value) or any(level.transform_name != "vmap"
                                   for level in transform_levels()):
        raise UnsupportedOperationError(
            "Tensor.requires_grad_(...): You are attempting to call Tensor.requires_grad_() "
            "(or perhaps using torch.autograd.functional.* APIs) inside of a function being "
            "transformed by a functorch transform. This is unsupported: the value belongs to "
            "the transform, which tracks its derivatives itself. Fix: differentiate with the "
            "transforms themselves (grad, vjp, jacrev) rather than with torch.autograd inside "
            "them.")
    return x.requires_grad_(requires_grad)
