"""jit: trace once per input signature, then replay straight-line code.

NOTE [What a cache hit costs]
A call flattens its arguments (optree, in C), builds the signature (pytree structure, and
for each tensor its shape, dtype and device; other leaves by value, as static arguments),
looks it up, and calls the generated function. The generated function is plain Python with
the torch calls written out and the captured constants bound as its globals, so nothing is
interpreted per call. ``backend='inductor'`` hands the exported FX graph to torch.compile.

NOTE [jit under other transforms]
Called on values of a transform (``vmap(jit(f))``, ``grad(jit(f))``), jit still traces once
for the signature, but evaluates the program with ``bind``, equation by equation, so the
surrounding transform applies its rules to each of them. This is how a jaxpr is handled
inside JAX's transforms.

NOTE [A bounded cache]
Each signature keeps a traced program and its generated code alive, so a jit called over
ever new shapes would grow without end (800 shapes held about 77 MB). The cache keeps the
``max_signatures`` most recently used (64 unless given) and drops the least recently used one
beyond that: a dropped signature is traced again if it comes back. torch.compile bounds its
recompilations the same way (``torch._dynamo.config.cache_size_limit``); JAX's jit caches
are LRU caches too.
"""
import collections
import functools

import torch

from . import primitives as P
from . import pytree
from . import tensor as tensor_module
from .fast_code import reusable_equations, unless_recorded
from .tensor import as_tensor, engine_code, unwrap
from .values import Value
from .errors import TransformUsageError
from .passes import fold_identity_bases, simplify
from .program import write_inputs
from .tracing import trace_flat


