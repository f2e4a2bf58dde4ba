"""RESULTS.md and results.png: the tables, the targets, the profiles and the plot."""
import dataclasses
import re
from pathlib import Path

from .harness import (
    BASELINE, COMPILE, COMPILE_HAND, CONTENDERS, DESCRIPTIONS, HAND, LOOP, MAKE_FX, MFT,
    MFT_INDUCTOR, MFT_JIT, format_seconds,
)

GROUP_TITLES = {
    "S1": "S1 overhead: an elementwise chain on a 10×10 tensor, per transform level",
    "S2": "S2 per-sample gradients: MLP 784-128-10, cross-entropy, vmap(grad)",
    "S3": "S3 Jacobians: f(x) = tanh(A sin x), jacrev and jacfwd",
    "S4": "S4 second order on R^32: hessian, hvp = jvp(grad), vmap(hessian)",
    "S5": "S5 ensembles: vmap over the stacked parameters of small MLPs (functional_call)",
    "S6": "S6 tracing: time to first result and cache-hit dispatch",
    "S7": "S7 per-sample gradients of a small CNN at MNIST shapes: vmap(grad) through "
          "functional_call",
    "S8": "S8 MAML: a meta-step with an outer backward",
    "S9": "S9 the empirical neural tangent kernel of a small CNN: vmap(jacrev) through "
          "functional_call, contracted over the parameters",
    "S10": "S10 an ensemble of small CNNs: vmap over stack_module_state (functional_call)",
}

# The groups with one table per case, in the report's order.
CASE_GROUPS = ("S2", "S3", "S4", "S5", "S7", "S8", "S9", "S10")

GROUP_INTROS = {
    "S7": "conv 1→8 3×3, relu, max_pool 2, conv 8→16 3×3, relu, max_pool 2, flatten, "
          "linear to 10, log_softmax, nll_loss (the quick sizes shrink the image, the "
          "channels and the batch), through `functional_call`, as "
          "`vmap(grad(loss), in_dims=(None, None, 0, 0))(params, buffers, x, y)`. The loop "
          "calls the model itself and `torch.autograd.grad` once per example. There is no "
          "hand-batched floor: per-sample gradients of a convolution's weight have no einsum "
          "closed form, and batching them by hand (unfold, expanded weights) would be a "
          "second implementation, not a floor.\n",
    "S8": "Sine-wave regression, an MLP 1-40-40-1, a meta-batch of 8 tasks with 10 "
          "support and 10 query points each (the quick sizes shrink them). Per task (`vmap` "
          "over the meta-batch): one inner `grad` step on the support set from the "
          "meta-parameters, then the query loss of the adapted parameters "
          "(`functional_call`); then "
          "`torch.autograd.grad` of the mean query loss w.r.t. the real (requires_grad) "
          "meta-parameters, through the transforms into torch's autograd. The case returns "
          "the meta-gradients. The loop: per task, `torch.autograd.grad(create_graph=True)` "
          "for the inner step. make_fx and compile trace the whole meta-step, the outer "
          "`torch.autograd.grad` included. The jit cannot trace `torch.autograd.grad` (it "
          "refuses it on its values), so its contenders compile the vmapped query losses "
          "and the outer backward runs through torch's autograd over the replayed program.\n",
    "S9": "The torch.func neural-tangent-kernels tutorial's Jacobian contraction on a small "
          "CNN: conv 3→8 3×3, relu, conv 8→8 3×3, relu, flatten, linear to 10, on 3×16×16 "
          "inputs, N = M = 8 (the quick sizes shrink them). Per example (`vmap`), the "
          "Jacobian of the outputs w.r.t. the parameters (`jacrev` through "
          "`functional_call`), for x1 and for x2; then, per parameter, "
          "`einsum('Naf,Mbf->NMab')` of the flattened Jacobians, summed over the parameters: "
          "the kernel is N×M×10×10. The loop calls the network itself once per example and "
          "`torch.autograd.grad` once per output, then contracts the same way. There is no "
          "hand-batched floor, for S7's reason: the Jacobian w.r.t. a convolution's weight "
          "has no einsum closed form.\n",
    "S10": "The torch.func model-ensembling tutorial with S7's CNN instead of an MLP: 10 "
           "models, `params, buffers = stack_module_state(models)` (when the contender is "
           "built, and detached: predictions only, as in S5), a base model on the meta "
           "device, and `vmap(fmodel, in_dims=(0, 0, None))` (every model on one shared "
           "minibatch of 64 MNIST-shaped images) or `in_dims=(0, 0, 0)` (each model on its "
           "own minibatch). The loop calls each model under `torch.no_grad`. The floor puts "
           "the ten models side by side in the channels: one convolution with every model's "
           "output channels for the shared minibatch's first layer, grouped convolutions "
           "(`groups` = 10) otherwise, max pooling channels-last as the engine pools (torch's "
           "CPU kernel for contiguous (N, C, H, W) is not vectorized; torch.func and the loop "
           "use it), the linear layer as an einsum.\n",
}


