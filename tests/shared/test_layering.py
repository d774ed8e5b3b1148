"""shared/ is what the gateway and the worker both speak: it must not depend on either of them.

Read from the source (an AST scan, nothing imported or executed), so an import hidden inside a
function counts too. Only the files that start those processes may name them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / "shared"
UPPER_LAYERS = ("gateway", "worker")
# The operations subpackage: the `microturn` entry point (which dispatches to `microturn worker`,
# `gateway`, `chat`), `microturn up` (which starts them as processes) and the keys CLI.
ALLOWED_PACKAGE = "shared/cli/"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_imports(path: Path) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for line, module in imported_modules(path)
        if module.split(".")[0] in UPPER_LAYERS
    ]


def test_shared_imports_neither_gateway_nor_worker() -> None:
    files = sorted(SHARED.rglob("*.py"))
    assert len(files) > 10  # the scan sees the package
    offending = [
        hit
        for path in files
        if not str(path.relative_to(REPO)).startswith(ALLOWED_PACKAGE)
        for hit in upward_imports(path)
    ]
    assert offending == []


def test_the_scan_sees_imports_inside_functions() -> None:
    # The entry point imports the processes it starts lazily, inside its sub-commands.
    hits = upward_imports(SHARED / "cli" / "main.py")
    assert any("imports worker.server.main" in hit for hit in hits)
    assert any("imports gateway.main" in hit for hit in hits)
