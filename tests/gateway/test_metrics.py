"""GET /metrics serves the Prometheus text format with the gateway's counters."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from gateway.recorder import metrics_routes, observe_call, observe_error


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_observed_calls_appear_in_metrics() -> None:
    before = sample("stepline_gateway_calls_total", api="messages", finish_reason="stop")
    tokens = sample("stepline_gateway_tokens_total", kind="completion")
    observe_call(
        "messages", True, "stop", 0.03, prompt_tokens=100, completion_tokens=7, first_token_seconds=0.01
    )
    observe_error("messages", 503)
    assert sample("stepline_gateway_calls_total", api="messages", finish_reason="stop") == before + 1
    assert sample("stepline_gateway_tokens_total", kind="completion") == tokens + 7

    app = web.Application()
    app.add_routes(metrics_routes())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.get("/metrics")
        text = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/plain"
    for name in (
        "stepline_gateway_calls_total",
        "stepline_gateway_call_seconds_bucket",
        "stepline_gateway_errors_total",
        "stepline_gateway_record_queue_depth",
        "stepline_gateway_first_token_seconds_count",
    ):
        assert name in text
    assert 'stepline_gateway_errors_total{api="messages",status="503"}' in text
