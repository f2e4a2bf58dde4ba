"""FuncTensor: the torch.Tensor that user code holds inside a transform, and its two doors.

NOTE [A value shown as a real tensor]
A ``FuncTensor`` is a storage-less ``torch.Tensor`` subclass (``_make_wrapper_subclass``)
that holds one engine value (values.py) in ``.value``. Its shape, dtype and device are the
value's, so ``isinstance(x, torch.Tensor)``, ``x.layout``, ``x.is_contiguous()`` and the
checks inside nn.Module and torch's own Python code all see an ordinary tensor. Shape,
dtype and device are also plain Python properties here: reading them is hot, and a
torch.Tensor property would take a trip through ``__torch_function__`` every time.

NOTE [Two doors]
A torch call that receives a FuncTensor reaches the engine through one of two doors.
1. The front door, ``__torch_function__``: torch hands over the function as the user called
   it (``torch.sin``, ``Tensor.reshape``, ``F.conv2d``). The table in torch_api.py maps the
   common ones onto ``ops``: fast, and readable in programs and tapes. This is the course's
   first pass.
2. The back door, ``__torch_dispatch__``: any other function is handed back to torch, whose
   C++ composite kernels lower it to aten ops (``aten.tan.default``, ``aten.var.correction``),
   and each aten op comes back here. Then, the first of these that applies:
   (a) the aten table of aten_api.py, onto ``ops``;
   (b) an in-place op is computed out of place and the result swapped into its tensor
       (functionalization: ``_write``);
   (c) a decomposition into other aten ops, from ``torch._decomp``;
   (d) the level's own answer for an op it has no rule for: under vmap a per-example loop
       (listed by ``capture_fallbacks``), under grad and jvp an op whose outputs cannot
       carry a derivative (integers, booleans) runs one level down;
   (e) otherwise an error that names the op. No op is ever silently wrong.
In functorch the same two places are ``__torch_function__`` for Python-level overrides and
the ``FuncTorchDynamicLayerFrontMode`` dispatch key for aten ops.

NOTE [Tensors created inside a transform]
``buf = torch.zeros(3); buf[0] = f(x)`` writes a value of the transform into a tensor that
no level owns. While a transform runs user code, a TorchFunctionMode (``user_code``) turns
tensors made by factory functions into FuncTensors holding a plain tensor, so that a later
in-place write can swap a value into them; functorch does the same by wrapping every result
at the current level. The mode is thread-local, and the engine's own work runs without it.
"""

import numpy
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import aten_api, grad_mode, ops, pytree, torch_api
from .errors import InPlaceError, InvalidOptionError, UnsupportedOperationError
from .names import label
from . import values
from .values import NUMBERS, Value, batched_by_vmap, top_dispatcher

_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided
# NOTE [Wrappers made with positional arguments]
# Every op inside a transform makes one wrapper, so its cost counts: torch's argument parser
# reads _make_wrapper_subclass's arguments about 0.3 µs faster by position (cls, size,
# strides, storage_offset, memory_format, dtype, layout, device) than by keyword.
_is_grad_enabled = torch.is_grad_enabled
aten = torch.ops.aten


class FuncTensor(torch.Tensor):
    """The tensor user code sees inside a transform: a real ``torch.Tensor`` whose data is an
    engine value (``.value``).

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> def f(x):
    ...     print(type(x).__name__, isinstance(x, torch.Tensor), tuple(x.shape))
    ...     return x.sin().sum()
    >>> _ = grad(f)(torch.ones(2))
    FuncTensor True (2,)
    """

    __slots__ = ("value",)
    # set on the few tensors that are views, or were written in place (a class default keeps
    # the creation of the many others to one attribute)
    _view = None
    _generation = 0

    # --- metadata, without a trip through __torch_function__ ---------------------------------
    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def device(self):
        return self.value.device

    @property
    def ndim(self):
        return len(self.value.shape)

    def dim(self):
        return len(self.value.shape)

    def size(self, dim=None):
        shape = self.value.shape
        return shape if dim is None else shape[dim]

    def numel(self):
        return self.value.shape.numel()

    def __len__(self):
        shape = self.value.shape
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def is_floating_point(self):
        return self.value.dtype.is_floating_point

    def is_complex(self):
        return self.value.dtype.is_complex

    @property
    def requires_grad(self):
        """As torch.func shows it: True for a value recorded by a grad or vjp level (the
        transform's inputs, and what is computed from them with grad enabled), a plain
        tensor's own flag, False otherwise (a batched value, a constant)."""
        return getattr(value_of(self), "requires_grad", False)

    # --- what the engine knows about this tensor -----------------------------------------------
    @property
    def name(self) -> str:
        """The value's readable name, as tapes and logs show it."""
        value = value_of(self)
        return value.name if isinstance(value, Value) else _plain_name(value)

    @property
    def dispatcher(self):
        """The level the value belongs to (None for a tensor that no level owns)."""
        value = value_of(self)
        return value.dispatcher if isinstance(value, Value) else None

    @property
    def payload(self):
        """The value one level down, as a tensor (a FuncTensor or a plain tensor)."""
        value = value_of(self)
        if not isinstance(value, Value):
            return value
        return as_tensor(value.payload)

    @property
    def tangent(self):
        """A forward-mode value's tangent (None for a symbolic zero)."""
        tangent = getattr(value_of(self), "tangent", None)
        return None if tangent is None else as_tensor(tangent)

    @property
    def bdim(self):
        """A batched value's batch dim in its payload."""
        return getattr(value_of(self), "bdim", None)

    # --- concrete values ---------------------------------------------------------------------
    def concrete(self):
        """The concrete tensor behind this value, for Python control flow."""
        value = value_of(self)
        return value.concrete() if isinstance(value, Value) else value

    def __bool__(self):
        return bool(self.concrete())

    def item(self):
        return self.concrete().item()

    def __float__(self):
        return float(self.concrete())

    def __int__(self):
        return int(self.concrete())

    def __index__(self):
        return self.concrete().__index__()

    def tolist(self):
        return self.concrete().tolist()

    def numpy(self, *, force=False):
        return self.concrete().numpy(force=force)

    def register_hook(self, hook):
        """``y.register_hook(fn)`` inside grad: ``fn`` sees y's gradient and may return a
        replacement (NOTE [Gradient hooks] in autograd.py). Returns a handle whose
        ``remove()`` takes the hook off."""
        value = value_of(self)
        tape = getattr(getattr(value, "dispatcher", None), "tape", None)
        if tape is None or not getattr(value, "requires_grad", False):
            level = getattr(value, "dispatcher", None)
            call = f"{level.call}: " if level is not None else ""
            if isinstance(value, Value) and getattr(value, "bdim", None) is not None:
                raise UnsupportedOperationError(
                    f"{call}Tensor.register_hook: a gradient hook on a value batched by vmap "
                    "is not supported (its gradient would be every example's). Fix: register "
                    "the hook inside the vmapped function, under grad, or use custom_vjp.")
            raise InvalidOptionError(
                f"{call}Tensor.register_hook: cannot register a hook on a tensor that doesn't "
                "require gradient (as in torch: no grad transform records it). Fix: register "
                "hooks on tensors computed from the inputs of grad or vjp.")
        hooks = tape.hooks.setdefault(value.name, [])
        hooks.append(hook)
        return _HookHandle(hooks, hook)

    def __format__(self, format_spec):
        # torch formats a 0-d tensor as its number (f"{loss:.3f}"), but only for its own
        # class: a subclass would reach object.__format__, which refuses a format spec
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):
        value = value_of(self)
        if not isinstance(value, Value):
            return repr(value)
        levels = []
        while isinstance(value, Value):
            level = value.dispatcher
            extra = f", bdim={value.bdim}" if hasattr(value, "bdim") else ""
            levels.append(f"{level.name} level {level.level}{extra}")
            value = value.payload
        inner = (f"{type(value).__name__}(shape={tuple(value.shape)}, dtype={value.dtype})"
                 if value.device.type == "meta" else repr(value))
        return f"FuncTensor({self.name}: {' > '.join(levels)}, {inner})"

    # --- the doors ---------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call_function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return call_aten(func, args, kwargs or {})

    # the arithmetic operators, the most frequent calls: straight to the front door
    # (NOTE [Operators skip torch's dispatch])
    def __add__(self, other): return _operator(torch.Tensor.__add__, self, other)
    def __radd__(self, other): return _operator(torch.Tensor.__radd__, self, other)
    def __sub__(self, other): return _operator(torch.Tensor.__sub__, self, other)
    def __rsub__(self, other): return _operator(torch.Tensor.__rsub__, self, other)
    def __mul__(self, other): return _operator(torch.Tensor.__mul__, self, other)
    def __rmul__(self, other): return _operator(torch.Tensor.__rmul__, self, other)
    def __truediv__(self, other): return _operator(torch.Tensor.__truediv__, self, other)
    def __rtruediv__(self, other): return _operator(torch.Tensor.__rtruediv__, self, other)


