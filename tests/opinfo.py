"""The OpInfo coverage harness: every op of PyTorch's OpInfo database (``op_db``) under
minifunctorch's vjp, jvp and vmap, compared with torch.func's.

A library: ``tools/coverage.py`` runs the full sweep and writes docs/COVERAGE.md, and
``tests/test_opinfo.py`` runs a sample of it in the test suite. Everything is seeded from the
entry's name, so a sample, its cotangents, tangents and batches are the same in both.

NOTE [How one sample is checked]
A sample is ``op(input, *args, **kwargs)``; its tensors are found by flattening
``(input, args, kwargs)``, so tensors inside lists (``torch.cat``) and keyword arguments count.
- vjp: a function of the floating tensors (every other argument held fixed) whose output is
  the sample's floating outputs, after OpInfo's ``output_process_fn_grad`` (which drops the
  parts of an output that are not differentiable or not unique, such as eigenvector signs);
  integer and boolean outputs go to ``has_aux``. The cotangents are random normal. Compared:
  outputs, aux and the pulled-back cotangents.
- jvp: the same function, random normal tangents for the same arguments. Compared: outputs,
  tangents of the outputs and aux.
- vmap: a function of all the tensors, under several ``in_dims`` (VMAP_VARIANTS). A batch of
  3 stacks the sample and two copies whose floating tensors are scaled by factors a little
  below 1 (one factor per copy and argument, so the examples differ but stay in the op's
  domain: probabilities stay in (0, 1), positive definite matrices stay positive definite,
  sorted sequences stay sorted); integer and boolean tensors are copied unchanged.
torch.func runs the same function on the same tensors (the global RNG reseeded before each
run, for ops that draw random numbers), and is the oracle.

NOTE [Tolerances]
float32 results of two engines differ by rounding: a batched kernel sums in another order
than a loop, a decomposition in another order than a fused kernel, and a backward formula
may be written differently. The comparison is ``torch.testing.assert_close`` with
RTOL = 1e-4 and ATOL = 1e-4 (torch's float32 defaults, 1.3e-6 and 1e-5, are for one kernel
against itself), dtypes and shapes exact, nan equal to nan. Measured on the full sweep
(torch 2.13): with torch's float32 defaults only two (entry, transform) pairs differ (ldexp
under jvp, matmul under vjp, by 1.5e-5 and 2e-5 absolute), and every real bug found so far
is off by more than 0.1 or gives nan, so the margin is wide on both sides.
"""
import dataclasses
import re
import signal
import warnings
import zlib

import optree
import torch
import torch.func as tf

import minifunctorch.core as mf
from minifunctorch.core import dispatch
from minifunctorch.core.errors import TransformError

TRANSFORMS = ("vjp", "jvp", "vmap")
RTOL = 1e-4
ATOL = 1e-4
SAMPLE_CAP = 32          # samples per op in the full sweep (evenly spread over op_db's list)
BATCH = 3                # examples in a vmap batch: the sample and two scaled copies
CALL_TIME_LIMIT = 30.0   # seconds for one call of ours; longer is a hang, classified wrong

# The in_dims variants of NOTE [How one sample is checked]: a name and, for n tensor
# arguments, their in_dims (None where the variant does not apply).
VMAP_VARIANTS = {
    "all 0": lambda n: (0,) * n,
    "first -1, rest None": lambda n: (-1,) + (None,) * (n - 1),
    "first None, rest 0": lambda n: (None,) + (0,) * (n - 1) if n > 1 else None,
}

# Statuses of an (op, transform), worst first (NOTE [Statuses]).
SUPPORTED, FALLBACK, REFUSED, WRONG = "supported", "fallback", "refused", "wrong"
TF_REFUSES, NO_SAMPLES = "torch.func refuses", "no samples"
STATUSES = (WRONG, REFUSED, TF_REFUSES, NO_SAMPLES, FALLBACK, SUPPORTED)


# --- the entries and their samples ---------------------------------------------------------
def entry_key(op) -> str:
    """``name`` or ``name.variant``: one op_db entry."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def entries(dtype=torch.float32):
    """The op_db entries that support ``dtype`` on CPU, in op_db's order."""
    from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if dtype in op.supported_dtypes("cpu")]


