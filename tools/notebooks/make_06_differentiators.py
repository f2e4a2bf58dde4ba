"""Generate notebooks/06_differentiators.ipynb (Chapter 6 · differentiators)."""
from nbcells import SOLUTION_HEADING, build

cells = []
md = lambda s: cells.append(("md", s))
code = lambda s: cells.append(("code", s))
solution = lambda s: cells.append(("solution", s))
solution_md = lambda s: cells.append(("solution-md", s))

md("""
# Chapter 6 · Differentiators: gradient formulas as closures

Every primitive in minifunctorch knows how to differentiate itself through one small Python
function, its **vjp rule**. This chapter is about the shape of that function.

The idea comes from TorchScript's symbolic gradients. Instead of writing a forward formula, a
separate backward formula, and the plumbing that carries values from one to the other, you
write *one* function: it does the forward computation and **returns the backward as a nested
function**. Whatever the backward needs from the forward, it simply mentions by name, and
Python's closures keep it alive. Such a function is called a *differentiator*.

In this chapter you will

- read real rules from `vjp_rules`, and write one for a new primitive;
- look inside a tape entry to see what its closure saved;
- see how the backward of a broadcasting op undoes the broadcast with `sum_to_size`;
- split a computation into a forward program and a backward program that pass an explicit
  *saved context* (`split_vjp`);
- decide, with `custom_vjp`, what the forward should save, and weigh memory against
  recomputation.

The chapter ends with an exercise: the differentiator of `hypot`.
""")

code("""
import inspect

import torch
import torch.nn.functional as F

from minifunctorch.core import (Primitive, bind, capture_tapes, custom_vjp, grad, split_vjp,
                                vjp_rules)
from minifunctorch.core import ops
from minifunctorch.core.autograd import sum_to_size
from minifunctorch.core.primitives import mul_p, sin_p

torch.manual_seed(0)
torch.set_printoptions(precision=4)
""")

md("""
## 1 · A rule is a forward that returns its backward

A vjp rule receives the primitive's inputs and returns two things: the output, and a function
`backward(ct)`. That function takes `ct`, the *cotangent* of the output (the gradient of the
loss with respect to the output, flowing backwards), and returns one cotangent per input, as a
tuple. Here is the engine's rule for `sin`:
""")

code("""
print(inspect.getsource(vjp_rules[sin_p]))
""")

md("""
Three things to notice:

- The backward is a `lambda` defined *inside* the rule. It uses `x`, a variable of the
  enclosing function, so Python stores `x` together with the lambda, in its *closure*. Nobody
  wrote "save `x` for the backward": mentioning it was enough.
- The rule is written with `ops.sin`, `ops.mul` and `ops.cos`, the engine's own operations.
  They dispatch on their arguments, so the same rule serves plain tensors, values under
  `vmap`, and values being traced into a program.
- `conj` is the complex conjugate, and does nothing to a real tensor. It is there for complex
  inputs: PyTorch's convention multiplies the cotangent by the *conjugate* of the derivative,
  and with it the one rule is right for both kinds of numbers.
- The backward returns a tuple with one entry per input, even when there is only one input.

A rule is an ordinary Python function, so you can call it by hand, with no transform at all:
""")

code("""
x = torch.randn(4)
out, backward = vjp_rules[sin_p](x)
(x_bar,) = backward(torch.ones(4))   # cotangent of ones: the gradient of sin(x).sum()

torch.testing.assert_close(out, torch.sin(x))
torch.testing.assert_close(x_bar, torch.cos(x))
x_bar
""")

md("""
## 2 · Writing a rule for a new primitive

A new operation needs a `Primitive` (a name and a torch implementation) and a rule in the table
of each transform that should handle it. For `grad`, the vjp rule is enough. Let us teach the
engine `softplus(x) = log(1 + exp(x))`, whose derivative is `sigmoid(x)`.

`bind(softplus_p, x)` applies the primitive at the level that `x` belongs to; for a plain
tensor it is just a call to `F.softplus`. (In the package, a primitive lives in
`core/primitives.py` and its rules next to the other rules, as CONTRIBUTING.md describes. In a
notebook we can register one on the spot.)
""")

