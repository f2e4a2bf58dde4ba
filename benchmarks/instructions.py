"""``python -m benchmarks.instructions [--levels grad,vmap] [--calls N] [--ops N]``: S1's cost
per op and level counted in CPU instructions, for minifunctorch and torch.func in one process.
``--programs`` counts a call of each part of the tutorial-style programs
(``benchmarks/programs.py``) instead, and ``--cases S7,S9 [--quick]`` a call of each case of
those benchmark groups (``benchmarks/cases.py``, at full or quick sizes).

NOTE [Counting instructions instead of time]
On a shared or virtual machine the time of a small op swings by 10-50% from run to run (steal
time, other processes), more than most changes to the engine's per-op work. The number of
instructions a call executes does not depend on the load. This script runs itself under
valgrind's callgrind and, per level of S1 (``benchmarks/cases.py``: the elementwise chain on
a 10x10 tensor) and per engine, zeroes the counters, makes ``--calls`` calls, and dumps them:
per op = (I(chain of ops + 1) - I(1-op function)) / (ops * calls), as S1 does with time. A
small helper, compiled at the start from valgrind's ``callgrind.h``, sends those requests.
The cyclic garbage collector is off while a region is counted, as ``timeit`` turns it off: a
collection walks the whole heap (torch's modules included), millions of instructions that
fall into whichever region it happens to start in.

Instructions are not time: a kernel's memory traffic or a cache miss costs more than its
count says. They measure the interpreter's and dispatcher's work per op, which is what S1's
per-op overhead is, and they tell two versions of the engine apart where time cannot (run it
in each checkout). Under callgrind a run takes a few minutes. It prints a table; nothing is
written. It needs valgrind with its headers and a C compiler.

``--programs`` and ``--cases`` count whole calls (per call = I(calls) / calls), both engines
on the same inputs. The programs' ratios are per-call overhead at the tests' small sizes,
which this tells apart from the machine's noise; at the cases' full sizes the count includes
the kernels' instructions, not what their memory traffic costs.
"""
import argparse
import ctypes
import dataclasses
import functools
import gc
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.func

import minifunctorch.core as mft

from .cases import S1_LEVELS, chain

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("minifunctorch", "torch.func")
HELPER_SOURCE = r"""
#include <valgrind/callgrind.h>
void zero_counts(void) { CALLGRIND_ZERO_STATS; }
void dump_counts(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
int under_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def build_helper(directory) -> str:
    """Compile the helper library that sends callgrind's client requests; its path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or shutil.which("valgrind") is None:
        raise SystemExit("benchmarks.instructions: needs valgrind and a C compiler (cc) on the "
                         "PATH. Fix: install valgrind (Debian: apt-get install valgrind).")
    source, library = os.path.join(directory, "helper.c"), os.path.join(directory, "helper.so")
    with open(source, "w") as f:
        f.write(HELPER_SOURCE)
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O1", source, "-o", library],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit("benchmarks.instructions: could not compile the helper against "
                         f"valgrind/callgrind.h:\n{built.stderr.strip()}\nFix: install "
                         "valgrind's headers (Debian: apt-get install valgrind).")
    return library


def _api(engine):
    return torch.func if engine == "torch.func" else mft


def _transformed(engine, level, f):
    _, transform, takes_tangent = S1_LEVELS[level]
    return transform(_api(engine), f), takes_tangent


def _s1_regions(levels, ops):
    """(engine, level, chain length, call) per counted region of S1."""
    x = torch.randn(10, 10, generator=torch.Generator().manual_seed(1))
    t = torch.randn(10, 10, generator=torch.Generator().manual_seed(2))
    for engine in ENGINES:
        for level in levels:
            for n_ops in (0, ops):
                f, takes_tangent = _transformed(engine, level, chain(n_ops))
                args = (x, t) if takes_tangent else (x,)
                yield engine, level, n_ops, functools.partial(f, *args)


def whole_calls(programs, groups, quick) -> list:
    """(name, {engine: a function that builds the call}) per program part (``programs``) or
    per case of the benchmark ``groups``."""
    from .harness import MFT, TORCH_FUNC
    if programs:
        from .programs import case_of, parts  # tests/test_tutorials.py, only for this mode
        named = [(f"{part.program}: {part.part}", case_of(part)) for part in parts()]
    else:
        from . import cases
        sizes = dataclasses.replace(cases.QUICK if quick else cases.FULL, inductor=False)
        named = [(f"{group} {case.name}", case)
                 for group, measured in cases.all_cases(sizes, "cpu", groups).items()
                 for together in measured for case in together]
    builders = dict(zip(ENGINES, (MFT, TORCH_FUNC)))
    return [(name, {e: case.builders[key] for e, key in builders.items()})
            for name, case in named]


def _whole_call_regions(calls):
    """(engine, key, 1, call) per whole call, the key numbering ``whole_calls``."""
    for engine in ENGINES:
        for i, (_, build) in enumerate(calls):
            yield engine, f"call{i}", 1, build[engine]()


def child(helper, levels, calls, ops, whole=None):
    """Inside callgrind: one counted region per (engine, level, chain length), or per
    (engine, whole call) when ``whole`` lists them."""
    requests = ctypes.CDLL(helper)
    requests.dump_counts.argtypes = [ctypes.c_char_p]
    if not requests.under_valgrind():
        raise SystemExit("benchmarks.instructions --child runs under callgrind only.")
    torch.set_num_threads(1)
    regions = _whole_call_regions(whole) if whole is not None else _s1_regions(levels, ops)
    requests.zero_counts()  # callgrind's first dump also holds what ran before its zero
    requests.dump_counts(b"start")
    for engine, key, n_ops, call in regions:
        for _ in range(3):  # warm up: first-call work is not per-op cost
            call()
        gc.collect()
        gc.disable()  # as timeit does: a collection's cost depends on the whole heap
        try:
            requests.zero_counts()
            for _ in range(calls):
                call()
            requests.dump_counts(f"{engine}|{key}|{n_ops}".encode())
        finally:
            gc.enable()


