"""The layers import only downward, and core/ has no import circle.

The graph is built from the source (every import statement, including those inside
functions: a lazy import that dodges a circle is still a circle), so the test needs no
import of the code it checks.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {"core": set(), "widgets": {"core"}, "magics": {"core", "widgets"}}


def import_graph():
    """module -> the project's modules it imports (``core.tensor`` -> {``core.ops``, ...})."""
    graph = {}
    for package in LAYERS:
        for path in (ROOT / package).glob("*.py"):
            module = f"{package}.{path.stem}"
            targets = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    names = [node.module] if node.module else [a.name for a in node.names]
                    targets |= {f"{package}.{name.split('.')[0]}" for name in names}
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "minifunctorch."):
                    parts = node.module.split(".")
                    targets.add(".".join(parts[1:3]) if len(parts) > 2 else
                                f"{parts[1]}.__init__")
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        parts = alias.name.split(".")
                        if parts[0] == "minifunctorch" and len(parts) > 1:
                            targets.add(".".join(parts[1:3]) if len(parts) > 2 else
                                        f"{parts[1]}.__init__")
            graph[module] = {t for t in targets if t != module}
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_core_has_no_import_circle():
    graph = import_graph()
    core = {m: {t for t in targets if t.startswith("core.") and not t.endswith("__init__")}
            for m, targets in graph.items() if m.startswith("core.") and
            not m.endswith("__init__")}
    assert len(core) > 20, "the graph of core/ was not built"
    assert cycles(core) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below(package):
    for module, targets in import_graph().items():
        if module.startswith(package + "."):
            layers = {t.split(".")[0] for t in targets}
            assert layers <= LAYERS[package] | {package}, (module, layers)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
