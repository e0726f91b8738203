"""The unmodified `openai` and `anthropic` SDKs drive 5-turn tool-calling conversations through Chat
Completions, Responses and Messages, streamed and not. The engine (FakeEngine) answers with the real
Qwen3 token ids of scripted tool-call text; every recorded call must hold exactly those ids, and each
call's prompt must begin with the previous call's prompt + output ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from gateway_helpers import Served, fake_engine, scripted, serve, tokenizer

CALLS = ['{"name": "get", "arguments": {"q": "' + q + '"}}' for q in "abcde"]


def call(i: int) -> str:
    return "<tool_call>\n" + CALLS[i] + "\n</tool_call>"


# what the model "samples" on each turn: reasoning, parallel calls, text + call, a bare call, the answer
TURNS = [
    "<think>\nNeed data.\n</think>\n\n" + call(0),
    "<think>\nTwo more.\n</think>\n\n" + call(1) + "\n" + call(2),
    "<think>\n\n</think>\n\nChecking.\n" + call(3),
    call(4),
    "<think>\nDone.\n</think>\n\nThe answer is 42.",
]
EXPECTED_QUERIES = [["a"], ["b", "c"], ["d"], ["e"], []]

OPENAI_TOOLS = [{"type": "function", "function": {"name": "get", "description": "Look something up.",
                                                  "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


async def drive_chat(client: openai.AsyncOpenAI, stream: bool) -> list[list[str]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You look things up."},
                                      {"role": "user", "content": "What is it?"}]
    seen = []
    for _ in TURNS:
        if stream:
            async with client.chat.completions.stream(model="m", messages=messages, tools=OPENAI_TOOLS) as s:
                async for _event in s:
                    pass
                message = (await s.get_final_completion()).choices[0].message
        else:
            message = (await client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)).choices[0].message
        calls = message.tool_calls or []
        seen.append([json.loads(c.function.arguments)["q"] for c in calls])
        echo: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            echo["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        messages.append(echo)  # a typical harness: reasoning is not echoed
        messages += [{"role": "tool", "tool_call_id": c.id, "content": f"result {c.function.arguments}"} for c in calls]
    assert message.content == "The answer is 42."
    return seen


async def drive_responses(client: openai.AsyncOpenAI, stream: bool) -> list[list[str]]:
    tools = [{"type": "function", "name": "get", "description": "Look something up.",
              "parameters": OPENAI_TOOLS[0]["function"]["parameters"]}]
    items: list[Any] = [{"role": "user", "content": "What is it?"}]
    seen = []
    for _ in TURNS:
        kwargs = {"model": "m", "input": items, "instructions": "You look things up.", "tools": tools}
        if stream:
            async with client.responses.stream(**kwargs) as s:
                async for _event in s:
                    pass
                response = await s.get_final_response()
        else:
            response = await client.responses.create(**kwargs)
        calls = [o for o in response.output if o.type == "function_call"]
        seen.append([json.loads(c.arguments)["q"] for c in calls])
        items += [o.model_dump(exclude_none=True) for o in response.output]  # the SDK's documented loop
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {c.arguments}"} for c in calls]
    assert response.output_text == "The answer is 42."
    return seen


async def drive_messages(client: anthropic.AsyncAnthropic, stream: bool) -> list[list[str]]:
    tools = [{"name": "get", "description": "Look something up.", "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is it?"}]
    seen = []
    for _ in TURNS:
        kwargs = {"model": "m", "max_tokens": 200, "system": "You look things up.", "messages": messages, "tools": tools}
        if stream:
            async with client.messages.stream(**kwargs) as s:
                async for _event in s:
                    pass
                message = await s.get_final_message()
        else:
            message = await client.messages.create(**kwargs)
        uses = [b for b in message.content if b.type == "tool_use"]
        seen.append([u.input["q"] for u in uses])
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"result {json.dumps(u.input)}"} for u in uses]})
    assert message.stop_reason == "end_turn"
    assert [b.text for b in message.content if b.type == "text"] == ["The answer is 42."]
    return seen


def check_records(served: Served, session_id: str, expected_outputs: list[list[int]]) -> None:
    calls = served.calls(session_id)
    assert [output for _, output in calls] == expected_outputs  # exactly what the engine sampled
    for (prompt, output), (next_prompt, _) in zip(calls, calls[1:]):
        assert next_prompt[: len(prompt) + len(output)] == prompt + output


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_five_turn_tool_conversation(api: str, stream: bool, qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    expected = [scripted(tok, text).output_ids for text in TURNS]
    async with fake_engine(tok, TURNS) as engine_url, serve(qwen3_model_dir, [engine_url], tmp_path) as served:
        s = await served.session()
        if api == "messages":
            client: Any = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
            seen = await drive_messages(client, stream)
        else:
            client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
            seen = await (drive_chat if api == "chat" else drive_responses)(client, stream)
        await client.close()
        assert seen == EXPECTED_QUERIES
        await served.flush()
        check_records(served, s["session_id"], expected)
        info = served.pool.get_session(s["session_id"])
        assert (info.task_id, info.harness) == ("t", "h")
