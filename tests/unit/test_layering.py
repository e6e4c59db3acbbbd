"""The package's layering, read from the source: no import cycles, planning free of I/O, and no
class too long to read whole. Imports inside functions and under TYPE_CHECKING count too: a
cycle hidden in a lazy import is still two modules that cannot be understood apart."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PLAN = "omniload.coordinator.plan"
# what planning must not reach: processes, rings, sockets, files, the event loop
PLAN_MAY_NOT_IMPORT = (
    "omniload.coordinator.pool",
    "omniload.coordinator.ha",
    "omniload.coordinator.serve",
    "omniload.coordinator.observe",
    "omniload.coordinator.server",
    "omniload.coordinator.spill",
    "omniload.coordinator.planning",
    "omniload.coordinator.plan_task",
    "omniload.storage",
    "omniload.workers",
    "omniload.formats.ring",
    "omniload.client",
    "omniload.job",
)
IO_MODULES = {"asyncio", "socket", "selectors", "subprocess", "multiprocessing", "mmap", "os", "shutil", "signal"}
IO_MODULES |= {"pyarrow", "psutil", "uvloop", "torch", "urllib", "http"}
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    found = {}
    # omniload/coordinator and omniload/workers are symbolic links to the top-level folders
    for folder, _, files in os.walk(ROOT / "omniload", followlinks=True):
        for file in files:
            if file.endswith(".py"):
                path = Path(folder) / file
                parts = path.relative_to(ROOT).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it (omniload's resolved to a module of ours)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return names


def _ours(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        deps = {_ours(n) for n in _imports(path) if n.startswith("omniload")}
        graph[name] = {d for d in deps if d and d != name and not name.startswith(d + ".") and d != "omniload"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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
                    work.append((child, iter(sorted(graph[child]))))
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


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back_through_others():
    assert len(MODULES) > 50, "the package was not found from the source tree"
    assert _cycles(_graph()) == []


def test_planning_imports_no_io_and_no_other_part_of_the_coordinator():
    planning = [name for name in MODULES if name.startswith(PLAN + ".")]
    assert len(planning) >= 10
    for name in planning:
        imported = _imports(MODULES[name])
        reached = sorted(n for n in imported if n.startswith(PLAN_MAY_NOT_IMPORT))
        assert not reached, f"{name} imports {reached}: planning is pure (omniload/coordinator/plan/)"
        io = sorted(n for n in imported if n.split(".")[0] in IO_MODULES)
        assert not io, f"{name} imports {io}: planning does no I/O"


def test_no_class_is_longer_than_a_reader_can_hold():
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{name}.{node.name}"] = lines
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"