def seed_of(*parts) -> int:
    """A stable seed from names and numbers (Python's hash() changes between runs)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def load_samples(op, dtype=torch.float32):
    """All of the op's CPU samples of ``dtype``, generated from a seed of its own name."""
    torch.manual_seed(seed_of(entry_key(op), "samples"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(op.sample_inputs("cpu", dtype, requires_grad=False))


def spread(n, cap):
    """Indices of ``cap`` samples spread evenly over ``n`` (all of them when n <= cap)."""
    if n <= cap:
        return list(range(n))
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


# --- one sample, flattened -------------------------------------------------------------------
def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def _is_float(x):
    """A tensor with derivatives: floating or complex (NOTE [Complex numbers] in
    core/dispatch.py: a complex output gets complex cotangents and tangents)."""
    return isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex)


_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _widen(x):
    """float32 -> float64 and complex64 -> complex128 (``.double()`` would drop the
    imaginary part); anything else unchanged."""
    return x.to(_WIDER[x.dtype]) if _is_tensor(x) and x.dtype in _WIDER else x


class Sample:
    """A SampleInput flattened: its leaves, which are tensors and which are floating."""

    def __init__(self, op, sample, index):
        self.op, self.sample, self.index = op, sample, index
        self.key = entry_key(op)
        self.leaves, self.spec = optree.tree_flatten(
            (sample.input, tuple(sample.args), dict(sample.kwargs)), none_is_leaf=True)
        self.tensors = [i for i, leaf in enumerate(self.leaves) if _is_tensor(leaf)]
        self.floats = [i for i, leaf in enumerate(self.leaves) if _is_float(leaf)]
        n_input = len(optree.tree_leaves(sample.input, none_is_leaf=True))
        self.input_floats = [i for i in self.floats if i < n_input]

    def call(self, replaced):
        """The op with the leaves at positions ``replaced`` (a dict) swapped in (the other
        tensors copied: an op may write into its arguments, and samples are reused)."""
        leaves = [replaced[i] if i in replaced else leaf.clone() if _is_tensor(leaf) else leaf
                  for i, leaf in enumerate(self.leaves)]
        inp, args, kwargs = optree.tree_unflatten(self.spec, leaves)
        return self.op(inp, *args, **kwargs)

    def fresh(self, positions):
        """Copies of the tensors at ``positions`` (an op may write into its arguments)."""
        return [self.leaves[i].clone() for i in positions]

    def describe(self):
        def show(x):
            if _is_tensor(x):
                return f"{str(x.dtype)[6:]}{list(x.shape)}"
            if isinstance(x, (list, tuple)):
                inner = ", ".join(show(i) for i in x)
                return f"[{inner}]" if isinstance(x, list) else f"({inner})"
            return repr(x)
        parts = [show(self.sample.input)] + [show(a) for a in self.sample.args]
        parts += [f"{k}={show(v)}" for k, v in self.sample.kwargs.items()]
        text = ", ".join(parts)
        return text if len(text) <= 120 else text[:117] + "..."


def _split_outputs(out):
    """(floating tensor outputs, other tensor outputs) of an op's output pytree."""
    leaves = optree.tree_leaves(out, none_is_leaf=True)
    floats = tuple(o for o in leaves if _is_float(o))
    others = tuple(o for o in leaves if _is_tensor(o) and not _is_float(o))
    return floats, others


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.complex64 if dtype.is_complex else torch.float32
    return torch.randn(tuple(shape), generator=g, dtype=base).to(dtype)


# --- the transforms, written once for both namespaces (ns: torch.func or minifunctorch) -----
def _differentiable_fn(s, wrt):
    """NOTE [Ops with nothing to differentiate]
    An op whose outputs are all integers or booleans (argmax, comparisons, searchsorted) has
    no derivative, but it must still run inside vjp and jvp on values of the transform and
    give torch.func's results: its outputs go to ``aux``, and a zero (the sum of the first
    argument times 0) stands in for the differentiable output that vjp and jvp require."""
    def f(*diff):
        out = s.call(dict(zip(wrt, diff)))
        floats, others = _split_outputs(s.sample.output_process_fn_grad(out))
        if not floats:
            floats = (diff[0].sum() * 0,)
        return floats, others
    return f


def _probe(s):
    """Why the sample cannot be run under vjp and jvp (no floating argument), or None."""
    if not s.floats:
        return "no floating tensor argument"
    return None


def cotangents(s, outputs):
    """The cotangents of a sample's floating outputs: random normal, seeded from the sample
    and the output's position (the same for both engines and for eager autograd)."""
    return tuple(_random(o.shape, o.dtype, seed_of(s.key, s.index, "ct", k))
                 for k, o in enumerate(outputs))


def run_vjp(ns, s, wrt):
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    out, vjp_fn, aux = ns.vjp(_differentiable_fn(s, wrt), *s.fresh(wrt), has_aux=True)
    return {"outputs": out, "aux": aux, "grads": vjp_fn(cotangents(s, out))}


def run_jvp(ns, s, wrt):
    primals = tuple(s.fresh(wrt))
    tangents = tuple(_random(p.shape, p.dtype, seed_of(s.key, s.index, "tangent", k))
                     for k, p in enumerate(primals))
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    out, out_dot, aux = ns.jvp(_differentiable_fn(s, wrt), primals, tangents, has_aux=True)
    return {"outputs": out, "tangents": out_dot, "aux": aux}


def _contract(jacobian, vector, dims):
    """``jacobian`` contracted with ``vector`` over the last (J @ v) or first (v @ J) dims."""
    return torch.tensordot(jacobian, vector, dims=dims)


def reference_jvp_by_jacrev(s, wrt):
    """NOTE [A second oracle for one mode]
    torch has no forward-mode formula for some ops (and no reverse one for a few), so
    torch.func refuses jvp (vjp) where it can still do the other. The Jacobian from the mode
    it can do gives the same answer: J @ t from torch.func.jacrev for a jvp, ct @ J from
    torch.func.jacfwd for a vjp. Same seeds as run_jvp and run_vjp."""
    primals = tuple(s.fresh(wrt))
    tangents = tuple(_random(p.shape, p.dtype, seed_of(s.key, s.index, "tangent", k))
                     for k, p in enumerate(primals))
    f = _differentiable_fn(s, wrt)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    out, aux = f(*primals)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    jacobian = tf.jacrev(lambda *p: f(*p)[0], argnums=tuple(range(len(primals))))(*primals)
    out_dot = tuple(sum(_contract(j_ki, t, t.dim()) for j_ki, t in zip(j_k, tangents))
                    for j_k in jacobian)
    return {"outputs": out, "tangents": out_dot, "aux": aux}


def reference_jvp_by_finite_differences(s, wrt):
    """NOTE [A third oracle for jvp]
    Where torch has no forward-mode formula and torch.func's jacrev cannot stand in either
    (jacrev refuses complex outputs: ``cholesky`` of a complex matrix), the outputs are the
    op's own and the tangents are float64 (complex128) central differences along the tangents
    run_jvp draws (finite_differences): the oracle the project holds every derivative to."""
    f = _differentiable_fn(s, wrt)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    with torch.no_grad():
        out, aux = f(*s.fresh(wrt))
    return {"outputs": out, "aux": aux,
            "tangents": finite_differences(s, "jvp", wrt)["tangents"]}


def reference_vjp_by_jacfwd(s, wrt):
    primals = tuple(s.fresh(wrt))
    f = _differentiable_fn(s, wrt)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    out, aux = f(*primals)
    cts = cotangents(s, out)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    jacobian = tf.jacfwd(lambda *p: f(*p)[0], argnums=tuple(range(len(primals))))(*primals)
    grads = tuple(sum(_contract(ct, jacobian[k][i], ct.dim()) for k, ct in enumerate(cts))
                  for i in range(len(primals)))
    return {"outputs": out, "aux": aux, "grads": grads}


FD_EPS = 1e-6
FD_MAX_ELEMENTS = 512


def _like_run(shape, dtype, seed):
    """The random cotangent or tangent that run_vjp / run_jvp drew for this seed (drawn in
    float32 or complex64, as they are), in the widened ``dtype``."""
    return _random(shape, torch.complex64 if dtype.is_complex else torch.float32, seed).to(dtype)


def _real_inner(a, b):
    """Re <a, b> = Re(sum(conj(a) * b)): the real inner product that makes a vjp the adjoint
    of its jvp, for real and complex tensors alike."""
    return (a.conj() * b).real.sum()


def finite_differences(s, transform, wrt):
    """NOTE [Finite differences of complex functions]
    Central differences in float64 (complex128), in the format of run_jvp / run_vjp
    (tangents or grads only): the last word when torch.func's two modes disagree with ours
    and with each other (NOTE [A second oracle for one mode]).
    A complex number is two real ones, so (f(z + eps t) - f(z - eps t)) / 2 eps is the jvp
    along a complex tangent t for any f, holomorphic or not. The vjp of a cotangent ct is
    that jvp's adjoint under Re <a, b>: element e of the gradient is Re <ct, J 1_e> + i Re
    <ct, J i_e> (the second term only for a complex argument), which is torch's convention
    (conjugate Wirtinger) and, for real tensors, the usual sum of ct * J e."""
    primals = [p.to(torch.complex128 if p.dtype.is_complex else torch.float64)
               for p in s.fresh(wrt)]
    f = _differentiable_fn(s, wrt)

    def outputs_at(ps):
        torch.manual_seed(seed_of(s.key, s.index, "call"))
        with torch.no_grad():
            out = f(*ps)[0]
        return [o.to(torch.complex128 if o.dtype.is_complex else torch.float64) for o in out]

    def directional(direction):
        plus = outputs_at([p + FD_EPS * d for p, d in zip(primals, direction)])
        minus = outputs_at([p - FD_EPS * d for p, d in zip(primals, direction)])
        return [(a - b) / (2 * FD_EPS) for a, b in zip(plus, minus)]

    if transform == "jvp":
        tangents = [_like_run(p.shape, p.dtype, seed_of(s.key, s.index, "tangent", k))
                    for k, p in enumerate(primals)]
        return {"tangents": directional(tangents)}
    if sum(p.numel() for p in primals) > FD_MAX_ELEMENTS:
        return None
    cts = [_like_run(o.shape, o.dtype, seed_of(s.key, s.index, "ct", k))
           for k, o in enumerate(outputs_at(primals))]

    def pulled_back(i, e, unit_value):
        unit = [torch.zeros_like(q) for q in primals]
        unit[i].view(-1)[e] = unit_value
        return sum(_real_inner(ct, d) for ct, d in zip(cts, directional(unit)))

    grads = []
    for i, p in enumerate(primals):
        g = torch.zeros_like(p).reshape(-1)
        for e in range(p.numel()):
            g[e] = pulled_back(i, e, 1.0)
            if p.dtype.is_complex:
                g[e] += 1j * pulled_back(i, e, 1j)
        grads.append(g.reshape(p.shape))
    return {"grads": grads}


def agrees_with_finite_differences(ours, reference):
    """Whether our tangents or grads match the finite differences (float64 vs float32)."""
    key = "tangents" if "tangents" in reference else "grads"
    try:
        for a, b in zip(ours[key], reference[key]):
            torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-3, atol=1e-3, equal_nan=True)
    except AssertionError:
        return False
    return True


