"""Contenders, correctness checks, interleaved timing and profiles.

NOTE [Check, then time, interleaved]
Every contender of a case is first built (traced, compiled) and called once; its output is
compared with torch.func's (``torch.testing.assert_close``) before anything is timed, and a
contender that is wrong is never timed. Timing then goes round by round: in each round every
contender of a group runs one ``Timer.blocked_autorange``, the order rotating by one each
round (A B C, B C A, C A B, ...), so that a slow drift of the machine (frequency, a
neighbour's load, the allocator's state) lands on every contender alike rather than on the
one that happened to run last. The per-block times of all rounds are pooled; tables report
their median and interquartile range, and ratios are medians divided by torch.func's median
from the same run.

Rounds are many and short (``ROUNDS`` of ``MIN_RUN_TIME`` seconds per contender, for the
same total as 4 rounds of 0.25 s), because on a shared virtual machine the drift comes in
bursts of a second or more that slow every call by up to half: with 4 rounds of 0.25 s, a
burst could cover one contender's block and miss the next one's. Five runs of S8 on the
2-core machine of RESULTS.md gave ratios from 0.85 to 1.31 that way (standard deviation
0.18), and from 0.91 to 0.98 with 25 rounds of 0.05 s (0.025). A block is still one call or
more of at least a millisecond, so the timer's own overhead stays negligible.
"""
import atexit
import cProfile
import dataclasses
import io
import os
import platform
import pstats
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

try:
    import numpy as np
except ImportError as error:  # torch.utils.benchmark needs numpy as well
    raise SystemExit(
        "benchmarks: numpy is not importable (%s). The benchmarks use it for statistics and "
        "torch.utils.benchmark needs it. Fix: `make setup`, or install numpy into the venv."
        % error
    ) from None

import torch
import torch.utils.benchmark as benchmark

# --- contenders, in the order of every table and plot -------------------------------------------
MFT = "minifunctorch"
MFT_JIT = "minifunctorch.jit"
MFT_INDUCTOR = "minifunctorch.jit(inductor)"
TORCH_FUNC = "torch.func"
MAKE_FX = "make_fx(torch.func)"
COMPILE = "compile(make_fx)"
LOOP = "python loop"
HAND = "hand-batched"
COMPILE_HAND = "compile(hand-batched)"
CONTENDERS = (MFT, MFT_JIT, MFT_INDUCTOR, TORCH_FUNC, MAKE_FX, COMPILE, LOOP, HAND,
              COMPILE_HAND)
BASELINE = TORCH_FUNC
ENGINE_CONTENDERS = (MFT, MFT_JIT, MFT_INDUCTOR)  # an error here is a failure, not a note

DESCRIPTIONS = {
    MFT: "minifunctorch transforms, eager (`minifunctorch.core.vmap(grad(f))`, ...)",
    MFT_JIT: "`minifunctorch.core.jit(transformed f)`: a traced program cached per input "
             "signature, replayed",
    MFT_INDUCTOR: "`minifunctorch.core.jit(transformed f, backend='inductor')`",
    TORCH_FUNC: "torch.func transforms, eager: the baseline of every ratio",
    MAKE_FX: "`make_fx(torch.func transform)(*args)` traced once; the GraphModule is "
             "replayed",
    COMPILE: "`torch.compile(make_fx(torch.func transform)(*args))` (inductor)",
    LOOP: "a Python loop: `torch.autograd.grad` per sample (S2, S7), per task (S8), per "
          "example and output (S9); one module call per model (S5, S10)",
    HAND: "hand-batched closed form (einsum; S10: a grouped convolution), the floor",
    COMPILE_HAND: "`torch.compile(hand-batched)` (inductor): what inductor makes of the floor "
                  "itself, beside what it makes of the engines' programs",
}


class NotAvailable(Exception):
    """A contender that does not exist or does not apply here: a note in the tables."""


def find_jit():
    """``minifunctorch.core.jit`` if the engine has it yet, else None (looked up per call,
    so that a jit that lands later, or a test's stand-in, is picked up)."""
    from minifunctorch import core
    return getattr(core, "jit", None)


