"""The benchmarks must not rot: run the quick mode (every case and contender checked
against torch.func on small sizes, nothing timed), and exercise timing, profiling and the
report on a tiny case. No assertion here is about speed."""
import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import cases, harness, report, run  # noqa: E402

# torch.func.jvp loads TorchScript decompositions on first use, and torch warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def quick_suite():
    threads = torch.get_num_threads()
    results_md = os.path.join(_ROOT, "benchmarks", "RESULTS.md")
    before = os.path.getmtime(results_md) if os.path.exists(results_md) else None
    try:
        suite = run.run(quick=True, log=_quiet)
    finally:
        torch.set_num_threads(threads)
    after = os.path.getmtime(results_md) if os.path.exists(results_md) else None
    assert before == after, "--quick must not write benchmarks/RESULTS.md"
    return suite


def test_quick_mode_checks_every_case_against_torch_func(quick_suite):
    failures = [f"{r.case.label} / {r.contender}: {r.status}: {r.detail}"
                for r in quick_suite.failures()]
    assert not failures, "\n".join(failures)
    assert set(quick_suite.groups) == {"S1", "S2", "S3", "S4", "S5", "S7", "S8", "S9", "S10"}
    for group in quick_suite.groups:
        for by_contender in quick_suite.results(group):
            for contender in (harness.MFT, harness.TORCH_FUNC, harness.MAKE_FX):
                result = by_contender[contender]
                assert result.ok, f"{result.case.label} / {contender}: {result.detail}"
                assert not result.times, "quick mode times nothing"
    assert quick_suite.first_result, "S6 time to first result was not collected"


def test_quick_report_renders_to_a_directory(quick_suite, tmp_path):
    markdown, image = report.write(quick_suite, tmp_path)
    text = markdown.read_text()
    assert "Quick mode" in text and "## Targets" in text
    for group in ("S7", "S8", "S9", "S10"):
        assert f"## {report.GROUP_TITLES[group]}" in text
    assert image.stat().st_size > 0


def test_s7_to_s10_are_judged_by_t1(quick_suite):
    """With (made-up) times, the eager ratio of every case of S7-S10 is judged by T1 (issue
    16: T1 covers S2-S5 and S7-S10), and a partial run reports only its groups."""
    late = ("S7", "S8", "S9", "S10")
    groups = {g: [[{c: r.fresh() for c, r in by_c.items()} for by_c in measured]
                  for measured in quick_suite.groups[g]] for g in late}
    for measured in groups.values():
        for together in measured:
            for by_contender in together:
                by_contender[harness.TORCH_FUNC].times = [2.0]
                by_contender[harness.MFT].times = [1.0]
    suite = report.Suite(env={"device": "cpu"}, quick=False, groups=groups, s1_ops=1,
                         threads=1)
    suite.targets = report.evaluate_targets(suite)
    cases_per_group = {g: len(suite.results(g)) for g in late}
    assert cases_per_group["S10"] == 2, "S10: one shared minibatch, and one per model"
    for group in late:
        rows = [row for row in suite.targets if row.case.startswith(group + " ")]
        assert [(row.target, row.value, row.status) for row in rows] == \
            [(report.T_EAGER, 0.5, "met")] * cases_per_group[group], group
    assert "S7–S10" in report.T_EAGER
    text = report.render(suite)
    assert "## " + report.GROUP_TITLES["S1"] not in text, "a partial run shows its groups only"
    assert [group for group, _ in report.plot_data(suite)] == list(late)


def test_groups_option_runs_only_the_named_groups():
    threads = torch.get_num_threads()
    try:
        suite = run.run(quick=True, groups=["S8"], log=_quiet)
    finally:
        torch.set_num_threads(threads)
    assert set(suite.groups) == {"S8"} and not suite.first_result
    assert not suite.failures()
    (by_contender,) = suite.results("S8")
    # the jit cannot trace the outer torch.autograd.grad: it compiles the vmapped losses
    assert by_contender[harness.MFT_JIT].ok and by_contender[harness.LOOP].ok
    with pytest.raises(SystemExit, match="no group S11"):
        run.run(quick=True, groups=["S11"], log=_quiet)


