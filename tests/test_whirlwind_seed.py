"""The functorch "whirlwind tour" runs unchanged on minifunctorch.

The test reads the tour's code cells from the reference copy in ../shared/seeds (it is not
copied into this repository), runs each cell twice, once with ``from functorch import ...``
pointed at ``torch.func`` and once at ``minifunctorch.core``, from the same random seed, and
compares every tensor the cell leaves in its namespace.
"""
import json
import sys
import types
from pathlib import Path

import pytest
import torch

SEEDS = Path(__file__).resolve().parent.parent.parent / "shared" / "seeds"


def _tour_cells():
    matches = sorted(SEEDS.glob("004_*.txt")) if SEEDS.is_dir() else []
    if not matches:
        # the seeds are reference material beside the repository, not part of it
        pytest.skip(f"the whirlwind tour seed is not available at {SEEDS}")
    lines = [line for line in matches[0].read_text().splitlines() if line.strip() != "|"]
    body = "\n".join(lines)
    notebook = json.loads(body[body.index("{"):body.rindex("}") + 1])
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _run_tour(transforms_module):
    """Run all cells against ``transforms_module`` posing as ``functorch``; namespaces per cell."""
    fake = types.ModuleType("functorch")
    fake.__dict__.update({name: getattr(transforms_module, name) for name in
                          ("grad", "vmap", "vjp", "jvp", "jacrev", "jacfwd", "hessian")})
    saved = sys.modules.get("functorch")
    sys.modules["functorch"] = fake
    namespace, snapshots = {}, []
    try:
        torch.manual_seed(0)
        for source in _tour_cells():
            exec(compile(source, "<whirlwind tour cell>", "exec"), namespace)
            snapshots.append({k: v.detach().clone() for k, v in namespace.items()
                              if isinstance(v, torch.Tensor)})
    finally:
        if saved is None:
            sys.modules.pop("functorch", None)
        else:
            sys.modules["functorch"] = saved
    return snapshots


def test_every_cell_of_the_tour_matches_torch_func():
    import minifunctorch.core
    ours = _run_tour(minifunctorch.core)
    reference = _run_tour(torch.func)
    assert len(ours) == len(reference) >= 10
    for index, (mine, theirs) in enumerate(zip(ours, reference)):
        assert mine.keys() == theirs.keys(), f"cell {index} defines different tensors"
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name],
                                       msg=lambda m: f"cell {index}, {name}: {m}")