@dataclasses.dataclass(eq=False)
class Suite:
    """Everything one run produced, as the report reads it."""

    env: dict
    quick: bool
    groups: dict  # "S1" -> list of measurement groups, each a list of {contender: Result}
    s1_ops: int
    threads: int
    extra_threads: int | None = None
    extra: list = dataclasses.field(default_factory=list)  # S2 again, at extra_threads
    first_result: dict = dataclasses.field(default_factory=dict)  # case -> contender -> [s]
    first_result_reps: int = 0
    targets: list = dataclasses.field(default_factory=list)
    profiles: dict = dataclasses.field(default_factory=dict)  # "contender on case" -> Profile
    # "contender on case" -> (its KernelTime, torch.func's on the same case)
    kernel_times: dict = dataclasses.field(default_factory=dict)
    detailed: list = dataclasses.field(default_factory=list)  # the profiles shown in full
    hot_spots: list = dataclasses.field(default_factory=list)  # per engine contender

    def results(self, group):
        """Every {contender: Result} of a group, in order."""
        return [by_contender for measured in self.groups.get(group, ())
                for by_contender in measured]

    def failures(self):
        return [r for group in self.groups for by_contender in self.results(group)
                for r in by_contender.values() if r.failed]


# --- derived numbers -----------------------------------------------------------------------------
def ratio(by_contender, contender, baseline=BASELINE):
    """median(contender) / median(baseline) from the same run, or None."""
    a, b = by_contender[contender].median, by_contender[baseline].median
    return None if a is None or b is None or b == 0 else a / b


@dataclasses.dataclass
class S1Row:
    level: str
    contender: str
    per_op: float | None
    per_op_iqr: float | None
    entry: float | None
    entry_iqr: float | None
    status: str
    detail: str


def s1_rows(suite) -> dict:
    """level -> contender -> S1Row (per op = (T(n-op) - T(1-op)) / n)."""
    table = {}
    for one_op, chain in suite.groups.get("S1", ()):
        level = one_op[BASELINE].case.name.rsplit(" ", 1)[0]
        rows = {}
        for contender in CONTENDERS:
            a, b = one_op[contender], chain[contender]
            per_op = None if a.median is None or b.median is None \
                else (b.median - a.median) / suite.s1_ops
            iqr = None if b.iqr is None else b.iqr / suite.s1_ops
            bad = a if not a.ok else b
            rows[contender] = S1Row(level, contender, per_op, iqr, a.median, a.iqr, bad.status,
                                    bad.detail)
        table[level] = rows
    return table


def _s1_ratio(rows, contender, baseline=BASELINE):
    a, b = rows[contender].per_op, rows[baseline].per_op
    return None if a is None or b is None or b <= 0 else a / b


# --- targets -------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class TargetRow:
    target: str
    case: str
    contender: str  # who is judged (and profiled if missed)
    value: float | None
    goal: float
    sense: str  # "<=" or ">="
    unit: str = "×"
    note: str = ""
    profile_case: object = None  # the Case to profile if missed

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        met = self.value <= self.goal if self.sense == "<=" else self.value >= self.goal
        return "met" if met else "missed"

    @property
    def miss(self) -> float:
        """How far from the goal, as a fraction (> 0 when missed, <= 0 when met)."""
        if self.value is None:
            return 0.0
        if self.sense == "<=":
            return self.value / self.goal - 1
        return self.goal / self.value - 1 if self.value > 0 else float("inf")

    def margin(self) -> str:
        if self.value is None:
            return self.note or "not measured"
        if self.status == "met":
            return f"met, {abs(self.miss):.0%} headroom"
        return f"missed by {self.miss:.0%}"


