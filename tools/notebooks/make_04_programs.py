"""Generate notebooks/04_programs.ipynb (Chapter 4 · programs)."""
from nbcells import SOLUTION_HEADING, code, md, solution, solution_md, write

cells = [
    md(r"""
    # Chapter 4 · Programs: a function turned into data

    So far every transform did its work *while the function ran*. Each torch call travelled
    down the stack of levels, each level handled it on the spot, and once the answer came
    back nothing was left of the computation. That is enough for `grad` and `vmap`, but two
    things we want next need more:

    * **`jit`** wants to run a function many times without paying for Python and for the
      dispatcher on every call;
    * **source-to-source reverse mode** (Chapter 5) wants a backward pass that we can print,
      read, simplify and export.

    Both need the computation itself as a value we can inspect: a **program**. The programs
    of minifunctorch are modelled on JAX's *jaxprs*: every value has an explicit type, there
    are no nested functions (the language is first-order), and there are no branches or loops
    (a program is one straight line of equations).

    The chapter goes step by step:

    1. tracing a function into a program;
    2. reading the printed program, and the Python objects behind it;
    3. typechecking;
    4. evaluating a program, and transforming it like any function;
    5. tracing functions that are themselves transformed;
    6. simplification passes;
    7. generated Python code, and `jit`.

    It ends with an exercise: a pass of your own.
    """),
    code(r"""
    %load_ext minifunctorch.magics
    # (the extension also shortens the engine's errors to the call, your line and the fix)

    import torch
    from torch.testing import assert_close

    import minifunctorch.core as mft
    from minifunctorch.core import Equation, Var, grad, hessian, jit, jvp, trace, vmap
    from minifunctorch.core.passes import (eliminate_common_subexpressions,
                                           eliminate_dead_code, fold_symbolic_zeros, simplify)

    torch.manual_seed(0)
    torch.set_printoptions(precision=4)
    """),
    md(r"""
    ## 1 · Tracing: running a function on values that have no numbers

    `trace(f)` returns a new function. Calling it with example arguments runs `f` exactly
    once, with a **Tracing** level on top of the stack. Instead of the real tensors, `f`
    receives stand-ins (`TracerValue`s, shown to it as tensors) whose payload is a *meta*
    tensor: a shape and a dtype, and no storage at all.

    Each primitive that reaches the Tracing level is appended to a list of equations. The
    type of its result comes from the primitive's shape rule, which runs the torch
    implementation on meta tensors, so no arithmetic happens. When `f` returns, the list of
    equations, together with the inputs and the outputs, is the program.
    """),
    code(r"""
    def f(x, y):
        z = torch.sin(x) * y
        return (z + 1.0).sum()

    x, y = torch.randn(3), torch.randn(3)
    program = trace(f)(x, y)
    print(program)
    """),
    md(r"""
    ### How to read a program

    * The first line, `{ lambda ; a:f32[3] b:f32[3] .`, names the inputs and gives each one a
      type, written `dtype[shape]`: `f32[3]` is a float32 vector of length 3, and `f32[]` is
      a float32 scalar. Tensors that `f` captured from outside (we meet them below) are listed
      before the `;`.
    * After `let` comes one equation per line: `result:type = primitive operands params`.
      An operand is either a variable or a *literal* (a Python number such as `1.0`). Static
      parameters are written `key=value`.
    * `in (f,)` lists the outputs.

    Every intermediate value has its own name and is assigned exactly once. Notice also that
    `.sum()` became `sum ... dim=(0,) keepdim=False`: parameters are stored in one normal form
    (dims are always a tuple), so the code that reads programs never has to re-parse the many
    ways a user can call a torch function.

    A `Var` carries no name: the printer names variables in order of appearance (`a` to `z`,
    then `ba`, `bb`, ...). The text therefore depends on the program alone, not on how many
    values the session created before, so tracing the same function twice prints the same
    text, which makes programs easy to compare in tests and diffs.

    Since only shapes and dtypes matter, meta tensors are perfectly good example arguments.
    With a `(2, 3)` input and a `(3,)` input, the types show the broadcasting that `mul`
    does:
    """),
    code(r"""
    print(trace(f)(torch.empty(2, 3, device="meta"), torch.empty(3, device="meta")))

    again = trace(f)(torch.randn(3), torch.randn(3))
    print(str(again) == str(program))
    print(program.names())
    """),
    md(r"""
    ### What tracing cannot see

    A traced value has no number in it, so Python cannot take a decision that depends on
    one. Rather than quietly recording whichever branch the example arguments would have
    taken, the Tracing level refuses, and says what to do instead. The fix is to make the
    choice part of the program with `torch.where`:
    """),
    code(r"""
    def absolute_sum(x):
        if x.sum() > 0:           # Python needs a concrete True or False here
            return x.sum()
        return -x.sum()

    try:
        trace(absolute_sum)(x)
    except mft.TransformError as error:
        print(f"{type(error).__name__}: {error}")

    def absolute_sum_traceable(x):
        s = x.sum()
        return torch.where(s > 0, s, -s)   # both branches are computed; where picks one

    branchless = trace(absolute_sum_traceable)(x)
    print(branchless)
    """),
    md(r"""
    ## 2 · The data behind the text

    The printed form is only a view. A `Program` holds four lists:

    | attribute | holds |
    |---|---|
    | `program.inputs` | the input variables (`Var`) |
    | `program.constants` | `(Var, tensor)` pairs: tensors the function captured |
    | `program.equations` | `Equation`s, in the order they ran |
    | `program.outputs` | variables or literals |

    A `Var` is a shape and a dtype; two variables are the same only if they are the same
    object. A `Literal` wraps a Python number. An `Equation` has a primitive (`prim`),
    operands (`inputs`), static parameters (`params`) and the variable it defines (`out`).
    """),
    code(r"""
    print("inputs:   ", program.inputs)
    print("constants:", program.constants)
    print("outputs:  ", program.outputs)
    print()
    for equation in program.equations:
        kinds = [type(operand).__name__ for operand in equation.inputs]
        print(f"{equation.prim.name:4}  operands={kinds}  params={equation.params}  "
              f"out={equation.out.type}")

    # the operand of `sin` is the very object that is the first input
    print(program.equations[0].inputs[0] is program.inputs[0])
    """),
    md(r"""
    ### Captured tensors become constants

    If `f` uses a tensor that it did not receive as an argument, the program cannot make it
    an input (callers will not pass it). It becomes a **constant** of the program instead: a
    variable bound to that tensor, printed before the `;`. Python numbers stay literals.
    """),
    code(r"""
    W = torch.randn(4, 3)

    def layer(x):
        return torch.tanh(W @ x) * 0.5

    layer_program = trace(layer)(x)
    print(layer_program)
    constant_var, constant_value = layer_program.constants[0]
    print(constant_var.type, constant_value is W)
    """),
    md(r"""
    ## 3 · Typechecking

    `program.typecheck()` walks the equations in order and checks two things for each one:
    every variable it uses has been defined before, and the type it declares is the type
    that the primitive's shape rule derives from the operand types. It returns the program,
    so it can be chained.

    `trace` always builds well-typed programs. The checker is for code that *rewrites*
    programs, such as the passes of section 6 or a hand edit: a mistake there is caught as a
    clear message at once, instead of a wrong number or a strange shape error much later.

    Our programs so far pass. To watch the checker fail, we corrupt a program. Programs are
    never changed in place: `program.replace(...)` makes a copy with some parts swapped. Our
    copy claims that multiplying two `f32[3]` vectors gives an `f32[4]` result. The cell after
    it fails on purpose: equation 1 declares `d:f32[4] = mul c b`, but the shape rule of `mul`
    derives `f32[3]` from two `f32[3]` operands, so `typecheck` raises a `TypecheckError`.
    """),
    code(r"""
    program.typecheck()
    layer_program.typecheck()
    print("both programs typecheck")

    sin_eq, mul_eq, add_eq, sum_eq = program.equations
    wrong = Var((4,), torch.float32)
    corrupted = program.replace(equations=[
        sin_eq,
        Equation(mul_eq.prim, mul_eq.inputs, mul_eq.params, wrong),
        Equation(add_eq.prim, [wrong, add_eq.inputs[1]], add_eq.params, add_eq.out),
        sum_eq,
    ])
    print(corrupted)
    """),
    code(r"""
    corrupted.typecheck()
    """, tags=["raises-exception"]),
    md(r"""
    ## 4 · Evaluating a program

    Calling `program(*args)` interprets it: it binds the inputs and constants, then runs
    each equation with `bind(prim, *operands, **params)`, and returns the outputs in the
    structure that `f` returned.

    `bind` is the entry point that every primitive call goes through, so it dispatches to
    whatever levels are on the stack. A program is therefore an ordinary function for every
    transform: `grad(program)`, `vmap(program)` and `trace(program)` just work.
    """),
    code(r"""
    assert_close(program(x, y), f(x, y))
    assert_close(layer_program(x), layer(x))
    assert_close(branchless(x), x.sum().abs())
    print(program(x, y))

    # a program is specialized to the types it was traced with
    try:
        program(torch.randn(4), torch.randn(4))
    except mft.TransformUsageError as error:
        print(error)

    # ... and transforms treat it as any other function
    assert_close(grad(program)(x, y), torch.func.grad(f)(x, y))

    xs, ys = torch.randn(5, 3), torch.randn(5, 3)
    assert_close(vmap(program)(xs, ys), torch.func.vmap(f)(xs, ys))

    print(grad(program)(x, y))
    print(str(trace(program)(x, y)) == str(program))   # tracing a program gives it back
    """),
    md(r"""
    ## 5 · Tracing composes with transforms

    The Tracing level is a level like the others, so it can sit *under* a transform. In
    `trace(grad(f))(x, y)` the stack is an Autograd level on top of the Tracing level. The
    forward operations go through Autograd, which records them on its tape, and down to
    Tracing, which records them as equations. Then `grad` runs the backward closures of the
    tape; the operations they issue land in the Tracing level too. The result is the
    gradient of `f` as one straight-line program.
    """),
    code(r"""
    grad_program = trace(grad(f))(x, y)
    print(grad_program)
    assert_close(grad_program(x, y), torch.func.grad(f)(x, y))
    """),
    md(r"""
    Equations `c` to `f` are the forward pass. `g` is the seed of the backward pass (the
    derivative of the output with respect to itself, a 1 with the output's type), and `h`
    spreads it back through the `sum`. The `mul` rule then makes `i`, the cotangent of `c`
    (the sine), and none for `b`: that is `y`, and `grad(f)` differentiates with respect to
    `x` only, so the rule is told that nobody wants a cotangent for it. Finally `j` and `k`
    carry `i` back through the `sin`. Nothing here was differentiated symbolically: these
    are the tape's own rules, recorded instead of executed.

    The same works for `vmap`: batching leaves no operation of its own in the program. The
    batch dimension simply appears in the types, and the batching rule of `sum` turned
    `dim=(0,)` into `dim=(1,)`.

    Transforms nest, and so does tracing: the second of the two cells below traces
    `hessian`, which is `jacfwd(jacrev(...))`, forward mode batched with `vmap` over reverse
    mode.
    """),
    code(r"""
    batched_program = trace(vmap(f))(xs, ys)
    print(batched_program)
    assert_close(batched_program(xs, ys), torch.func.vmap(f)(xs, ys))
    """),
    code(r"""
    def g(x):
        return (torch.sin(x) ** 2).sum()

    hessian_program = trace(hessian(g))(x)
    print(hessian_program)
    assert_close(hessian_program(x), torch.func.hessian(g)(x))
    """),
    md(r"""
    Two things stand out.

    * There are two constants. `b` is the identity matrix whose columns `jacfwd` pushes
      forward. `c` is the row that `jacrev` pulls back, already spread to the shape of `x`:
      `jacrev` builds its basis with ordinary torch calls on tensors that do not depend on
      `x`, so that work is done once, while tracing, and only its result is kept.
    * The program is a faithful record of what the rules did, and the rules were written to
      be simple, not to cooperate: `sin a` and `cos a` are each computed twice, and several
      results are never used. Cleaning this up is the job of passes.

    ## 6 · Simplification passes

    A pass is a function from a program to a new program. minifunctorch has four, each a
    few dozen lines in `core/passes.py`:

    * `eliminate_dead_code`: walk backwards from the outputs and keep only the equations
      that contribute to them;
    * `eliminate_common_subexpressions`: when an equation repeats an earlier one (same
      primitive, same operands, same parameters), reuse the earlier result;
    * `fold_symbolic_zeros`: never do arithmetic with a tensor that is known to be zero
      (`x + 0` is `x`, `x * 0` is zero, the sum of zeros is zero, ...);
    * `fold_identities`: drop an operation that gives back its operand unchanged (`mul x 1`,
      `div x 1`, an `expand` or `reshape` to the shape it already has, a `permute` undone
      by another);

    and `simplify` runs all four until the program stops shrinking. `jit` runs one more
    before compiling, `fold_identity_bases`: the identity matrix that `jacrev` pulls back
    (and `jacfwd` pushes forward) is diagonal, and so is what an elementwise backward such
    as `tanh_backward` makes of it, so a matmul with it becomes a product by its diagonal:
    n k multiplications where the dense matmul takes n² k.

    **Dead code.** `hessian(g)` returns the matrix of second derivatives only, but on the
    way it also worked out the value `g(x)` (equations `g` and `j` above) and, twice, the
    gradient: forward mode in `h`, `i` and `k`, reverse mode in `u` and `z`. Nothing uses
    them:
    """),
    code(r"""
    pruned = eliminate_dead_code(hessian_program)
    kept = {id(equation) for equation in pruned.equations}
    for equation in hessian_program.equations:
        if id(equation) not in kept:
            print("dropped", hessian_program.equation_text(equation))
    print(len(hessian_program.equations), "->", len(pruned.equations), "equations")
    assert_close(pruned(x), torch.func.hessian(g)(x))

    print("grad_program:", len(grad_program.equations), "->",
          len(eliminate_dead_code(grad_program).equations), "equations")
    """),
    md(r"""
    `grad_program` has nothing to drop. Even its forward `sum` (`f`), whose value `grad`
    does not return, survives: the seed `g = full_like f fill_value=1` reads it. It only
    needs its type, but dead-code elimination looks at data dependencies, and a data
    dependency is what it sees.

    **Common subexpressions.** The backward rules of `sin` and `cos` recompute `cos a` and
    `sin a`, which the forward pass already has:
    """),
    code(r"""
    def wave(x):
        return (torch.sin(x) * torch.cos(x)).sum()

    wave_grad = trace(grad(wave))(x)
    shared = eliminate_common_subexpressions(wave_grad)
    print(wave_grad)
    print(shared)
    assert_close(shared(x), torch.func.grad(wave)(x))
    """),
    md(r"""
    **Symbolic zeros.** Forward mode in the direction of `x` alone gives `y` a tangent of
    zeros. Folding follows them: a zero times the number 2 is zero, and adding a zero changes
    nothing, so the tangent of `2 * y` disappears, with the sum that added it, and dead-code
    elimination removes what became unused. A zero times a *tensor* stays (`mul` of the zeros
    and `sin a`): the tensor may hold `inf` or `nan`, and `0 * inf` is `nan`, as eager torch and
    torch.func compute it (NOTE [Zero times infinity] in `passes.py`). (The tangent of `x` is a
    tensor of ones, and the program still multiplies by it: `fold_identities` knows the literal
    `1`, not a tensor that happens to hold ones.) The cell after it runs `simplify`, the four
    passes repeated until nothing changes, on the Hessian program.
    """),
    code(r"""
    def product(x, y):
        return torch.sin(x) * y + 2 * y

    def d_product_dx(x, y):
        _, tangent = jvp(product, (x, y), (torch.ones_like(x), torch.zeros_like(y)))
        return tangent

    along_x = trace(d_product_dx)(x, y)
    print(along_x)
    print(eliminate_dead_code(fold_symbolic_zeros(along_x)))

    _, expected = torch.func.jvp(product, (x, y), (torch.ones_like(x), torch.zeros_like(y)))
    assert_close(simplify(along_x)(x, y), expected)
    """),
    code(r"""
    simple_hessian = simplify(hessian_program)
    print(simple_hessian)
    print(len(hessian_program.equations), "->", len(simple_hessian.equations), "equations")
    assert_close(simple_hessian(x), torch.func.hessian(g)(x))
    """),
    md(r"""
    Nine equations fewer, and the same numbers: the seven dead equations are gone, and so
    are the second `sin a` and `cos a`. Some waste remains: the constant `c` holds ones, so
    `k = mul j c` gives back `j`, but no pass looks inside a constant. The exercise at the
    end asks you to remove it.

    ## 7 · Generated code and `jit`

    Interpreting a program equation by equation still costs a Python loop and a `bind` per
    equation. `program.python_source()` writes the program out as straight-line Python
    instead: one statement per equation, with the torch call spelled out. It returns the
    source and the globals the source needs (`torch`, `operator` and the constants, which
    become global names of the generated function).
    """),
    code(r"""
    source, namespace = simple_hessian.python_source("hessian_of_g")
    print(source)
    print(sorted(namespace))

    compiled = simple_hessian.compile_python()    # exec of that source
    (compiled_hessian,) = compiled(x)
    assert_close(compiled_hessian, torch.func.hessian(g)(x))
    """),
    md(r"""
    The code that `jit` runs is this source with two rewrites, each of which gives the same
    bits in less time on small tensors:

    * **Buffer reuse.** When an elementwise equation's first operand is an intermediate that
      nothing reads afterwards, the result goes into that operand's memory, through torch's
      in-place method: `h = f.mul_(...)` allocates nothing. `g = d * 2` keeps a buffer of
      its own, because `d` is read again by `l = b * d`. Compilers call this buffer
      assignment.
    * **Numbers as tensors.** For `f * 2`, torch wraps the 2 in a tensor on every call. The
      generated code binds each number once, as a 0-d tensor of the result's dtype
      (`_number0`, `_number1`).

    Torch's own autograd keeps intermediates for its backward pass, and writing over them
    would break it; so `jit` runs the rewritten code only when autograd is not recording.
    """),
    code(r"""
    fast_source, _ = simple_hessian.python_source("hessian_of_g", reuse_buffers=True,
                                                  number_tensors=True)
    print(fast_source)
    fast = simple_hessian.compile_python(reuse_buffers=True, number_tensors=True)
    assert torch.equal(fast(x)[0], compiled(x)[0])    # the same bits
    """),
    md(r"""
    `jit(f)` puts the pieces together. On each call it computes a *signature* of the
    arguments: the pytree structure, the shape, dtype and device of each tensor, and the
    value of every non-tensor argument. The first call with a new signature traces `f`,
    simplifies the program and generates its Python code; every later call with that
    signature goes straight to the generated function, with no tracing, no dispatcher and
    no interpretation. That is where its speed comes from (`make bench` measures it; this
    chapter prints no timings, so that its outputs are the same on every run).

    `f.cache_size()` says how many signatures have been compiled, and `f.program_for(*args)`
    returns the program that a call with these arguments runs.
    """),
    code(r"""
    def loss(w, inputs):
        return torch.tanh(inputs @ w).pow(2).mean()

    fast_grad = jit(grad(loss))
    w, batch = torch.randn(3), torch.randn(8, 3)

    assert_close(fast_grad(w, batch), grad(loss)(w, batch))              # eager minifunctorch
    assert_close(fast_grad(w, batch), torch.func.grad(loss)(w, batch))   # torch.func
    print(fast_grad(w, batch))
    print("cache size:", fast_grad.cache_size())

    fast_grad(w, torch.randn(8, 3))       # same signature: no new trace
    print("cache size:", fast_grad.cache_size())
    fast_grad(w, torch.randn(16, 3))      # a new batch size is a new signature
    print("cache size:", fast_grad.cache_size())

    print(fast_grad.program_for(w, batch))
    """),
    md(r"""
    ### A function that writes its arguments

    A training step often updates its arguments in place: `w.sub_(lr * g)`, a running mean
    `stats.mul_(0.9).add_(...)`. A program is pure data, with outputs but no side effects, so
    while tracing such a write swaps the new value into the argument's stand-in, as under any
    transform, and the program computes it out of place. It becomes one more output, and the
    program's `writes` table pairs it with the input it belongs to, printed after the outputs
    as `writes a <- h`. Calling the program, or the `jit` function, copies those outputs into
    the caller's tensors. This is how torch.func's `functionalize` and torch.compile's
    AOTAutograd treat input mutations: the graph stays pure, and the copy back happens
    around it.
    """),
    code(r"""
    def sgd_step(w, inputs):
        g = grad(loss)(w, inputs)
        w.sub_(0.5 * g)            # an in-place update of an argument
        return loss(w, inputs)

    step = jit(sgd_step)
    w_jit, w_eager = torch.ones(3), torch.ones(3)
    for _ in range(3):
        assert_close(step(w_jit, batch), sgd_step(w_eager, batch))
    assert_close(w_jit, w_eager)   # three calls, three updates of the caller's tensor
    print(w_jit)
    print(step.program_for(w_jit, batch))
    """),
    md(r"""
    ### A function that draws random numbers

    Dropout in training mode draws a new mask at every step. A program that stored the mask
    drawn while tracing would replay that one mask forever. So the trace records the call
    itself, as a `draw` equation that names the torch call (`torch.bernoulli` on a tensor of
    the input's shape) and makes it anew each time the program runs, from torch's generator:
    from the same seed, the same numbers as eager torch. Nothing is drawn while tracing (the
    result's shape comes from the same call on the meta device), and the passes keep every
    draw, in order, even one nobody reads, because each one moves the generator on.

    Under a `vmap` around the program, each draw goes back to the rule of the random function
    that made it, so `vmap(jit(f), randomness='different')` draws what `vmap(f,
    randomness='different')` draws, and 'same' and 'error' act as they do on `f`.
    """),
    code(r"""
    def noisy_step(w, inputs):
        return loss(torch.nn.functional.dropout(w, 0.5), inputs)   # training mode

    noisy = jit(noisy_step)
    torch.manual_seed(0)
    jitted_losses = [noisy(torch.ones(3), batch) for _ in range(3)]
    torch.manual_seed(0)
    eager_losses = [noisy_step(torch.ones(3), batch) for _ in range(3)]
    assert_close(jitted_losses, eager_losses)   # a new mask at each call, the eager ones
    print([round(l.item(), 4) for l in jitted_losses])
    print(noisy.program_for(torch.ones(3), batch))
    """),
    md(r"""
    ## Summary

    * `trace(f)(*examples)` runs `f` once on shape-and-dtype stand-ins and records each
      primitive as an equation of a typed, first-order, straight-line `Program`.
    * A program prints with stable names, is plain data (`inputs`, `constants`, `equations`,
      `outputs`; `Var`, `Literal`, `Equation`), and checks itself with `typecheck()`.
    * `program(*args)` evaluates with `bind`, so programs can be transformed again; and
      tracing a transformed function records forward and backward (or batched) work alike.
    * Passes rewrite programs; `simplify` combines them. `python_source()` and `jit` turn a
      program into straight-line Python, compiled once per signature; the code `jit` runs
      reuses dead buffers and binds numbers once.
    * A function that writes its arguments in place traces to a pure program with the new
      values as extra outputs (`writes`); a call copies them into the caller's tensors.
    * A random draw is recorded as the call that makes it (`draw`), made anew at each call.

    Next chapter: reverse mode done entirely on programs, exported to `torch.fx`.

    ## Exercise · A pass that removes `mul v ones`

    The simplified Hessian program above still multiplies by ones: its constant `c` holds
    only ones, and `k = mul j c` gives back `j`. Write a pass `remove_mul_by_ones(program)`
    that returns a new program in which

    * every equation `out = mul v c` (or `out = mul c v`), where `c` is a constant of the
      program whose tensor holds only ones, is dropped when `v` is a variable with exactly
      the type of `out`, and
    * every later use of `out`, in the equations and in the outputs, refers to `v` instead.

    Why the condition on the type? Multiplying by ones can change the shape or the dtype:
    `i = mul c g` turns the `f32[3]` vector `g` into an `f32[1,3]` row, and for an integer
    `v` the product with float ones is a float tensor. Replacing such an `out` by `v` could
    change what a later equation computes, so the pass keeps those equations.

    Hints: the passes in `core/passes.py` all have the same shape: a `replacement`
    dictionary from dropped variables to the variables that replace them, a `resolve`
    function applied to every operand, a list of new `Equation`s, and finally
    `program.replace(equations=..., outputs=...)`. `program.constants` holds the
    `(Var, tensor)` pairs of section 2. The primitive is `minifunctorch.core.primitives.mul_p`.

    The check below applies your pass to `simple_hessian`. It passes when the rewritten
    program typechecks, has no such product left, is shorter, and still computes
    `torch.func.hessian(g)`. Run it once now to see it fail.

    **Going further**, once it passes: `simplify(along_x)` from section 6 multiplies by a
    tensor of ones too, made by `full_like ... fill_value=1` rather than captured as a
    constant. Extend your pass to it, and run it in a loop with `simplify`. Or write your
    own evaluator: a loop over `program.equations` with a dictionary from variables to
    tensors, calling `equation.prim.impl`, compared with `program(*args)`.
    """),
    code(r"""
    from minifunctorch.core.primitives import mul_p


    def remove_mul_by_ones(program):
        # your pass goes here
        raise NotImplementedError("remove_mul_by_ones is not written yet")
    """),
    code(r"""
    from minifunctorch.core.checks import check_against


    def multiplies_by_ones(program, equation):
        # `mul v c` or `mul c v`, with c a constant of ones and v already of the result's type
        if equation.prim is not mul_p:
            return False
        ones = {var for var, value in program.constants if bool((value == 1).all())}
        out = equation.out
        for factor, v in (equation.inputs, equation.inputs[::-1]):
            if isinstance(factor, Var) and factor in ones and isinstance(v, Var) \
                    and (v.shape, v.dtype) == (out.shape, out.dtype):
                return True
        return False


    def hessian_after_the_pass(x):
        rewritten = remove_mul_by_ones(simple_hessian).typecheck()
        left = [rewritten.equation_text(eq) for eq in rewritten.equations
                if multiplies_by_ones(rewritten, eq)]
        if left:
            raise ValueError(f"these equations still multiply by ones: {left}")
        if len(rewritten.equations) >= len(simple_hessian.equations):
            raise ValueError("the rewritten program is not shorter than the original")
        return rewritten(x)


    check_against(hessian_after_the_pass, torch.func.hessian(g), x,
                  what="remove_mul_by_ones drops `mul v ones` and keeps the Hessian",
                  hint="map each dropped `out` to its `v` in a dict, and resolve every operand "
                       "and every output through that dict")
    """),
    md(SOLUTION_HEADING),
    solution_md(r"""
    First the constants that hold only ones, then one loop over the equations. Operands are
    resolved first, so that a chain such as `d = mul b c; e = mul d c` collapses all the way
    to `b`.
    """),
    solution(r"""
    def remove_mul_by_ones(program):
        ones = {var for var, value in program.constants if bool((value == 1).all())}
        replacement = {}   # dropped variable -> the variable that replaces it

        def resolve(operand):
            return replacement.get(operand, operand) if isinstance(operand, Var) else operand

        def is_ones(operand):
            return isinstance(operand, Var) and operand in ones

        def same_type(var, out):
            return isinstance(var, Var) and (var.shape, var.dtype) == (out.shape, out.dtype)

        equations = []
        for equation in program.equations:
            inputs = [resolve(operand) for operand in equation.inputs]
            if equation.prim is mul_p:
                left, right = inputs
                if is_ones(right) and same_type(left, equation.out):
                    replacement[equation.out] = left
                    continue
                if is_ones(left) and same_type(right, equation.out):
                    replacement[equation.out] = right
                    continue
            equations.append(Equation(equation.prim, inputs, equation.params, equation.out))
        outputs = [resolve(operand) for operand in program.outputs]
        return program.replace(equations=equations, outputs=outputs)


    print(remove_mul_by_ones(simple_hessian))
    """),
    code(r"""
    check_against(hessian_after_the_pass, torch.func.hessian(g), x,
                  what="remove_mul_by_ones drops `mul v ones` and keeps the Hessian",
                  hint="map each dropped `out` to its `v` in a dict, and resolve every operand "
                       "and every output through that dict")
    """),

]

write(cells, "04_programs.ipynb")
