"""The SDKs against the built-in engine on qwen3-tiny (random weights, real Qwen3 template): plain-text
multi-turn conversations, streamed and whole. Replaying each recorded prompt on the engine with the
recorded sampling parameters (seeded) reproduces the recorded output ids and logprobs, so the records
hold exactly what the engine sampled; each call's prompt begins with the previous prompt + output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import numpy as np
import openai
import pytest
from gateway_helpers import Served, serve

from stepline.gateway.engines import SamplingParams, make_engine

pytest.importorskip("stepline.engine.testing")

TURNS = 5
STOP_IDS = [151643, 151645]  # <|endoftext|>, <|im_end|> (generation_config.json of qwen3-tiny)


@pytest.fixture(scope="module")
def engine_url(qwen3_model_dir: Path) -> Iterator[str]:
    import torch

    from stepline.engine.testing import running_engine

    torch.set_num_threads(1)
    with running_engine(qwen3_model_dir) as url:
        yield url


async def replay_matches(served: Served, engine_url: str, session_id: str) -> None:
    tree = served.pool.get_tree(session_id)
    calls = served.calls(session_id)
    assert len(calls) == TURNS
    for (prompt, output), (next_prompt, _) in zip(calls, calls[1:]):
        assert next_prompt[: len(prompt) + len(output)] == prompt + output
    nodes = {n.id: n for n in tree.nodes}
    async with aiohttp.ClientSession() as http:
        engine = make_engine(engine_url, "builtin", http, 60.0)
        for index, (prompt, output) in enumerate(calls):
            # what the gateway sent: the call's seed and max_tokens, the model's stop tokens, API defaults
            sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=index, stop_token_ids=STOP_IDS)
            again = await engine.generate(prompt, sampling)
            assert again.output_ids == output, f"call {index}"
            logprobs = np.concatenate([nodes[i].logprobs for i in tree.calls[index][1]])
            np.testing.assert_allclose(logprobs, again.logprobs, atol=1e-4)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_plain_multi_turn_through_the_real_engine(api: str, engine_url: str, qwen3_model_dir: Path,
                                                       tmp_path: Path) -> None:
    async with serve(qwen3_model_dir, [engine_url], tmp_path) as served:
        s = await served.session()
        history: list[dict[str, Any]] = []
        for turn in range(TURNS):
            stream = turn % 2 == 1
            history.append({"role": "user", "content": f"Question {turn}: what comes next?"})
            text, chunks = await TALK[api](s, history, stream, seed=turn)
            if stream:
                assert chunks > 2  # tokens arrived as the engine produced them
            history.append({"role": "assistant", "content": text})
        await served.flush()
        await replay_matches(served, engine_url, s["session_id"])


async def talk_chat(s: dict, history: list[dict], stream: bool, seed: int) -> tuple[str, int]:
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
    kwargs: dict[str, Any] = {"model": "m", "messages": history, "max_tokens": 8, "seed": seed}
    async with client:
        if not stream:
            return (await client.chat.completions.create(**kwargs)).choices[0].message.content or "", 1
        text, chunks = "", 0
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            chunks += 1
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        return text, chunks


async def talk_responses(s: dict, history: list[dict], stream: bool, seed: int) -> tuple[str, int]:
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
    async with client:
        kwargs: dict[str, Any] = {"model": "m", "input": history, "max_output_tokens": 8, "extra_body": {"seed": seed}}
        if not stream:
            return (await client.responses.create(**kwargs)).output_text, 1
        text, chunks = "", 0
        async for event in await client.responses.create(**kwargs, stream=True):
            chunks += 1
            if event.type == "response.output_text.delta":
                text += event.delta
        return text, chunks


async def talk_messages(s: dict, history: list[dict], stream: bool, seed: int) -> tuple[str, int]:
    client = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
    async with client:
        kwargs: dict[str, Any] = {"model": "m", "messages": history, "max_tokens": 8, "extra_body": {"seed": seed}}
        if not stream:
            message = await client.messages.create(**kwargs)
            return "".join(b.text for b in message.content if b.type == "text"), 1
        text, chunks = "", 0
        async for event in await client.messages.create(**kwargs, stream=True):
            chunks += 1
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        return text, chunks


TALK = {"chat": talk_chat, "responses": talk_responses, "messages": talk_messages}