T_EAGER = "T1 eager ≤ 1.0× torch.func (S2–S5, S7–S10)"
T_EAGER_S1 = "T2 eager ≤ 1.5× torch.func per op (S1)"
T_LOOP = "T3 per-sample speed-up over the loop ≥ torch.func's (S2)"
T_JIT_FAST = "T4 jit ≥ 2× faster than torch.func eager (S1 per op, S3, S4)"
T_JIT_MAKE_FX = "T5 jit ≤ 1.1× make_fx(torch.func) replay (S1 per op, S3, S4)"
T_DISPATCH = "T6 jit cache-hit dispatch ≤ 20 µs (1-op function)"
T_INDUCTOR = "T7 jit(inductor) ≤ 1.2× compile(make_fx(torch.func)) (S2)"
T_INDUCTOR_HAND = "T8 jit(inductor) ≤ 1.5× hand-batched floor (S2)"
TARGET_CONTENDER = {T_EAGER: MFT, T_EAGER_S1: MFT, T_LOOP: MFT, T_JIT_FAST: MFT_JIT,
                    T_JIT_MAKE_FX: MFT_JIT, T_DISPATCH: MFT_JIT, T_INDUCTOR: MFT_INDUCTOR,
                    T_INDUCTOR_HAND: MFT_INDUCTOR}


def _why_missing(*results):
    for r in results:
        if not r.ok:
            return f"{r.contender}: {r.status} ({r.detail})" if r.detail else r.status
    return "not timed"


def evaluate_targets(suite) -> list:
    rows = []

    def add(target, by_contender, contender, value, goal, sense="<=", *, against=BASELINE,
            case_label=None, profile_case=None, unit="×"):
        note = "" if value is not None else _why_missing(by_contender[contender],
                                                          by_contender[against])
        case = by_contender[contender].case
        rows.append(TargetRow(target, case_label or case.label, contender, value, goal, sense,
                              unit, note, profile_case or case))

    s1 = s1_rows(suite)
    s1_pairs = {one_op[BASELINE].case.name.rsplit(" ", 1)[0]: (one_op, chain)
                for one_op, chain in suite.groups.get("S1", ())}
    for target, contender, goal, against in ((T_EAGER_S1, MFT, 1.5, BASELINE),
                                             (T_JIT_FAST, MFT_JIT, 0.5, BASELINE),
                                             (T_JIT_MAKE_FX, MFT_JIT, 1.1, MAKE_FX)):
        for level, by_level in s1.items():
            if level == "none":
                continue  # no transform: both engines are plain torch calls
            one_op, chain = s1_pairs[level]
            value = _s1_ratio(by_level, contender, against)
            note_from = chain if chain[contender].ok else one_op
            add(target, note_from, contender, value, goal, against=against,
                case_label=f"S1 {level} (per op)", profile_case=chain[contender].case)
        if target == T_EAGER_S1:
            for group in ("S2", "S3", "S4", "S5", "S7", "S8", "S9", "S10"):
                for by_contender in suite.results(group):
                    add(T_EAGER, by_contender, MFT, ratio(by_contender, MFT), 1.0)
    for by_contender in suite.results("S2"):
        loop = by_contender[LOOP].median
        speedups = [None if loop is None or by_contender[c].median is None
                    else loop / by_contender[c].median for c in (MFT, BASELINE)]
        row_goal = speedups[1] or 0.0
        add(T_LOOP, by_contender, MFT, speedups[0] if speedups[1] is not None else None,
            row_goal, ">=", against=LOOP)
    for group in ("S3", "S4"):
        for by_contender in suite.results(group):
            add(T_JIT_FAST, by_contender, MFT_JIT, ratio(by_contender, MFT_JIT), 0.5)
            add(T_JIT_MAKE_FX, by_contender, MFT_JIT, ratio(by_contender, MFT_JIT, MAKE_FX),
                1.1, against=MAKE_FX)
    if "none" in s1_pairs:
        one_op = s1_pairs["none"][0]
        median = one_op[MFT_JIT].median
        add(T_DISPATCH, one_op, MFT_JIT, None if median is None else median * 1e6, 20.0,
            against=MFT_JIT, case_label=f"S6 dispatch ({one_op[MFT_JIT].case.label})",
            unit=" µs")
    for by_contender in suite.results("S2"):
        add(T_INDUCTOR, by_contender, MFT_INDUCTOR, ratio(by_contender, MFT_INDUCTOR, COMPILE),
            1.2, against=COMPILE)
        add(T_INDUCTOR_HAND, by_contender, MFT_INDUCTOR,
            ratio(by_contender, MFT_INDUCTOR, HAND), 1.5, against=HAND)
    order = list(TARGET_CONTENDER)
    return sorted(rows, key=lambda r: order.index(r.target))