code("""
softplus_p = Primitive("softplus", F.softplus)

def softplus_vjp(x):
    out = bind(softplus_p, x)

    def backward(ct):
        return (ops.mul(ct, ops.sigmoid(x)),)

    return out, backward

vjp_rules[softplus_p] = softplus_vjp

# user code reaches the new primitive through bind, too
def total_softplus(x):
    return bind(softplus_p, x).sum()

ours = grad(total_softplus)(x)
torch.testing.assert_close(ours, torch.func.grad(lambda x: F.softplus(x).sum())(x))
ours
""")

md("""
The backward is built from `ops.mul` and `ops.sigmoid`, which have rules of their own. So the
backward is differentiable as well, and a second derivative by `grad` of `grad` needs no new
code. (`hessian` would need more: it is forward mode over reverse mode, so it also asks for a
forward-mode rule, `jvp_rules[softplus_p]`.)
""")

code("""
def softplus_slope_total(x):
    return grad(total_softplus)(x).sum()

ours = grad(softplus_slope_total)(x)
expected = torch.func.grad(
    lambda x: torch.func.grad(lambda x: F.softplus(x).sum())(x).sum())(x)
torch.testing.assert_close(ours, expected)
torch.testing.assert_close(ours, torch.sigmoid(x) * (1 - torch.sigmoid(x)))
ours
""")

md("""
## 3 · What the closure keeps: the saved context

While `grad` runs a function, its Autograd level calls the rule of each primitive it meets and
records a **tape entry**: the names of the inputs and the output, and the backward closure.
`capture_tapes()` collects the tapes made inside a `with` block. On an entry,
`TapeEntry.saved` reads the variables its closure captured, by name: the **saved context** of
that step.
""")

code("""
def f(x):
    return (torch.sin(x) * x).sum()

with capture_tapes() as tapes:
    grad(f)(x)

tape = tapes[0]
for entry in tape:
    print(entry.format())
    for name, value in entry.saved.items():
        print(f"    saved {name} = {value}")
""")

md("""
Entry by entry:

- `sin` kept its input, `x` (the tensor called `v0` on the tape): its backward will need
  `cos(x)`.
- `mul` kept both operands, because the cotangent of each one is the output cotangent times
  the *other*. Its `x` is `sin(v0)` and its `y` is `v0`. The same tensor `v0` is now referenced
  by two closures, yet stored once.
- `sum` kept no tensor at all: only the input's shape and the reduced dims. Its backward just
  spreads the cotangent back over that shape.

Everything listed here stays in memory from the moment the forward computes it until the
backward has used it. That is the memory bill of reverse mode, and each rule decides its own
share of it.

## 4 · Broadcasting, and how the backward undoes it

Multiplying a `(2, 3)` matrix by a `(3,)` vector broadcasts: the vector is used once per row,
as if it had been copied into a `(2, 3)` tensor. A value that is used in several places gets the
**sum** of the gradients of all its uses. The cotangent that reaches the vector has the output's
shape, `(2, 3)`, so it must be summed back down to `(3,)`. The engine's `mul` rule does this
with `sum_to_size`:
""")

code("""
print(inspect.getsource(vjp_rules[mul_p]))
""")

md("""
(The `wants_cotangent` tests skip the cotangents that nobody wants, like PyTorch's
`ctx.needs_input_grad`: a Python number, as in `x * 2.0`, needs no gradient, and neither does
a tensor that the transform holds constant, such as an argument `grad` does not differentiate.
Called by hand, outside a backward pass, the rule makes both.) To see the reduction at work,
call the rule by hand and compare the shapes of the raw products with the shapes it returns,
then take the gradient with `grad`:
""")

code("""
a = torch.randn(2, 3)
b = torch.randn(3)
ct = torch.ones(2, 3)

out, backward = vjp_rules[mul_p](a, b)
a_bar, b_bar = backward(ct)
print("output:", tuple(out.shape))
print("ct * b:", tuple((ct * b).shape), "-> a_bar:", tuple(a_bar.shape))
print("ct * a:", tuple((ct * a).shape), "-> b_bar:", tuple(b_bar.shape))

# under grad, each gradient has the shape of its own argument, as in torch.func
def product_total(a, b):
    return (a * b).sum()

a_grad, b_grad = grad(product_total, argnums=(0, 1))(a, b)
torch.testing.assert_close((a_grad, b_grad),
                           torch.func.grad(product_total, argnums=(0, 1))(a, b))
torch.testing.assert_close(b_grad, a.sum(0))   # each entry is a column sum of a
print(tuple(a_grad.shape), tuple(b_grad.shape))
""")

