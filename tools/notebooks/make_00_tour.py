"""Generate notebooks/00_tour.ipynb (Chapter 0 · minifunctorch in ten minutes)."""
from nbcells import code as code_cell, md as md_cell, write

cells = []


def md(text):
    cells.append(md_cell(text))


def code(text, tags=None):
    cells.append(code_cell(text, tags))


md(r"""
# Chapter 0 · minifunctorch in ten minutes

**minifunctorch** is a small engine of *function transforms* over PyTorch. Hand it a Python
function and it hands back another one: the gradient, the Jacobian, the same function run on a
whole batch, or the program the function computes. Its API is torch.func's, and it is made to
be read: each transform is one level in a stack of interpreters, and the chapters take that
stack apart piece by piece ([1 · dispatchers](01_dispatchers.ipynb), [2 · levels](02_levels.ipynb),
[3 · interpreters](03_interpreters.ipynb), [4 · programs](04_programs.ipynb),
[5 · source to source](05_source_to_source.ipynb),
[6 · differentiators](06_differentiators.ipynb), [7 · learning](07_learning.ipynb),
[8 · whirlwind](08_whirlwind.ipynb)).

This tour only drives it. Each transform is one *magic* line on top of an ordinary cell, and
after each result a plain cell checks the numbers against `torch.func`.

## 1 · Set-up: the magics and some data

`%load_ext minifunctorch.magics` registers the cell magics `%%grad`, `%%vmap`, `%%jvp`,
`%%jacobian`, `%%hessian` and `%%trace`, and the line magic `%tape`. Add a `?` to any of them
(`%%grad?`) to list its flags. A cell magic is the **first line of its cell**: a comment or a
blank line may sit above it, code may not (the magic then says so).

The running example is a least-squares fit: five examples `x` of three features each, their
targets `y`, and weights `w`. `mse` is the same loss written as a plain function, for the
`torch.func` checks; `t` waits for `%%jvp`, further down.
""")
code(r"""
%load_ext minifunctorch.magics

import torch
import torch.func

torch.manual_seed(0)
torch.set_printoptions(precision=4)

x = torch.randn(5, 3)
y = torch.randn(5)
w = torch.randn(3)
t = torch.tensor([0.0, 1.0, 0.0])


def mse(w, x, y):
    return ((x @ w - y) ** 2).mean()
""")

md(r"""
## 2 · `%%grad`: a cell becomes a function, and you get its gradient

With `%%grad --wrt x w` on top, the cell becomes the body of a function of `x` and `w`, and its
last expression, a scalar, is what gets differentiated. Every other name (here `y`) is read
from the notebook and held constant. The gradients are bound in the notebook as `dx` and `dw`,
and shown.
""")
code(r"""
%%grad --wrt x w
((x @ w - y) ** 2).mean()
""")
code(r"""
ref_dw, ref_dx = torch.func.grad(mse, argnums=(0, 1))(w, x, y)
torch.testing.assert_close(dx, ref_dx)
torch.testing.assert_close(dw, ref_dw)
""")

md(r"""
Two flags you will reach for often: `--value` binds the cell's value too (as `value`), and
`--check` runs the same cell again with `torch.func` and prints the largest difference for
each result.
""")
code(r"""
%%grad --wrt w --value --check
((x @ w - y) ** 2).mean()
""")
code(r"""
torch.testing.assert_close(value, mse(w, x, y))
torch.testing.assert_close(dw, ref_dw)
""")

md(r"""
## 3 · `%%vmap`: write it for one example, run it on the batch

With `%%vmap --over x y` on top, `x` and `y` stand for **one** example inside the cell: a row
of three features and its target. The results come back stacked along a new first dimension,
bound as `out`. `w` is not listed, so all the examples share it. Here, the residual of each
example:
""")
code(r"""
%%vmap --over x y
x @ w - y
""")
code(r"""
torch.testing.assert_close(out, torch.func.vmap(lambda x, y: x @ w - y)(x, y))
""")

