"""Prometheus metrics of the gateway (default registry) and the `GET /metrics` route.

The app calls `observe_call` once per finished model call and `observe_error` per error answer; the
recorder and the weight gate keep their own gauges up to date.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from typing_extensions import TypedDict, Unpack

if TYPE_CHECKING:
    from gateway.engines import EngineRouter

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

CALLS = Counter("stepline_gateway_calls", "Model calls served", ["api", "finish_reason"])
ERRORS = Counter("stepline_gateway_errors", "Requests answered with an error", ["api", "status"])
LATENCY = Histogram(
    "stepline_gateway_call_seconds", "Call latency, received to answered", ["api", "stream"], buckets=_LATENCY_BUCKETS
)
FIRST_TOKEN = Histogram(
    "stepline_gateway_first_token_seconds", "Time to the first streamed token", ["api"], buckets=_LATENCY_BUCKETS
)
TOKENS = Counter("stepline_gateway_tokens", "Tokens through the gateway", ["kind"])  # prompt | completion
IN_FLIGHT = Gauge("stepline_gateway_in_flight", "Model calls being served now")
WEIGHT_VERSION = Gauge("stepline_gateway_weight_version", "Weight version new calls are stamped with")
WEIGHT_UPDATES = Counter("stepline_gateway_weight_updates", "Weight updates", ["result"])  # ok | failed
QUEUE_DEPTH = Gauge("stepline_gateway_record_queue_depth", "Records waiting for the pool")
RECORDS_WRITTEN = Counter("stepline_gateway_records_written", "Call records committed to the pool")
RECORDS_DROPPED = Counter("stepline_gateway_records_dropped", "Call records the pool refused as invalid (logged)")
POOL_ERRORS = Counter("stepline_gateway_pool_errors", "Failed pool writes (retried)")
ENGINE_UP = Gauge("stepline_gateway_engine_up", "1 when the engine passes its health check", ["engine"])


class CallSizes(TypedDict, total=False):
    """What one call moved: its prompt and completion tokens, and (streamed) the time to its first token."""

    prompt_tokens: int
    completion_tokens: int
    first_token_seconds: float | None


def observe_call(api: str, stream: bool, finish_reason: str, seconds: float, **sizes: Unpack[CallSizes]) -> None:
    """Count one finished model call."""
    CALLS.labels(api, finish_reason).inc()
    LATENCY.labels(api, "true" if stream else "false").observe(seconds)
    TOKENS.labels("prompt").inc(sizes.get("prompt_tokens", 0))
    TOKENS.labels("completion").inc(sizes.get("completion_tokens", 0))
    if (first := sizes.get("first_token_seconds")) is not None:
        FIRST_TOKEN.labels(api).observe(first)


def observe_error(api: str, status: int) -> None:
    ERRORS.labels(api, str(status)).inc()


def metrics_routes(router: EngineRouter | None = None) -> list[web.RouteDef]:
    """`GET /metrics` in the Prometheus text format (engine health refreshed at scrape time)."""

    async def metrics(request: web.Request) -> web.Response:
        if router is not None:
            for url, ok in router.healthy.items():
                ENGINE_UP.labels(url).set(1 if ok else 0)
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return [web.get("/metrics", metrics)]
