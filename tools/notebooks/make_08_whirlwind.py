"""Generate notebooks/08_whirlwind.ipynb (Chapter 8 · whirlwind tour)."""
from nbcells import SOLUTION_HEADING, build

cells = []
md = lambda s: cells.append(("md", s))
code = lambda s: cells.append(("code", s))
solution = lambda s: cells.append(("solution", s))
solution_md = lambda s: cells.append(("solution-md", s))

md("""
# Chapter 8 · A whirlwind tour of the transforms

A **function transform** takes a Python function and returns a new function that computes
something else about it: its gradient, its Jacobian, or its value on a whole batch at once.
Transforms compose, so a handful of them cover a lot of ground.

This chapter runs through minifunctorch's user-facing transforms once, quickly. They carry
torch.func's names and signatures, so every cell computes a result with minifunctorch and
checks it, in the same cell, against `torch.func` with `torch.testing.assert_close`. The earlier
chapters showed how the engine works inside; this one is about what it gives you.

Why bother? In plain PyTorch, `loss.backward()` fills each `.grad` with one gradient summed
over the batch. Gradients *per example*, full Jacobians and Hessians, or batches of
Jacobians take loops or tricks. With composable transforms each is a line or two, built from
the same few pieces. At the end, an exercise: per-sample gradient norms.
""")

code("""
%load_ext minifunctorch.magics
import math

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

from minifunctorch.core import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from minifunctorch.core.checks import check_against

torch.manual_seed(0)
torch.set_printoptions(precision=4)
""")

md("""
## 1 · `grad`: the gradient

`grad(f)` returns a function that computes the gradient of `f` with respect to its first
argument. `f` must return a scalar (a 0-dim tensor), the way a loss does. Our example is the
cubic `x**3 - 2x`, whose derivative is `3x**2 - 2`:
""")

code("""
def cubic(x):
    return x ** 3 - 2 * x

x = torch.randn([])
ours = grad(cubic)(x)
torch.testing.assert_close(ours, torch.func.grad(cubic)(x))
torch.testing.assert_close(ours, 3 * x ** 2 - 2)
ours
""")

md("""
## 2 · Transforms compose: `grad` of `grad`

What `grad` returns is an ordinary function, so it can be transformed again. Two `grad`s give
the second derivative, `6x`, and three the third, the constant `6`:
""")

code("""
second = grad(grad(cubic))(x)
third = grad(grad(grad(cubic)))(x)
torch.testing.assert_close(second, torch.func.grad(torch.func.grad(cubic))(x))
torch.testing.assert_close(third, torch.func.grad(torch.func.grad(torch.func.grad(cubic)))(x))
torch.testing.assert_close((second, third), (6 * x, torch.tensor(6.0)))
second, third
""")

md("""
## 3 · `vmap`: write it for one example, run it on a batch

`vmap(f)` maps `f` over a batch dimension (dim 0 by default) of its inputs. You write `f` for a
**single** example; `vmap(f)` takes a batch and returns the stacked results, as a loop would,
but with batched tensor operations instead of a Python loop. Inside `f` the batch dimension is
hidden. The `print` below shows what `f` sees: the shape of one example. It runs once per call
of `f`, not once per example, so it prints twice: once for minifunctorch, once for torch.func.
""")

code("""
def spread(example):
    print("f sees one example of shape", tuple(example.shape))
    centered = example - example.mean()
    return (centered ** 2).mean()

examples = torch.randn(3, 5)
ours = vmap(spread)(examples)
torch.testing.assert_close(ours, torch.func.vmap(spread)(examples))
torch.testing.assert_close(ours, examples.var(dim=1, unbiased=False))  # what it computes
ours
""")

md("""
`in_dims` gives, for each argument, which dimension is the batch. `None` marks an argument
that every example shares, such as the center here:
""")

code("""
def distance(center, point):
    return ((point - center) ** 2).sum().sqrt()

center = torch.zeros(5)
ours = vmap(distance, in_dims=(None, 0))(center, examples)
torch.testing.assert_close(ours, torch.func.vmap(distance, in_dims=(None, 0))(center, examples))
torch.testing.assert_close(ours, examples.norm(dim=1))  # distances from the origin
ours
""")

