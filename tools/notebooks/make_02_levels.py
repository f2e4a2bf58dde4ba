"""Generate notebooks/02_levels.ipynb (Chapter 2 · levels)."""
from nbcells import code, md, write

cells = [
md("""
# Chapter 2 · Levels: values, real tensors, and nested derivatives

[Chapter 1](01_dispatchers.ipynb) stacked levels by hand and read their tapes. This chapter
follows the **values** between the levels: how a function with a backward of its own keeps it
under every level, how a value joins a level and leaves it, how an ordinary torch call reaches
the levels at all, and why nested derivatives need separate levels.

**Contents.** 1 · `custom_vjp` · 2 · Lifting and lowering · 3 · Values as real tensors ·
4 · Perturbation confusion · Summary · Appendix: the two doors

The levels keep chapter 1's numbering: `Torch` is level 0, and an outer transform has a lower
number than the ones nested inside it. Every number is compared with `torch.func`.
"""),
code("""
import torch
import torch.nn.functional as F
import torch.func

from minifunctorch.core import (Autograd, Batched, FuncTensor, Logger, Torch, Value, custom_vjp,
                                grad, label, reset_names, vmap)

torch.manual_seed(0)
torch.set_printoptions(precision=4)


def same(ours, reference, what):
    \"\"\"Raise if two results differ; otherwise say that they agree.\"\"\"
    torch.testing.assert_close(ours, reference)
    print(f"{what}: agree")


def toy(d, a, b):
    return d.add(d.mul(a, b), d.mul(b, b))


# Chapter 1's three-level stack (section 7): per-example gradients inside a batch of two.
torch.manual_seed(0)
reset_names()
A, B = label(torch.rand(2, 4), "A"), label(torch.rand(2, 4), "B")
level1 = Autograd(Torch(), name="Autograd1")
level2 = Batched(level1, length=2, name="Batched2")
level3 = Autograd(level2, name="Autograd3")
L0 = level3.sum(toy(level3, A, B), dim=0, name="L0")
g_a, g_b = level3.grad(L0, [A, B])
"""),

md("""
## 1 · `custom_vjp`: a backward pass you write yourself

Sometimes you know a better backward than the one autodiff would derive: cheaper, more stable,
or deliberately different. `@custom_vjp` marks a function whose gradient comes from two
functions you supply: `fwd(*args)` returns the output and what to save; `bwd(saved, ct)` returns
one cotangent per argument.

Our example is SiLU, `x * sigmoid(x)`. Its derivative is `s * (1 + x * (1 - s))` with
`s = sigmoid(x)`, so saving `s` in the forward pass spares the backward pass a second sigmoid.

Seen through the explicit API (second half of the cell), the custom function is a **single
tape entry**, and the logger below shows the operations of `silu_fwd` during the forward pass
and those of `silu_bwd` during the backward pass. (`d.adopt(x)` makes `x` a value of `d`'s
level; section 2 explains it.)
"""),
code("""
@custom_vjp
def silu(x):
    return x * torch.sigmoid(x)


def silu_fwd(x):
    s = torch.sigmoid(x)
    return x * s, (x, s)                     # output, saved context


def silu_bwd(saved, ct):
    x, s = saved
    return (ct * s * (1 + x * (1 - s)),)     # one cotangent per argument


silu.defvjp(silu_fwd, silu_bwd)

torch.manual_seed(0)
x = label(torch.randn(4), "x")
same(grad(lambda x: silu(x).sum())(x), torch.func.grad(lambda x: F.silu(x).sum())(x),
     "grad of our silu vs torch.func")
print()

reset_names()
d = Autograd(Logger(Torch(), name="[Torch]"))
print("-- forward")
L = d.sum(silu(d.adopt(x)))
print(d.tape)
print("-- backward")
(gx,) = d.grad(L, [x])
same(gx.payload, torch.func.grad(lambda x: F.silu(x).sum())(x), "dL/dx vs torch.func")
"""),
md("""
A custom function must survive the other transforms too. When it reaches a `Batched` level, the
batching rule makes a *batched* custom function, named `vmap(silu)`, whose function, `fwd` and
`bwd` are all vmapped, and hands that to the level below. An Autograd level under the batch
therefore still records one custom entry, and still uses the hand-written backward.

(In the other order, an Autograd level *above* the others uses `silu_fwd` and `silu_bwd` itself,
and the levels below just see their ordinary operations, as in the cell above. JAX makes the
same choice.)
"""),
code("""
reset_names()
torch.manual_seed(0)
xs = label(torch.randn(3, 4), "xs")
below = Autograd(Torch(), name="Autograd1")
batch = Batched(below, length=3)
ys = silu(batch.adopt(xs))          # three examples of shape (4,)
print(below.tape)
(g_xs,) = below.grad(below.sum(ys), [xs])
same(g_xs, torch.func.grad(lambda xs: F.silu(xs).sum())(xs), "gradient through vmap(silu)")
"""),

md("""
## 2 · Lifting and lowering: how values join a level and leave it

Every value belongs to one level and wraps a value of the level below. Two conversions move
values between levels.

**Lifting**, `d.adopt(value)`: a plain tensor becomes a value of `d`'s level, wrapped once per
level of the stack. For `Autograd` and `Logger` the wrapper adds nothing but a name. For
`Batched` it is a *reading* of the tensor: dimension 0 is taken as the batch and hidden. The
explicit API adopts every argument of `d.mul(...)`, `d.sum(...)`, ... automatically; that is
how the plain tensors `A` and `B` entered the three-level stack of the set-up cell
(chapter 1, section 7).

**Lowering** goes the other way: a value of a higher level, seen from a lower one. In that stack,
`level1.mul(g_a, g_a)` receives `g_a`, a per-example gradient that belongs to level 2. Adopting
it into level 1 *lowers* it, and the batch dimension becomes visible again, in front.
"""),
code("""
def show_levels(value):
    \"\"\"Print a value one level per line, from its own level down to the torch tensor.\"\"\"
    value = value.value if isinstance(value, FuncTensor) else value  # the value it shows
    while isinstance(value, Value):
        extra = f", bdim={value.bdim}" if hasattr(value, "bdim") else ""
        print(f"level {value.dispatcher.level}  {value.dispatcher.name:<9}  "
              f"{type(value).__name__}{extra}, shape seen here {tuple(value.shape)}")
        value = value.payload
    print(f"level 0  Torch      {value!r}")


t = label(torch.tensor([5.0, 7.0]), "t")
show_levels(level3.adopt(t))

try:
    level3.adopt(torch.ones(3))            # dim 0 has size 3, but the batch has length 2
except ValueError as error:
    print(type(error).__name__ + ":", error)

print()
print("g_a belongs to level", g_a.dispatcher.level, "with shape", tuple(g_a.shape))
lowered = level1.adopt(g_a)
print("lowered to level", lowered.dispatcher.level, "it has shape", tuple(lowered.shape))
"""),

md("""
## 3 · Values as real tensors: ordinary PyTorch code under `grad` and `vmap`

Real code calls `torch.sin(x)`, not `d.sin(x)`. Two pieces close the gap.

1. **A global stack of levels.** `grad(f)(x)` creates an Autograd level on top of the *current*
   level, makes it current while `f` runs, and makes `x` a value of that level (an
   `AutogradValue`).
2. **A tensor that shows the value.** `f` receives a `FuncTensor`: a real `torch.Tensor`
   (so `isinstance(x, torch.Tensor)` holds, and nn.Modules accept it) that holds no numbers of
   its own, only the value. It defines `__torch_function__`, the hook PyTorch calls when one
   of the arguments of a torch function is a tensor subclass. So `torch.sin(x)` lands in
   minifunctorch, which finds the highest level among the values and lets that level run the
   operation; the result is shown to `f` as a new FuncTensor.

Why two objects, a value and a tensor? The levels' own work (rules, backward closures) runs on
light values; only what user code sees needs to be a tensor, and a tensor subclass costs about
ten times more to create.

The first cell looks inside `f` under `grad` and under `vmap(grad(...))`: the stack grows with
nesting. The second cell rebuilds `grad` from these pieces, with the helpers that
minifunctorch's own `grad` uses: `new_level` stacks a level on the current one,
`transform_scope` makes it current while `f` runs (and pops it afterwards, even on an error),
`as_tensor` shows a value to `f` as a FuncTensor, and `unwrap` takes the value back out of a
tensor (so that `my_grad(my_grad(f))` works: the inner call receives a FuncTensor).
"""),
code("""
from minifunctorch.core.dispatch import current_dispatcher


def f(x):
    print(f"inside f: x is a {type(x).__name__} of level {x.dispatcher.level} "
          f"(its value: {type(x.value).__name__});",
          "current stack:", current_dispatcher())
    y = torch.sin(x) * x             # torch sees a FuncTensor and hands the call over
    print("torch.sin(x) * x ->", repr(y))
    return y


x = torch.tensor(0.5)
same(grad(f)(x), torch.func.grad(lambda x: torch.sin(x) * x)(x), "grad(f) vs torch.func")
print()
_ = vmap(grad(f))(torch.tensor([0.5, 1.0]))
"""),
code("""
from minifunctorch.core.dispatch import new_level, transform_scope
from minifunctorch.core.tensor import as_tensor, unwrap


def my_grad(f):
    def grad_f(x):
        level = new_level(Autograd)              # on top of whatever level is current
        with transform_scope(level):
            x_value = level.wrap_input(unwrap(x))  # x, as a value of the new level
            out = f(as_tensor(x_value))          # ... shown to f as a tensor
        (g,) = level.grad(out, [x_value])        # walk this level's tape
        return g
    return grad_f


x = torch.tensor(0.5)
same(my_grad(torch.sin)(x), torch.func.grad(torch.sin)(x), "my_grad(sin)")
same(my_grad(my_grad(torch.sin))(x), torch.func.grad(torch.func.grad(torch.sin))(x),
     "my_grad(my_grad(sin))")
xs = torch.tensor([0.0, 0.5, 1.0])
same(vmap(my_grad(torch.sin))(xs), torch.func.vmap(torch.func.grad(torch.sin))(xs),
     "vmap(my_grad(sin))")
"""),

md("""
## 4 · Perturbation confusion

Here is a function with a derivative *inside* it:

$$g(x) = x \\cdot \\frac{d}{dy}(x + y)\\Big|_{y=1}$$

The inner derivative is 1 whatever `x` is, so `g(x) = x` and `g'(x) = 1`; minifunctorch and
`torch.func` agree. But getting 1 is not automatic. Take PyTorch's eager autograd (second half
of the cell), which keeps **one graph for everything** and, with `.backward()`, adds gradients
into every leaf that took part. The inner "derivative with respect to `y`" also deposits a
gradient into `x.grad`, and the outer derivative adds its own on top.
"""),
code("""
one = torch.tensor(1.0)
x = torch.tensor(3.0)
ours = grad(lambda x: x * grad(lambda y: x + y)(one))(x)
reference = torch.func.grad(lambda x: x * torch.func.grad(lambda y: x + y)(one))(x)
print("ours:", ours, "| torch.func:", reference)
same(ours, reference, "nested grad")
print()

x = torch.tensor(3.0, requires_grad=True)
y = torch.tensor(1.0, requires_grad=True)
(x + y).backward()                 # meant as d/dy (x + y) ...
inner = y.grad                     # ... which is 1, but x.grad received 1 as well
(x * inner).backward()             # the outer d/dx
print("x.grad =", x.grad, "but the derivative is 1")
"""),
md("""
That is **perturbation confusion**: on one shared tape, nothing says which differentiation a
variable belongs to, so the inner derivative "sees" the outer variable `x` as something to
differentiate and mixes the two. (Forward mode with a single tangent slot per value fails the
same way: `x` already carries the outer tangent, so `x + y` gets a tangent of 2.)

Levels fix it. The outer `grad` gives `x` level 1, the inner `grad` gives `y` level 2, and
`x + y` is recorded only on the level-2 tape, with `x` as a **constant** input: the inner
backward pass can only ever reach `y`. Look inside:
"""),
code("""
def outer_fn(x):
    def inner_fn(y):
        z = x + y
        print(f"inside: x is level {x.dispatcher.level}, y is level {y.dispatcher.level}, "
              f"z = x + y is level {z.dispatcher.level}")
        show_levels(z)
        return z
    inner_grad = grad(inner_fn)(one)
    print("inner derivative:", inner_grad)
    return x * inner_grad


print("result:", grad(outer_fn)(torch.tensor(3.0)))
"""),

md("""
## Summary

- `custom_vjp` swaps in a hand-written backward, and survives batching as `vmap(f)`.
- `adopt` lifts values into a level, lowering takes them back down: a batch level shows its
  batch dimension again to the levels below it.
- A `FuncTensor`, a real `torch.Tensor` showing one value, lets ordinary PyTorch code reach
  the current level through `__torch_function__` (and `__torch_dispatch__` for everything
  else).
- Separate levels keep nested derivatives apart: no perturbation confusion.

[Chapter 3](03_interpreters.ipynb) looks at the same machine from the inside: primitives,
`bind`, and the rule tables of each interpreter.

---
"""),
md("""
## Appendix · The two doors

Section 3 said that a FuncTensor hands every torch call to minifunctorch. There are two ways in,
and a call takes the first that knows it.

1. **The front door, `__torch_function__`.** Torch passes the function as the user called it
   (`torch.sin`, `Tensor.reshape`, `F.conv2d`). A table, `torch_api.TORCH_FUNCTIONS`, maps the
   common ones onto `ops`, which bind primitives. This is the fast path, and the one whose
   programs read like the code you wrote.
2. **The back door, `__torch_dispatch__`.** Any other function is handed back to torch, whose
   own C++ lowers it to *aten* ops, torch's internal vocabulary (`aten.sub.Tensor`,
   `aten.sum.dim_IntList`), and each aten op comes back to minifunctorch. It then tries, in
   order: its aten table (`aten_api.ATEN_OPS`, onto the same `ops`); an in-place op computed
   out of place; one of torch's own decompositions into other aten ops; what the level itself
   can do without a rule (vmap loops over the examples; grad and jvp run an op whose results
   cannot carry a derivative, such as integer indices); and otherwise an error that names the
   op.

`torch.trapezoid` is not in the front table, so it takes the back door; the program shows what
it became. The primitives are the same ones the front door uses: the back door adds breadth,
not a second engine.
"""),
code("""
from minifunctorch.core import TransformError, capture_fallbacks, torch_api, trace

print("front door knows torch.sin:", torch.sin in torch_api.TORCH_FUNCTIONS)
print("front door knows torch.trapezoid:", torch.trapezoid in torch_api.TORCH_FUNCTIONS)
print(trace(torch.trapezoid)(torch.ones(5)))
same(grad(lambda x: torch.trapezoid(x * x))(torch.arange(5.0)),
     torch.func.grad(lambda x: torch.trapezoid(x * x))(torch.arange(5.0)), "grad of trapezoid")
"""),
md("""
The last two steps show on an op that nobody taught minifunctorch: a custom op registered with
`torch.library`, which torch cannot decompose. Under `vmap` it runs once per example (correct,
but a Python loop: `capture_fallbacks` names every op that took that slow path, so that it can
get a batching rule). Under `grad` there is no way to differentiate it, and the error says so.
"""),
code("""
@torch.library.custom_op("course::scaled_cube", mutates_args=())
def scaled_cube(x: torch.Tensor) -> torch.Tensor:
    return 2 * x ** 3


@scaled_cube.register_fake
def _(x):
    return torch.empty_like(x)


xs = torch.arange(6.0).reshape(3, 2)
with capture_fallbacks() as used:
    same(vmap(scaled_cube)(xs), 2 * xs ** 3, "vmap of an op without a batching rule")
print("took the per-example fallback:", dict(used))
try:
    grad(lambda x: scaled_cube(x).sum())(xs[0])
except TransformError as error:
    print(type(error).__name__ + ":", error)
"""),
]

write(cells, "02_levels.ipynb")
