"""The gateway's shape (docs/architecture.md §1, "The hot path of one chat completion"): the project files
one chat completion runs through, and no gateway function with more than 6 parameters (past that a
record is missing)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from gateway_helpers import fake_engine, serve, tokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_PARAMETERS = 6
MAX_HOT_PATH_FILES = 10  # docs/architecture.md lists them


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


def documented_hot_path() -> set[str]:
    """The files of the table under "The hot path of one chat completion" in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### The hot path of one chat completion", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([\w/.]+\.py)` \|", section, flags=re.M))


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
    files.discard("stepline/gateway/testing.py")  # the fake engine, serving on the same loop
    documented = documented_hot_path()
    assert files <= documented, sorted(files - documented)
    assert len(documented) <= MAX_HOT_PATH_FILES, sorted(documented)
