"""The package's import graph has no circles: every module of `tokenmill` (worker/, schemas/,
kernels/, tools/) imports others in one direction only, lazy imports inside functions included
(a circle through a lazy import still ties the two modules' designs together). Imports under
`if TYPE_CHECKING:` are annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"tokenmill": "worker", "tokenmill.schemas": "schemas", "tokenmill.kernels": "kernels",
         "tokenmill.tools": "tools"}


def modules() -> dict[str, Path]:
    found = {}
    for name, folder in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        annotation_only = {id(n) for node in ast.walk(tree)
                           if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                           for stmt in node.body for n in ast.walk(stmt)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in annotation_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tokenmill"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in mods else owner(node.module))
            elif isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("tokenmill")}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return found


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_every_module_and_their_imports():
    mods = modules()
    graph = import_graph(mods)
    assert {"tokenmill", "tokenmill.engine.engine", "tokenmill.schemas.decode", "tokenmill.tools.bench"} <= set(mods)
    assert "tokenmill.schemas.job" in graph["tokenmill.schemas.decode"]


def test_no_module_of_the_package_imports_its_way_back_to_itself():
    assert circles(import_graph(modules())) == []