class _HookHandle:
    """What ``register_hook`` returns, as torch's RemovableHandle: ``remove()`` once or more."""

    def __init__(self, hooks, hook):
        self._hooks, self._hook = hooks, hook

    def remove(self):
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _operator(func, x, y):
    """NOTE [Operators skip torch's dispatch]
    ``x * 1.1`` on a tensor subclass would go through torch's argument parsing and then its
    ``__torch_function__`` dispatch, which also takes the transform mode off the stack while
    the handler runs. The operators do both by hand: the mode comes off for the engine's
    work (so the torch calls at the bottom run at full speed) and goes back on."""
    depth = _stack_length()
    if depth and _stack_at(depth - 1) is _MODE:
        _pop_mode()
        try:
            view = x._view  # (up to date: NOTE [Views that outlive a write])
            current = view is None or view.checked == _writes
            if type(y) in NUMBERS and current:
                value = x.value
                prim = _NUMBER_SECOND.get(func)
                if type(value) is batched_value_type:
                    # NOTE [vmap's elementwise ops at the front door]
                    result = _batched_elementwise(prim, value, (y,))
                    if result is not None:
                        return result
                elif prim is not None and isinstance(value, Value):
                    # call_function's case "x * 1.1", without its lookups
                    return _wrapped(value.dispatcher.apply(prim, value, y), func, (x, y))
            elif isinstance(y, torch.Tensor) and type(y) is not FuncTensor and current:
                value = x.value
                if type(value) is batched_value_type and not value.dispatcher.exited:
                    # NOTE [An unbatched tensor beside a batched value] (batching.py)
                    prim, x_first = _TENSOR_OPERAND[func]
                    out = beside_a_tensor(prim, value, y, x_first, {})
                    if out is not None:
                        return _wrapped(out, func, (x, y))
            return call_function(func, (x, y), {})
        finally:
            _push_mode(_MODE)
    return call_function(func, (x, y), {})


_stack_length = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack


def _plain_name(tensor):
    return label(tensor).t_name


# --- wrapping and unwrapping ---------------------------------------------------------------------
def is_plain_strided(value) -> bool:
    """A plain tensor (a Parameter too) with the strided layout: one that a FuncTensor can
    show and whose memory a write reaches (not a FuncTensor, another subclass or sparse)."""
    kind = type(value)
    return (kind is torch.Tensor or kind is torch.nn.Parameter) and value.layout is _STRIDED


def share_memory(a, b) -> bool:
    """Whether two plain strided tensors have elements in the same memory (by byte ranges of
    one storage: interleaved strides that never meet count as shared)."""
    if not (is_plain_strided(a) and is_plain_strided(b)) or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_start, a_end), (b_start, b_end) = _byte_range(a), _byte_range(b)
    return a_start < b_end and b_start < a_end


def _byte_range(t):
    start = t.storage_offset()
    end = start + 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start * t.element_size(), end * t.element_size()


def wrap(value):
    """A FuncTensor showing ``value`` (a Value, or a plain tensor that no level owns)."""
    if isinstance(value, Value):
        shape, dtype, device = value.metadata()
        t = _make_wrapper(FuncTensor, shape, None, None, None, dtype, _STRIDED, device)
    else:
        # A plain tensor keeps its own strides: torch's decompositions choose between a view
        # and a copy from the wrapper's strides, and the choice then runs on the real tensor
        # (a channels-last kernel output would otherwise be viewed as if contiguous).
        t = _make_wrapper(FuncTensor, value.shape, value.stride(), dtype=value.dtype,
                          device=value.device)
    t.value = value
    return t


def as_tensor(value):
    """What user code receives for an engine result: a FuncTensor for a value, anything
    else unchanged (a plain tensor stays plain)."""
    if isinstance(value, Value):
        return wrap(value)
    return value


def as_tensors(tree):
    """``as_tensor`` on every leaf of a pytree."""
    return pytree.tree_map(as_tensor, tree, none_is_leaf=True)


def value_of(t):
    """The current value of a FuncTensor (a view is brought up to date with its base)."""
    view = t._view
    if view is not None and view.checked != _writes:  # (NOTE [Views that outlive a write])
        _refresh_view(t)
    return t.value


def unwrap(x):
    """A FuncTensor's value; anything else unchanged."""
    if type(x) is FuncTensor:
        return x.value if x._view is None else value_of(x)
    return x


def unwrap_all(args, func=None):
    """``unwrap`` on arguments, and on the tensors inside list and tuple arguments; a NumPy
    scalar becomes the Python number it holds (torch's argument parser reads it as one:
    ``x * np.float64(2)`` is float32 for a float32 x, as ``x * 2.0`` is). ``func``, the torch
    function called, names the call in an error."""
    n = len(args)
    if n == 1:  # one argument, the most common call
        a = args[0]
        if type(a) is FuncTensor and a._view is None:
            return (a.value,)
    elif n == 2:  # an operator: a tensor and a tensor or a number
        a, b = args
        if type(a) is FuncTensor and a._view is None:
            if type(b) is FuncTensor:
                if b._view is None:
                    return (a.value, b.value)
            elif not isinstance(b, (list, tuple, numpy.generic, numpy.ndarray)):
                return (a.value, b)
        elif type(b) is FuncTensor and b._view is None and type(a) is torch.Tensor:
            return (a, b.value)  # a plain tensor first: a constant matrix, ``w @ x``
    out = []
    for a in args:
        if type(a) is FuncTensor:
            out.append(a.value if a._view is None else value_of(a))
        elif type(a) in NUMBERS:  # (dims and sizes: x.transpose(0, 1), x.view(4, -1))
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.append(_same_sequence(a, [unwrap(item) for item in a]))
        elif isinstance(a, numpy.generic):
            out.append(a.item())
        elif isinstance(a, numpy.ndarray):
            raise _numpy_array_error(a, func)
        else:
            out.append(a)
    return out


