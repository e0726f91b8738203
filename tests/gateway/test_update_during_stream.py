"""An update during a long stream fails no new call (docs/architecture.md §2.4), through the whole gateway:
with partial rollouts off, the stream is cut short after the update's grace — answered as truncated
(finish_reason length), recorded with finish_reason abort and the version that sampled it (on, it goes on under
the new weights: tests/gateway/test_partial_rollouts.py) — and the calls that arrive meanwhile are held,
then served and recorded under the new version. The engine side of it, against every engine, is in
tests/engines/test_contract.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from fakes.engine import FakeEngine
from gateway_helpers import END, serve, tokenizer

CHAT = {"messages": [{"role": "user", "content": "write a long story"}], "max_tokens": 300}


async def test_new_calls_during_an_update_are_held_and_the_long_stream_is_cut_short(tiny_model_dir: Path,
                                                                                     tmp_path: Path) -> None:
    tok = tokenizer(tiny_model_dir)
    # 400 tokens 20 ms apart: the stream would run 6 s; the update's grace is 0.1 s
    fake = FakeEngine(eos_id=tok.token_to_id(END), default_tokens=400, token_delay=0.02,
                      decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    async with fake as url, serve(tiny_model_dir, [url], tmp_path, update_grace=0.1, max_wait_paused=60,
                                         partial_rollouts=False) as served:
        sessions = [await served.session(task=f"t{i}") for i in range(4)]
        auth = [{"Authorization": f"Bearer {s['api_key']}"} for s in sessions]
        base = [s["openai_base_url"] for s in sessions]
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{base[0]}/chat/completions", headers=auth[0],
                                   json={**CHAT, "stream": True}) as long:
                lines = long.aiter_lines()
                async for line in lines:  # until the first chunk: the stream is running
                    if line.startswith("data: {"):
                        break
                update = asyncio.create_task(http.post(f"{served.url}/admin/update_weights",
                                                       headers={"Authorization": "Bearer adm"},
                                                       json={"path": str(tiny_model_dir), "version": 1}))
                await asyncio.sleep(0.02)  # the update has closed admission: these calls arrive during it
                new = [asyncio.create_task(http.post(f"{base[i]}/chat/completions", headers=auth[i], json=CHAT))
                       for i in (1, 2, 3)]
                rest = [line async for line in lines]
            answers = await asyncio.gather(*new)
            assert (await update).status_code == 200
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert "data: [DONE]" in rest
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # cut short: a truncated answer
        await served.flush()
        cut = served.pool.get_calls(sessions[0]["session_id"])  # type: ignore[attr-defined]
        held = [c for s in sessions[1:] for c in served.pool.get_calls(s["session_id"])]  # type: ignore[attr-defined]
    assert fake.aborted == 1
    assert [(c.finish_reason, c.weight_version) for c in cut] == [("abort", 0)]
    assert 1 <= len(cut[0].output_ids) < CHAT["max_tokens"]
    assert [c.weight_version for c in held] == [1, 1, 1]

