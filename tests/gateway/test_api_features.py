"""Request options reach the engine and come back in each API's fields: n choices (each its own
record), logprobs, stop / seed / temperature / top_p / max_tokens, usage in streams, Completions with
text and token-id prompts, Responses' previous_response_id."""

from __future__ import annotations

from pathlib import Path

import openai
from fakes.engine import Scripted
from gateway_helpers import fake_engine, scripted, serve, tokenizer


async def test_sampling_options_n_and_logprobs(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, ["one", "two"])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=2, temperature=0.5, top_p=0.9, seed=7,
            max_completion_tokens=5, stop=["\n\n"], logprobs=True, top_logprobs=3)
        await client.close()
        assert [c.message.content for c in r.choices] == ["one", "two"]
        sent = [body["sampling_params"] for _, body in engine.requests]
        assert sorted(p["sampling_seed"] for p in sent) == [7, 8]  # each choice its own reproducible seed
        assert {(p["temperature"], p["top_p"], p["max_new_tokens"], tuple(p["stop"])) for p in sent} == {(0.5, 0.9, 5, ("\n\n",))}
        one = scripted(tok, "one")
        first = r.choices[0].logprobs.content
        assert [t.token for t in first] == [tok.decode([i], skip_special_tokens=False) for i in one.output_ids]
        assert [t.logprob for t in first] == [-(k + 1) / 100 for k in range(len(one.output_ids))]  # FakeEngine's
        assert [[x.token for x in t.top_logprobs] for t in first] == [[t.token] for t in first]  # only the sampled one
        assert r.usage.completion_tokens == 2 * len(one.output_ids)
        await served.flush()
        calls = served.calls(s["session_id"])
        assert [o for _, o in calls] == [one.output_ids, scripted(tok, "two").output_ids]
        assert calls[0][0] == calls[1][0]


async def test_stream_usage_and_finish_reason_length(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["a b c d e f"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            stream_options={"include_usage": True})]
        await client.close()
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


async def test_completions_text_and_ids(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    answer = tok.encode(" there was", add_special_tokens=False).ids
    engine = fake_engine(tok, [])
    engine.queue.extend([Scripted(answer, text=" there was"), Scripted(answer, text=" there was"),
                         Scripted(answer, text=" there was")])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        r = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=4)
        assert r.choices[0].text == " there was" and r.choices[0].finish_reason == "stop"
        r = await client.completions.create(model="m", prompt="Once upon a time there was a cat", max_tokens=4)
        text = "".join([c.choices[0].text async for c in await client.completions.create(
            model="m", prompt=[1, 2, 3], max_tokens=4, stream=True) if c.choices])
        assert text == " there was"
        await client.close()
        await served.flush()
        (p0, o0), (p1, _), (p2, _) = served.calls(s["session_id"])
        assert p0 == tok.encode("Once upon a time", add_special_tokens=False).ids
        assert p1 == p0 + o0 + tok.encode(" a cat", add_special_tokens=False).ids  # the model's own tokens kept
        assert p2 == [1, 2, 3]


async def test_completions_stream_chunks_usage_and_text_memory(qwen3_model_dir: Path, tmp_path: Path) -> None:
    """A streamed Completions call: a `text_completion` chunk per engine delta (`usage: null` on each under
    include_usage), one with the finish reason, the usage event, `[DONE]`; its text answer is remembered."""
    import json

    import httpx

    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["a b", "c"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers=headers) as c:
            r = await c.post("/completions", json={"model": "m", "prompt": "Once", "stream": True, "logprobs": 1,
                                                   "stream_options": {"include_usage": True}})
            await c.post("/completions", json={"model": "m", "prompt": "Oncea b more", "max_tokens": 2})
        events = r.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        *deltas, last, usage = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in [*deltas, last])
        assert "".join(c["choices"][0]["text"] for c in deltas) == "a b"
        assert {c["choices"][0]["finish_reason"] for c in deltas} == {None}
        one = scripted(tok, "a b").output_ids
        assert [lp for c in deltas for lp in c["choices"][0]["logprobs"]["token_logprobs"]] == [
            -(k + 1) / 100 for k in range(len(one))]  # FakeEngine's
        assert last["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
        prompt = len(tok.encode("Once", add_special_tokens=False).ids)
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": prompt, "completion_tokens": len(one),
                                  "total_tokens": prompt + len(one)}
        await served.flush()
        (p0, o0), (p1, _) = served.calls(s["session_id"])
        assert p1[: len(p0) + len(o0) - 1] == p0 + o0[:-1]  # the streamed answer's ids, less its stop token


