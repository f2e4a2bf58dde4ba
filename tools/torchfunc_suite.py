"""Run PyTorch's own torch.func tests on torch.func and on minifunctorch, and compare.

    nice -n 10 .venv/bin/python tools/torchfunc_suite.py SUITE_DIR [--out report.md]

SUITE_DIR holds four files of PyTorch's repository, from the commit closest to the installed
torch (see docs/TORCHFUNC-SUITE.md): test/functorch/test_eager_transforms.py,
test/functorch/test_vmap.py, and the helpers they import from the same folder,
test/functorch/common_utils.py and test/functorch/functorch_additional_op_db.py. Keep them
outside this repository: they are PyTorch's code, not ours.

The runner runs the tests twice with pytest, in subprocesses: as they are (torch.func), and with
the torch.func API swapped for minifunctorch's by the pytest plugin tools/torchfunc_shim.py
(its NOTE [What the swap replaces] says which names, and why). It then reports how many of the
tests that pass on torch.func pass here, per file and per test class, and the most frequent
failure causes: the first line of each exception, normalized, and the operations minifunctorch
refused.

The engine under test is whatever ``import minifunctorch.core`` resolves to in the Python that
runs this script (with the editable install, the checkout the install points at).

NOTE [What counts as passing]
A test passes when pytest reports it passed in every phase and in every subtest (the OpInfo
tests run each sample input as a unittest subtest). Skipped, expected failures (unittest's
expectedFailure and the tests' own xfail lists) and unexpected successes do not pass. The
denominator is the set of tests that pass on torch.func in the same environment, so tests that
need a newer torch than the installed one, CUDA, or torchvision drop out of it on their own.

NOTE [Timeouts and parallel runs]
pytest-timeout is not installed here, so the plugin limits each test itself (SIGALRM, as
pytest-timeout's signal method does; ``--test-timeout``), and each pytest process also has a
limit (``--run-timeout``). A process that dies or runs out of time leaves the outcomes it had
written; the tests it did not reach are reported as not run. Each (engine, file) pair is one
pytest process with OMP_NUM_THREADS=1; ``--jobs N`` runs N of them at once (the four are
independent processes, so on a 2-core machine ``--jobs 2`` is safe; the default is 1).
"""

import argparse
import collections
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
TEST_FILES = ("test_eager_transforms.py", "test_vmap.py")
HELPERS = ("common_utils.py", "functorch_additional_op_db.py")
ENGINES = ("torch.func", "minifunctorch")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run PyTorch's torch.func tests on torch.func and on minifunctorch.")
    parser.add_argument("suite_dir", type=Path,
                        help="folder holding PyTorch's test/functorch files (see the docstring)")
    parser.add_argument("--out", type=Path, help="write the markdown report here (default: print)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, applied to both runs")
    parser.add_argument("--jobs", type=int, default=1,
                        help="pytest processes at once, one per (engine, file) (default 1)")
    parser.add_argument("--test-timeout", type=float, default=300,
                        help="seconds one test may run (default 300)")
    parser.add_argument("--run-timeout", type=float, default=3 * 3600,
                        help="seconds one pytest process may run (default 10800)")
    parser.add_argument("--workdir", type=Path,
                        help="where outcomes and pytest logs go (default: a new temporary folder)")
    parser.add_argument("--baseline", type=Path,
                        help="reuse the torch.func outcomes of an earlier run (its "
                             "WORKDIR/torch.func) instead of running torch.func again")
    parser.add_argument("--top", type=int, default=40, help="failure causes to list (default 40)")
    args = parser.parse_args(argv)
    missing = [name for name in TEST_FILES + HELPERS if not (args.suite_dir / name).is_file()]
    if missing:
        parser.error(f"{args.suite_dir} lacks {', '.join(missing)}: fetch them from "
                     "pytorch/pytorch test/functorch/ (see docs/TORCHFUNC-SUITE.md)")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.baseline and not all((args.baseline / f"{name}.jsonl").is_file()
                                 for name in TEST_FILES):
        parser.error(f"--baseline {args.baseline}: expected "
                     f"{', '.join(name + '.jsonl' for name in TEST_FILES)} in it "
                     "(the torch.func folder of an earlier run's workdir)")
    return args


