"""A sampled OpInfo sweep (tests/opinfo.py) against torch.func, in the test suite.

Every op_db entry that supports float32 on CPU, under vjp, jvp and vmap: its first sample
(vmap: every tensor batched at 0), and for a fixed subset of entries chosen by a hash of
their names, every sample of the full sweep under every in_dims variant. A test fails when
- minifunctorch disagrees with torch.func, or crashes with an error that is not a
  TransformError (``wrong``: a bug), or
- docs/COVERAGE.md lists the entry as supported or fallback under the transform, and now
  minifunctorch refuses it.
Each failure names the entry, the transform, the sample and the difference. The full sweep,
which writes docs/COVERAGE.md, is ``python tools/coverage.py`` (``make coverage``).
"""
import os

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (op_db) needs expecttest: "
                    "pip install -e '.[test]'")
import opinfo  # noqa: E402

COVERAGE_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "COVERAGE.md")
SUBSET_MODULUS = 10  # about one entry in ten runs its full set of samples


def in_subset(key):
    return opinfo.seed_of(key, "subset") % SUBSET_MODULUS == 0


# Known engine bugs that the sampled run finds: (entry, transform) -> reason. Each is a strict
# xfail, so a fix makes it fail until its line here is removed.
KNOWN_WRONG = {
}

ENTRIES = opinfo.entries()
DOCUMENTED = opinfo.read_table(COVERAGE_MD) if os.path.exists(COVERAGE_MD) else {}


def _params():
    for op in ENTRIES:
        key = opinfo.entry_key(op)
        for transform in opinfo.TRANSFORMS:
            reason = KNOWN_WRONG.get((key, transform))
            marks = (pytest.mark.xfail(strict=True, reason=reason),) if reason else ()
            yield pytest.param(op, transform, id=f"{key}-{transform}", marks=marks)


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


_loaded = {}


def _samples(op):
    """The entry's samples, kept while its three transforms run one after the other."""
    key = opinfo.entry_key(op)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = opinfo.load_samples(op)
    return _loaded[key]


@pytest.mark.parametrize("op, transform", list(_params()))
def test_opinfo_entry(op, transform):
    key = opinfo.entry_key(op)
    try:
        samples = _samples(op)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"op_db cannot make samples: {opinfo.describe_error(e)}")
    if in_subset(key):
        indices, variants = None, None  # everything the full sweep runs
    else:
        indices, variants = [0], ["all 0"]
    result = opinfo.check_op(op, (transform,), indices=indices, variants=variants,
                             samples=samples)[transform]
    documented = DOCUMENTED.get(key, {}).get(transform)
    failures = [f"{o.where(key, transform)}: {o.detail}"
                for o in result.outcomes if o.kind == "wrong"]
    if documented in (opinfo.SUPPORTED, opinfo.FALLBACK):
        failures += [f"{o.where(key, transform)}: docs/COVERAGE.md says {documented}, now "
                     f"refused: {o.detail}" for o in result.outcomes if o.kind == "refused"]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


def test_coverage_table_is_readable():
    """The committed table parses, and names every entry this torch's op_db has."""
    assert DOCUMENTED, f"{COVERAGE_MD} is missing or has no table: run `make coverage`"
    missing = [opinfo.entry_key(op) for op in ENTRIES if opinfo.entry_key(op) not in DOCUMENTED]
    assert not missing, f"entries missing from docs/COVERAGE.md: {missing[:10]}"
    statuses = {s for row in DOCUMENTED.values() for s in row.values()}
    assert statuses <= set(opinfo.STATUSES), statuses - set(opinfo.STATUSES)