def _numpy_array_error(array, func):
    """torch.func's error for a NumPy array that meets a transform's tensor: torch hands the
    op to NumPy, which asks the tensor for its numbers, and a tracked tensor has none to give
    (here it would reach the engine as an array it cannot compute with)."""
    call = f"{_qualified_name(func)}(...)" if func is not None else "a torch function"
    return UnsupportedOperationError(
        f"{call}: Can't call numpy() on Tensor that requires grad (torch.func's words under "
        "grad; under vmap and jvp it cannot access the tensor's data pointer): a NumPy array "
        f"of shape {array.shape} and dtype {array.dtype} is an operand of a value of a "
        "transform, and NumPy would compute the op on the tensor's numbers, where the "
        "transform cannot follow it. Fix: make the array a tensor first (torch.as_tensor("
        "array)), or compute with NumPy outside the transform.")


def unwrap_tree(tree):
    """``unwrap`` on every leaf of a pytree (transform inputs and outputs)."""
    return pytree.tree_map(unwrap, tree, none_is_leaf=True)


def _unwrap_kwargs(kwargs):
    """``unwrap`` on keyword arguments (and in their lists and tuples); a NumPy scalar
    becomes its Python number, as in ``unwrap_all``."""
    return {k: (type(v)(unwrap(i) for i in v) if isinstance(v, (list, tuple))
                else v.item() if isinstance(v, numpy.generic) else unwrap(v))
            for k, v in kwargs.items()}


def _wrap_result(out):
    """Results of a door: every tensor or value becomes a FuncTensor."""
    if isinstance(out, (Value, torch.Tensor)):
        return out if type(out) is FuncTensor else wrap(out)
    if isinstance(out, (list, tuple)):
        return _same_sequence(out, [_wrap_result(o) for o in out])
    return out


def _same_sequence(original, items):
    """A list or tuple of ``original``'s type (a named tuple, or torch's return types such
    as ``torch.return_types.max``) holding ``items``."""
    kind = type(original)
    if kind is list or kind is tuple:
        return kind(items)
    if hasattr(kind, "_fields"):
        return kind(*items)
    return kind(items)  # torch.return_types.* are built from one sequence


def bind(prim, *args, **params):
    """``bind`` for code that may hold FuncTensors (a primitive called from user code, as
    the course's own primitives are): FuncTensors in, FuncTensors out. Rules, which compute
    with values, get values back.

    >>> import torch
    >>> from minifunctorch.core import bind, grad
    >>> from minifunctorch.core.primitives import sin_p
    >>> grad(lambda x: bind(sin_p, x))(torch.tensor(0.0))
    tensor(1.)
    """
    for a in args:
        if type(a) is FuncTensor:
            return as_tensor(values.bind(prim, *unwrap_all(args), **params))
    return values.bind(prim, *args, **params)


def call_with_tensors(function, *args, **kwargs):
    """Run a function written for tensors (a torch decomposition, a composite of torch
    calls) on engine values: the values are shown to it as FuncTensors, and its results taken
    back as values. A rule can use it to borrow torch's own decomposition of an op; the ops
    inside go through the doors, so every level interprets them."""
    with engine_code():
        return unwrap_tree(function(*as_tensors(args), **as_tensors(kwargs)))


# --- views and writes ----------------------------------------------------------------------------
class _View:
    """How a FuncTensor was made from its base: ``func(base, *args, **kwargs)[output]``."""

    __slots__ = ("base", "func", "args", "kwargs", "output", "generation", "checked")

    def __init__(self, base, func, args, kwargs, output, generation):
        self.base = base
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.output = output
        self.generation = generation
        self.checked = _writes  # made from an up-to-date base (call_function reads it first)

    def replay(self, base):
        out = self.func(base, *self.args, **self.kwargs)
        return out if self.output is None else out[self.output]


def _record_views(result, base, func, args, kwargs):
    if type(base) is not FuncTensor:
        return
    if type(result) is FuncTensor:
        result._view = _View(base, func, args, kwargs, None, base._generation)
    elif isinstance(result, (list, tuple)):
        for i, r in enumerate(result):
            if type(r) is FuncTensor:
                r._view = _View(base, func, args, kwargs, i, base._generation)


# NOTE [as_strided reads memory]
# torch's ``as_strided`` reads a tensor's storage: sizes, strides and offset count in the
# memory the tensor lives in, so on a view (``x.t()``, ``x[1]``), on a tensor that torch laid
# out like one (``x.t().sin()`` keeps the transposed strides) or on such an input, the same
# call picks other elements than on a contiguous tensor. A value of a transform has no
# storage of its own: the engine reads ``as_strided`` in the value's own contiguous layout
# (NOTE [as_strided on a tensor without storage] in indexing.py). A user's call is checked
# against two witnesses of torch's layout: the plain tensor at the bottom of the value, which
# torch's own kernels computed (without the batch dims of vmap levels), and, for a view, its
# chain of views replayed on a storage-less "meta" tensor. Where torch would pick other
# elements than the engine (``_reads_alike`` compares the two readings element by element),
# the call is refused rather than silently different from torch.func. (functorch's wrappers
# keep the strides of the tensors they wrap, so its as_strided reads real storage.) Inside
# the back door, torch's own decompositions compute strides from the FuncTensor's reported
# contiguous layout, which is the engine's reading, so they are not checked; nor is a plain
# tensor, on which torch's own kernel runs.
# function -> (where its size argument is, whether it reads a fresh copy of x: the
# scatter writes into ``x.clone()``, which keeps x's strides where x is dense but starts at
# offset 0)
_STORAGE_READERS = {
    **dict.fromkeys((torch.as_strided, torch.Tensor.as_strided, torch.Tensor.as_strided_,
                     torch.as_strided_copy, aten.as_strided, aten.as_strided.default,
                     aten.as_strided_copy, aten.as_strided_copy.default, aten.as_strided_,
                     aten.as_strided_.default), (1, False)),
    **dict.fromkeys((torch.as_strided_scatter, torch.Tensor.as_strided_scatter,
                     aten.as_strided_scatter, aten.as_strided_scatter.default), (2, True)),
}


def _replayed_layout(t):
    """A meta tensor with the strides and storage offset torch gives the view ``t`` (None
    when its chain of views cannot be replayed on a meta tensor)."""
    chain = []
    while t._view is not None:
        chain.append(t._view)
        t = t._view.base
    try:
        with engine_code():
            layout = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            for view in reversed(chain):
                layout = view.replay(layout)
    except Exception:  # a view whose arguments are themselves tensors of the transform
        return None
    return layout if type(layout) is torch.Tensor else None


