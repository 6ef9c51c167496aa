"""The architecture as a test: imports go one way (flows -> tasks -> engine -> finetune), no
module imports another that imports it back (lazy, in-function imports count too), and the
engine knows nothing of the pipeline's folder layout."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

FLOORS = {"finetune": 0, "engine": 1, "tasks": 2, "flows": 3}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body."""
    modules = {_module(p): p for pkg in FLOORS for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                # `from engine import checkpoint` imports the submodule engine.checkpoint
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_imports_go_one_way():
    upward = [(mod, dep) for mod, deps in _imports().items() for dep in deps
              if FLOORS[dep.split(".")[0]] > FLOORS[mod.split(".")[0]]]
    assert upward == []


def test_no_import_cycles():
    graph = _imports()
    # package __init__ files re-export their own submodules: that is not a cycle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_engine_does_not_know_the_pipeline_layout():
    graph = _imports()
    assert [m for m, deps in graph.items() if m.startswith("engine")
            and "finetune.workspace" in deps] == []
    for path in (ROOT / "engine").rglob("*.py"):
        assert "data/" not in path.read_text(), path
