"""Generate notebooks/07_learning.ipynb (Chapter 7 · Learning with the transforms)."""
from nbcells import SOLUTION_HEADING, build

cells = []
md = lambda s: cells.append(("md", s))
code = lambda s: cells.append(("code", s))
solution = lambda s: cells.append(("solution", s))
solution_md = lambda s: cells.append(("solution-md", s))
trained = lambda s: cells.append(("trained", s))  # prints the outcome of a long training run

md("""
# Chapter 7 · Learning with the transforms

The chapters so far checked numbers against `torch.func`. This one trains models with the
transforms, and watches them learn. Every gradient below comes from minifunctorch
(`minifunctorch.core` and the magics); `torch.func` only appears in the cells that check it.

1. A small MLP learns to separate two moons, trained *functionally*: its parameters are a dict,
   `grad` differentiates the loss with respect to that dict, and the update is one line. One
   training step is opened in the tape stepper.
2. Per-sample gradients, `%%vmap` over `%%grad`, are what differentially private training
   (DP-SGD) needs: each example's gradient is clipped, noise is added, and the model still
   learns.
3. Eight copies of the model train at once, in one call: `vmap` over their stacked parameters.
   Where they disagree, the ensemble is unsure.
4. MAML learns an initialization that adapts to a new sine wave in a few gradient steps:
   `grad` inside `vmap` over tasks, inside `grad`.

Every part starts from its own `torch.manual_seed`, so the chapter gives the same numbers each
time it runs, and every number it claims is checked by an `assert` in a cell. It ends with an
exercise that combines parts 2 and 3.
""")

code("""
%load_ext minifunctorch.magics
%matplotlib inline

import math

import matplotlib.pyplot as plt
import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F
from IPython.display import display

from minifunctorch.core import functional_call, grad, grad_and_value, stack_module_state, vmap
from minifunctorch.core.checks import check_against

torch.set_num_threads(1)   # one thread: the same numbers on every run
torch.set_printoptions(precision=4)
""")

md("""
## 1 · Two moons and a small MLP

The data is made here, with no download: two interleaving half circles, "two moons", with a
little noise, 100 points each. `x` holds the 200 points (two coordinates each) and `y` their
class, 0 or 1.

The model is an ordinary `nn.Module`: two hidden layers of 16 `tanh` units and two output
logits. Its parameter names (`hidden1.weight`, ...) come from its attributes, and they will be
the keys of our parameter dict.
""")

code("""
def two_moons(n, noise=0.1):
    half = n // 2
    angle = torch.rand(n) * math.pi
    upper = torch.stack([torch.cos(angle[:half]), torch.sin(angle[:half])], dim=1)
    lower = torch.stack([1 - torch.cos(angle[half:]), 0.5 - torch.sin(angle[half:])], dim=1)
    points = torch.cat([upper, lower]) + noise * torch.randn(n, 2)
    classes = torch.cat([torch.zeros(half), torch.ones(n - half)]).long()
    return points, classes


class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.hidden1 = nn.Linear(2, width)
        self.hidden2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 2)

    def forward(self, x):
        h = torch.tanh(self.hidden1(x))
        h = torch.tanh(self.hidden2(h))
        return self.out(h)


torch.manual_seed(0)
x, y = two_moons(200)
model = MLP()
model.requires_grad_(False)   # the transforms compute the gradients, not .backward()
initial = {name: p.clone() for name, p in model.named_parameters()}
{name: tuple(p.shape) for name, p in initial.items()}
""")

md("""
## 2 · Functional training: `grad` over a parameter dict

`functional_call(model, params, (x,))` runs the module with the tensors of the dict `params`
in place of its own parameters, so the loss is a plain function of `params`, and `grad` can
differentiate it. `grad_and_value` returns the gradient, a dict with the same keys, together
with the loss. The update is written out: each parameter takes a step against its gradient.

While it trains, the figure below is redrawn in place every 60 steps: the loss so far on the
left, and on the right the points with the model's decision boundary (the background is the
predicted probability of class 1). The last drawing is the final picture.
""")