# --- running -----------------------------------------------------------------------------------

def run_pytest(engine, test_file, args, workdir):
    """One pytest process: ``test_file`` on ``engine``. Returns (results file, return code)."""
    outdir = workdir / engine
    outdir.mkdir(parents=True, exist_ok=True)
    results = outdir / f"{test_file}.jsonl"
    results.unlink(missing_ok=True)
    plugin_dir = workdir / "plugin"
    env = dict(os.environ,
               TORCHFUNC_SUITE_ENGINE=engine,
               TORCHFUNC_SUITE_RESULTS=str(results),
               TORCHFUNC_SUITE_TIMEOUT=str(args.test_timeout),
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir),
                                                        os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "torchfunc_shim",
               "-q", "--tb=short", "-rN", test_file]
    if args.keyword:
        command += ["-k", args.keyword]
    with open(outdir / f"{test_file}.log", "w") as log:
        try:
            process = subprocess.run(command, cwd=args.suite_dir, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=args.run_timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            code = f"killed after --run-timeout {args.run_timeout:g} s"
    return results, code


def prepare_plugin(workdir):
    """A folder holding only the plugin, for PYTHONPATH: tools/ also holds modules (coverage.py)
    that would shadow installed packages."""
    plugin_dir = workdir / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    link = plugin_dir / "torchfunc_shim.py"
    if not link.exists():
        link.symlink_to(TOOLS / "torchfunc_shim.py")


def read_results(path):
    """The plugin's JSON lines: a header, the collected node ids, one record per test run."""
    header, collected, tests = {}, [], {}
    if not path.is_file():
        return header, collected, tests
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed process
            continue
        if "nodeid" in record:
            tests[record["nodeid"]] = record
        elif "collected" in record:
            collected = record["collected"]
        else:
            header.update(record)
    return header, collected, tests


def run_all(args, workdir):
    """Outcomes per engine: {engine: {test_file: (header, collected, tests, return code)}}."""
    engines = ("minifunctorch",) if args.baseline else ENGINES
    jobs = [(engine, test_file) for engine in engines for test_file in TEST_FILES]
    outcomes = collections.defaultdict(dict)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_pytest, engine, test_file, args, workdir): (engine, test_file)
                   for engine, test_file in jobs}
        for future in concurrent.futures.as_completed(futures):
            engine, test_file = futures[future]
            results, code = future.result()
            outcomes[engine][test_file] = (*read_results(results), code)
            print(f"  {engine} {test_file}: done ({code})", file=sys.stderr)
    if args.baseline:
        for test_file in TEST_FILES:
            outcomes["torch.func"][test_file] = (
                *read_results(args.baseline / f"{test_file}.jsonl"), "reused")
    return outcomes


# --- analysis ----------------------------------------------------------------------------------

def normalize(message):
    """A failure's first line, with what varies between tests of the same cause taken out: the
    module path of the exception type, the call that minifunctorch's messages start with, its
    "Fix: ..." advice, operation names (the refusals table counts those), numbers, addresses."""
    line = message or "(no message)"
    line = re.sub(r"^(?:[\w]+\.)+(\w+(?:Error|Exception|Timeout))\b", r"\1", line)
    line = re.sub(r"\b(\w+)\(.*?\)\((?:<inputs>|cotangents|primals)\): ", r"\1(...): ", line)
    line = re.sub(r"\bFix: .*", "", line)
    line = re.sub(r"\b(?:aten|prims)\.[\w.]+", "aten.<op>", line)
    line = re.sub(r"the primitive '[^']+'", "the primitive '<op>'", line)
    line = re.sub(r"0x[0-9a-fA-F]+", "0x...", line)
    line = re.sub(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w])", "N", line)
    line = line.strip()
    return line if len(line) <= 160 else line[:157] + "..."


REFUSAL_PATTERNS = (
    re.compile(r"\b((?:aten|prims)\.[\w.]+)"),  # ...: aten.foo.default is not supported ...
    re.compile(r"the primitive '([^']+)' has no"),
    re.compile(r"^([\w.]+(?:\(\.\.\.\))?) is not supported inside minifunctorch"),
    re.compile(r"^(?:\w+: )?([\w.]+): [^:]* is not supported inside minifunctorch"),
    re.compile(r"minifunctorch has no (\w+)"),
)


