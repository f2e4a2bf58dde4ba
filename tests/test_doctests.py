"""Every docstring example in the package runs as printed."""
import doctest
import importlib
import pkgutil

import pytest

import minifunctorch.core
import minifunctorch.magics
import minifunctorch.widgets
from minifunctorch.core import reset_names


def _modules():
    for package in (minifunctorch.core, minifunctorch.widgets, minifunctorch.magics):
        yield package.__name__
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            yield info.name


@pytest.mark.parametrize("module_name", sorted(set(_modules())))
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for test in finder.find(module, module_name):
        reset_names()  # each example starts from v0, as a fresh notebook cell would
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) in {module_name} failed"
