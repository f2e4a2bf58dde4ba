"""Every primitive has a shape rule, an impl and one rule in each transform's table.

A failure names the primitive and the missing rule (CONTRIBUTING.md, "A new primitive").
"""
import subprocess
import sys

import pytest
import torch

from minifunctorch.core import PRIMITIVES, Primitive, batching_rules, jvp_rules, vjp_rules

NAMES = sorted(PRIMITIVES)

# One set of sample arguments per primitive, for its impl and its shape rule.
x23 = torch.randn(2, 3, dtype=torch.float64)
SAMPLES = {
    "neg": ((x23,), {}), "exp": ((x23,), {}), "log": ((x23.abs() + 1,), {}),
    "sin": ((x23,), {}), "cos": ((x23,), {}), "tanh": ((x23,), {}), "sigmoid": ((x23,), {}),
    "relu": ((x23,), {}), "abs": ((x23,), {}), "sqrt": ((x23.abs(),), {}),
    "sign": ((x23,), {}),
    **{name: ((x23, torch.ones(3, dtype=torch.float64)), {})
       for name in ("add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge")},
    "where": ((x23 > 0, x23, 0.0), {}),
    **{name: ((x23,), {"dim": (1,), "keepdim": False})
       for name in ("sum", "mean", "amax", "amin", "logsumexp")},
    "softmax": ((x23,), {"dim": 1}), "log_softmax": ((x23,), {"dim": 1}),
    "softmax_backward": ((x23, torch.softmax(x23, 1)), {"dim": 1}),
    "log_softmax_backward": ((x23, torch.log_softmax(x23, 1)), {"dim": 1}),
    "matmul": ((x23, torch.ones(3, 4, dtype=torch.float64)), {}),
    "permute": ((x23,), {"dims": (1, 0)}), "reshape": ((x23,), {"shape": (3, 2)}),
    "unsqueeze": ((x23,), {"dim": 0}), "squeeze": ((x23[:1],), {"dim": (0,)}),
    "expand": ((x23[:1],), {"shape": (4, 3)}),
    "cat": ((x23, x23), {"dim": 0}),
    "getitem": ((x23,), {"index": (1, slice(0, 2, 1))}),
    "scatter_index": ((torch.ones(2, dtype=torch.float64),),
                      {"index": (1, slice(0, 2, 1)), "shape": (2, 3)}),
    "diagonal": ((x23,), {"offset": 0, "dim1": 0, "dim2": 1}),
    "diag_embed": ((x23,), {"offset": 0, "dim1": 1, "dim2": 2}),
    "diagonal_scatter": ((torch.ones(2, dtype=torch.float64),),
                         {"offset": 0, "dim1": 0, "dim2": 1, "shape": (2, 3)}),
    "gather": ((x23, torch.zeros(2, 2, dtype=torch.long)), {"dim": 1}),
    "scatter_add": ((torch.ones(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.long)),
                    {"dim": 1, "shape": (2, 3)}),
    "full_like": ((x23,), {"fill_value": 2.0}),
    "convert": ((x23,), {"dtype": torch.float32}),
    "detach": ((x23,), {}),
    "clone": ((x23,), {}),
    "to_device": ((x23,), {"device": torch.device("cpu")}),
    "div_rounding": ((x23, torch.ones(3, dtype=torch.float64)), {"rounding_mode": "floor"}),
    "softplus_backward": ((x23, x23), {"beta": 2.0, "threshold": 1.5}),
    "log_sigmoid_backward": ((x23, x23), {}),
    "elu_backward": ((x23, x23), {"alpha": 0.7, "scale": 1.2, "input_scale": 0.9}),
    "layer_norm": ((x23, torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)),
                   {"normalized_shape": (3,), "eps": 1e-5, "affine": ("weight", "bias")}),
    "layer_norm_stats": ((x23,), {"normalized_shape": (3,), "eps": 1e-5}),
    "layer_norm_backward_input": ((x23, x23, x23[:, :1], x23[:, :1].abs()),
                                  {"normalized_shape": (3,), "affine": ()}),
    "layer_norm_backward_params": ((x23, x23, x23[:, :1], x23[:, :1].abs()),
                                   {"normalized_shape": (3,)}),
    "group_norm": ((x23, torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)),
                   {"num_groups": 3, "eps": 1e-5, "affine": ("weight", "bias")}),
    "group_norm_stats": ((x23,), {"num_groups": 1, "eps": 1e-5}),
}


def test_primitives_are_registered_under_their_names():
    assert NAMES, "PRIMITIVES is empty"
    for name, prim in PRIMITIVES.items():
        assert isinstance(prim, Primitive) and prim.name == name, name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_impl_and_shape_rule(name):
    prim = PRIMITIVES[name]
    assert callable(prim.impl), f"primitive '{name}' has no impl"
    args, params = SAMPLES[name]
    out = prim.impl(*args, **params)
    shape, dtype = prim.shape_rule(*args, **params)
    assert (tuple(shape), dtype) == (tuple(out.shape), out.dtype), (
        f"the shape rule of '{name}' says {tuple(shape)} {dtype}, its impl gives "
        f"{tuple(out.shape)} {out.dtype}"
    )


TABLES = {"vjp": vjp_rules, "jvp": jvp_rules, "batching": batching_rules}


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("name", NAMES)
def test_rule_is_registered(name, table):
    prim, rules = PRIMITIVES[name], TABLES[table]
    if table != "batching" and not prim.differentiable:
        return  # every level treats a non-differentiable primitive the same way
    assert prim in rules, f"primitive '{name}' has no {table} rule ({table}_rules[{name}_p])"
    assert callable(rules[prim]), f"the {table} rule of '{name}' is not callable"


def test_core_does_not_import_ipython_or_widgets():
    code = (
        "import sys\n"
        "import minifunctorch.core\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'ipywidgets'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