md("""
## 4 · Per-sample gradients: `vmap(grad(loss))`

Composing the two gives what `loss.backward()` cannot: the gradient of the loss **for each
example separately**. Differential privacy needs it (each example's gradient is clipped before
averaging), and so do data attribution and studies of gradient noise.

The recipe: write the loss of *one* example, take `grad` with respect to the parameters, and
`vmap` the result over the examples and their targets but not over the parameters, which all
examples share: `in_dims=(None, 0, 0)`.

To do this with an `nn.Module`, the parameters must be an argument of the loss.
`functional_call(model, params, args)` runs the module with the tensors of the dict `params`
standing in for its own parameters. Each library's transforms go with its own
`functional_call` (more on this below), so `make_loss` takes the one to use:
""")

code("""
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
model.requires_grad_(False)   # the transforms compute the gradients, not .backward()
params = dict(model.named_parameters())

def make_loss(call):
    def loss(params, x, target):
        logits = call(model, params, (x.unsqueeze(0),))   # a batch of one example
        return F.cross_entropy(logits, target.unsqueeze(0))
    return loss

loss = make_loss(functional_call)                    # for minifunctorch's transforms
torch_loss = make_loss(torch.func.functional_call)   # for torch.func's

xs = torch.randn(6, 4)
targets = torch.randint(0, 3, (6,))
{name: tuple(p.shape) for name, p in params.items()}
""")

code("""
per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, targets)
expected = torch.func.vmap(torch.func.grad(torch_loss), in_dims=(None, 0, 0))(params, xs, targets)
torch.testing.assert_close(per_sample, expected)
{name: tuple(g.shape) for name, g in per_sample.items()}
""")

md("""
The gradient has the same structure as `params` (a dict), and every entry gained a leading
dimension of size 6: one slice per example. Their mean is the ordinary gradient of the mean
loss over the batch, what `loss.backward()` would put in `.grad`:
""")

code("""
mean_of_per_sample = {name: g.mean(0) for name, g in per_sample.items()}

def torch_batch_loss(params):
    return F.cross_entropy(torch.func.functional_call(model, params, (xs,)), targets)

torch.testing.assert_close(mean_of_per_sample, torch.func.grad(torch_batch_loss)(params))
print("the mean of the per-sample gradients is the batch gradient")
""")

md("""
## 5 · `vjp`: reverse mode with your own cotangent

`vjp(f, *primals)` runs `f` once and returns its output and a function `vjp_fn`. Given a
cotangent `v` shaped like the output, `vjp_fn(v)` returns the vector-Jacobian product `vᵀJ`,
one entry per primal, as a tuple. `grad` is the special case of a scalar output with `v = 1`.
Here `f` is a softmax, whose output is a whole vector:
""")

code("""
def softmax(z):
    return torch.softmax(z, dim=0)

z = torch.randn(4)
cotangent = torch.randn(4)

out, vjp_fn = vjp(softmax, z)
torch_out, torch_vjp_fn = torch.func.vjp(softmax, z)
torch.testing.assert_close(out, torch_out)
torch.testing.assert_close(vjp_fn(cotangent), torch_vjp_fn(cotangent))
vjp_fn(cotangent)
""")

md("""
## 6 · `jvp`: forward mode

`jvp(f, primals, tangents)` returns `f(*primals)` together with the Jacobian-vector product
`J·t`: how fast the outputs change when the inputs move along the tangents. Both come out of
one forward pass. Unlike the others, `jvp` takes the function and the point together and
returns values, not a new function.

Take the map from polar coordinates `(r, θ)` to the plane. Moving `r` alone (tangent `(1, 0)`)
moves the point along the unit vector `(cos θ, sin θ)`:
""")

code("""
def polar_to_plane(r, theta):
    return r * torch.cos(theta), r * torch.sin(theta)

r, theta = torch.tensor(2.0), torch.tensor(0.5)
along_r = (torch.tensor(1.0), torch.tensor(0.0))
ours = jvp(polar_to_plane, (r, theta), along_r)
torch.testing.assert_close(ours, torch.func.jvp(polar_to_plane, (r, theta), along_r))
torch.testing.assert_close(ours[1], (torch.cos(theta), torch.sin(theta)))
ours
""")

md("""
## 7 · Jacobians: `jacrev` and `jacfwd`

`jacrev(f)(x)` builds the full Jacobian by reverse mode: one vjp per output element, all run
together by `vmap` over the rows of an identity matrix. `jacfwd(f)(x)` builds the same matrix
by forward mode: one jvp per input element, the columns. The results agree; the costs differ.
Reverse mode pays per output and forward mode per input, so `jacrev` suits functions with
many inputs and few outputs (a loss is the extreme case), and `jacfwd` the opposite.

The Jacobian of a softmax `s` has a known closed form, `diag(s) - s sᵀ`:
""")

