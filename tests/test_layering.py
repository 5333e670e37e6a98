"""The packages import one way (kernels <- replica <- router <- cluster <- bench), without cycles.

Read from the source with ast, so a violation is caught without importing anything: an upward
import anywhere (module level or inside a function), and a cycle among module-level imports
(those under `if TYPE_CHECKING:` excepted: they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("kernels", "replica", "router", "cluster", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The project modules an import statement loads (the most specific known name)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level == 0 and node.module:
        # `from pkg import mod` needs pkg.mod when it is a module (a package still loading
        # may hand out its submodules), else an attribute of pkg: pkg itself.
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            names.append(sub if sub in known else node.module)
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def imports(path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(every project module imported anywhere, those imported when the module loads)."""
    tree = ast.parse(path.read_text())
    everywhere: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            everywhere |= _imported(node, known)
    at_load: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                at_load.update(_imported(node, known))
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return everywhere, at_load


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_no_package_imports_a_higher_one() -> None:
    known = modules()
    upward = []
    for name, path in known.items():
        everywhere, _ = imports(path, known)
        upward += [f"{name} -> {dep}" for dep in sorted(everywhere) if layer(dep) > layer(name)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of graph as a path that ends where it starts, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in graph:
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle() -> None:
    known = modules()
    graph = {}
    for name, path in known.items():
        # A package's __init__ importing its own modules is how a package loads, not a cycle.
        graph[name] = {d for d in imports(path, known)[1] if d != name}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"a"}}, True),
    ],
)
def test_find_cycle(graph: dict[str, set[str]], has_cycle: bool) -> None:
    assert (find_cycle(graph) is not None) is has_cycle