md(r"""
## 4 · Stacking magics: per-sample gradients

Magics stacked at the top of a cell compose like nested calls, the first line outermost. Below,
the cell is the loss of a single example, `%%grad` differentiates it with respect to `w`, and
`%%vmap` runs that over the batch. The result is a gradient **per example**, which
`loss.backward()` cannot give you: `dw` now has shape `(5, 3)`.
""")
code(r"""
%%vmap --over x y
%%grad --wrt w
((x @ w - y) ** 2).mean()
""")
code(r"""
per_sample = torch.func.vmap(torch.func.grad(mse), in_dims=(None, 0, 0))(w, x, y)
torch.testing.assert_close(dw, per_sample)
torch.testing.assert_close(dw.mean(dim=0), ref_dw)  # averaged, they give the batch gradient
""")

md(r"""
## 5 · `%%jacobian` and `%%hessian`

For a vector output, `%%jacobian` gives the whole matrix of partial derivatives, bound as
`jac_w`, of shape `(*output shape, *w.shape)`, here `(5, 3)`. `--mode rev` (the default) uses
reverse mode, which produces it row by row; `--mode fwd` uses forward mode, column by column,
and is the cheaper one when there are fewer inputs than outputs, as here. `--out` chooses
the name.

`%%hessian` gives the matrix of second derivatives of a scalar, bound as `hess_w`. For our
loss it is the constant matrix `2 xᵀx / 5`.
""")
code(r"""
%%jacobian --wrt w
torch.tanh(x @ w)
""")
code(r"""
%%jacobian --wrt w --mode fwd --out jac_w_fwd
torch.tanh(x @ w)
""")
code(r"""
f = lambda w: torch.tanh(x @ w)
torch.testing.assert_close(jac_w, torch.func.jacrev(f)(w))
torch.testing.assert_close(jac_w_fwd, torch.func.jacfwd(f)(w))
torch.testing.assert_close(jac_w, jac_w_fwd)
""")

code(r"""
%%hessian --wrt w
((x @ w - y) ** 2).mean()
""")
code(r"""
torch.testing.assert_close(hess_w, torch.func.hessian(mse)(w, x, y))
torch.testing.assert_close(hess_w, 2 * x.T @ x / 5)
""")

md(r"""
## 6 · `%%jvp`: one direction, one forward pass

`%%jvp --wrt w --tangent t` pushes the direction `t` through the function along with `w`. It
binds the output as `out` and the Jacobian times `t` as `out_dot`, without ever building the
Jacobian. Since `t` is the second unit vector, `out_dot` is the second column of `jac_w`.
""")
code(r"""
%%jvp --wrt w --tangent t
torch.tanh(x @ w)
""")
code(r"""
ref_out, ref_out_dot = torch.func.jvp(f, (w,), (t,))
torch.testing.assert_close(out, ref_out)
torch.testing.assert_close(out_dot, ref_out_dot)
torch.testing.assert_close(out_dot, jac_w[:, 1])
""")

md(r"""
## 7 · `%%trace`: the program behind a stack

Put `%%trace` on top of a stack and you get, instead of numbers, the program the stack runs.
Here it is the gradient of our loss. The first line lists the program's constants, then its
input after the `;`. They keep their notebook names: `x` and `y` are constants, read from the
notebook, and `w` is the input. The values the program computes are named `a`, `b`, ...: the
forward equations (`a` to `d`), the seed `e`, which is `dL/dL = 1`, and the backward
equations, down to the gradient `j`, a vector-matrix product with `x`. None of them works out
a contribution for `x` or `y`: those are constants, and the backward rules skip what nobody
asked for. `--fx` adds the same program as Python source (a `torch.fx` module).

`--split`, in the cell after, shows reverse mode as **two** programs. The forward one returns
the loss `d` and what the backward one will need: `b`, the residuals `x @ w - y`. The backward
one takes that saved value (its `a`) and the loss's cotangent (its `b`), and returns the
gradient. `--inputs w` names the program's input, since there is no magic below to list it.
""")
code(r"""
%%trace --fx
%%grad --wrt w
((x @ w - y) ** 2).mean()
""")

code(r"""
%%trace --split --inputs w
((x @ w - y) ** 2).mean()
""")