async def test_responses_previous_response_id(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["First.", "Second."]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        r1 = await client.responses.create(model="m", input="hi", instructions="Be brief.")
        r2 = await client.responses.create(model="m", input="more", previous_response_id=r1.id, instructions="Be brief.")
        assert (r1.output_text, r2.output_text) == ("First.", "Second.")
        assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
        await client.close()
        await served.flush()
        (p0, o0), (p1, _) = served.calls(s["session_id"])
        assert p1[: len(p0) + len(o0)] == p0 + o0


async def test_streamed_choices_interleave_and_each_is_recorded(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, ["alpha beta gamma", "one two three"], token_delay=0.001)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        texts = {0: "", 1: ""}
        async for chunk in await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], n=2, stream=True, logprobs=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        await client.close()
        assert sorted(texts.values()) == ["alpha beta gamma", "one two three"]
        await served.flush()
        outputs = sorted(o for _, o in served.calls(s["session_id"]))
        assert outputs == sorted([scripted(tok, "alpha beta gamma").output_ids, scripted(tok, "one two three").output_ids])


async def test_client_leaving_a_stream_records_nothing(qwen3_model_dir: Path, tmp_path: Path) -> None:
    import asyncio

    import httpx

    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, [" ".join(["word"] * 60), "fine"], token_delay=0.02)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers=headers) as c:
            async with c.stream("POST", "/chat/completions", json=body) as r:
                async for _line in r.aiter_lines():
                    break  # the harness gives up after the first chunk
            await asyncio.sleep(0.5)
            ok = await c.post("/chat/completions", json={**body, "stream": False})
            assert ok.json()["choices"][0]["message"]["content"] == "fine"
        await asyncio.sleep(1.5)  # longer than the abandoned stream would have run
        assert engine.in_flight == 0
        await served.flush()
        assert [o for _, o in served.calls(s["session_id"])] == [scripted(tok, "fine").output_ids]


async def test_anthropic_count_tokens(qwen3_model_dir: Path, tmp_path: Path) -> None:
    import anthropic

    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["hi"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "hello there"}]
        counted = await client.messages.count_tokens(model="m", messages=messages, system="S")
        made = await client.messages.create(model="m", max_tokens=4, messages=messages, system="S")
        await client.close()
        assert counted.input_tokens == made.usage.input_tokens
        text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
        assert counted.input_tokens == len(tok.encode(text, add_special_tokens=False).ids)


EDGE_ANSWERS = ["<think>\n\n</think>\n\n", "<think>\nonly thinking\n</think>\n\n", "<think>\n\n</think>\n\nHi",
                '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>']


async def test_streamed_blocks_and_items_match_the_whole_answer(qwen3_model_dir: Path, tmp_path: Path) -> None:
    import anthropic

    tok = tokenizer(qwen3_model_dir)
    doubled = [text for text in EDGE_ANSWERS for _ in range(4)]  # whole + stream, for each API
    tools = [{"name": "get", "input_schema": {"type": "object"}}]
    async with fake_engine(tok, doubled) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        claude = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
        gpt = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        for text in EDGE_ANSWERS:
            kwargs = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": text}], "tools": tools}
            whole = await claude.messages.create(**kwargs)
            async with claude.messages.stream(**kwargs) as stream:
                streamed = await stream.get_final_message()
            assert [b.type for b in streamed.content] == [b.type for b in whole.content], text
            rkw = {"model": "m", "input": text, "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}]}
            whole_r = await gpt.responses.create(**rkw)
            added = [e.item.type async for e in await gpt.responses.create(**rkw, stream=True)
                     if e.type == "response.output_item.added"]
            assert added == [o.type for o in whole_r.output], text
        await claude.close()
        await gpt.close()
