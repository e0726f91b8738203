"""The gateway records a turn that extends an earlier call as a delta of it (the call's index, how many of its
ids open the prompt, and only the ids after them), and the pool hands back exactly the prompts the engine got."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import zstandard
from gateway_helpers import fake_engine, serve, tokenizer

from stepline.datapool.records import CallRecord


class Spy:
    """The gateway's pool, keeping every call record as the recorder sent it."""

    def __init__(self, pool: object) -> None:
        self.pool = pool
        self.sent: list[CallRecord] = []

    def add_calls(self, records: list[CallRecord]) -> None:
        self.sent.extend(records)
        self.pool.add_calls(records)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.pool, name)


async def test_turns_are_recorded_as_deltas_and_read_back_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(tiny_model_dir)
    engine = fake_engine(tok, ["First answer.", "Second answer.", "Again.", "Fresh start."])
    async with engine as url, serve(tiny_model_dir, [url], tmp_path) as served:
        spy = Spy(served.pool)
        served.gateway.recorder.pool = spy  # type: ignore[assignment]
        s = await served.session()
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]
        bodies: list[bytes] = []
        async with httpx.AsyncClient(base_url=s["openai_base_url"],
                                     headers={"Authorization": f"Bearer {s['api_key']}"}) as client:
            async def chat(messages: list[dict]) -> str:
                bodies.append(orjson.dumps({"model": "m", "messages": messages}))
                r = await client.post("/chat/completions", content=bodies[-1],
                                      headers={"Content-Type": "application/json"})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            history.append({"role": "assistant", "content": await chat(history)})
            history.append({"role": "user", "content": "And then?"})
            await chat(history)  # turn 2: extends call 0's prompt + answer
            await chat(history)  # an exact retry: extends call 1's prompt
            await chat([{"role": "user", "content": "Something else."}])  # nothing to extend: whole
        await served.flush()
        sent = {r.call_index: r for r in spy.sent}
        prompts = [body["input_ids"] for path, body in engine.requests if path == "/generate"]
        assert [(sent[i].parent, sent[i].prefix_len) for i in range(4)] == [
            (-1, 0), (0, len(prompts[0]) + len(sent[0].output_ids)), (1, len(prompts[1])), (-1, 0)]
        assert len(sent[1].prompt_ids) == len(prompts[1]) - sent[1].prefix_len and len(sent[2].prompt_ids) == 0
        # the bodies too: turn 2's after the bytes it shares with turn 1's (up to its last message), the retry's empty
        assert [r.request_prefix for r in sent.values()] == [0, bodies[1].index(b',{"role":"assistant"'),
                                                             len(bodies[2]), 0]
        got = served.pool.get_calls(s["session_id"])
        assert [c.prompt_ids.tolist() for c in got] == prompts  # exactly what the engine received
        assert [zstandard.ZstdDecompressor().decompress(c.request) for c in got] == bodies  # and the harness sent
        assert [(c.parent, c.prefix_len, c.request_prefix) for c in got] == [(-1, 0, 0)] * 4
