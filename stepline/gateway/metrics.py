"""One gateway app's Prometheus metrics and its `GET /metrics` route.

`GatewayMetrics` keeps them on a registry of its own (two gateways in one process count apart). The call
path pushes each finished model call (`observe_call`) and each error answer (`observe_error`); what the
recorder (stepline/gateway/recorder.py) and the weight gate (stepline/gateway/fleet.py) count is their
own state, read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from typing_extensions import TypedDict, Unpack

if TYPE_CHECKING:
    from stepline.gateway.fleet import EngineRouter, WeightGate
    from stepline.gateway.recorder import Recorder

__all__ = ["CallSizes", "GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class CallSizes(TypedDict, total=False):
    """What one call moved: its prompt and completion tokens, and (streamed) the time to its first token."""

    prompt_tokens: int
    completion_tokens: int
    first_token_seconds: float | None


class GatewayMetrics:
    """One gateway app's Prometheus metrics, on a registry of its own (two gateways in one process
    count apart). The call path pushes each call and error answer; the state of the parts (the weight
    gate's version, calls in flight and updates, the recorder's queue and counts, engine health) is read
    from them when `/metrics` is scraped."""

    def __init__(self, router: EngineRouter, recorder: Recorder, gate: WeightGate) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("stepline_gateway_calls", "Model calls served", ["api", "finish_reason"],
                             registry=self.registry)
        self.errors = Counter("stepline_gateway_errors", "Requests answered with an error", ["api", "status"],
                              registry=self.registry)
        self.latency = Histogram("stepline_gateway_call_seconds", "Call latency, received to answered",
                                 ["api", "stream"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_token = Histogram("stepline_gateway_first_token_seconds", "Time to the first streamed token",
                                     ["api"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("stepline_gateway_tokens", "Tokens through the gateway", ["kind"],  # prompt | completion
                              registry=self.registry)
        self.registry.register(_PartsCollector(router, recorder, gate))
        for collector in (ProcessCollector, PlatformCollector, GCCollector):  # as on the default registry
            collector(registry=self.registry)

    def observe_call(self, api: str, stream: bool, finish_reason: str, seconds: float,
                     **sizes: Unpack[CallSizes]) -> None:
        """Count one finished model call."""
        self.calls.labels(api, finish_reason).inc()
        self.latency.labels(api, "true" if stream else "false").observe(seconds)
        self.tokens.labels("prompt").inc(sizes.get("prompt_tokens", 0))
        self.tokens.labels("completion").inc(sizes.get("completion_tokens", 0))
        if (first := sizes.get("first_token_seconds")) is not None:
            self.first_token.labels(api).observe(first)

    def observe_error(self, api: str, status: int) -> None:
        self.errors.labels(api, str(status)).inc()

    def routes(self) -> list[web.RouteDef]:
        """`GET /metrics`: this app's registry in the Prometheus text format."""

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        return [web.get("/metrics", metrics)]


class _PartsCollector(Collector):
    """The metrics the gateway's parts keep as their own state, read at scrape time."""

    def __init__(self, router: EngineRouter, recorder: Recorder, gate: WeightGate) -> None:
        self.router, self.recorder, self.gate = router, recorder, gate
        self.created = time.time()  # the counters' `_created`, as prometheus_client's own counters have

    def collect(self) -> Iterable[Metric]:
        gate, recorder, created = self.gate, self.recorder, self.created
        yield GaugeMetricFamily("stepline_gateway_in_flight", "Engine requests (a call's choices) being served now",
                                gate.in_flight)
        yield GaugeMetricFamily("stepline_gateway_weight_version", "Weight version new calls are stamped with",
                                gate.version)
        updates = CounterMetricFamily("stepline_gateway_weight_updates", "Weight updates", labels=["result"])
        for result, count in gate.updates.items():  # ok | failed
            updates.add_metric([result], count, created=created)
        yield updates
        cut = CounterMetricFamily("stepline_gateway_cut_calls", "Engine requests a weight update cut short, by how "
                                  "they were answered: resumed under the new weights | truncated", labels=["answer"])
        for answer in ("resumed", "truncated"):
            cut.add_metric([answer], gate.cut_calls[answer], created=created)
        yield cut
        yield GaugeMetricFamily("stepline_gateway_record_queue_depth", "Records waiting for the pool",
                                recorder.depth())
        for name, doc, value in (
            ("records_written", "Call records committed to the pool", recorder.written),
            ("records_dropped", "Call records the pool refused as invalid (logged)", recorder.dropped),
            ("pool_errors", "Failed pool writes (retried)", recorder.pool_errors),
        ):
            yield CounterMetricFamily(f"stepline_gateway_{name}", doc, value, created=created)
        engines = GaugeMetricFamily("stepline_gateway_engine_up", "1 when the engine passes its health check",
                                    labels=["engine"])
        for url, ok in self.router.healthy.items():
            engines.add_metric([url], 1 if ok else 0)
        yield engines

    describe = collect  # the registry checks the names for clashes
