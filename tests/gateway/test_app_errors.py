"""Bad input at every endpoint gets a 4xx/5xx in the API's own error format, nothing is half-recorded,
and the gateway keeps serving; a schema fuzz test finds no 500."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_helpers import ServedInThread, fake_engine, serve, tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 4}
COMPLETIONS = {"model": "m", "prompt": "hi", "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def gw(qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedInThread]:
    with ServedInThread(qwen3_model_dir, tmp_path_factory.mktemp("errors"), max_body_bytes=100_000,
                        context_length=256) as served:
        with httpx.Client(timeout=30) as served.client:
            yield served


@pytest.fixture()
def session(gw: ServedInThread) -> dict:
    return gw.run(gw.served.session())


def post(gw: ServedInThread, path: str, body: Any = None, key: str | None = None, raw: bytes | None = None,
         headers: dict | None = None) -> httpx.Response:
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return gw.client.post(gw.served.url + path, json=body if raw is None else None, content=raw, headers=headers)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_clear_errors_and_record_nothing(gw: ServedInThread, session: dict) -> None:
    base, key = f"/s/{session['session_id']}/v1", session["api_key"]
    openai_error(post(gw, f"{base}/chat/completions", raw=b"{not json", key=key), 400)
    anthropic_error(post(gw, f"{base}/messages", raw=b"[1, 2", key=key), 400)
    assert "messages" in openai_error(post(gw, f"{base}/chat/completions", {**CHAT, "messages": "hi"}, key), 400)["message"]
    openai_error(post(gw, f"{base}/chat/completions", {**CHAT, "temperature": "hot"}, key), 400)
    openai_error(post(gw, f"{base}/chat/completions", {**CHAT, "n": 0}, key), 400)
    anthropic_error(post(gw, f"{base}/messages", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, key), 400)
    openai_error(post(gw, f"{base}/responses", {**RESPONSES, "input": 5}, key), 400)
    openai_error(post(gw, f"{base}/completions", {**COMPLETIONS, "prompt": [10**9]}, key), 400)
    unknown_tool = {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}
    assert openai_error(post(gw, f"{base}/chat/completions", unknown_tool, key), 400)["param"] == "tool_choice"
    anthropic_error(post(gw, f"{base}/messages", {**MESSAGES, "tool_choice": {"type": "tool", "name": "rm"}}, key), 400)
    too_long = {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}
    assert openai_error(post(gw, f"{base}/chat/completions", too_long, key), 400)["code"] == "context_length_exceeded"
    assert anthropic_error(post(gw, f"{base}/messages", {**MESSAGES, "system": "x" * 200_000}, key), 413)["type"] == "request_too_large"
    gw.run(gw.served.flush())
    assert gw.served.calls(session["session_id"]) == []  # nothing half-recorded
    ok = post(gw, f"{base}/chat/completions", CHAT, key)  # and the gateway keeps serving
    assert ok.status_code == 200
    gw.run(gw.served.flush())
    assert len(gw.served.calls(session["session_id"])) == 1


def test_attribution_errors(gw: ServedInThread, session: dict) -> None:
    other = gw.run(gw.served.session())
    openai_error(post(gw, "/v1/chat/completions", CHAT), 401)
    openai_error(post(gw, "/v1/chat/completions", CHAT, key="sk-not-a-session"), 401)
    openai_error(post(gw, "/s/s-unknown/v1/chat/completions", CHAT, session["api_key"]), 404)
    assert openai_error(post(gw, f"/s/{other['session_id']}/v1/chat/completions", CHAT, session["api_key"]), 403)
    anthropic_error(post(gw, f"/s/{other['session_id']}/v1/messages", MESSAGES,
                         headers={"x-api-key": session["api_key"]}), 403)
    openai_error(post(gw, "/v1/chat/completions", CHAT, session["api_key"], headers={"X-Session-Id": other["session_id"]}), 403)
    openai_error(post(gw, f"/sessions/{other['session_id']}/reward", {"value": 1.0}, session["api_key"]), 403)
    openai_error(post(gw, f"/sessions/{other['session_id']}/end", {}, session["api_key"]), 403)
    openai_error(post(gw, "/sessions", {"task_id": "t", "harness": "h"}), 401)
    openai_error(post(gw, "/sessions", {"task_id": "t", "harness": "h"}, session["api_key"]), 401)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_engine_down_is_503_with_retry_after(qwen3_model_dir: Path, tmp_path: Path) -> None:
    async with serve(qwen3_model_dir, [f"http://127.0.0.1:{_free_port()}"], tmp_path) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            r = await c.post("/chat/completions", json=CHAT)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            r = await c.post("/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 503 and r.json()["error"]["message"].startswith("engine")
        await served.flush()
        assert served.calls(s["session_id"]) == []


async def test_engine_error_and_timeout(qwen3_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, [], fail_next=[500])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, engine_timeout=0.5) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=s["anthropic_base_url"], headers={"x-api-key": s["api_key"]}) as c:
            r = await c.post("/v1/messages", json=MESSAGES)
            assert r.status_code == 502 and r.json()["error"]["type"] == "api_error" and "Retry-After" in r.headers
            engine.latency = 2.0
            r = await c.post("/v1/messages", json=MESSAGES)
            assert r.status_code == 504 and "Retry-After" in r.headers
            engine.latency = 0.0
            assert (await c.post("/v1/messages", json=MESSAGES)).status_code == 200
        await served.flush()
        assert len(served.calls(s["session_id"])) == 1


async def test_stream_failing_after_the_headers_ends_with_the_api_error_event(qwen3_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """The engine stalls after its first token: the status is already sent, so the stream's last event is the
    OpenAI error object, with the same type, param and code as a non-streamed answer, and nothing is recorded."""
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, ["one two three four"] * 2, token_delay=1.0)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, engine_timeout=0.3) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=s["openai_base_url"], headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            for path, body in (("/chat/completions", CHAT), ("/completions", COMPLETIONS)):
                r = await c.post(path, json={**body, "max_tokens": 8, "stream": True})
                assert r.status_code == 200, path
                last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
                error = json.loads(last.removeprefix("data: "))["error"]
                assert error["code"] == "engine_error" and "param" in error, (path, error)
                assert error["type"] and "no answer within 0.3 s" in error["message"], (path, error)
        await served.flush()
        assert served.calls(s["session_id"]) == []


# --- fuzz: random and mutated bodies at every endpoint; no 500, always the API's error format ---

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=12)

MESSAGE_VALUES = {
    "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]) | JSON,
    "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "tool_result", "tool_use"]) | JSON, "text": st.text(max_size=10) | JSON})) | JSON,
    "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=5), "type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=5), "arguments": st.text(max_size=20) | JSON})}), max_size=2) | JSON,
}
MESSAGE = st.fixed_dictionaries({}, optional=MESSAGE_VALUES)


def mutated(valid: dict[str, Any], extra: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    fields = {k: st.just(v) | JSON for k, v in valid.items()}
    fields.update(extra)
    return st.fixed_dictionaries({}, optional=fields)


COMMON = {"messages": st.lists(MESSAGE, max_size=4) | JSON, "tools": st.just(TOOLS) | JSON,
          "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "get"}},
                                          {"type": "any"}, {"type": "tool", "name": "x"}]) | JSON,
          "stream": st.booleans() | JSON, "n": st.integers(-1, 3) | JSON, "max_tokens": st.integers(-1, 5) | JSON,
          "temperature": st.floats(-1, 3) | JSON, "stop": st.text(max_size=3) | JSON, "logprobs": st.booleans() | JSON,
          "top_logprobs": st.integers(-1, 30) | JSON, "input": st.text(max_size=10) | st.lists(MESSAGE, max_size=3) | JSON,
          "prompt": st.text(max_size=10) | st.lists(st.integers(-5, 200_000), max_size=5) | JSON}

BODIES = {
    "chat/completions": mutated(CHAT, COMMON),
    "messages": mutated(MESSAGES, COMMON),
    "responses": mutated(RESPONSES, COMMON),
    "completions": mutated(COMPLETIONS, COMMON),
}


# STEPLINE_FUZZ_EXAMPLES=2000 for the long run (docs/reference.md, Hardening)
FUZZ_EXAMPLES = int(os.environ.get("STEPLINE_FUZZ_EXAMPLES", "200"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(BODIES)), data=st.data())
def test_fuzz_model_apis_never_500(gw: ServedInThread, session: dict, path: str, data: st.DataObject) -> None:
    body = data.draw(BODIES[path] | JSON)
    r = post(gw, f"/s/{session['session_id']}/v1/{path}", body, session["api_key"])
    assert r.status_code < 500 or r.status_code in (502, 503, 504), r.text
    if r.status_code >= 400:
        (anthropic_error if path == "messages" else openai_error)(r, r.status_code)


@settings(max_examples=max(40, FUZZ_EXAMPLES // 5), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["/sessions", "reward", "end"]), body=JSON | st.fixed_dictionaries({}, optional={
    "task_id": st.text(max_size=5) | JSON, "harness": st.text(max_size=5) | JSON, "value": st.floats(allow_nan=False, allow_infinity=False) | JSON,
    "step": st.integers(-2, 3) | JSON, "status": st.sampled_from(["completed", "failed", "x"]) | JSON}))
def test_fuzz_session_routes_never_500(gw: ServedInThread, which: str, body: Any) -> None:
    s = gw.run(gw.served.session())
    path = which if which == "/sessions" else f"/sessions/{s['session_id']}/{which}"
    r = post(gw, path, body, "adm" if which == "/sessions" else s["api_key"])
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        openai_error(r, r.status_code)
