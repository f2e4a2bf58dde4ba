"""``python -m benchmarks.ops [--out FILE] [--rounds N] [--min-run-time S] [--check] [NAME ...]``

Breadth of speed: common torch ops and layers, each under ``grad`` and ``vmap(grad)``, side
by side with torch.func. ``make bench`` times a few whole models; this finds the op whose
path is slow (a decomposition at the aten door, a formula that does more work than torch's
kernel), which a model that uses it inherits. The twenty-sixth session's sweep of this kind
found cdist at 9x torch.func's time, multi-head attention at 4x and interpolation spreading
an inf; each op here is one line: a function of one tensor and the shape of that tensor.

For every op and transform both libraries' results are compared first
(``torch.testing.assert_close``, float32 tolerances; the harness's NOTE [Check, then time,
interleaved]), then the two are timed interleaved on one thread. It writes
``benchmarks/OPS.md`` (or ``--out FILE``): the ratio minifunctorch / torch.func per op and
transform, slowest first. Nothing is judged: there is no goal per op (issue 16's goals are
``make bench``'s and ``make programs``'s); a ratio well above 1 is a lead. Run it as
``make bench`` runs the suite::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 .venv/bin/python -m benchmarks.ops

``--check`` only compares (nothing timed or written); ``NAME ...`` picks ops. The exit status
is 1 if an op's results differ between the two libraries, or minifunctorch fails where
torch.func runs.
"""
import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core as mft

from . import harness  # noqa: I001 - harness fails clearly if numpy is missing
from . import report
from .harness import MFT, TORCH_FUNC, Case

