"""Imports flow one way: no cycle among the `app` modules, counting every import (at the top of a module,
inside a function, under TYPE_CHECKING). An import moved into a function to dodge a cycle is still the
cycle; the function-local imports that remain are the start-up ones (a module that the driver or a worker
imports before the heavy stack may load), each marked with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import app

ROOT = Path(app.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The `app` modules a file imports anywhere in it (`from app.x import y` names app.x.y if that is a
    module, else app.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules and name != "app"}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: imported_modules(path, modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the list of its modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import(tmp_path):
    (tmp_path / "a.py").write_text("import app.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from app.a import thing\n")
    modules = {"app.a", "app.b"}
    graph = {name: imported_modules(tmp_path / f"{name[-1]}.py", modules) for name in modules}
    assert find_cycle(graph) == ["app.a", "app.b", "app.a"]


def test_no_import_cycle_among_app_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_among_app_packages():
    """The packages by stage (config, data, model, train, runs, tracking, launch, serve) import each other one
    way too."""
    packages: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        package = ".".join(module.split(".")[:2])
        packages.setdefault(package, set()).update(".".join(i.split(".")[:2]) for i in imports)
    cycle = find_cycle({package: imports - {package} for package, imports in packages.items()})
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)