def _agrees_in_float64(run, s, wrt, ours):
    """NOTE [Tolerances]: whether ours agrees with torch.func run on the sample in float64,
    so that a disagreement in float32 is torch.func's rounding (a fused kernel's cancellation
    of two large terms, such as layer norm's backward over one element)."""
    if not any(_is_tensor(leaf) and leaf.dtype in _WIDER for leaf in s.leaves):
        return False
    s64 = Sample.__new__(Sample)
    s64.__dict__.update(s.__dict__)
    s64.leaves = [_widen(leaf) for leaf in s.leaves]
    try:
        theirs = run(tf, s64, wrt)
    except Exception:  # noqa: BLE001 - no opinion
        return False
    widened = optree.tree_map(_widen, ours, none_is_leaf=True)
    return difference(widened, theirs) is None


def scale(k, j):
    """The factor of copy ``k`` (1, 2) for tensor argument ``j``: a little below 1."""
    return 1.0 - 0.04 * k - 0.01 * (j % 5)


def batched_inputs(s, in_dims):
    """The vmap inputs: for each tensor argument, the stacked batch moved to its in_dim, or
    the sample's own tensor where the in_dim is None."""
    inputs = []
    for j, (position, in_dim) in enumerate(zip(s.tensors, in_dims)):
        x = s.leaves[position]
        if in_dim is None:
            inputs.append(x.clone())
            continue
        copies = [x.clone()]
        for k in range(1, BATCH):
            copies.append(x * scale(k, j) if x.dtype.is_floating_point else x.clone())
        inputs.append(torch.movedim(torch.stack(copies), 0, in_dim))
    return inputs


