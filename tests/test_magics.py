"""The IPython magics, in a real InteractiveShell: results against torch.func, stacking,
bindings, errors and tracebacks, load/unload, and that no wrapped value reaches the notebook."""
import linecache
import re
import subprocess
import sys

import pytest
import torch
import torch.func
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from traitlets.config import Config

import minifunctorch.core as core
import minifunctorch.widgets as widgets
from minifunctorch.core import FuncTensor, NonScalarOutputError
from minifunctorch.magics import load_ipython_extension, unload_ipython_extension
from minifunctorch.magics.display import Results

# torch.func.jvp loads torch's jvp decompositions with torch.jit.script on first use.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

SETUP = """
import torch
torch.manual_seed(0)
x = torch.randn(5, 3)
y = torch.randn(5)
w = torch.randn(3)
t = torch.randn(3)
"""


@pytest.fixture
def shell():
    """A fresh shell per test (in-memory history), with the magics loaded and x, y, w, t."""
    InteractiveShell.clear_instance()
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    shell.colors = "nocolor"
    ok(shell, "%load_ext minifunctorch.magics")
    ok(shell, SETUP)
    yield shell
    InteractiveShell.clear_instance()
    from minifunctorch.core import dispatch
    assert not dispatch.transform_levels(), "a magic left a transform level behind"


def ok(shell, source):
    """Run a cell that must succeed; return its result."""
    result = shell.run_cell(source)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result


def fails(shell, source):
    """Run a cell that must fail; return the exception it raised."""
    result = shell.run_cell(source)
    error = result.error_before_exec or result.error_in_exec
    assert error is not None, f"the cell succeeded:\n{source}"
    return error


def ns(shell):
    return shell.user_ns


def loss(x, y, w):
    return ((x @ w - y) ** 2).mean()


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def wrapped_values(namespace):
    """Every FuncTensor in the namespace, also inside tuples, lists and dicts."""
    found = []

    def visit(value, depth=0):
        if isinstance(value, FuncTensor):
            found.append(value)
        elif depth < 3 and isinstance(value, (tuple, list)):
            for v in value:
                visit(v, depth + 1)
        elif depth < 3 and isinstance(value, dict) and value is not namespace:
            for v in value.values():
                visit(v, depth + 1)
    for value in list(namespace.values()):
        visit(value)
    return found


