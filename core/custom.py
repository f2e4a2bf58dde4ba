"""custom_vjp: a function with a hand-written backward, honoured by every transform.

NOTE [A custom function is a primitive]
``@custom_vjp`` turns a function into a primitive of its own: its torch implementation is
the function, and its rules are built from ``fwd`` and ``bwd``.
- Autograd uses ``fwd``/``bwd`` as the differentiator pair. Levels below see the ops inside
  ``fwd`` and ``bwd`` as ordinary ops, so the backward is itself differentiable (JAX does the
  same).
- Forward mode has no use for a vjp: it differentiates the function itself.
- Batching makes a new custom function whose function, ``fwd`` and ``bwd`` are vmapped, and
  binds it one level down, so an Autograd level below vmap still sees a custom function (the
  seed's "batchify" of ``custom_vjp``).
"""
import functools

from .autograd import vjp_rules
from .batching import batching_rules
from .errors import TransformUsageError
from .forward import jvp_rules
from .primitives import Primitive
from .tensor import as_tensor, as_tensors, unwrap_all, unwrap_tree
from .values import bind


def _run_custom_backward(custom, saved, count, ct):
    # fwd and bwd are user code: they receive tensors, and give tensors back
    cts = unwrap_tree(custom.bwd(as_tensors(saved), as_tensor(ct)))
    if not isinstance(cts, tuple) or len(cts) != count:
        got = f"a tuple of length {len(cts)}" if isinstance(cts, tuple) else type(cts).__name__
        raise TransformUsageError(
            f"{custom.prim.name}: the custom backward must return a tuple with one cotangent "
            f"per argument ({count}), got {got}. Fix: return (ct_x, ct_y, ...), with None for "
            "arguments that get no gradient."
        )
    return cts


class custom_vjp:
    """Decorator for a function with a custom backward.

    >>> import torch
    >>> from minifunctorch.core import custom_vjp, grad
    >>> @custom_vjp
    ... def halve_gradient(x):
    ...     return x
    >>> def halve_gradient_fwd(x):
    ...     return x, ()
    >>> def halve_gradient_bwd(saved, ct):
    ...     return (ct * 0.5,)
    >>> _ = halve_gradient.defvjp(halve_gradient_fwd, halve_gradient_bwd)
    >>> grad(lambda x: halve_gradient(x).sum())(torch.ones(2))
    tensor([0.5000, 0.5000])

    ``fwd(*args)`` returns ``(out, saved)``; ``bwd(saved, cotangent)`` returns a tuple with
    one cotangent per argument (``None`` for arguments without a gradient).
    """

    def __init__(self, function, *, fwd=None, bwd=None):
        functools.update_wrapper(self, function)
        self.function = function
        self.fwd = None
        self.bwd = None
        self.prim = Primitive(getattr(function, "__name__", "custom_vjp"),
                              lambda *args: unwrap_tree(function(*args)))
        self._batched_versions = {}
        if fwd is not None:
            self.defvjp(fwd, bwd)

    def defvjp(self, fwd, bwd):
        """Attach the forward (returns ``(out, saved)``) and backward (``bwd(saved, ct)``)."""
        self.fwd, self.bwd = fwd, bwd
        prim = self.prim
        vjp_rules[prim] = self._vjp_rule
        jvp_rules[prim] = self._jvp_rule
        batching_rules[prim] = self._batching_rule
        return self

    def __call__(self, *args):
        if self.fwd is None:
            raise TransformUsageError(
                f"{self.prim.name}(...): this custom_vjp function has no backward yet. Fix: "
                f"call {self.prim.name}.defvjp(fwd, bwd) before using it."
            )
        return as_tensor(bind(self.prim, *unwrap_all(args)))

    def _vjp_rule(self, *args):
        out, saved = unwrap_tree(self.fwd(*as_tensors(args)))
        # The closure captures only `saved` (and the backward): that is the saved context.
        return out, functools.partial(_run_custom_backward, self, saved, len(args))

    def _jvp_rule(self, primals, tangents):
        from .transforms import jvp
        from . import ops
        tangents = tuple(ops.zeros_like(p) if t is None and not isinstance(p, (int, float))
                         else t for p, t in zip(primals, tangents))
        return unwrap_tree(jvp(self.function, tuple(primals), tangents))

    def _batching_rule(self, values, bdims):
        from .transforms import vmap
        key = tuple(bdims)
        batched = self._batched_versions.get(key)
        if batched is None:
            batched = custom_vjp(vmap(self.function, in_dims=key))
            batched.prim.name = f"vmap({self.prim.name})"
            batched.defvjp(vmap(self.fwd, in_dims=key),
                           vmap(self.bwd, in_dims=(0, 0)))
            self._batched_versions[key] = batched
        return bind(batched.prim, *values), 0
