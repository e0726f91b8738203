"""Forks (stepline/gateway/forks.py): a fork replays its source's calls before the branch point without the engine,
keeps their exact ids (its first recorded prompt is the source's, token for token), samples from there,
records the link in the pool, and branches earlier where the harness does not repeat itself."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
from gateway_helpers import fake_engine, serve, tokenizer

from stepline.datapool.records import ForkPoint

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


def tool_call(q: str) -> str:
    return '<tool_call>\n{"name": "get", "arguments": {"q": "%s"}}\n</tool_call>' % q


async def play(s: dict, turns: int = 3, opening: str = "go", stream_first: bool = False) -> list[str]:
    """A deterministic harness: a tool call's result depends only on its arguments; returns what it saw."""
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
    history: list[Any] = [{"role": "user", "content": opening}]
    seen = []
    for turn in range(turns):
        if stream_first and turn == 0:
            stream = await client.chat.completions.create(model="m", messages=history, tools=TOOLS, stream=True)
            parts = [chunk async for chunk in stream]
            args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in parts
                           if c.choices and c.choices[0].delta.tool_calls)
            seen.append(args)
            calls = [{"id": "call_0", "type": "function", "function": {"name": "get", "arguments": args}}]
            message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": calls}
        else:
            m = (await client.chat.completions.create(model="m", messages=history, tools=TOOLS)).choices[0].message
            seen.append(m.tool_calls[0].function.arguments if m.tool_calls else m.content or "")
            if not m.tool_calls:
                break
            message = m.model_dump(exclude_none=True)
        history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                              "content": f"result of {message['tool_calls'][0]['function']['arguments']}"}]
    await client.close()
    return seen


async def fork(url: str, session: dict, call: int, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url) as c:
        return await c.post(f"/sessions/{session['session_id']}/fork", json={"call": call, **body},
                            headers={"Authorization": f"Bearer {session['api_key']}"})