def run_vmap(ns, s, in_dims, randomness="error"):
    def g(*tensors):
        return s.call(dict(zip(s.tensors, tensors)))
    inputs = batched_inputs(s, in_dims)
    torch.manual_seed(seed_of(s.key, s.index, "call"))
    return ns.vmap(g, in_dims=in_dims, randomness=randomness)(*inputs)


def run_vmap_different(ns, s, in_dims):
    """NOTE [Random ops under vmap]
    An op that draws random numbers is refused by vmap's default ``randomness='error'``, in
    torch.func as here; torch.func runs it under ``randomness='different'`` (one draw per
    example). So such a sample is compared under that flag, each engine from the same seed:
    torch.func's batched draws are the reference (the per-example loop draws other numbers)."""
    return run_vmap(ns, s, in_dims, randomness="different")


def loop_vmap(s, in_dims):
    """What vmap means: the op on each example, the results stacked (a second oracle, for
    when torch.func itself is off: NOTE [When torch.func is wrong])."""
    inputs = batched_inputs(s, in_dims)
    results = []
    for i in range(BATCH):
        # each example a tensor of its own (a view into the batch would have a storage
        # offset, which as_strided sees)
        example = [x.clone() if d is None else x.select(d, i).clone()
                   for x, d in zip(inputs, in_dims)]
        torch.manual_seed(seed_of(s.key, s.index, "call"))
        results.append(s.call(dict(zip(s.tensors, example))))
    leaves, spec = optree.tree_flatten(results[0], none_is_leaf=True)
    columns = zip(*(optree.tree_leaves(r, none_is_leaf=True) for r in results))
    stacked = [torch.stack(c) if _is_tensor(c[0]) else c[0] for c in columns]
    return optree.tree_unflatten(spec, stacked)