def refused_operation(message):
    """The operation or API a minifunctorch refusal names, if the message is one."""
    text = re.sub(r"^(?:[\w]+\.)+(\w+Error): ", "", message or "")
    if not re.search(r"not supported|has no|minifunctorch has no", text):
        return None
    for pattern in REFUSAL_PATTERNS:
        match = pattern.search(text)
        if match:
            return match.group(1)
    return None


def test_class(nodeid):
    return nodeid.split("::")[1] if "::" in nodeid else nodeid


def compare(outcomes):
    """Per file: the tests passing on torch.func, and the outcome of each here."""
    rows = {}
    for test_file in TEST_FILES:
        _, collected, torch_tests, torch_code = outcomes["torch.func"][test_file]
        _, _, ours, our_code = outcomes["minifunctorch"][test_file]
        baseline = sorted(n for n, r in torch_tests.items() if r["outcome"] == "passed")
        here = {}
        for nodeid in baseline:
            record = ours.get(nodeid)
            if record is None:
                record = {"outcome": "not run",
                          "message": f"not run: the minifunctorch pytest process ended ({our_code})",
                          "engine_calls": 0}
            here[nodeid] = record
        extra = sorted(n for n, r in ours.items() if r["outcome"] == "passed"
                       and torch_tests.get(n, {}).get("outcome") != "passed")
        rows[test_file] = {"collected": len(collected), "baseline": baseline, "here": here,
                           "extra": extra, "codes": (torch_code, our_code),
                           "torch_run": len(torch_tests)}
    return rows


# --- report ------------------------------------------------------------------------------------