# --- each magic against torch.func -----------------------------------------------------------
def test_grad_binds_gradients_of_every_named_input(shell):
    ok(shell, "%%grad --wrt x w\n((x @ w - y) ** 2).mean()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    dx, dw = torch.func.grad(loss, argnums=(0, 2))(x, y, w)
    assert_close(ns(shell)["dx"], dx)
    assert_close(ns(shell)["dw"], dw)


def test_grad_names_by_commas_and_out(shell):
    ok(shell, "%%grad --wrt x, w --out gx gw -q\n((x @ w - y) ** 2).mean()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    assert_close(ns(shell)["gw"], torch.func.grad(loss, argnums=2)(x, y, w))
    assert_close(ns(shell)["gx"], torch.func.grad(loss, argnums=0)(x, y, w))
    assert "dx" not in ns(shell) and "dw" not in ns(shell)


def test_grad_argnums_selects_among_wrt(shell):
    ok(shell, "%%grad --wrt x w --argnums 1\n((x @ w - y) ** 2).mean()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    assert_close(ns(shell)["dw"], torch.func.grad(loss, argnums=2)(x, y, w))
    assert "dx" not in ns(shell)


def test_grad_value_and_has_aux(shell):
    ok(shell, "%%grad --wrt w --has-aux --value\nr = x @ w - y\n(r ** 2).mean(), r")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]

    def with_aux(w):
        r = x @ w - y
        return (r ** 2).mean(), r
    g, (value, aux) = torch.func.grad_and_value(with_aux, has_aux=True)(w)
    assert_close(ns(shell)["dw"], g)
    assert_close(ns(shell)["aux"], aux)
    assert_close(ns(shell)["value"], value)
    assert "r" not in ns(shell)


def test_grad_aux_out_and_value_out(shell):
    ok(shell, "%%grad --wrt w --has-aux --aux-out resid --value-out L -q\n"
              "r = x @ w - y\n(r ** 2).mean(), r")
    assert_close(ns(shell)["L"], loss(ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]))
    assert ns(shell)["resid"].shape == (5,)
    assert "value" not in ns(shell) and "aux" not in ns(shell)


def test_grad_of_a_dict_of_parameters(shell):
    ok(shell, "model = torch.nn.Linear(3, 1)\n"
              "params = {k: v.detach() for k, v in model.named_parameters()}\n"
              "from minifunctorch.core import functional_call")
    ok(shell, "%%grad --wrt params\n"
              "((functional_call(model, params, (x,)).squeeze(-1) - y) ** 2).mean()")
    model, params, x, y = (ns(shell)[k] for k in ("model", "params", "x", "y"))

    def f(params):
        return ((torch.func.functional_call(model, params, (x,)).squeeze(-1) - y) ** 2).mean()
    expected = torch.func.grad(f)(params)
    assert set(ns(shell)["dparams"]) == set(expected)
    for key in expected:
        assert_close(ns(shell)["dparams"][key], expected[key])


def test_grad_check_prints_the_difference(shell, capsys):
    ok(shell, "%%grad --wrt x w --check -q\n((x @ w - y) ** 2).mean()")
    assert "check against torch.func" in capsys.readouterr().out
    magics = shell.magics_manager.registry["TransformMagics"]
    assert set(magics.last_check) == {"dx", "dw"}
    assert max(magics.last_check.values()) < 1e-5


def test_vmap_runs_the_cell_per_example(shell):
    ok(shell, "%%vmap --over x\nx @ w")
    x, w = ns(shell)["x"], ns(shell)["w"]
    assert_close(ns(shell)["out"], torch.func.vmap(lambda x: x @ w)(x))


def test_vmap_in_dims_out_dims_chunk_size_and_out(shell):
    ok(shell, "xt = x.T.contiguous()")
    ok(shell, "%%vmap --over xt y --in-dims 1 0 --out-dims 1 --chunk-size 2 --out z\n"
              "torch.stack([xt @ w, y * w[0]])")
    xt, y, w = ns(shell)["xt"], ns(shell)["y"], ns(shell)["w"]
    expected = torch.func.vmap(lambda a, b: torch.stack([a @ w, b * w[0]]), in_dims=(1, 0),
                               out_dims=1)(xt, y)
    assert ns(shell)["z"].shape == (2, 5)
    assert_close(ns(shell)["z"], expected)


def test_vmap_in_dims_none_leaves_an_input_unbatched(shell):
    ok(shell, "%%vmap --over x w --in-dims 0 None\nx @ w")
    assert_close(ns(shell)["out"], ns(shell)["x"] @ ns(shell)["w"])


def test_jvp_binds_tangent_and_value(shell):
    ok(shell, "%%jvp --wrt w --tangent t --check -q\ntorch.sin(x @ w)")
    x, w, t = ns(shell)["x"], ns(shell)["w"], ns(shell)["t"]
    value, tangent = torch.func.jvp(lambda w: torch.sin(x @ w), (w,), (t,))
    assert_close(ns(shell)["out"], value)
    assert_close(ns(shell)["out_dot"], tangent)


def test_jvp_renamed_outputs(shell):
    ok(shell, "%%jvp --wrt w --tangent t --out Jt --value-out f -q\ntorch.sin(x @ w)")
    assert {"Jt", "f"} <= set(ns(shell))
    assert "out" not in ns(shell) and "out_dot" not in ns(shell)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_jacobian(shell, mode):
    ok(shell, f"%%jacobian --wrt w x --mode {mode}\ntorch.sin(x @ w)")
    x, w = ns(shell)["x"], ns(shell)["w"]
    jac_w, jac_x = torch.func.jacrev(lambda w, x: torch.sin(x @ w), argnums=(0, 1))(w, x)
    assert_close(ns(shell)["jac_w"], jac_w)
    assert_close(ns(shell)["jac_x"], jac_x)


def test_hessian(shell):
    ok(shell, "%%hessian --wrt w\n((x @ w - y) ** 2).mean() + w.sin().sum()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    expected = torch.func.hessian(lambda w: loss(x, y, w) + w.sin().sum())(w)
    assert_close(ns(shell)["hess_w"], expected)


def test_hessian_blocks_of_two_inputs(shell):
    ok(shell, "%%hessian --wrt w t -q\n(w * t).sin().sum()")
    w, t = ns(shell)["w"], ns(shell)["t"]
    blocks = torch.func.hessian(lambda w, t: (w * t).sin().sum(), argnums=(0, 1))(w, t)
    for a, name_a in enumerate("wt"):
        for b, name_b in enumerate("wt"):
            assert_close(ns(shell)[f"hess_{name_a}_{name_b}"], blocks[a][b])


# --- stacking --------------------------------------------------------------------------------
def test_vmap_of_grad_is_per_example_gradients(shell):
    ok(shell, "%%vmap --over x y\n%%grad --wrt w\n((x @ w - y) ** 2).mean()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    expected = torch.func.vmap(torch.func.grad(loss, argnums=2), in_dims=(0, 0, None))(x, y, w)
    assert ns(shell)["dw"].shape == (5, *w.shape)
    assert_close(ns(shell)["dw"], expected)


def test_vmap_of_grad_with_value_batches_the_value(shell):
    ok(shell, "%%vmap --over x y\n%%grad --wrt w --value\n((x @ w - y) ** 2).mean()")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    assert_close(ns(shell)["value"], (x @ w - y) ** 2)


def test_grad_of_vmap_reduced(shell):
    ok(shell, "%%grad --wrt w\n%%vmap --over x y --reduce mean\n(x @ w - y) ** 2")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    per_example = torch.func.vmap(lambda x, y, w: (x @ w - y) ** 2, in_dims=(0, 0, None))
    expected = torch.func.grad(lambda w: per_example(x, y, w).mean())(w)
    assert_close(ns(shell)["dw"], expected)


def test_jvp_of_grad_is_a_hessian_vector_product(shell):
    ok(shell, "%%jvp --wrt w --tangent t\n%%grad --wrt w\n(x @ w).sin().sum()")
    x, w, t = ns(shell)["x"], ns(shell)["w"], ns(shell)["t"]

    def f(w):
        return (x @ w).sin().sum()
    hvp = torch.func.jvp(torch.func.grad(f), (w,), (t,))[1]
    assert_close(ns(shell)["dw_dot"], hvp)
    assert_close(ns(shell)["dw"], torch.func.grad(f)(w))


def test_three_levels_vmap_jvp_grad(shell):
    ok(shell, "%%vmap --over x\n%%jvp --wrt w --tangent t\n%%grad --wrt w\n(x @ w).sin()")
    x, w, t = ns(shell)["x"], ns(shell)["w"], ns(shell)["t"]

    def hvp(x, w, t):
        return torch.func.jvp(torch.func.grad(lambda w: (x @ w).sin()), (w,), (t,))[1]
    expected = torch.func.vmap(hvp, in_dims=(0, None, None))(x, w, t)
    assert_close(ns(shell)["dw_dot"], expected)


def test_vmap_of_vmap(shell):
    ok(shell, "%%vmap --over x\n%%vmap --over x\nx * w[0]")
    assert_close(ns(shell)["out"], ns(shell)["x"] * ns(shell)["w"][0])


def test_grad_of_grad(shell):
    ok(shell, "s = torch.tensor(0.5)")
    ok(shell, "%%grad --wrt s --out d2s\n%%grad --wrt s\ntorch.sin(s) * s")
    s = ns(shell)["s"]
    f = lambda s: torch.sin(s) * s  # noqa: E731
    assert_close(ns(shell)["d2s"], torch.func.grad(torch.func.grad(f))(s))


def test_stacked_check_compares_the_whole_stack(shell):
    ok(shell, "%%vmap --over x y --check\n%%grad --wrt w\n((x @ w - y) ** 2).mean()")
    magics = shell.magics_manager.registry["TransformMagics"]
    assert magics.last_check["dw"] < 1e-5


def test_trace_of_grad(shell):
    with capture_output() as captured:
        ok(shell, "%%trace --out prog\n%%grad --wrt w\n((x @ w - y) ** 2).mean()")
    program = ns(shell)["prog"]
    assert isinstance(program, core.Program)
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    assert_close(program(w), torch.func.grad(lambda w: loss(x, y, w))(w))
    assert any("text/html" in output.data for output in captured.outputs)
    assert "dw" not in ns(shell)  # %%trace shows the program: it does not run the stack


def test_trace_fx_and_split(shell):
    with capture_output() as captured:
        ok(shell, "%%trace --fx --split --inputs w --out pair\n((x @ w - y) ** 2).mean()")
    forward, backward = ns(shell)["pair"]
    assert isinstance(forward, core.Program) and isinstance(backward, core.Program)
    shown = "\n".join(output.data.get("text/plain", "") for output in captured.outputs)
    assert "def forward" in shown and "forward" in shown and "backward" in shown


def test_trace_inside_a_stack_is_refused(shell):
    error = fails(shell, "%%grad --wrt w\n%%trace\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "outermost" in str(error)


# --- cells are function bodies -------------------------------------------------------------
def test_assignments_do_not_leak_and_closures_see_inputs(shell):
    ok(shell, "%%grad --wrt w -q\n"
              "scale = 2.0\n"
              "terms = [x[i] @ w * scale for i in range(5)]\n"
              "torch.stack(terms).sum()")
    assert "scale" not in ns(shell) and "terms" not in ns(shell)
    x = ns(shell)["x"]
    assert_close(ns(shell)["dw"], 2.0 * x.sum(0))  # the comprehension saw the traced w


def test_a_cell_may_return(shell):
    ok(shell, "%%grad --wrt w -q\nif True:\n    return (w ** 2).sum()")
    assert_close(ns(shell)["dw"], 2 * ns(shell)["w"])


def test_a_cell_must_end_with_an_expression(shell):
    error = fails(shell, "%%grad --wrt w\nz = (w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "must end with an expression" in str(error)


def test_a_cell_needs_a_body(shell):
    error = fails(shell, "%%vmap --over x\n%%grad --wrt w\n")
    assert isinstance(error, UsageError)
    assert "no code below the magic line" in str(error)


def test_no_wrapped_value_reaches_the_namespace(shell):
    ok(shell, "%%grad --wrt x w --has-aux --value -q\nr = x @ w - y\n(r ** 2).mean(), (r, x)")
    ok(shell, "%%vmap --over x y -q\n%%grad --wrt w --value\n((x @ w - y) ** 2).mean()")
    ok(shell, "%%jvp --wrt w --tangent t -q\n%%grad --wrt w --has-aux\n((x @ w) ** 2).sum(), w")
    ok(shell, "%%jacobian --wrt w -q\n%%vmap --over x\nx @ w")
    assert wrapped_values(ns(shell)) == []


def test_display_is_an_escaped_html_table(shell):
    with capture_output() as captured:
        ok(shell, "%%grad --wrt w\n(w ** 2).sum()")
    (output,) = captured.outputs
    assert "<table>" in output.data["text/html"] and "<code>dw</code>" in output.data["text/html"]
    assert "dw: f32[3]" in output.data["text/plain"]
    page = Results("%%grad --wrt <b>", {"a<b": torch.ones(1)})._repr_html_()
    assert "<b>" not in page and "&lt;b&gt;" in page and "a&lt;b" in page


def test_quiet_displays_nothing(shell):
    with capture_output() as captured:
        ok(shell, "%%grad --wrt w -q\n(w ** 2).sum()")
    assert captured.outputs == []


# --- tapes -----------------------------------------------------------------------------------
def test_tape_line_magic_before_any_grad(shell):
    error = fails(shell, "%tape")
    assert isinstance(error, UsageError)
    assert "%%grad cell first" in str(error)


def test_tape_flag_and_tape_line_magic_show_the_stepper(shell):
    with capture_output() as captured:
        ok(shell, "%%grad --wrt w --tape -q\n(w.sin() * w).sum()")
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)
    magics = shell.magics_manager.registry["TransformMagics"]
    assert len(magics.last_tapes) == 1
    assert [entry.prim.name for entry in magics.last_tapes[0]] == ["sin", "mul", "sum"]
    assert "w" in magics.last_tapes[0].entries[0].inputs  # inputs carry their notebook names
    with capture_output() as captured:
        ok(shell, "%tape")
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in captured.outputs)


# --- the notebook's names -------------------------------------------------------------------
MLP = """
torch.manual_seed(1)
X = torch.randn(6, 3)
Y = torch.randn(6, 1)
W1 = torch.randn(3, 4)
W2 = torch.randn(4, 1)
"""
MLP_CELL = ("%%grad --wrt W1 W2 --tape -q\n"
            "h = torch.tanh(X @ W1)\n"
            "pred = h @ W2\n"
            "loss = ((pred - Y) ** 2).mean()\n"
            "loss")


def mlp_loss(W1, W2, X, Y):
    return ((torch.tanh(X @ W1) @ W2 - Y) ** 2).mean()


def last_tape_text(shell):
    return str(shell.magics_manager.registry["TransformMagics"].last_tapes[0])


def test_a_tape_over_an_mlp_shows_the_notebooks_names(shell):
    ok(shell, MLP)
    with capture_output() as captured:
        ok(shell, MLP_CELL)
    tape = last_tape_text(shell)
    assert tape.splitlines() == [
        "v0:f32[6,4] = matmul X W1",
        "h:f32[6,4] = tanh v0",
        "pred:f32[6,1] = matmul h W2",
        "v3:f32[6,1] = sub pred Y",
        "v4:f32[6,1] = pow v3 2",
        "loss:f32[] = mean v4 dim=(0,1) keepdim=False",
    ]
    assert not re.search(r"\bc\d+\b", tape)
    (stepper,) = [o.data["text/plain"] for o in captured.outputs]  # -q: only the stepper
    for name in ("X", "Y", "W1", "W2", "h", "pred", "loss"):
        assert re.search(rf"\b{name}\b", stepper), name
    assert not re.search(r"\bc\d+\b", stepper) and re.search(r"\n  loss .*← seed", stepper)
    expected = torch.func.grad(mlp_loss, argnums=(0, 1))(*(ns(shell)[k] for k in
                                                            ("W1", "W2", "X", "Y")))
    assert_close(ns(shell)["dW1"], expected[0])
    assert_close(ns(shell)["dW2"], expected[1])
    for name in ("X", "Y", "W1", "W2"):  # labels ride on views, never on the notebook's tensors
        assert not hasattr(ns(shell)[name], "t_name")
    assert not {"h", "pred", "loss"} & set(ns(shell))


def test_a_dict_of_parameters_is_named_by_its_keys(shell):
    ok(shell, 'params = {"w": torch.ones(3), "b": torch.zeros(())}; x = torch.arange(3.0)')
    ok(shell, '%%grad --wrt params --tape -q\nout = (x * params["w"]).sum() + params["b"]\nout')
    assert last_tape_text(shell).splitlines() == [
        "v0:f32[3] = mul x w",
        "v1:f32[] = sum v0 dim=(0,) keepdim=False",
        "out:f32[] = add v1 b",
    ]
    assert_close(ns(shell)["dparams"], {"w": torch.arange(3.0), "b": torch.tensor(1.0)})
    assert not any(hasattr(t, "t_name") for t in ns(shell)["params"].values())


def test_names_restart_per_call(shell):
    ok(shell, MLP)
    ok(shell, MLP_CELL)
    first = last_tape_text(shell)
    ok(shell, MLP_CELL)
    assert last_tape_text(shell) == first


def test_a_reassigned_variable_names_each_value_once(shell):
    ok(shell, "%%grad --wrt w --tape -q\nh = x @ w\nfor _ in range(2):\n    h = torch.sin(h)\n"
              "h.sum()")
    assert last_tape_text(shell).splitlines()[:3] == [
        "h:f32[5] = matmul x w", "h_1:f32[5] = sin h", "h_2:f32[5] = sin h_1"]
    x, w = ns(shell)["x"], ns(shell)["w"]
    assert_close(ns(shell)["dw"], torch.func.grad(lambda w: (x @ w).sin().sin().sum())(w))


def test_a_value_already_used_keeps_its_engine_name(shell):
    # v0 is read by the sum before `h = ...`: renaming it would cut the tape's links
    ok(shell, "%%grad --wrt w --tape -q\nparts = [x @ w]\ns = parts[0].sum()\nh = parts[0]\n"
              "s + (h ** 2).sum()")
    tape = last_tape_text(shell)
    assert "h:" not in tape and "s:f32[] = sum v0" in tape
    x, w = ns(shell)["x"], ns(shell)["w"]
    assert_close(ns(shell)["dw"],
                 torch.func.grad(lambda w: (x @ w).sum() + ((x @ w) ** 2).sum())(w))


def test_names_of_the_engines_form_are_not_given(shell):
    ok(shell, "%%grad --wrt w --tape -q\nv7 = x @ w\nc0 = v7 * 2\nc0.sum()")
    assert last_tape_text(shell).splitlines()[:2] == ["v0:f32[5] = matmul x w",
                                                      "v1:f32[5] = mul v0 2"]


def test_trace_names_inputs_and_captured_tensors(shell):
    with capture_output() as captured:
        ok(shell, "%%trace --fx --out prog\n%%grad --wrt w\n((x @ w - y) ** 2).mean()")
    shown = captured.outputs[1].data["text/plain"]
    assert shown.splitlines()[0] == "{ lambda x:f32[5,3] y:f32[5] ; w:f32[3] ."
    assert "  let a:f32[5] = matmul x w" in shown
    html = captured.outputs[1].data["text/html"]
    assert '<span class="mft-var">x</span>' in html
    code = captured.outputs[2].data["text/plain"]  # the FX code reads with the same names
    assert code.startswith("def forward(self, w):") and "x = self.x" in code
    program = ns(shell)["prog"]  # the bound program is the engine's own
    assert type(program) is core.Program and repr(program).startswith("<Program cell:")
    assert str(program).startswith("{ lambda b:f32[5,3] c:f32[5] ; a:f32[3] .")
    x, y, w = ns(shell)["x"], ns(shell)["y"], ns(shell)["w"]
    assert_close(program(w), torch.func.grad(lambda w: loss(x, y, w))(w))


# --- errors ---------------------------------------------------------------------------------
def one_line(error):
    """A magic's mistake is one line that begins with the magic as written."""
    text = str(error)
    assert "\n" not in text, text
    return text


def test_misspelled_flag_is_named_and_the_right_one_suggested(shell):
    error = fails(shell, "%%grad --wtr w\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert one_line(error).startswith("%%grad --wtr w: unknown flag --wtr; did you mean --wrt?")
    assert "required" not in str(error)  # not argparse's "the following arguments are required"


def test_unknown_flag_without_a_close_one(shell):
    error = fails(shell, "%%grad --wrt w --bogus\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert one_line(error) == ("%%grad --wrt w --bogus: unknown flag --bogus (%%grad? lists its "
                               "flags)")


def test_abbreviated_flags_and_negative_dims_are_not_unknown(shell):
    ok(shell, "%%grad --wrt x w --argn 1 -q\n(w ** 2).sum()")  # argparse's abbreviation
    assert_close(ns(shell)["dw"], 2 * ns(shell)["w"])
    ok(shell, "%%vmap --over x --in-dims -2 -q\nx * 2")
    assert_close(ns(shell)["out"], ns(shell)["x"] * 2)


def test_missing_required_flag(shell):
    error = fails(shell, "%%vmap\nx")
    assert isinstance(error, UsageError)
    assert one_line(error) == ("%%vmap: the following arguments are required: --over "
                               "(%%vmap? lists its flags)")


@pytest.mark.parametrize("line, message", [
    ("%%grad --wrt w --argnums 3", "out of range"),
    ("%%grad --wrt w w", "twice"),
    ("%%grad --wrt 1x", "not a Python variable name"),
    ("%%grad --wrt w --aux-out a", "--has-aux"),
    ("%%vmap --over x y --in-dims 0 1 2", "--in-dims gives 3 dims"),
    ("%%vmap --over x --in-dims zero", "not a dim"),
    ("%%vmap --over x --chunk-size 0", "positive"),
    ("%%jvp --wrt w --tangent t x", "one tangent per input"),
    ("%%jacobian --wrt w --mode fwd --chunk-size 2", "--mode rev only"),
    ("%%grad --wrt w --out a b", "one name per output"),
])
def test_bad_flag_values(shell, line, message):
    error = fails(shell, f"{line}\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert one_line(error).startswith(f"{line}: ")
    assert message in str(error) and "Fix: " in str(error)


def test_undefined_name(shell):
    error = fails(shell, "%%grad --wrt nope\n(nope ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "'nope' is not defined in the notebook" in str(error)


def test_non_tensor_input(shell):
    ok(shell, "k = 3")
    error = fails(shell, "%%grad --wrt k\nk * 2")
    assert isinstance(error, UsageError)
    assert "the input k is a int" in str(error)


def shown_error(shell, source, capsys):
    """Run a failing cell; return the exception and what the shell printed for it."""
    capsys.readouterr()
    error = fails(shell, source)
    return error, capsys.readouterr().out


def assert_no_engine_frames(shown):
    for sign in ("/core/", "/magics/", "site-packages", ".py:", "Traceback", "get_ipython()"):
        assert sign not in shown, (sign, shown)


def test_non_scalar_result_names_the_magic_and_shows_the_cell_line(shell, capsys):
    shell.execution_count = 4
    error, shown = shown_error(shell, "%%grad --wrt w\nx @ w", capsys)
    assert type(error) is NonScalarOutputError  # the engine's error, with the magic's words
    assert str(error).startswith("%%grad --wrt w: grad_and_value(f)(*args): Expected f(*args) "
                                 "to return a scalar Tensor")
    assert "Fix: " in str(error) and "%%jacobian" in str(error)
    assert shown.splitlines() == ["Cell In[4], line 2", "----> 2 x @ w",
                                  f"NonScalarOutputError: {error}"]


def test_an_engine_error_in_a_stack_names_the_magic_it_is_about(shell, capsys):
    # the non-scalar result is %%grad's error, although %%vmap is the outer magic
    error, shown = shown_error(shell, "%%vmap --over x y\n%%grad --wrt w\nx * w", capsys)
    assert str(error).startswith("%%grad --wrt w: grad_and_value(f)(*args): Expected f(*args) "
                                 "to return a scalar Tensor")
    assert "----> 3 x * w" in shown
    assert_no_engine_frames(shown)
    # an `if` on a batched value is %%vmap's, raised on the cell's own line
    error, shown = shown_error(
        shell, "%%vmap --over x\n%%grad --wrt w\nz = (x @ w).sin()\nif z > 0:\n    z = -z\nz",
        capsys)
    assert type(error) is core.BatchedControlFlowError
    assert str(error).startswith("%%vmap --over x: It looks like you're calling .item() on a "
                                 "Tensor or attempting to use a Tensor in some data-dependent")
    assert "torch.where" in str(error)
    assert "----> 4 if z > 0:" in shown
    assert_no_engine_frames(shown)


@pytest.mark.parametrize("source, kind, start", [
    ("%%vmap --over x\nx + torch.randn(3)", core.RandomnessError,
     "%%vmap --over x: vmap: called random operation while in randomness error mode. Please "
     "either use the 'same' or 'different' randomness flags on vmap or perform the randomness "
     "operation out of vmap. torch.randn"),
    ("%%grad --wrt w\ntorch.linalg.ldl_factor(torch.outer(w, w) + torch.eye(3))[0].sum()",
     core.TransformError, "%%grad --wrt w: "),
])
def test_randomness_and_unsupported_ops_are_short(shell, capsys, source, kind, start):
    error, shown = shown_error(shell, source, capsys)
    assert isinstance(error, kind)
    assert str(error).startswith(start)
    assert "----> 2 " in shown and "Fix: " in shown
    assert_no_engine_frames(shown)


def test_a_notebook_function_called_by_the_cell_shows_its_line(shell, capsys):
    shell.execution_count = 10
    ok(shell, "def helper(v):\n    if v.sum() > 0:\n        return v\n    return -v")
    shell.execution_count = 11
    error, shown = shown_error(shell, "%%vmap --over x\nhelper(x)", capsys)
    assert shown.splitlines()[:4] == ["Cell In[11], line 2", "----> 2 helper(x)",
                                      "Cell In[10], line 2, in helper", "----> 2 if v.sum() > 0:"]


def test_engine_errors_outside_magics_are_short_while_the_extension_is_loaded(shell, capsys):
    ok(shell, "from minifunctorch.core import vmap\n"
              "def g(x):\n    return x if x < 1 else 2 * x")
    error, shown = shown_error(shell, "vmap(g)(torch.tensor([0.5, 3.0]))", capsys)
    assert type(error) is core.BatchedControlFlowError
    assert "----> 1 vmap(g)(torch.tensor([0.5, 3.0]))" in shown
    assert "in g" in shown and "----> 3     return x if x < 1 else 2 * x".replace("    ", "") \
        in shown
    assert shown.strip().endswith(f"BatchedControlFlowError: {error}")
    assert_no_engine_frames(shown)
    ok(shell, "%xmode verbose")  # every frame, as IPython shows any other error
    _, shown = shown_error(shell, "vmap(g)(torch.tensor([0.5, 3.0]))", capsys)
    assert "transforms.py" in shown
    ok(shell, "%xmode context")
    ok(shell, "%unload_ext minifunctorch.magics")
    assert not hasattr(core.TransformError, "_render_traceback_")


def test_a_comment_above_a_magic_works(shell):
    ok(shell, "# the gradient of the loss\n\n%%grad --wrt w -q\n(w ** 2).sum()")
    assert_close(ns(shell)["dw"], 2 * ns(shell)["w"])
    ok(shell, "# per-example gradients\n%%vmap --over x y -q\n%%grad --wrt w\n"
              "((x @ w - y) ** 2).mean()")
    assert ns(shell)["dw"].shape == (5, 3)


def test_a_comment_above_keeps_the_line_numbers_of_the_cell(shell, capsys):
    shell.execution_count = 3
    _, shown = shown_error(shell, "# a comment\n%%grad --wrt w\nx @ w", capsys)
    assert shown.splitlines()[:2] == ["Cell In[3], line 3", "----> 3 x @ w"]


def test_a_magic_below_code_says_first_line(shell):
    error = fails(shell, "z = 1\n%%grad --wrt w\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert one_line(error).startswith("%%grad --wrt w: a cell magic must be the first line of "
                                      "its cell")
    assert "z" not in ns(shell)  # nothing ran


def test_has_aux_without_a_pair(shell):
    error = fails(shell, "%%grad --wrt w --has-aux\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "expected the cell to return a pair" in str(error)


def test_stacking_a_foreign_magic_is_refused(shell):
    error = fails(shell, "%%vmap --over x\n%%time\nx")
    assert isinstance(error, UsageError)
    assert "can be stacked" in str(error)


def test_grad_over_two_gradients_is_refused(shell):
    error = fails(shell, "%%grad --wrt w\n%%grad --wrt x w\n((x @ w) ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "single output" in str(error) and "dx, dw" in str(error)


def test_output_name_clash_is_refused(shell):
    error = fails(shell, "%%grad --wrt w --value --value-out dw\n(w ** 2).sum()")
    assert isinstance(error, UsageError)
    assert "dw twice" in str(error)


def test_error_in_the_cell_points_at_the_cell(shell, capsys):
    shell.execution_count = 7
    result = shell.run_cell("%%vmap --over x y\n%%grad --wrt w\nz = x @ w\nz / undefined_name",
                            store_history=True)
    error = result.error_in_exec
    assert isinstance(error, NameError)
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    cell_frames = [f for f in frames if f.tb_frame.f_code.co_name == "cell"
                   and f.tb_frame.f_code.co_filename.startswith("<ipython-input-")]
    (cell_frame,) = cell_frames
    filename = cell_frame.tb_frame.f_code.co_filename
    assert cell_frame.tb_lineno == 4  # the line numbers of the whole cell
    assert linecache.getline(filename, 4).strip() == "z / undefined_name"
    magic_frames = [f for f in frames if "/magics/" in f.tb_frame.f_code.co_filename]
    assert all(f.tb_frame.f_locals.get("__tracebackhide__") for f in magic_frames)
    shown = capsys.readouterr().out
    assert "Cell In[7], line 1" in shown  # the cell as IPython runs it: run_cell_magic(...)
    assert "Cell In[7], line 4" in shown and "----> 4 z / undefined_name" in shown
    assert "stack.py" not in shown and "transforms.py" not in shown


def test_syntax_error_points_at_the_cell(shell):
    error = fails(shell, "%%grad --wrt w\nz = (w **\n(w ** 2).sum()")
    assert isinstance(error, SyntaxError)
    assert error.lineno in (2, 3)


def test_a_failed_cell_leaves_the_namespace_as_it_was(shell):
    ok(shell, "dw = 'before'")
    before = dict(ns(shell))
    fails(shell, "%%grad --wrt w --value\nnew_name = 1\n(w ** 2).sum() + undefined_name")
    fails(shell, "%%grad --wrt w --value\n(w ** 2)")  # non-scalar
    fails(shell, "%%vmap --over x w\nx @ w")          # batch sizes differ: an engine error
    fails(shell, "%%grad --wtr w\n(w ** 2).sum()")    # a flag mistake
    fails(shell, "%%vmap --over x\nh = x * y[0]\nif h.sum() > 0:\n    h = -h\nh")
    fails(shell, "# a comment\n%%grad --wrt w\nloss = x @ w\nloss")
    assert ns(shell)["dw"] == "before"
    assert not hasattr(ns(shell)["x"], "t_name") and not hasattr(ns(shell)["y"], "t_name")
    assert "h" not in ns(shell) and "loss" not in ns(shell)
    ok(shell, "%%grad --wrt w -q\n(w ** 2).sum()")   # and the next call works
    assert_close(ns(shell)["dw"], 2 * ns(shell)["w"])
    assert "value" not in ns(shell) and "new_name" not in ns(shell)
    assert set(ns(shell)) - set(before) <= {"_", "__", "___", "_i", "_ii", "_iii"} | {
        k for k in ns(shell) if k.startswith("_i")}


# --- the extension -------------------------------------------------------------------------
def test_load_twice_is_harmless_and_unload_removes_the_magics(shell):
    ok(shell, "%%grad --wrt w -q\n(w ** 2).sum()")
    magics = shell.magics_manager.registry["TransformMagics"]
    ok(shell, "%load_ext minifunctorch.magics")
    load_ipython_extension(shell)  # directly, twice: the same instance stays registered
    assert shell.magics_manager.registry["TransformMagics"] is magics
    ok(shell, "%unload_ext minifunctorch.magics")
    for name in ("grad", "vmap", "jvp", "jacobian", "hessian", "trace"):
        assert name not in shell.magics_manager.magics["cell"]
    assert "tape" not in shell.magics_manager.magics["line"]
    assert "TransformMagics" not in shell.magics_manager.registry
    unload_ipython_extension(shell)  # unloading again is harmless too
    assert fails(shell, "%%grad --wrt w\n(w ** 2).sum()") is not None
    ok(shell, "%load_ext minifunctorch.magics")
    ok(shell, "%%grad --wrt w -q\n(w ** 2).sum()")


def test_reload_ext(shell):
    ok(shell, "%reload_ext minifunctorch.magics")
    ok(shell, "%%grad --wrt w -q\n(w ** 2).sum()")
    assert_close(ns(shell)["dw"], 2 * ns(shell)["w"])


def test_help_shows_usage_and_every_flag(shell):
    for name in ("grad", "vmap", "jvp", "jacobian", "hessian", "trace"):
        magic = shell.find_cell_magic(name)
        doc = magic.__doc__
        assert f"%%{name}" in doc
        for action in magic.parser._actions:
            for option in action.option_strings:
                assert option in doc, (name, option)


def test_importing_the_package_does_not_import_ipython():
    code = "import sys, minifunctorch.magics; print('IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
