"""The gateway's aiohttp application: routes and error answers, wired to the components it is given.

    create_app(settings, router, recorder, gate, model_dir) -> web.Application

The caller owns the components' lifecycle (`stepline.gateway.cli.running_gateway` starts the router and the
recorder before serving, and after the app stops flushes the recorder and closes them).

Model APIs are served under `/v1/...` (attribution by session key or X-Session-Id) and under
`/s/<session>/v1/...`; each answers errors in its own API's format.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
from aiohttp import web

from stepline.gateway import reaper
from stepline.gateway.admin import admin_routes
from stepline.gateway.config import GatewaySettings
from stepline.gateway.fleet import EngineRouter, WeightGate
from stepline.gateway.frontends import chat, completions, messages, responses
from stepline.gateway.frontends.errors import Flavour
from stepline.gateway.frontends.pipeline import Core, Handler, error_boundary, model_route
from stepline.gateway.frontends.session_routes import SessionRoutes
from stepline.gateway.profile import detect
from stepline.gateway.recorder import Recorder
from stepline.gateway.templating import load_template
from stepline.gateway.tool_prompt import injector

log = logging.getLogger(__name__)

MODEL_APIS: dict[str, tuple[str, Handler]] = {
    "chat/completions": ("chat.completions", chat.handle),
    "completions": ("completions", completions.handle),
    "responses": ("responses", responses.handle),
    "messages": ("messages", messages.handle),
}

CORE_KEY = web.AppKey("core", Core)


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
    template = load_template(model_dir, settings.eot_token)
    profile = detect(template, settings.tool_parser, settings.reasoning_parser)
    log.info("model profile: %s", profile.describe())
    if settings.inject_tools and not profile.tools_supported:
        template = template.with_tool_injection(injector(profile.tool_parser))
    core = Core(settings, router, recorder, gate, template, profile)
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[error_boundary(core.metrics.observe_error, _flavour, _api)])
    app[CORE_KEY] = core
    app.cleanup_ctx.append(_reaping(core))
    for prefix in ("/v1", "/s/{session}/v1"):
        for path, (_, handler) in MODEL_APIS.items():
            app.router.add_post(f"{prefix}/{path}", model_route(core, handler))
        app.router.add_get(f"{prefix}/models", model_route(core, list_models))
        app.router.add_post(f"{prefix}/messages/count_tokens", model_route(core, messages.count_tokens))
    app.router.add_routes(SessionRoutes(core).routes())
    app.router.add_get("/health", model_route(core, health))
    app.router.add_routes(admin_routes(gate, settings.admin_token))
    app.router.add_routes(core.metrics.routes())  # this app's registry only
    return app


def _reaping(core: Core) -> Callable[[web.Application], AsyncIterator[None]]:
    """The idle-session reaper (stepline.gateway.reaper) runs while the app does."""
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(reaper.run(core))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return ctx


async def list_models(core: Core, request: web.Request) -> web.Response:
    if "session" in request.match_info:
        core.session_for(request)  # an unknown session is a 404 here too
    model = {"id": core.settings.model_name, "object": "model", "created": 0, "owned_by": "stepline",
             "context_length": core.context_length}
    return web.Response(body=orjson.dumps({"object": "list", "data": [model]}), content_type="application/json")


async def health(core: Core, request: web.Request) -> web.Response:
    """200 `ok` while some engine is healthy; 503 `degraded` when none is (calls would all fail)."""
    engines = [{"url": url, "healthy": ok} for url, ok in core.router.healthy.items()]
    up = any(e["healthy"] for e in engines)
    body = {"status": "ok" if up else "degraded", "weight_version": core.gate.version, "engines": engines,
            "sessions": len(core.sessions)}
    return web.Response(body=orjson.dumps(body), status=200 if up else 503, content_type="application/json")
