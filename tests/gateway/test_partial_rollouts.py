"""Partial rollouts through the whole gateway on the built-in engine (docs/architecture.md §2.4): a call still
running when a weight update cuts it goes on under the new weights and the harness gets one complete answer,
whole or streamed; the recorded call is the engine's two pieces spliced, with the version of each. Off, the
call is answered truncated, as before. A call cut more often than the resume bound ends truncated."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fakes.engine import FakeEngine
from gateway_helpers import END, Served, serve, tokenizer

from stepline.gateway.engines import Generation, SamplingParams, StreamDelta
from stepline.gateway.frontends import dispatch

pytest.importorskip("stepline.engine.testing")

# The call must still run when the update comes: with this seed the tiny model samples no end-of-turn token in
# its first 3,500 tokens, so only the update (tens of ms after the first token) can end the first piece early.
MAX_TOKENS = 1500
CHAT = {"messages": [{"role": "user", "content": "write a long story"}], "max_tokens": MAX_TOKENS, "seed": 2,
        "temperature": 1.0}
ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    import torch

    from stepline.engine.testing import running_engine

    torch.set_num_threads(1)
    with running_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture
def checkpoint(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, path)
    return path


@dataclass
class Pieces:
    """What the gateway's engine client was asked and answered: one entry per engine request (piece)."""

    asked: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    answered: list[Generation] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)  # output tokens streamed so far, per piece


def record_pieces(served: Served) -> Pieces:
    client = served.gateway.router.clients[0]
    generate, stream, pieces = client.generate, client.stream, Pieces()

    async def recorded_generate(ids: Any, sampling: SamplingParams, rid: str | None = None) -> Generation:
        pieces.asked.append((np.asarray(ids).tolist(), sampling))
        gen = await generate(ids, sampling, rid)
        pieces.answered.append(gen)
        return gen

    async def recorded_stream(ids: Any, sampling: SamplingParams, rid: str | None = None) -> AsyncIterator[StreamDelta]:
        pieces.asked.append((np.asarray(ids).tolist(), sampling))
        pieces.streamed.append(0)
        async for delta in stream(ids, sampling, rid):
            pieces.streamed[-1] += len(delta.output_ids)
            if delta.final is not None:
                pieces.answered.append(delta.final)
            yield delta

    client.generate, client.stream = recorded_generate, recorded_stream  # type: ignore[method-assign]
    return pieces


async def engine_running(http: httpx.AsyncClient, engine_url: str) -> None:
    """Until the engine runs a sequence (one that has prefilled and sampled its first token)."""
    while (await http.get(f"{engine_url}/get_model_info")).json()["running_requests"] < 1:
        await asyncio.sleep(0.01)


async def update(http: httpx.AsyncClient, served: Served, path: Path, version: int) -> httpx.Response:
    return await http.post(f"{served.url}/admin/update_weights", headers=ADMIN, json={"path": str(path),
                                                                                     "version": version})


def check_spliced(served: Served, session_id: str, pieces: Pieces) -> None:
    """The recorded call is the two pieces spliced, each with its version; the second asked for the rest."""
    [call] = served.pool.get_calls(session_id)
    first, second = pieces.answered
    assert first.finish_reason == "abort" and len(first.output_ids) >= 1
    assert call.finish_reason == second.finish_reason != "abort"
    assert call.output_ids.tolist() == first.output_ids + second.output_ids
    assert call.output_logprobs.tolist() == np.asarray(first.logprobs + second.logprobs, np.float32).tolist()
    n = len(call.output_ids)
    assert n == MAX_TOKENS or call.finish_reason == "stop"  # as many tokens as asked, or a natural stop
    (prompt, asked), (resumed_prompt, resumed) = pieces.asked
    assert resumed_prompt == prompt + first.output_ids  # the prompt and the tokens sampled so far
    assert (asked.max_new_tokens, resumed.max_new_tokens) == (MAX_TOKENS, MAX_TOKENS - len(first.output_ids))
    assert call.weight_version == 0 and call.version_spans == [(0, 0), (len(first.output_ids), 1)]
    acts = [(len(node.tokens), node.weight_version) for node in served.pool.get_tree(session_id).nodes
            if node.kind == "act"]
    assert acts == [(len(first.output_ids), 0), (len(second.output_ids), 1)]
    assert served.gateway.gate.cut_calls == {"resumed": 1}


async def called_across_an_update(served: Any, http: httpx.AsyncClient, engine_url: str,
                                  checkpoint: Path) -> tuple[dict[str, Any], httpx.Response]:
    """A new session's chat call, with a weight update (to version 1) pushed while the engine runs it."""
    s = await served.session()
    call = asyncio.create_task(http.post(f"{s['openai_base_url']}/chat/completions", json=CHAT,
                                         headers={"Authorization": f"Bearer {s['api_key']}"}))
    await engine_running(http, engine_url)
    assert (await update(http, served, checkpoint, 1)).status_code == 200
    return s, await call


