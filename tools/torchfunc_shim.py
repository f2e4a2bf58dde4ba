"""pytest plugin of tools/torchfunc_suite.py: points PyTorch's torch.func tests at minifunctorch's
transforms (or leaves them on torch.func) and records the outcome of every test.

The runner loads it with ``-p torchfunc_shim`` and sets it up through the environment:

``TORCHFUNC_SUITE_ENGINE``   ``torch.func`` (record only) or ``minifunctorch`` (swap, then record)
``TORCHFUNC_SUITE_RESULTS``  file to which one JSON line per test is appended
``TORCHFUNC_SUITE_TIMEOUT``  seconds one test may run (unset or 0: no limit)

NOTE [What the swap replaces]
The tests reach the transforms through public names only: ``from functorch import vmap, grad,
...``, ``from functorch.experimental import functionalize, chunk_vmap, ...``, ``from torch.func
import functional_call, linearize, stack_module_state``, and attribute lookups at call time
(``torch.func.grad``, ``torch.vmap``, ``getattr(functorch, name)``). So the swap sets those module
attributes, in ``pytest_configure``, before any test module is imported:

- each name of the torch.func API (``API`` below) that ``minifunctorch.core`` has becomes
  minifunctorch's, in ``torch.func``, ``functorch`` and ``functorch.experimental`` wherever that
  module exports it, and ``torch.vmap`` too. ``functorch.<name>`` keeps torch's FutureWarning
  (a deprecation notice of the functorch namespace, not engine behaviour), then calls ours;
- each name of that API that minifunctorch lacks becomes a stub that raises NotImplementedError
  naming it. Keeping torch's there would run those tests on torch's engine and count them as
  ours; the stub counts them as missing until minifunctorch has the name;
- nothing under ``torch._functorch`` or ``torch._C._functorch`` is touched. torch's own code
  imports its transforms from there, so the references the tests compute with torch's autograd
  (``torch.autograd.grad``, ``torch.autograd.functional.jacobian``, which vectorizes with
  ``torch._vmap_internals``) stay torch's. Tests that call those internals directly (wrapper
  levels, ``_slice_argnums``, ``reshape_dim_into``) test torch; the report counts the tests
  that passed without calling minifunctorch (``engine_calls``);
- ``make_fx`` (a torch.fx tracer that functorch re-exports) and ``rearrange`` are not
  transforms, and stay torch's.

The one exception to "torch's internals stay torch's": torch code that looks up ``torch.vmap``
or ``torch.func.functional_call`` at call time (control-flow higher-order ops, aot_autograd)
sees ours; only the torch.compile tests reach it.
"""

import functools
import json
import os
import signal

import pytest

API = (
    "vmap", "grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "linearize",
    "functional_call", "stack_module_state", "functionalize", "debug_unwrap",
    "replace_all_batch_norm_modules_", "chunk_vmap",
    "make_functional", "make_functional_with_buffers", "combine_state_for_ensemble",
)
# functorch's deprecated spellings, and the replacement their warning names (None: torch.func.X)
DEPRECATED_IN_FUNCTORCH = {
    "vmap": "torch.vmap", "grad": None, "grad_and_value": None, "vjp": None, "jvp": None,
    "jacrev": None, "jacfwd": None, "hessian": None, "functionalize": None,
    "make_functional": "torch.func.functional_call",
    "make_functional_with_buffers": "torch.func.functional_call",
    "combine_state_for_ensemble": "torch.func.stack_module_state",
}
# worst outcome wins when a test reports several phases (setup, call, teardown, subtests)
OUTCOME_RANK = {"passed": 0, "skipped": 1, "xfailed": 2, "xpassed": 3, "failed": 4}

engine_calls = 0  # calls of the swapped names during the current test
_records = {}     # nodeid -> record of the test that is running


class TestTimeout(Exception):
    """Raised inside a test that ran past TORCHFUNC_SUITE_TIMEOUT."""