HERE = Path(__file__).resolve().parent
BATCH = 8  # examples under vmap(grad)
TRANSFORMS = ("grad", "vmap(grad)")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    fn: object  # one tensor -> tensor
    shape: tuple  # of one example


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ops() -> list:
    """The ops, with their constants made once (seeded): the function differentiates only
    its one argument."""
    torch.manual_seed(0)
    conv_w, conv1d_w = _randn(16, 8, 3, 3, seed=1), _randn(16, 8, 5, seed=2)
    grid = _randn(1, 32, 32, 2, seed=3).tanh()
    lstm = nn.LSTM(32, 64).requires_grad_(False)
    gru = nn.GRU(32, 64).requires_grad_(False)
    lstm_cell = nn.LSTMCell(32, 64).requires_grad_(False)

    def lstm_cell_loop(x):  # the steps of x (steps, batch, features) through nn.LSTMCell
        state = None
        outputs = []
        for step in x:
            state = lstm_cell(step, state)
            outputs.append(state[0])
        return torch.stack(outputs)
    attention = nn.MultiheadAttention(64, 4).requires_grad_(False).eval()
    encoder = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0).requires_grad_(False).eval()
    index = torch.arange(200) % 64
    return [
        Op("conv2d", lambda x: F.conv2d(x, conv_w, padding=1), (8, 32, 32)),
        Op("conv1d", lambda x: F.conv1d(x, conv1d_w, padding=2), (8, 256)),
        Op("max_pool2d", lambda x: F.max_pool2d(x, 2), (16, 64, 64)),
        Op("avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2), (16, 64, 64)),
        Op("batch_norm", lambda x: F.batch_norm(x[None], None, None, training=True)[0],
           (16, 32, 32)),
        Op("layer_norm", lambda x: F.layer_norm(x, (512,)), (64, 512)),
        Op("group_norm", lambda x: F.group_norm(x[None], 4)[0], (16, 32, 32)),
        Op("instance_norm", lambda x: F.instance_norm(x[None])[0], (16, 32, 32)),
        Op("softmax", lambda x: x.softmax(-1), (64, 1024)),
        Op("cross_entropy", lambda x: F.cross_entropy(x, torch.arange(64) % 1000), (64, 1000)),
        Op("smooth_l1_loss", lambda x: F.smooth_l1_loss(x, x.flip(0)), (64, 512)),
        Op("gelu", F.gelu, (256, 256)),
        Op("pad reflect", lambda x: F.pad(x, (3, 3, 3, 3), mode="reflect"), (16, 64, 64)),
        Op("pad circular", lambda x: F.pad(x[None], (3, 3, 3, 3), mode="circular")[0],
           (16, 64, 64)),
        Op("interpolate bilinear", lambda x: F.interpolate(x[None], scale_factor=2,
                                                           mode="bilinear")[0], (8, 32, 32)),
        Op("grid_sample", lambda x: F.grid_sample(x[None], grid, align_corners=False)[0],
           (8, 32, 32)),
        Op("unfold", lambda x: F.unfold(x[None], 3)[0], (8, 32, 32)),
        Op("scaled_dot_product_attention", lambda x: F.scaled_dot_product_attention(
            x[None], x[None], x[None])[0], (4, 128, 64)),
        Op("nn.MultiheadAttention", lambda x: attention(x, x, x, need_weights=False)[0],
           (20, 4, 64)),
        Op("nn.TransformerEncoderLayer", encoder, (20, 4, 64)),
        Op("nn.LSTM", lambda x: lstm(x)[0], (20, 4, 32)),
        Op("nn.GRU", lambda x: gru(x)[0], (20, 4, 32)),
        Op("nn.LSTMCell, a loop", lstm_cell_loop, (20, 4, 32)),
        Op("embedding", lambda x: F.embedding(torch.arange(256) % 1000, x), (1000, 64)),
        Op("index_select", lambda x: x.index_select(0, index), (64, 1024)),
        Op("cumsum", lambda x: x.cumsum(-1), (64, 1024)),
        Op("sort", lambda x: x.sort(-1)[0], (64, 1024)),
        Op("einsum", lambda x: torch.einsum("ij,kj->ik", x, x), (128, 256)),
        Op("cdist", lambda x: torch.cdist(x, x), (128, 32)),
        Op("tril", torch.tril, (256, 256)),
        Op("lerp", lambda x: torch.lerp(x, x.flip(0), 0.3), (256, 256)),
        Op("linalg.solve", lambda x: torch.linalg.solve(x + 64 * torch.eye(64), x), (64, 64)),
        Op("matrix_norm", torch.linalg.matrix_norm, (64, 64)),
    ]


def _transformed(api, op, transform):
    def loss(x):
        return op.fn(x).square().sum()
    return api.grad(loss) if transform == "grad" else api.vmap(api.grad(loss))


def _builder(api, op, transform, x):
    """The harness's builder: it makes the transformed function, and returns its call on x."""
    return lambda: functools.partial(_transformed(api, op, transform), x)


def cases() -> list:
    """(Op, transform, Case): both libraries on the same input."""
    made = []
    for number, op in enumerate(ops()):
        for transform in TRANSFORMS:
            shape = op.shape if transform == "grad" else (BATCH, *op.shape)
            x = _randn(*shape, seed=100 + number)
            builders = {MFT: _builder(mft, op, transform, x),
                        TORCH_FUNC: _builder(torch.func, op, transform, x)}
            made.append((op, transform, Case(
                op.name, transform, builders,
                notes={c: "the ops run on the two libraries only"
                       for c in harness.CONTENDERS if c not in (MFT, TORCH_FUNC)},
                rtol=1e-3, atol=1e-3)))
    return made


def _check_against_a_loop(op, case, error) -> dict:
    """Where torch.func fails (its vmap of nn.GRU: the harness raises for its baseline),
    minifunctorch is checked against a loop of torch.func's grads, one per example, and
    timed alone."""
    results = {c: harness.Result(case, c, "n/a", "the ops run on the two libraries only")
               for c in harness.CONTENDERS}
    results[TORCH_FUNC] = harness.Result(case, TORCH_FUNC, "error",
                                         " ".join(str(error).split())[:200])
    fn = case.builders[MFT]()
    x = fn.args[0]
    try:
        ours = fn()
        grad = torch.func.grad(lambda x: op.fn(x).square().sum())
        torch.testing.assert_close(ours, torch.stack([grad(example) for example in x]),
                                   rtol=case.rtol, atol=case.atol)
        results[MFT] = harness.Result(case, MFT, "ok", fn=fn)
    except AssertionError as mismatch:
        results[MFT] = harness.Result(case, MFT, "wrong", " ".join(str(mismatch).split())[:300])
    except Exception as failure:  # noqa: BLE001 - reported, and fails the run
        results[MFT] = harness.Result(case, MFT, "error", " ".join(str(failure).split())[:300])
    return results


def _check(item) -> dict:
    op, _, case = item
    try:
        return harness.check_case(case)
    except Exception as error:  # noqa: BLE001 - torch.func itself fails on this one
        return _check_against_a_loop(op, case, error)


def run(*, names=(), check_only=False, threads=1, min_run_time=harness.MIN_RUN_TIME,
        rounds=harness.ROUNDS, out=None, log=print) -> list:
    """Check every (op, transform), then (unless ``check_only``) time it and write the report
    to ``out``. Returns [((Op, transform, Case), {contender: Result})]."""
    return harness.check_then_time(
        [item for item in cases() if not names or item[0].name in names], check=_check,
        label=lambda item: f"{item[0].name}, {item[1]}", check_only=check_only,
        threads=threads, min_run_time=min_run_time, rounds=rounds, out=out, render=render,
        log=log)


def failures(checked) -> list:
    """minifunctorch results that differ, or fail where torch.func runs."""
    return [by_contender[MFT] for _, by_contender in checked
            if by_contender[MFT].failed and by_contender[TORCH_FUNC].ok]


def render(checked, env) -> str:
    rows = []
    for (op, transform, _), by_contender in checked:
        ours, theirs = by_contender[MFT], by_contender[TORCH_FUNC]
        value = report.ratio(by_contender, MFT)
        note = "" if ours.ok else f"minifunctorch {ours.status}: {ours.detail}"
        if not theirs.ok:
            note = f"torch.func {theirs.status}: {theirs.detail}"
        rows.append((value, [op.name, transform, f"({', '.join(map(str, op.shape))})",
                             harness.format_seconds(ours.median) if ours.times else "—",
                             harness.format_seconds(theirs.median) if theirs.times else "—",
                             report._ratio_text(value), note]))
    rows.sort(key=lambda row: (row[0] is None, -(row[0] or 0.0)))  # (unmeasured ones last)
    return "\n".join([
        "# Common ops under grad and vmap(grad): minifunctorch side by side with torch.func\n",
        "Written by `python -m benchmarks.ops`; do not edit by hand. Each op is a function of "
        f"one tensor (of the shape given; {BATCH} of them under vmap), differentiated through "
        "the sum of its output's squares. Both libraries' results are compared before "
        "anything is timed; the two are then timed interleaved, on one thread. Slowest "
        "first: a ratio well above 1 is a path worth a look (nothing here is a goal).\n",
        "## Machine and settings\n",
        report.settings_table(env),
        "\n## Times\n",
        report._table(["op", "transform", "example shape", "minifunctorch", "torch.func",
                       "ratio (minifunctorch / torch.func)", "notes"],
                      [row for _, row in rows]),
        ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="ops to run (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="compare the two libraries only: nothing timed or written")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--min-run-time", type=float, default=harness.MIN_RUN_TIME,
                        help=f"seconds per blocked_autorange (default {harness.MIN_RUN_TIME})")
    parser.add_argument("--rounds", type=int, default=harness.ROUNDS,
                        help=f"interleaved rounds per op (default {harness.ROUNDS})")
    parser.add_argument("--out", type=Path, default=HERE / "OPS.md",
                        help="where to write the table (default: benchmarks/OPS.md)")
    args = parser.parse_args(argv)
    known = {op.name for op in ops()}
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"unknown ops {unknown}; the ops are: {', '.join(sorted(known))}")
    checked = run(names=tuple(args.names), check_only=args.check, threads=args.threads,
                  min_run_time=args.min_run_time, rounds=args.rounds,
                  out=None if args.check else args.out)
    for result in failures(checked):
        print(f"FAILED: {result.case.label}: minifunctorch {result.status}: {result.detail}",
              file=sys.stderr)
    return 1 if failures(checked) else 0


if __name__ == "__main__":
    sys.exit(main())
