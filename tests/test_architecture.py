"""The layering contract (docs/contributing.md, Layers), read from the source with ``ast``: every import counts,
function-level and ``TYPE_CHECKING`` ones included.

- A module imports only modules of its own layer or a layer below. Bottom up: the contract (``schemas``), the
  base (``servelens.errors``, ``servelens.settings``, ``servelens.provenance``, ``servelens.sql``,
  ``servelens.layout``, the ``servelens`` package's version), ``privacy``, ``replay`` (the engine, its models
  and the analysis: metrics, comparison, gate), ``pipelines``, ``dashboard``, and the entry points (the rest
  of ``servelens``: the CLI, the configuration tree, the demo; and Dagster's code location:
  ``pipelines.definitions``, ``pipelines.dagster_*``).
- No import cycle among the project's modules.
- No function in the production packages over 60 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "privacy", "pipelines", "replay", "dashboard", "servelens")
#: The entry points (the command line, the configuration tree, the demo, Dagster's code location) sit on top.
ENTRY_POINTS = ("servelens", "pipelines.definitions", "pipelines.dagster_assets", "pipelines.dagster_resources")
#: Bottom up; a module belongs to the layer of its longest matching prefix (``servelens`` itself, the package
#: with the version, is base).
BASE = ("servelens.errors", "servelens.settings", "servelens.provenance", "servelens.sql", "servelens.layout")
LAYERS = (("schemas",), BASE, ("privacy",), ("replay",), ("pipelines",), ("dashboard",), ENTRY_POINTS)
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def layer(module: str) -> int:
    if module == "servelens":
        return 1
    matches = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes if module == p or module.startswith(p + ".")]
    assert matches, f"{module} is in no layer"
    return max(matches)[1]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _project_module(target: str) -> str | None:
    """The project module an import names (``a.b.name`` -> ``a.b`` when ``name`` is not a module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, node):
                    found = _project_module(target) if target.split(".")[0] in PACKAGES else None
                    if found and found != name and not name.startswith(found + "."):
                        graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_every_module_imports_only_its_layer_or_below():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert not upward, "upward imports (docs/contributing.md, Layers): " + ", ".join(upward)


def test_no_import_cycle_among_the_project_modules():
    assert not cycles(import_graph())


def test_no_function_over_the_limit():
    long = sorted(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
                  for name, tree in TREES.items() for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): " + ", ".join(long)


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_the_layers_order_the_packages():
    assert layer("schemas.events") < layer("servelens.errors") < layer("privacy.sanitize") < layer("replay.engine")
    assert layer("replay.gate") < layer("pipelines.ingest") < layer("dashboard.ui") < layer("servelens.cli")
    assert layer("servelens") == layer("servelens.settings") < layer("servelens.config")
    assert layer("pipelines.lake") < layer("pipelines.dagster_assets") == layer("servelens.cli")
