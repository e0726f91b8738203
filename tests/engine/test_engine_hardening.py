"""The engine's edge: body limit (413), header and body read
timeouts, a token on the control endpoints, seeds and text range-checked, a batch cap, and one bad
request never aborting the others."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from stepline.engine.testing import running_engine


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[str]:
    with running_engine(tiny_model_dir, control_token="tok", read_timeout=0.5, max_body_bytes=200_000) as url:
        yield url


def test_a_body_over_the_limit_is_413(client: httpx.Client) -> None:
    # 10 MB of text stalled the engine for 22 s; the default limit is 8 MiB
    body = b'{"input_ids": [' + b"1," * 4_500_000 + b'1]}'
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "larger than" in r.json()["error"]["message"]
    assert client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_the_control_endpoints_need_the_token(guarded: str) -> None:
    # anyone local could pause, abort, set the version, update weights
    with httpx.Client(base_url=guarded, timeout=60) as c:
        for path, body in [("/pause_generation", {}), ("/continue_generation", {}), ("/abort_request", {"abort_all": True}),
                           ("/update_weight_version", {"new_version": "777"}), ("/flush_cache", {}),
                           ("/update_weights_from_disk", {"model_path": "/nonexistent"})]:
            r = c.post(path, json=body)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "Unauthorized"
            r = c.post(path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
        assert c.get("/get_weight_version").json()["weight_version"] == "0"  # nothing changed
        ok = c.post("/update_weight_version", json={"new_version": "1"}, headers={"Authorization": "Bearer tok"})
        assert ok.status_code == 200
        assert c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        assert c.get("/health").status_code == 200


def test_a_lone_surrogate_is_400(client: httpx.Client) -> None:
    # "a\ud800" reached the tokenizer -> 500
    for body in [b'{"text": "a\\ud800"}', b'{"text": ["ok", "\\udfff"]}',
                 b'{"input_ids": [1], "rid": "\\ud800"}', b'{"text": "a", "sampling_params": {"stop": "\\ud800"}}']:
        r = client.post("/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert "surrogate" in r.json()["error"]["message"]


def test_a_seed_past_64_bits_is_400_and_aborts_nobody(client: httpx.Client) -> None:
    # sampling_seed 2^64 passed the schema, failed torch's manual_seed inside the step and
    # aborted every running request
    results: list[dict] = []
    long = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: results.append(client.post("/generate", json=long).json()))
    worker.start()
    bad = client.post("/generate", json={"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}})
    worker.join(60)
    assert bad.status_code == 400 and "sampling_seed" in bad.json()["error"]["message"]
    assert results[0]["meta_info"]["finish_reason"]["type"] == "length"
    top = {"input_ids": [1], "sampling_params": {"sampling_seed": 2**63 - 1, "n": 2, "max_new_tokens": 2}}
    assert client.post("/generate", json=top).status_code == 200  # the second sample's seed wraps to 0


def test_a_batch_is_capped(client: httpx.Client) -> None:
    # one request may not become thousands of sequences
    body = {"input_ids": [[1]] * 17, "sampling_params": {"n": 64, "max_new_tokens": 1}}
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "at most" in r.json()["error"]["message"]


def _raw(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.settimeout(20)
    return sock


def test_slow_headers_and_bodies_are_cut_off(guarded: str) -> None:
    # partial requests held connections for as long as the client liked
    with _raw(guarded) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert sock.recv(1024) == b""  # closed by the engine (a hang would raise socket.timeout)
    with _raw(guarded) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"input")  # the body never finishes
        assert sock.recv(1024).startswith(b"HTTP/1.1 408")
    with httpx.Client(base_url=guarded, timeout=60) as c:  # and it keeps serving
        assert c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
