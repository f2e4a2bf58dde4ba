"""The full OpInfo sweep: every op_db entry that supports float32 (or, with --dtype,
complex64) on CPU, up to SAMPLE_CAP samples each, under vjp, jvp and vmap (every in_dims
variant), compared with torch.func; writes docs/COVERAGE.md (docs/COVERAGE-complex64.md).
The harness is tests/opinfo.py.

    .venv/bin/python tools/coverage.py                 # the whole sweep (a few minutes)
    .venv/bin/python tools/coverage.py --dtype complex64  # the complex64 samples
    .venv/bin/python tools/coverage.py sin cat --print # some entries, printed, nothing written

Run from the repository root. One thread, so that it does not crowd a shared machine; the
result does not depend on timing (every entry is seeded from its name), except that a call
of ours that runs past opinfo.CALL_TIME_LIMIT is classified wrong as a hang.
"""
import argparse
import collections
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import opinfo  # noqa: E402
from opinfo import (  # noqa: E402
    FALLBACK, NO_SAMPLES, REFUSED, SUPPORTED, TF_REFUSES, TRANSFORMS, WRONG,
)

DTYPES = {"float32": torch.float32, "complex64": torch.complex64}
OUTPUTS = {"float32": os.path.join(ROOT, "docs", "COVERAGE.md"),
           "complex64": os.path.join(ROOT, "docs", "COVERAGE-complex64.md")}


def sweep(names=(), cap=opinfo.SAMPLE_CAP, log=sys.stderr, dtype=torch.float32):
    """[(op, {transform: Result}, seconds)] for the entries (all, or those named)."""
    rows = []
    entries = opinfo.entries(dtype)
    if names:
        entries = [op for op in entries if opinfo.entry_key(op) in names]
    for n, op in enumerate(entries, 1):
        start = time.perf_counter()
        results = opinfo.check_op(op, cap=cap, dtype=dtype)
        seconds = time.perf_counter() - start
        rows.append((op, results, seconds))
        if log is not None:
            statuses = " ".join(f"{t}={results[t].status}" for t in TRANSFORMS)
            print(f"[{n}/{len(entries)}] {opinfo.entry_key(op)} {seconds:.2f}s {statuses}",
                  file=log, flush=True)
    return rows


# --- the report ------------------------------------------------------------------------------
def _short(reason):
    """A reason without the call prefix (``vjp(f)(<inputs>): ``), which says nothing here."""
    if ": " in reason and "(<inputs>): " in reason:
        head, _, rest = reason.partition(": ")  # "sample 3 (in_dims ...)" or the error type
        if head.startswith("sample "):
            kind, _, tail = rest.partition(": ")
            return f"{head}: {kind}: {_strip_call(tail)}"
        return f"{head}: {_strip_call(rest)}"
    return reason


def _strip_call(text):
    return re.sub(r"^\w+\((?:[^()]|\([^()]*\))*\)\(<inputs>\): ", "", text)


def _cell(text):
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _status_cell(status):
    return f"**{status}**" if status == WRONG else status


def _notes(results):
    """One notes cell: the reasons, transforms sharing a reason named together."""
    by_reason = collections.OrderedDict()
    for t in TRANSFORMS:
        r = results[t]
        if r.status in (REFUSED, WRONG, TF_REFUSES, NO_SAMPLES):
            by_reason.setdefault(_short(r.reason), []).append(t)
        elif r.status == FALLBACK:
            by_reason.setdefault("fallback: " + ", ".join(r.fallbacks), []).append(t)
        if r.status in (SUPPORTED, FALLBACK) and r.reason:
            by_reason.setdefault(_short(r.reason), []).append(t)
    return "; ".join(f"{', '.join(ts)}: {reason}" for reason, ts in by_reason.items())