def _computed_layout(value):
    """(sizes, strides, offset) of one example of the plain tensor at the bottom of
    ``value``: the batch dims of its vmap levels taken out."""
    chain = []
    while isinstance(value, Value):
        chain.append(value)
        value = value.payload
    dims = list(range(value.dim()))
    for level_value in reversed(chain):  # from the bottom level up, as the dims were added
        bdim = getattr(level_value, "bdim", None)
        if bdim is not None:
            del dims[bdim]
    return ([value.shape[d] for d in dims], [value.stride(d) for d in dims],
            value.storage_offset())


def _torch_layouts(x, value):
    """torch's layout of FuncTensor x holding ``value``, as each witness of NOTE [as_strided
    reads memory] sees it: (sizes, strides, offset), or None for a view chain that cannot be
    replayed."""
    layouts = [_computed_layout(value)]
    if x._view is not None:
        replayed = _replayed_layout(x)
        layouts.append(None if replayed is None else (
            tuple(replayed.shape), replayed.stride(), replayed.storage_offset()))
    return layouts


def _reads_alike(layout, size, stride, offset):
    """Whether ``as_strided(x, size, stride, offset)`` picks the same elements of x read in
    memory laid out as ``layout`` (torch) and in x's own contiguous layout (the engine)."""
    sizes, strides, own_offset = layout
    size, stride = tuple(size), tuple(stride)
    if 0 in size or len(size) != len(stride) or min(stride, default=0) < 0:
        return True  # nothing read, or a call that the op itself refuses
    def reach(base, sizes_, strides_):
        return base + sum((n - 1) * st for n, st in zip(sizes_, strides_)) + 1
    memory = torch.arange(max(reach(own_offset, sizes, strides),
                              reach(own_offset if offset is None else offset, size, stride)))
    place_of_element = memory.as_strided(sizes, strides, own_offset).reshape(-1)
    torch_places = memory.as_strided(size, stride, own_offset if offset is None else offset)
    own_elements = torch.arange(reach(offset or 0, size, stride)).as_strided(
        size, stride, offset or 0)
    if own_elements.numel() and own_elements.max() >= place_of_element.numel():
        return True  # outside x: the op itself refuses it
    return bool((place_of_element[own_elements] == torch_places).all())


def _layout_of_a_copy(sizes, strides, offset):
    """The layout torch gives ``x.clone()`` for x laid out as (sizes, strides, offset)."""
    copy = torch.empty_like(torch.empty_strided(sizes, strides, device="meta"))
    return tuple(copy.shape), copy.stride(), 0


def _check_storage_read(func, args, kwargs):
    """Refuse ``as_strided(x, ...)`` where torch would read x's memory differently from x's
    own contiguous layout (NOTE [as_strided reads memory])."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if type(x) is not FuncTensor or grad_mode.door[0]:
        return
    value = value_of(x)
    if not isinstance(value, Value):
        return
    at, reads_a_copy = _STORAGE_READERS[func]
    names = ("size", "stride", "storage_offset")
    size, stride, offset = (args[at + i] if len(args) > at + i else kwargs.get(name)
                            for i, name in enumerate(names))
    layouts = _torch_layouts(x, value)
    if reads_a_copy:
        layouts = [None if layout is None else _layout_of_a_copy(*layout) for layout in layouts]
    for layout in layouts:
        if layout is not None and _reads_alike(layout, size, stride, offset):
            continue
        where = ("is a view whose place in memory is not known here" if layout is None else
                 f"lies in memory with strides {tuple(layout[1])} and offset {layout[2]}")
        raise UnsupportedOperationError(
            f"{_qualified_name(func)}(x, ...): in torch x {where} (as a view does), and "
            "as_strided reads that memory, which a tensor of a transform does not "
            "have: the engine reads sizes, strides and offset in x's own contiguous layout, "
            "and here it would pick other elements than torch. Fix: call x.contiguous() "
            "first (then offsets and strides count in x itself), or index x explicitly."
        )


def _refresh_view(t):
    """NOTE [Views that outlive a write]
    ``v = x[0]; x.add_(1)``: torch's ``v`` shares memory with ``x`` and sees the write. Here
    ``v`` holds a value computed from ``x``'s old value, so a view remembers how it was made
    and is recomputed from its base when the base has been written since (a view of a view,
    ``x.view(-1)[1:]``, through its own base in turn).

    Writes are rare and reads of views are not (a reshape feeds every next op), so a view
    also remembers the count of writes when it was last brought up to date: while no write
    has happened anywhere since, the walk down its chain of bases is skipped, and a long
    chain of views (``x.flatten().unflatten(...)`` in a loop) costs one comparison per read
    rather than its depth. The front door's shortcuts (``_operator``, the transform mode's
    one-argument case) take such an up-to-date view as they take a tensor that is no view."""
    view = t._view  # (value_of calls this only if a write has happened since its last check)
    base = view.base
    value_of(base)
    if view.generation != base._generation:
        with engine_code():
            t.value = unwrap(view.replay(base))
        view.generation = base._generation
        t._generation += 1  # a new value: views taken of this view refresh in turn
    view.checked = _writes


# How many writes (``_written``) have happened: a view checked since the last is up to date.
_writes = 0


def _written(target):
    """``target`` holds a new value by a write: its views, and views of them, refresh."""
    global _writes
    target._generation += 1
    _writes += 1


def captured_write_words(batched, op=None) -> str:
    """torch.func's words for a write of a transform's value into a tensor that the
    transform does not hold: vmap's where the value has a batch dim (``batched``), else
    autograd's, which name the in-place ``op`` where it is known."""
    if batched:
        return ("vmap: inplace arithmetic(self, *extra_args) is not possible because there "
                "exists a Tensor `other` in extra_args that has more elements than `self`: ")
    return ("During a grad (vjp, jvp, grad, etc) transform, the function provided attempted "
            f"to call in-place operation{f' ({op})' if op else ''} that would mutate a "
            "captured Tensor: ")


