"""docs/architecture.md, Layout: dependencies point one way.

agents → (HTTP) → gateway → datapool ← trainer; rollout reaches the gateway over HTTP and the pool
through its interface, and needs no torch; nothing imports the launchers (stepline.launch, the composition root).

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
PACKAGE = ROOT / "stepline"
PARTS = ("gateway", "datapool", "trainer", "rollout", "agents", "engine", "dashboard", "launch")
THIRD_PARTY = ("torch", "transformers", "peft", "accelerate")  # the heavy training stack
SERVICES = {"gateway", "datapool", "trainer", "rollout", "engine", "dashboard"}

# part -> parts (and heavy libraries) it must never import; the launchers (launch, cli) are imported by nobody
FORBIDDEN: dict[str, set[str]] = {
    "gateway": {"trainer", "rollout", "agents", "engine", "dashboard", "launch", "cli"},
    "trainer": {"gateway", "rollout", "agents", "engine", "dashboard", "launch", "cli"},
    "datapool": {"gateway", "trainer", "rollout", "agents", "engine", "dashboard", "launch", "cli"},
    "rollout": {"gateway", "trainer", "agents", "engine", "dashboard", "launch", "cli", *THIRD_PARTY},
    "agents": {*SERVICES, "launch", "cli", "models", "pretrained", "chatml", "assets", "report", "_retry"},  # black boxes
    "engine": {"gateway", "datapool", "trainer", "rollout", "agents", "dashboard", "launch", "cli"},
    "dashboard": {"gateway", "rollout", "agents", "engine"},
    "launch": {"agents"},  # harnesses run as separate processes, never imported
    "_retry": {*SERVICES, "agents", "launch", "cli"},  # used by all
}


def part_of(path: Path) -> str:
    """The part a module belongs to: stepline/<part>/... or the module stepline/<name>.py itself."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path) -> set[str]:
    """Parts of stepline and heavy libraries a module imports (lazy imports inside functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                names.add(rest.split(".")[0] if top == "stepline" and rest else top)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top, _, rest = node.module.partition(".")
            if top != "stepline":
                names.add(top)
            elif rest:
                names.add(rest.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def modules() -> list[tuple[str, Path]]:
    return [(part_of(path), path) for path in sorted(PACKAGE.rglob("*.py"))]


def test_there_are_modules_to_check() -> None:
    assert set(PARTS) <= {part for part, _ in modules()}


def test_one_import_root() -> None:
    """Only stepline/ holds Python packages: nothing at the top level that would shadow another distribution
    (the OpenAI Agents SDK installs `agents`; PyPI has `trainer` and `datapool` too)."""
    top = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert top == ["stepline"]


@pytest.mark.parametrize("part,path", modules(), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_import_direction(part: str, path: Path) -> None:
    bad = imported_parts(path) & FORBIDDEN.get(part, set())
    assert not bad, f"{path.relative_to(ROOT)} ({part}) imports {sorted(bad)}, against docs/architecture.md"


TEST_TOOLS = {"unittest", "pytest", "hypothesis", "fakes"}  # the test runner's and the tests' own (tests/fakes/)


@pytest.mark.parametrize("part,path", modules(), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_no_product_module_imports_test_tools(part: str, path: Path) -> None:
    bad = imported_parts(path) & TEST_TOOLS
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: test tools and fakes live under tests/"


def test_the_rollout_package_loads_without_torch() -> None:
    """Transitively too: every rollout module imported in a fresh interpreter leaves torch unloaded."""
    names = [f"stepline.rollout.{p.stem}" for p in sorted((PACKAGE / "rollout").glob("*.py")) if p.stem != "__init__"]
    code = f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\nprint(sorted(sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    assert len(names) >= 7 and "stepline.rollout" in loaded
    assert not {name.split(".")[0] for name in loaded} & set(THIRD_PARTY)
    assert not {name for name in loaded if name.split(".")[:2] in (["stepline", "gateway"], ["stepline", "trainer"])}


def test_no_file_names_a_path_outside_the_repository() -> None:
    """Comments and docs point inside the repository (docs/), never at notes or machines elsewhere."""
    outside = ("DESIGN.md", "STYLE.md", "/work/", "/home/")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / name for name in tracked if name.endswith((".py", ".md", ".toml", ".sh", ".cfg"))]
    files = [path for path in files if path.is_file() and path != Path(__file__).resolve()]
    if not files:  # not a git checkout (an sdist): the package files at least
        files = [path for _, path in modules()]
    assert len(files) > len(PARTS)
    bad = [f"{path.relative_to(ROOT)}: {word}" for path in files for word in outside if word in path.read_text()]
    assert not bad, bad


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the stepline modules it imports: every import statement, lazy ones inside functions and those
    under TYPE_CHECKING included (`from stepline.a import b` names the module stepline.a.b when b is one)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def known(name: str) -> str:
        while name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name.startswith("stepline.")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *[base] * bool(base)])
                if base == "stepline" or base.startswith("stepline."):
                    edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else known(base) for a in node.names}
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    """No two modules of the package import each other, directly or through others, lazily or not."""
    graph = import_graph()
    assert len(graph) > 100 and "stepline.rollout.trees" in graph["stepline.rollout.driver"]
    assert circles(graph) == []



MAX_PARAMETERS = 10  # beyond this a record is missing (docs/architecture.md, Layout)


def test_no_function_takes_more_than_ten_parameters() -> None:
    """Counting every parameter but self/cls, *args and **kwargs included."""
    long = []
    for _, path in modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                count = len(named) + (a.vararg is not None) + (a.kwarg is not None)
                count -= bool(named) and named[0].arg in ("self", "cls")
                if count > MAX_PARAMETERS:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert not long, long
