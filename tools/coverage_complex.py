"""The OpInfo sweep on complex64 samples: tests/opinfo.py with complex tensors counted as
differentiable and complex random cotangents and tangents (NOTE [Complex numbers] in
core/dispatch.py). Prints the count of entries per status under vjp, jvp and vmap, and the
entries that disagree with torch.func; writes nothing (docs/COVERAGE.md is float32's).

    .venv/bin/python tools/coverage_complex.py [CAP] [entry ...]

Finite differences, the harness's last word where torch.func is off, are real-only and not
used here, so an entry where torch.func itself is off (as_strided_scatter's vjp, see
docs/COVERAGE.md) shows as wrong.
"""
import collections
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import opinfo  # noqa: E402

CAP = int(sys.argv[1]) if len(sys.argv) > 1 else 8
names = sys.argv[2:]

def entries():
    from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if torch.complex64 in op.supported_dtypes("cpu")]

def load_samples(op):
    torch.manual_seed(opinfo.seed_of(opinfo.entry_key(op), "samples"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(op.sample_inputs("cpu", torch.complex64, requires_grad=False))

def _is_float(x):
    return isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex)

def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(tuple(shape), generator=g, dtype=torch.complex64).to(dtype)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)

opinfo.load_samples = load_samples
opinfo._is_float = _is_float
opinfo._random = _random
opinfo.finite_differences = lambda *a, **k: None  # real-only; never the last word here

counts = {t: collections.Counter() for t in opinfo.TRANSFORMS}
wrong = []
ops = entries()
if names:
    ops = [op for op in ops if opinfo.entry_key(op) in names]
start = time.time()
for n, op in enumerate(ops, 1):
    results = opinfo.check_op(op, cap=CAP)
    for t in opinfo.TRANSFORMS:
        r = results[t]
        counts[t][r.status] += 1
        if r.status == opinfo.WRONG:
            wrong.append((opinfo.entry_key(op), t, getattr(r, "reason", "")[:300]))
    print(f"[{n}/{len(ops)}] {opinfo.entry_key(op)} " +
          " ".join(f"{t}={results[t].status}" for t in opinfo.TRANSFORMS), file=sys.stderr, flush=True)
print(f"{len(ops)} entries with complex64 samples, cap {CAP}, {time.time() - start:.0f}s")
for t in opinfo.TRANSFORMS:
    print(t, dict(counts[t]))
print("WRONG:")
for w in wrong:
    print("  ", w)
