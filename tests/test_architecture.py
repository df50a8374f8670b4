"""The shape of the house (issue 33), checked on the source so that it stays that way.

- No production file under tiercache/, tiers/ or policies/ is over 800 lines, and no class
  over 600, the manager included (limits are guides: a file near one is split by meaning).
- No private (underscore, not dunder) name crosses a module boundary: none is imported from
  another module, read as an imported module's attribute, or listed in `__all__`; no private
  module is imported by another module, of its own package or not (a module used across
  modules is public in its package).
- No import circle between tiercache's modules, counting the imports at module level,
  `TYPE_CHECKING` blocks included (a type-only circle is a design circle too; imports inside
  functions run later and break no circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package name it installs as (pyproject's package-dir).
TREES = {"tiercache": "tiercache", "tiers": "tiercache.tiers", "policies": "tiercache.policies"}
FILE_MAX = 800
CLASS_MAX = 600


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every production module."""
    out = {}
    for folder, package in TREES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


MODULES = modules()


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_source_tree_is_found() -> None:
    assert "tiercache.manager" in MODULES and "tiercache.tiers.base" in MODULES
    assert "tiercache.policies.lru" in MODULES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_and_class_sizes(name: str) -> None:
    path = MODULES[name]
    lines = len(path.read_text().splitlines())
    assert lines <= FILE_MAX, f"{path.relative_to(ROOT)}: {lines} lines (at most {FILE_MAX})"
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= CLASS_MAX, f"{name}.{node.name}: {size} lines (at most {CLASS_MAX})"


def imported(module: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names) of every module-level import of `tree`, `TYPE_CHECKING` blocks
    included (relative ones resolved)."""
    out: list[tuple[str, list[str]]] = []
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                out.append((base, [a.name for a in node.names]))
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return out


def edges() -> dict[str, set[str]]:
    """Module -> the tiercache modules it imports at import time (a submodule named in a
    `from package import name` counts as that submodule)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for base, names in imported(name, parse(path)):
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            if subs:
                deps.update(subs)
            if base in MODULES and len(subs) < len(names or [None]):
                deps.add(base)
        graph[name] = deps - {name}
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of `graph` meets (each as a closed path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                walk(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return circles


def test_no_import_circles() -> None:
    circles = find_circles(edges())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_checks_can_fail() -> None:
    """A circle and a private import written as source are found."""
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_circles({"a": {"b"}, "b": set()}) == []
    source = (
        "from tiercache.tiers.redis import _mask, __version__\nimport tiercache.cache\n"
        "from tiercache.tiers.nvme import tier as t\nt._KNOB = 1\ntiercache.cache._x()\n"
        "from ..connectors._x import y\n__all__ = ['_z', '__all__']\n"
    )
    found = private_uses("tiercache.cli.inspect", ast.parse(source))
    assert found == [
        "tiercache.tiers.redis._mask",
        "tiercache.connectors._x",
        "tiercache.cli.inspect.__all__: _z",
        "t._KNOB",
        "tiercache.cache._x",
    ]
    assert private_uses("tiercache.cli.inspect", ast.parse("from ._store import f")) == [
        "tiercache.cli._store"
    ]


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(module: str, tree: ast.Module) -> list[str]:
    """Where `tree` reaches a private (underscore, not dunder) name of another tiercache
    module: `from m import _x`, `m._x` on an imported module, any private module, or a
    private name in `__all__`."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    bad: list[str] = []
    mods: set[str] = set()  # local names bound to tiercache modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if not base.startswith("tiercache"):
                continue
            parts = base.split(".")
            if any(is_private(p) for p in parts):
                bad.append(base)
            bad += [f"{base}.{a.name}" for a in node.names if is_private(a.name)]
            mods.update(a.asname or a.name for a in node.names if f"{base}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            mods.update(a.asname or a.name for a in node.names if a.name.startswith("tiercache"))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names = [
                e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)
            ]
            bad += [f"{module}.__all__: {n}" for n in names if is_private(n)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            dotted = ast.unparse(node.value)
            if dotted in mods or dotted.startswith("tiercache."):
                bad.append(f"{dotted}.{node.attr}")
    return bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_crosses_a_module_boundary(name: str) -> None:
    bad = private_uses(name, parse(MODULES[name]))
    assert not bad, f"{name} reaches private names of other modules: {bad}"