def percent(part, whole):
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def git_commit(path):
    try:
        return subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%h %cs %s"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def report(args, outcomes, rows, workdir):
    header = outcomes["minifunctorch"][TEST_FILES[0]][0]
    engine_dir = header["minifunctorch"]
    torch_version = header["torch"]
    lines = [
        "# PyTorch's torch.func tests on minifunctorch", "",
        f"- Date: {datetime.date.today().isoformat()}; torch {torch_version}; "
        f"Python {sys.version.split()[0]}",
        f"- minifunctorch.core: {engine_dir} ({git_commit(engine_dir)})",
        "- Suite: " + ", ".join(f"{name} (sha256 {file_digest(args.suite_dir / name)})"
                                for name in TEST_FILES + HELPERS),
    ]
    source = args.suite_dir / "SOURCE.txt"
    if source.is_file():
        lines.append(f"- {source}:")
        lines += [f"  - {line}" for line in source.read_text().splitlines() if line.strip()]
    if header.get("missing"):
        lines.append("- torch.func API minifunctorch lacks (stubbed, raise NotImplementedError): "
                     + ", ".join(header["missing"]))
    if args.keyword:
        lines.append(f"- Filtered with -k {args.keyword!r}")
    lines.append(f"- Outcomes and pytest logs: {workdir}")

    lines += ["", "## The figure", "",
              "| file | collected | pass on torch.func | pass here | % | passing here without "
              "calling minifunctorch |",
              "|---|---:|---:|---:|---:|---:|"]
    totals = collections.Counter()
    for test_file, row in rows.items():
        passed = [n for n, r in row["here"].items() if r["outcome"] == "passed"]
        untouched = [n for n in passed if row["here"][n]["engine_calls"] == 0]
        counts = {"collected": row["collected"], "baseline": len(row["baseline"]),
                  "passed": len(passed), "untouched": len(untouched)}
        totals.update(counts)
        lines.append(f"| {test_file} | {counts['collected']} | {counts['baseline']} | "
                     f"{counts['passed']} | {percent(counts['passed'], counts['baseline'])} | "
                     f"{counts['untouched']} |")
    lines.append(f"| **total** | {totals['collected']} | {totals['baseline']} | "
                 f"**{totals['passed']}** | **{percent(totals['passed'], totals['baseline'])}** | "
                 f"{totals['untouched']} |")
    lines.append("")
    lines.append(f"On PyTorch's own torch.func suite ({', '.join(TEST_FILES)}, torch "
                 f"{torch_version}), {percent(totals['passed'], totals['baseline'])} of the "
                 f"tests that pass on torch.func pass here ({totals['passed']} of "
                 f"{totals['baseline']}).")
    for test_file, row in rows.items():
        torch_code, our_code = row["codes"]
        notes = []
        if torch_code not in (0, 1, "reused"):
            notes.append(f"the torch.func run ended with {torch_code}")
        if our_code not in (0, 1):
            notes.append(f"the minifunctorch run ended with {our_code}")
        if row["extra"]:
            notes.append(f"{len(row['extra'])} tests pass here but not on torch.func")
        if notes:
            lines.append(f"- {test_file}: " + "; ".join(notes))

    failures = [(test_file, nodeid, record) for test_file, row in rows.items()
                for nodeid, record in row["here"].items() if record["outcome"] != "passed"]
    kinds = collections.Counter(record["outcome"] for _, _, record in failures)
    lines.append(f"- Outcome here of the {len(failures)} that do not pass: " + ", ".join(
        f"{kind} {count}" for kind, count in kinds.most_common()))
    lines += ["", "## By test class", "",
              "| file | class | pass on torch.func | pass here | fail here | % |",
              "|---|---|---:|---:|---:|---:|"]
    per_class = collections.defaultdict(collections.Counter)
    for test_file, row in rows.items():
        for nodeid, record in row["here"].items():
            counts = per_class[(test_file, test_class(nodeid))]
            counts["baseline"] += 1
            counts["passed"] += record["outcome"] == "passed"
    for (test_file, name), counts in sorted(
            per_class.items(), key=lambda item: (item[1]["passed"] - item[1]["baseline"], item[0])):
        lines.append(f"| {test_file} | {name} | {counts['baseline']} | {counts['passed']} | "
                     f"{counts['baseline'] - counts['passed']} | "
                     f"{percent(counts['passed'], counts['baseline'])} |")

    causes = collections.defaultdict(list)
    for test_file, nodeid, record in failures:
        reason = record["message"] if record["outcome"] == "failed" else \
            f"[{record['outcome']}] {record['message'] or ''}"
        causes[normalize(reason)].append(nodeid)
    shown = min(args.top, len(causes))
    lines += ["", f"## Failure causes ({len(failures)} tests; the first line of the exception, "
              f"normalized; the {shown} most frequent of {len(causes)})", "",
              "| tests | cause | example |", "|---:|---|---|"]
    for cause, nodeids in sorted(causes.items(), key=lambda item: (-len(item[1]), item[0]))[
            :args.top]:
        lines.append(f"| {len(nodeids)} | {escape(cause)} | {nodeids[0].split('::', 1)[-1]} |")

    refused = collections.defaultdict(set)
    for test_file, nodeid, record in failures:
        operation = refused_operation(record["message"])
        if operation:
            refused[operation].add(nodeid)
    lines += ["", f"## Refused by minifunctorch ({len(refused)} operations or APIs; tests whose "
              "first failure names them)", "", "| tests | operation |", "|---:|---|"]
    for operation, nodeids in sorted(refused.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"| {len(nodeids)} | {escape(operation)} |")
    return "\n".join(lines) + "\n"


def escape(text):
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv=None):
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="torchfunc_suite_"))
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    args.suite_dir = args.suite_dir.resolve()
    print(f"torchfunc_suite: outcomes and logs in {workdir}", file=sys.stderr)
    prepare_plugin(workdir)
    outcomes = run_all(args, workdir)
    for engine, files in outcomes.items():
        for test_file, (header, collected, tests, code) in files.items():
            if not header:
                where = args.baseline if engine == "torch.func" and args.baseline else \
                    workdir / engine
                sys.exit(f"torchfunc_suite: the {engine} run of {test_file} did not start "
                         f"(pytest exit {code}); see {where / (test_file + '.log')}")
    text = report(args, outcomes, compare(outcomes), workdir)
    if args.out:
        args.out.write_text(text)
        print(f"torchfunc_suite: report written to {args.out}", file=sys.stderr)
    else:
        print(text)


if __name__ == "__main__":
    main()
