"""The gateway's aiohttp application: the call path's parts built once, and the routes that use them.

    create_app(settings, router, recorder, gate, model_dir) -> web.Application

The caller owns the components' lifecycle (`stepline.gateway.cli.running_gateway` starts the router and the
recorder before serving, and after the app stops flushes the recorder and closes them).

Model APIs are served under `/v1/...` (attribution by session key or X-Session-Id) and under
`/s/<session>/v1/...`; each answers errors in its own API's format. Each handler is given the parts it
uses (docs/architecture.md, "The call path"): the request edge, the stages of a call (prompting,
dispatch, commit), the sessions service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import orjson
from aiohttp import web

from stepline.gateway import reaper
from stepline.gateway.admin import admin_routes
from stepline.gateway.config import GatewaySettings
from stepline.gateway.fairness import SequenceLimit
from stepline.gateway.fleet import EngineRouter, WeightGate
from stepline.gateway.forks import ForkLimits
from stepline.gateway.frontends import chat, completions, messages, responses
from stepline.gateway.frontends.dispatch import Dispatch
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import Flavour
from stepline.gateway.frontends.ledger import Ledger
from stepline.gateway.frontends.prompting import Prompting
from stepline.gateway.frontends.routes import Handler, error_boundary, model_route
from stepline.gateway.frontends.session_routes import SessionRoutes
from stepline.gateway.frontends.stages import Stages
from stepline.gateway.metrics import GatewayMetrics
from stepline.gateway.profile import ModelProfile, detect
from stepline.gateway.recorder import Recorder
from stepline.gateway.session_service import SessionService
from stepline.gateway.sessions import SessionStore
from stepline.gateway.templating import ChatTemplate, load_template
from stepline.gateway.tokenizing import TokenizerPool
from stepline.gateway.tool_prompt import injector

log = logging.getLogger(__name__)

FrontEnd = Callable[[Edge, Stages, web.Request], Awaitable[web.StreamResponse]]
MODEL_APIS: dict[str, tuple[str, FrontEnd]] = {
    "chat/completions": ("chat.completions", chat.handle),
    "completions": ("completions", completions.handle),
    "responses": ("responses", responses.handle),
    "messages": ("messages", messages.handle),
}
PROFILE_KEY = web.AppKey("profile", ModelProfile)  # what the model's template was detected to be (for the CLI)


def _flavour(path: str) -> Flavour:
    return "anthropic" if path.endswith(("/messages", "/messages/count_tokens")) else "openai"


def _api(path: str) -> str:
    """The metrics label of a path: the model API it serves, "sessions", or "other" (bounded labels)."""
    for suffix, (api, _) in MODEL_APIS.items():
        if path.endswith("/v1/" + suffix):
            return api
    return "sessions" if path.startswith("/sessions") else "other"


def create_app(settings: GatewaySettings, router: EngineRouter, recorder: Recorder, gate: WeightGate,
               model_dir: Path) -> web.Application:
    template, prompting = _model(settings, model_dir)
    store = SessionStore(template, settings.strict_template or not prompting.profile.append_only,
                         settings.max_live_sessions)
    metrics = GatewayMetrics(router, recorder, gate)  # this app's own registry
    edge, ledger = Edge(settings, store), Ledger(recorder, metrics)
    dispatch = Dispatch(router, gate, recorder, settings.retry_after, SequenceLimit(settings.max_session_sequences),
                        settings.partial_rollouts)
    stages = Stages(prompting, dispatch, ledger, edge.offload)
    service = SessionService(store, recorder, router, settings.session_lease)
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[error_boundary(metrics.observe_error, _flavour, _api)])
    app[PROFILE_KEY] = prompting.profile
    app.cleanup_ctx.append(_reaping(service, reaper.Timeouts(settings.session_idle_timeout,
                                                              settings.fork_idle_timeout)))
    app.on_cleanup.append(partial(_stop_preparing, edge, template))

    def model(handler: Handler) -> Handler:
        return model_route(handler, ledger, store)

    for prefix in ("/v1", "/s/{session}/v1"):
        for path, (_, handle) in MODEL_APIS.items():
            app.router.add_post(f"{prefix}/{path}", model(partial(handle, edge, stages)))
        app.router.add_get(f"{prefix}/models", model(partial(list_models, edge, prompting)))
        app.router.add_post(f"{prefix}/messages/count_tokens", model(partial(messages.count_tokens, edge, template)))
    limits = ForkLimits(settings.max_forks_per_session, settings.max_forks_per_group, settings.retry_after)
    app.router.add_routes(SessionRoutes(edge, service, template, settings.public_url, limits,
                                        lambda: gate.version).routes())
    app.router.add_get("/health", model(partial(health, router, gate, store, recorder)))
    app.router.add_routes(admin_routes(gate, settings.admin_token))
    app.router.add_routes(metrics.routes())  # this app's registry only
    return app


def _model(settings: GatewaySettings, model_dir: Path) -> tuple[ChatTemplate, Prompting]:
    """The served model's template (with tool injection where asked and needed) and its prompting."""
    template = load_template(model_dir, settings.eot_token)
    profile = detect(template, settings.tool_parser, settings.reasoning_parser)
    log.info("model profile: %s", profile.describe())
    if settings.inject_tools and not profile.tools_supported:
        template = template.with_tool_injection(injector(profile.tool_parser))
    if settings.prepare_workers and template.tokenizer_path is not None:
        template = template.with_pool(TokenizerPool(template.tokenizer_path, settings.prepare_workers,
                                                    settings.tokenize_process_chars))
    return template, Prompting(settings, template, profile)


async def _stop_preparing(edge: Edge, template: ChatTemplate, app: web.Application) -> None:
    """The large requests' worker threads and the tokenizer processes end with the app."""
    edge.offload.close()
    if template.pool is not None:
        template.pool.close()


def _reaping(service: SessionService, timeouts: reaper.Timeouts) -> Callable[[web.Application], AsyncIterator[None]]:
    """The idle-session reaper (stepline.gateway.reaper) runs while the app does."""
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(reaper.run(service, timeouts))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return ctx


async def list_models(edge: Edge, prompting: Prompting, request: web.Request) -> web.Response:
    if "session" in request.match_info:
        edge.session_for(request)  # an unknown session is a 404 here too
    model = {"id": prompting.model_name, "object": "model", "created": 0, "owned_by": "stepline",
             "context_length": prompting.context_length}
    return web.Response(body=orjson.dumps({"object": "list", "data": [model]}), content_type="application/json")


async def health(router: EngineRouter, gate: WeightGate, store: SessionStore, recorder: Recorder,
                 request: web.Request) -> web.Response:
    """200 `ok` while some engine is healthy and the pool takes writes; `degraded` (and `pool` says why) while the
    pool fails (full, damaged, out of reach: calls are spilled); 503 when no engine is healthy or the recorder
    stopped (calls would all fail)."""
    engines = [{"url": url, "healthy": ok} for url, ok in router.healthy.items()]
    up = any(e["healthy"] for e in engines) and recorder.failure is None
    pool = recorder.pool_problem
    body = {"status": "ok" if up and pool is None else "degraded", "weight_version": gate.version,
            "engines": engines, "sessions": len(store), "pool": pool or "ok"}
    return web.Response(body=orjson.dumps(body), status=200 if up else 503, content_type="application/json")
