"""Checkers for the course exercises: compare a student's rule or function with torch.func.

A checker never raises on a wrong answer and never prints: it returns a :class:`CheckResult`
that a notebook displays as a clear PASS or FAIL line with a hint.
"""
import html

import torch
import torch.func

from .tensor import bind
from .errors import TransformError


class CheckResult:
    """The outcome of a check: ``passed``, what was checked, and a hint when it failed."""

    def __init__(self, passed, what, detail="", hint=""):
        self.passed = bool(passed)
        self.what = what
        self.detail = detail
        self.hint = hint

    def __bool__(self):
        return self.passed

    def __str__(self):
        if self.passed:
            return f"PASS: {self.what}"
        text = f"FAIL: {self.what}"
        if self.detail:
            text += f"\n  {self.detail}"
        if self.hint:
            text += f"\n  Hint: {self.hint}"
        return text

    __repr__ = __str__

    def _repr_html_(self):
        color = "#1a7f37" if self.passed else "#cf222e"
        return f'<pre style="color:{color}">{html.escape(str(self))}</pre>'


def _compare(ours, reference, atol, rtol):
    ours_leaves = torch.utils._pytree.tree_leaves(ours)
    reference_leaves = torch.utils._pytree.tree_leaves(reference)
    if len(ours_leaves) != len(reference_leaves):
        return f"expected {len(reference_leaves)} outputs, got {len(ours_leaves)}"
    for position, (a, b) in enumerate(zip(ours_leaves, reference_leaves)):
        if not isinstance(a, torch.Tensor):
            return f"output {position} is a {type(a).__name__}, expected a tensor"
        if a.shape != b.shape:
            return f"output {position} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        if not torch.allclose(a, b, atol=atol, rtol=rtol):
            error = (a - b).abs().max().item()
            return f"output {position} differs from torch.func by up to {error:.3g}"
    return None


def check_against(ours, reference, *args, what="your function", hint="", atol=1e-5,
                  rtol=1e-4):
    """Call ``ours(*args)`` and ``reference(*args)`` and compare the results.

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> from minifunctorch.core.checks import check_against
    >>> f = lambda x: (x ** 2).sum()
    >>> check_against(grad(f), torch.func.grad(f), torch.ones(3), what="grad of a square")
    PASS: grad of a square
    """
    try:
        result = ours(*args)
    except (TransformError, NotImplementedError, RuntimeError, TypeError, ValueError) as error:
        return CheckResult(False, what, f"it raised {type(error).__name__}: {error}", hint)
    problem = _compare(result, reference(*args), atol, rtol)
    return CheckResult(problem is None, what, problem or "", hint if problem else "")


def check_primitive(prim, reference, *args, **params):
    """Check a primitive's jvp, vjp and batching rules against torch.func on ``reference``.

    ``reference`` is the torch function the primitive computes (with ``params`` already
    applied). Each rule is checked on ``args``; the batching rule on a batch of three copies
    with small perturbations.
    """
    from .transforms import jvp, vjp, vmap

    def ours(*xs):
        return bind(prim, *xs, **params)

    tangents = tuple(torch.randn_like(a) for a in args)
    results = [
        check_against(lambda *xs: jvp(ours, xs, tangents), lambda *xs: torch.func.jvp(
            reference, xs, tangents), *args, what=f"jvp rule of {prim.name}",
            hint=f"jvp_rules[{prim.name}_p] gets (primals, tangents) and returns "
                 "(out, out_dot)."),
    ]
    out = reference(*args)
    cotangent = torch.randn_like(out)
    results.append(check_against(
        lambda *xs: vjp(ours, *xs)[1](cotangent),
        lambda *xs: torch.func.vjp(reference, *xs)[1](cotangent), *args,
        what=f"vjp rule of {prim.name}",
        hint=f"vjp_rules[{prim.name}_p] returns (out, backward), and backward(ct) returns one "
             "cotangent per argument, with broadcasting undone by sum_to_size."))
    batch = tuple(torch.stack([a, a + 0.1, a - 0.2]) for a in args)
    results.append(check_against(
        vmap(ours), torch.func.vmap(reference), *batch, what=f"batching rule of {prim.name}",
        hint=f"batching_rules[{prim.name}_p] gets (values, bdims) and returns (out, out_bdim); "
             "it makes one batched torch call, no loop."))
    passed = all(results)
    what = f"all rules of {prim.name}" if passed else f"the rules of {prim.name}"
    detail = "\n  ".join(str(r) for r in results if not r)
    return CheckResult(passed, what, detail)
