"""``python -m benchmarks.programs [--out FILE] [--rounds N] [--min-run-time S] [--check]``

The five tutorial-style programs of ``tests/test_tutorials.py`` (issue 16: "each run in at
most torch.func's time, measured side by side in one process by a benchmark script, not a
timed test"): per-sample gradients of a CNN, model ensembling, the empirical NTK of a CNN,
Jacobians and Hessians, and MAML with an outer backward. Each program is written once against
an ``api`` in the test module; this script imports it from there (nothing is copied), calls
it whole with ``minifunctorch.core`` and with ``torch.func`` on the tests' inputs, checks that
both give the same result, then times the two interleaved (NOTE [Check, then time,
interleaved] in ``harness``), on one thread. Programs of two parts (the two NTK methods, the
single and batched Jacobians) are timed part by part.

It writes ``benchmarks/PROGRAMS.md`` (or ``--out FILE``): per part, the median time of each
library, the ratio minifunctorch / torch.func, and whether it meets the goal (≤ 1.0×).
Run it as ``make bench`` runs the suite, with the glibc allocator settings that the report
records::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 .venv/bin/python -m benchmarks.programs

``--check`` only checks the programs against torch.func (nothing timed, nothing written).
The exit status is 1 if a program's results differ between the two libraries.
"""
import argparse
import dataclasses
import functools
import importlib
import sys
from pathlib import Path

import torch
import torch.func

import minifunctorch.core as mft

from . import harness  # noqa: I001 - harness fails clearly if numpy is missing
from . import report
from .harness import MFT, TORCH_FUNC, Case

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
GOAL = 1.0  # minifunctorch's time / torch.func's time, at most


def tutorials():
    """``tests/test_tutorials.py``, where the programs are written (against an ``api``)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))  # as tests/conftest.py does: tests/ is no package
    return importlib.import_module("test_tutorials")


@dataclasses.dataclass(frozen=True)
class Part:
    """One timed call: ``program(api, *args)`` of the test module, on the test's inputs."""

    program: str  # "3. empirical NTK of a CNN"
    part: str  # "Jacobian contraction, full kernel"
    test: str  # the test that checks the same call
    call: object  # api -> result
    tolerances: dict = dataclasses.field(default_factory=dict)


def parts() -> list:
    """The five programs' calls, with the inputs their tests use (same seeds, same shapes)."""
    t = tutorials()

    torch.manual_seed(0)  # test_per_sample_gradients_of_a_cnn
    cnn = t.SmallCNN().eval()
    data, targets = torch.randn(8, 1, 12, 12), torch.randint(10, (8,))

    torch.manual_seed(0)  # test_model_ensembling
    models = [t.MLP() for _ in range(5)]
    minibatches = torch.randn(5, 6, 4, 4)

    torch.manual_seed(0)  # test_empirical_ntk_of_a_cnn
    net = t.TinyCNN()
    x1, x2 = torch.randn(4, 3, 8, 8), torch.randn(3, 3, 8, 8)

    torch.manual_seed(0)  # test_jacobians_and_hessians_of_an_mlp
    weight, bias = torch.randn(16, 16), torch.randn(16)
    x, v = torch.randn(16), torch.randn(16)

    torch.manual_seed(0)  # test_batch_jacobians_and_hessians
    batch_weight, batch_bias, batch_x = torch.randn(5, 7), torch.randn(5), torch.randn(8, 7)

    def call(program, *args):
        return lambda api: program(api, *args)

    close = {"rtol": 1e-4, "atol": 1e-5}
    return [
        Part("1. per-sample gradients of a CNN", "vmap(grad) through functional_call, B=8",
             "test_per_sample_gradients_of_a_cnn",
             call(t.per_sample_gradients, cnn, data, targets), {"rtol": 1e-4, "atol": 1e-6}),
        Part("2. model ensembling", "stack_module_state, 5 MLPs, vmap with in_dims "
             "(0, 0, None) and (0, 0, 0)", "test_model_ensembling",
             call(t.ensemble, models, minibatches)),
        Part("3. empirical NTK of a CNN", "Jacobian contraction, full kernel",
             "test_empirical_ntk_of_a_cnn[full-jacobian_contraction]",
             call(t.ntk_by_jacobian_contraction, net, x1, x2, "full"), close),
        Part("3. empirical NTK of a CNN", "NTK-vector products, full kernel",
             "test_empirical_ntk_of_a_cnn[full-ntk_vector_products]",
             call(t.ntk_by_ntk_vector_products, net, x1, x2, "full"), close),
        Part("4. Jacobians and Hessians", "vjp, jacrev, jacfwd, hessian, hvp, vhp on R^16",
             "test_jacobians_and_hessians_of_an_mlp",
             call(t.jacobians_and_hessians, weight, bias, x, v), close),
        Part("4. Jacobians and Hessians", "batched: vmap(jacrev), vmap(hessian), B=8",
             "test_batch_jacobians_and_hessians",
             call(t.batch_jacobians_and_hessians, batch_weight, batch_bias, batch_x), close),
        # maml() seeds, builds its network and Adam, and takes 3 meta-steps of 4 tasks with an
        # outer .backward(): all of it is the timed program, for both libraries alike.
        Part("5. MAML with an outer backward", "3 meta-steps, 4 tasks, MLP 1-40-40-1",
             "test_maml_with_an_outer_backward", t.maml, {"rtol": 1e-5, "atol": 1e-6}),
    ]