code("""
by_rev = jacrev(softmax)(z)
by_fwd = jacfwd(softmax)(z)
torch.testing.assert_close(by_rev, torch.func.jacrev(softmax)(z))
torch.testing.assert_close(by_fwd, torch.func.jacfwd(softmax)(z))
s = softmax(z)
torch.testing.assert_close(by_rev, torch.diag(s) - torch.outer(s, s))
by_rev
""")

md("""
Modules are functions too. Here is the Jacobian of the network with respect to its input, by
both modes: 3 outputs by 4 inputs.
""")

code("""
x_in = torch.randn(4)
by_rev = jacrev(model)(x_in)
by_fwd = jacfwd(model)(x_in)
torch.testing.assert_close(by_rev, torch.func.jacrev(model)(x_in))
torch.testing.assert_close(by_fwd, torch.func.jacfwd(model)(x_in))
torch.testing.assert_close(by_rev, by_fwd)
by_rev
""")

md("""
## 8 · Batched Jacobians: `vmap(jacrev(f))`

One Jacobian per example of a batch, without a loop: `vmap` of a Jacobian transform. For the
network on our 6 examples that is 6 matrices of shape `(3, 4)`; for the softmax on 10 vectors,
10 matrices of shape `(4, 4)`.
""")

code("""
ours_model = vmap(jacrev(model))(xs)
torch.testing.assert_close(ours_model, torch.func.vmap(torch.func.jacrev(model))(xs))

vectors = torch.randn(10, 4)
ours_softmax = vmap(jacfwd(softmax))(vectors)
torch.testing.assert_close(ours_softmax, torch.func.vmap(torch.func.jacfwd(softmax))(vectors))
print(tuple(ours_model.shape), tuple(ours_softmax.shape))
""")

md("""
## 9 · Hessians

The Hessian is the Jacobian of the gradient, so any two Jacobian transforms stacked give it:
`jacrev(jacrev(f))`, or `jacfwd(jacrev(f))`, forward over reverse. For a scalar `f` the inner
reverse pass is the natural choice: it gets the whole gradient in one sweep. The outer
transform differentiates that gradient, which has as many entries as the input, so either mode
needs one pass per input; forward mode does it without recording a tape, which makes it the
usual choice. `hessian(f)` is exactly `jacfwd(jacrev(f))`.

A neat check: the gradient of `logsumexp` is the softmax, so its Hessian is the softmax's
Jacobian from above.
""")

code("""
def logsumexp(z):
    return torch.logsumexp(z, dim=0)

rev_rev = jacrev(jacrev(logsumexp))(z)
fwd_rev = jacfwd(jacrev(logsumexp))(z)
ours = hessian(logsumexp)(z)
expected = torch.func.hessian(logsumexp)(z)
for h in (rev_rev, fwd_rev, ours):
    torch.testing.assert_close(h, expected)
torch.testing.assert_close(ours, jacrev(softmax)(z))
ours
""")

md("""
## 10 · Beyond networks: linear algebra

Nothing above was specific to neural networks. A Gaussian process fits a smooth curve through
noisy points, and its three hyperparameters (a lengthscale, a signal variance, a noise
variance) are chosen by minimizing the negative log marginal likelihood of the data:

$$\\mathrm{nll}(\\theta) = \\tfrac12\\, y^\\top K_\\theta^{-1} y + \\tfrac12 \\log\\det K_\\theta + \\tfrac n2 \\log 2\\pi,$$

where $K_\\theta$ is the $n \\times n$ kernel matrix of the inputs. The function goes through
`torch.linalg.solve` and `torch.linalg.slogdet`; the transforms differentiate through both, and
`hessian` gives the curvature that a Newton step, or a Laplace approximation of the
hyperparameters' uncertainty, needs. We work with the logs of the hyperparameters, so that any
real vector is valid, and in float64, as linear algebra usually is.
""")

