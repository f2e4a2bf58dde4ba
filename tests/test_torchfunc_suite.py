"""tools/torchfunc_suite.py and its pytest plugin tools/torchfunc_shim.py, on made-up tests
(PyTorch's own test files are not part of this repository)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_runner():
    spec = importlib.util.spec_from_file_location("torchfunc_suite", TOOLS / "torchfunc_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


suite = load_runner()

FAKE_TESTS = '''
import unittest
import warnings

import pytest
import torch
import torch.func
import functorch
from functorch import vmap
from functorch.experimental import functionalize

import minifunctorch.core


def test_names_point_at_the_engine_under_test():
    if ENGINE == "minifunctorch":
        assert torch.func.grad.__wrapped__ is minifunctorch.core.grad
        assert torch.vmap is torch.func.vmap
        assert torch.vmap.__wrapped__ is minifunctorch.core.vmap
        assert functorch.jacrev.__wrapped__.__wrapped__ is minifunctorch.core.jacrev
        assert torch._functorch.apis.vmap is not torch.vmap  # torch's internals stay torch's
    else:
        assert not hasattr(torch.func.grad, "__wrapped__")


def test_functorch_spelling_still_warns():
    with pytest.warns(FutureWarning, match="Please use `torch.vmap`"):
        vmap(torch.sin)


def test_grad_works():
    x = torch.tensor([0.5, 1.0])
    assert torch.allclose(vmap(torch.func.grad(torch.sin))(x), x.cos())


def test_functionalize_is_swapped_too():
    if ENGINE == "minifunctorch":
        assert functionalize.__wrapped__ is minifunctorch.core.functionalize
    assert torch.equal(functionalize(torch.sin)(torch.ones(2)), torch.ones(2).sin())


class Subtests(unittest.TestCase):
    def test_one_subtest_fails(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertNotEqual(i, 1)

    @unittest.expectedFailure
    def test_expected_failure(self):
        raise RuntimeError("known")
'''


def run_plugin(tmp_path, engine):
    tests = tmp_path / "test_fake.py"
    tests.write_text(f"ENGINE = {engine!r}\n" + FAKE_TESTS)
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    link = plugin_dir / "torchfunc_shim.py"
    if not link.exists():
        link.symlink_to(TOOLS / "torchfunc_shim.py")
    results = tmp_path / f"{engine}.jsonl"
    env = dict(os.environ, TORCHFUNC_SUITE_ENGINE=engine, TORCHFUNC_SUITE_RESULTS=str(results),
               TORCHFUNC_SUITE_TIMEOUT="60", PYTHONPATH=str(plugin_dir))
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                    "torchfunc_shim", "-q", "-W", "default", str(tests)],
                   cwd=tmp_path, env=env, capture_output=True, check=False)
    return suite.read_results(results)


def test_plugin_swaps_the_api_and_records_outcomes(tmp_path):
    header, collected, tests = run_plugin(tmp_path, "minifunctorch")
    assert header["engine"] == "minifunctorch"
    assert header["missing"] == []  # minifunctorch now has every name of the API
    assert len(collected) == 6
    outcome = {nodeid.split("::")[-1]: record for nodeid, record in tests.items()}
    assert outcome["test_names_point_at_the_engine_under_test"]["outcome"] == "passed"
    assert outcome["test_functorch_spelling_still_warns"]["outcome"] == "passed"
    assert outcome["test_grad_works"]["outcome"] == "passed"
    assert outcome["test_grad_works"]["engine_calls"] == 2
    assert outcome["test_functionalize_is_swapped_too"]["outcome"] == "passed"
    assert outcome["test_one_subtest_fails"]["outcome"] == "failed"  # a subtest failed
    assert outcome["test_expected_failure"]["outcome"] == "xfailed"


def test_plugin_leaves_torch_func_alone(tmp_path):
    header, collected, tests = run_plugin(tmp_path, "torch.func")
    assert header == {"engine": "torch.func", "torch": header["torch"]}
    outcome = {nodeid.split("::")[-1]: record["outcome"] for nodeid, record in tests.items()}
    assert outcome["test_names_point_at_the_engine_under_test"] == "passed"
    assert outcome["test_functionalize_is_swapped_too"] == "passed"


def test_a_name_minifunctorch_lacks_becomes_a_stub():
    spec = importlib.util.spec_from_file_location("torchfunc_shim", TOOLS / "torchfunc_shim.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    stub = shim._missing("frobnicate")
    assert stub.__name__ == "frobnicate"
    try:
        stub(1, key=2)
    except NotImplementedError as error:
        assert str(error).startswith("minifunctorch has no frobnicate: torchfunc_shim replaced")
    else:
        raise AssertionError("the stub for a missing name did not raise")


def test_normalize_groups_messages_of_one_cause():
    first = ("minifunctorch.core.errors.MissingRuleError: grad(foo)(<inputs>): "
             "aten._conj.default is not supported: it has no grad rule here. Fix: write it")
    second = ("minifunctorch.core.errors.MissingRuleError: grad(<lambda>)(<inputs>): "
              "aten.cummax.default is not supported: it has no grad rule here. Fix: other")
    assert suite.normalize(first) == suite.normalize(second) == (
        "MissingRuleError: grad(...): aten.<op> is not supported: it has no grad rule here.")
    assert suite.normalize("RuntimeError: size (3) must match (2) in conv2d") == \
        "RuntimeError: size (N) must match (N) in conv2d"
    assert suite.refused_operation(first) == "aten._conj.default"
    assert suite.refused_operation("AssertionError: Tensor-likes are not close!") is None


def fake_outcomes(torch_outcomes, our_outcomes):
    def results(engine, outcomes):
        tests = {f"test_vmap.py::TestX::{name}": {"nodeid": f"test_vmap.py::TestX::{name}",
                                                  "outcome": outcome, "engine_calls": 1,
                                                  "message": message}
                 for name, (outcome, message) in outcomes.items()}
        header = {"engine": engine, "torch": "2.13.0", "minifunctorch": "/nowhere"}
        return header, sorted(tests), tests, 1
    empty = ({"engine": "x", "torch": "2.13.0", "minifunctorch": "/nowhere"}, [], {}, 0)
    return {engine: {"test_eager_transforms.py": empty, "test_vmap.py": results(engine, outs)}
            for engine, outs in (("torch.func", torch_outcomes), ("minifunctorch", our_outcomes))}


def test_report_counts_only_tests_that_pass_on_torch_func(tmp_path):
    for name in suite.TEST_FILES + suite.HELPERS:
        (tmp_path / name).write_text("")
    outcomes = fake_outcomes(
        {"a": ("passed", None), "b": ("passed", None), "c": ("passed", None),
         "d": ("failed", "RuntimeError: needs CUDA")},
        {"a": ("passed", None), "b": ("failed", "RuntimeError: aten.foo.default is not supported"),
         "d": ("passed", None)})
    rows = suite.compare(outcomes)
    assert rows["test_vmap.py"]["baseline"] == [f"test_vmap.py::TestX::{n}" for n in "abc"]
    assert rows["test_vmap.py"]["here"]["test_vmap.py::TestX::c"]["outcome"] == "not run"
    assert rows["test_vmap.py"]["extra"] == ["test_vmap.py::TestX::d"]
    args = Namespace(suite_dir=tmp_path, keyword=None, top=10)
    text = suite.report(args, outcomes, rows, tmp_path)
    assert "33.3% of the tests that pass on torch.func pass here (1 of 3)" in text
    assert "| 1 | aten.foo.default |" in text
    assert json.dumps(text)  # plain text, no objects leaked into it