md("""
### `sum_to_size`, ours and PyTorch's

`sum_to_size(ct, shape)` runs broadcasting backwards: dims that broadcasting added on the left
are summed away, and dims where `shape` has size 1 are summed but kept. PyTorch has the same
operation as a tensor method, `Tensor.sum_to_size`. The engine writes its own with `ops.sum`,
so that it works on the values of every level (a plain tensor method would not dispatch under
`vmap` or tracing). On plain tensors the two agree:
""")

code("""
g = torch.arange(6.0).reshape(2, 3)
for shape in [(2, 3), (3,), (1, 3), (2, 1), ()]:
    ours = sum_to_size(g, shape)
    torch.testing.assert_close(ours, g.sum_to_size(shape))
    print(f"{str(shape):7} -> {ours.tolist()}")
""")

md("""
## 5 · Splitting the closure into two programs

A closure is pleasant to write but hard to inspect, compile or ship: its saved values are
hidden inside a Python function object. TorchScript's answer was to cut every differentiator
in two. The forward half returns the output **and** a tuple of what the closure captured; the
backward half is a function of that tuple and of the output's cotangent. What was implicit in
the closure becomes an explicit value handed from one half to the other.

`split_vjp(f)(*example_args)`, which Chapter 5 met briefly, does this for a whole function.
It traces `f` under an Autograd level, collects the values that the recorded backward
closures captured, and returns two programs, `fwd` and `bwd`:
""")

code("""
def broadcast_mul(a, b):
    return a * b

fwd, bwd = split_vjp(broadcast_mul)(a, b)
print(fwd)
print(bwd)
""")

md("""
How to read them (the letters are program variables, local to each program):

- `fwd` takes `a` and `b` and returns `(c, a, b)`: the output `c`, then the saved context,
  which for a product is both operands.
- `bwd` takes the saved context first (`a`, `b`), then the output cotangent `c`. Its body is
  the `mul` rule's backward: two products, and a `sum ... dim=(0,)`. That sum is the
  `sum_to_size` which brings `b`'s cotangent from `(2, 3)` back to `(3,)`. The cotangent of
  `a` already had the right shape, so its `sum_to_size` did nothing and left no trace.

Both programs can be called. `fwd` returns `(output, saved)`, and `bwd(saved, ct)` returns one
cotangent per input. Together they compute what `torch.func.vjp` computes:
""")

code("""
out, saved = fwd(a, b)
print("saved context:", [tuple(s.shape) for s in saved])

ct = torch.randn(2, 3)
ours = bwd(saved, ct)
torch.testing.assert_close(out, broadcast_mul(a, b))
torch.testing.assert_close(ours, torch.func.vjp(broadcast_mul, a, b)[1](ct))
ours
""")

md("""
Between the two calls, `saved` is a plain tuple of tensors. The backward can run much later,
after everything else the forward computed is gone: only this tuple must be kept. Its size was
decided rule by rule, by what each closure mentions.

## 6 · Choosing what to save: `sin`, two ways

For `sin` there are two sensible differentiators:

1. save the input `x`, and compute `cos(x)` in the backward;
2. compute `cos(x)` during the forward and save *that*; the backward only multiplies.

They give the same gradient. With `custom_vjp` we can write both and let `split_vjp` show how
they differ. A `custom_vjp` function gets a forward `fwd(x)` that returns `(out, saved)` and a
backward `bwd(saved, ct)` that returns a tuple with one cotangent per input: the split form of
section 5, written by hand.
""")

code("""
@custom_vjp
def sin_keeps_x(x):
    return torch.sin(x)

def sin_keeps_x_fwd(x):
    return torch.sin(x), (x,)            # save the input

def sin_keeps_x_bwd(saved, ct):
    (x,) = saved
    return (ct * torch.cos(x),)          # cos is computed here, in the backward

sin_keeps_x.defvjp(sin_keeps_x_fwd, sin_keeps_x_bwd)
torch.testing.assert_close(sin_keeps_x(x), torch.sin(x))
""")