def test_timing_profile_and_report_on_a_tiny_case(tmp_path):
    one_op, chain = cases.s1_cases(cases.QUICK, "cpu")[1]  # the grad level
    checked = [harness.check_case(one_op), harness.check_case(chain)]
    harness.measure([r for by_contender in checked for r in by_contender.values()],
                    threads=1, min_run_time=0.01, rounds=2, warmup=1, log=_quiet)
    for by_contender in checked:
        assert by_contender[harness.TORCH_FUNC].median > 0
        assert by_contender[harness.TORCH_FUNC].iqr is not None
    profile = harness.profile(checked[1][harness.MFT].fn, "tiny", seconds=0.02)
    assert profile.calls >= 3 and profile.by_tottime
    kernels = tuple(harness.kernel_time(checked[1][contender].fn, contender, device="cpu",
                                        calls=3) for contender in (harness.MFT, harness.TORCH_FUNC))
    for k in kernels:  # the chain's ops, each called from Python once per op of the chain
        assert k.aten_ops >= cases.QUICK.s1_ops and 0 < k.aten_s < k.wall_s
        assert k.launches is None and k.device_s is None and k.syncs is None  # the CPU
    key = f"{harness.MFT} on tiny"
    suite = report.Suite(env={"device": "cpu"}, quick=False, groups={"S1": [checked]},
                         s1_ops=cases.QUICK.s1_ops, threads=1, profiles={key: profile},
                         detailed=[key], hot_spots=[harness.hot_spots([profile], "tiny")],
                         kernel_times={key: kernels})
    suite.targets = report.evaluate_targets(suite)
    assert any(row.case == "S1 grad (per op)" for row in suite.targets)
    markdown, image = report.write(suite, tmp_path)
    text = markdown.read_text()
    assert "per op" in text and image.stat().st_size > 0
    assert "### Below Python: torch.profiler" in text and "CUDA kernel launches" not in text
    assert f"| {key} | torch.func | " in text


@pytest.mark.parametrize("seconds, shown", [
    (0.0009996, "1 ms"), (0.0009994, "999 µs"), (2.5, "2.5 s"), (0.9996, "1 s"),
    (1.5e-6, "1.5 µs"), (9.996e-7, "1 µs"), (4e-9, "4 ns"), (None, "—")])
def test_format_seconds_never_prints_a_thousand_of_a_unit(seconds, shown):
    assert harness.format_seconds(seconds) == shown


def test_kernel_time_counts_the_aten_ops_called_from_python():
    x = torch.randn(8)
    k = harness.kernel_time(lambda: torch.sin(x).exp() + 1, "three ops", device="cpu", calls=4)
    assert k.calls == 4 and k.aten_ops == 3  # sin, exp, add: none is inside another
    on_gpu = harness.KernelTime("gpu", 4, 30e-6, 10e-6, 3.0, launches=3.0, device_s=4e-6,
                                syncs=0.0)
    section = report.kernel_times_section({"minifunctorch on a case": (on_gpu, on_gpu)})
    assert "| CUDA kernel launches | GPU kernel time | syncs |" in section
    assert "| minifunctorch on a case | minifunctorch | 30 µs | 3 | 10 µs | 20 µs | 3 | " \
        in section


def test_jit_contenders_follow_the_engine(monkeypatch):
    """Without ``minifunctorch.core.jit`` the jit contenders are "not available"; with one
    (here an eager stand-in) they are built and checked like any other."""
    from minifunctorch import core

    case = cases.s2_cases(cases.QUICK, "cpu")[0]
    monkeypatch.delattr(core, "jit", raising=False)
    missing = harness.check_case(case)[harness.MFT_JIT]
    assert missing.status == "n/a" and "not available" in missing.detail
    assert not missing.failed

    monkeypatch.setattr(core, "jit", lambda f, backend=None: f, raising=False)
    assert harness.check_case(case)[harness.MFT_JIT].ok