async def test_a_whole_call_cut_by_an_update_is_answered_complete(engine_url: str, tiny_model_dir: Path,
                                                                  checkpoint: Path, tmp_path: Path) -> None:
    async with serve(tiny_model_dir, [engine_url], tmp_path, update_grace=0.0) as served:
        pieces = record_pieces(served)
        async with httpx.AsyncClient(timeout=120) as http:
            s, answer = await called_across_an_update(served, http, engine_url, checkpoint)
        await served.flush()
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == ("length" if pieces.answered[-1].finish_reason == "length" else "stop")
        assert answer.json()["usage"]["completion_tokens"] == sum(len(g.output_ids) for g in pieces.answered)
        check_spliced(served, s["session_id"], pieces)


async def test_a_stream_cut_by_an_update_goes_on_uninterrupted(engine_url: str, tiny_model_dir: Path,
                                                               checkpoint: Path, tmp_path: Path) -> None:
    async with serve(tiny_model_dir, [engine_url], tmp_path, update_grace=0.0) as served:
        pieces = record_pieces(served)
        s = await served.session()
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{s['openai_base_url']}/chat/completions", json={**CHAT, "stream": True},
                                   headers={"Authorization": f"Bearer {s['api_key']}"}) as stream:
                lines = stream.aiter_lines()
                async for line in lines:  # until the first chunk: the stream is running
                    if line.startswith("data: {"):
                        break
                assert (await update(http, served, checkpoint, 1)).status_code == 200
                rest = [line async for line in lines]
        await served.flush()
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert rest.count("data: [DONE]") == 1
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finishes == ["length" if pieces.answered[-1].finish_reason == "length" else "stop"]  # one end only
        check_spliced(served, s["session_id"], pieces)


async def test_with_partial_rollouts_off_a_cut_call_is_answered_truncated(engine_url: str, tiny_model_dir: Path,
                                                                         checkpoint: Path, tmp_path: Path) -> None:
    async with serve(tiny_model_dir, [engine_url], tmp_path, update_grace=0.0, partial_rollouts=False) as served:
        pieces = record_pieces(served)
        async with httpx.AsyncClient(timeout=120) as http:
            s, answer = await called_across_an_update(served, http, engine_url, checkpoint)
            metrics = (await http.get(f"{served.url}/metrics")).text
        await served.flush()
        [recorded] = served.pool.get_calls(s["session_id"])
    assert answer.json()["choices"][0]["finish_reason"] == "length"  # cut short: a truncated answer
    assert [g.finish_reason for g in pieces.answered] == ["abort"]  # never resumed
    assert (recorded.finish_reason, recorded.weight_version, recorded.version_spans) == ("abort", 0, [])
    assert recorded.output_ids.tolist() == pieces.answered[0].output_ids
    assert 'stepline_gateway_cut_calls_total{answer="truncated"} 1.0' in metrics
    assert 'stepline_gateway_cut_calls_total{answer="resumed"} 0.0' in metrics


async def test_a_call_cut_more_often_than_the_bound_ends_truncated(tiny_model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "MAX_RESUMES", 1)
    tok = tokenizer(tiny_model_dir)
    # 400 tokens 20 ms apart: each piece would run for seconds; the updates' grace is 0.05 s
    fake = FakeEngine(eos_id=tok.token_to_id(END), default_tokens=400, token_delay=0.02,
                      decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    async with fake as url, serve(tiny_model_dir, [url], tmp_path, update_grace=0.05) as served:
        pieces = record_pieces(served)
        s = await served.session()
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{s['openai_base_url']}/chat/completions",
                                   json={**CHAT, "max_tokens": 300, "stream": True},
                                   headers={"Authorization": f"Bearer {s['api_key']}"}) as stream:
                lines = stream.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break
                assert (await update(http, served, tiny_model_dir, 1)).status_code == 200
                while len(pieces.streamed) < 2 or pieces.streamed[1] == 0:  # the resumed piece is running
                    await asyncio.sleep(0.01)
                assert (await update(http, served, tiny_model_dir, 2)).status_code == 200
                rest = [line async for line in lines]
        await served.flush()
        [recorded] = served.pool.get_calls(s["session_id"])
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the second cut is answered truncated
    assert [g.finish_reason for g in pieces.answered] == ["abort", "abort"]  # one resume, not two
    first, second = pieces.answered
    assert recorded.finish_reason == "abort"
    assert recorded.output_ids.tolist() == first.output_ids + second.output_ids
    assert recorded.version_spans == [(0, 0), (len(first.output_ids), 1)]
    assert served.gateway.gate.cut_calls == {"resumed": 1, "truncated": 1}
