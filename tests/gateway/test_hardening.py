"""Bounded work per request and validation at the edge: bodies
counted after decompression (413), large bodies parsed and rendered off the event loop, prompt batches
and n capped, integers beyond 64 bits refused with a 400 that names the field, and a session's URL
is an address, not a credential."""

from __future__ import annotations

import asyncio
import gzip
import json  # writes integers of any size (orjson refuses those beyond 64 bits)
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import orjson
import pytest
from gateway_helpers import ServedInThread, fake_engine, serve, tokenizer

from stepline.gateway.frontends import stages as flow
from stepline.gateway.frontends.edge import check_int64, int64_violation
from stepline.gateway.frontends.errors import ApiError
from stepline.gateway.frontends.prompting import choice_seed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def gw(qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedInThread]:
    # the default body limit and offload threshold: what a deployment gets
    with ServedInThread(qwen3_model_dir, tmp_path_factory.mktemp("hardening"), context_length=256) as served:
        with httpx.Client(timeout=60) as served.client:
            yield served


@pytest.fixture()
def session(gw: ServedInThread) -> dict:
    return gw.run(gw.served.session())


def post(gw: ServedInThread, session: dict, path: str, body: object = None, content: bytes | None = None,
         headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {session['api_key']}", **(headers or {})}
    url = f"{gw.served.url}/s/{session['session_id']}/v1/{path}"
    return gw.client.post(url, json=body if content is None else None, content=content, headers=headers)


def test_a_small_gzip_body_inflating_past_the_limit_is_413(gw: ServedInThread, session: dict) -> None:
    # 20 KB of gzip inflating to 10 MB used to be parsed and tokenised in full
    big = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "a" * 10_000_000}]})
    packed = gzip.compress(big)
    assert len(packed) < 100_000
    r = post(gw, session, "chat/completions", content=packed,
             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert post(gw, session, "chat/completions", CHAT).status_code == 200  # and it keeps serving


def test_a_large_body_is_rendered_off_the_event_loop(gw: ServedInThread, session: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    original = flow.build_prompt

    def spy(*args):
        threads.append(threading.current_thread())
        return original(*args)

    monkeypatch.setattr(flow, "build_prompt", spy)
    assert post(gw, session, "chat/completions", CHAT).status_code == 200
    large = {**CHAT, "messages": [{"role": "user", "content": "word " * 100_000}]}  # 500 KB > offload_bytes
    r = post(gw, session, "chat/completions", large)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert threads[0] is gw.thread  # small: on the loop, as before
    assert threads[1] is not gw.thread  # large: on a worker thread; the loop keeps serving others


@pytest.mark.slow
def test_a_long_prompt_being_tokenized_leaves_the_event_loop_free(gw: ServedInThread, session: dict) -> None:
    # a 7.9 MB body stalled /health 6.4-8.2 s: the tokenizer held the GIL on the worker thread (about 10 s here)
    words = " ".join(f"w{i % 997} said {i % 13}," for i in range(200_000))  # 2.9 MB, about 1.2M tokens
    big = {**CHAT, "messages": [{"role": "user", "content": words}]}
    answer: list[httpx.Response] = []
    url = f"{gw.served.url}/s/{session['session_id']}/v1/chat/completions"

    def call() -> None:  # its own client: tokenizing 1.2M tokens takes 5-30 s, longer than the module's timeout
        with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {session['api_key']}"}) as client:
            answer.append(client.post(url, json=big))

    worker = threading.Thread(target=call)
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        start = time.perf_counter()
        assert gw.client.get(f"{gw.served.url}/health").status_code == 200
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.02)
    worker.join()
    assert answer[0].json()["error"]["code"] == "context_length_exceeded"  # tokenized in full, then refused
    assert slowest < 1.0  # a bound far above the few ms it takes, far below the seconds it took


def test_a_long_number_across_the_int64_scans_slices_is_still_found() -> None:
    raw = b'{"a": "' + b" " * (64 * 1024 - 12) + b'", "b": 123456789012345678901}'
    with pytest.raises(ApiError) as err:
        check_int64(raw)
    assert err.value.param == "b"


def test_completions_prompt_batches_and_n_are_capped(gw: ServedInThread, session: dict) -> None:
    # one request of 1,600 prompts became 1,600 engine requests
    r = post(gw, session, "completions", {"model": "m", "prompt": ["hi"] * 65, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post(gw, session, "completions", {"model": "m", "prompt": ["hi"] * 17, "n": 16, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = post(gw, session, "completions", {"model": "m", "prompt": ["hi"] * 4, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


@pytest.mark.parametrize(("path", "body", "field"), [
    ("chat/completions", {**CHAT, "seed": 2**64}, "seed"),
    ("chat/completions", {**CHAT, "max_tokens": -(2**63) - 1}, "max_tokens"),
    ("responses", {"model": "m", "input": "hi", "max_output_tokens": 2**64}, "max_output_tokens"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "get", "parameters": {"type": "object", "properties": {"n": {"maximum": 10**30}}}}}]},
     "tools.0.function.parameters.properties.n.maximum"),
    ("messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "seed": 2**70},
     "seed"),
    ("completions", {"model": "m", "prompt": [1, 2**64], "max_tokens": 2}, "prompt.1"),
])
def test_integers_beyond_64_bits_are_400_naming_the_field(gw: ServedInThread, session: dict, path: str,
                                                          body: dict, field: str) -> None:
    # they passed the schema and failed in orjson ("Integer exceeds 64-bit range") -> 500
    r = post(gw, session, path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert field in r.text


def test_the_largest_seed_still_serves_every_choice(gw: ServedInThread, session: dict) -> None:
    r = post(gw, session, "chat/completions", {**CHAT, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert [choice_seed(2**63 - 1, i) for i in range(2)] == [2**63 - 1, 0]  # wraps inside [0, 2^63)
    assert choice_seed(-1, 0) == 2**63 - 1


def test_int64_violation_names_the_first_bad_path() -> None:
    assert int64_violation({"a": [1, {"b": 2**63}]}) == "a.1.b"
    assert int64_violation({"a": -(2**63), "b": 2**63 - 1, "c": True, "d": 1e300}) is None


async def _until(condition, seconds: float = 15.0) -> bool:
    """Poll `condition` until it holds or `seconds` pass (a bound, not a measurement)."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def test_a_client_hanging_up_cancels_its_engine_request(qwen3_model_dir: Path, tmp_path: Path) -> None:
    # the engine kept generating >= 25 s after the client was gone
    tok = tokenizer(qwen3_model_dir)
    engine = fake_engine(tok, ["hello"], latency=60.0)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path) as served:
        s = await served.session()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}, timeout=120) as c:
            call = asyncio.create_task(c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT))
            assert await _until(lambda: engine.in_flight == 1)
            call.cancel()  # the harness gives up: its connection closes
            await asyncio.gather(call, return_exceptions=True)
        assert await _until(lambda: engine.in_flight == 0)  # the engine request went with it
        await served.flush()
        assert served.calls(s["session_id"]) == []


def _raw(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.settimeout(20)
    return sock


async def test_slow_headers_and_bodies_are_cut_off(qwen3_model_dir: Path, tmp_path: Path) -> None:
    # slowloris partial requests held connections 40-45 s each
    engine = fake_engine(tokenizer(qwen3_model_dir), [])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, read_timeout=0.5) as served:
        s = await served.session()

        def slow_clients() -> tuple[bytes, bytes]:
            with _raw(served.url) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
                headers = sock.recv(1024)
            with _raw(served.url) as sock:
                sock.sendall(f"POST /s/{s['session_id']}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             f"Authorization: Bearer {s['api_key']}\r\nContent-Type: application/json\r\n"
                             "Content-Length: 100\r\n\r\n{\"mod".encode())  # the body never finishes
                body = sock.recv(1024)
            return headers, body

        headers, body = await asyncio.to_thread(slow_clients)
        assert headers == b""  # closed (a hang would raise socket.timeout)
        assert body.startswith(b"HTTP/1.1 408"), body


def test_a_session_id_alone_authorises_nothing(gw: ServedInThread, session: dict) -> None:
    # /s/<id>/v1/... with no key, a bogus key, or X-Session-Id without a key answered 200
    url = f"{gw.served.url}/s/{session['session_id']}/v1/chat/completions"
    for headers in [{}, {"Authorization": "Bearer sk-bogus"}, {"x-api-key": "sk-bogus"}]:
        r = gw.client.post(url, json=CHAT, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = gw.client.post(f"{gw.served.url}/v1/chat/completions", json=CHAT, headers={"X-Session-Id": session["session_id"]})
    assert r.status_code == 401
    r = gw.client.get(f"{gw.served.url}/s/{session['session_id']}/v1/models")
    assert r.status_code == 401
    assert gw.client.post(url, json=CHAT, headers={"Authorization": f"Bearer {session['api_key']}"}).status_code == 200
    assert gw.client.post(url, json=CHAT, headers={"Authorization": "Bearer adm"}).status_code == 200  # the admin
    gw.run(gw.served.flush())
    assert len(gw.served.calls(session["session_id"])) == 2