def test_tutorial_programs_script_checks_and_reports(tmp_path):
    """benchmarks.programs (issue 16): the five tutorial programs of tests/test_tutorials.py
    run on both libraries and agree (--check times nothing); with (made-up) times the report
    gives each part's ratio and judges it against 1.0x."""
    from benchmarks import programs

    threads = torch.get_num_threads()
    checked = programs.run(check_only=True, out=tmp_path / "PROGRAMS.md", log=_quiet)
    assert torch.get_num_threads() == threads, "the script restores the thread count"
    assert not (tmp_path / "PROGRAMS.md").exists(), "--check writes nothing"
    assert not programs.failures(checked)
    assert {part.program.split(".")[0] for part, _ in checked} == {"1", "2", "3", "4", "5"}
    for part, by_contender in checked:
        for contender in (harness.MFT, harness.TORCH_FUNC):
            assert by_contender[contender].ok and not by_contender[contender].times, part
    fake = [(part, {c: r.fresh() for c, r in by_contender.items()})
            for part, by_contender in checked]
    for i, (_, by_contender) in enumerate(fake):
        by_contender[harness.TORCH_FUNC].times = [2.0]
        by_contender[harness.MFT].times = [1.0 if i else 3.0]  # the first part misses
    text = programs.render(fake, {"device": "cpu"})
    assert f"{len(fake) - 1} of {len(fake)} parts within torch.func's time" in text
    assert "| 1.50× | **missed** |" in text and "| 0.50× | met |" in text


def test_ops_script_checks_and_reports(tmp_path):
    """benchmarks.ops: each op agrees with torch.func under grad and vmap(grad) (or, where
    torch.func's vmap fails, with a loop of its grads); with (made-up) times the report
    puts the slowest first."""
    from benchmarks import ops

    checked = ops.run(check_only=True, out=tmp_path / "OPS.md", log=_quiet)
    assert not (tmp_path / "OPS.md").exists(), "--check writes nothing"
    assert not ops.failures(checked)
    assert {transform for (_, transform, _), _ in checked} == set(ops.TRANSFORMS)
    assert len(checked) == 2 * len(ops.ops())
    fake = [(item, {c: r.fresh() for c, r in by_contender.items()})
            for item, by_contender in checked[:3]]
    for i, (_, by_contender) in enumerate(fake):
        by_contender[harness.MFT].times = [float(i + 1)]
        by_contender[harness.TORCH_FUNC].times = [1.0]
    text = ops.render(fake, {"device": "cpu"})
    assert text.index("| 3.00× |") < text.index("| 2.00× |") < text.index("| 1.00× |")


def test_the_dispatch_floor_script_measures_every_row():
    """benchmarks.floor (NOTE [The floor of a tensor-subclass engine]): the minimal subclass
    computes what torch computes, and every row gets a time per op (nothing is judged)."""
    from benchmarks import floor

    x = torch.randn(3, 3)
    f = cases.chain(4)
    torch.testing.assert_close(f(floor.Wrapped.of(x)).inner, f(x))
    with floor.PassThrough():
        out = f(floor.Wrapped.of(x))
    assert type(out) is floor.Wrapped
    torch.testing.assert_close(out.inner, f(x))
    rows = floor.measure(ops=2, rounds=1)
    assert [name for name, _ in rows][:3] == [
        "plain torch call", "floor: subclass, unwrap-call-wrap",
        "floor: subclass + mode on the stack"]
    assert len(rows) == 7 and all(isinstance(t, float) for _, t in rows)


