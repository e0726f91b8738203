"""`records_from_conversation`: a demonstration is recorded exactly as the gateway records a served session
whose model sampled those very answers (same prompt ids, same output ids, turn after turn)."""

from __future__ import annotations

from pathlib import Path

import httpx
from gateway_helpers import fake_engine, serve, tokenizer

from stepline.gateway.demonstrations import records_from_conversation
from stepline.gateway.templating import ChatTemplate

ANSWERS = ["hello there", "the answer is 4"]
CONVERSATION = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": ANSWERS[0]},
    {"role": "user", "content": "what is 2 + 2?"},
    {"role": "assistant", "content": ANSWERS[1]},
]}


async def test_a_demonstration_is_the_record_of_a_session_that_sampled_its_answers(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    tok = tokenizer(tiny_model_dir)
    async with fake_engine(tok, ANSWERS) as url, serve(tiny_model_dir, [url], tmp_path) as served:
        s = await served.session()
        headers = {"Authorization": f"Bearer {s['api_key']}"}
        async with httpx.AsyncClient(base_url=f"{served.url}/s/{s['session_id']}/v1", headers=headers) as client:
            for end in (2, 4):  # the harness sends the history up to each assistant turn
                body = {"model": "m", "messages": CONVERSATION["messages"][:end]}
                r = await client.post("/chat/completions", json=body)
                assert r.json()["choices"][0]["message"]["content"] == ANSWERS[end // 2 - 1]
        await served.flush()
        served_calls = served.calls(s["session_id"])

    records = records_from_conversation(ChatTemplate.from_model_dir(tiny_model_dir), CONVERSATION, "demo-1")
    assert [(r.prompt_ids.tolist(), r.output_ids.tolist()) for r in records] == served_calls
    assert [r.call_index for r in records] == [0, 1]
    assert all(r.session_id == "demo-1" and r.weight_version == 0 and not r.output_logprobs.any() for r in records)


def test_anthropic_tools_read_as_a_messages_request(tiny_model_dir: Path) -> None:
    tools = [{"name": "add", "description": "adds", "input_schema": {"type": "object", "properties": {}}}]
    records = records_from_conversation(ChatTemplate.from_model_dir(tiny_model_dir),
                                        {**CONVERSATION, "tools": tools}, "demo-2")
    assert [r.api for r in records] == ["messages", "messages"]


def test_a_conversation_without_an_assistant_turn_has_no_records(tiny_model_dir: Path) -> None:
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert records_from_conversation(template, {"messages": CONVERSATION["messages"][:2]}, "demo-3") == []


async def post_demonstration(url: str, session_id: str, body: object, token: str | None = "adm") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.post(f"/sessions/{session_id}/demonstration", json=body, headers=headers)


async def test_an_expert_session_records_the_conversation_at_the_serving_version(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """An expert's episode in a training group: its calls are those of the conversation, token for token, stamped
    with the weight version serving at the time (so the staleness bound keeps them), with logprobs 0."""
    async with fake_engine(tokenizer(tiny_model_dir), []) as url, \
            serve(tiny_model_dir, [url], tmp_path, initial_version=7) as served:
        s = await served.session(metadata={"expert": True})
        r = await post_demonstration(served.url, s["session_id"], CONVERSATION)
        assert r.status_code == 200, r.text
        assert r.json() == {"ok": True, "calls": 2}
        recorded = served.pool.get_calls(s["session_id"])
        again = await post_demonstration(served.url, s["session_id"], CONVERSATION)
    expected = records_from_conversation(ChatTemplate.from_model_dir(tiny_model_dir), CONVERSATION, "x")
    assert [(c.prompt_ids.tolist(), c.output_ids.tolist()) for c in recorded] == \
        [(r.prompt_ids.tolist(), r.output_ids.tolist()) for r in expected]
    assert {c.weight_version for c in recorded} == {7}
    assert not any(c.output_logprobs.any() for c in recorded)
    assert again.status_code == 409  # a session holds one episode


async def test_an_expert_session_takes_no_model_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Its calls would train with ratio 1 as the expert's: the gateway answers 409 instead of asking the engine."""
    async with fake_engine(tokenizer(tiny_model_dir), ["hello"]) as url, \
            serve(tiny_model_dir, [url], tmp_path) as served:
        s = await served.session(metadata={"expert": True})
        async with httpx.AsyncClient(base_url=s["openai_base_url"],
                                     headers={"Authorization": f"Bearer {s['api_key']}"}) as client:
            r = await client.post("/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert served.pool.get_calls(s["session_id"]) == []
    assert r.status_code == 409 and r.json()["error"]["code"] == "expert_session"


async def test_a_demonstration_is_refused_where_it_would_pass_for_the_policy(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    async with fake_engine(tokenizer(tiny_model_dir), []) as url, serve(tiny_model_dir, [url], tmp_path) as served:
        plain = await served.session()
        expert = await served.session(metadata={"expert": True})
        not_expert = await post_demonstration(served.url, plain["session_id"], CONVERSATION)
        own_key = await post_demonstration(served.url, expert["session_id"], CONVERSATION, token=expert["api_key"])
        no_messages = await post_demonstration(served.url, expert["session_id"], {"messages": []})
        not_a_conversation = await post_demonstration(served.url, expert["session_id"], {"messages": [{"role": 3}]})
        no_answer = await post_demonstration(served.url, expert["session_id"],
                                             {"messages": CONVERSATION["messages"][:2]})
        unknown = await post_demonstration(served.url, "nope", CONVERSATION)
        assert served.pool.get_calls(expert["session_id"]) == []
    assert not_expert.status_code == 400 and "metadata.expert" in not_expert.text
    assert own_key.status_code == 401
    assert (no_messages.status_code, not_a_conversation.status_code, no_answer.status_code) == (400, 400, 400)
    assert "no assistant turn" in no_answer.text
    assert unknown.status_code == 404