async def test_a_fork_replays_its_prefix_and_samples_from_the_branch_point(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    script = [tool_call("a"), tool_call("b"), "done",  # the source: three calls
              tool_call("c"), "other",  # the fork at call 1 samples its calls 1 and 2
              "third"]  # the fork of the fork at call 2 samples its call 2
    engine = fake_engine(tok, script)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        source = await served.session(task="t1", harness="h", group_id="g", metadata={"reference": "Pine"})
        assert await play(source) == ['{"q": "a"}', '{"q": "b"}', "done"]
        asked = len(engine.requests)

        r = await fork(served.url, source, 1, metadata={"branch": 1})
        assert r.status_code == 201, r.text
        first = r.json()
        assert first["fork_of"] == {"session": source["session_id"], "call": 1}
        # call 0 is answered from the record (the engine is not asked), call 1 on is sampled
        assert await play(first, stream_first=True) == ['{"q": "a"}', '{"q": "c"}', "other"]
        assert len(engine.requests) == asked + 2

        r = await fork(served.url, first, 2)
        assert r.status_code == 201, r.text
        second = r.json()
        assert await play(second) == ['{"q": "a"}', '{"q": "c"}', "third"]  # the source's call 0, the fork's call 1
        await served.flush()

        calls = {s["session_id"]: served.calls(s["session_id"]) for s in (source, first, second)}
        trees = {sid: served.pool.get_tree(sid) for sid in calls}
        assert sorted(trees[first["session_id"]].calls) == [1, 2]  # replayed calls are not recorded again
        assert sorted(trees[second["session_id"]].calls) == [2]
        # token fidelity: the fork's prompt at its branch call is the source's prompt there, id for id
        assert calls[first["session_id"]][0][0] == calls[source["session_id"]][1][0]
        assert calls[second["session_id"]][0][0] == calls[first["session_id"]][1][0]
        # the shared prefix is context in the fork's tree (an observation), trained once, in the source
        fork_tree = trees[first["session_id"]]
        assert fork_tree.nodes[0].kind == "obs" and fork_tree.nodes[0].call_index == 1
        info = served.pool.get_session(first["session_id"])
        assert info.fork_of == ForkPoint(source["session_id"], 1)
        assert (info.task_id, info.harness, info.group_key) == ("t1", "h", "g")
        assert info.metadata["reference"] == "Pine" and info.metadata["branch"] == 1  # inherited, then added
        assert served.pool.get_session(second["session_id"]).fork_of == ForkPoint(first["session_id"], 2)


async def test_a_harness_that_does_not_repeat_itself_branches_earlier(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, [tool_call("a"), "done", "fresh"])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        source = await served.session()
        await play(source, turns=2)
        r = await fork(served.url, source, 1)
        assert r.status_code == 201
        assert await play(r.json(), turns=2, opening="something else") == ["fresh"]
        await served.flush()
        assert sorted(served.pool.get_tree(r.json()["session_id"]).calls) == [0]  # sampled from call 0 on


async def test_fork_requests_are_checked(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, ["x"]) as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        source, other = await served.session(), await served.session()
        await play(source, turns=1)
        assert (await fork(served.url, source, 1)).status_code == 400  # it has one call: 0
        assert (await fork(served.url, source, -1)).status_code == 400
        bad_link = await fork(served.url, source, 0, metadata={"fork_of": {"session": "s", "call": 0}})
        assert bad_link.status_code == 400
        foreign = {**source, "api_key": other["api_key"]}
        assert (await fork(served.url, foreign, 0)).status_code == 403  # another session's key
        async with httpx.AsyncClient(base_url=served.url) as c:
            assert (await c.post(f"/sessions/{source['session_id']}/fork", json={"call": 0})).status_code == 401
            made = await c.post("/sessions", json={"task_id": "t", "harness": "h", "metadata": {"fork_of": {}}},
                                headers={"Authorization": "Bearer adm"})
            assert made.status_code == 400 and "fork" in made.text
            shown = await c.get(f"/sessions/{source['session_id']}", headers={"Authorization": f"Bearer {source['api_key']}"})
            assert shown.status_code == 200
            assert shown.json()["calls"] == 1 and shown.json()["ended"] is False and shown.json()["fork_of"] is None


async def test_forks_are_bounded_per_session_and_per_group(qwen3_model_dir: Path, tmp_path: Path) -> None:
    # one session key could open forks without end (3,000 in 24 s): past the bound, 429 in the API's format
    engine = fake_engine(tokenizer(qwen3_model_dir), [tool_call("a"), "done"])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, max_forks_per_session=3,
                                    max_forks_per_group=4) as served:
        source = await served.session(task="t", harness="h", group_id="g")
        await play(source, turns=2)
        for _ in range(3):
            assert (await fork(served.url, source, 0)).status_code == 201
        refused = await fork(served.url, source, 0)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_forks"
        assert "max_forks_per_session" in refused.json()["error"]["message"]
        peer = await served.session(task="t", harness="h", group_id="g")
        await play(peer, turns=2)
        assert (await fork(served.url, peer, 0)).status_code == 201  # the group's 4th open fork
        refused = await fork(served.url, peer, 0)
        assert refused.status_code == 429 and "max_forks_per_group" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"]
        assert len(served.pool.list_sessions()) == 2 + 4  # nothing was created for a refused fork


async def test_an_unfinished_fork_stops_holding_its_group_after_its_own_short_bound(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # the source and its peer rewarded and ended; a fork nobody plays must not keep the group unclaimable
    # until the (long) session idle timeout
    engine = fake_engine(tokenizer(qwen3_model_dir), [tool_call("a"), "done"])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, fork_idle_timeout=0.5) as served:
        source = await served.session(task="t", harness="h", group_id="g")
        await play(source, turns=2)
        branch = (await fork(served.url, source, 1)).json()
        async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": "Bearer adm"}) as c:
            assert (await c.post(f"/sessions/{source['session_id']}/reward", json={"value": 1.0})).status_code == 200
            assert (await c.post(f"/sessions/{source['session_id']}/end", json={})).status_code == 200
        await served.flush()
        assert served.pool.claim_groups("t", 0, 10) == []  # the open fork holds the group
        for _ in range(100):  # the reaper sweeps every 0.125 s here; a bound, not a measurement
            if served.pool.get_session(branch["session_id"]).status != "open":
                break
            await asyncio.sleep(0.05)
        assert served.pool.get_session(branch["session_id"]).status == "abandoned"
        (group,) = served.pool.claim_groups("t", 0, 10)
        assert [e.info.session_id for e in group.episodes] == [source["session_id"]]
        assert served.pool.get_session(source["session_id"]).status == "completed"  # the 24 h timeout still rules it
