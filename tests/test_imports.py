"""The package's import graph, read with `ast` (module-level imports, TYPE_CHECKING blocks and imports
inside functions alike): no cycles, and data flows one way (models and cache never import the engine;
dist never imports serve)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hypic"
FORBIDDEN = (("hypic.models", "hypic.engine"), ("hypic.cache", "hypic.engine"), ("hypic.dist", "hypic.serve"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The hypic modules `path` imports anywhere in its body."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return {name for name in imports_in(path.read_text(), package) if name in modules}


def imports_in(source: str, package: str) -> set[str]:
    """Every name an import statement of `source` (a module of `package`) reaches, at any depth;
    `from a import b` gives a and a.b (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imported(path, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> ... -> a, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
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
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_every_kind_of_import() -> None:
    # the walker's own oracle: module-level, TYPE_CHECKING, function-level and relative imports
    source = ("import hypic.config\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from hypic.engine import x\n"
              "def f():\n    import hypic.serve\n    from .sibling import y\n    from .. import errors\n")
    assert imports_in(source, "hypic.dist") == {
        "hypic.config", "typing", "typing.TYPE_CHECKING", "hypic.engine", "hypic.engine.x", "hypic.serve",
        "hypic.dist.sibling", "hypic.dist.sibling.y", "hypic", "hypic.errors"}
    assert "hypic.models.batch" in import_graph()["hypic.models.attention"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(("lower", "higher"), FORBIDDEN)
def test_lower_layers_never_import_higher_ones(lower: str, higher: str) -> None:
    graph = import_graph()
    wrong = sorted(f"{m} imports {d}" for m, deps in graph.items() if _in(m, lower) for d in deps if _in(d, higher))
    assert not wrong, "\n".join(wrong)
