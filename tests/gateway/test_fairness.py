"""Fair service across sessions: one session's burst holds at most `max_session_sequences` engine sequences at
once (its further ones wait their turn, none refused), and another session's call goes in beside it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from gateway_helpers import fake_engine, serve, tokenizer

from stepline.gateway.fairness import SequenceLimit

LIMIT = 4
LATENCY = 0.3  # seconds the engine takes per sequence


def _client(session: dict) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=session["openai_base_url"], timeout=60,
                             headers={"Authorization": f"Bearer {session['api_key']}"})


async def test_one_sessions_burst_holds_at_most_the_limit_and_another_session_goes_in_beside_it(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # one session's eight 256-sequence requests delayed another session's 1-token call from 0.07 to 8.2 s
    engine = fake_engine(tokenizer(qwen3_model_dir), [], latency=LATENCY)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, max_session_sequences=LIMIT) as served:
        burst, victim = await served.session(), await served.session()
        async with _client(burst) as b, _client(victim) as v:
            batch = b.post("/completions", json={"prompt": [f"prompt {i}" for i in range(12)], "max_tokens": 2})
            choices = b.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 4,
                                                        "max_tokens": 2})
            started = time.monotonic()
            flood = asyncio.gather(batch, choices)  # 12 + 4 sequences: four rounds of the limit
            await asyncio.sleep(LATENCY / 3)
            alone = await v.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1})
            waited = time.monotonic() - started
            answers = await flood
        assert alone.status_code == 200, alone.text
        assert waited < 2.5 * LATENCY  # one engine call, not behind the burst's four rounds (>= 4 x LATENCY)
        assert [r.status_code for r in answers] == [200, 200]  # split into rounds, not refused
        assert len(answers[0].json()["choices"]) == 12 and len(answers[1].json()["choices"]) == 4
        assert engine.max_in_flight <= LIMIT + 1  # the burst's share, and the victim's one


async def test_a_streamed_call_with_more_choices_than_the_limit_streams_them_all(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    engine = fake_engine(tokenizer(qwen3_model_dir), [], latency=0.1)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, max_session_sequences=2) as served:
        s = await served.session()
        async with _client(s) as c:
            body = {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 2, "stream": True}
            r = await c.post("/chat/completions", json=body)
        finished = {line for line in r.text.splitlines() if '"finish_reason":"' in line}
        assert r.status_code == 200 and len(finished) == 5, r.text
        assert engine.max_in_flight == 2


async def test_the_limit_takes_turns_in_arrival_order_and_forgets_idle_sessions() -> None:
    limit, order = SequenceLimit(2), []

    async def sequence(i: int) -> None:
        async with limit.slot("s"):
            order.append(i)
            assert limit.running("s") <= 2
            await asyncio.sleep(0.01)

    await asyncio.gather(*(sequence(i) for i in range(6)))
    assert order == list(range(6))
    assert limit.running("s") == 0 and not limit._shares  # nothing kept per session once its calls are done