code("""
def loss_fn(params, x, y):
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def accuracy(params, x, y):
    return (functional_call(model, params, (x,)).argmax(dim=1) == y).float().mean().item()


grid = torch.stack(torch.meshgrid(torch.linspace(-2.5, 3.5, 80), torch.linspace(-2, 2.5, 60),
                                  indexing="xy"), dim=-1)            # 60 x 80 points of the plane


def draw_boundary(ax, params, title, points=x, classes=y):
    probability = functional_call(model, params, (grid,)).softmax(dim=-1)[..., 1]
    ax.contourf(grid[..., 0], grid[..., 1], probability, levels=20, cmap="RdBu", alpha=0.6,
                vmin=0, vmax=1)
    ax.contour(grid[..., 0], grid[..., 1], probability, levels=[0.5], colors="k", linewidths=1)
    ax.scatter(points[:, 0], points[:, 1], c=classes, cmap="RdBu", edgecolors="k", s=12)
    ax.set_title(title)
    ax.set_xticks([]); ax.set_yticks([])
""")

code("""
loss_and_grads = grad_and_value(loss_fn)
params = dict(initial)
lr, steps = 0.3, 300
losses = []

fig, (ax_loss, ax_model) = plt.subplots(1, 2, figsize=(9, 3.5))
handle = display(fig, display_id=True)
for step in range(steps + 1):
    grads, batch_loss = loss_and_grads(params, x, y)
    params = {name: p - lr * grads[name] for name, p in params.items()}   # the update
    losses.append(batch_loss.item())
    if step % 60 == 0:
        ax_loss.clear(); ax_model.clear()
        ax_loss.plot(losses); ax_loss.set_xlim(0, steps); ax_loss.set_ylim(0, 0.8)
        ax_loss.set_xlabel("step"); ax_loss.set_title("training loss")
        draw_boundary(ax_model, params, f"step {step}")
        handle.update(fig)
plt.close(fig)

trained = params
train_accuracy = accuracy(trained, x, y)
assert train_accuracy >= 0.95, train_accuracy
assert losses[-1] < 0.1 < 0.5 < losses[0], (losses[0], losses[-1])
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, train accuracy {train_accuracy:.1%}")
""")

code("""
# the same gradient from torch.func, at the trained parameters
torch_loss_fn = lambda params, x, y: F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
torch.testing.assert_close(grad(loss_fn)(trained, x, y), torch.func.grad(torch_loss_fn)(trained, x, y))
""")

md("""
## 3 · One training step on the tape

What did `grad` do in each of those steps? `%%grad --tape` records one and opens the tape
stepper on it. The step below is a real one: the trained model on four of the points.

`%%grad` names a tensor input by its notebook name, and the tensors of a dict input by their
keys: here the parameter names, `hidden1.weight` to `out.bias`. The cell's own variables,
`logits` and `loss`, name their values too, and `batch` is read from the notebook. `--quiet`
binds the gradient, `dtrained`, without printing its 354 numbers.
""")

code("""
batch, batch_classes = x[[0, 50, 100, 150]], y[[0, 50, 100, 150]]
""")

trained("""
%%grad --wrt trained --tape --quiet --value
logits = functional_call(model, trained, (batch,))
loss = F.cross_entropy(logits, batch_classes)
loss
""")

md("""
Step through it from the seed: the backward pass walks the 7 entries from the cross-entropy's
`nll_loss` (one entry: torch's kernel, whose backward is torch's `nll_loss_backward` kernel)
back through `log_softmax` and the three `linear` layers, and each layer's entry sends
contributions to its `weight` and `bias`, which then appear by name in the gradient map. The gradient dict `dtrained` is what `grad` returned in the training loop,
and the update uses it the same way:
""")

code("""
stepped = {name: p - lr * dtrained[name] for name, p in trained.items()}
loss_after = loss_fn(stepped, batch, batch_classes)
torch.testing.assert_close(dtrained, torch.func.grad(torch_loss_fn)(trained, batch, batch_classes))
assert sum(g.numel() for g in dtrained.values()) == 354
assert loss_after < value, (loss_after, value)
print(f"loss on the batch: {value.item():.4f} before the step, {loss_after.item():.4f} after")
""")

md("""
## 4 · Per-sample gradients: `%%vmap` over `%%grad`

`grad` above gave the gradient of the *mean* loss over the batch. Differentially private
SGD (DP-SGD) needs one gradient per example, so that no single example can move the model by
more than a fixed amount. Chapter 0 showed the recipe: a cell that is the loss of **one**
example, `%%grad` of it with respect to the parameters, and `%%vmap` of that over the
examples. Inside the cell `x` is one point and `y` its class; the model wants a batch, so the
point goes in as a batch of one.
""")

code("""
%%vmap --over x y --quiet
%%grad --wrt params
F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))
""")

