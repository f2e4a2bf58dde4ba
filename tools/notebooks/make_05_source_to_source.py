"""Generate notebooks/05_source_to_source.ipynb (Chapter 5 · source-to-source reverse mode)."""
from nbcells import SOLUTION_HEADING, code, md, solution, solution_md, write

cells = [
    md(r"""
    # Chapter 5 · Source-to-source reverse mode

    In Chapter 4, `trace(grad(f))` gave us the gradient of `f` as a program. This chapter
    turns that observation into a tool: `vjp_program` is reverse mode as a
    **program-to-program** transformation. It takes the program of `f` and returns the
    program of its vector-Jacobian product, forward pass and backward pass together, as one
    straight-line program that we can read, check, export to `torch.fx`, and hand to a
    compiler.

    A quick reminder of what a VJP is. If `f` maps an input `x` to an output `y`, and `v`
    is a tensor with the shape of `y` (a *cotangent*), the VJP is `vᵀ J`, where `J` is the
    Jacobian of `f` at `x`; it has the shape of `x`. Reverse mode computes it without ever
    forming `J`: the forward pass keeps the intermediate values it will need, and the
    backward pass visits the equations in reverse order. For each equation a rule turns the
    cotangent of its result into cotangents of its operands, and when a variable feeds
    several equations its contributions are added up. With `v = 1` and a scalar output, the
    VJP is the gradient.

    Contents:

    1. `vjp_program` on the smallest example;
    2. `sin(trace(x)) * x`, read line by line and checked against a hand derivation;
    3. `x.T @ x`;
    4. how `vjp_program` is built from the tape's own rules, plus passes;
    5. splitting forward and backward into two programs;
    6. export to `torch.fx`;
    7. shapes;
    8. a comparison with what `make_fx` records for `torch.func`.

    The exercise at the end adds a primitive and its VJP rule.
    """),
    code(r"""
    import math

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.shape_prop import ShapeProp
    from torch.testing import assert_close

    from minifunctorch.core import (Primitive, bind, simplify, split_vjp, trace, vjp,
                                    vjp_program, vjp_rules)
    from minifunctorch.core import ops
    from minifunctorch.core import primitives as P

    torch.manual_seed(0)
    torch.set_printoptions(precision=4)
    """),
    md(r"""
    ## 1 · The shape of a VJP program

    `vjp_program(program)` returns a program whose inputs are the inputs of `program`
    followed by one cotangent per output, and whose outputs are the outputs of `program`
    followed by one cotangent per input:

        (*inputs, *output_cotangents)  ->  (*outputs, *input_cotangents)

    The smallest example is the sine:
    """),
    code(r"""
    x4, v4 = torch.randn(4), torch.randn(4)

    sin_vjp = vjp_program(trace(torch.sin)(x4))
    print(sin_vjp)

    out, x_bar = sin_vjp(x4, v4)
    expected_out, pull_back = torch.func.vjp(torch.sin, x4)
    assert_close(out, expected_out)
    assert_close(x_bar, pull_back(v4)[0])
    """),
    md(r"""
    `a` is `x` and `b` is the cotangent `v`. `c` is the forward pass. The backward pass is
    `d` and `e`: the derivative of the sine, evaluated at the *saved* input `a`, times the
    incoming cotangent. Both the output `c` and the input cotangent `e` are returned.

    ## 2 · First showcase: `sin(trace(x)) * x`

    A function that mixes a reduction, a scalar function and broadcasting:
    """),
    code(r"""
    def foo(x):
        return torch.sin(torch.trace(x)) * x

    x, v = torch.randn(3, 3), torch.randn(3, 3)
    foo_program = trace(foo)(x)
    print(foo_program)
    """),
    md(r"""
    minifunctorch has no `trace` primitive: `torch.trace` is written with two primitives,
    `diagonal` and `sum`. Its derivative will therefore come out of the rules of those two,
    with nothing written specially for it.

    Before asking the program, let us derive the VJP by hand. Write `s = tr(X)` and
    `Y = sin(s) X`. `X` reaches `Y` by two paths:

    * directly, scaled by `sin(s)`: this contributes `sin(s) V`;
    * through `s`: the scalar `sin(s)` multiplies every element of `X`, so its cotangent
      is `Σᵢⱼ Vᵢⱼ Xᵢⱼ`; the sine turns that into `cos(s) Σᵢⱼ Vᵢⱼ Xᵢⱼ`; and since the
      trace only reads the diagonal, this scalar lands on the diagonal, times the identity.

    So `X̄ = sin(s) V + cos(s) (Σᵢⱼ Vᵢⱼ Xᵢⱼ) I`. Now the program:
    """),
    code(r"""
    foo_vjp = vjp_program(foo_program)
    print(foo_vjp)
    """),
    md(r"""
    The program *is* the derivation, one step per line:

    * `c` to `f` are the forward pass (`e` is `sin(s)`).
    * `g`, `h`: the cotangent of the scalar `e`. In `f = mul e a` the scalar was broadcast
      to `3×3`, so its cotangent is the product `b * a` summed back down to a scalar (the
      `mul` rule undoes broadcasting with `sum_to_size`).
    * `i`: the cotangent of `a` along the direct path, `V sin(s)`.
    * `j`, `k`: back through the sine.
    * `l`: back through the `sum`, which spreads the scalar over the 3 diagonal elements.
    * `m`: back through `diagonal`: a `3×3` matrix of zeros with `l` on its diagonal (the
      `... I` of the hand derivation).
    * `n`: `a` was used twice (by `diagonal` and by `mul`), so its two contributions are
      added.

    The numbers agree with `torch.func.vjp`, with `torch.autograd.functional.vjp`, and
    with the formula:
    """),
    code(r"""
    out, x_bar = foo_vjp(x, v)

    expected_out, pull_back = torch.func.vjp(foo, x)
    assert_close(out, expected_out)
    assert_close(x_bar, pull_back(v)[0])

    autograd_out, autograd_x_bar = torch.autograd.functional.vjp(foo, x, v)
    assert_close(out, autograd_out)
    assert_close(x_bar, autograd_x_bar)

    s = torch.trace(x)
    assert_close(x_bar, torch.sin(s) * v + torch.cos(s) * (v * x).sum() * torch.eye(3))
    print(x_bar)
    """),
    md(r"""
    ## 3 · Second showcase: `x.T @ x`

    For `Y = XᵀX` with `X` of shape `5×2`, the derivative is `dY = dXᵀ X + Xᵀ dX`, and
    pairing it with a cotangent `V` (a `2×2` matrix) gives `X̄ = X Vᵀ + X V`. The matmul
    rule produces exactly those two terms, one per operand, and the transpose rule carries
    the first one back through `x.T`:
    """),
    code(r"""
    def bar(x):
        return x.T @ x

    x52, v22 = torch.randn(5, 2), torch.randn(2, 2)
    bar_vjp = vjp_program(trace(bar)(x52))
    print(bar_vjp)

    out, x_bar = bar_vjp(x52, v22)
    expected_out, pull_back = torch.func.vjp(bar, x52)
    assert_close(out, expected_out)
    assert_close(x_bar, pull_back(v22)[0])
    assert_close(x_bar, torch.autograd.functional.vjp(bar, x52, v22)[1])
    assert_close(x_bar, x52 @ v22.T + x52 @ v22)
    """),
    md(r"""
    For `Z = A B` the matmul rule gives `Ā = V Bᵀ` and `B̄ = Aᵀ V`. Here `A = Xᵀ` (that is
    `c`) and `B = X` (that is `a`). So `e = matmul b c` is `V Xᵀ`, the cotangent of `c`,
    and `g` carries it back through the transpose: `X Vᵀ`. `f = matmul a b` is `X V`, the
    cotangent of `a` through the second operand, and `h` adds the two paths.

    Where did `Aᵀ` go? The rule computed it as `permute c`, the transpose of a transpose of
    `a`, which is just `a`. `fold_identities`, one of the passes that `vjp_program` runs
    (section 4), saw the two transposes cancel, so `f` multiplies `a` itself.

    ## 4 · How `vjp_program` is built

    `vjp_program` contains no derivative rules at all. It runs the program of `f` under an
    **Autograd level placed on top of a Tracing level**, then asks Autograd for the
    backward pass:

    * on the way forward, each equation goes through Autograd, which records a tape entry
      with a backward closure built by that primitive's rule in `vjp_rules`, and then
      reaches Tracing, which records it as an equation;
    * on the way back, the closures run; the values they captured are traced values, so
      every operation they perform becomes one more equation;
    * finally the program is simplified with the passes of Chapter 4.

    The rules are the very ones that `grad` uses on real numbers. Here is the rule of `sin`,
    called directly: it returns the result and a backward closure. On real tensors the
    closure computes numbers; inside `trace` the same closure writes equations, and we get
    `sin_vjp` from section 1 back.
    """),
    code(r"""
    sin_rule = vjp_rules[P.sin_p]

    out, backward = sin_rule(x4)       # real tensors: real numbers
    (x_bar,) = backward(v4)
    assert_close(x_bar, v4 * torch.cos(x4))

    def sin_by_its_rule(x, v):         # the same closure, on traced values
        out, backward = sin_rule(x)
        return (out, *backward(v))

    by_rule = trace(sin_by_its_rule)(x4, v4)
    print(by_rule)
    print(str(by_rule) == str(sin_vjp))
    """),
    md(r"""
    We can rebuild the whole of `vjp_program` in a few lines: a function that runs
    minifunctorch's `vjp` (the Autograd level) and pulls the cotangent back at once,
    traced as a whole (the Tracing level below it). On `sin(x) * cos(x)` the raw trace has
    some waste: the backward rules of `sin` and `cos` recompute `cos a` and `sin a`, which
    the forward pass already has. `simplify` shares them, and the result is exactly what
    `vjp_program` returns. (Zeros are not the problem: the backward pass skips an entry
    whose result received no cotangent, and a rule returns `None` for operands that need
    none, such as literals, so no zero tensor is built along the way.)
    """),
    code(r"""
    def forward_and_backward(f):
        def joint(x, v):
            out, pull_back = vjp(f, x)
            (x_bar,) = pull_back(v)
            return out, x_bar
        return joint

    def wave(x):
        return torch.sin(x) * torch.cos(x)

    raw = trace(forward_and_backward(wave))(x4, v4)
    wave_vjp = vjp_program(trace(wave)(x4))
    print(raw)
    print(wave_vjp)
    print(len(raw.equations), "->", len(wave_vjp.equations), "equations;",
          "same as vjp_program:", str(simplify(raw)) == str(wave_vjp))

    expected_out, pull_back = torch.func.vjp(wave, x4)
    assert_close(wave_vjp(x4, v4), (expected_out, pull_back(v4)[0]))
    """),
    md(r"""
    ## 5 · Splitting forward and backward

    The VJP program keeps the two passes together, which is right when both run at once.
    A training step, though, runs the forward pass, does other work, and runs the backward
    pass later. For that, `split_vjp(f)(*examples)` returns **two** programs:

    * `fwd(*inputs)` returns the outputs and the *saved values*: exactly the values the
      backward closures captured;
    * `bwd(*saved, *cotangents)` takes those values and the cotangents, and returns the
      input cotangents.

    This is the forward/backward pair of a differentiator closure made explicit, with the
    saved context as the interface between the two halves.
    """),
    code(r"""
    fwd, bwd = split_vjp(foo)(x)
    print(fwd)
    print(bwd)

    out, saved = fwd(x)
    (x_bar,) = bwd(*saved, v)
    assert_close(out, foo(x))
    assert_close(x_bar, torch.func.vjp(foo, x)[1](v)[0])
    """),
    md(r"""
    `fwd` saves `s = tr(X)` (for the cosine), `sin(s)` and `X` itself. `bwd` never
    recomputes the forward pass: it starts from those values.

    ## 6 · Exporting to `torch.fx`

    `program.to_fx()` builds a `torch.fx.GraphModule`: one `placeholder` node per input,
    one `call_function` node per equation whose target is the plain torch function or
    Python operator (`torch.sin`, `operator.mul`, ...), and an `output` node.
    `graph.lint()` checks that the graph is well formed, and `gm.code` is the Python source
    that FX generates from it. The `name = None` statements are FX freeing each value right
    after its last use.

    The module is an ordinary `nn.Module`: call it, or pass it to `torch.compile`.
    """),
    code(r"""
    gm = foo_vjp.to_fx()
    gm.graph.lint()
    print(gm.code.strip())

    assert_close(gm(x, v), foo_vjp(x, v))
    """),
    md(r"""
    Equation `m`, the primitive `diagonal_scatter`, means "a matrix of zeros of the given
    shape, with this vector on its diagonal", while `torch.diagonal_scatter` expects the
    zero matrix as an argument. So the export writes it in two steps: `new_zeros` makes the
    zero matrix (with the dtype and device of the vector), and `torch.diagonal_scatter`
    writes the vector onto its diagonal. `new_zeros` is a method call, a `call_method` node,
    which section 7 leaves out when it pairs the graph's nodes with the equations.

    ## 7 · Shapes

    Several rules need shapes while the backward program is being built: the backward of
    `sum` spreads a cotangent back to the input's shape, the backward of `diagonal` builds
    a matrix of the input's shape, and broadcasting is undone with `sum_to_size(ct,
    shape)`. A graph captured by `torch.fx.symbolic_trace` has no shapes at all, so a
    reverse-mode tool built on it first has to run a shape-propagation pass (such as
    `ShapeProp`, which runs the graph on example inputs and stores each node's shape in
    `node.meta`).

    A minifunctorch program has types from the start: each `Var` got its shape and dtype
    from the primitive's shape rule while tracing. As a cross-check, we run `ShapeProp` on
    the exported module and compare, node by node, with the types of the program:
    """),
    code(r"""
    ShapeProp(gm).propagate(x, v)

    names = foo_vjp.names()
    program_vars = [*foo_vjp.inputs, *(equation.out for equation in foo_vjp.equations)]
    fx_nodes = [node for node in gm.graph.nodes if node.op in ("placeholder", "call_function")]
    for var, node in zip(program_vars, fx_nodes, strict=True):
        propagated = node.meta["tensor_meta"]
        assert (tuple(propagated.shape), propagated.dtype) == (var.shape, var.dtype)
        print(f"{names[var]}:{var.type:9} {node.op:14} {node.name}")
    """),
    md(r"""
    ## 8 · Compared with `make_fx(jacrev(f))`

    `torch.func` can be traced too. `make_fx` runs a function with tracing tensors at the
    level of PyTorch's dispatcher, so it records **ATen** operators, the operator set that
    every torch function is eventually lowered to. Here is what it records for the Jacobian
    of the sine, computed by `torch.func.jacrev`. We trace it twice to check that the text
    is deterministic:
    """),
    code(r"""
    def sin_jacobian(x):
        return torch.func.jacrev(torch.sin)(x)

    first = make_fx(sin_jacobian)(x4).code
    second = make_fx(sin_jacobian)(x4).code
    print(first == second)
    print(first.strip())

    aten_jacobian = make_fx(sin_jacobian)(x4)
    assert_close(aten_jacobian(x4), torch.diag(torch.cos(x4)))
    """),
    md(r"""
    Compare it with `sin_vjp` from section 1 (three equations). `jacrev` computes the
    whole `4×4` Jacobian: it builds an identity basis (`new_zeros`, then `fill_` writing
    ones onto a diagonal view, in place), pulls every row back at once (the batched
    `mul`), and reshapes the result. The shapes are baked in as literal lists. The two
    record different things at different levels: ours is a VJP in terms of minifunctorch's
    primitives; this is a Jacobian in terms of ATen operators, after `torch.func`'s own
    batching.

    A fairer comparison is `torch.func.vjp` on `foo`, traced by `make_fx`:
    """),
    code(r"""
    def foo_pull_back(x, v):
        _, pull_back = torch.func.vjp(foo, x)
        return pull_back(v)

    first = make_fx(foo_pull_back)(x, v).code
    print(first == make_fx(foo_pull_back)(x, v).code)
    print(first.strip())

    (aten_x_bar,) = make_fx(foo_pull_back)(x, v)(x, v)
    assert_close(aten_x_bar, foo_vjp(x, v)[1])
    """),
    md(r"""
    The structure is the same as ours: the forward pass, `v * sin(s)`, the
    sum of `v * x`, the cosine, and the addition of the two contributions. Two differences
    are worth a look.

    * ATen has a `trace` operator, so its backward is a formula of its own: a zero vector
      of 9 elements, `index_fill` at positions `0, 4, 8` (every 4th element of the
      flattened `3×3` matrix is on the diagonal), and a `view` back to `3×3`. Ours came out
      of the `sum` and `diagonal` rules as `expand` and `diagonal_scatter`.
    * The forward output `mul` is computed and dropped at once (`mul = None`): `foo_pull_back`
      only returns the cotangent, and `make_fx` records what ran without removing dead
      code. Our VJP program returns both.

    ## Summary

    * `vjp_program(trace(f)(x))` is reverse mode as a program transformation: one readable
      program from `(inputs, cotangents)` to `(outputs, input cotangents)`.
    * It is built from the tape's rules run on a Tracing level, plus the passes of
      Chapter 4; `split_vjp` cuts the same computation into a forward and a backward
      program joined by the saved values.
    * Every variable is typed, so rules can use shapes while the program is built; the
      export to `torch.fx` reads like hand-written code.
    """),
    md(r"""
    ## Exercise · A VJP rule for a new primitive

    The error function `erf` is not one of minifunctorch's primitives. The cell below adds
    it: a `Primitive` is a name and a torch implementation, and `bind` applies it. Tracing
    works at once, since it needs only the implementation (for the shape rule), but
    `vjp_program` cannot work until `vjp_rules` has a rule for it.

    Write `erf_vjp(x)`. Like every rule, it must return a pair: the result, computed with
    `bind(erf_p, x)`, and a backward closure `backward(ct)` that returns a tuple with one
    cotangent per argument (here, one). The derivative you need is

    $$\frac{d}{dx}\,\mathrm{erf}(x) = \frac{2}{\sqrt{\pi}}\, e^{-x^2}.$$

    Inside the closure, ordinary torch code on `x` and `ct` works (`torch.exp`, `*`, ...):
    the operations reach whatever level `x` belongs to, which during `vjp_program` is the
    Tracing level. The check builds `vjp_program` of `model(x) = erf(2x) · x` and compares
    it with `torch.func.vjp` of the same function written with `torch.erf`.
    """),
    code(r"""
    erf_p = Primitive("erf", torch.erf)

    def erf(x):
        return bind(erf_p, x)

    def model(x):
        return erf(x * 2.0) * x

    def model_in_torch(x):
        return torch.erf(x * 2.0) * x

    x5, v5 = torch.randn(5), torch.randn(5)
    print(trace(model)(x5))
    """),
    code(r"""
    def erf_vjp(x):
        # return (bind(erf_p, x), backward), where backward(ct) returns a 1-tuple
        raise NotImplementedError("erf_vjp is not written yet")

    vjp_rules[erf_p] = erf_vjp
    """),
    code(r"""
    from minifunctorch.core.checks import check_against


    def ours(x, v):
        return vjp_program(trace(model)(x))(x, v)


    def reference(x, v):
        out, pull_back = torch.func.vjp(model_in_torch, x)
        return (out, *pull_back(v))


    check_against(ours, reference, x5, v5,
                  what="vjp_program of erf(2x) * x, with your erf_vjp",
                  hint="backward(ct) returns (ct * 2 / sqrt(pi) * ops.exp(-(x * x)),): the chain "
                       "rule through x * 2.0 is the mul rule's job, not yours")
    """),
    md(SOLUTION_HEADING),
    solution_md(r"""
    The closure captures `x`, the input: that is the saved context of this rule. (Saving
    `out` instead would not help here, since the derivative of `erf` is not a function of
    its value the way the derivative of `exp` is.)
    """),
    solution(r"""
    def erf_vjp(x):
        out = bind(erf_p, x)

        def backward(ct):  # ct and x are values: arithmetic works on them, functions are ops.*
            return (ct * (2 / math.sqrt(math.pi)) * ops.exp(-(x * x)),)

        return out, backward


    vjp_rules[erf_p] = erf_vjp

    model_vjp = vjp_program(trace(model)(x5))
    print(model_vjp)
    print(model_vjp.to_fx().code.strip())
    """),
    code(r"""
    check_against(ours, reference, x5, v5,
                  what="vjp_program of erf(2x) * x, with your erf_vjp",
                  hint="backward(ct) returns (ct * 2 / sqrt(pi) * ops.exp(-(x * x)),): the chain "
                       "rule through x * 2.0 is the mul rule's job, not yours")
    """),
]

write(cells, "05_source_to_source.ipynb")