def _write(target, new_value, call):
    """Functionalization: an in-place op on ``target`` computed out of place as
    ``new_value``, which becomes ``target``'s value.

    NOTE [Writing through a view]
    A view is a choice of its base's elements. Replaying the view on a tensor of element
    numbers (an arange with the base's shape) says which; a write through the view is then
    a scatter of the new values at those numbers into the base, and the base's other views
    are recomputed when next read (``_refresh_view``). torch's functionalization replays
    views the same way."""
    if type(target) is not FuncTensor:
        batched = batched_by_vmap(new_value)
        # NOTE [Arguments a transform does not differentiate] (transforms.py)
        or_else = "" if batched else (
            ", or pass it to the transformed function as an argument that it does not "
            "differentiate (grad(f)(x, buf) may write into buf)")
        raise InPlaceError(
            f"{call}: {captured_write_words(batched, call)}this writes a value of a transform "
            "into a tensor created outside the transform, which torch.func refuses too (the tensor would have to "
            "hold a value of the transform). Fix: compute out of place, or create the tensor "
            "inside the transformed function (torch.zeros(...) there can be written "
            f"into){or_else}."
        )
    new_value = _conform(target, new_value, call)
    if (not _is_grad_enabled() and grad_mode.grad_off()) or grad_mode.floors[grad_mode.REVERSE]:
        new_value = _keep_grad_identity(target.value, new_value)
    target.value = new_value
    _written(target)
    view = target._view
    if view is not None:
        base = view.base
        base_value = value_of(base)
        if base_value.dtype != target.dtype:
            raise UnsupportedOperationError(
                f"{call}: this writes through a view that reads its base as another dtype "
                f"({base_value.dtype} seen as {target.dtype}, e.g. torch.view_as_real), which "
                "is not supported inside transforms. Fix: build the tensor out of place (for "
                "complex numbers, torch.complex(real, imag))."
            )
        positions = view.replay(torch.arange(base_value.shape.numel(),
                                             device=base_value.device).reshape(base_value.shape))
        if positions.numel() != positions.unique().numel():
            raise InPlaceError(
                f"{call}: this writes through a view in which several elements share one "
                "place of the base (an expand or an overlapping as_strided), so the result "
                "would depend on the order of the writes. Fix: clone the view before writing."
            )
        flat = ops.reshape(base_value, base_value.shape.numel())
        flat = ops.scatter(flat, 0, positions.reshape(-1), ops.reshape(new_value, -1))
        contents = ops.reshape(flat, *base_value.shape)
        if view.func in _DETACHING:
            contents = _keep_grad_identity(base_value, ops.detach(contents), detached=True)
        elif view.func == _DATA:  # (a new method-wrapper object at each lookup)
            contents = _keep_own_derivative(base_value, contents)
        _write(base, contents, call)
        view.generation = base._generation
    return target


_DETACHING = frozenset((torch.Tensor.detach, torch.detach, aten.detach.default))
_DATA = torch.Tensor.data.__get__


def _keep_own_derivative(old, new):
    """A write through ``x.data``: as a write through ``x.detach()`` (NOTE [In-place writes
    under no_grad], its last paragraph), for x's own innermost level only, which is the one
    ``.data`` detaches from (NOTE [x.data under nested transforms] in batching.py); the
    levels outside see the write."""
    if isinstance(old, Value) and old.dispatcher.differentiates:
        level = old.dispatcher
        inner = new.payload if isinstance(new, Value) and new.dispatcher is level else new
        if getattr(old, "requires_grad", False):
            return type(old)(level, inner, old.name)
        if hasattr(old, "tangent"):
            return type(old)(level, inner, old.tangent)
    return new


def _keep_grad_identity(old, new, *, detached=False):
    """NOTE [In-place writes under no_grad]
    In torch, an in-place op under ``no_grad`` on a tensor that requires grad changes its data
    but not its history: gradients flow into it as if the write had not happened (what
    ``var.clamp_(min=eps)`` under no_grad in ``F.gaussian_nll_loss`` relies on). Here the new
    value was computed while the grad levels were off (NOTE [Grad modes and transform
    levels]), so it is a constant for them; each grad level of the old value that is off puts
    the old value's name back on the new one, and its tape sees the same tensor with new
    contents. Batched and forward levels keep the new value's own structure (a batch dim is
    moved to where the old value had it, so the name still means the same layout).

    A write through a detached alias (``detached``: ``v = x.detach(); v.add_(s)``, or
    ``p.detach().clamp_(-c, c)`` for weight clipping) is the same for every derivative level,
    whatever the grad mode: torch's v shares x's memory but not its history, so x's contents
    change and its derivatives do not. ``new`` is then the detached contents: every grad
    level puts back the old value's name, and every forward level its tangent, while the
    formulas downstream read the new contents."""
    if not isinstance(old, Value):
        return new
    level = old.dispatcher
    new_own = isinstance(new, Value) and new.dispatcher is level
    if getattr(old, "requires_grad", False) and (
            detached or (level.obeys_grad_mode and grad_mode.reverse_off(level))):
        inner = new.payload if new_own else new
        return type(old)(level, _keep_grad_identity(old.payload, inner, detached=detached),
                         old.name)
    if detached and hasattr(old, "tangent"):
        inner = new.payload if new_own else new
        return type(old)(level, _keep_grad_identity(old.payload, inner, detached=detached),
                         old.tangent)
    if not new_own:
        return new
    bdim = getattr(old, "bdim", None)
    if bdim is not None:
        payload = new.payload  # the batch dim moved from new.bdim to bdim (a permute)
        if new.bdim != bdim:
            dims = [d for d in range(len(ops.shape_of(payload))) if d != new.bdim]
            dims.insert(bdim, new.bdim)
            payload = ops.permute(payload, *dims)
        return type(new)(level, _keep_grad_identity(old.payload, payload, detached=detached),
                         bdim)
    if hasattr(new, "tangent"):
        return type(new)(level, _keep_grad_identity(old.payload, new.payload, detached=detached),
                         new.tangent)
    return new


def _conform(target, new_value, call):
    """The written value with the target's shape and dtype, as torch's in-place ops do."""
    shape, dtype = tuple(target.shape), target.dtype
    if not isinstance(new_value, (Value, torch.Tensor)):  # a Python number
        return ops.full_like(target.value, new_value)
    new_shape = ops.shape_of(new_value)
    if new_shape != shape:
        if len(new_shape) > len(shape) or any(
                n not in (1, s) for n, s in zip(new_shape[::-1], shape[::-1])):
            raise InPlaceError(
                f"{call}: the result has shape {new_shape}, which cannot be written into a "
                f"tensor of shape {shape}. Fix: make the shapes agree, or compute out of place."
            )
        new_value = ops.expand(new_value, *shape)
    new_dtype = new_value.dtype
    if new_dtype != dtype:
        if not torch.can_cast(new_dtype, dtype):
            raise InPlaceError(
                f"{call}: the result has dtype {new_dtype}, which cannot be cast to the "
                f"tensor's dtype {dtype} in place. Fix: compute out of place, or convert first."
            )
        new_value = ops.convert(new_value, dtype)
    return new_value


def _set_shape(t, shape):
    """Change a FuncTensor's own metadata (for in-place view ops such as ``squeeze_``)."""
    strides = torch._prims_common.make_contiguous_strides_for(shape) if shape else ()
    with torch._C._DisableTorchDispatch():
        torch.Tensor.as_strided_(t, shape, strides)


# --- the front door: torch functions -------------------------------------------------------------
def _qualified_name(func):
    return torch_api.qualified_name(func)


_TORCH_FUNCTIONS = torch_api.TORCH_FUNCTIONS
_ONE_PRIMITIVE = torch_api.ONE_PRIMITIVE
_NUMBER_SECOND = torch_api.NUMBER_SECOND
_TENSOR_OPERAND = torch_api.TENSOR_OPERAND
_RANDOM_FUNCTIONS = torch_api.RANDOM_FUNCTIONS
_VIEWS = torch_api.VIEWS


def _torch_names(kwargs):
    """torch's argument parser takes NumPy's names for two arguments (``axis`` for ``dim``,
    ``keepdims`` for ``keepdim``: ``torch.argsort(x, axis=0)``); the table's ops take torch's."""
    names = {"axis": "dim", "keepdims": "keepdim"}
    return {names[k] if k in names and names[k] not in kwargs else k: v
            for k, v in kwargs.items()}