md("""
`params` holds the trained parameters, and `dparams` one gradient per point: every entry
gained a leading dimension of 200. The same stack, written as functions, is
`vmap(grad(one_loss), in_dims=(None, 0, 0))`; both agree with `torch.func`, and their mean is
the batch gradient:
""")

code("""
def one_loss(params, point, target):
    return F.cross_entropy(functional_call(model, params, (point.unsqueeze(0),)), target.unsqueeze(0))


def torch_one_loss(params, point, target):
    logits = torch.func.functional_call(model, params, (point.unsqueeze(0),))
    return F.cross_entropy(logits, target.unsqueeze(0))


per_sample_grads = vmap(grad(one_loss), in_dims=(None, 0, 0))
expected = torch.func.vmap(torch.func.grad(torch_one_loss), in_dims=(None, 0, 0))(trained, x, y)
torch.testing.assert_close(dparams, expected)
torch.testing.assert_close(per_sample_grads(trained, x, y), expected)
torch.testing.assert_close({k: g.mean(0) for k, g in dparams.items()}, grad(loss_fn)(trained, x, y))
{name: tuple(g.shape) for name, g in dparams.items()}
""")

md("""
The norm of each point's gradient, over all parameters together, says how hard that point
pulls on the model. At the start of training every point pulls about as hard; once the model
has learned, most points barely pull, and the few near the boundary pull much harder. An
average gradient is dominated by them, and that is what DP-SGD must bound.
""")

code("""
def grad_norms(per_sample):
    return sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()).sqrt()


norms_initial = grad_norms(per_sample_grads(initial, x, y))
norms_trained = grad_norms(dparams)

fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
for ax, norms, title in zip(axes, (norms_initial, norms_trained), ("initial model", "trained model")):
    ax.hist(norms, bins=30)
    ax.set_title(f"per-sample gradient norms, {title}"); ax.set_xlabel("norm")
plt.show()
assert norms_trained.median() < 0.1 * norms_initial.median()
print(f"median norm {norms_initial.median():.3f} initially, {norms_trained.median():.4f} trained; "
      f"largest {norms_initial.max():.3f} and {norms_trained.max():.3f}")
""")

md("""
## 5 · DP-SGD: clip each gradient, add noise, train again

One step of DP-SGD, written out:

1. the per-sample gradients, from the stack above;
2. each one is scaled down to norm at most `max_norm` (**clipped**); a point's influence on
   the step is now bounded;
3. the clipped gradients are summed, Gaussian noise of standard deviation
   `noise_multiplier * max_norm` is added to each parameter's sum, and the result divided by
   the number of points.

We start from the same initial parameters as in section 2. (A real DP-SGD run also samples a
random batch each step and accounts for the privacy spent; here the whole set is the batch.)
""")

code("""
def private_step(params, x, y, lr=0.5, max_norm=1.0, noise_multiplier=0.5):
    per_sample = per_sample_grads(params, x, y)
    scale = (max_norm / (grad_norms(per_sample) + 1e-6)).clamp(max=1.0)   # one factor per point
    new = {}
    for name, p in params.items():
        clipped = per_sample[name] * scale.view(-1, *[1] * p.dim())
        noisy = clipped.sum(0) + noise_multiplier * max_norm * torch.randn_like(p)
        new[name] = p - lr * noisy / len(x)
    return new


torch.manual_seed(1)
private = dict(initial)
for step in range(300):
    private = private_step(private, x, y)

private_accuracy = accuracy(private, x, y)
assert private_accuracy >= 0.85, private_accuracy
print(f"train accuracy: {train_accuracy:.1%} with plain training, {private_accuracy:.1%} with DP-SGD")
""")

code("""
fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
draw_boundary(axes[0], trained, f"plain training: {train_accuracy:.1%}")
draw_boundary(axes[1], private, f"DP-SGD: {private_accuracy:.1%}")
plt.show()
""")

md("""
The private model separates the bulk of the two moons with a smoother boundary, but misses
where their tips interleave. The points there are few, and they are the ones whose gradients
stay large once the rest are learned: clipping cuts their pull down to that of any other
point, and the noise drowns much of what is left. That is the price of bounding each
example's influence.

## 6 · An ensemble in one call: `vmap` over stacked parameters

Eight models with different random initializations, trained on the same data, agree where
there is data and may disagree elsewhere. `stack_module_state` stacks their parameters into
one dict whose tensors have a leading dimension of 8. `vmap` over that dimension, and not over
the data (`in_dims=(0, None, None)`), computes all eight gradients and losses in one call, and
the update is the same line as before.
""")