def test_a_full_run_compiles_into_a_fresh_inductor_cache(monkeypatch):
    """NOTE [A fresh inductor cache per run]: unless the caller chose a cache, the run gets a
    new empty directory (a stale cache could hold code built under other conditions), and the
    report says which; a directory the caller set is kept."""
    # setenv first, so that teardown restores the variable's first state even when it was
    # unset (delenv of an unset variable records nothing, and the run sets it)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "set by this test")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    described = harness.use_fresh_inductor_cache()
    directory = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.path.isdir(directory) and not os.listdir(directory)
    assert "fresh directory" in described
    assert harness.use_fresh_inductor_cache() == f"{directory} (TORCHINDUCTOR_CACHE_DIR, as set)"
    env = harness.environment(device="cpu", threads=1, min_run_time=0.1, rounds=1,
                              inductor_cache=described)
    assert env["torch.compile cache"] == described


def test_instruction_counts_are_read_from_callgrind_dumps(tmp_path):
    """benchmarks.instructions (NOTE [Counting instructions instead of time]) reads one dump
    per counted region and gives per op = (I(long) - I(short)) / (ops * calls). The run itself
    needs valgrind, which CI does not have; this checks the reading and the arithmetic."""
    from benchmarks import instructions

    def dump(n, label, summary):
        (tmp_path / f"callgrind.out.{n}").write_text(
            f"version: 1\ndesc: Trigger: Client Request: {label}\nevents: Ir\n"
            f"summary: {summary}\ntotals: {summary + 7}\n")
    dump(1, "start", 999)  # the first region, before any level: ignored
    dump(2, "minifunctorch|vmap|0", 1_000)
    dump(3, "minifunctorch|vmap|10", 41_000)
    dump(4, "torch.func|vmap|0", 1_000)
    dump(5, "torch.func|vmap|10", 21_000)
    (tmp_path / "callgrind.out").write_text("desc: Trigger: Program termination\nsummary: 5\n")
    counts = instructions.read_dumps(tmp_path)
    assert counts == {("minifunctorch", "vmap", 0): 1_000, ("minifunctorch", "vmap", 10): 41_000,
                      ("torch.func", "vmap", 0): 1_000, ("torch.func", "vmap", 10): 21_000}
    assert instructions.per_op(counts, ["vmap"], calls=2, ops=10) == [("vmap", 2000, 1000, 2.0)]


def test_instruction_counts_per_program_call(tmp_path):
    """Whole calls (``--programs``, ``--cases``) count one region per (engine, call), keyed
    ``call<i>``: per call = I / calls."""
    from benchmarks import instructions

    for n, (label, summary) in enumerate([("start", 5), ("minifunctorch|call0|1", 3_000),
                                          ("torch.func|call0|1", 2_000),
                                          ("minifunctorch|call1|1", 900),
                                          ("torch.func|call1|1", 1_200)]):
        (tmp_path / f"callgrind.out.{n}").write_text(
            f"desc: Trigger: Client Request: {label}\nsummary: {summary}\n")
    counts = instructions.read_dumps(tmp_path)
    assert instructions.per_call(counts, ["call0", "call1"], calls=3) == [
        ("call0", 1000, 2000 / 3, 1.5), ("call1", 300, 400, 0.75)]


def test_instruction_counts_of_whole_calls_name_what_they_count():
    """``--cases`` counts a call of each case of the groups named (both engines' builders);
    ``--programs`` one of each program part; options that cannot go together are refused
    before anything runs under valgrind."""
    from benchmarks import instructions

    calls = instructions.whole_calls(False, ["S7", "S9"], quick=True)
    assert [name for name, _ in calls] == ["S7 CNN 2-3 on 1×10×10, B=4",
                                           "S9 CNN 2-3 on 2×7×7, N=3, M=2"]
    for _, build in calls:
        ours, theirs = (build[engine]()() for engine in instructions.ENGINES)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    programs = instructions.whole_calls(True, [], quick=False)
    assert programs[0][0] == "1. per-sample gradients of a CNN: vmap(grad) through " \
        "functional_call, B=8"
    for argv, words in [(["--cases", "S1"], "no group S1"),
                        (["--cases", "S11"], "no group S11"),
                        (["--quick"], "only the cases have quick sizes"),
                        (["--programs", "--cases", "S7"], "give one of them per run")]:
        with pytest.raises(SystemExit, match=words):
            instructions.main(argv)