def case_of(part: Part) -> Case:
    """The two contenders of a part, as a harness Case (checked, then timed, together)."""
    builders = {MFT: lambda: functools.partial(part.call, mft),
                TORCH_FUNC: lambda: functools.partial(part.call, torch.func)}
    return Case(part.program, part.part, builders,
                notes={c: "the programs run on the two libraries only"
                       for c in harness.CONTENDERS if c not in (MFT, TORCH_FUNC)},
                **part.tolerances)


def run(*, check_only=False, threads=1, min_run_time=harness.MIN_RUN_TIME,
        rounds=2 * harness.ROUNDS, out=None, log=print) -> list:
    """Check every part, then (unless ``check_only``) time it and write the report to
    ``out``. Returns [(Part, {contender: Result})]."""
    return harness.check_then_time(
        parts(), check=lambda part: harness.check_case(case_of(part)),
        label=lambda part: f"{part.program}, {part.part}", check_only=check_only,
        threads=threads, min_run_time=min_run_time, rounds=rounds, out=out, render=render,
        log=log)


def failures(checked) -> list:
    return [result for _, by_contender in checked for result in by_contender.values()
            if result.failed]


def render(checked, env) -> str:
    rows, counts = [], {"met": 0, "missed": 0, "n/a": 0}
    for part, by_contender in checked:
        ours, theirs = by_contender[MFT], by_contender[TORCH_FUNC]
        value = report.ratio(by_contender, MFT)
        status = "n/a" if value is None else "met" if value <= GOAL else "missed"
        counts[status] += 1
        note = "" if ours.ok else f"{ours.status}: {ours.detail}"
        rows.append([part.program, part.part,
                     f"{harness.format_seconds(ours.median)} "
                     f"(IQR {harness.format_seconds(ours.iqr)})",
                     f"{harness.format_seconds(theirs.median)} "
                     f"(IQR {harness.format_seconds(theirs.iqr)})",
                     report._ratio_text(value),
                     f"**{status}**" if status == "missed" else status,
                     f"`{part.test}`" + (f"; {note}" if note else "")])
    return "\n".join([
        "# Tutorial-style programs: minifunctorch side by side with torch.func\n",
        "Written by `python -m benchmarks.programs`; do not edit by hand. The five programs "
        "of `tests/test_tutorials.py`, each written once against an `api` and called whole, "
        "on the inputs of the test named in the last column, with `minifunctorch.core` and "
        "with `torch.func` (issue 16: each runs in at most torch.func's time). Both results "
        "are compared (`torch.testing.assert_close`) before anything is timed; the two are "
        "then timed interleaved, round by round, rotating the order (as `make bench` does), "
        "and the ratio is minifunctorch's median / torch.func's median from the same run.\n",
        "## Machine and settings\n",
        report.settings_table(env),
        "\n## Times\n",
        f"{counts['met']} of {len(checked)} parts within torch.func's time (goal: ratio ≤ "
        f"{GOAL:.1f}×), {counts['missed']} missed, {counts['n/a']} not measured.\n",
        report._table(["program", "part", "minifunctorch", "torch.func",
                       "ratio (minifunctorch / torch.func)", f"goal ≤ {GOAL:.1f}×",
                       "the test, notes"], rows),
        ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.programs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="check the programs against torch.func only: nothing timed or "
                             "written")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1)")
    parser.add_argument("--min-run-time", type=float, default=harness.MIN_RUN_TIME,
                        help=f"seconds per blocked_autorange (default {harness.MIN_RUN_TIME})")
    parser.add_argument("--rounds", type=int, default=2 * harness.ROUNDS,
                        help=f"interleaved rounds per part (default {2 * harness.ROUNDS})")
    parser.add_argument("--out", type=Path, default=HERE / "PROGRAMS.md",
                        help="where to write the table (default: benchmarks/PROGRAMS.md)")
    args = parser.parse_args(argv)
    checked = run(check_only=args.check, threads=args.threads,
                  min_run_time=args.min_run_time, rounds=args.rounds,
                  out=None if args.check else args.out)
    for result in failures(checked):
        print(f"FAILED: {result.case.label}, {result.contender}: {result.status}: "
              f"{result.detail}", file=sys.stderr)
    return 1 if failures(checked) else 0


if __name__ == "__main__":
    sys.exit(main())