code("""
@custom_vjp
def sin_keeps_cos(x):
    return torch.sin(x)

def sin_keeps_cos_fwd(x):
    return torch.sin(x), (torch.cos(x),)  # compute cos now, and save it

def sin_keeps_cos_bwd(saved, ct):
    (cos_x,) = saved
    return (ct * cos_x,)                  # the backward only multiplies

sin_keeps_cos.defvjp(sin_keeps_cos_fwd, sin_keeps_cos_bwd)
torch.testing.assert_close(sin_keeps_cos(x), torch.sin(x))
""")

code("""
fwd_x, bwd_x = split_vjp(sin_keeps_x)(x)
print(fwd_x)
print(bwd_x)
""")

md("""
**Saving `x`.** The forward does one `sin` and returns `(b, a)`: the output, then the input
itself as the saved context. The backward receives `a` (that is `x`) and the cotangent `b`,
and computes the `cos` itself.
""")

code("""
fwd_cos, bwd_cos = split_vjp(sin_keeps_cos)(x)
print(fwd_cos)
print(bwd_cos)
""")

md("""
**Saving `cos(x)`.** The `cos` has moved from the backward program into the forward program,
and the saved context is now `c = cos a` rather than `a`. The backward is a single
multiplication.

Both pairs compute the same vector-Jacobian product as `torch.func.vjp` on `torch.sin`, and
`grad` uses either custom backward. The engine's built-in rule for `sin`, from section 1, makes
the first choice: its forward program is the same as `sin_keeps_x`'s.
""")

code("""
ct = torch.randn(4)
expected = torch.func.vjp(torch.sin, x)[1](ct)
for fwd_program, bwd_program in [(fwd_x, bwd_x), (fwd_cos, bwd_cos)]:
    out, saved = fwd_program(x)
    torch.testing.assert_close(out, torch.sin(x))
    torch.testing.assert_close(bwd_program(saved, ct), expected)

for sin_version in (sin_keeps_x, sin_keeps_cos):
    torch.testing.assert_close(grad(lambda x: sin_version(x).sum())(x), torch.cos(x))
print("both versions agree with torch.func")

# the built-in rule of sin (section 1) makes the first choice
builtin_fwd, builtin_bwd = split_vjp(torch.sin)(x)
print("forward program of the built-in sin rule:")
print(builtin_fwd)
""")

md("""
### Memory or recomputation?

Neither choice wins everywhere. Three questions decide it.

- **Is the value alive anyway?** Saving `x` usually costs no extra memory: `x` is the input,
  and something else (the caller, or the closure of the layer that produced it) often holds it
  regardless. Saving `cos(x)` creates a *new* tensor as large as `x`, which must live from the
  forward until the backward. In a deep network that is one more activation per layer, held
  during the entire forward pass.
- **Is the work on the forward pass wasted?** Computing `cos(x)` in the forward is pure cost
  whenever no backward follows (evaluation, or an output nobody differentiates). Saving `x`
  postpones the work to the backward, which only runs when a gradient is wanted.
- **How expensive is recomputing?** `cos` is one cheap elementwise kernel. When the derivative
  is costly to rebuild, or when it is a simple function of the *output*, saving is better:
  the `exp`, `tanh` and `sigmoid` rules in `core/autograd.py` save their output `out`, a
  tensor that exists anyway because it is handed to the next operation.

PyTorch's own derivative of `sin` (in its `derivatives.yaml`) saves the input, like the first
version. Taking recomputation to the extreme gives *activation checkpointing*
(`torch.utils.checkpoint`): keep only a few tensors, and rerun whole pieces of the forward
during the backward. With differentiator closures every rule makes this choice locally, and
the choice is easy to see: the saved context is exactly what the closure names.

## Summary

- A vjp rule is a **differentiator**: a forward that returns its output and a backward closure.
  The closure's captured variables are the **saved context**, visible as `TapeEntry.saved`.
- A broadcasting op's backward sums each cotangent back to its input's shape with
  `sum_to_size`, because a broadcast input is used several times.
- `split_vjp` turns the closures into two programs that pass the saved context explicitly,
  which is what TorchScript did with its symbolic gradients.
- What a rule saves is a trade-off between memory (keeping tensors alive) and compute
  (rebuilding them in the backward); `custom_vjp` lets you make that choice yourself.

After the exercise below, the course steps back to the user's view: Chapter 7 trains real
models with the transforms, and Chapter 8 runs through the whole torch.func API, each transform
checked against `torch.func`.
""")


