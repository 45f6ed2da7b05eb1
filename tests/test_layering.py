"""The package layering: heads/ is the base that train/ and infer/ build on, neither of those imports the
other, and no modules import each other (at load time or inside a function)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "train", "infer")
ALLOWED = {"heads": set(), "train": {"heads"}, "infer": {"heads"}}  # package -> packages it may import


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def unprefixed(name: str) -> str:
    """headway.infer.engine -> infer.engine: the folders install under the `headway` namespace."""
    return name.removeprefix("headway.")


def imports(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports anywhere in its code (`from a import b` counts a.b when b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {unprefixed(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = unprefixed(node.module)
            subs = {f"{module}.{alias.name}" for alias in node.names}
            found |= (subs & known) or {module}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_packages_import_only_the_layers_below_them():
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in graph().items() for dep in deps
                   if dep.split(".")[0] != mod.split(".")[0]
                   and dep.split(".")[0] not in ALLOWED[mod.split(".")[0]])
    assert not wrong, wrong


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [node, dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycles():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


@pytest.mark.parametrize("edges, cyclic", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": {"c"}}, False)])
def test_the_cycle_finder_finds_cycles(edges, cyclic):
    assert (find_cycle(edges) is not None) == cyclic