# --- cases and results ---------------------------------------------------------------------------
Builder = Callable[[], Callable[[], Any]]


@dataclasses.dataclass(eq=False)
class Case:
    """One measured computation. Each builder builds its contender (tracing, compiling) and
    returns a zero-argument callable that computes the result; builders run lazily, inside
    the correctness check, so that building counts towards the time to first result."""

    group: str  # "S2"
    name: str  # "B=64"
    builders: dict  # contender -> Builder
    notes: dict = dataclasses.field(default_factory=dict)  # contender -> why it is absent
    rtol: float | None = None
    atol: float | None = None

    @property
    def label(self) -> str:
        return f"{self.group} {self.name}"


@dataclasses.dataclass(eq=False)
class Result:
    """A contender on a case: its check status and, once measured, its per-block times."""

    case: Case
    contender: str
    status: str  # "ok", "n/a", "error" or "wrong"
    detail: str = ""
    first_call_s: float | None = None
    fn: Callable | None = dataclasses.field(default=None, repr=False)
    times: list = dataclasses.field(default_factory=list)  # seconds per call, one per block

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed(self) -> bool:
        """A wrong result, or an engine contender that raised: the run must not pass."""
        return self.status == "wrong" or (self.status == "error"
                                          and self.contender in ENGINE_CONTENDERS)

    @property
    def median(self) -> float | None:
        return float(np.median(self.times)) if self.times else None

    @property
    def iqr(self) -> float | None:
        if not self.times:
            return None
        q25, q75 = np.percentile(self.times, [25, 75])
        return float(q75 - q25)

    def fresh(self) -> "Result":
        """The same checked contender with no times (for a second run at other settings)."""
        return dataclasses.replace(self, times=[])


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def check_case(case: Case) -> dict:
    """Build and call every contender once; compare each output with torch.func's.

    Returns contender -> Result, for every contender name (absent ones as "n/a")."""
    results = {}
    expected = None
    order = (BASELINE,) + tuple(c for c in CONTENDERS if c != BASELINE)
    for contender in order:
        builder = case.builders.get(contender)
        if builder is None:
            results[contender] = Result(case, contender, "n/a",
                                        case.notes.get(contender, "does not apply"))
            continue
        try:
            _sync()
            start = time.perf_counter()
            fn = builder()
            out = fn()
            _sync()
            first_call = time.perf_counter() - start
        except (NotAvailable, NotImplementedError) as error:
            results[contender] = Result(case, contender, "n/a", _first_line(error))
            continue
        except Exception as error:  # noqa: BLE001 - reported in the tables, and fails the run
            if contender == BASELINE:
                raise
            results[contender] = Result(case, contender, "error", _first_line(error))
            continue
        if contender == BASELINE:
            expected = out
        else:
            try:
                torch.testing.assert_close(out, expected, rtol=case.rtol, atol=case.atol,
                                           check_dtype=True)
            except (AssertionError, TypeError, ValueError) as error:
                message = " ".join(str(error).split())[:300]
                results[contender] = Result(case, contender, "wrong", message)
                continue
        results[contender] = Result(case, contender, "ok", first_call_s=first_call, fn=fn)
    inductor, compiled = results[MFT_INDUCTOR], results[COMPILE]
    if inductor.status == "error" and compiled.status == "error":
        # torch.compile itself does not work here (no compiler, no triton): not the engine's
        results[MFT_INDUCTOR] = Result(case, MFT_INDUCTOR, "n/a",
                                       f"torch.compile fails here too ({compiled.detail})")
    return {c: results[c] for c in CONTENDERS}


# --- timing --------------------------------------------------------------------------------------
# NOTE [Check, then time, interleaved]: many short rounds
ROUNDS = 20
MIN_RUN_TIME = 0.05


