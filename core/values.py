"""A level's values, and ``bind``: the smallest piece of the engine.

NOTE [Values and tensors]
Each interpreter level (dispatcher) has its own kind of value: an ``AutogradValue`` carries a
name its tape refers to, a ``BatchedValue`` a hidden batch dim, a ``ForwardValue`` a
tangent. A value's ``payload`` is a value of a lower level, or at the very bottom a plain
``torch.Tensor`` (the seed's FuncTensor chain; a Tracer in Autodidax). Values are light
Python objects: the rules of every level compute with them, through ``ops``.

User code never holds a value directly. It holds a ``FuncTensor`` (tensor.py): a real
``torch.Tensor`` that shows one value to torch, so that ``isinstance(x, torch.Tensor)``,
nn.Module internals and torch's own Python code all accept it. Keeping the two apart is what
keeps the engine fast: a torch.Tensor subclass costs about ten times more to create than a
light object, and only the values user code sees need one.

``bind(prim, *args)`` finds the highest level among its arguments and lets that level
``apply`` the primitive (Autodidax's ``find_top_trace``). The level runs its rule, and the
rule calls ops on the payloads, which ``bind`` again, one level down. Anything that is not a
value (a plain tensor, a Python number) is a constant for every level; with no value among
the arguments, ``bind`` is a direct torch call.
"""
import torch

from .names import fresh_name


# The Python numbers an op may take beside its tensors: constants to every level.
NUMBERS = (int, float, bool, complex)


class Value:
    """A value of one dispatcher level; its payload lives one level down.

    >>> import torch
    >>> from minifunctorch.core import Autograd, Torch
    >>> from minifunctorch.core.values import Value
    >>> v = Value(Autograd(Torch()), torch.ones(2, 3))
    >>> v.shape, v.dtype
    (torch.Size([2, 3]), torch.float32)
    """

    __slots__ = ("dispatcher", "payload", "_name", "_metadata")

    def __init__(self, dispatcher, payload, name=None):
        self.dispatcher = dispatcher
        self.payload = payload
        self._name = name
        self._metadata = None

    @property
    def name(self) -> str:
        """A readable name (v0, v1, ... or a label), given on first use."""
        if self._name is None:
            payload = self.payload
            if isinstance(payload, Value):
                self._name = payload.name
            else:
                self._name = getattr(payload, "t_name", None) or fresh_name()
        return self._name

    # (read from the kept metadata: a chain of levels is walked once per value, not per read)
    @property
    def shape(self) -> torch.Size:
        return self.metadata()[0]

    @property
    def dtype(self):
        return self.metadata()[1]

    @property
    def device(self):
        return self.metadata()[2]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim=None):
        shape = self.shape
        return shape if dim is None else shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def metadata(self):
        """(shape, dtype, device) in one call: what a FuncTensor showing this value needs.

        A level whose values look like their payloads asks the payload once, where the three
        properties would each walk down the payload chain (this is the hot path). A value
        never changes its payload (a write makes a new value), so the answer is kept: under
        grad both the tape entry and the FuncTensor of an op's result ask for it. A value type
        that overrides ``shape``, ``dtype`` or ``device`` overrides ``_own_metadata``
        (BatchedValue, on the hot path, overrides this method with both written out)."""
        metadata = self._metadata
        if metadata is None:
            metadata = self._metadata = self._own_metadata()
        return metadata

    def _own_metadata(self):
        payload = self.payload
        if isinstance(payload, Value):
            return payload.metadata()
        return payload.shape, payload.dtype, payload.device

    def concrete(self):
        """The concrete tensor behind this value, for Python control flow.

        Autograd and Forward values have one (their primal); a batched or traced value does
        not, and its level raises a clear error.
        """
        return self.dispatcher.concrete(self)

    def __repr__(self):
        return (f"{type(self).__name__}({self.name}, level={self.dispatcher.level}, "
                f"{self.payload!r})")


def bind(prim, *args, **params):
    """Apply a primitive at the highest level among its arguments (a torch call if none)."""
    top = None
    top_level = 0
    for arg in args:
        if isinstance(arg, Value):
            level = arg.dispatcher.level
            if level > top_level:
                top, top_level = arg.dispatcher, level
    if top is None:
        return prim.impl(*args, **params)
    return top.apply(prim, *args, **params)


def top_dispatcher(values):
    """The highest level among ``values`` (None if none of them is a value)."""
    top = None
    for value in values:
        if isinstance(value, Value) and (top is None or value.dispatcher.level > top.level):
            top = value.dispatcher
    return top


def batched_by_vmap(value) -> bool:
    """Whether a vmap level batches ``value`` (one of the levels in its payload chain)."""
    while isinstance(value, Value):
        if value.dispatcher.transform_name == "vmap":
            return True
        value = value.payload
    return False


def bottom_tensor(value):
    """The plain tensor at the bottom of a value's payload chain (a meta tensor if traced)."""
    while isinstance(value, Value):
        value = value.payload
    return value


def map_tensors(function, tree):
    """Apply ``function`` to every tensor or value in a tree of lists, tuples and dicts."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(function, item) for item in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(function, v) for k, v in tree.items()}
    if isinstance(tree, (torch.Tensor, Value)):
        return function(tree)
    return tree


def lower_tree(level, tree):
    """Replace the values of ``level`` in a tree by their payloads (one level down)."""
    return map_tensors(lambda v: v.payload if isinstance(v, Value) and v.dispatcher is level
                       else v, tree)