def refusal_messages(rows):
    """[(message, entries)], most entries first: the refusals that name no aten op, grouped
    by their message without the call that starts it and with numbers replaced by N."""
    counts = collections.Counter()
    for _, res, _ in rows:
        messages = set()
        for t in TRANSFORMS:
            for o in res[t].outcomes:
                if o.kind == "refused" and not opinfo.named_ops(o.detail):
                    kind, _, text = o.detail.partition(": ")
                    text = re.sub(r"(?<![A-Za-z_])\d+", "N", _strip_call(text))
                    messages.add(f"{kind}: {text[:110]}")
        counts.update(messages)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def render(rows, cap, left_out, dtype_name="float32"):
    counts = {t: collections.Counter(res[t].status for _, res, _ in rows) for t in TRANSFORMS}
    n = len(rows)
    all_supported = sum(all(res[t].status == SUPPORTED for t in TRANSFORMS) for _, res, _ in rows)
    all_with_fallback = sum(all(res[t].status in (SUPPORTED, FALLBACK) for t in TRANSFORMS)
                            for _, res, _ in rows)
    agree = sum(all(res[t].status in (SUPPORTED, FALLBACK, TF_REFUSES, NO_SAMPLES)
                    for t in TRANSFORMS) for _, res, _ in rows)

    refused_entries = collections.Counter()
    for _, res, _ in rows:
        for name in {name for t in TRANSFORMS for name in res[t].refused_ops}:
            refused_entries[name] += 1

    out = []
    w = out.append
    w("# OpInfo coverage")
    w("")
    if dtype_name == "float32":
        w("Generated by `python tools/coverage.py` (run from the repository root with the "
          "project's venv); do not edit by hand. `tests/test_opinfo.py` reads the table below "
          "and fails when an entry listed as supported or fallback stops agreeing with "
          "torch.func. The same sweep on complex64 samples: "
          "[COVERAGE-complex64.md](COVERAGE-complex64.md).")
    else:
        w(f"Generated by `python tools/coverage.py --dtype {dtype_name}` (run from the "
          "repository root with the project's venv); do not edit by hand. The same sweep as "
          f"[COVERAGE.md](COVERAGE.md), on {dtype_name} samples: complex tensors get complex "
          "random cotangents and tangents (NOTE [Complex numbers] in core/dispatch.py), and "
          "finite differences, real-only, are not consulted.")
    w("")
    w("## Method")
    w("")
    w(f"Every entry of PyTorch's OpInfo database (`op_db`, torch {torch.__version__}) that "
      f"supports {dtype_name} on CPU ({n} entries; {left_out} others do not and are left out) "
      f"is run on its samples (`op.sample_inputs(\"cpu\", torch.{dtype_name})`; at most {cap} per "
      "entry, spread evenly over the list) under minifunctorch's `vjp`, `jvp` and `vmap` and "
      "under torch.func's, and the results are compared (tests/opinfo.py, NOTE [How one "
      "sample is checked]):")
    w("")
    w("- **vjp**: with respect to every floating tensor argument (the input, tensors in "
      "args, kwargs and lists), random normal cotangents for the floating outputs (after "
      "OpInfo's `output_process_fn_grad`); integer and boolean outputs are compared but not "
      "differentiated. Compared: outputs and the pulled-back cotangents.")
    w("- **jvp**: random normal tangents for the same arguments. Compared: outputs and "
      "output tangents.")
    w(f"- **vmap**: batches of {opinfo.BATCH}, the sample and two copies whose floating "
      "tensors are scaled by factors a little below 1 (integer and boolean tensors are "
      "copied unchanged), under three `in_dims`: every tensor at 0; the first at -1 and the "
      "others unbatched; the first unbatched and the others at 0.")
    w("- Where torch.func refuses to differentiate every floating argument (a loss's target, "
      "a running statistic: PyTorch has no derivative for them), the sample is compared "
      "with respect to its input alone. Where ours and torch.func disagree under vmap, the "
      "per-example loop (the op on each example, stacked) decides: if ours agrees with it "
      "and torch.func does not, the sample counts as agreeing and the note says "
      "\"torch.func is off\" (NOTE [When torch.func is wrong]).")
    w("- Where torch.func has no jvp (torch has no forward-mode formula), J @ t from its "
      "`jacrev` stands in; where that fails too (jacrev refuses complex outputs), the "
      "outputs are the op's own and the tangents float64 (complex128) central differences "
      "along the same tangents (NOTE [A third oracle for jvp]): a sample that agrees counts "
      "as agreeing, one that does not stays uncompared (torch's formula may keep a "
      "convention, such as cholesky's Hermitian tangent, that a difference along any "
      "tangent does not).")
    w("- An op that draws random numbers, which vmap refuses under its default "
      "`randomness='error'` in torch.func as here, is compared under "
      "`randomness='different'`, both engines from the same seed (NOTE [Random ops under "
      "vmap]).")
    w(f"- Comparison: `torch.testing.assert_close(rtol={opinfo.RTOL}, atol={opinfo.ATOL}, "
      "equal_nan=True)`, dtypes and shapes exact (NOTE [Tolerances]); our results must be "
      "plain tensors. Every entry is seeded from its name, so the sweep is deterministic. "
      "One thread. A call of ours that takes more than "
      f"{opinfo.CALL_TIME_LIMIT:.0f} s is classified wrong (a hang).")
    w("")
    w("Statuses of an (entry, transform), the first that applies over its samples: "
      "**wrong** (ours disagrees, or crashes with an error that is not a `TransformError`: "
      "a bug); **refused** (ours raises a `TransformError` on a sample torch.func runs); "
      "**torch.func refuses** (torch.func raises on every sample, so nothing can be compared; "
      "the note says whether we refuse too); **no samples** (no sample has a floating tensor "
      "argument and a floating output, or op_db gives none); **fallback** (every compared "
      "sample agrees, some through vmap's per-example fallback, listed by "
      "`minifunctorch.core.capture_fallbacks()`); **supported** (every compared sample "
      "agrees). A sample torch.func refuses is left out of the comparison.")
    w("")
    w("## Totals")
    w("")
    w(f"- Entries: {n}.")
    w(f"- Supported under all three of vjp, jvp and vmap: {all_supported} without the "
      f"per-example fallback, {all_with_fallback} counting it.")
    w(f"- Never wrong nor refused (supported, fallback, or nothing to compare): {agree}.")
    w("")
    w("| status | vjp | jvp | vmap |")
    w("|---|---:|---:|---:|")
    for status in (SUPPORTED, FALLBACK, REFUSED, WRONG, TF_REFUSES, NO_SAMPLES):
        w(f"| {status} | " + " | ".join(str(counts[t][status]) for t in TRANSFORMS) + " |")
    w("")
    w("## The per-example fallback")
    w("")
    w("The aten ops that vmap ran example by example (no batching rule), how many entries "
      "each affects (all samples, including those with other failures), and what torch.func "
      "does with them: its own per-example fallback (it warns so), or a refusal, or a batching "
      "rule (the issue's criterion: no op that torch.func batches natively may be here):")
    w("")
    all_fallbacks = collections.Counter()
    theirs = collections.defaultdict(set)
    for _, res, _ in rows:
        outcomes = [o for t in TRANSFORMS for o in res[t].outcomes]
        for name in {f for o in outcomes for f in o.fallbacks}:
            all_fallbacks[name] += 1
            for o in outcomes:  # (on the samples where ours took it)
                if o.fallbacks and name in o.fallbacks:
                    theirs[name].add(
                        f"its fallback too ({', '.join(o.their_fallbacks)})"
                        if o.their_fallbacks else
                        "refuses" if o.kind == "tf refuses" else "batches it")
    w("| aten op | entries | torch.func |")
    w("|---|---:|---|")
    for name, k in sorted(all_fallbacks.items(), key=lambda kv: (-kv[1], kv[0])):
        w(f"| `{name}` | {k} | {', '.join(sorted(theirs[name]))} |")
    w("")
    w("## Causes")
    w("")
    w("The aten ops named by refusals, and how many entries each affects (any transform):")
    w("")
    w("| aten op | entries |")
    w("|---|---:|")
    for name, k in sorted(refused_entries.items(), key=lambda kv: (-kv[1], kv[0]))[:40]:
        w(f"| `{name}` | {k} |")
    w("")
    w("The refusals that name no aten op, grouped by message (the call and numbers left out), "
      "and how many entries each affects:")
    w("")
    w("| refusal | entries |")
    w("|---|---:|")
    for message, k in refusal_messages(rows)[:30]:
        w(f"| {_cell(message)} | {k} |")
    w("")
    wrong_rows = [(op, res) for op, res, _ in rows
                  if any(res[t].status == WRONG for t in TRANSFORMS)]
    w(f"Wrong (bugs): {len(wrong_rows)} entries.")
    w("")
    for op, res in wrong_rows:
        for t in TRANSFORMS:
            if res[t].status == WRONG:
                w(f"- `{opinfo.entry_key(op)}` {t}: {_cell(_short(res[t].reason))}")
    w("")
    w("## Table")
    w("")
    w("<!-- table -->")
    w("| op | variant | vjp | jvp | vmap | notes |")
    w("|---|---|---|---|---|---|")
    for op, res, _ in rows:
        cells = [f"`{op.name}`", f"`{op.variant_test_name}`" if op.variant_test_name else ""]
        cells += [_status_cell(res[t].status) for t in TRANSFORMS]
        cells.append(_cell(_notes(res)))
        w("| " + " | ".join(cells) + " |")
    w("")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="entries to run (name or name.variant)")
    parser.add_argument("--cap", type=int, default=opinfo.SAMPLE_CAP,
                        help="samples per entry (default %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the samples' dtype (default %(default)s)")
    parser.add_argument("--print", action="store_true",
                        help="print the report instead of writing it")
    parser.add_argument("--output", default=None,
                        help="default: docs/COVERAGE.md, docs/COVERAGE-complex64.md")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    output = args.output or OUTPUTS[args.dtype]
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = sweep(args.names, args.cap, dtype=dtype)
    from torch.testing._internal.common_methods_invocations import op_db
    left_out = len(op_db) - len(opinfo.entries(dtype))
    report = render(rows, args.cap, left_out, args.dtype)
    elapsed = time.perf_counter() - start
    slowest = sorted(rows, key=lambda r: -r[2])[:10]
    print(f"swept {len(rows)} entries in {elapsed:.0f} s; slowest: " + ", ".join(
        f"{opinfo.entry_key(op)} {s:.1f}s" for op, _, s in slowest), file=sys.stderr)
    if args.print or args.names:
        print(report)
    else:
        with open(output, "w", encoding="utf-8") as f:
            f.write(report)
        print(f"wrote {os.path.relpath(output, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