code("""
torch.manual_seed(2)
members = 8
stacked, buffers = stack_module_state([MLP() for _ in range(members)])
stacked = {name: p.detach() for name, p in stacked.items()}

ensemble_lr = 1.0   # larger steps than in section 2: every member ends up sure of the data
ensemble_step = vmap(grad_and_value(loss_fn), in_dims=(0, None, None))
torch_step = torch.func.vmap(torch.func.grad_and_value(torch_loss_fn), in_dims=(0, None, None))
torch.testing.assert_close(ensemble_step(stacked, x, y), torch_step(stacked, x, y))  # first step

for step in range(300):
    grads, ensemble_losses = ensemble_step(stacked, x, y)
    stacked = {name: p - ensemble_lr * grads[name] for name, p in stacked.items()}

predict = vmap(lambda params, points: functional_call(model, params, (points,)), in_dims=(0, None))
member_accuracy = (predict(stacked, x).argmax(dim=-1) == y).float().mean(dim=1)
assert (member_accuracy >= 0.95).all(), member_accuracy
print("member accuracy:", ", ".join(f"{a:.1%}" for a in member_accuracy.tolist()))
{name: tuple(p.shape) for name, p in stacked.items()}
""")

code("""
fig, axes = plt.subplots(2, 4, figsize=(11, 4.5))
for m, ax in enumerate(axes.flat):
    draw_boundary(ax, {name: p[m] for name, p in stacked.items()}, f"member {m}")
plt.show()
""")

md("""
The boundaries agree between the moons and fan out beyond their tips, where each member
extrapolates in its own way. The spread (standard
deviation) of the eight predicted probabilities measures that disagreement. We compare it on
the training points with the same over the points of the plot that lie farther than 0.5 from
every training point, *off the data*: its mean, and its largest value.
""")

code("""
grid_probability = predict(stacked, grid).softmax(dim=-1)[..., 1]   # (8, 60, 80)
spread = grid_probability.std(dim=0)
on_data = predict(stacked, x).softmax(dim=-1)[..., 1].std(dim=0)
far = torch.cdist(grid.reshape(-1, 2), x).min(dim=1).values.reshape(60, 80) > 0.5
off_data = spread[far]

fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
axes[0].contourf(grid[..., 0], grid[..., 1], grid_probability.mean(0), levels=20, cmap="RdBu", alpha=0.6)
axes[0].scatter(x[:, 0], x[:, 1], c=y, cmap="RdBu", edgecolors="k", s=12)
axes[0].set_title("ensemble mean")
image = axes[1].contourf(grid[..., 0], grid[..., 1], spread, levels=20, cmap="magma")
axes[1].scatter(x[:, 0], x[:, 1], c="w", s=4)
axes[1].set_title("disagreement (std of the 8 members)")
fig.colorbar(image, ax=axes[1])
plt.show()
assert off_data.mean() > 5 * on_data.mean() and off_data.max() > 5 * on_data.max()
print(f"spread on the training points: mean {on_data.mean():.4f}, largest {on_data.max():.3f}")
print(f"spread off the data:           mean {off_data.mean():.4f}, largest {off_data.max():.3f}")
""")

md("""
## 7 · MAML on sine waves

Each *task* is a sine wave `a · sin(t + b)`, with an amplitude `a` between 0.1 and 5 and a
phase `b` between 0 and π. A task gives 10 points to adapt on (its *support* set) and 10 more to
judge the adaptation (its *query* set). MAML (model-agnostic meta-learning) looks for
parameters from which **one** gradient step on a task's support set gives a low loss on its
query set.

That is three transforms deep:

- `adapted_loss`: `grad` of the support loss, one step of gradient descent, then the query
  loss of the adapted parameters;
- `vmap` of it over a batch of tasks (the parameters are shared, `in_dims=None`);
- `grad` of the mean over tasks, with respect to the starting parameters. It differentiates
  *through* the inner gradient step: a second derivative.

The meta-update is Adam, written out.
""")

