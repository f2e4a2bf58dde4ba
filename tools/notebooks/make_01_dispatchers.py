"""Generate notebooks/01_dispatchers.ipynb (Chapter 1 · dispatchers)."""
from nbcells import SOLUTION_HEADING, code, md, solution, write

cells = [
md("""
# Chapter 1 · Dispatchers: transforms as a stack of interpreters

With `torch.func` you write `grad(f)` or `vmap(f)` and get back a new function. What makes that
possible is a small idea: while `f` runs, every operation it performs is handed to an
**interpreter** that decides what the operation means. One interpreter simply computes; one
also writes the operation down so it can be differentiated later; one applies it to a whole
batch at once. minifunctorch calls these interpreters **dispatchers** (or **levels**) and lets
you stack them, each one doing its own job and passing the real work to the one below.

This chapter drives the dispatchers *by hand*, calling `d.mul(a, b)` on an explicit object, so
that nothing is hidden. [Chapter 2](02_levels.ipynb) then follows values from level to level,
and meets the tensor class that lets ordinary PyTorch code (`torch.sin(x)`, `x * y`) run under
`grad` and `vmap`.

**Contents.** 1 · Torch and Logger · 2 · Autograd records a tape · 3 · The tape is data ·
4 · Where backward ops go · 5 · Second derivatives with one shared tape · 6 · Second
derivatives with two levels · 7 · Per-sample gradients · Exercise

**Levels: numbers, outer and inner.** Levels are numbered up from `Torch`, which is level 0: a
level built on level *k* is level *k + 1*. A transform applied *outside* another one is built
first, so it gets the **lower** number: in `grad(grad(f))` the outer `grad` is level 1 and the
inner one level 2. The course calls them *outer* and *inner*, and the tape stepper labels its
panels that way, outer first.

Every number we compute is compared with `torch.func`.
"""),
code("""
import torch
import torch.nn.functional as F
import torch.func

from minifunctorch.core import Autograd, Batched, Logger, Torch, grad, label, reset_names, vmap

torch.manual_seed(0)
torch.set_printoptions(precision=4)


def same(ours, reference, what):
    \"\"\"Raise if two results differ; otherwise say that they agree.\"\"\"
    torch.testing.assert_close(ours, reference)
    print(f"{what}: agree")
"""),

md("""
## 1 · A dispatcher is an object that runs operations

A dispatcher has one method per operation: `d.add(a, b)`, `d.mul(a, b)`,
`d.sum(x, dim=..., name=...)`, and so on. The simplest one, `Torch()`, just calls PyTorch. It
sits at the bottom of every stack and is **level 0**.

`Logger(inner, name=...)` is a dispatcher stacked on another one (**level 1** here): it prints
each operation it receives, with a prefix, and hands it on to `inner`.

To make the printout readable, tensors carry names. `label(t, "a")` names a tensor `a`; every
result gets a fresh name `v0`, `v1`, ...; `reset_names()` restarts that counter, so this
notebook prints the same names on every run.
"""),
code("""
reset_names()
a = label(torch.tensor([1.0, 2.0, 3.0]), "a")
b = label(torch.tensor([10.0, 20.0, 30.0]), "b")

d = Logger(Torch(), name="[Torch]")
c = d.mul(a, b)
s = d.sum(d.add(c, a), dim=0)
s
"""),
md("""
Each printed line reads *result : shape = expression*. What we get back is a tensor, but not
a plain one: it shows a `LoggedValue`, a value that **belongs to level 1**, and whose
**payload** is the torch tensor underneath (a value of level 0). Every level wraps the values
of the level below in the same way; chapter 2 comes back to this.

## 2 · The Autograd dispatcher records a tape

`Autograd(inner)` runs each operation on the level below and also appends an **entry** to its
**tape**: which primitive ran, on which named inputs, and a *backward closure* that knows how to
turn the gradient of the output into gradients of the inputs. `d.grad(loss, inputs)` walks the
tape from the end to the beginning, calling those closures: that is reverse-mode autodiff.

Our running example is `toy(d, a, b) = a * b + b * b`, written once against *any* dispatcher
`d`, next to its plain PyTorch twin for the comparisons. `name="L"` names the result of an
operation.
"""),
code("""
torch.manual_seed(0)
reset_names()
a, b = label(torch.rand(4), "a"), label(torch.rand(4), "b")


def toy(d, a, b):
    return d.add(d.mul(a, b), d.mul(b, b))


def toy_torch(a, b):
    return (a * b + b * b).sum()


d = Autograd(Torch())
loss = d.sum(toy(d, a, b), name="L")
da, db = d.grad(loss, [a, b])
print("dL/da =", da)
print("dL/db =", db)

ref_da, ref_db = torch.func.grad(toy_torch, argnums=(0, 1))(a, b)
same(da, ref_da, "dL/da vs torch.func.grad")
same(db, ref_db, "dL/db vs torch.func.grad")
"""),

md("""
## 3 · The tape is data

`d.tape` is an ordinary Python object you can print, index and loop over. Each line is one
entry, written as *name : type = primitive inputs parameters*; `f32[4]` means a float32
tensor of shape `(4,)`.
"""),
code("""
print(d.tape)
print()
entry = d.tape.entries[1]                       # v1 = mul b b
print("primitive:", entry.prim, "| inputs:", entry.inputs, "| output:", entry.output)
print("what its backward closure saved:", list(entry.saved))
print("backward(ones) gives one cotangent per input:", entry.backward(torch.ones(4)))
"""),
md("""
The saved context of `mul` is its two inputs: the gradient of `x * y` with respect to `x` is
`y`, and the other way round (here both are `b`). With that, the whole backward pass is a short
loop, and we can write it ourselves. A value used several times receives the **sum** of its
contributions: `b` is used three times, once by the first `mul` and twice by the second.

`d.grad` runs the same loop and keeps a record of it: `d.tape.steps` lists the steps of its last backward pass (step 0 is the seed), and
`d.tape.gradient_map()` gives, for every name, its gradient and the entries that contributed.
"""),
code("""
def backward_by_hand(tape, loss_name):
    cotangents = {loss_name: torch.tensor(1.0)}          # dL/dL = 1, the seed
    for entry in reversed(tape.entries):
        ct = cotangents.get(entry.output)
        if ct is None:                                   # this entry does not lead to the loss
            continue
        for name, contribution in zip(entry.inputs, entry.backward(ct)):
            if name is None or contribution is None:     # a constant input, or a zero gradient
                continue
            cotangents[name] = cotangents[name] + contribution if name in cotangents else contribution
    return cotangents


by_hand = backward_by_hand(d.tape, "L")
same(by_hand["a"], da, "dL/da by hand vs d.grad")
same(by_hand["b"], db, "dL/db by hand vs d.grad")
print()
for step in d.tape.steps:
    print(step)
print()
for name, (gradient, sources) in d.tape.gradient_map().items():
    print(f"{name:>2}  {gradient!r}  from {sources}")
"""),

md("""
## 4 · Where the backward operations go

Put a `Logger` **under** the Autograd level and run the example again. The forward operations
pass through the logger on their way down. So do the backward operations: a backward closure
calls ordinary operations on the *payloads*, that is on the level below. The tape itself
records only the forward pass.
"""),
code("""
reset_names()
d = Autograd(Logger(Torch(), name="[Torch]"))
print("-- forward")
loss = d.sum(toy(d, a, b))
print("-- backward")
da_logged, db_logged = d.grad(loss, [a, b])
"""),
md("""
The backward pass starts from a tensor of ones (`full_like`), spreads it back over the summed
dimension (`expand`: the backward of `sum`), then applies the rules of the two `mul`s (the rule
of `add` passes the cotangent on unchanged, with no operation at all); the two `+` lines add up
the three contributions to `b`. These operations ran on level 0 and **nothing recorded them**,
so the gradients we got cannot be differentiated again. There are two ways to
get second derivatives: record the backward on the same tape (section 5) or stack a second
Autograd level (section 6).

## 5 · Second derivatives, way 1: one shared tape (`create_graph=True`)

This is what PyTorch's `loss.backward(create_graph=True)` does. With `create_graph=True` the
backward operations run on the Autograd level *itself*, so they are appended to its own tape.
One tape ends up holding the forward pass, the backward pass, and whatever we compute from the
gradients, and a second `grad` can walk back through all of it.

The experiment: take the gradients of `L0 = sum(a * b + b * b)`, build
`L1 = sum(dL0/da * dL0/db)` from them, and differentiate `L1`. The helper takes two dispatchers,
one for each loss, so that section 6 can run the same code on two levels.
"""),
code("""
def second_order(d_first, d_second):
    \"\"\"d_first differentiates L0; d_second differentiates a loss made of those gradients.\"\"\"
    L0 = d_first.sum(toy(d_first, a, b), name="L0")
    g_a, g_b = d_first.grad(L0, [a, b])
    L1 = d_second.sum(d_second.mul(g_a, g_b), name="L1")
    return d_second.grad(L1, [a, b])


def L1_reference(a, b):
    g_a, g_b = torch.func.grad(toy_torch, argnums=(0, 1))(a, b)
    return (g_a * g_b).sum()


ref_a, ref_b = torch.func.grad(L1_reference, argnums=(0, 1))(a, b)

reset_names()
shared = Autograd(Torch(), create_graph=True)
h_a, h_b = second_order(shared, shared)
# with create_graph=True, gradients are values of the Autograd level: .payload is the tensor
same(h_a.payload, ref_a, "dL1/da, one shared tape vs torch.func")
same(h_b.payload, ref_b, "dL1/db, one shared tape vs torch.func")
shared.tape
"""),
md("""
Reading the 20 entries: 0–3 are the forward pass of `L0`; 4–9 are its backward pass, recorded
because of `create_graph=True` (`v7` is `dL0/da`, `v9` is `dL0/db`); 10–11 build `L1`; 12–19 are
the backward pass of `L1`, recorded as well, although nothing will differentiate it. Two names
are used but never defined on the tape, `c0` and `c1`: they are **constants** for this level
(a tape labels its constants `c0`, `c1`, ... in the order it meets them), the seed of ones of
each backward pass (spread by `sum`'s backward). Ones have no derivative, so no entry records
them, and the backward pass of `L1` works out no cotangent for them.

## 6 · Second derivatives, way 2: two Autograd levels, two tapes

The functorch way, and what `grad(grad(f))` does: stack two Autograd levels, neither with
`create_graph`. The inner level (`Autograd2`, which computes `dL0/da`) sends its backward
operations down to the level below, as in section 4; but the level below is now `Autograd1`,
which **records them on its own tape**. Nothing special is needed for that: recording is just
what a level does with the operations it receives.

We compute the same numbers, then show the two tapes. `TapeStepper` (from
`minifunctorch.widgets`) shows each tape in a panel, the outer level (`Autograd1`, level 1)
first: its panels are labelled *outer* and *inner*. In JupyterLab one control bar steps both
panels together (untick "step together" to step each on its own); the legend above them says
what the row marks mean. Without a running kernel it shows the tapes and their final gradients
as text.
"""),
code("""
reset_names()
outer = Autograd(Torch(), name="Autograd1")
inner = Autograd(outer, name="Autograd2")
h2_a, h2_b = second_order(inner, outer)
same(h2_a, ref_a, "dL1/da, two levels vs torch.func")
same(h2_b, ref_b, "dL1/db, two levels vs torch.func")
same(h2_a, h_a.payload, "dL1/da, two levels vs one shared tape")

from minifunctorch.widgets import TapeStepper
TapeStepper([outer.tape, inner.tape])
"""),
md("""
What to notice:

- The four forward entries (`mul`, `mul`, `add`, `sum`) are on **both** tapes: the forward pass is
  recorded twice, once per level. (Only the entries are duplicated; the tensors they point to
  are shared.)
- `Autograd2` holds just the forward pass of `L0`. Its backward pass became entries 4–9 of
  `Autograd1`, followed by `L1`: 12 entries, against 20 on the shared tape, because the last
  backward pass is recorded nowhere (no one needs to differentiate it).
- Neither way is free. The shared tape records the forward pass once, but with
  `create_graph=True` it records *everything*, including a last backward pass that nobody
  differentiates. Two levels record the forward pass twice and nothing more. What separate
  levels buy is independence: that is what lets a *different* transform sit between the two
  levels (section 7), and what keeps nested derivatives from mixing up (chapter 2,
  perturbation confusion).

## 7 · A level in between: per-sample gradients

Slide a `Batched` level between the two Autograd levels:
`Autograd(Batched(Autograd(Torch()), length=2))`. `Batched` reads dimension 0 of every tensor
it is handed as the batch, and **hides** it: the level above sees one example of shape `(4,)`.
So `Autograd3` computes the loss and the gradients of *one example*, which the batch level turns
into per-example gradients for all examples at once. `Autograd1`, below the batch, then
differentiates a loss built from those per-example gradients.

This is exactly `torch.func.grad` of a function that calls `vmap(grad(...))`.
"""),
code("""
torch.manual_seed(0)
reset_names()
A, B = label(torch.rand(2, 4), "A"), label(torch.rand(2, 4), "B")    # 2 examples each

level1 = Autograd(Torch(), name="Autograd1")
level2 = Batched(level1, length=2, name="Batched2")
level3 = Autograd(level2, name="Autograd3")

L0 = level3.sum(toy(level3, A, B), dim=0, name="L0")   # dim 0 of one example, shape (4,)
g_a, g_b = level3.grad(L0, [A, B])                    # per-example gradients
L1 = level1.sum(level1.mul(g_a, g_b), name="L1")
dA, dB = level1.grad(L1, [A, B])
print("dL1/dA =", dA)


def L1_per_sample(a, b):
    g_a, g_b = torch.func.vmap(torch.func.grad(toy_torch, argnums=(0, 1)))(a, b)
    return (g_a * g_b).sum()


ref_A, ref_B = torch.func.grad(L1_per_sample, argnums=(0, 1))(A, B)
same(dA, ref_A, "dL1/dA vs torch.func grad of vmap(grad)")
same(dB, ref_B, "dL1/dB vs torch.func grad of vmap(grad)")


# minifunctorch's torch.func-style functions build this very stack for you
def L1_ours(a, b):
    g_a, g_b = vmap(grad(toy_torch, argnums=(0, 1)))(a, b)
    return (g_a * g_b).sum()


ours_A, ours_B = grad(L1_ours, argnums=(0, 1))(A, B)
same(ours_A, ref_A, "the same with grad(... vmap(grad(...)) ...)")
same(ours_B, ref_B, "the same with grad(... vmap(grad(...)) ...)")
"""),
code("""
print("Autograd3, inside the batch (one example):")
print(level3.tape)
print()
print("Autograd1, outside the batch (all examples):")
print(level1.tape)
"""),
md("""
The two tapes start alike but are not copies. `Autograd3` records per-example shapes
(`f32[4]`, a sum over `dim=(0,)`). `Autograd1` received the same forward operations *after*
the batch level had translated them: shapes `f32[2,4]`, and the sum now runs over `dim=(1,)`
because the batch dimension sits in front. Entries 4–9 are `Autograd3`'s backward pass, batched
the same way. (`c0`, used but never defined, is the seed of ones: a constant for
`Autograd1`.)
"""),

md("""
## Summary

- A **dispatcher** (level) interprets operations; levels stack, and each one passes its work to
  the level below. `Torch` computes; `Logger` prints; `Autograd` records a tape; `Batched`
  hides a batch dimension.
- A **tape** is a list of entries with backward closures; `grad` is a loop over it in reverse.
- Higher derivatives: record the backward on the same tape (`create_graph=True`), or stack
  Autograd levels (one tape each, forward pass duplicated, levels independent).
- Independent levels let `vmap` sit between two `grad`s: per-sample gradients.
- Levels are numbered up from `Torch` (level 0); the outer transform has the lower number.

[Chapter 2](02_levels.ipynb) follows values from one level to another, and shows how ordinary
PyTorch code reaches the levels.

---

## Exercise · A vjp rule for a new primitive

`softplus(x) = log(1 + exp(x))` is not a primitive of minifunctorch. Below we create it as one
and register rules for forward mode and for batching ([chapter 3](03_interpreters.ipynb)
explains those tables). The **reverse-mode rule is missing**: write `softplus_vjp` as a
*differentiator closure*, the way every rule in `core/autograd.py` is written:

```python
def some_vjp(x):
    out = ...                          # the forward result
    def backward(ct):                  # ct: the cotangent of out
        return (x_bar,)                # one cotangent per argument
    return out, backward
```

Write the backward with the functions of `minifunctorch.core.ops` (`ops.mul`, `ops.sigmoid`,
...), so that it works on the values of any level. Hint: the derivative of softplus is
`sigmoid(x)`. Run the stub and the check first: the check fails and tells you what is missing.
"""),
code("""
from minifunctorch.core import Primitive, batching_rules, bind, jvp_rules, ops, vjp_rules

softplus_p = Primitive("softplus", F.softplus)


def softplus(x):
    return bind(softplus_p, x)


def softplus_vjp(x):
    # TODO: return (out, backward), where backward(ct) returns a 1-tuple (x_bar,)
    raise NotImplementedError("softplus_vjp: write the forward result and the backward closure")


vjp_rules[softplus_p] = softplus_vjp


# Given: the forward-mode rule and the batching rule (see chapter 3).
def softplus_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return softplus(x), ops.mul(x_dot, ops.sigmoid(x))


def softplus_batch(values, bdims):
    (x,), (bdim,) = values, bdims
    return softplus(x), bdim          # elementwise: the batch dimension stays where it is


jvp_rules[softplus_p] = softplus_jvp
batching_rules[softplus_p] = softplus_batch
"""),
code("""
from minifunctorch.core.checks import check_against, check_primitive

torch.manual_seed(0)
display(check_primitive(softplus_p, F.softplus, torch.randn(5)))
display(check_against(vmap(grad(grad(softplus))), torch.func.vmap(torch.func.grad(torch.func.grad(F.softplus))),
                      torch.randn(5), what="second derivative of softplus, per element",
                      hint="the backward closure must use ops.*, so that it can be differentiated again"))
"""),
md(SOLUTION_HEADING),
solution("""
# Solution. The forward result is softplus(x), bound on the level below. The backward closure
# captures x and multiplies the incoming cotangent by sigmoid(x). Because it is written with
# ops.*, a level below can record its operations: that is what makes grad(grad(softplus)) work.
def softplus_vjp(x):
    out = softplus(x)

    def backward(ct):
        return (ops.mul(ct, ops.sigmoid(x)),)
    return out, backward


vjp_rules[softplus_p] = softplus_vjp
"""),
code("""
torch.manual_seed(0)
display(check_primitive(softplus_p, F.softplus, torch.randn(5)))
display(check_against(vmap(grad(grad(softplus))), torch.func.vmap(torch.func.grad(torch.func.grad(F.softplus))),
                      torch.randn(5), what="second derivative of softplus, per element",
                      hint="the backward closure must use ops.*, so that it can be differentiated again"))
"""),
]

write(cells, "01_dispatchers.ipynb")