md("""
## Exercise · The differentiator of `hypot`

`torch.hypot(x, y)` computes `sqrt(x**2 + y**2)` element by element, and broadcasts its two
arguments against each other. With `out = hypot(x, y)`, its partial derivatives are `x / out`
and `y / out`.

The next cell creates a primitive `hypot_p` and registers its forward-mode rule and its
batching rule for you, and makes two example inputs of shapes `(3, 4)` and `(4,)`.

**Your task:** write `hypot_vjp(x, y)`, the differentiator closure of `hypot_p`. It computes
the output with `bind(hypot_p, x, y)` and returns it together with a `backward(ct)` that
returns a tuple of two cotangents, each with the shape of its own input (think of
`sum_to_size`). Use the `ops` functions, as the engine's rules do.

Then run the check: `check_primitive(hypot_p, torch.hypot, hx, hy)` compares the jvp, vjp and
batching rules of `hypot_p` with `torch.hypot` under `torch.func`. Until the rule is written it
says FAIL, with a hint.

*Something to decide:* which values should your closure keep?
""")

code("""
from minifunctorch.core import batching_rules, jvp_rules
from minifunctorch.core.batching import broadcasting_batch
from minifunctorch.core.checks import check_primitive
from minifunctorch.core.forward import add_tangents, broadcast_tangent, scale_tangent

hypot_p = Primitive("hypot", torch.hypot)

def hypot_jvp(primals, tangents):
    (x, y), (x_dot, y_dot) = primals, tangents   # a tangent of None is a zero tangent
    out = bind(hypot_p, x, y)
    out_dot = add_tangents(scale_tangent(x_dot, ops.div(x, out)),
                           scale_tangent(y_dot, ops.div(y, out)))
    return out, broadcast_tangent(out_dot, ops.shape_of(out))

jvp_rules[hypot_p] = hypot_jvp
batching_rules[hypot_p] = broadcasting_batch(hypot_p)

hx = torch.randn(3, 4)
hy = torch.randn(4)      # broadcasts against hx
""")

code("""
def hypot_vjp(x, y):
    # Your code here: compute out = bind(hypot_p, x, y), define backward(ct),
    # and return out, backward.
    raise NotImplementedError("hypot_vjp is not written yet")

vjp_rules[hypot_p] = hypot_vjp
""")

code("""
check_primitive(hypot_p, torch.hypot, hx, hy)
""")

md(SOLUTION_HEADING)

solution_md("""
The backward needs `x`, `y` and `out`. Keeping `out` costs nothing, since it is the result and
exists anyway; recomputing it would cost a square root. The raw products `ct * x / out` and
`ct * y / out` have the broadcast shape `(3, 4)`, so `sum_to_size` brings `y`'s back to
`(4,)`. Leaving it out is the classic slip: the check then reports that output 1 has shape
`(3, 4)` where `(4,)` was expected.

Once it passes, your rule is a differentiator like the built-in ones: try
`split_vjp(lambda x, y: bind(hypot_p, x, y))(hx, hy)` and look at the saved context it
produces.
""")

solution("""
def hypot_vjp(x, y):
    out = bind(hypot_p, x, y)

    def backward(ct):
        x_bar = sum_to_size(ops.mul(ct, ops.div(x, out)), ops.shape_of(x))
        y_bar = sum_to_size(ops.mul(ct, ops.div(y, out)), ops.shape_of(y))
        return x_bar, y_bar

    return out, backward

vjp_rules[hypot_p] = hypot_vjp
""")

code("""
check_primitive(hypot_p, torch.hypot, hx, hy)
""")

build(cells, "06_differentiators.ipynb", "ch06")