def read_dumps(directory) -> dict:
    """(engine, level, ops) -> instructions, from callgrind's dump files in ``directory``."""
    counts = {}
    for path in glob.glob(os.path.join(directory, "callgrind.out*")):
        text = Path(path).read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if label and total and "|" in label.group(1):
            engine, level, n_ops = label.group(1).strip().split("|")
            counts[(engine, level, int(n_ops))] = int(total.group(1))
    return counts


def per_call(counts, keys, calls) -> list:
    """Rows (key, minifunctorch per call, torch.func per call, ratio) of whole calls."""
    rows = []
    for key in keys:
        ours, theirs = (counts[(e, key, 1)] / calls for e in ENGINES)
        rows.append((key, ours, theirs, ours / theirs))
    return rows


def per_op(counts, levels, calls, ops) -> list:
    """Rows (level, minifunctorch per op, torch.func per op, ratio)."""
    rows = []
    for level in levels:
        ours, theirs = ((counts[(e, level, ops)] - counts[(e, level, 0)]) / (ops * calls)
                        for e in ENGINES)
        rows.append((level, ours, theirs, ours / theirs))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default=",".join(lv for lv in S1_LEVELS if lv != "none"),
                        help="S1 levels, comma-separated (default: every transformed level)")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls counted per region (default 20, or 5 for whole calls)")
    parser.add_argument("--ops", type=int, default=100, help="ops in the long chain")
    parser.add_argument("--programs", action="store_true",
                        help="count a call of each tutorial-style program part instead of S1")
    parser.add_argument("--cases", default=None,
                        help="count a call of each case of these groups instead (e.g. S7,S9)")
    parser.add_argument("--quick", action="store_true", help="the cases at their quick sizes")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    groups = [g.strip() for g in (options.cases or "").split(",") if g.strip()]
    whole = options.programs or bool(groups)
    if options.calls is None:
        options.calls = 5 if whole else 20
    levels = [lv.strip() for lv in options.levels.split(",") if lv.strip()]
    unknown = [lv for lv in levels if lv not in S1_LEVELS]
    if unknown:
        raise SystemExit(f"benchmarks.instructions --levels: no level {', '.join(unknown)}; "
                         f"the levels are {', '.join(S1_LEVELS)}.")
    _check_whole_call_options(options, groups)
    calls = whole_calls(options.programs, groups, options.quick) if whole else None
    if options.child:
        return child(options.child, levels, options.calls, options.ops, calls)
    with tempfile.TemporaryDirectory(prefix="minifunctorch-instructions-") as directory:
        helper = build_helper(directory)
        mode = (["--programs"] if options.programs else
                ["--cases", ",".join(groups), *(["--quick"] if options.quick else [])]
                if groups else [])
        command = ["valgrind", "--tool=callgrind", "--dump-instr=no",
                   f"--callgrind-out-file={directory}/callgrind.out",
                   sys.executable, "-m", "benchmarks.instructions", "--child", helper,
                   "--levels", ",".join(levels), "--calls", str(options.calls),
                   "--ops", str(options.ops), *mode]
        what = ("the tutorial-style programs" if options.programs else
                f"{len(calls)} cases of {', '.join(groups)}" if groups else
                f"S1 at {len(levels)} levels")
        print(f"running {what}, 2 engines, under callgrind (minutes) ...", flush=True)
        ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if ran.returncode != 0:
            raise SystemExit(f"benchmarks.instructions: the run under callgrind failed:\n"
                             f"{ran.stderr[-2000:]}")
        counts = read_dumps(directory)
    if whole:
        _print_whole_calls(counts, calls, options.calls)
        return 0
    rows = per_op(counts, levels, options.calls, options.ops)
    print(f"instructions per op of S1's chain on a 10x10 tensor ({options.ops} ops, "
          f"{options.calls} calls per count)")
    print(f"{'level':12s} {'minifunctorch':>14s} {'torch.func':>11s} {'ratio':>6s}")
    for level, ours, theirs, ratio in rows:
        print(f"{level:12s} {ours:14,.0f} {theirs:11,.0f} {ratio:6.2f}")
    return 0


def _check_whole_call_options(options, groups):
    from .cases import GROUPS
    if options.programs and groups:
        raise SystemExit("benchmarks.instructions: --programs and --cases count different "
                         "calls. Fix: give one of them per run.")
    if options.quick and not groups:
        raise SystemExit("benchmarks.instructions --quick: only the cases have quick sizes. "
                         "Fix: add --cases S7,S9 (for example).")
    wrong = [g for g in groups if g not in GROUPS or g == "S1"]
    if wrong:
        raise SystemExit(f"benchmarks.instructions --cases: no group {', '.join(wrong)} here; "
                         f"the groups are {', '.join(g for g in GROUPS if g != 'S1')} (S1 is "
                         "counted per op without --cases, S6 is a first call's time).")


def _print_whole_calls(counts, calls, n_calls):
    rows = per_call(counts, [f"call{i}" for i in range(len(calls))], n_calls)
    print(f"instructions per call (counted over {n_calls} call{'s' if n_calls != 1 else ''})")
    print(f"{'minifunctorch':>14s} {'torch.func':>14s} {'ratio':>6s}  call")
    for (name, _), (_, ours, theirs, ratio) in zip(calls, rows):
        print(f"{ours:14,.0f} {theirs:14,.0f} {ratio:6.2f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
