"""docs/architecture.md, Layout: dependencies point one way.

agents → (HTTP) → gateway → datapool ← trainer; rollout reaches the gateway over HTTP and the pool
through its interface, and needs no torch; nothing imports stepline (the composition root).

Parses every module's imports (ast, nothing executed) and checks the forbidden edges; one test also
imports the whole rollout package in a fresh interpreter and checks that torch never loads.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stepline", "gateway", "datapool", "trainer", "rollout", "agents", "deploy", "httpretry")
THIRD_PARTY = ("torch", "transformers", "peft", "accelerate")  # the heavy training stack

# package -> packages it must never import (the composition root, stepline, is imported by nobody)
FORBIDDEN: dict[str, set[str]] = {
    "gateway": {"trainer", "rollout", "agents", "stepline"},
    "trainer": {"gateway", "rollout", "agents", "stepline"},
    "datapool": {"gateway", "trainer", "rollout", "agents", "stepline"},
    "rollout": {"gateway", "trainer", "agents", "stepline", *THIRD_PARTY},  # HTTP + the pool only, no torch
    "agents": {"gateway", "datapool", "trainer", "rollout", "stepline"},  # harnesses are black boxes
    "deploy": {"agents", "stepline"},
    "stepline": {"agents"},  # agents run as separate processes, never imported
    "httpretry": {"stepline", "gateway", "datapool", "trainer", "rollout", "agents", "deploy"},  # used by all
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & {*PACKAGES, *THIRD_PARTY}


def modules() -> list[tuple[str, Path]]:
    return [(pkg, path) for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))]


def test_there_are_modules_to_check() -> None:
    assert {pkg for pkg, _ in modules()} == set(PACKAGES)


@pytest.mark.parametrize("package,path", modules(), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_import_direction(package: str, path: Path) -> None:
    bad = imported_packages(path) & FORBIDDEN[package]
    assert not bad, f"{path.relative_to(ROOT)} ({package}) imports {sorted(bad)}, against docs/architecture.md"


def test_the_rollout_package_loads_without_torch() -> None:
    """Transitively too: every rollout module imported in a fresh interpreter leaves torch unloaded."""
    names = [f"rollout.{p.stem}" for p in sorted((ROOT / "rollout").glob("*.py")) if p.stem != "__init__"]
    code = f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\nprint(sorted(sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in ast.literal_eval(out.stdout)}
    assert len(names) >= 7 and "rollout" in loaded
    assert not loaded & {*THIRD_PARTY, "gateway", "trainer", "stepline"}



def test_no_file_names_a_path_outside_the_repository() -> None:
    """Comments and docs point inside the repository (docs/), never at notes or machines elsewhere."""
    outside = ("DESIGN.md", "STYLE.md", "/work/", "/home/")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / name for name in tracked if name.endswith((".py", ".md", ".toml", ".sh", ".cfg"))]
    files = [path for path in files if path.is_file() and path != Path(__file__).resolve()]
    if not files:  # not a git checkout (an sdist): the package files at least
        files = [path for _, path in modules()]
    assert len(files) > len(PACKAGES)
    bad = [f"{path.relative_to(ROOT)}: {word}" for path in files for word in outside if word in path.read_text()]
    assert not bad, bad