md(r"""
## 8 · The tape stepper

Reverse mode records a **tape** of the operations as they run, then walks it backwards. Add
`--tape` to `%%grad` and you can watch that walk. A tiny example keeps every step on screen:
""")
code(r"""
a = torch.tensor([1.0, 2.0])
b = torch.tensor([3.0, 4.0])
""")
code(r"""
%%grad --wrt a b --tape
s = a + b
loss = (s * b).sum()
loss
""")
code(r"""
ref_da, ref_db = torch.func.grad(lambda a, b: ((a + b) * b).sum(), argnums=(0, 1))(a, b)
torch.testing.assert_close(da, ref_da)
torch.testing.assert_close(db, ref_db)
torch.testing.assert_close(db, a + 2 * b)  # b is used twice: its two contributions add up
""")

md(r"""
**What you see when you step.** The tape has three entries, `s = add a b`, `v1 = mul s b`
and `loss = sum v1`. Values keep the names the notebook gave them: the inputs `a` and `b`, any
notebook tensor the cell reads, and the cell's own variables `s` and `loss`; a value that no
variable holds gets a made-up name (`v1`). The *first*, *back*, *step* and *last* buttons,
*play* and the slider move through the backward pass, and the legend above the tape says what
its marks mean.

- **Step 0 is the seed**: `dloss/dloss = 1`, the gradient of the loss with respect to itself,
  our `dL/dL = 1`.
- **Each later step handles one entry**, from the last one back to the first. That entry is
  highlighted in the list (▶), and the ones already handled are ticked (✓).
- Under the list, **incoming** is the cotangent that has reached the entry's output (the
  gradient of the loss with respect to it), and **contributions** are what the entry's
  backward rule sends to each of its inputs, e.g. `b += [4, 6]` at step 2.
- At the bottom, the **gradient map** holds every gradient found so far, with the entries it
  came from. A name used twice receives two contributions: `b` feeds both the `add` and the
  `mul`, so at step 3 it shows **fan-in**, `b ← entry 1 + entry 0`, and its gradient is the
  sum `[7, 10]`.

Without a running kernel (on GitHub, or in a saved file) the stepper appears as text: the tape
and its final gradient map. `%tape` reopens the stepper of the last `%%grad` cell at any time:
""")
code(r"""
%tape
""")

md(r"""
## 9 · When something is wrong

A mistake in a magic's flags is one line that names the magic as you wrote it and the fix:
`%%grad --wtr w` answers `unknown flag --wtr; did you mean --wrt?`. When the engine refuses
the cell itself, the error names the magic, says what went wrong and how to fix it, and points
at your line. The next cell fails on purpose: `%%grad` needs a scalar, and `x @ w - y` is one
residual per example.
""")
code(r"""
%%grad --wrt w
x @ w - y
""", tags=["raises-exception"])
md(r"""
The same short form applies to the engine's errors anywhere in a notebook that has loaded the
extension; `%xmode verbose` shows every frame instead, the engine's included.

## Where next

Each chapter opens up one part of what you just used:

1. [Dispatchers](01_dispatchers.ipynb): transforms as a stack of interpreter levels, tapes,
   second derivatives two ways, per-sample gradients.
2. [Levels](02_levels.ipynb): `custom_vjp`, values moving between levels, the tensors that
   let ordinary PyTorch code run under transforms, and nested derivatives kept apart.
3. [Interpreters](03_interpreters.ipynb): primitives and `bind`, the interpreter stack, `jvp`,
   `vmap`, `jacfwd`, and Python control flow.
4. [Programs](04_programs.ipynb): functions traced to programs, printed, typechecked,
   simplified by passes, and compiled by `jit` (what `%%trace` shows).
5. [Source to source](05_source_to_source.ipynb): reverse mode as a program transformation,
   and export to FX (what `--split` and `--fx` show).
6. [Differentiators](06_differentiators.ipynb): gradient formulas as closures over a saved
   context (where the stepper's contributions come from).
7. [Learning](07_learning.ipynb): the transforms at work, training real models: an MLP
   trained functionally, private training with per-sample gradients, an ensemble in one call,
   and MAML on sine waves.
8. [Whirlwind](08_whirlwind.ipynb): the torch.func-style API that the magics call, checked
   against `torch.func` in every cell.
""")

write(cells, "00_tour.ipynb")