def worst_misses(targets) -> list:
    """Per target, the missed row that is furthest from its goal (what gets profiled)."""
    worst = {}
    for row in targets:
        if row.status == "missed" and (row.target not in worst
                                       or row.miss > worst[row.target].miss):
            worst[row.target] = row
    return list(worst.values())


# --- markdown ------------------------------------------------------------------------------------
def _table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def settings_table(env: dict) -> str:
    """The machine and settings a report's times depend on (harness.environment)."""
    return _table(["", ""], [[k, f"`{v}`" if k.startswith("MALLOC") else v]
                             for k, v in env.items()])


def _ratio_text(value) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}×" if value < 10 else f"{value:.3g}×"


def _value_text(row: TargetRow) -> str:
    if row.value is None:
        return "—"
    if row.unit == " µs":
        return f"{row.value:.1f} µs"
    return _ratio_text(row.value)


def _goal_text(row: TargetRow) -> str:
    if row.target == T_LOOP:
        if row.value is None:
            return "≥ torch.func's"
        return f"≥ {_ratio_text(row.goal)} (torch.func's)"
    return f"{'≤' if row.sense == '<=' else '≥'} {row.goal:g}{row.unit}"


def _status_note(result) -> str:
    if result.ok:
        return ""
    return f"{result.status}: {result.detail}" if result.detail else result.status


def _not_run_line(by_contender) -> str:
    absent = [f"{c} ({r.detail or r.status})" for c, r in by_contender.items()
              if r.status == "n/a"]
    return f"\nNot run here: {'; '.join(absent)}.\n" if absent else ""


def case_table(by_contender, *, show_first_call=True) -> str:
    headers = ["contender", "median", "IQR", "ratio vs torch.func"]
    if show_first_call:
        headers.append("build + first call")
    headers.append("note")
    rows = []
    for contender, result in by_contender.items():
        if result.status == "n/a":
            continue
        row = [contender, format_seconds(result.median), format_seconds(result.iqr),
               _ratio_text(ratio(by_contender, contender))]
        if show_first_call:
            row.append(format_seconds(result.first_call_s))
        row.append(_status_note(result))
        rows.append(row)
    return _table(headers, rows) + "\n" + _not_run_line(by_contender)


def s1_section(suite) -> str:
    table = s1_rows(suite)
    n = suite.s1_ops
    out = [f"Per op = (T({n + 1}-op) − T(1-op)) / {n}, the IQR column is the {n + 1}-op "
           f"chain's IQR / {n}; entry = the time of the transformed 1-op function "
           "(`x.sum()`). vmap maps over the rows of the 10×10 tensor, vmap(vmap) over its "
           "elements, so every level computes on the same 100 numbers. At level `none` both "
           "engines are plain torch calls. Levels: the number of nested transforms.\n"]
    rows = []
    from .cases import S1_LEVELS
    for level, by_contender in table.items():
        depth = S1_LEVELS[level][0]
        for contender, row in by_contender.items():
            if row.status == "n/a" and row.per_op is None:
                continue
            per_level = None if row.per_op is None or depth == 0 else row.per_op / depth
            rows.append([level, depth, contender,
                         format_seconds(row.per_op), format_seconds(row.per_op_iqr),
                         format_seconds(per_level),
                         _ratio_text(_s1_ratio(by_contender, contender)),
                         format_seconds(row.entry), format_seconds(row.entry_iqr),
                         _ratio_text(None if row.entry is None or by_contender[BASELINE].entry
                                     is None else row.entry / by_contender[BASELINE].entry),
                         "" if row.status == "ok" else f"{row.status}: {row.detail}"])
    out.append(_table(["level", "levels", "contender", "per op", "IQR", "per op per level",
                       "ratio (per op)", "entry (1-op)", "IQR", "ratio (entry)", "note"], rows))
    if table:
        out.append(_not_run_line(next(iter(suite.groups["S1"]))[0]))
    jvp, grad = (table.get(level, {}).get(BASELINE) for level in ("jvp", "grad"))
    if jvp and grad and jvp.per_op and grad.per_op and jvp.per_op > 5 * grad.per_op:
        out.append(f"Note: torch.func's own jvp costs {format_seconds(jvp.per_op)} per op here, "
                   f"{jvp.per_op / grad.per_op:.0f}× its grad per op (its forward-mode AD is "
                   "slow on these small CPU tensors, worst for ops with a constant operand, "
                   "`x * 1.1`, `x + 0.1`): the jvp row says more about torch.func than about "
                   "minifunctorch.\n")
    return "\n".join(out)