code("""
t = torch.linspace(0, 5, 12, dtype=torch.float64)
y = torch.sin(t) + 0.1 * torch.randn(12, dtype=torch.float64)

def nll(log_params):
    lengthscale, variance, noise = log_params.exp()
    gaps = t[:, None] - t[None, :]
    K = variance * torch.exp(-0.5 * (gaps / lengthscale) ** 2) + noise * torch.eye(len(t), dtype=t.dtype)
    _, logdet = torch.linalg.slogdet(K)
    return 0.5 * (y @ torch.linalg.solve(K, y)) + 0.5 * logdet + 0.5 * len(t) * math.log(2 * math.pi)

theta = torch.tensor([0.0, 0.0, -2.0], dtype=torch.float64)
g, H = grad(nll)(theta), hessian(nll)(theta)
torch.testing.assert_close(g, torch.func.grad(nll)(theta))
torch.testing.assert_close(H, torch.func.hessian(nll)(theta))

# the Hessian's first column, against central differences of the gradient
eps = 1e-5
step = torch.tensor([eps, 0.0, 0.0], dtype=torch.float64)
torch.testing.assert_close(H[:, 0], (grad(nll)(theta + step) - grad(nll)(theta - step)) / (2 * eps))
H
""")

md("""
The Jacobians of the linear-algebra functions themselves are worth a look too. The solution
of $A x = b$ is $x = A^{-1} b$, which is linear in $b$, so the Jacobian of `solve` with respect
to `b` is $A^{-1}$ itself:
""")

code("""
A = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
d_db = jacrev(torch.linalg.solve, argnums=1)(A, b)
torch.testing.assert_close(d_db, torch.func.jacrev(torch.linalg.solve, argnums=1)(A, b))
torch.testing.assert_close(d_db, torch.linalg.inv(A))
d_dA = jacfwd(torch.linalg.solve)(A, b)  # one (3, 3) slice per entry of x
torch.testing.assert_close(d_dA, torch.func.jacfwd(torch.linalg.solve)(A, b))
tuple(d_db.shape), tuple(d_dA.shape)
""")

md("""
## 11 · Swapping libraries

Since the names and signatures match, moving code between torch.func and minifunctorch is a
one-line change: write it against a module name, and choose what that name means,
`import torch.func as ft` or `import minifunctorch.core as ft`. The function below does four
computations from this tour against a module `api`, and we run it once with each library:
""")

code("""
import minifunctorch.core

def tour(api):
    loss = make_loss(api.functional_call)
    return {
        "third derivative": api.grad(api.grad(api.grad(cubic)))(x),
        "per-sample gradients": api.vmap(api.grad(loss), in_dims=(None, 0, 0))(params, xs, targets),
        "batched Jacobians": api.vmap(api.jacfwd(model))(xs),
        "Hessian": api.hessian(logsumexp)(z),
    }

ours = tour(minifunctorch.core)
theirs = tour(torch.func)
torch.testing.assert_close(ours, theirs)
list(ours)
""")

md("""
`functional_call` is swapped along with the transforms, as the rest of the API is: inside a
minifunctorch transform the values are real tensors (`FuncTensor`s), so
`torch.func.functional_call` would work too, but each library's own is used with its own
transforms. Hence `api.functional_call` in `tour`, and the two losses made by `make_loss`
earlier.
""")

md("""
## 12 · Randomness under `vmap`

What should `torch.rand(3)` mean inside `vmap`? One draw for the whole batch, or one per
example? torch.func makes you say it, with `randomness=`: `'error'` (the default) refuses
random calls, `'different'` gives each example its own numbers, `'same'` shares one draw.
Dropout is random too, so a per-sample loss with dropout in training mode needs the flag.
With the same seed, minifunctorch draws exactly the numbers torch.func draws:
""")

code("""
def noisy(x):
    return x + torch.rand(3)

xs3 = torch.zeros(4, 3)
for mode in ("different", "same"):
    torch.manual_seed(1)
    ours = vmap(noisy, randomness=mode)(xs3)
    torch.manual_seed(1)
    torch.testing.assert_close(ours, torch.func.vmap(noisy, randomness=mode)(xs3))
    rows_differ = not torch.equal(ours[0], ours[1])
    print(f"{mode:9}: rows differ: {rows_differ}")
""")

md("""
And the default refuses, naming the call and the fix. This cell fails on purpose; the
extension loaded in the first cell (`%load_ext minifunctorch.magics`) keeps an engine error to
your line and its message:
""")

cells.append(("raises", """
vmap(noisy)(xs3)
"""))

md("""
## 13 · Your own derivative: `torch.autograd.Function`

PyTorch's way to give an operation a hand-written derivative is a `torch.autograd.Function`.
For the transforms it needs `forward` without `ctx`, a `setup_context` that saves what the
backward needs, and `backward` (and `jvp` for forward mode, and `generate_vmap_rule=True`
for `vmap`). Here a "straight-through" rounding: the forward rounds, the backward lets the
gradient through unchanged. Every transform uses the rule, as in torch.func:
""")

