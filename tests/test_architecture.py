"""DESIGN.md §5: dependencies point one way. agents → (HTTP) → gateway → datapool ← trainer.

Parses every module's imports (ast, nothing executed) and checks the forbidden edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stepline", "gateway", "datapool", "trainer", "agents")

# package -> packages it must never import
FORBIDDEN: dict[str, set[str]] = {
    "gateway": {"trainer", "agents"},
    "trainer": {"gateway", "agents"},
    "datapool": {"gateway", "trainer", "agents"},
    "agents": {"gateway", "datapool", "trainer", "stepline"},  # harnesses are black boxes
    "stepline": {"agents"},  # agents run as separate processes, never imported
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


def modules() -> list[tuple[str, Path]]:
    return [(pkg, path) for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))]


def test_there_are_modules_to_check() -> None:
    assert len(modules()) >= len(PACKAGES)


@pytest.mark.parametrize("package,path", modules(), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_import_direction(package: str, path: Path) -> None:
    bad = imported_packages(path) & FORBIDDEN[package]
    assert not bad, f"{path.relative_to(ROOT)} ({package}) imports {sorted(bad)}, against DESIGN.md §5"