# --- comparing ---------------------------------------------------------------------------------
def _path(path):
    """Where a leaf is: ``grads[1]``, ``output[0]``, ``output``."""
    if path and isinstance(path[0], str):
        head, path = path[0], path[1:]
    else:
        head = "output"
    return head + "".join(f"[{p!r}]" for p in path)


def difference(ours, theirs, values=True, names=("ours", "torch.func")):
    """None when ours agrees with theirs, else a one-line description of the difference.
    ``values=False`` compares dtypes and shapes only (ops whose output is uninitialized
    memory, such as empty_like: OpInfo's ``has_nondeterministic_output``)."""
    ours_paths, ours_leaves, _ = optree.tree_flatten_with_path(ours, none_is_leaf=True)
    theirs_leaves = optree.tree_leaves(theirs, none_is_leaf=True)
    for path, leaf in zip(ours_paths, ours_leaves):
        if _is_tensor(leaf) and type(leaf) is not torch.Tensor:
            return f"{_path(path)}: {names[0]} returned a {type(leaf).__name__}, not a plain tensor"
    if len(ours_leaves) != len(theirs_leaves):
        return (f"the output structure differs: {len(ours_leaves)} leaves ({names[0]}) against "
                f"{len(theirs_leaves)} ({names[1]})")
    for path, a, b in zip(ours_paths, ours_leaves, theirs_leaves):
        where = _path(path)
        if _is_tensor(a) != _is_tensor(b):
            return f"{where}: {names[0]} {type(a).__name__}, {names[1]} {type(b).__name__}"
        if not _is_tensor(a):
            if a != b:
                return f"{where}: {names[0]} {a!r}, {names[1]} {b!r}"
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"{where}: {names[0]} {str(a.dtype)[6:]}{list(a.shape)}, {names[1]} "
                    f"{str(b.dtype)[6:]}{list(b.shape)}")
        if not values:
            continue
        try:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            return f"{where}: {_summary(str(e))}"
    return None


def _summary(message):
    """assert_close's message in one line: how many elements differ and by how much."""
    keep = [line.strip() for line in message.splitlines()
            if line.strip().startswith(("Mismatched elements", "Greatest absolute",
                                        "Greatest relative", "Expected ", "Absolute diff",
                                        "Relative diff"))]
    return "; ".join(keep) if keep else first_line(message)


def first_line(text, limit=200):
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def describe_error(e):
    return f"{type(e).__name__}: {first_line(e)}"


_OP_NAME = re.compile(r"\b((?:aten|prims)\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)")


def named_ops(message):
    """The aten/prims ops a message names (for counting the causes of refusals)."""
    return sorted(set(_OP_NAME.findall(message)))


# --- running one sample under one transform ------------------------------------------------------
class CallTimeout(Exception):
    """Our call ran past CALL_TIME_LIMIT (not a TransformError: a hang is a bug)."""