# NOTE [Functions that return their input]
# torch's ``x.contiguous()`` on a contiguous tensor, ``x.to(x.dtype)``, ``x.float()`` on a
# float tensor and ``x.type_as(x)`` return x itself, so a write into
# the result is a write into x (``y = x.contiguous(); y.add_(1)``). The table computes them
# as ops, whose results are new tensors; these functions return the FuncTensor itself where
# torch would (a contiguous() of a tensor that torch holds transposed is a copy, as in torch:
# NOTE [as_strided reads memory] says how the layout is known).
def _returns_itself(func, args, kwargs):
    x = args[0] if args else None
    if type(x) is not FuncTensor:
        return False
    if func is torch.Tensor.contiguous:
        memory_format = args[1] if len(args) > 1 else kwargs.get("memory_format")
        return (memory_format in (None, torch.contiguous_format)
                and _torch_would_hold_contiguously(x))
    if func is torch.Tensor.float or func is torch.Tensor.double:
        target = torch.float32 if func is torch.Tensor.float else torch.float64
        return x.dtype is target and len(args) == 1 and kwargs.get("memory_format") in (
            None, torch.preserve_format)
    if func is torch.Tensor.type_as:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return (isinstance(other, torch.Tensor) and other.dtype is x.dtype
                and other.device == x.device)
    if func is torch.Tensor.to:
        copy = kwargs.get("copy", False) or any(a is True for a in args[2:4])
        rest = {k: v for k, v in kwargs.items() if k != "copy"}
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **rest)
        except (TypeError, RuntimeError):
            return False  # torch's own error comes from the op
        return (not copy and dtype in (None, x.dtype)
                and (device is None or torch.device(device) == x.device)
                and memory_format in (None, torch.preserve_format))
    return False


_ALIASING = frozenset((torch.Tensor.contiguous, torch.Tensor.float, torch.Tensor.double,
                       torch.Tensor.type_as, torch.Tensor.to))


def _torch_would_hold_contiguously(x):
    """Whether torch holds the tensor behind FuncTensor x contiguously (the witnesses of
    NOTE [as_strided reads memory])."""
    value = value_of(x)
    if not isinstance(value, Value):
        return value.is_contiguous()
    return all(layout is not None and _lies_contiguously(*layout[:2])
               for layout in _torch_layouts(x, value))


def _lies_contiguously(sizes, strides):
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# the front-door functions that need the FuncTensor itself, not only its value
_SPECIAL_CALLS = {**dict.fromkeys(_STORAGE_READERS, "storage"),
                  **dict.fromkeys(_ALIASING, "alias")}


def call_function(func, args, kwargs):
    """A torch function called with a FuncTensor among its arguments (``__torch_function__``)."""
    op = _TORCH_FUNCTIONS.get(func)
    if op is not None:
        special = _SPECIAL_CALLS.get(func)
        if special is not None:
            if special == "storage":
                _check_storage_read(func, args, kwargs)
            elif _returns_itself(func, args, kwargs):
                return args[0]
        if kwargs:
            if kwargs.get("out") is not None:
                raise _out_error(func, args)
            if "axis" in kwargs or "keepdims" in kwargs:
                kwargs = _torch_names(kwargs)
            out = op(*unwrap_all(args, func), **_unwrap_kwargs(kwargs))
        elif len(args) == 1 and type(args[0]) is FuncTensor:
            x = args[0]  # one FuncTensor argument: unwrap_all written out
            value = x.value if x._view is None else value_of(x)
            prim = _ONE_PRIMITIVE.get(func)
            if prim is not None and isinstance(value, Value):
                # NOTE [Functions that are one primitive] (torch_api.py)
                out = value.dispatcher.apply(prim, value)
            else:
                out = op(value)
        elif (len(args) == 2 and type(args[1]) in NUMBERS and type(args[0]) is FuncTensor
              and args[0]._view is None and func in _NUMBER_SECOND
              and isinstance(args[0].value, Value)):  # x * 1.1: the same, with a number
            value = args[0].value
            out = value.dispatcher.apply(_NUMBER_SECOND[func], value, args[1])
        else:
            out = op(*unwrap_all(args, func))
        if isinstance(out, Value):  # the common case, written out: this is the hot path
            shape, dtype, device = out.metadata()
            result = _make_wrapper(FuncTensor, shape, None, None, None, dtype, _STRIDED, device)
            result.value = out
        elif out is NotImplemented:  # the op declines this call: torch lowers it instead
            return _back_door(func, args, kwargs)
        else:
            result = _wrap_result(out)
        is_view = _VIEWS.get(func)
        if is_view is not None and is_view(args):
            _record_views(result, args[0], func, args[1:], kwargs)
        return result
    op = torch_api.IN_PLACE.get(func)
    if op is not None:
        if kwargs.get("out") is not None:
            raise _out_error(func, args)
        new_value = op(*unwrap_all(args, func), **_unwrap_kwargs(kwargs))
        return _write(args[0], new_value, f"{_qualified_name(func)}(...)")
    activation = torch_api.ACTIVATIONS.get(func)
    if activation is not None:
        op, position = activation
        kwargs = dict(kwargs)
        in_place = kwargs.pop("inplace", False)
        if len(args) > position:
            in_place = args[position]
            args = args[:position]
        if kwargs.get("out") is not None:
            raise _out_error(func, args)
        new_value = op(*unwrap_all(args, func), **_unwrap_kwargs(kwargs))
        if in_place:
            return _write(args[0], new_value, f"{_qualified_name(func)}(..., inplace=True)")
        return wrap(new_value) if isinstance(new_value, Value) else _wrap_result(new_value)
    updating = torch_api.UPDATES.get(func)
    if updating is not None:
        op, written = updating
        out, new_values = op(*unwrap_all(args, func), **_unwrap_kwargs(kwargs))
        call = f"{_qualified_name(func)}(...)"
        for target, new_value in zip(written(*args, **kwargs), new_values):
            _write(target, new_value, call)
        return wrap(out) if isinstance(out, Value) else _wrap_result(out)
    refusal = torch_api.REFUSED.get(func)
    if refusal is not None:
        raise _refusal(func, refusal)
    if func in _STORAGE_READERS:
        _check_storage_read(func, args, kwargs)
    if func is torch.Tensor.is_contiguous and type(args[0]) is FuncTensor:
        memory_format = args[1] if len(args) > 1 else kwargs.get("memory_format")
        ops.refuse_memory_format_under_vmap("Tensor.is_contiguous", value_of(args[0]),
                                            memory_format, (None, torch.contiguous_format))
    return _back_door(func, args, kwargs)


def _wrapped(out, func, args):
    """What call_function returns for ``out``, the result of ``func(*args)``'s primitive (for
    the shortcuts that bind it themselves: none of them is a view)."""
    if isinstance(out, Value):
        shape, dtype, device = out.metadata()
        result = _make_wrapper(FuncTensor, shape, None, None, None, dtype, _STRIDED, device)
        result.value = out
        return result
    return _back_door(func, args, {}) if out is NotImplemented else _wrap_result(out)


