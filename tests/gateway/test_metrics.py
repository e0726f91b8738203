"""GET /metrics serves the Prometheus text format with the gateway's counters, each app its own."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import httpx
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fakes.engine import FakeEngine
from gateway_helpers import fake_engine, serve, tokenizer
from prometheus_client.parser import text_string_to_metric_families

from stepline.datapool import open_pool
from stepline.gateway.engines import make_engine
from stepline.gateway.fleet import EngineRouter, WeightGate
from stepline.gateway.metrics import GatewayMetrics
from stepline.gateway.recorder import Recorder


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus text page (None: not there)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


async def test_observed_calls_and_the_parts_state_appear_in_metrics(tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    async with FakeEngine() as url, aiohttp.ClientSession() as http:
        router = EngineRouter([make_engine(url, "sglang", http, 5)])
        gate = WeightGate(router, initial_version=2)
        metrics = GatewayMetrics(router, Recorder(pool), gate)
        metrics.observe_call("messages", True, "stop", 0.03, prompt_tokens=100, completion_tokens=7,
                             first_token_seconds=0.01)
        metrics.observe_error("messages", 503)
        await gate.update_weights("/ckpt/3", 3)
        router.healthy[url] = False
        app = web.Application()
        app.add_routes(metrics.routes())
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.get("/metrics")
            text = await resp.text()
    pool.close()
    assert resp.status == 200 and resp.content_type == "text/plain"
    assert sample(text, "stepline_gateway_calls_total", api="messages", finish_reason="stop") == 1
    assert sample(text, "stepline_gateway_tokens_total", kind="completion") == 7
    assert sample(text, "stepline_gateway_errors_total", api="messages", status="503") == 1
    assert sample(text, "stepline_gateway_call_seconds_count", api="messages", stream="true") == 1
    assert sample(text, "stepline_gateway_first_token_seconds_count", api="messages") == 1
    assert sample(text, "stepline_gateway_weight_version") == 3
    assert sample(text, "stepline_gateway_weight_updates_total", result="ok") == 1
    assert sample(text, "stepline_gateway_in_flight") == 0
    assert sample(text, "stepline_gateway_record_queue_depth") == 0
    assert sample(text, "stepline_gateway_records_written_total") == 0
    assert sample(text, "stepline_gateway_engine_up", engine=url) == 0
    for name in ("stepline_gateway_records_dropped_total", "stepline_gateway_pool_errors_total",
                 "process_cpu_seconds_total"):
        assert sample(text, name) is not None, name


async def test_two_gateways_in_one_process_count_apart(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(tiny_model_dir)
    async with AsyncExitStack() as stack:
        served = []
        for name in ("a", "b"):
            url = await stack.enter_async_context(fake_engine(tok, ["hello there"]))
            (tmp_path / name).mkdir()
            served.append(await stack.enter_async_context(serve(tiny_model_dir, [url], tmp_path / name)))
        for gateway in served:  # one call each
            s = await gateway.session()
            async with httpx.AsyncClient(base_url=gateway.url) as client:
                answer = await client.post(f"/s/{s['session_id']}/v1/chat/completions",
                                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                           headers={"Authorization": f"Bearer {s['api_key']}"})
            assert answer.status_code == 200, answer.text
            await gateway.flush()
        async with httpx.AsyncClient() as client:  # then each one's page, after both calls
            pages = [(await client.get(f"{gateway.url}/metrics")).text for gateway in served]
    for text in pages:  # each gateway counts its own call, not the other's
        assert sample(text, "stepline_gateway_calls_total", api="chat.completions", finish_reason="stop") == 1
        assert sample(text, "stepline_gateway_call_seconds_count", api="chat.completions", stream="false") == 1
        assert sample(text, "stepline_gateway_records_written_total") == 1


async def test_a_completions_batch_counts_each_prompt(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = tokenizer(tiny_model_dir)
    async with fake_engine(tok, ["one", "two"]) as url, serve(tiny_model_dir, [url], tmp_path) as gateway:
        s = await gateway.session()
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            answer = await client.post(f"/s/{s['session_id']}/v1/completions",
                                       json={"model": "m", "prompt": [[1, 2, 3], [4, 5, 6, 7, 8]]},
                                       headers={"Authorization": f"Bearer {s['api_key']}"})
            assert answer.status_code == 200, answer.text
            text = (await client.get("/metrics")).text
    assert answer.json()["usage"]["prompt_tokens"] == 8
    assert sample(text, "stepline_gateway_tokens_total", kind="prompt") == 8  # 3 + 5, not twice the first
    assert sample(text, "stepline_gateway_calls_total", api="completions", finish_reason="stop") == 2