def _signature(leaves):
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((leaf.shape, leaf.dtype, leaf.device))
        elif isinstance(leaf, Value):
            parts.append(("transformed", tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TransformUsageError(
                    f"jit(f)(<inputs>): a non-tensor argument of type {type(leaf).__name__} is "
                    "static and must be hashable. Fix: pass it as a tensor, or as a hashable "
                    "value (a number, a string, a tuple)."
                ) from None
            # with its type: 1 == 1.0 == True, but x * 1 and x * 1.0 differ for integer x
            parts.append(("static", type(leaf), leaf))
    return tuple(parts)


class _Compiled:
    __slots__ = ("program", "run", "out_treedef", "has_transformed_constants", "key", "draws")

    def __init__(self, program, backend, key):
        self.key = key  # its entry in jit._cache
        self.program = program
        self.out_treedef = program.out_treedef
        self.draws = any(equation.prim is P.draw_p for equation in program.equations)
        self.has_transformed_constants = any(isinstance(c, Value)
                                             for _, c in program.constants)
        if self.has_transformed_constants:
            self.run = None
        elif backend is None:
            # the same bits, faster: NOTE [Number operands as tensors] (primitives.py) and
            # NOTE [Buffer reuse in generated code] (fast_code.py)
            self.run = program.compile_python(number_tensors=True)
            if reusable_equations(program):
                self.run = unless_recorded(
                    program.compile_python(reuse_buffers=True, number_tensors=True), self.run,
                    program.constants)
        elif backend == "inductor":
            graph_module = program.to_fx()
            self.run = torch.compile(graph_module, backend="inductor", dynamic=False)
        else:
            raise TransformUsageError(
                f"jit(f, backend={backend!r}): expected backend=None (generated Python) or "
                "'inductor' (torch.compile)."
            )


def _draws_under_a_vmap(compiled):
    """Whether a program that draws is called while a vmap runs, with plain tensors (the
    vmapped function passes it none of its values): its draws follow that vmap's
    ``randomness`` when the program is evaluated (NOTE [A program's draw under an outer
    vmap] in randomness.py), which the generated code, made for one call, cannot."""
    return compiled.draws and tensor_module.vmap_running()


class jit:
    """Compile ``f``: trace it once per input signature and replay the generated code.

    >>> import torch
    >>> from minifunctorch.core import jit, grad
    >>> f = jit(grad(lambda x: (x.sin() ** 2).sum()))
    >>> f(torch.zeros(3))
    tensor([0., 0., 0.])
    >>> f.cache_size()
    1

    ``f.program_for(*args)`` returns the Program that a call with these arguments replays.
    At most ``max_signatures`` programs are kept, the most recently used (NOTE [A bounded
    cache]). A program replays only what it recorded: a random draw inside ``f`` is made
    anew at each call, from torch's generator (NOTE [Random numbers in a traced program] in
    tracing.py), and under a vmap around the program it follows vmap's ``randomness``
    (NOTE [A program's draw under an outer vmap] in randomness.py); a write into a tensor
    that ``f`` closes over is refused (NOTE [A traced function that writes a tensor it
    closes over]); writes into its arguments happen at every call (NOTE [A traced function
    that writes its inputs] in program.py); a ``torch.no_grad()`` region stays one (NOTE [A
    no_grad region in a traced function]); and the checks that read values (indices in
    range, BCE's probabilities) are steps of the program, made at every call. The passes
    keep IEEE arithmetic: ``x * 0`` stays a product, NaN where x is inf or NaN, as in eager
    code (NOTE [Zero times infinity] in passes.py).
    """

    def __init__(self, f, backend=None, *, max_signatures=64):
        if backend not in (None, "inductor"):
            raise TransformUsageError(
                f"jit(f, backend={backend!r}): expected backend=None (generated Python) or "
                "'inductor' (torch.compile)."
            )
        if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or \
                max_signatures < 1:
            raise TransformUsageError(
                f"jit(f, max_signatures={max_signatures!r}): expected a positive int, the "
                "number of input signatures whose programs are kept."
            )
        functools.update_wrapper(self, f)
        self.function = f
        self.backend = backend
        self.max_signatures = max_signatures
        self._cache = collections.OrderedDict()  # signature -> _Compiled, least recent first
        self._plain_cache: dict = {}  # the same entries, for calls with plain tensors only

    def __call__(self, *args, **kwargs):
        if not kwargs:
            # fast path: plain tensors only, looked up by their types without flattening
            try:
                compiled = self._plain_cache.get(
                    tuple((a.shape, a.dtype, a.device) if type(a) is torch.Tensor else None
                          for a in args))
            except AttributeError:  # an argument without a shape: use the general path
                compiled = None
            if compiled is not None and not _draws_under_a_vmap(compiled):
                self._cache.move_to_end(compiled.key)
                outputs = compiled.run(*args)
                if compiled.program.writes:  # NOTE [A traced function that writes its inputs]
                    outputs = write_inputs(compiled.program, args, outputs, self._call())
                return pytree.tree_unflatten(compiled.out_treedef, list(outputs))
        callers, treedef = pytree.tree_flatten((args, kwargs))
        leaves = [unwrap(leaf) for leaf in callers]
        key = (treedef, _signature(leaves))
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
        else:
            compiled = self._compile(args, kwargs, key)
            if not kwargs and compiled.run is not None and \
                    all(type(a) is torch.Tensor for a in args):
                self._plain_cache[tuple((a.shape, a.dtype, a.device) for a in args)] = compiled
        arrays = [isinstance(leaf, (torch.Tensor, Value)) for leaf in leaves]
        tensors = [leaf for leaf, is_array in zip(leaves, arrays) if is_array]
        if (compiled.run is None or any(isinstance(t, Value) for t in tensors)
                or _draws_under_a_vmap(compiled)):
            # values of an enclosing transform: the program is evaluated with bind, so that
            # the transform applies its rules to each equation
            with engine_code():
                outputs = [as_tensor(o) for o in compiled.program.evaluate_flat(tensors)]
        else:
            outputs = compiled.run(*tensors)
        if compiled.program.writes:  # into the caller's tensors, FuncTensors as they are
            outputs = write_inputs(compiled.program, [
                leaf for leaf, is_array in zip(callers, arrays) if is_array], outputs,
                self._call())
        return pytree.tree_unflatten(compiled.out_treedef, list(outputs))

    def _compile(self, args, kwargs, key):
        program = simplify(fold_identity_bases(simplify(trace_flat(self.function, args,
                                                                   kwargs))))
        compiled = _Compiled(program, self.backend, key)
        if not compiled.has_transformed_constants:
            self._cache[key] = compiled
            while len(self._cache) > self.max_signatures:
                _, dropped = self._cache.popitem(last=False)
                for plain_key in [k for k, c in self._plain_cache.items() if c is dropped]:
                    del self._plain_cache[plain_key]
        return compiled

    def program_for(self, *args, **kwargs):
        """The (simplified) Program that a call with these arguments runs."""
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        leaves = [unwrap(leaf) for leaf in leaves]
        key = (treedef, _signature(leaves))
        compiled = self._cache.get(key) or self._compile(args, kwargs, key)
        return compiled.program

    def _call(self):
        """The call as the user wrote it, for errors."""
        return f"jit({getattr(self.function, '__name__', 'f')})(<inputs>)"

    def cache_size(self) -> int:
        """How many signatures have a traced program in the cache (at most max_signatures)."""
        return len(self._cache)

    def __repr__(self):
        return f"jit({getattr(self.function, '__name__', 'f')}, backend={self.backend!r})"
