"""Sessions over HTTP: creation, the three ways a call is attributed, rewards and ends committed to
the pool, and forks (a retry, an edited tool result, stripped reasoning under the strict option)
recorded as calls that diverge exactly at the first differing token."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from gateway_helpers import fake_engine, serve, tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def test_create_attribute_reward_end(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["a", "b", "c", "d"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session(task="task-1", harness="search", group_id="g", metadata={"k": 1})
        host = served.url
        assert s["openai_base_url"] == f"{host}/s/{s['session_id']}/v1"
        assert s["anthropic_base_url"] == f"{host}/s/{s['session_id']}"
        other = await served.session()
        async with httpx.AsyncClient(base_url=host) as c:
            key = {"Authorization": f"Bearer {s['api_key']}"}
            assert (await c.post(f"/s/{s['session_id']}/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
            msg = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            assert (await c.post("/v1/messages", json=msg, headers={"x-api-key": s["api_key"]})).status_code == 200
            by_header = {"X-Session-Id": other["session_id"], "Authorization": f"Bearer {other['api_key']}"}
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=by_header)).status_code == 200
            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == "stepline"
            health = (await c.get("/health")).json()
            assert health["status"] == "ok" and health["weight_version"] == 0
            assert (await c.post(f"/sessions/{s['session_id']}/reward", json={"value": 0.5, "step": 1, "name": "tool"},
                                 headers=key)).status_code == 200
            assert (await c.post(f"/sessions/{s['session_id']}/reward", json={"value": 1.0}, headers=key)).status_code == 200
            assert (await c.post(f"/sessions/{s['session_id']}/reward", json={"value": 1.0, "step": 7},
                                 headers=key)).status_code == 400
            assert (await c.post(f"/sessions/{s['session_id']}/end", json={"status": "completed"}, headers=key)).status_code == 200
            # the end was acknowledged after the pool committed it and every call before it
            episode = served.pool.get_episode(s["session_id"])
            assert episode.info.status == "completed" and episode.info.group_key == "g"
            assert episode.outcome == 1.0
            assert sorted((r.step, r.name, r.value) for r in episode.rewards if r.step is not None) == [(1, "tool", 0.5)]
            assert len(episode.tree.calls) == 3
            assert len(served.pool.get_tree(other["session_id"]).calls) == 1
            r = await c.post(f"/s/{s['session_id']}/v1/chat/completions", json=CHAT, headers=key)
            assert r.status_code == 409  # an ended session takes no more calls


async def test_forks_diverge_at_the_first_differing_token(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    call = '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    async with fake_engine(tok, [call, call, "retry", "edited"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        history = [{"role": "user", "content": "go"}]
        for result in ("alpha", "beta"):
            m = (await client.chat.completions.create(model="m", messages=history, tools=tools)).choices[0].message
            history += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": result}]
        await client.chat.completions.create(model="m", messages=history[:3], tools=tools)  # a retry of call 1
        edited = [*history[:2], {**history[2], "content": "omega"}, *history[3:]]
        await client.chat.completions.create(model="m", messages=edited, tools=tools)
        await client.close()
        await served.flush()
        (p0, o0), (p1, _), (p2, _), (p3, _) = served.calls(s["session_id"])
        assert p2 == p1  # the retry repeats call 1's prompt exactly: siblings in the tree
        opening = tok.encode("\n<|im_start|>user\n<tool_response>\n", add_special_tokens=False).ids
        assert first_difference(p3, p1) == len(p0) + len(o0) + len(opening)  # at the edited result's first token


async def test_strict_template_forks_where_reasoning_is_stripped(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with (fake_engine(tok, ["<think>\nhmm\n</think>\n\nHello", "Bye"]) as url,
                serve(qwen3_model_dir, [url], tmp_path, strict_template=True) as served):
        s = await served.session()
        client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        history = [{"role": "user", "content": "hi"}]
        m = (await client.chat.completions.create(model="m", messages=history)).choices[0].message
        assert m.content == "Hello"
        history += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=history)
        await client.close()
        await served.flush()
        (p0, o0), (p1, _) = served.calls(s["session_id"])
        assert first_difference(p1, p0 + o0) == len(p0)  # the template drops the <think> the model wrote
        assert o0[0] == tok.token_to_id("<think>")


async def test_calls_are_stamped_with_the_weight_version_at_dispatch(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["a", "b"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=served.url) as c:
            key = {"Authorization": f"Bearer {s['api_key']}"}
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
            r = await c.post("/admin/update_weights", json={"path": str(tmp_path), "version": 3},
                             headers={"Authorization": "Bearer adm"})
            assert r.json() == {"weight_version": 3}
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
        await served.flush()
        tree = served.pool.get_tree(s["session_id"])
        nodes = {n.id: n for n in tree.nodes}
        versions = [nodes[tree.calls[i][1][0]].weight_version for i in sorted(tree.calls)]
        assert versions == [0, 3]


async def test_request_and_answer_are_recorded_compressed(qwen3_model_dir: Path, tmp_path: Path) -> None:
    """What the pool receives for a call: the request body and the API answer, zstd-compressed JSON."""
    import orjson
    import zstandard

    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["hello"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        seen = []
        add_calls = served.pool.add_calls
        served.pool.add_calls = lambda batch: (seen.extend(batch), add_calls(batch))[1]  # type: ignore[method-assign]
        async with httpx.AsyncClient(base_url=served.url) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "seed": 3},
                             headers={"Authorization": f"Bearer {s['api_key']}"})
        await served.flush()
        (record,) = seen
        unzip = zstandard.ZstdDecompressor()
        assert orjson.loads(unzip.decompress(record.request)) == {**CHAT, "seed": 3}
        assert orjson.loads(unzip.decompress(record.response)) == r.json()
        assert (record.api, record.call_index, record.finish_reason) == ("chat.completions", 0, "stop")
        assert record.sampling["seed"] == 3 and record.sampling["max_new_tokens"] == 4
        assert set(record.timings) >= {"received", "dispatched", "done"}


async def test_calls_during_a_weight_update_wait_then_get_503(qwen3_model_dir: Path, tmp_path: Path) -> None:
    import asyncio

    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, ["a"], update_delay=1.0)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, max_wait_paused=0.2) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=served.url) as c:
            update = asyncio.create_task(c.post("/admin/update_weights", json={"path": str(tmp_path), "version": 1},
                                                headers={"Authorization": "Bearer adm"}))
            await asyncio.sleep(0.2)
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['api_key']}"})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["message"].startswith("weights are being updated")
            assert (await update).status_code == 200
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['api_key']}"})
            assert r.status_code == 200
        await served.flush()
        assert len(served.calls(s["session_id"])) == 1


def test_token_memory_is_bounded_to_the_most_recent_sessions(qwen3_model_dir: Path) -> None:
    import numpy as np

    from stepline.gateway.sessions import SessionStore
    from stepline.gateway.templating import load_template

    store = SessionStore(load_template(qwen3_model_dir), max_live=1)
    a, b = store.new("t", "h", None, {}), store.new("t", "h", None, {})
    store.add(a)
    store.add(b)
    store.touch(a)
    prompt = a.tokens.prompt_for([{"role": "user", "content": "hi"}], None)
    a.tokens.remember(prompt, {"role": "assistant", "content": "x"}, np.asarray([151645], dtype=np.int32))
    assert a.tokens.prompt_for([{"role": "user", "content": "hi"}], None).reused == len(prompt.ids)
    store.touch(b)  # a is now the least recently used beyond the bound: its memory goes
    assert a.tokens.prompt_for([{"role": "user", "content": "hi"}], None).reused == 0


async def test_a_sessions_purpose_is_typed(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    admin = {"Authorization": "Bearer adm"}
    async with fake_engine(tok, ["a"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        async with httpx.AsyncClient(base_url=served.url, headers=admin) as c:
            for bad in ("training", "", 1, None, ["eval"]):
                r = await c.post("/sessions", json={"task_id": "t", "harness": "h", "purpose": bad})
                assert r.status_code == 400, (bad, r.text)
                error = r.json()["error"]
                assert error["param"] == "purpose" and "'train', 'eval' or 'demo'" in error["message"], error
        trained, evaluated = await served.session(), await served.session(purpose="eval", metadata={"split": "test"})
        async with httpx.AsyncClient(base_url=served.url, headers=admin) as c:
            chat = await c.post(f"/s/{evaluated['session_id']}/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"Bearer {evaluated['api_key']}"})
            assert chat.status_code == 200, chat.text
            await served.flush()
            shown = (await c.get(f"/sessions/{evaluated['session_id']}")).json()
            fork = await c.post(f"/sessions/{evaluated['session_id']}/fork", json={"call": 0})
            assert fork.status_code == 201, fork.text
            bad_fork = await c.post(f"/sessions/{evaluated['session_id']}/fork", json={"call": 0, "purpose": "train"})
        assert shown["purpose"] == "eval"
        assert bad_fork.status_code == 400  # a fork keeps its source's purpose
        assert served.pool.get_session(trained["session_id"]).purpose == "train"
        assert served.pool.get_session(evaluated["session_id"]).purpose == "eval"
        assert served.pool.get_session(fork.json()["session_id"]).purpose == "eval"


async def test_the_runners_sampling_holds_for_every_call_of_a_session(qwen3_model_dir: Path, tmp_path: Path) -> None:
    # training rollouts at the runner's temperature, evaluations greedy: whatever the black-box harness asks
    tok = tokenizer(qwen3_model_dir)
    admin = {"Authorization": "Bearer adm"}
    async with fake_engine(tok, ["a", "b", "c", "d"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        async with httpx.AsyncClient(base_url=served.url, headers=admin) as c:
            for bad in ({"temperature": 5}, {"temperature": "hot"}, {"top_p": 0}, {"top_k": -2}, {"seed": 1}, 0.7):
                r = await c.post("/sessions", json={"task_id": "t", "harness": "h", "sampling": bad})
                assert r.status_code == 400 and "sampling" in r.json()["error"]["param"], (bad, r.text)
        fixed = await served.session(sampling={"temperature": 0, "top_k": 5})
        free = await served.session()
        async with httpx.AsyncClient(base_url=served.url) as c:
            for s in (fixed, free):
                key = {"Authorization": f"Bearer {s['api_key']}"}
                chat = await c.post(f"/s/{s['session_id']}/v1/chat/completions", headers=key,
                                    json={**CHAT, "temperature": 0.9, "top_p": 0.8})
                text = await c.post(f"/s/{s['session_id']}/v1/completions", headers=key,
                                    json={"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0.9})
                assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
            fork = await c.post(f"/sessions/{fixed['session_id']}/fork", json={"call": 0}, headers=admin)
            assert fork.status_code == 201, fork.text
            branch = fork.json()
            r = await c.post(f"/s/{branch['session_id']}/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {branch['api_key']}"})
            assert r.status_code == 200, r.text
        await served.flush()

        def sampled(session: dict) -> list[tuple]:
            return [(c.sampling["temperature"], c.sampling["top_p"], c.sampling["top_k"])
                    for c in served.pool.get_calls(session["session_id"])]

        assert sampled(fixed) == [(0.0, 0.8, 5), (0.0, 1.0, 5)]  # the session's fields win; top_p stays the request's
        assert sampled(free) == [(0.9, 0.8, -1), (0.9, 1.0, -1)]
        assert sampled(branch)[-1] == (0.0, 1.0, 5)  # a fork samples as its source did


async def test_a_reward_whose_product_is_not_finite_is_refused_naming_the_field(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # a session's own key posted this: each factor finite, their product not; trained on, the policy went NaN
    async with fake_engine(tokenizer(qwen3_model_dir), []) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            for body, field in (({"value": 1e300, "name": "bonus", "weight": 1e10}, "value"),
                                ({"value": 1.0, "name": "bonus", "weight": 1e10}, "weight"),
                                ({"value": 1e5, "name": "bonus", "weight": 1e5}, "value × weight")):
                r = await c.post(f"/sessions/{s['session_id']}/reward", json=body)
                assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        assert served.pool.get_episode(s["session_id"]).rewards == []
