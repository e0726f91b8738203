"""`stepline gateway` and `stepline up`: option handling, and whole processes serving and recording
into the real SQLite pool (FakeEngine or the built-in engine behind them)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from fakes.engine import FakeEngine, Scripted
from tokenizers import Tokenizer

from stepline.cli import main

ADMIN = {"Authorization": "Bearer adm"}


def stepline(*args: str) -> list[str]:
    return [sys.executable, "-m", "stepline.cli", *args]


def scripted_answer(model_dir: Path, text: str) -> tuple[FakeEngine, list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode(text, add_special_tokens=False).ids + [end]
    fake = FakeEngine([Scripted(ids, text=text)], eos_id=end, decode=lambda i: tok.decode(i, skip_special_tokens=False))
    return fake, ids


def recorded_output(pool, session_id: str, call_index: int) -> list[int]:
    tree = pool.get_tree(session_id)
    nodes = {n.id: n for n in tree.nodes}
    _, action = tree.calls[call_index]
    return np.concatenate([nodes[i].tokens for i in action]).tolist()


def test_gateway_options(tiny_model_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["gateway", "--help"])
    assert result.exit_code == 0
    for option in ("--engine", "--engine-kind", "--model", "--pool", "--port", "--admin-token"):
        assert option in result.output
    missing = runner.invoke(main, ["gateway", "--model", str(tiny_model_dir), "--pool", "sqlite:///:memory:"])
    assert missing.exit_code == 2 and "--engine" in missing.output
    bad_kind = runner.invoke(
        main, ["gateway", "--engine", "http://x", "--engine-kind", "tgi", "--model", str(tiny_model_dir), "--pool", "p"]
    )
    assert bad_kind.exit_code == 2 and "tgi" in bad_kind.output


def test_gateway_reports_a_busy_port_and_a_bad_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["gateway", "--engine", "http://127.0.0.1:9", "--model", str(tiny_model_dir)]
    bad_pool = runner.invoke(main, [*args, "--pool", "mysql://nope"])
    assert bad_pool.exit_code == 1 and "cannot open the pool 'mysql://nope'" in bad_pool.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = runner.invoke(main, [*args, "--pool", f"sqlite:///{tmp_path / 'p.db'}", "--port", str(port)])
    assert busy.exit_code == 1 and f"cannot serve on 127.0.0.1:{port}" in busy.output


def test_up_options() -> None:
    result = CliRunner().invoke(main, ["up", "--help"])
    assert result.exit_code == 0 and "--model" in result.output and "--serve-pool" in result.output
    assert "--context-length" in result.output


async def wait_health(url: str, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            assert proc.returncode is None, "the gateway exited"
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def test_gateway_process_serves_records_and_flushes_on_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("stepline.gateway.app")
    from stepline.datapool import open_pool

    fake, answer = scripted_answer(tiny_model_dir, "Hello there")
    db = tmp_path / "pool.db"
    async with fake as engine_url:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            *stepline(
                "gateway",
                "--engine",
                engine_url,
                "--engine-kind",
                "sglang",
                "--model",
                str(tiny_model_dir),
                "--pool",
                f"sqlite:///{db}",
                "--port",
                str(port),
                "--admin-token",
                "adm",
            ),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_health(url, proc)
            async with httpx.AsyncClient(timeout=30) as client:
                session = (
                    await client.post(url + "/sessions", json={"task_id": "t", "harness": "h"}, headers=ADMIN)
                ).json()
                reply = await client.post(
                    session["openai_base_url"] + "/chat/completions",
                    json={"model": "stepline", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {session['api_key']}"},
                )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "Hello there"
        finally:
            proc.send_signal(signal.SIGTERM)  # the call is recorded asynchronously: shutdown must flush it
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    # what the gateway read from the model's template, printed at start
    assert "model: tool parser hermes, reasoning parser qwen3; end-of-turn '<|im_end|>', tools in the template" \
        in out.decode()
    prompt_sent = fake.requests[-1][1]["input_ids"]
    pool = open_pool(f"sqlite:///{db}")
    try:
        assert recorded_output(pool, session["session_id"], 0) == answer  # the stop token included
        tree = pool.get_tree(session["session_id"])
        nodes = {n.id: n for n in tree.nodes}
        end_node, _ = tree.calls[0]
        path = []
        node = nodes[end_node]
        while True:
            path[:0] = node.tokens.tolist()
            if node.parent < 0:
                break
            node = nodes[node.parent]
        assert path == prompt_sent  # exactly the ids the engine received
    finally:
        pool.close()


def test_up_starts_everything_prints_how_and_stops_on_ctrl_c(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("stepline.gateway.app")
    openai = pytest.importorskip("openai")
    proc = subprocess.Popen(
        stepline("up", "--model", str(tiny_model_dir), "--port", "0", "--state-dir", str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lines = []
        while not any("OPENAI_BASE_URL" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"up exited: {proc.stderr.read()}"
            lines.append(line)
        text = "".join(lines)
        base = re.search(r"OPENAI_BASE_URL=(\S+)", text).group(1)
        key = re.search(r"OPENAI_API_KEY=(\S+)", text).group(1)
        client = openai.OpenAI(base_url=base, api_key=key)
        reply = client.chat.completions.create(
            model="stepline", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message is not None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    assert proc.returncode == 0
    from stepline.datapool import open_pool

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    try:
        (session,) = pool.list_sessions()
        assert sorted(pool.get_tree(session.session_id).calls) == [0]
    finally:
        pool.close()
