"""Generate notebooks/03_interpreters.ipynb (Chapter 3 · interpreters)."""
from nbcells import SOLUTION_HEADING, code, md, solution, write

cells = [
md("""
# Chapter 3 · Interpreters: primitives, `bind`, and a stack of levels

Chapters [1](01_dispatchers.ipynb) and [2](02_levels.ipynb) drove the levels by hand. This
chapter looks at the same machine from the inside, the way JAX's *Autodidax* tutorial presents JAX: a numerical function is a sequence of
**primitive** applications, and to *transform* a function is to *interpret* each application
differently. Evaluating computes numbers; forward-mode differentiation carries a tangent along
with every value; batching carries a batch of values. Several interpretations can run at once,
stacked, which is how transforms compose.

**Contents.** 1 · Primitives are data · 2 · Rule tables · 3 · `bind` · 4 · The stack of
levels · 5 · The JVP interpreter · 6 · `deriv`, four times · 7 · Python control flow under
`jvp` · 8 · The batching interpreter · 9 · `jacfwd` is `vmap` of `jvp` · 10 · Control flow
under `vmap` · Exercise

Every number is compared with `torch.func`.
"""),
code("""
%load_ext minifunctorch.magics
# (the extension also shortens the engine's errors to the call, your line and the fix)

import inspect
import textwrap

import torch
import torch.func

from minifunctorch.core import (PRIMITIVES, Batched, Forward, FuncTensor, Logger, Torch, Value,
                                bind, batching_rules, grad, jacfwd, jvp, jvp_rules, label, ops,
                                reset_names, vjp_rules, vmap)
from minifunctorch.core.dispatch import current_dispatcher
from minifunctorch.core.tensor import as_tensor
from minifunctorch.core.primitives import mul_p, sin_p, sum_p

torch.manual_seed(0)
torch.set_printoptions(precision=4)


def same(ours, reference, what):
    \"\"\"Raise if two results differ; otherwise say that they agree.\"\"\"
    torch.testing.assert_close(ours, reference)
    print(f"{what}: agree")


def show_source(function):
    print(textwrap.dedent(inspect.getsource(function)))
"""),

md("""
## 1 · Primitives are data

A **primitive** is an operation that the transforms treat as atomic: `sin`, `mul`, `sum`,
`matmul`, ... In minifunctorch a `Primitive` is a small object holding a name and the torch
function that computes it, and nothing else: it knows nothing about derivatives or batches.
The built-in ones are registered in `PRIMITIVES`: the course's own, in `core/primitives.py`,
and the families that give the engine its breadth (`core/elementwise.py`, `core/indexing.py`,
`core/structural.py`, `core/nn.py`, `core/linalg.py`). Every torch function that
minifunctorch supports is either one of these or written in terms of them.

A primitive can also tell the shape and dtype of its result without computing anything:
`shape_rule` runs the torch function on *meta* tensors, which have a shape but no data.
"""),
code("""
from minifunctorch.core import primitives as course_primitives

own = [p.name for name, p in vars(course_primitives).items() if name.endswith("_p")]
# rounded down, so that the printed count stays put as the families grow
print(f"over {len(PRIMITIVES) // 100 * 100} primitives;", len(own), "of them are the course's own:")
print(textwrap.fill(", ".join(own), 90))
print("and from the families, for example:", ", ".join(["tan", "index", "convolution", "sort"]))
print()
print("sin_p is", repr(sin_p), "| its impl is torch.sin:", sin_p.impl is torch.sin)
print("sin_p.impl(1.0) =", sin_p.impl(torch.tensor(1.0)))
print("shape rule of sum over dim 1 of a (3, 2) tensor:",
      sum_p.shape_rule(torch.zeros(3, 2), dim=(1,), keepdim=False))
"""),

md("""
## 2 · Each transform keeps its own rule table

What a primitive *means* under a transform lives in that transform's table, keyed by the
primitive: `jvp_rules` (forward mode, `core/forward.py`), `vjp_rules` (reverse mode,
`core/autograd.py`) and `batching_rules` (`core/batching.py`). Adding an operation means adding
a primitive and one rule per table; adding a transform means adding one table. Here are the
three rules of `sin`:
"""),
code("""
show_source(jvp_rules[sin_p])
show_source(vjp_rules[sin_p])
show_source(batching_rules[sin_p])   # shared by every elementwise primitive (prim = sin_p here)

# a non-differentiable primitive (a comparison, argmax) needs only a batching rule: the
# derivative levels treat every such primitive alike (its output has no derivative)
missing = [name for name, p in PRIMITIVES.items() if p not in batching_rules
           or (p.differentiable and not (p in jvp_rules and p in vjp_rules))]
print("built-in primitives without a full set of rules:", missing)
"""),
md("""
Notice what the rules are written in: `ops.sin`, `ops.mul`, `bind(prim, ...)`. A rule never
computes with torch directly and never names a level. It calls ordinary operations on the
values it is given, and those operations go through `bind` again. That one design choice is
what makes transforms stack, as the next sections show.

## 3 · `bind`: the single door

Every operation ends in a call `bind(primitive, *arrays, **params)`. The functions of
`minifunctorch.core.ops` (which `torch.sin`, `x.sum(...)` and the operators reach inside a
transform) are thin wrappers that tidy up their arguments and call `bind`. Tensors are
positional; everything static, such as the dims of a reduction, is a keyword, already
normalized (a tuple of non-negative dims), so that rules never re-parse user arguments.

And `bind` itself (second half of the cell) looks for the **highest level among the
arguments** and lets that level `apply` the primitive. An argument that belongs to no level (a
plain tensor or a Python number) is a constant for every level. With no level at all, `bind` is
simply the torch call: the bottom of the stack, ordinary evaluation. (`values.bind` is the
engine's own; the `bind` exported by `minifunctorch.core` also accepts the tensors user code
holds, and gives tensors back.)
"""),
code("""
from minifunctorch.core import values

show_source(ops.sum)

x = torch.arange(6.0).reshape(2, 3)
same(ops.sum(x, -1), bind(sum_p, x, dim=(1,), keepdim=False), "ops.sum(x, -1) vs bind(sum_p, ...)")
print()
show_source(values.bind)
"""),

md("""
## 4 · The stack of levels, and the values that belong to them

| Autodidax (JAX) | minifunctorch |
|---|---|
| an interpreter on the stack (`MainTrace` / `Trace`) | a level: a `Dispatcher` object with a `.level` number and an `.inner` level |
| the evaluation interpreter at the bottom | `Torch()`, level 0 (or no level at all: `bind` calls `impl`) |
| a boxed value (`Tracer`) | a `Value` of that level (`AutogradValue`, `BatchedValue`, ...), whose `payload` is a value one level down; user code sees it as a `FuncTensor`, a real `torch.Tensor` |
| finding the top interpreter among the arguments | the loop at the start of `bind` |
| raising a value into a level | `Dispatcher.adopt` (explicit API); transforms treat unknown values as constants |
| lowering a value out of a level | `Dispatcher.lower`, and the unwrapping of outputs when a transform returns |

To watch `bind` pick the top level, stack two `Logger`s and mix a value of level 1 with a value
of level 2 in one multiplication. Level 2 is the top, so it applies `mul`; its rule unwraps its
own argument and calls `mul` again on the payloads, which are now at most level 1, so level 1
applies it next and level 0 computes. Each logger prints once its inner call has returned, so
the innermost line comes first.
"""),
code("""
def show_levels(value):
    \"\"\"Print a value one level per line, from its own level down to the torch tensor.\"\"\"
    value = value.value if isinstance(value, FuncTensor) else value  # the value it shows
    while isinstance(value, Value):
        extra = ""
        if hasattr(value, "bdim"):
            extra = f", bdim={value.bdim}"
        if hasattr(value, "tangent"):
            extra = f", tangent={value.tangent!r}"
        print(f"level {value.dispatcher.level}  {type(value).__name__}{extra}")
        value = value.payload
    print(f"level 0  {value!r}")


reset_names()
level1 = Logger(Torch(), name="[level 1]")
level2 = Logger(level1, name="[level 2]")
a1 = level1.adopt(label(torch.tensor([1.0, 2.0]), "a"))     # a value of level 1
b2 = level2.adopt(label(torch.tensor([3.0, 4.0]), "b"))     # a value of level 2
c = bind(mul_p, a1, b2)
print()
show_levels(c)
"""),

md("""
## 5 · The JVP interpreter: `Forward`

Forward-mode differentiation computes, along with `f(x)`, the directional derivative
`J·t` for a tangent `t` (a Jacobian-vector product). Its interpreter, the `Forward` level,
makes every value a pair: the **primal** (the payload) and its **tangent**. A rule receives the
primals and the tangents of the arguments and returns the output and its tangent; for `sin`
that is `sin(x)` and `x_dot * cos(x)`.

Below, a `Logger` sits under the `Forward` level, so we can see what the rules do. The function
`f` is plain PyTorch code; it runs on the `ForwardValue` once `as_tensor` shows that value as
a `FuncTensor`, a real tensor whose `__torch_function__` hands each call to the level. Every
line the logger prints is an operation that a JVP rule issued one level down: the primal
computation interleaved with the tangent computation.

The function `jvp(f, primals, tangents)` (end of the cell) does the same without the explicit
objects: it pushes a `Forward` level onto the stack, wraps each primal with its tangent, runs
`f`, and unwraps the output into the pair `(f(x), J·t)`.
"""),
code("""
def f(x):
    return x * torch.cos(x) + torch.exp(-x)


reset_names()
below = Logger(Torch(), name="[Logger]")
d = Forward(below)
x = d.wrap_input(below.adopt(label(torch.tensor(0.5), "x")),        # the primal
                 below.adopt(label(torch.tensor(1.0), "x_dot")),    # its tangent
                 name="x")
z = f(as_tensor(x))
print()
show_levels(z)
print()

x, t = torch.tensor(0.5), torch.tensor(1.0)
ours = jvp(f, (x,), (t,))
print("ours:      ", ours)
reference = torch.func.jvp(f, (x,), (t,))
print("torch.func:", reference)
same(ours, reference, "jvp(f)")
"""),

md("""
## 6 · `deriv`, four times

For a function of one number, the derivative is the JVP with tangent 1. Since `deriv(f)` is
just another Python function, we can differentiate it again. Each `deriv` pushes one more
`Forward` level: four of them stack four levels, and the `sin` at the top is interpreted by
level 4, whose rule calls `cos` and `mul` for level 3, and so on down. The derivatives of `sin`
cycle through `cos`, `-sin`, `-cos`, `sin`.
"""),
code("""
def deriv(f):
    return lambda x: jvp(f, (x,), (torch.ones_like(x),))[1]


def deriv_reference(f):
    return lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1]


def sin_showing_the_stack(x):
    print("  the stack while sin runs:", current_dispatcher())
    return torch.sin(x)


x = torch.tensor(1.0)
print("4th derivative of sin at 1:")
fourth = deriv(deriv(deriv(deriv(sin_showing_the_stack))))(x)
print(" ", fourth)

ours, reference = torch.sin, torch.sin
for n, closed_form in enumerate([torch.cos(x), -torch.sin(x), -torch.cos(x), torch.sin(x)], 1):
    ours, reference = deriv(ours), deriv_reference(reference)
    value, expected = ours(x), reference(x)
    print(f"derivative {n}: ours {value.item():+.4f}, torch.func {expected.item():+.4f}, "
          f"closed form {closed_form.item():+.4f}")
    same(value, expected, f"derivative {n}")
"""),

md("""
## 7 · Python control flow works under `jvp` (and `grad`)

Because every `Forward` value carries its primal, an ordinary tensor, Python can look at it.
`x < 1` is a comparison primitive; comparisons have no derivative, so the Forward level runs it on the primals alone and hands back a plain boolean tensor. The `if` picks a branch,
and the transform only ever sees the operations of the branch taken. The same holds under
`grad`, whose values also carry their primal.
"""),
code("""
def g(x):
    # x squared up to 1, then the tangent line at 1: a smooth piecewise function
    if x < 1:                      # a plain boolean: the primal is concrete
        return x * x
    return 2 * x - 1


one = torch.tensor(1.0)
for value in (0.5, 3.0):
    x = torch.tensor(value)
    print(f"x = {value}: jvp {jvp(g, (x,), (one,))}, grad {grad(g)(x)!r}")
    same(jvp(g, (x,), (one,)), torch.func.jvp(g, (x,), (one,)), "  jvp(g)")
    same(grad(g)(x), torch.func.grad(g)(x), "  grad(g)")
"""),

md("""
## 8 · The batching interpreter: `Batched`

`vmap(f)` runs `f` on a batch of inputs as if on one example, without a Python loop. Its
interpreter, the `Batched` level, keeps each value as a payload with one extra dimension, the
**batch dimension**, whose position is the value's `bdim`; the level hides that dimension, so
code sees the shape of one example. A batching rule receives the payloads and their bdims
(`None` for a value that is not batched) and returns the result and its bdim, using one
batched torch call.

Here the batch dimension of `xb` is dim 1 of its payload. Summing over the example's dim 0
must therefore sum the payload's dim 0, and the batch dimension of the result moves to 0.
Multiplying by a plain tensor does not copy it once per example: a constant has bdim `None`,
and the rule lines the operands up (here by moving the batch dimension to the front, a view)
so that broadcasting does the rest.
"""),
code("""
reset_names()
d = Batched(Torch(), length=3)
xb = as_tensor(d.wrap_input(torch.arange(6.0).reshape(2, 3), 1, name="xb"))  # 3 examples of (2,)
print("one example has shape", tuple(xb.shape), "| payload shape", tuple(xb.payload.shape),
      "| bdim", xb.bdim)

s = torch.sum(xb, 0)                 # per example: the sum of its 2 entries
print("sum over dim 0 of each example:", s.payload, "| bdim", s.bdim)
same(s.payload, torch.arange(6.0).reshape(2, 3).sum(0), "sum under Batched")

scaled = xb * torch.tensor([10.0, 100.0])     # a constant (bdim None), broadcast per example
print("xb * [10, 100] has bdim", scaled.bdim, "and payload")
print(scaled.payload)
"""),
md("""
`vmap(f, in_dims, out_dims)` pushes a `Batched` level, wraps each input with its `in_dim` as the
bdim, runs `f`, and moves each output's batch dimension to its `out_dim`. The simplest example:
a function written for one number, applied to a vector of them.
"""),
code("""
def add_one(scalar):
    return scalar + 1


vector = torch.tensor([1.0, 2.0, 3.0])
print(vmap(add_one)(vector))
same(vmap(add_one)(vector), torch.func.vmap(add_one)(vector), "vmap(add_one)")

matrix = torch.arange(6.0).reshape(2, 3)
same(vmap(add_one, in_dims=1, out_dims=1)(matrix),
     torch.func.vmap(add_one, in_dims=1, out_dims=1)(matrix), "vmap(add_one) over columns")
"""),

md("""
## 9 · `jacfwd` is `vmap` of `jvp`

One JVP with the tangent `e_j` (the j-th basis vector) gives the j-th column of the Jacobian.
Pushing every basis vector through at once, with `vmap` over the rows of an identity matrix,
gives the whole Jacobian in one batched pass. That is all `jacfwd` is.
"""),
code("""
def my_jacfwd(f, x):
    column = lambda tangent: jvp(f, (x,), (tangent,))[1]      # J @ tangent
    return vmap(column, out_dims=1)(torch.eye(x.numel()))     # all columns, side by side


def h(x):
    return torch.sin(x) * x.sum()


x = torch.tensor([0.5, 1.0, 2.0])
print(my_jacfwd(h, x))
same(my_jacfwd(h, x), torch.func.jacfwd(h)(x), "my_jacfwd vs torch.func.jacfwd")
same(jacfwd(h)(x), torch.func.jacfwd(h)(x), "minifunctorch's jacfwd vs torch.func.jacfwd")
"""),
md("""
Two interpreters are now active at once. Look at the argument that `h` receives: it is a value
of the Forward level (level 2, on top), whose primal is the plain `x`, a constant for the batch,
and whose **tangent is a batched value** of level 1 holding all the basis vectors. The JVP
rules compute with that tangent, and each operation they issue on it is batched by level 1.
"""),
code("""
def h_peeking(x):
    show_levels(x)
    return h(x)


_ = my_jacfwd(h_peeking, torch.tensor([0.5, 1.0]))
"""),

md("""
## 10 · Python control flow does *not* work under `vmap`

Under `vmap`, `x < 1` holds one boolean per example, here `[True, False]`. A Python `if` needs a
single answer, and there is none, so minifunctorch stops with a `BatchedControlFlowError` that
says so and suggests the fix, rather than silently picking a branch for the whole batch.
(`torch.func.vmap` refuses too, with its own message.)

The next cell fails on purpose: under `vmap`, `x < 1` inside `g` is a batch of booleans, one per
example, and Python's `if` cannot follow two branches at once. The error names the call, the
line of `g` that asked, and the fix.
"""),
code("""
vmap(g)(torch.tensor([0.5, 3.0]))
""", tags=["raises-exception"]),
md("""
The fix computes both branches for every example and chooses element by element with
`torch.where`, which is a primitive with a batching rule:
"""),
code("""
def g_batchable(x):
    return torch.where(x < 1, x * x, 2 * x - 1)


xs = torch.tensor([0.5, 3.0])
print(vmap(g_batchable)(xs))
same(vmap(g_batchable)(xs), torch.func.vmap(g_batchable)(xs), "vmap(g_batchable)")
same(vmap(g_batchable)(xs), torch.stack([g(x) for x in xs]), "the same as g, one example at a time")
"""),

md("""
## Summary

- A **primitive** is a name and a torch function. Its meaning under each transform is a rule in
  that transform's table: `jvp_rules`, `vjp_rules`, `batching_rules`.
- **`bind`** sends every operation to the highest level among its arguments. Rules compute with
  `ops` on the payloads, which binds again one level down: this is how interpreters stack.
- The **Forward** level pairs each value with a tangent (`jvp`); the **Batched** level hides a
  batch dimension at `bdim` (`vmap`). `jacfwd` is `vmap` of `jvp`.
- Under `jvp` and `grad` the primal is concrete, so Python `if`s work; under `vmap` they cannot,
  and `torch.where` is the way out.

---

## Exercise · Forward-mode and batching rules for `cumsum`

`torch.cumsum(x, dim)` computes running totals along `dim`. The engine has its own cumsum
primitive (in `core/structural.py`); here we build one from scratch. The cell below creates
`cumsum_p`, with a static parameter `dim` (a non-negative int), and gives it a reverse-mode
rule. **Write the two missing rules:**

1. `cumsum_jvp(primals, tangents, *, dim)` returns `(out, out_dot)`. Hint: `cumsum` is
   *linear*, so the tangent of the output is the cumsum of the tangent.
2. `cumsum_batch(values, bdims, *, dim)` returns `(out, out_bdim)`. Hint: `dim` counts the
   dims of *one example*. In the payload, the batch dimension sits at `bdim`, so the example's
   dims at or after `bdim` are shifted right by one. Do not move the batch dimension; use it
   where it is.

Run the stub and the check first: the check fails and says which rule is wrong. The second check
batches along dim 1 of the input (`in_dims=1`), where a rule that always adds 1 to `dim` gets
the wrong answer.
"""),
code("""
from minifunctorch.core import Primitive

cumsum_p = Primitive("cumsum", lambda x, *, dim: torch.cumsum(x, dim))


def cumsum(x, dim):
    return bind(cumsum_p, x, dim=dim)


# Given: the reverse-mode rule. Each input collects the cotangents of every later output:
# the total, minus the running total, plus its own.
def cumsum_vjp(x, *, dim):
    def backward(ct):
        total = ops.sum(ct, dim, keepdim=True)
        return (ops.add(ops.sub(total, cumsum(ct, dim)), ct),)
    return cumsum(x, dim), backward


vjp_rules[cumsum_p] = cumsum_vjp


def cumsum_jvp(primals, tangents, *, dim):
    (x,), (x_dot,) = primals, tangents
    raise NotImplementedError("cumsum_jvp: return (out, out_dot)")


def cumsum_batch(values, bdims, *, dim):
    (x,), (bdim,) = values, bdims
    raise NotImplementedError("cumsum_batch: return (out, out_bdim)")


jvp_rules[cumsum_p] = cumsum_jvp
batching_rules[cumsum_p] = cumsum_batch
"""),
code("""
from minifunctorch.core.checks import check_against, check_primitive

torch.manual_seed(0)
display(check_primitive(cumsum_p, lambda x: torch.cumsum(x, 1), torch.randn(3, 4), dim=1))
display(check_against(vmap(lambda x: cumsum(x, 0), in_dims=1),
                      torch.func.vmap(lambda x: torch.cumsum(x, 0), in_dims=1),
                      torch.randn(4, 3), what="vmap of cumsum with in_dims=1",
                      hint="the batch dim is at bdim=1: an example's dim 0 is still dim 0"))
"""),
md(SOLUTION_HEADING),
solution("""
# Solution. The jvp rule: cumsum is linear, so the tangent goes through the same cumsum.
def cumsum_jvp(primals, tangents, *, dim):
    (x,), (x_dot,) = primals, tangents
    return cumsum(x, dim), cumsum(x_dot, dim)


# The batching rule: translate the example's dim into the payload's dim and leave the batch
# dimension where it is (cumsum along another dim does not move it).
def cumsum_batch(values, bdims, *, dim):
    (x,), (bdim,) = values, bdims
    payload_dim = dim if dim < bdim else dim + 1
    return cumsum(x, payload_dim), bdim


jvp_rules[cumsum_p] = cumsum_jvp
batching_rules[cumsum_p] = cumsum_batch
"""),
code("""
torch.manual_seed(0)
display(check_primitive(cumsum_p, lambda x: torch.cumsum(x, 1), torch.randn(3, 4), dim=1))
display(check_against(vmap(lambda x: cumsum(x, 0), in_dims=1),
                      torch.func.vmap(lambda x: torch.cumsum(x, 0), in_dims=1),
                      torch.randn(4, 3), what="vmap of cumsum with in_dims=1",
                      hint="the batch dim is at bdim=1: an example's dim 0 is still dim 0"))
# with both rules in place, the compositions come for free:
display(check_against(jacfwd(lambda x: cumsum(x, 0)), torch.func.jacfwd(lambda x: torch.cumsum(x, 0)),
                      torch.randn(4), what="jacfwd of cumsum (vmap of jvp)"))
"""),
]

write(cells, "03_interpreters.ipynb")
