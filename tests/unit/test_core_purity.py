"""The core is pure: it imports the standard library, xxhash, cbor2 and itself, nothing else
(no HTTP, no asyncio), so every rule in it is testable without an event loop."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "proxy" / "core"
ALLOWED_THIRD_PARTY = {"xxhash", "cbor2"}
FORBIDDEN_STDLIB = {"asyncio", "socket", "http", "urllib", "threading", "subprocess"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(
                node.module if node.module.startswith("proxy.") else node.module.split(".")[0]
            )
    return names


def test_core_imports_only_stdlib_xxhash_and_itself() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for name in _imports(path):
            if name.startswith("proxy."):
                assert name.startswith("proxy.core") or name == "proxy.errors", (path, name)
                continue
            assert name not in FORBIDDEN_STDLIB, (path, name)
            assert (
                name in sys.stdlib_module_names
                or name in ALLOWED_THIRD_PARTY
                or name in ("__future__",)
            ), (path, name)
