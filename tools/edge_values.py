"""The OpInfo sweep at special values: every op_db entry that supports float64 on CPU, its
first samples with the input's elements replaced by a cycle of special values, under vjp,
jvp and vmap, compared with torch.func; writes docs/EDGE-VALUES.md. The harness is
tests/opinfo.py (NOTE [How one sample is checked]); tools/coverage.py is the same sweep at
the samples' own values.

    .venv/bin/python tools/edge_values.py                      # the whole sweep (~70 s)
    .venv/bin/python tools/edge_values.py prod cumprod --print  # some entries, nothing written

NOTE [Where torch disagrees with itself at special values]
At inf, nan, 0 and the kinks of piecewise ops, a derivative is a convention, and torch keeps
several: its formulas on plain tensors (eager autograd, and torch.func's vjp, whose backward
runs on them) sometimes take another path than on wrapped tensors (torch.func's grad, jvp and
vmap: prod divides by x only on plain tensors), some kernels give another answer in their
vectorized loop than in their scalar tail (hardtanh's backward at a nan), and some formulas
lose to rounding where the engine's do not (the mm form of cdist at inf). So a difference
here is not by itself a bug. Each one is classified:
- **eager torch**: ours equals eager autograd on plain tensors (vjp only), so torch.func
  differs from eager torch and the engine follows eager;
- **known**: a reason in KNOWN below, written where the behaviour is chosen;
- **unexplained**: neither, to look into;
- **refused**: ours raises a TransformError where torch.func runs (docs/COVERAGE.md lists
  these refusals too).
The values (PATTERNS): "special" has no zero, so that prod and cumprod divide; "with zeros";
and "kinks", small integers and halves, where margins and clamps meet their bounds exactly.
"""
import argparse
import collections
import contextlib
import itertools
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import optree  # noqa: E402
import torch  # noqa: E402

import opinfo  # noqa: E402

PATTERNS = {
    "special": (float("inf"), 1.5, float("-inf"), 0.5, float("nan"), -1.0, 2.0),
    "with zeros": (0.0, float("inf"), 1.5, -0.0, 2.0, float("-inf"), -1.0, 0.5),
    "kinks": (0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0),
}
SAMPLES = 3  # per entry: the first samples whose input is a non-empty real tensor
OUTPUT = os.path.join(ROOT, "docs", "EDGE-VALUES.md")

_ZERO_TANGENT = "NOTE [Zero tangents times infinity]: torch.func multiplies by a zero tangent"
_PRODUCTS = ("NOTE [Products with zeros] (core/structural.py): torch.func's vjp divides by x "
             "where its grad and jvp take exclusive products")
_NAN_MASKS = ("torch's backward at a nan depends on where the element falls: its vectorized "
              "loop and its scalar tail disagree (hardtanh in core/elementwise.py)")
_CLAMP = ("NOTE [clamp with tensor bounds] (core/elementwise.py): at a nan no input gets a "
          "gradient; torch gives one to the input its masks pick, and its jvp the bound's "
          "tangent")