def test_the_gpu_section_quotes_the_gpu_runs_targets(tmp_path):
    missing = report.gpu_section(tmp_path / "none.md")
    assert "No run on a GPU is on record" in missing and "--device cuda" in missing
    gpu_md = tmp_path / "RESULTS.md"
    gpu_md.write_text("# Benchmarks\n\n## Machine and settings\n\n|  |  |\n|---|---|\n"
                      "| GPU | Some GPU |\n| torch | 9.9 |\n| threads | 1 |\n\n## Targets\n\n"
                      "2 met, 1 missed.\n\n| target | value |\n|---|---|\n| T1 | 0.5× |\n\n"
                      "## S1 overhead\n\nnot quoted\n")
    section = report.gpu_section(gpu_md)
    assert "| GPU | Some GPU |" in section and "| torch | 9.9 |" in section
    assert "2 met, 1 missed." in section and "| T1 | 0.5× |" in section
    assert "threads" not in section and "not quoted" not in section
    # the committed GPU run, if any, renders too
    if report.GPU_RESULTS.exists():
        assert " met, " in report.gpu_section()


def test_no_inductor_leaves_out_the_compile_contenders_and_says_so():
    sizes = run.dataclasses.replace(cases.FULL, inductor=False)
    case = cases.s2_cases(sizes, "cpu")[0]
    for contender in (harness.MFT_INDUCTOR, harness.COMPILE, harness.COMPILE_HAND):
        assert contender not in case.builders
        assert case.notes[contender] == cases.NO_INDUCTOR_NOTE


def test_inductor_compiles_the_floor_where_there_is_one():
    """compile(hand-batched) runs beside the inductor contenders wherever a case has a
    hand-batched floor (nothing is built here); a case without one says why."""
    (s2_64, *_), (s9, *_) = cases.s2_cases(cases.FULL, "cpu"), cases.s9_cases(cases.FULL, "cpu")
    assert {harness.MFT_INDUCTOR, harness.HAND, harness.COMPILE_HAND} <= set(s2_64.builders)
    assert harness.HAND not in s9.builders and harness.COMPILE_HAND not in s9.builders
    assert s9.notes[harness.HAND] == cases.S9_HAND_NOTE
    assert s9.notes[harness.COMPILE_HAND] == cases.NO_HAND_NOTE
    (s3,) = [c for c in cases.s3_cases(cases.FULL, "cpu") if c.name == "jacrev 32→64"]
    assert harness.HAND in s3.builders and s3.notes[harness.COMPILE_HAND] == cases.INDUCTOR_NOTE


def test_t8_is_shown_beside_inductors_own_program_for_the_floor(quick_suite):
    """With (made-up) times, the targets section says how far torch.compile of the floor
    itself is from the floor, per S2 case; without that contender it says nothing."""
    measured = [[{c: r.fresh() for c, r in by_c.items()} for by_c in together]
                for together in quick_suite.groups["S2"]]
    suite = report.Suite(env={"device": "cpu"}, quick=False, groups={"S2": measured},
                         s1_ops=1, threads=1)
    suite.targets = report.evaluate_targets(suite)
    assert "T8 in context" not in report.targets_section(suite)
    for by_contender in suite.results("S2"):
        for contender, seconds in ((harness.TORCH_FUNC, 4.0), (harness.MFT_INDUCTOR, 4.0),
                                   (harness.HAND, 2.0), (harness.COMPILE_HAND, 5.0)):
            by_contender[contender].times = [seconds]
    suite.targets = report.evaluate_targets(suite)
    text = report.targets_section(suite)
    names = [by_contender[harness.HAND].case.name for by_contender in suite.results("S2")]
    assert f"(`compile(hand-batched)`) takes 2.50× ({names[0]})" in text
    assert all(f"2.50× ({name})" in text for name in names)