code("""
torch.manual_seed(3)
sine_model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
sine_model.requires_grad_(False)
meta_params = {name: p.clone() for name, p in sine_model.named_parameters()}
inner_lr = 0.01


def sample_tasks(n_tasks, shots=10):
    amplitude = torch.rand(n_tasks, 1, 1) * 4.9 + 0.1
    phase = torch.rand(n_tasks, 1, 1) * math.pi
    t = torch.rand(n_tasks, 2 * shots, 1) * 10 - 5
    wave = amplitude * torch.sin(t + phase)
    return t[:, :shots], wave[:, :shots], t[:, shots:], wave[:, shots:]


def mse(params, t, target, call=functional_call):
    return F.mse_loss(call(sine_model, params, (t,)), target)


def adapted_loss(params, t_support, y_support, t_query, y_query):
    g = grad(mse)(params, t_support, y_support)
    adapted = {name: p - inner_lr * g[name] for name, p in params.items()}
    return mse(adapted, t_query, y_query)


def meta_loss(params, *tasks):
    return vmap(adapted_loss, in_dims=(None, 0, 0, 0, 0))(params, *tasks).mean()
""")

code("""
# the meta-gradient, second derivatives included, against torch.func
def torch_adapted_loss(params, t_support, y_support, t_query, y_query):
    call = torch.func.functional_call
    g = torch.func.grad(mse)(params, t_support, y_support, call)
    return mse({name: p - inner_lr * g[name] for name, p in params.items()}, t_query, y_query, call)


tasks = sample_tasks(4)
expected = torch.func.grad(
    lambda p, *tasks: torch.func.vmap(torch_adapted_loss, in_dims=(None, 0, 0, 0, 0))(p, *tasks).mean()
)(meta_params, *tasks)
torch.testing.assert_close(grad(meta_loss)(meta_params, *tasks), expected)
""")

trained("""
meta_step = grad_and_value(meta_loss)
moment = {name: torch.zeros_like(p) for name, p in meta_params.items()}
square = {name: torch.zeros_like(p) for name, p in meta_params.items()}
meta_lr, beta1, beta2 = 1e-3, 0.9, 0.999
meta_losses = []
for step in range(1, 1501):
    g, loss = meta_step(meta_params, *sample_tasks(16))
    meta_losses.append(loss.item())
    for name, p in meta_params.items():
        moment[name] = beta1 * moment[name] + (1 - beta1) * g[name]
        square[name] = beta2 * square[name] + (1 - beta2) * g[name] ** 2
        step_size = meta_lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        meta_params[name] = p - step_size * moment[name] / (square[name].sqrt() + 1e-8)

early, late = sum(meta_losses[:100]) / 100, sum(meta_losses[-100:]) / 100
assert late < 0.5 * early, (early, late)
print(f"mean loss after adaptation over 100 meta-steps: {early:.2f} at the start, {late:.2f} at the end")
""")

md("""
Now a new wave, amplitude 3.5 and phase 2.5, that meta-training never saw. We give it 10
points, spread over the interval, and take 10 plain gradient steps from the meta-learned
parameters with the inner learning rate, measuring the loss on 100 points of the true curve
after each.
""")

trained("""
torch.manual_seed(4)
t_new = (torch.linspace(-4.5, 4.5, 10) + 0.3 * torch.randn(10)).unsqueeze(1)   # spread out
wave = lambda t: 3.5 * torch.sin(t + 2.5)
y_new = wave(t_new)
t_curve = torch.linspace(-5, 5, 100).unsqueeze(1)

adapted, curve_losses, fits = dict(meta_params), [], {}
for k in range(11):
    curve_losses.append(mse(adapted, t_curve, wave(t_curve)).item())
    if k in (0, 1, 10):
        fits[k] = functional_call(sine_model, adapted, (t_curve,))
    g = grad(mse)(adapted, t_new, y_new)
    adapted = {name: p - inner_lr * g[name] for name, p in adapted.items()}

fig, (ax_fit, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.5))
ax_fit.plot(t_curve, wave(t_curve), "k", label="true curve")
for k, style in zip(fits, (":", "--", "-")):
    ax_fit.plot(t_curve, fits[k], style, label=f"after {k} step{'s' * (k != 1)}" if k else "before adaptation")
ax_fit.scatter(t_new, y_new, c="k", marker="^", label="the 10 points given")
ax_fit.legend(fontsize=8); ax_fit.set_title("a new sine wave")
ax_loss.plot(curve_losses, "o-"); ax_loss.set_xlabel("gradient steps"); ax_loss.set_title("loss on the curve")
plt.show()
assert curve_losses[10] < 0.2 * curve_losses[0], curve_losses
print(f"loss on the curve: {curve_losses[0]:.2f} before adaptation, {curve_losses[1]:.2f} after one step, "
      f"{curve_losses[10]:.2f} after ten")
""")

