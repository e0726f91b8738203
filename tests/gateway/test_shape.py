"""The gateway's shape (docs/architecture.md §1, "The call path"): which modules the call path may import,
the project files one chat completion runs through, and no gateway function with more than 6 parameters
(past that a record is missing).

The rule is on imports, not on a count of files: splitting a module along its seams is free, reaching from
the call path into the trainer, the rollout driver or the launchers is not.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from gateway_helpers import fake_engine, serve, tokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_PARAMETERS = 6
APP = "stepline.gateway.app"  # the call path's root: every route and the parts it is given
# what the call path may import, transitively (lazy imports included): the gateway, the pool's records and
# interface (never a storage backend), the retry policy
MAY_IMPORT = ("stepline.gateway", "stepline.datapool.records", "stepline.datapool.base", "stepline.datapool.wire",
              "stepline._retry", "stepline.weightdelta")  # (the weight push's folder format: stdlib at import)
NEVER = ("stepline.trainer", "stepline.rollout", "stepline.launch")
FRONT_ENDS = ("chat", "completions", "messages", "responses")
# a front end reaches the engine, the recorder and the metrics only through the stages it is given
FRONT_ENDS_NEVER = ("stepline.gateway.fleet", "stepline.gateway.recorder", "stepline.gateway.metrics",
                    "stepline.gateway.session_service", "stepline.gateway.frontends.dispatch",
                    "stepline.gateway.frontends.ledger")


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameters as a caller sees them: self / cls left out, *args and **kwargs one each."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


def test_parameters_counts_what_a_caller_passes() -> None:
    tree = ast.parse("def f(self, a, /, b, *args, c, **kw): ...")
    assert parameters(tree.body[0]) == ["a", "b", "c", "args", "kw"]  # type: ignore[arg-type]


def test_no_gateway_function_takes_more_than_six_parameters() -> None:
    too_many = []
    for path in sorted((ROOT / "stepline" / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(parameters(node)) > MAX_PARAMETERS:
                too_many.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(parameters(node))})")
    assert not too_many, too_many


def documented_call_path() -> set[str]:
    """The files of the table under "The call path of one chat completion" in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### The call path of one chat completion", 1)[1].split("\n#", 1)[0]
    return {name for name in re.findall(r"^\| `([\w/.]+\.py)` \|", section, flags=re.M) if name.startswith("stepline/")}


@pytest.mark.parametrize("stream", [False, True])
async def test_one_chat_completion_runs_through_the_documented_files(tiny_model_dir: Path, tmp_path: Path,
                                                                     stream: bool) -> None:
    tok = tokenizer(tiny_model_dir)
    async with fake_engine(tok, ["hello there", "again"]) as url, serve(tiny_model_dir, [url], tmp_path) as served:
        s = await served.session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        async with httpx.AsyncClient(base_url=f"{served.url}/s/{s['session_id']}/v1", headers=headers) as client:
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            assert (await client.post("/chat/completions", json=body)).status_code == 200  # warm: imports, caches
            body["messages"] += [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
            files: set[str] = set()

            def profile(frame: FrameType, event: str, arg: object) -> None:
                name = frame.f_code.co_filename
                if event == "call" and name.startswith(str(ROOT)) and "/tests/" not in name and "/site-packages/" not in name:
                    files.add(str(Path(name).relative_to(ROOT)))

            sys.setprofile(profile)  # this thread only: the event loop's (the recorder's worker is not timed)
            try:
                answer = await client.post("/chat/completions", json=body)
            finally:
                sys.setprofile(None)
    assert answer.status_code == 200
    documented = documented_call_path()
    assert files <= documented, sorted(files - documented)
    assert {"stepline/gateway/frontends/chat.py", "stepline/gateway/frontends/stages.py"} <= files


def module_file(name: str) -> Path | None:
    for path in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py"):
        if path.is_file():
            return path
    return None


def stepline_imports(name: str) -> set[str]:
    """The stepline modules `name` imports (ast: nothing executed; imports inside functions included)."""
    path = module_file(name)
    assert path is not None, name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found |= {f"{module}.{a.name}" if module_file(f"{module}.{a.name}") else module for a in node.names}
    return {m for m in found if m.startswith("stepline") and module_file(m)}


def closure(root: str) -> set[str]:
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += stepline_imports(name)
    return seen


def test_stepline_imports_reads_absolute_relative_and_lazy_imports() -> None:
    assert {"stepline.gateway.frontends.stages", "stepline.gateway.frontends.edge"} <= stepline_imports(
        "stepline.gateway.frontends.chat")
    assert "stepline.gateway.frontends.errors" in closure("stepline.gateway.frontends.chat")


def test_the_call_path_imports_only_the_gateway_the_pool_records_and_the_retry_policy() -> None:
    reached = closure(APP)
    assert {"stepline.gateway.frontends.chat", "stepline.gateway.recorder", "stepline.datapool.records"} <= reached
    outside = sorted(m for m in reached if not m.startswith(MAY_IMPORT))
    assert not outside, outside
    assert not [m for m in reached if m.startswith(NEVER)]


def test_loading_the_app_loads_no_trainer_rollout_launcher_or_torch() -> None:
    code = f"import sys, {APP}\nprint(sorted(sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    assert APP in loaded
    assert not [m for m in loaded if m.startswith(NEVER) or m.split(".")[0] in ("torch", "transformers")]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_front_end_reaches_engine_and_recorder_only_through_its_stages(front_end: str) -> None:
    direct = stepline_imports(f"stepline.gateway.frontends.{front_end}")
    assert "stepline.gateway.frontends.stages" in direct
    assert not direct & set(FRONT_ENDS_NEVER), sorted(direct & set(FRONT_ENDS_NEVER))