def _on_alarm(signum, frame):
    raise CallTimeout(f"no result after {CALL_TIME_LIMIT:.0f} s (a hang?)")


@dataclasses.dataclass
class Outcome:
    """One sample (and vmap variant) under one transform."""
    kind: str                  # "ok", "refused", "wrong", "tf refuses", "skip"
    sample: int
    variant: str = ""
    detail: str = ""           # the error or difference, one line
    fallbacks: tuple = ()      # aten ops that took vmap's per-example fallback
    their_fallbacks: tuple = ()  # aten ops that took torch.func's fallback (its warning)
    we_refuse_too: bool = False  # for "tf refuses": did ours raise as well?
    described: str = ""        # the sample's arguments, for messages

    def short(self):
        """The detail with the sample it happened on."""
        variant = f" ({self.variant})" if self.variant else ""
        return f"sample {self.sample}{variant}: {self.detail}"

    def where(self, key, transform):
        variant = f", {self.variant}" if self.variant else ""
        return f"{key} under {transform}, sample {self.sample}{variant} ({self.described})"


def _ours(run, *args):
    """Our result (or exception), the fallbacks it used, and whether it left the engine
    clean. A hang is cut by an alarm."""
    stack_depth = len(dispatch._per_thread.transform_stack)
    modes = torch._C._len_torch_function_stack()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, CALL_TIME_LIMIT)
    try:
        with mf.capture_fallbacks() as used:
            try:
                result, error = run(mf, *args), None
            except Exception as e:  # noqa: BLE001 - every error is classified
                result, error = None, e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    left = None
    if len(dispatch._per_thread.transform_stack) != stack_depth:
        del dispatch._per_thread.transform_stack[stack_depth:]
        left = "left a transform level on the stack"
    while torch._C._len_torch_function_stack() > modes:
        torch._C._pop_torch_function_stack()
        left = "left a TorchFunctionMode on the stack"
    return result, error, tuple(sorted(used)), left