md("""
Before adaptation the meta-learned model draws a wave of its own, of small amplitude. One
gradient step on the 10 points takes it most of the way to this wave's amplitude and phase,
and the next nine refine it.
Chained this way, the transforms give MAML in about ten lines: the inner `grad`, the `vmap`
over tasks and the outer `grad` are the same functions as in every earlier part.

## Summary

| part | transforms | what it gave |
|---|---|---|
| functional training | `grad_and_value(loss)` over a parameter dict, `functional_call` | an MLP on two moons, and one step on the tape |
| DP-SGD | `%%vmap` over `%%grad`, i.e. `vmap(grad(one_loss), in_dims=(None, 0, 0))` | per-sample gradients to clip and noise |
| ensemble | `vmap(grad_and_value(loss), in_dims=(0, None, None))` on `stack_module_state` | eight models in one call, and their disagreement |
| MAML | `grad(vmap(adapted_loss))`, with `grad` inside `adapted_loss` | an initialization that adapts in a few steps |

`in_dims` says what each `vmap` maps over: the examples (per-sample gradients), the models
(the ensemble), or the tasks (MAML). The parameters are always a plain dict, so the update is
a line of Python wherever it is.
""")

md("""
## Exercise · Per-sample gradient norms for every member of the ensemble

Which training points does each member of the ensemble still find hard? Combine sections 4
and 6:
for each of the 8 members and each point, the norm of that point's gradient at that member's
parameters. That is two `vmap`s, one over the members and one over the points, around one
`grad`.

**Your task:** complete `member_grad_norms(stacked, points, targets)` so that it returns a tensor
of shape `(8, n)`, row `m` holding the per-sample gradient norms of member `m`, computed with
minifunctorch's `vmap` and `grad` and the one-example loss `one_loss` of section 4 (`grad_norms`
may help).

The reference, `norms_by_loop`, gets the same numbers the way plain PyTorch must: one backward
pass per member and per point. The check compares the two on 8 of the points with
`check_against`; until your function is written it says FAIL, with a hint.
""")

code("""
def norms_by_loop(stacked, points, targets):
    \"\"\"The reference: one torch.autograd backward pass per member and per point.\"\"\"
    rows = []
    for m in range(len(next(iter(stacked.values())))):
        leaves = {name: p[m].detach().requires_grad_() for name, p in stacked.items()}
        row = []
        for point, target in zip(points, targets):
            grads = torch.autograd.grad(torch_one_loss(leaves, point, target), list(leaves.values()))
            row.append(torch.sqrt(sum((g ** 2).sum() for g in grads)))
        rows.append(torch.stack(row))
    return torch.stack(rows)


some_points, some_targets = x[::25], y[::25]
hint = ("vmap(grad(one_loss), in_dims=(None, 0, 0)) maps over the points for one member; wrap "
        "it in vmap(..., in_dims=(0, None, None)) to map over the members, then apply "
        "grad_norms inside the outer vmap (or flatten each gradient to (8, n, -1)).")
""")

code("""
def member_grad_norms(stacked, points, targets):
    # Your code here: a vmap over the members of a vmap over the points of grad(one_loss),
    # then one norm per member and point.
    raise NotImplementedError("member_grad_norms is not written yet")
""")

code("""
check_against(member_grad_norms, norms_by_loop, stacked, some_points, some_targets,
              what="per-sample gradient norms of every member", hint=hint)
""")

md(SOLUTION_HEADING)

solution_md("""
For one member, `vmap(grad(one_loss), in_dims=(None, 0, 0))` gives the per-sample gradients
and `grad_norms` their norms, a vector of `n`. Wrapping that function of one member's
parameters in a `vmap` over the stacked dict, `in_dims=(0, None, None)`, runs it for all eight
members at once: the result gains the leading dimension 8.
""")

solution("""
def member_grad_norms(stacked, points, targets):
    def norms_of_one_member(params, points, targets):
        return grad_norms(vmap(grad(one_loss), in_dims=(None, 0, 0))(params, points, targets))
    return vmap(norms_of_one_member, in_dims=(0, None, None))(stacked, points, targets)
""")

code("""
check_against(member_grad_norms, norms_by_loop, stacked, some_points, some_targets,
              what="per-sample gradient norms of every member", hint=hint)
""")

build(cells, "07_learning.ipynb", "ch07")