def measure(results: list, *, threads: int, min_run_time: float, rounds: int,
            warmup: int = 2, log=print) -> None:
    """Time the checked contenders in ``results`` together, interleaved (see the NOTE).

    Appends per-block seconds-per-call to each ``Result.times``."""
    ready = [r for r in results if r.ok]
    if not ready:
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for result in ready:  # warm caches and the allocator before any block is timed
            for _ in range(warmup):
                result.fn()
    finally:
        torch.set_num_threads(previous)
    for round_index in range(rounds):
        shift = round_index % len(ready)
        for result in ready[shift:] + ready[:shift]:
            timer = benchmark.Timer(stmt="fn()", globals={"fn": result.fn},
                                    num_threads=threads, label=result.case.label,
                                    sub_label=result.contender)
            measurement = timer.blocked_autorange(min_run_time=min_run_time)
            result.times.extend(measurement.times)
    for result in ready:
        log(f"  {result.case.label:<28} {result.contender:<28} "
            f"{format_seconds(result.median):>10}  (IQR {format_seconds(result.iqr)})")


def check_then_time(items, *, check, label, check_only, threads, min_run_time, rounds, out,
                    render, log=print) -> list:
    """The side-by-side scripts' run (benchmarks.programs, benchmarks.ops): check every item
    (``check(item)`` -> {contender: Result}), then, unless ``check_only``, time each item's
    checked contenders interleaved and write ``render(checked, env)`` to ``out`` (if given).
    ``label(item)`` names an item in the log. Returns [(item, {contender: Result})]; the
    thread count is restored."""
    started = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        env = environment(device="cpu", threads=threads, min_run_time=min_run_time,
                          rounds=rounds, inductor_cache="not used (nothing is compiled)")
        checked = []
        for item in items:
            by_contender = check(item)
            checked.append((item, by_contender))
            for result in by_contender.values():
                if result.status in ("error", "wrong"):
                    log(f"  {label(item)}: {result.contender} {result.status}: "
                        f"{result.detail}")
        log(f"checked {len(checked)} in {time.perf_counter() - started:.1f} s")
        if not check_only:
            for item, by_contender in checked:
                log(f"timing {label(item)} ...")
                measure(list(by_contender.values()), threads=threads,
                        min_run_time=min_run_time, rounds=rounds, log=log)
            env["load average at the end (1/5/15 min)"] = load_average()
            if out is not None:
                Path(out).write_text(render(checked, env))
                log(f"wrote {out}")
    finally:
        torch.set_num_threads(previous)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return checked


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        # (999.6 µs is shown as 1 ms: three digits of it in µs would print as 1e+03 µs)
        if abs(seconds) >= 0.9995 * scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


# --- profiles ------------------------------------------------------------------------------------
_CORE_DIR = None


def _core_dir() -> str:
    global _CORE_DIR
    if _CORE_DIR is None:
        from minifunctorch import core
        _CORE_DIR = str(Path(core.__file__).resolve().parent)
    return _CORE_DIR


def _where(filename: str) -> str:
    """'core' (the engine), 'program' (code the jit generated: its tensor operators run
    inline, so their kernels count as its own time), 'torch' (torch's Python), 'builtin'
    (C calls) or 'other'."""
    if filename == "~":
        return "builtin"
    if filename.startswith("<minifunctorch program"):
        return "program"
    if str(Path(filename).resolve()).startswith(_core_dir()):
        return "core"
    if f"{os.sep}torch{os.sep}" in filename:
        return "torch"
    return "other"


def _short_function(key) -> str:
    filename, line, function = key
    where = _where(filename)
    if where == "builtin":
        return function
    if where == "core":
        return f"core/{Path(filename).name}:{line}({function})"
    if where == "program":
        return f"{filename}({function})"
    parts = Path(filename).parts
    if where == "torch":
        tail = "/".join(parts[parts.index("torch"):][-2:])
        return f"{tail}:{line}({function})"
    return f"{Path(filename).name}:{line}({function})"