def _second_opinion(outcome, s, in_dims, ours, theirs, values):
    """NOTE [When torch.func is wrong]
    torch.func has bugs of its own (an empty input whose output loses the batch dim). When
    ours and torch.func disagree under vmap, the per-example loop decides: if ours agrees with
    the loop and torch.func does not, the sample counts as agreeing, with a note."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop = loop_vmap(s, in_dims)
    except Exception:  # noqa: BLE001 - no second opinion
        return
    theirs_off = difference(theirs, loop, values, names=("torch.func", "loop"))
    if difference(ours, loop, values) is None and theirs_off is not None:
        outcome.kind = "ok"
        outcome.detail = f"torch.func is off, ours agrees with the per-example loop: {theirs_off}"


_THEIR_FALLBACK = re.compile(r"not yet implemented the batching rule for (aten::\w+)")


def _theirs(run, args, fallbacks=None):
    """torch.func's result (or exception); the aten ops its vmap ran through its own
    per-example fallback are added to ``fallbacks`` (torch.func warns about each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = run(tf, *args), None
        except Exception as e:  # noqa: BLE001 - torch.func's refusals are recorded
            result = None, e
    if fallbacks is not None:
        for warning in caught:
            fallbacks.update(_THEIR_FALLBACK.findall(str(warning.message)))
    return result


def check(s, transform, variant=None):
    """One sample under one transform (vmap: one in_dims variant), as an Outcome."""
    second_oracle = finite_oracle = False
    if transform == "vmap":
        in_dims = VMAP_VARIANTS[variant](len(s.tensors)) if s.tensors else None
        outcome = Outcome("skip", s.index, variant, described=s.describe())
        if in_dims is None:
            outcome.detail = "no tensor argument" if not s.tensors else "needs 2 tensors"
            return outcome
        args = (s, in_dims)
        run = run_vmap
        outcome.variant = f"in_dims {variant}"
    else:
        outcome = Outcome("skip", s.index, described=s.describe())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                why = _probe(s)
        except Exception as e:  # noqa: BLE001 - the op itself fails on its sample
            why = f"the op fails on its own: {describe_error(e)}"
        if why:
            outcome.detail = why
            return outcome
        args = (s, s.floats)
        run = run_vjp if transform == "vjp" else run_jvp
    their_fallbacks = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, their_error = _theirs(run, args, their_fallbacks)
        if transform == "vmap" and "randomness error mode" in str(their_error or ""):
            run = run_vmap_different
            theirs, their_error = _theirs(run, args, their_fallbacks)
            outcome.variant += ", randomness='different'"
        if their_error is not None and transform != "vmap":
            other = reference_jvp_by_jacrev if transform == "jvp" else reference_vjp_by_jacfwd
            try:
                theirs, their_error = other(s, args[1]), None
                outcome.variant = ("torch.func has no jvp here: J @ t from its jacrev"
                                   if transform == "jvp" else
                                   "torch.func has no vjp here: ct @ J from its jacfwd")
                second_oracle = True
            except Exception:  # noqa: BLE001 - no second oracle: try the third
                if transform == "jvp":
                    try:
                        refusal = their_error
                        theirs, their_error = reference_jvp_by_finite_differences(s, args[1]), None
                        outcome.variant = ("torch.func has no jvp here, nor a jacrev: float64 "
                                           "finite differences")
                        finite_oracle = True
                    except Exception:  # noqa: BLE001 - no oracle at all: torch.func refuses
                        pass
        if (their_error is not None and transform != "vmap" and s.input_floats
                and len(s.input_floats) < len(s.floats)):
            # NOTE [Arguments torch cannot differentiate]: a loss's target or a running
            # statistic has no derivative in PyTorch, and torch.func raises when asked for
            # one; then the sample is compared w.r.t. its input alone.
            retry = (s, s.input_floats)
            retried, retry_error = _theirs(run, retry)
            if retry_error is None:
                theirs, their_error, args = retried, None, retry
                outcome.variant = "w.r.t. the input only"
        ours, error, used, left = _ours(run, *args)
    outcome.fallbacks = used
    outcome.their_fallbacks = tuple(sorted(their_fallbacks))
    if their_error is not None:
        outcome.kind = "tf refuses"
        outcome.detail = describe_error(their_error)
        outcome.we_refuse_too = error is not None
    elif finite_oracle and error is not None:
        # torch.func refuses this jvp, and so do we: nothing to hold to finite differences
        outcome.kind, outcome.detail = "tf refuses", describe_error(refusal)
        outcome.we_refuse_too = True
    elif left is not None:
        outcome.kind, outcome.detail = "wrong", left
    elif isinstance(error, TransformError):
        outcome.kind, outcome.detail = "refused", describe_error(error)
    elif error is not None:
        outcome.kind, outcome.detail = "wrong", "crash: " + describe_error(error)
    elif finite_oracle:
        values = not getattr(s.op, "has_nondeterministic_output", False)
        diff = difference({k: v for k, v in ours.items() if k in ("outputs", "aux")},
                          {k: v for k, v in theirs.items() if k in ("outputs", "aux")}, values)
        if diff is not None:
            outcome.kind, outcome.detail = "wrong", diff
        elif agrees_with_finite_differences(ours, theirs):
            outcome.kind = "ok"
        else:
            # not proof of a bug: torch's formulas keep conventions that a difference along
            # any tangent does not (cholesky's assumes a Hermitian tangent; the op reads one
            # triangle): with torch.func silent, the sample stays uncompared
            outcome.kind = "tf refuses"
            outcome.detail = ("torch.func has no jvp here, and ours disagrees with float64 "
                              "finite differences along a general tangent")
            outcome.we_refuse_too = False
    else:
        values = not getattr(s.op, "has_nondeterministic_output", False)
        diff = difference(ours, theirs, values)
        if diff is None:
            outcome.kind = "ok"
        else:
            outcome.kind, outcome.detail = "wrong", diff
            if transform == "vmap":
                _second_opinion(outcome, s, args[1], ours, theirs, values)
            elif difference({k: v for k, v in ours.items() if k in ("outputs", "aux")},
                            {k: v for k, v in theirs.items() if k in ("outputs", "aux")},
                            values) is None:
                # the outputs agree and the derivatives do not: float64 finite differences
                # say which is right (torch declares some derivatives zero, such as that of
                # nll_loss's class weights under jvp, and has a few wrong ones)
                try:
                    reference = finite_differences(s, transform, args[1])
                except Exception:  # noqa: BLE001 - no third opinion
                    reference = None
                if reference is not None and agrees_with_finite_differences(ours, reference):
                    outcome.kind = "ok"
                    off = "torch.func's other mode" if second_oracle else "torch.func"
                    outcome.detail = (f"{off} is off, ours agrees with finite differences in "
                                      f"float64: {diff}")
                elif not second_oracle and _agrees_in_float64(run, s, args[1], ours):
                    outcome.kind = "ok"
                    outcome.detail = (f"torch.func's float32 rounding, ours agrees with "
                                      f"torch.func in float64: {diff}")
    return outcome


# --- one op under one transform ----------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """NOTE [Statuses]
    Of one (op, transform), from its samples' outcomes, the first that applies:
    wrong (some sample disagrees or crashes with a non-TransformError: a bug); refused (ours
    raised a TransformError on a sample torch.func runs); torch.func refuses (no sample could
    be compared because torch.func raises); no samples (none to run: no floating argument
    or output, or no sample at all); fallback (all compared samples agree, some through
    vmap's per-example fallback); supported."""
    key: str
    transform: str
    status: str
    reason: str = ""
    fallbacks: tuple = ()
    outcomes: list = dataclasses.field(default_factory=list)

    @property
    def refused_ops(self):
        return sorted({name for o in self.outcomes if o.kind == "refused"
                       for name in named_ops(o.detail)})


def classify(key, transform, outcomes, no_samples_reason="op_db gives no sample"):
    kinds = [o.kind for o in outcomes]
    fallbacks = tuple(sorted({f for o in outcomes if o.kind == "ok" for f in o.fallbacks}))
    compared = kinds.count("ok")

    def first(kind):
        return next(o for o in outcomes if o.kind == kind)

    def counted(kind):
        n = kinds.count(kind)
        return f" [{n} of {len(outcomes)} runs]" if len(outcomes) > 1 else ""
    if "wrong" in kinds:
        status, reason = WRONG, first("wrong").short() + counted("wrong")
    elif "refused" in kinds:
        status, reason = REFUSED, first("refused").short() + counted("refused")
    elif compared == 0 and "tf refuses" in kinds:
        o = first("tf refuses")
        refusing = [x for x in outcomes if x.kind == "tf refuses"]
        ours = ("we refuse too" if all(x.we_refuse_too for x in refusing) else
                "we run it" if not any(x.we_refuse_too for x in refusing) else
                "we refuse some")
        status, reason = TF_REFUSES, f"{o.detail} ({ours})"
    elif compared == 0:
        status = NO_SAMPLES
        reason = first("skip").detail if "skip" in kinds else no_samples_reason
    else:
        status = FALLBACK if fallbacks else SUPPORTED
        noted = [o for o in outcomes if o.kind == "ok" and o.detail]
        reason = noted[0].short() if noted else ""
    return Result(key, transform, status, reason, fallbacks, outcomes)


def check_op(op, transforms=TRANSFORMS, cap=SAMPLE_CAP, indices=None, variants=None,
             samples=None, dtype=torch.float32):
    """{transform: Result} for one op_db entry: the samples of ``dtype`` at ``indices``
    (default: ``cap`` of them, spread over the list), every vmap variant in ``variants``
    (default: all). ``samples``: the op's samples if already loaded (load_samples)."""
    key = entry_key(op)
    variants = list(VMAP_VARIANTS) if variants is None else variants
    if samples is None:
        try:
            samples = load_samples(op, dtype)
        except Exception as e:  # noqa: BLE001
            reason = f"sample_inputs fails: {describe_error(e)}"
            return {t: Result(key, t, NO_SAMPLES, reason) for t in transforms}
    chosen = spread(len(samples), cap) if indices is None else [
        i for i in indices if i < len(samples)]
    flat = [Sample(op, samples[i], i) for i in chosen]
    results = {}
    for t in transforms:
        outcomes = []
        for s in flat:
            if t == "vmap":
                outcomes += [check(s, t, v) for v in variants]
            else:
                outcomes.append(check(s, t))
        results[t] = classify(key, t, outcomes)
    return results


# --- docs/COVERAGE.md: its table, read back ----------------------------------------------------
def read_table(path):
    """{key: {transform: status}} from the table of a generated COVERAGE.md."""
    table = {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = lines.index("<!-- table -->")
    except ValueError:
        return table
    for line in lines[start + 3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, variant = cells[0].strip("`"), cells[1].strip("`")
        key = name + (f".{variant}" if variant else "")
        table[key] = {t: cells[2 + i].strip("*") for i, t in enumerate(TRANSFORMS)}
    return table