# (entry, transform) or entry -> why ours differs from torch.func there
KNOWN = {
    ("nn.functional.mse_loss", "jvp"): _ZERO_TANGENT,
    **{(name, "jvp"): "the output itself is nan there: its tangent is nan here, 0 in "
                      "torch.func" for name in (
        "nn.functional.linear_cross_entropy.chunked",
        "nn.functional.linear_cross_entropy.chunked_none", "nn.functional.cosine_embedding_loss",
        "nn.functional.triplet_margin_loss", "nn.functional.triplet_margin_with_distance_loss",
        "corrcoef")},
    "prod": _PRODUCTS, "masked.prod": _PRODUCTS,
    "cumprod": "cumprod's derivatives never divide, as torch.func's grad (NOTE [Products with "
               "zeros]); its vjp and eager torch divide by x",
    "masked.cumprod": "as cumprod",
    **{name: _CLAMP for name in ("clamp", "clamp_min", "clamp_max")},
    ("nn.functional.scaled_dot_product_attention", "vjp"): (
        "NOTE [Attention without dropout, a mask or grouped heads: three ops] (core/nn.py): "
        "a causal mask is a where, so a masked score passes no cotangent on, where torch adds a "
        "-inf bias through which the nan cotangent of a nan output reaches the key: a number "
        "here where torch.func (and torch's math kernel) give nan, never the reverse"),
    **{name: _NAN_MASKS for name in (
        "nn.functional.hardtanh", "nn.functional.relu6", "nn.functional.softshrink")},
    "nn.functional.hardswish": "torch's hardswish_backward at a nan depends on the CPU "
                               "(tests/test_edge_values.py, NAN_BY_THE_CPU)",
    "var_mean": "torch's fused kernel's mean is nan at an inf (its running update); ours is "
                "the mean, as torch.mean's",
    "std_mean": "as var_mean",
    "var_mean.unbiased": "as var_mean", "std_mean.unbiased": "as var_mean",
    "cdist": "compute_mode='use_mm_for_euclid_dist': torch's |x|^2 + |y|^2 - 2 x.y is nan at "
             "an inf; ours is the distance",
    "polar": "torch's formula divides by the result's sign: nan at abs = inf, and torch "
             "leaves polar undefined for abs <= 0",
    ("triangular_solve", "jvp"): "torch 2.13's jvp with respect to A is off (docs/COVERAGE.md)",
    ("nn.functional.nll_loss", "jvp"): "torch declares the class weights non-differentiable",
    ("scatter_reduce.prod", "jvp"): "torch.func's jvp of scatter_reduce(prod) is zero "
                                    "(tests/test_indexing.py)",
    ("linalg.vander", "jvp"): "torch's formula gives nan at an inf where the derivative is "
                              "its power, as ours",
    ("linalg.lu", "jvp"): "L's diagonal is ones, so its tangent is 0 here; torch's formula "
                          "gives nan there at an infinite matrix",
    ("__rdiv__", "jvp"): "d(c / x) at x = 0: -inf here, torch.func nan",
    ("__rdiv__", "vjp"): "at x = 0 the cotangent of a broadcast x sums terms of both signs "
                         "divided by 0: nan here (inf - inf), where torch's formula reduces "
                         "in another order and gives inf for an (n, 1) x (nan for a (1, 1) "
                         "one)",
    "special.i1": "torch's derivative at a nan is a number", "special.i1e": "as special.i1",
    "as_strided_scatter": "torch's vjp passes the cotangent into a fully overwritten input "
                          "(docs/COVERAGE.md: torch.func is off)",
    ("nn.functional.prelu", "jvp"): "torch's jvp takes x = 0 as positive (x >= 0), its vjp as "
                                    "not (x > 0); ours follows the vjp in both modes",
    ("logcumsumexp", "jvp"): "of one number at an inf torch's jvp is exp(inf - inf) t = nan, "
                             "where its vjp passes the cotangent through, as ours in both "
                             "modes",
}


def _no_second_oracle(*args, **kwargs):
    raise RuntimeError("at special values torch.func's own transform is the only oracle")


@contextlib.contextmanager
def only_torch_func():
    """Where torch.func refuses a transform, tests/opinfo.py asks torch.func's other mode or
    finite differences instead; at inf and nan neither means anything (and torch's jacfwd of
    eigvals at a nan never returns), so while the sweep runs such a sample counts as
    torch.func refusing. (The harness is put back after: the test suite shares it.)"""
    names = ("reference_vjp_by_jacfwd", "reference_jvp_by_jacrev",
             "reference_jvp_by_finite_differences", "finite_differences")
    saved = {name: getattr(opinfo, name) for name in names}
    try:
        for name in names:
            setattr(opinfo, name, _no_second_oracle)
        yield
    finally:
        for name, function in saved.items():
            setattr(opinfo, name, function)


def special_like(x, values):
    """A tensor of x's shape and dtype holding ``values`` in a cycle."""
    cycled = list(itertools.islice(itertools.cycle(values), x.numel()))
    return torch.tensor(cycled, dtype=x.dtype).reshape(x.shape)


def samples_at(op, values, count=SAMPLES):
    """The entry's first ``count`` samples whose input is a non-empty real tensor, that input
    replaced by ``values``."""
    out = []
    for index, sample in enumerate(opinfo.load_samples(op, torch.float64)):
        s = opinfo.Sample(op, sample, index)
        if not s.input_floats:
            continue
        i = s.input_floats[0]
        x = s.leaves[i]
        if x.numel() == 0 or x.dtype.is_complex:
            continue
        s.leaves[i] = special_like(x, values)
        out.append(s)
        if len(out) == count:
            break
    return out


