"""Shared fixtures of the test suite.

The helper modules next to this file (``op_table``) are importable by their plain names
whether or not ``tests`` is a package.
"""
import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


_CORE_TEST_MODULES = ("test_core_", "test_rules_complete")


@pytest.fixture(autouse=True)
def _no_level_left_behind(request):
    """Every core test starts and ends with only the Torch level on the transform stack."""
    module = getattr(request.node, "module", None)
    if module is None or not module.__name__.rpartition(".")[2].startswith(_CORE_TEST_MODULES):
        yield
        return
    from minifunctorch.core import dispatch
    assert not dispatch.transform_levels(), "a previous test left a transform level"
    yield
    assert not dispatch.transform_levels(), (
        f"the test left transform levels on the stack: {dispatch.transform_levels()}"
    )


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's sweep (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``), as the coverage sweep measures; the rest of the suite keeps its own."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
