"""``python -m benchmarks.run [--quick] [--device cpu|cuda] [--threads N] [--groups S7,S8]``

The full run checks every case, times it, evaluates the targets, profiles the
minifunctorch contender of each missed target, and writes ``benchmarks/RESULTS.md`` and
``benchmarks/results.png`` (``make bench`` runs it with the glibc allocator settings that
the report records). ``--quick`` uses small sizes and only checks correctness: nothing is
timed, and the report is written only if ``--out DIR`` is given. ``--groups`` runs only the
groups named (e.g. ``S7,S8``; S6 is the time to first result), and then too the report is
written only if ``--out DIR`` is given, so that a partial run never replaces the full
``benchmarks/RESULTS.md``. ``--no-inductor`` leaves out the two torch.compile contenders
(minutes of compiling, which a short lease of a GPU machine cannot spare). The exit status
is 1 if a contender computed a wrong result or an engine contender raised.
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from . import harness  # noqa: I001 - harness fails clearly if numpy is missing
from . import cases, report

HERE = Path(__file__).resolve().parent


def run(*, quick=False, device="cpu", threads=1, extra_threads=2, out_dir=None,
        min_run_time=harness.MIN_RUN_TIME, rounds=harness.ROUNDS, first_result_reps=5, max_profiles=16, groups=None,
        inductor=True, log=print) -> report.Suite:
    """Run the suite, or only the ``groups`` named; write the report to ``out_dir``
    (default: benchmarks/ for a full run of every group, else nowhere). Returns the Suite."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks: --device cuda was asked for, but torch.cuda is not "
                         "available on this machine (torch %s)." % torch.__version__)
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"benchmarks: --device must be cpu or cuda, got {device!r}.")
    if groups is not None:
        groups = tuple(groups)
        unknown = set(groups) - set(cases.GROUPS) - {"S6"}
        if unknown:
            known = sorted(set(cases.GROUPS) | {"S6"}, key=lambda g: int(g[1:]))  # S9 < S10
            raise SystemExit(f"benchmarks: --groups {','.join(groups)}: no group "
                             f"{', '.join(sorted(unknown))}; the groups are "
                             f"{', '.join(known)}.")
    started = time.perf_counter()
    torch.set_num_threads(threads)
    sizes = cases.QUICK if quick else cases.FULL
    if not inductor:
        sizes = dataclasses.replace(sizes, inductor=False)
    inductor_cache = (harness.use_fresh_inductor_cache() if sizes.inductor else
                      "not used (no inductor contender is built)")
    env = harness.environment(device=device, threads=threads, min_run_time=min_run_time,
                              rounds=rounds, inductor_cache=inductor_cache)
    if device == "cuda":
        # On a GPU, torch runs convolutions (and, if asked, matmuls) in TF32 by default: a
        # 10-bit mantissa, so contenders that batch the same convolution differently (cuDNN
        # picks its algorithm per shape) differ by 1e-4, and the correctness check would
        # reject the python loop itself. Every contender computes in full float32 here.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        env["TF32 (cudnn, cuda matmul)"] = "off, for every contender"
    suite = report.Suite(env=env, quick=quick, groups={}, s1_ops=sizes.s1_ops,
                         threads=threads)

    # 1. Correctness, for every case and contender, before anything is timed.
    log(f"checking ({'quick' if quick else 'full'} sizes, device {device}) ...")
    for group, measured in cases.all_cases(sizes, device, groups).items():
        suite.groups[group] = [[harness.check_case(case) for case in together]
                               for together in measured]
        for by_contender in suite.results(group):
            for result in by_contender.values():
                if result.status in ("error", "wrong"):
                    log(f"  {result.case.label:<28} {result.contender:<28} {result.status}: "
                        f"{result.detail}")
    if groups is None or "S6" in groups:
        _first_results(suite, sizes, device, reps=1 if quick else first_result_reps)
    failures = suite.failures()
    log(f"checked in {time.perf_counter() - started:.1f} s; "
        f"{len(failures)} failure(s)")

    # 2. Timing, interleaved within each measurement group.
    if not quick:
        for group, measured in suite.groups.items():
            log(f"timing {group} ({threads} thread(s)) ...")
            for together in measured:
                harness.measure([r for by_c in together for r in by_c.values()],
                                threads=threads, min_run_time=min_run_time, rounds=rounds,
                                log=log)
        if extra_threads and extra_threads != threads and suite.results("S2"):
            log(f"timing S2 again with {extra_threads} threads ...")
            suite.extra_threads = extra_threads
            suite.extra = [{c: r.fresh() for c, r in by_c.items()}
                           for by_c in suite.results("S2")]
            for by_contender in suite.extra:
                harness.measure(list(by_contender.values()), threads=extra_threads,
                                min_run_time=min_run_time, rounds=rounds, log=log)

    # 3. Targets, and profiles of the minifunctorch contenders that missed one.
    suite.targets = report.evaluate_targets(suite)
    if not quick:
        torch.set_num_threads(threads)
        _profile_misses(suite, max_profiles=max_profiles, log=log)
    suite.env["load average at the end (1/5/15 min)"] = harness.load_average()

    if out_dir is None and not quick and groups is None:
        out_dir = HERE
    if out_dir is not None:
        markdown, image = report.write(suite, Path(out_dir))
        log(f"wrote {markdown} and {image}")
    log(f"done in {time.perf_counter() - started:.0f} s")
    return suite