code("""
class StraightThroughRound(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output

    @staticmethod
    def jvp(ctx, x_dot):
        return x_dot

def rounded_loss(x):
    return (StraightThroughRound.apply(x) * x).sum()

x3 = torch.tensor([0.4, 1.6, -2.3])
for transform in ("grad", "jacrev", "jacfwd"):
    ours = getattr(minifunctorch.core, transform)(rounded_loss)(x3)
    torch.testing.assert_close(ours, getattr(torch.func, transform)(rounded_loss)(x3))
per_sample = vmap(grad(rounded_loss))(torch.stack([x3, 2 * x3]))
torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(rounded_loss))(torch.stack([x3, 2 * x3])))
grad(rounded_loss)(x3)  # round(x) + x: the rounding counts as the identity in the backward
""")

md("""
## Summary

| transform | what it computes | built from |
|---|---|---|
| `grad(f)` | the gradient of a scalar `f` | reverse mode |
| `vmap(f, in_dims)` | `f` on every example of a batch, without a loop | batching |
| `vjp(f, x)` | `f(x)` and a function `v -> vᵀJ` | reverse mode |
| `jvp(f, (x,), (t,))` | `f(x)` and `J·t` | forward mode |
| `jacrev(f)`, `jacfwd(f)` | the full Jacobian | `vmap` of `vjp`, `vmap` of `jvp` |
| `hessian(f)` | the matrix of second derivatives | `jacfwd(jacrev(f))` |
| `vmap(f, randomness=...)` | random calls: refused, per example, or shared | batching |
| `torch.autograd.Function` | your own derivative, honoured by every transform | its `backward`, `jvp`, `vmap` |

Each one returns an ordinary function, so they stack: `grad(grad(f))`, `vmap(grad(loss))`,
`vmap(jacrev(f))`. And each matches its `torch.func` namesake, which every cell above checked.
""")

md("""
## Exercise · Per-sample gradient norms

Differentially private training clips each example's gradient to a maximum norm before
averaging. For that it needs, for every example `i`, the norm of its gradient taken over *all*
parameters at once: the square root of the sum, over every parameter tensor, of the sum of
squares of example `i`'s gradient.

**Your task:** complete `per_sample_grad_norms(params, xs, targets)` so that it returns a
tensor of shape `(6,)`, one norm per example, computed with minifunctorch's `vmap` and `grad`
and the one-example `loss` from above.

The reference, `norms_by_loop`, computes the same numbers the way plain PyTorch must: one
backward pass per example, in a Python loop. The check cell compares the two with
`check_against`; until your function is written it says FAIL, with a hint.
""")

code("""
def norms_by_loop(params, xs, targets):
    \"\"\"The reference: one torch.autograd backward pass per example.\"\"\"
    norms = []
    for x, target in zip(xs, targets):
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        grads = torch.autograd.grad(torch_loss(leaves, x, target), list(leaves.values()))
        norms.append(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    return torch.stack(norms)
""")

code("""
def per_sample_grad_norms(params, xs, targets):
    # Your code here: the per-sample gradients with vmap(grad(loss), in_dims=...),
    # then one norm per example, over all the parameters together.
    raise NotImplementedError("per_sample_grad_norms is not written yet")
""")

code("""
check_against(per_sample_grad_norms, norms_by_loop, params, xs, targets,
              what="per-sample gradient norms",
              hint="vmap(grad(loss), in_dims=(None, 0, 0)) gives a dict of gradients of shape "
                   "(6, ...); flatten each to (6, -1), sum its squares over dim 1, add those "
                   "over the parameters, and take the square root.")
""")

md(SOLUTION_HEADING)

solution_md("""
`vmap(grad(loss))` gives one gradient per example for each parameter. Flattening each to
`(6, -1)` puts every example's numbers in one row, so summing the squares along dim 1 and then
across the parameters gives each example's squared norm. No loop over examples: the batch
dimension is carried through by `vmap`.
""")

solution("""
def per_sample_grad_norms(params, xs, targets):
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, targets)
    squared = sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values())
    return squared.sqrt()
""")

code("""
check_against(per_sample_grad_norms, norms_by_loop, params, xs, targets,
              what="per-sample gradient norms",
              hint="vmap(grad(loss), in_dims=(None, 0, 0)) gives a dict of gradients of shape "
                   "(6, ...); flatten each to (6, -1), sum its squares over dim 1, add those "
                   "over the parameters, and take the square root.")
""")

build(cells, "08_whirlwind.ipynb", "ch08")