def s6_section(suite) -> str:
    out = [f"**Time to first result**: building the contender (tracing, compiling) plus its "
           f"first call, median of {suite.first_result_reps} fresh builds (the inductor "
           "contenders: their single build in S2, with the inductor's on-disk caches as they "
           "were). The steady-state column is the same computation's median once warm.\n"]
    steady = {}
    for by_contender in suite.results("S2")[:1]:
        steady["per-sample"] = by_contender
    for one_op, chain in suite.groups.get("S1", ()):
        if one_op[BASELINE].case.name.startswith("vmap(grad)"):
            steady["vmap(grad)"] = chain
    rows = []
    for label, by_contender in suite.first_result.items():
        warm = next((v for k, v in steady.items() if k in label), {})
        for contender in CONTENDERS:
            times = by_contender.get(contender)
            if not times:
                continue
            median = sorted(times)[len(times) // 2]
            warm_result = warm.get(contender)
            rows.append([label.replace("first result: ", ""), contender,
                         format_seconds(median), len(times),
                         format_seconds(warm_result.median if warm_result else None)])
    out.append(_table(["case", "contender", "time to first result", "samples",
                       "steady state per call"], rows))
    out.append("\n**Cache-hit dispatch**: the per-call time of the 1-op function `x.sum()` "
               "on a 10×10 tensor, once warm (from S1). At level `none`, torch.func and "
               "minifunctorch eager are the plain torch call; the overhead column subtracts "
               "it.\n")
    rows = []
    one_ops = {one_op[BASELINE].case.name.rsplit(" ", 1)[0]: one_op
               for one_op, _ in suite.groups.get("S1", ())}
    plain = one_ops["none"][BASELINE].median if "none" in one_ops else None
    for level in ("none", "grad"):
        one_op = one_ops.get(level)
        if one_op is None:
            continue
        for contender in (BASELINE, MAKE_FX, MFT_JIT):
            result = one_op[contender]
            overhead = None if result.median is None or plain is None \
                else result.median - plain
            rows.append([level, contender, format_seconds(result.median),
                         format_seconds(result.iqr), format_seconds(overhead),
                         _status_note(result)])
    out.append(_table(["level", "contender", "per call", "IQR", "above the plain call",
                       "note"], rows))
    return "\n".join(out)


def targets_section(suite) -> str:
    counts = {s: sum(1 for r in suite.targets if r.status == s) for s in ("met", "missed", "n/a")}
    out = [f"{counts['met']} met, {counts['missed']} missed, {counts['n/a']} not measurable "
           "(a contender not available, failed, or not timed). Ratios are medians from this "
           "run; a target row names the contender it judges.\n"]
    rows = [[row.target, row.case, row.contender, _value_text(row), _goal_text(row),
             f"**{row.status}**" if row.status == "missed" else row.status, row.margin()]
            for row in suite.targets]
    out.append(_table(["target", "case", "contender", "value", "goal", "status",
                       "by how much"], rows))
    compiled_floor = [f"{value:.2f}× ({by_contender[HAND].case.name})"
                      for by_contender in suite.results("S2")
                      if (value := ratio(by_contender, COMPILE_HAND, HAND)) is not None]
    if compiled_floor:
        out.append(f"\nT8 in context: torch.compile of the hand-batched floor itself "
                   f"(`{COMPILE_HAND}`) takes {', '.join(compiled_floor)} the eager floor's "
                   "time in this run (S2's tables): a bound on what an inductor program reaches "
                   "on this machine.")
    return "\n".join(out)


def _profile_table(rows, calls) -> str:
    return _table(["function", "calls per benchmark call", "own time", "cumulative time"],
                  [[f"`{name}`", f"{n / calls:.3g}", format_seconds(own / calls),
                    format_seconds(cum / calls)] for name, n, own, cum in rows])


def _share_line(profile) -> str:
    share = profile.share
    program = (f", jit-generated program {share['program']:.0%} (with the kernels of the "
               "tensor operators it runs inline)" if share.get("program") else "")
    return (f"Own time: engine `core/` Python {share['core']:.0%}{program}, C calls "
            f"{share['builtin']:.0%} (of which into torch {profile.torch_c_share:.0%}), torch "
            f"Python {share['torch']:.0%}, other Python (optree, functools, ...) "
            f"{share['other']:.0%}.")


def kernel_times_section(kernel_times: dict) -> str:
    """The torch.profiler table of the profiled cases (NOTE [Kernel time of a missed target]
    in harness.py): the engine's contender and torch.func on the same case."""
    on_gpu = any(k.launches is not None for pair in kernel_times.values() for k in pair)
    headers = ["profiled", "contender", "wall per call (profiled)", "aten ops called",
               "aten own CPU time", "rest: Python (and the profiler)"]
    if on_gpu:
        headers += ["CUDA kernel launches", "GPU kernel time", "syncs"]
    rows = []
    for key, pair in kernel_times.items():
        for who, k in zip((key.split(" on ", 1)[0], "torch.func"), pair):
            row = [key, who, format_seconds(k.wall_s), f"{k.aten_ops:.0f}",
                   format_seconds(k.aten_s), format_seconds(max(0.0, k.wall_s - k.aten_s))]
            if on_gpu:
                row += ["—", "—", "—"] if k.launches is None else [
                    f"{k.launches:.0f}", format_seconds(k.device_s), f"{k.syncs:g}"]
            rows.append(row)
    return ("\n### Below Python: torch.profiler\n\n"
            "The same cases under torch.profiler, per call, with torch.func on each beside the "
            "engine (NOTE [Kernel time of a missed target] in harness.py). *aten own CPU time* "
            "is the aten ops' own time: the kernels and their dispatch, and for torch.func its "
            "batching and autograd layers too, which run inside the aten ops; *rest* is the "
            "wall time outside them, Python. "
            + ("On the GPU, equal launches and kernel time with no sync mean the miss is the "
               "CPU's time between launches. " if on_gpu else "")
            + "The profiler adds a few microseconds to every op.\n\n"
            + _table(headers, rows))


def profiles_section(suite) -> str:
    if not suite.profiles:
        return "No target was missed by a minifunctorch contender that could be profiled.\n"
    out = ["cProfile of the minifunctorch contender on each case where it missed a target "
           "(at most a fixed number of cases). Times are per benchmark call and under the "
           "profiler, which inflates Python-heavy code: read them as shares. *Own time* is "
           "a function's own (tottime); C calls into torch are the kernels and torch's "
           "dispatcher, `core/` is the engine's Python.\n",
           "### Where the time goes, per profiled case\n"]
    rows = []
    for key, profile in suite.profiles.items():
        top = ", ".join(f"`{name}` {own / profile.total_s:.0%}"
                        for name, _, own, _ in profile.by_tottime[:3])
        core, program = profile.share["core"], profile.share["program"]
        rows.append([key, ", ".join(profile.targets),
                     format_seconds(profile.total_s / profile.calls), f"{core:.0%}",
                     f"{program:.0%}", f"{profile.torch_c_share:.0%}",
                     f"{1 - core - program - profile.torch_c_share:.0%}", top])
    out.append(_table(["profiled", "missed", "per call (profiled)", "core/ Python",
                       "jit program", "torch C calls", "rest", "top own time"], rows))
    if suite.kernel_times:
        out.append(kernel_times_section(suite.kernel_times))
    for spots in suite.hot_spots:
        out.append(f"\n### Hot spots: {spots.label}\n\n{_share_line(spots)} Shares are "
                   "averaged over the cases, so that each case weighs the same; cumulative "
                   "shares of recursive functions can exceed 100%.\n")
        out.append(_table(["function", "share of own time", "share of cumulative time"],
                          [[f"`{name}`", f"{own:.1%}", f"{cum:.1%}"]
                           for name, own, cum in spots.rows]))
    for key in suite.detailed:
        profile = suite.profiles[key]
        out.append(f"\n### {key} (the worst miss of {', '.join(profile.targets)})\n\n"
                   f"{profile.calls} calls, {format_seconds(profile.total_s / profile.calls)} "
                   f"per call under the profiler. {_share_line(profile)}\n")
        out.append("Top by own time (tottime):\n\n" + _profile_table(profile.by_tottime,
                                                                       profile.calls))
        out.append("\nTop by cumulative time:\n\n" + _profile_table(profile.by_cumtime,
                                                                     profile.calls))
    return "\n".join(out) + "\n"


def render(suite) -> str:
    out = ["# Benchmarks: minifunctorch side by side with torch.func\n",
           "Written by `make bench` (`python -m benchmarks.run`); do not edit by hand. "
           + ("**Quick mode: correctness only, nothing was timed.**" if suite.quick else "")
           + "\n", "## Machine and settings\n",
           settings_table(suite.env),
           "\n## Method\n",
           "Every contender is built and called once, and its output compared with "
           "torch.func's (`torch.testing.assert_close`), before anything is timed; a wrong "
           "contender is never timed. Contenders of a case are then timed interleaved: each "
           "round runs one `blocked_autorange` per contender, rotating the order, and the "
           "per-block times of all rounds are pooled. Tables give the median and the "
           "interquartile range; ratios divide by torch.func's median from the same run "
           "(below 1 is faster than torch.func).\n",
           _table(["contender", "what it is"], [[c, DESCRIPTIONS[c]] for c in CONTENDERS]),
           "\n## Correctness\n"]
    failures = suite.failures()
    if failures:
        out.append("**Failed checks (these contenders were not timed):**\n")
        out += [f"- {r.case.label}, {r.contender}: {r.status}: {r.detail}" for r in failures]
    else:
        out.append("Every contender that exists matched torch.func on every case.")
    out.append("\n## Targets\n")
    out.append(targets_section(suite))
    if "S1" in suite.groups:
        out.append(f"\n## {GROUP_TITLES['S1']}\n")
        out.append(s1_section(suite))
    for group in CASE_GROUPS:
        if group not in suite.groups:
            continue  # a run of some groups only (``--groups``)
        out.append(f"\n## {GROUP_TITLES[group]}\n")
        if group in GROUP_INTROS:
            out.append(GROUP_INTROS[group])
        for by_contender in suite.results(group):
            case = next(iter(by_contender.values())).case
            out.append(f"### {case.label}\n")
            out.append(case_table(by_contender))
        if group == "S2" and suite.extra:
            out.append(f"### S2 again with {suite.extra_threads} threads\n")
            out.append(f"The same cases, timed with `torch.set_num_threads("
                       f"{suite.extra_threads})`; ratios against torch.func at "
                       f"{suite.extra_threads} threads.\n")
            for by_contender in suite.extra:
                case = next(iter(by_contender.values())).case
                out.append(f"#### {case.label}, {suite.extra_threads} threads\n")
                out.append(case_table(by_contender, show_first_call=False))
    if suite.first_result or "S1" in suite.groups:
        out.append(f"\n## {GROUP_TITLES['S6']}\n")
        out.append(s6_section(suite))
    if suite.env.get("device") == "cpu" and not suite.quick:
        out.append("\n## On a GPU\n")
        out.append(gpu_section())
    out.append("\n## Profiles of missed targets\n")
    out.append(profiles_section(suite))
    out.append("\n![ratio vs torch.func per case and contender](results.png)\n")
    return "\n".join(out)


# --- the GPU run -------------------------------------------------------------------------------
# where ``python -m benchmarks.run --device cuda --no-inductor --out benchmarks/gpu`` writes, on a
# machine with a GPU (none is at hand in CI or on this repository's own machine)
GPU_RESULTS = Path(__file__).resolve().parent / "gpu" / "RESULTS.md"
_GPU_ROWS = ("GPU", "torch", "minifunctorch commit", "date (UTC)", "TF32 (cudnn, cuda matmul)",
             "torch.compile cache")


def gpu_section(path: Path = GPU_RESULTS) -> str:
    """The targets of the last run on a GPU, read from that run's own report (issue 16: a GPU
    section whenever a GPU is lent). Its machine and date differ from this run's: the two
    are compared only through their ratios to torch.func, each from its own run."""
    if not path.exists():
        return ("No run on a GPU is on record. On a machine with one: `python -m benchmarks.run "
                "--device cuda --no-inductor --out benchmarks/gpu`.\n")
    text = path.read_text()
    settings = dict(re.findall(r"^\| ([^|]+?) \| ([^|]*?) \|$", text, re.M))
    start = text.index("## Targets\n") + len("## Targets\n")
    end = text.find("\n## ", start)
    rows = [[k, settings[k]] for k in _GPU_ROWS if k in settings]
    return (f"From the last run on a GPU, [gpu/RESULTS.md](gpu/RESULTS.md) (its own machine, "
            f"date and commit; every table and profile is there):\n\n"
            + _table(["", ""], rows) + "\n" + text[start:end if end >= 0 else None].strip() + "\n")


# --- the plot ------------------------------------------------------------------------------------
PLOTTED = (MFT, MFT_JIT, MFT_INDUCTOR, MAKE_FX, COMPILE, LOOP, HAND, COMPILE_HAND)


def plot_data(suite) -> list:
    """[(group, [(case label, {contender: ratio})])] in a fixed order."""
    data = []
    s1 = s1_rows(suite)
    if s1:
        data.append(("S1 (per op)", [(level, {c: _s1_ratio(rows, c) for c in PLOTTED})
                                     for level, rows in s1.items() if level != "none"]))
    for group in CASE_GROUPS:
        cases = [(by_contender[BASELINE].case.name,
                  {c: ratio(by_contender, c) for c in PLOTTED})
                 for by_contender in suite.results(group)]
        if cases:
            data.append((group, cases))
    return data


def plot(suite, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(suite)
    colors = dict(zip(PLOTTED, plt.get_cmap("tab10").colors))
    widths = [max(len(cases), 2) for _, cases in data] or [1]
    figure, axes = plt.subplots(1, len(widths), figsize=(20, 6), sharey=True, squeeze=False,
                                gridspec_kw={"width_ratios": widths})
    bar = 0.8 / len(PLOTTED)
    values = [v for _, cases in data for _, ratios in cases for v in ratios.values() if v]
    for axis, (group, cases) in zip(axes[0], data):
        for slot, contender in enumerate(PLOTTED):
            xs = [i + (slot - (len(PLOTTED) - 1) / 2) * bar for i in range(len(cases))]
            ys = [ratios.get(contender) for _, ratios in cases]
            axis.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], bar,
                     color=colors[contender], label=contender)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_yscale("log")
        axis.set_title(group)
        axis.set_xticks(range(len(cases)))
        axis.set_xticklabels([name for name, _ in cases], rotation=35, ha="right", fontsize=8)
        axis.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("time / torch.func time (log; below 1 is faster)")
    if not values:
        axes[0][0].text(0.5, 0.5, "not timed (--quick)", transform=axes[0][0].transAxes,
                        ha="center")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in PLOTTED]
    figure.suptitle(f"minifunctorch vs torch.func: time / torch.func time, "
                    f"{suite.env.get('device')}, {suite.threads} thread(s)", y=0.99)
    figure.legend(handles, PLOTTED, loc="upper center", bbox_to_anchor=(0.5, 0.95),
                  ncol=len(PLOTTED), frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.89))
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)


def write(suite, out_dir: Path) -> tuple:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, image = out_dir / "RESULTS.md", out_dir / "results.png"
    markdown.write_text(render(suite))
    plot(suite, image)
    return markdown, image