# NOTE [vmap's elementwise ops at the front door]
# An elementwise op under vmap, on one batched tensor (and maybe a number), is the commonest
# call there is, and when the batched value's payload is a plain tensor its level's whole
# work is the kernel on the payload, the batch dim kept where it is (NOTE [The commonest
# cases, written out] in batching.py). The front door does that work itself: no apply, and
# the result's metadata is the input's shape with the kernel's dtype. It saves about 1 us of
# the 5 that such an op costs (torch.func, in C++: 2). The level must still be running: a
# value that escaped its vmap takes the level's own path (NOTE [Values that escape a
# transform]). batching.py, which this module sits below, gives the value class and the
# primitives that keep the batch dim.
batched_value_type = None  # BatchedValue (set by batching.py)
chain_to_bottom = None  # batching.chain_to_bottom: a chain of vmap values over one tensor
beside_a_tensor = None  # batching.beside_a_tensor: a vmap value and a plain tensor
keeps_batch_dim = frozenset()  # the primitives whose batching keeps the dim (batching.py)


def _batched_elementwise(prim, value, rest):
    """``prim(value, *rest)`` for a vmap value over a plain tensor (or over a chain of vmap
    values over one: nested vmaps, each keeping its batch dim where it is, as
    ``Batched._keeping_bdim`` does level by level) and a ``prim`` that keeps the batch dim, as
    a FuncTensor; None for every other case (the general path runs)."""
    if prim not in keeps_batch_dim or value.dispatcher.exited:
        return None  # (prim None: a function that is not one primitive)
    payload = value.payload
    if type(payload) is torch.Tensor:
        out = prim.impl(payload, *rest)
        out_value = batched_value_type(value.dispatcher, out, value.bdim)
    else:
        chain = chain_to_bottom(value)
        if chain is None:
            return None
        links, payload = chain
        out = out_value = prim.impl(payload, *rest)
        for link in reversed(links):
            out_value = batched_value_type(link.dispatcher, out_value, link.bdim)
    shape, _, device = value.metadata()  # (a kernel of one tensor and numbers stays on its
    dtype = out.dtype                      # device; its dtype may change: abs of complex)
    out_value._metadata = (shape, dtype, device)
    result = _make_wrapper(FuncTensor, shape, None, None, None, dtype, _STRIDED, device)
    result.value = out_value
    return result


def _back_door(func, args, kwargs):
    """torch lowers the call to aten ops, which reach __torch_dispatch__."""
    with torch._C.DisableTorchFunctionSubclass():
        if vmap_running is not None and vmap_running():
            with _FactoryDraws():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# NOTE [Random draws inside torch's own Python code]
# torch.svd_lowrank draws ``torch.randn(n, q)`` in its Python body, and F.fractional_max_pool
# its window samples with ``torch.rand``. They reach the back door above, where torch runs
# the body with the transform mode switched off (a mode is off inside its own handler), so
# those draws would be plain tensors, the same for every example, whatever ``randomness``
# says. Under vmap the back door therefore runs the body under a dispatch mode that sees the
# aten factory calls such a body makes (``aten.randn`` with no tensor argument: nothing else
# would tell the engine about them) and draws them as the transform mode draws torch.randn
# (randomness.py); every other aten op passes through untouched. torch.func needs no such
# step: its vmap is a dispatch key that sees every aten call.
vmap_running = None  # set by randomness.py: is a vmap level running in this thread?
_FACTORY_DRAWS = {
    aten.rand.default: torch.rand, aten.randn.default: torch.randn,
    aten.randint.default: torch.randint, aten.randint.low: torch.randint,
    aten.randperm.default: torch.randperm, aten.normal.float_float: torch.normal,
}


