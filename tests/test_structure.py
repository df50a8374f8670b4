"""The core reads top-down: no import circle among tiercache's core modules, counting imports
inside functions and TYPE_CHECKING blocks too (a circle broken by a late import is still a
circle a reader has to untangle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tiercache"
CORE = ["cache", "config", "errors", "hashing", "manager", "records", "telemetry", "workload"]


def imports_of(module: str) -> set[str]:
    """Core modules `module` imports anywhere in its source (a package: in any of its files)."""
    path = ROOT / f"{module}.py"
    files = [path] if path.exists() else sorted((ROOT / module).glob("*.py"))
    found: set[str] = set()
    for node in (n for f in files for n in ast.walk(ast.parse(f.read_text()))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tiercache" and len(parts) > 1 and parts[1] in CORE:
                found.add(parts[1])
    found.discard(module)
    return found


def test_core_modules_have_no_import_circle() -> None:
    graph = {m: imports_of(m) for m in CORE}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circle = [*path[path.index(n) :], n]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in CORE:
        if m not in state:
            visit(m, [m])


def test_telemetry_knows_no_facade() -> None:
    assert "cache" not in imports_of("telemetry")
    assert "telemetry" not in imports_of("config")