@dataclasses.dataclass
class Profile:
    """A cProfile of ``calls`` calls of one contender, summarised for the report."""

    label: str
    calls: int
    total_s: float
    rows: list = dataclasses.field(repr=False)  # (function, ncalls, tottime_s, cumtime_s)
    share: dict  # 'core'/'program'/'torch'/'builtin'/'other' -> fraction of the own time
    torch_c_share: float  # fraction of own time in C calls into torch (kernels, dispatch)
    top: int = 12
    targets: list = dataclasses.field(default_factory=list)  # the targets it missed

    @property
    def by_tottime(self) -> list:
        return sorted(self.rows, key=lambda r: -r[2])[:self.top]

    @property
    def by_cumtime(self) -> list:
        return sorted(self.rows, key=lambda r: -r[3])[:self.top]


def profile(fn: Callable, label: str, *, seconds: float = 0.5, top: int = 12) -> Profile:
    """Profile repeated calls of ``fn`` for about ``seconds`` (after one warm call)."""
    fn()
    start = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - start, 1e-6)
    calls = max(3, min(2000, int(seconds / per_call)))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    _sync()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows, torch_c = [], 0.0
    share = {"core": 0.0, "program": 0.0, "torch": 0.0, "builtin": 0.0, "other": 0.0}
    for key, (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append((_short_function(key), ncalls, tottime, cumtime))
        where = _where(key[0])
        share[where] += tottime
        if where == "builtin" and any(word in key[2] for word in ("torch", "Tensor", "kernel")):
            torch_c += tottime
    total = sum(share.values()) or 1.0
    share = {k: v / total for k, v in share.items()}
    return Profile(label, calls, total, rows, share, torch_c / total, top)


# NOTE [Kernel time of a missed target]
# cProfile says where the Python time goes; it cannot say whether the kernels themselves
# differ. torch.profiler records every aten op with its own CPU time (the kernel, with its
# dispatch) and, on a GPU, every kernel launch, the kernels' time on the device and the
# runtime calls that make the CPU wait for the GPU. Side by side for the engine and for
# torch.func on the same case, these say whether a miss is the kernels' (more launches, a
# sync, a slower kernel) or the Python around them (the same kernels, more wall time).
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
          "cudaMemcpy")


@dataclasses.dataclass
class KernelTime:
    """torch.profiler of ``calls`` calls of one contender; every figure is per call."""

    label: str
    calls: int
    wall_s: float  # under the profiler
    aten_s: float  # the aten ops' own CPU time: the kernels (on a GPU: their launches)
    aten_ops: float  # aten ops called from Python (not from inside another aten op)
    launches: float | None = None  # CUDA kernel launches (None on the CPU)
    device_s: float | None = None  # the kernels' time on the GPU
    syncs: float | None = None  # runtime calls that wait for the GPU