def _first_results(suite, sizes, device, *, reps):
    """S6: build + first call of fresh contenders, ``reps`` times. The inductor contenders
    are not rebuilt (seconds each): their one build in S2 stands for them."""
    for _ in range(reps):
        for case in cases.s6_first_result_cases(sizes, device):
            for contender, result in harness.check_case(case).items():
                if result.ok:
                    suite.first_result.setdefault(case.name, {}).setdefault(
                        contender, []).append(result.first_call_s)
    suite.first_result_reps = reps
    s2 = suite.results("S2")
    for label, by_contender in suite.first_result.items():
        if s2 and "per-sample" in label:
            for contender in (harness.MFT_INDUCTOR, harness.COMPILE):
                if s2[0][contender].ok:
                    by_contender[contender] = [s2[0][contender].first_call_s]


def _profile_misses(suite, *, max_profiles, log):
    """Profile each (case, contender) that missed a target: the worst miss of every target
    first, then the others by how far they missed, at most ``max_profiles`` in all."""
    worst = report.worst_misses(suite.targets)
    worst_ids = {id(r) for r in worst}
    others = sorted((r for r in suite.targets
                     if r.status == "missed" and id(r) not in worst_ids), key=lambda r: -r.miss)
    for row in worst + others:
        key = f"{row.contender} on {row.profile_case.label}"
        if key in suite.profiles:
            suite.profiles[key].targets.append(row.target.split(" ", 1)[0])
            continue
        result = _result_of(suite, row.profile_case, row.contender)
        if result is None or not result.ok or len(suite.profiles) >= max_profiles:
            continue
        log(f"profiling {key} ...")
        suite.profiles[key] = harness.profile(result.fn, key)
        baseline = _result_of(suite, row.profile_case, harness.TORCH_FUNC)
        if baseline is not None and baseline.ok:  # NOTE [Kernel time of a missed target]
            device = suite.env.get("device", "cpu")
            suite.kernel_times[key] = (
                harness.kernel_time(result.fn, key, device=device),
                harness.kernel_time(baseline.fn, f"torch.func on {row.profile_case.label}",
                                    device=device))
        suite.profiles[key].targets.append(row.target.split(" ", 1)[0])
        if id(row) in worst_ids:
            suite.detailed.append(key)
    for contender in harness.ENGINE_CONTENDERS:
        profiles = [p for k, p in suite.profiles.items() if k.startswith(contender + " on")]
        if profiles:
            suite.hot_spots.append(harness.hot_spots(
                profiles, f"{contender}, over {len(profiles)} profiled case(s)"))


def _result_of(suite, case, contender):
    for group in suite.groups:
        for by_contender in suite.results(group):
            if by_contender[contender].case is case:
                return by_contender[contender]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, correctness checks only, nothing timed")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the main run (default 1)")
    parser.add_argument("--extra-threads", type=int, default=2,
                        help="thread count of the second run of S2 (0: skip; default 2)")
    parser.add_argument("--min-run-time", type=float, default=harness.MIN_RUN_TIME,
                        help=f"seconds per blocked_autorange (default {harness.MIN_RUN_TIME})")
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS,
                        help=f"interleaved rounds per measurement group (default "
                             f"{harness.ROUNDS})")
    parser.add_argument("--groups", default=None,
                        help="comma-separated groups to run (e.g. S7,S8; default: all); the "
                             "report is then written only with --out")
    parser.add_argument("--no-inductor", action="store_true",
                        help="leave out the torch.compile contenders (minutes of compiling)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write RESULTS.md and results.png (default: "
                             "benchmarks/; in --quick mode, nowhere unless given)")
    args = parser.parse_args(argv)
    suite = run(quick=args.quick, device=args.device, threads=args.threads,
                extra_threads=args.extra_threads, out_dir=args.out,
                min_run_time=args.min_run_time, rounds=args.rounds,
                groups=None if args.groups is None else
                [g.strip() for g in args.groups.split(",") if g.strip()],
                inductor=not args.no_inductor)
    failures = suite.failures()
    for result in failures:
        print(f"FAILED: {result.case.label}, {result.contender}: {result.status}: "
              f"{result.detail}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