class _FactoryDraws(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        factory = _FACTORY_DRAWS.get(func)
        if factory is not None:
            kw = {k: v for k, v in kwargs.items()
                  if v is not None and k not in ("layout", "pin_memory")}
            result = _RANDOM_FUNCTIONS[factory](factory, args, kw)
            if result is not NotImplemented:
                return _wrap_result(result)
        return func(*args, **kwargs)


def _refusal(func, refusal):
    what, fix = refusal
    return UnsupportedOperationError(
        f"{_qualified_name(func)}: {what} is not supported inside minifunctorch transforms. "
        f"Fix: {fix}"
    )


def _out_error(func, args):
    """The refusal of ``out=`` inside a transform, with torch.func's words for it: its vmap
    has no batching rule for the op's out= overload, and its grad levels no derivative."""
    name = getattr(func, "__name__", "op")
    if any(batched_by_vmap(unwrap(a)) for a in args):
        words = (f"Batching rule not implemented for aten::{name}.out; the fallback path "
                 "doesn't work on out= or view ops")
    else:
        words = (f"{name}(): functions with out=... arguments don't support automatic "
                 "differentiation, but one of the arguments requires grad")
    return InPlaceError(
        f"{_qualified_name(func)}(..., out=...): {words} (as in torch.func): writing into an "
        "out= tensor inside a transform is not supported. Fix: use the returned value."
    )


# --- the back door: aten ops ---------------------------------------------------------------------
def _torch_autograd_enabled():
    """Inside ``__torch_dispatch__`` torch has switched its own autograd off. Plain tensors
    at the bottom of a value may be parameters that require grad (MAML's outer
    ``.backward()``), so torch's autograd is switched back on while the engine works.
    (A guard object rather than a generator-based contextmanager: NOTE [Context managers on
    the hot path]; every call through the aten door enters it.)"""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(_AUTOGRAD_CPU).remove(
        _AD_INPLACE_OR_VIEW)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_AUTOGRAD_CPU = torch._C.DispatchKey.AutogradCPU
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


def call_aten(func, args, kwargs):
    """An aten op with a FuncTensor among its arguments (``__torch_dispatch__``)."""
    door = grad_mode.door  # NOTE [Grad mode inside the back door] (grad_mode.py)
    depth = door[0]
    outer_mode = door[1]
    if depth == 0:
        door[1] = _is_grad_enabled()
    door[0] = depth + 1
    try:
        with _torch_autograd_enabled():
            return _call_aten(func, args, kwargs)
    finally:
        door[0] = depth
        door[1] = outer_mode


def _call_aten(func, args, kwargs):
    if func._schema.is_mutable and func not in aten_api.ATEN_OPS:
        # (an in-place op registered in the table does its own writes: batch norm's
        # _native_batch_norm_legit and _batch_norm_with_update update running statistics)
        return _functionalize(func, args, kwargs)
    values = unwrap_all(args)
    kw = _unwrap_kwargs(kwargs)
    top = top_dispatcher(pytree.tree_leaves((values, kw), none_is_leaf=True))
    if top is None:
        # only tensors that no level owns: torch's own kernel computes the result
        result = _wrap_result(func(*values, **kw))
    else:
        op = aten_api.ATEN_OPS.get(func) or aten_api.ATEN_OPS.get(func.overloadpacket)
        if op is not None:
            result = _wrap_result(op(*values, **kw))
        elif aten_api.is_random_generator(func):
            result = _wrap_result(top.random_op(str(func), runner(func), values, kw))
        else:
            decomposition = aten_api.decomposition(func)
            if decomposition is not None:
                # The mode makes the tensors a decomposition creates FuncTensors, so that it
                # may write into them; and its outputs, which came out of other doors, are
                # shown as fresh tensors, as torch requires of __torch_dispatch__.
                with user_code():
                    out = decomposition(*args, **kwargs)
                result = _wrap_result(unwrap_tree(out))
            elif torch.Tag.nondeterministic_seeded in func.tags and top.draws_random_numbers:
                result = _wrap_result(top.random_op(str(func), runner(func), values, kw))
            else:
                result = _wrap_result(top.unknown_op(str(func), runner(func), values, kw))
    if aten_api.is_view(func) and args and type(args[0]) is FuncTensor:
        _record_views(result, args[0], func, args[1:], kwargs)
    return result


def runner(func):
    """``run(values, kwargs)``: ``func`` (an aten op or a torch function) on values of a lower
    level, through call_with_tensors, for a level's ``unknown_op`` and ``random_op``."""
    def run(values, kwargs):
        return call_with_tensors(func, *values, **kwargs)
    return run


def _with_defaults(func, args):
    """The positional arguments of an aten call with the schema's defaults filled in (the
    out-of-place overload may have no default where the in-place one has: bernoulli_'s p)."""
    positional = [a for a in func._schema.arguments if not a.kwarg_only]
    missing = positional[len(args):]
    if not missing or any(not a.has_default_value() for a in missing):
        return args
    return tuple(args) + tuple(a.default_value for a in missing)


def _functionalize(func, args, kwargs):
    """(b) of NOTE [Two doors]: an in-place aten op, computed out of place."""
    schema = func._schema
    written = [i for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    call = f"{func}(...)"
    if any(schema.arguments[i].kwarg_only for i in written):
        raise InPlaceError(
            f"{call}: writing into an out= tensor inside a transform is not supported. Fix: "
            "use the returned value."
        )
    write = aten_api.IN_PLACE_ONLY.get(func)
    if write is not None:
        new_value = write(func, *unwrap_all(args), **_unwrap_kwargs(kwargs))
        if new_value is not NotImplemented:
            return _write(args[0], new_value, call)
    functional = aten_api.functional_variant(func)
    if functional is None:
        raise UnsupportedOperationError(
            f"{call}: the in-place op has no out-of-place form, so it cannot run on a value "
            "of a transform. Fix: write the computation out of place."
        )
    result = functional(*_with_defaults(func, args), **kwargs)
    results = result if isinstance(result, (list, tuple)) else (result,)
    for position, out in zip(written, results):
        target = args[position]
        new_value = unwrap(out)
        if aten_api.changes_metadata(func) and type(target) is FuncTensor:
            target.value = new_value  # squeeze_, t_, ...: the tensor takes the new shape
            _written(target)
            _set_shape(target, tuple(new_value.shape))
        else:
            _write(target, new_value, call)
    written_args = tuple(args[i] for i in written)
    return written_args[0] if len(written_args) == 1 else written_args


# --- the mode: tensors created while user code runs inside a transform ---------------------------
# Called with each plain tensor that an in-place torch function is about to write, and the
# call's name, while user code runs inside a transform; each may refuse the write. Filled by
# the modules above this one: autograd.py (NOTE [A tape has no version counter]) and
# tracing.py (NOTE [A traced function that writes a tensor it closes over]).
plain_write_guards = []
# While a trace runs: called with the result of each torch function of plain tensors that
# user code calls (tracing.py's record of the tensors created during the trace)
plain_results_hook = None


def _writes_in_place(func) -> bool:
    """torch's naming: ``add_``, ``embedding_renorm_``, ``__setitem__``, ``__iadd__``."""
    name = getattr(func, "__name__", "")
    if name.endswith("__"):
        return name == "__setitem__" or name.startswith("__i")
    return name.endswith("_")


class _TransformMode(TorchFunctionMode):
    """Active while a transform runs user code (NOTE [Tensors created inside a transform])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if len(args) == 1 and not kwargs:
            x = args[0]
            # (a tensor that is no view, or an up-to-date one: NOTE [Views that outlive a write])
            if type(x) is FuncTensor and (x._view is None or x._view.checked == _writes):
                value = x.value
                prim = _ONE_PRIMITIVE.get(func)
                if type(value) is batched_value_type:
                    # NOTE [vmap's elementwise ops at the front door]
                    result = _batched_elementwise(prim, value, ())
                    if result is not None:
                        return result
                elif prim is not None and isinstance(value, Value):
                    # NOTE [Functions that are one primitive] (torch_api.py): what
                    # call_function does for them, without its lookups (none of them is a view,
                    # a storage reader or a random function)
                    return _wrapped(value.dispatcher.apply(prim, value), func, args)
        kwargs = kwargs or {}
        draw = _RANDOM_FUNCTIONS.get(func)
        if draw is not None:  # torch.rand & co under vmap (randomness.py)
            result = draw(func, args, kwargs)
            if result is not NotImplemented:
                return _wrap_result(result)
        if FuncTensor in types:
            return call_function(func, args, kwargs)
        if func in torch_api.FACTORIES:
            return _wrap_result(func(*args, **kwargs))
        if func in torch_api.REFUSED_IN_TRANSFORMS:  # even on plain tensors: Tensor.backward()
            raise _refusal(func, torch_api.REFUSED_IN_TRANSFORMS[func])
        if plain_write_guards:
            if args and isinstance(args[0], torch.Tensor) and _writes_in_place(func):
                for guard in plain_write_guards:
                    guard(args[0], f"{_qualified_name(func)}(...)")
            written = torch_api.WRITES_AN_ARGUMENT.get(func)
            target = written(*args, **kwargs) if written is not None else kwargs.get("out")
            for target in (target if isinstance(target, (tuple, list)) else (target,)):
                if isinstance(target, torch.Tensor):
                    for guard in plain_write_guards:
                        guard(target, f"{_qualified_name(func)}(...)")
        if plain_results_hook is None:
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        plain_results_hook(result, args, kwargs)
        return result


_MODE = _TransformMode()


def _mode_on_top():
    depth = torch._C._len_torch_function_stack()
    return depth > 0 and torch._C._get_function_stack_at(depth - 1) is _MODE


# NOTE [Context managers on the hot path]
# A transform call enters user_code and engine_code a few times each; a small class is
# about five times cheaper to enter and leave than a generator-based contextmanager.
class _UserCode:
    """While a transform calls user code: the mode is on."""
    __slots__ = ("pushed",)

    def __enter__(self):
        self.pushed = not _mode_on_top()
        if self.pushed:
            torch._C._push_on_torch_function_stack(_MODE)

    def __exit__(self, *exc_info):
        if self.pushed:
            popped = torch._C._pop_torch_function_stack()
            assert popped is _MODE, "the transform mode must be popped by the call that pushed it"


class _EngineCode:
    """While the engine works inside user code (a nested transform): the mode is off."""
    __slots__ = ("popped",)

    def __enter__(self):
        self.popped = _mode_on_top()
        if self.popped:
            torch._C._pop_torch_function_stack()

    def __exit__(self, *exc_info):
        if self.popped:
            torch._C._push_on_torch_function_stack(_MODE)


def user_code():
    """``with user_code():`` while a transform runs user code (the transform mode on)."""
    return _UserCode()


def engine_code():
    """``with engine_code():`` while the engine works inside user code (the mode off)."""
    return _EngineCode()