def kernel_time(fn: Callable, label: str, *, device: str, calls: int = 20) -> KernelTime:
    """``fn`` called ``calls`` times under torch.profiler, after two warm calls (NOTE [Kernel
    time of a missed target])."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = device == "cuda"
    fn()
    fn()
    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        wall = time.perf_counter() - start
    events = prof.events()
    if cuda:  # the syncs that profiling itself makes (the one above, the profiler's own)
        with torch_profile(activities=activities) as empty:
            _sync()
        own_syncs = sum(e.name in _SYNCS for e in empty.events())
    aten = [e for e in events if e.name.startswith("aten::")]
    result = KernelTime(
        label, calls, wall / calls,
        aten_s=sum(e.self_cpu_time_total for e in aten) / 1e6 / calls,
        aten_ops=sum(e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
                     for e in aten) / calls)
    if cuda:
        on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        result.launches = sum(e.name in _LAUNCHES for e in events) / calls
        result.device_s = sum(e.device_time_total for e in on_device) / 1e6 / calls
        result.syncs = max(0, sum(e.name in _SYNCS for e in events) - own_syncs) / calls
    return result


@dataclasses.dataclass
class HotSpots:
    """Profiles merged: each function's share of the own (and cumulative) time, averaged
    over the profiles so that every profiled case weighs the same."""

    label: str
    rows: list  # (function, mean share of own time, mean share of cumulative time)
    share: dict
    torch_c_share: float


def hot_spots(profiles: list, label: str, *, top: int = 15) -> HotSpots | None:
    if not profiles:
        return None
    own, cumulative = {}, {}
    for p in profiles:
        for name, _, tottime, cumtime in p.rows:
            own[name] = own.get(name, 0.0) + tottime / p.total_s / len(profiles)
            cumulative[name] = cumulative.get(name, 0.0) + cumtime / p.total_s / len(profiles)
    rows = sorted(((name, own[name], cumulative[name]) for name in own), key=lambda r: -r[1])
    share = {k: sum(p.share[k] for p in profiles) / len(profiles) for k in profiles[0].share}
    torch_c = sum(p.torch_c_share for p in profiles) / len(profiles)
    return HotSpots(label, rows[:top], share, torch_c)


# --- the machine and the settings ----------------------------------------------------------------
def _cpu_model() -> str:
    """"AMD EPYC (AuthenticAMD, cpu family 25, model 17)": two CPUs of one name can differ in
    what the kernel choices depend on (NOTE [Kernel choices that depend on the CPU])."""
    from minifunctorch.core import kernels  # (the facts the engine itself reads)
    info = kernels.CPU_INFO
    if "model name" not in info:
        return platform.processor() or "unknown"
    ids = [info.get("vendor_id", "")] + [f"{key} {info[key]}" for key in ("cpu family", "model")
                                         if key in info]
    return f"{info['model name']} ({', '.join(filter(None, ids))})"


def _kernel_choices() -> str:
    from minifunctorch.core import kernels
    return f"wide-vector convolution kernels: {'yes' if kernels.WIDE_VECTORS else 'no'}"


def _git_revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "core"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + (" (core/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# NOTE [A fresh inductor cache per run]
# torch.compile keeps what it built in a cache on disk (TORCHINDUCTOR_CACHE_DIR, by default
# /tmp/torchinductor_<user>) and reuses it across processes. A run would then time code
# built by some earlier process, under whatever that process found: an artifact compiled
# when inductor's CPU check failed is plain scalar C++, and stays so on every later hit (a
# stale cache on this machine held S2's compiled program at 2x the time of a fresh build).
# Its "build + first call" column would also show a cache hit, not a build. So each run
# compiles into a fresh directory of its own, unless TORCHINDUCTOR_CACHE_DIR is set.
def use_fresh_inductor_cache() -> str:
    """Point torch.compile at a new empty cache directory (unless the caller chose one);
    returns the directory, for the report."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen:
        return f"{chosen} (TORCHINDUCTOR_CACHE_DIR, as set)"
    directory = tempfile.mkdtemp(prefix="minifunctorch-bench-inductor-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    return "a fresh directory for this run (NOTE [A fresh inductor cache per run])"


def environment(*, device: str, threads: int, min_run_time: float, rounds: int,
                inductor_cache: str) -> dict:
    """What the results depend on, recorded with them."""
    info = {
        "platform": platform.platform(),
        "CPU": _cpu_model(),
        # (the rules pick some CPU kernels by it: NOTE [Kernel choices that depend on the CPU])
        "CPU capability (torch)": torch.backends.cpu.get_cpu_capability(),
        "CPU kernel choices (core/kernels.py)": _kernel_choices(),
        "cores (os.cpu_count / usable)": f"{os.cpu_count()} / {len(os.sched_getaffinity(0))}"
        if hasattr(os, "sched_getaffinity") else str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "minifunctorch commit": _git_revision(),
        "device": device,
    }
    if device == "cuda":
        info["GPU"] = torch.cuda.get_device_name()
    info.update({
        "threads (torch.set_num_threads)": str(threads),
        "MALLOC_MMAP_MAX_": os.environ.get("MALLOC_MMAP_MAX_", "unset"),
        "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_", "unset"),
        "torch.compile cache": inductor_cache,
        "timer": f"torch.utils.benchmark.Timer.blocked_autorange(min_run_time={min_run_time})"
                 f" x {rounds} interleaved rounds",
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load average at the start (1/5/15 min)": load_average(),
        "process niceness": str(os.nice(0)) if hasattr(os, "nice") else "unknown",
    })
    return info


def load_average() -> str:
    """The machine's load: other processes running during a run make its timings noisy."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"
