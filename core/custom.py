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

NOTE [Rule tables do not keep a custom function alive]
The rule tables are module-level dicts. Had they held the custom function's bound methods,
every definition would live as long as the process: a notebook cell that defines one, run
ten times, would leave ten in the tables. So the tables hold small functions that reach the
definition through a weak reference, and a finalizer takes the primitive's rules out of the
tables when the definition is garbage. (JAX avoids the question: its custom_vjp rules live
on the primitive's parameters, not in a global table.)
"""
import functools
import weakref

from .autograd import vjp_rules
from .batching import batching_rules
from .errors import MissingRuleError, TransformUsageError
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
        _register_rules(self)
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


# --- the rule tables hold a custom function weakly ----------------------------------------------
def _register_rules(custom):
    """Rules of ``custom.prim`` that look the definition up through a weak reference
    (NOTE [Rule tables do not keep a custom function alive])."""
    prim, definition = custom.prim, weakref.ref(custom)

    def alive():
        custom = definition()
        if custom is None:
            raise MissingRuleError(
                f"{prim.name}: its custom_vjp definition no longer exists (it was garbage "
                "collected), but a program still uses it. Fix: keep the custom_vjp function "
                "alive while programs that call it run."
            )
        return custom

    vjp_rules[prim] = lambda *args: alive()._vjp_rule(*args)
    jvp_rules[prim] = lambda primals, tangents: alive()._jvp_rule(primals, tangents)
    batching_rules[prim] = lambda values, bdims: alive()._batching_rule(values, bdims)
    weakref.finalize(custom, _forget_rules, prim)


def _forget_rules(prim):
    for table in (vjp_rules, jvp_rules, batching_rules):
        table.pop(prim, None)