def equals_eager(s, ours):
    """Whether ours (a vjp outcome's run: outputs and gradients) is eager autograd's: torch's
    kernels and formulas on plain tensors, with the cotangents run_vjp draws."""
    leaves = [s.leaves[j].clone().requires_grad_() for j in s.floats]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        floats, _ = opinfo._differentiable_fn(s, s.floats)(*leaves)
        eager = torch.autograd.grad(floats, leaves, opinfo.cotangents(s, floats),
                                    allow_unused=True)
    ours_leaves = (optree.tree_leaves(ours["outputs"], none_is_leaf=True)
                   + optree.tree_leaves(ours["grads"], none_is_leaf=True))
    for a, b in zip(ours_leaves, [f.detach() for f in floats] + list(eager), strict=True):
        if b is None:
            b = torch.zeros_like(a)
        if a is None or a.shape != b.shape or not torch.allclose(a, b, rtol=1e-6, atol=1e-8,
                                                                   equal_nan=True):
            return False
    return True


def classify(s, transform, outcome):
    """(class, reason) of a sample whose outcome is 'wrong' (NOTE [Where torch disagrees
    with itself at special values])."""
    if transform == "vjp" and not outcome.detail.startswith("crash"):
        try:
            ours, error, _, _ = opinfo._ours(opinfo.run_vjp, s, s.floats)
        except Exception:  # noqa: BLE001 - no second look
            ours, error = None, True
        try:
            eager = error is None and equals_eager(s, ours)
        except Exception:  # noqa: BLE001 - eager torch refuses (a running statistic)
            eager = False
        if eager:
            return "eager torch", "ours equals eager autograd; torch.func differs from it"
    reason = KNOWN.get((s.key, transform)) or KNOWN.get(s.key)
    if reason:
        return "known", reason
    return "unexplained", outcome.detail


def sweep(names=(), log=sys.stderr):
    """[(pattern, entry, transform, sample index, class, reason)] of every difference."""
    rows = []
    entries = opinfo.entries(torch.float64)
    if names:
        entries = [op for op in entries if opinfo.entry_key(op) in names]
    with only_torch_func():
        for n, op in enumerate(entries, 1):
            _sweep_entry(op, rows)
            if log is not None:
                print(f"[{n}/{len(entries)}] {opinfo.entry_key(op)}", file=log, flush=True)
    return rows


def _sweep_entry(op, rows):
    """Append the differences of one entry, at every pattern, to ``rows``."""
    for pattern, values in PATTERNS.items():
        try:
            samples = samples_at(op, values)
        except Exception:  # noqa: BLE001 - the entry has no samples on this machine
            continue
        for s in samples:
            for transform, variant in (("vjp", None), ("jvp", None), ("vmap", "all 0")):
                outcome = opinfo.check(s, transform, variant)
                if outcome.kind in ("wrong", "refused"):
                    kind, reason = (("refused", outcome.detail) if outcome.kind == "refused"
                                    else classify(s, transform, outcome))
                    rows.append((pattern, s.key, transform, s.index, kind, reason))


def render(rows, entries):
    counts = collections.Counter(kind for *_, kind, _ in rows)
    by_entry = collections.defaultdict(list)
    for pattern, key, transform, index, kind, reason in rows:
        by_entry[key, transform, kind, reason].append(f"{pattern} #{index}")
    lines = [
        "# Special values: the OpInfo entries at inf, nan, 0 and kinks",
        "",
        "Written by `tools/edge_values.py` (`make edge-values`); the method and the classes are "
        "its NOTE [Where torch disagrees with itself at special values]. "
        f"{entries} entries (float64, CPU), up to {SAMPLES} samples each, the input's elements "
        "replaced by each of these cycles:",
        "",
    ]
    lines += [f"- {name}: `{', '.join(str(v) for v in values)}`"
              for name, values in PATTERNS.items()]
    lines += [
        "",
        "Everything not listed below gives torch.func's values, derivatives and batches. "
        f"Differences: {sum(counts.values())} samples ("
        + ", ".join(f"{kind} {counts[kind]}" for kind in
                    ("eager torch", "known", "unexplained", "refused")) + ").",
        "",
        "| entry | transform | class | samples | reason |",
        "|---|---|---|---|---|",
    ]
    order = {"unexplained": 0, "refused": 1, "known": 2, "eager torch": 3}
    for (key, transform, kind, reason), where in sorted(
            by_entry.items(), key=lambda item: (order[item[0][2]], item[0][0], item[0][1])):
        reason = reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{key}` | {transform} | {kind} | {', '.join(where)} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="entries to run (default: all)")
    parser.add_argument("--print", action="store_true", help="print, write nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = sweep(args.names)
    entries = len(args.names) if args.names else len(opinfo.entries(torch.float64))
    text = render(rows, entries)  # (no timing in it: a rerun writes the same file)
    print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.print or args.names:
        print(text)
        return 0
    with open(OUTPUT, "w") as f:
        f.write(text)
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