def _settings():
    engine = os.environ.get("TORCHFUNC_SUITE_ENGINE", "torch.func")
    if engine not in ("torch.func", "minifunctorch"):
        raise pytest.UsageError(
            f"TORCHFUNC_SUITE_ENGINE={engine!r}: expected 'torch.func' or 'minifunctorch'")
    results = os.environ.get("TORCHFUNC_SUITE_RESULTS")
    if not results:
        raise pytest.UsageError(
            "TORCHFUNC_SUITE_RESULTS is not set: torchfunc_shim needs a file to write outcomes "
            "to (tools/torchfunc_suite.py sets it)")
    timeout = float(os.environ.get("TORCHFUNC_SUITE_TIMEOUT") or 0)
    return engine, results, timeout


def _counted(function):
    @functools.wraps(function)
    def counted(*args, **kwargs):
        global engine_calls
        engine_calls += 1
        return function(*args, **kwargs)
    return counted


def _missing(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"minifunctorch has no {name}: torchfunc_shim replaced torch.func's {name} by this "
            "stub, so that the test does not run on torch's engine")
    missing.__name__ = missing.__qualname__ = name
    return missing


def _deprecated(name, function):
    from torch._functorch.deprecated import warn_deprecated

    @functools.wraps(function)
    def deprecated(*args, **kwargs):
        warn_deprecated(name, DEPRECATED_IN_FUNCTORCH[name])
        return function(*args, **kwargs)
    return deprecated


def install_minifunctorch():
    """Swap the torch.func API for minifunctorch's (NOTE [What the swap replaces])."""
    import functorch
    import functorch.experimental
    import torch
    import torch.func

    import minifunctorch.core as core

    ours = {name: _counted(getattr(core, name) if hasattr(core, name) else _missing(name))
            for name in API}
    for module in (torch.func, functorch, functorch.experimental):
        for name in API:
            if not hasattr(module, name):
                continue
            if module is functorch and name in DEPRECATED_IN_FUNCTORCH:
                setattr(module, name, _deprecated(name, ours[name]))
            else:
                setattr(module, name, ours[name])
    torch.vmap = ours["vmap"]
    return [name for name in API if not hasattr(core, name)]


def pytest_configure(config):
    engine, results, timeout = _settings()
    config._torchfunc_suite = {"results": results, "timeout": timeout}
    import torch

    header = {"engine": engine, "torch": torch.__version__}
    if engine == "minifunctorch":
        header["missing"] = install_minifunctorch()
        import minifunctorch.core
        header["minifunctorch"] = os.path.dirname(minifunctorch.core.__file__)
    _write(results, header)


def _write(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    _write(session.config._torchfunc_suite["results"],
           {"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global engine_calls
    engine_calls = 0
    _records[item.nodeid] = {"nodeid": item.nodeid, "outcome": "passed", "message": None,
                             "duration": 0.0}
    try:
        return (yield)
    finally:
        record = _records.pop(item.nodeid)
        record["engine_calls"] = engine_calls
        _write(item.config._torchfunc_suite["results"], record)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    timeout = item.config._torchfunc_suite["timeout"]
    if not timeout:
        return (yield)

    def expire(signum, frame):
        raise TestTimeout(f"the test ran longer than {timeout:g} s (TORCHFUNC_SUITE_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _first_line(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = report.longrepr[2]
    else:
        text = str(report.longrepr)
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def pytest_runtest_logreport(report):
    record = _records.get(report.nodeid)
    if record is None:
        return
    record["duration"] += report.duration
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    else:
        outcome = report.outcome
    if OUTCOME_RANK[outcome] > OUTCOME_RANK[record["outcome"]]:
        record["outcome"] = outcome
        record["when"] = report.when
        record["message"] = (_first_line(report) if outcome in ("failed", "skipped")
                             else report.wasxfail if outcome == "xfailed" else None)
