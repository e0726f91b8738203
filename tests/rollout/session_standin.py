"""A tiny aiohttp stand-in for the gateway's session endpoints (POST /sessions, /reward, /end), for
rollout-driver tests that need no model. The base URLs it hands out point wherever the test says
(e.g. at stepline.agents.common.scripted_server), so harnesses still talk to a real wire format."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class StandIn:
    url: str = ""
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> create body + api_key
    rewards: dict[str, list[float]] = field(default_factory=dict)
    ends: dict[str, str] = field(default_factory=dict)
    fail_reward_once: set[str] = field(default_factory=set)  # session ids whose first reward gets a 503
    step_rewards: dict[str, dict[int, float]] = field(default_factory=dict)  # id -> {call index: reward}
    calls: int | None = None  # the calls every session is taken to have: a step reward for a later one gets a 400


@asynccontextmanager
async def session_standin(model_url: str = "http://127.0.0.1:9") -> AsyncIterator[StandIn]:
    state = StandIn()

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        sid = "s-" + uuid.uuid4().hex[:10]
        state.sessions[sid] = {**body, "api_key": f"key-{sid}"}
        return web.json_response({"session_id": sid, "api_key": f"key-{sid}", "openai_base_url": f"{model_url}/v1",
                                  "anthropic_base_url": model_url}, status=201)

    def _authorised(request: web.Request, sid: str) -> bool:
        return sid in state.sessions and request.headers.get("Authorization") in (f"Bearer key-{sid}", "Bearer admin")

    async def reward(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if not _authorised(request, sid):
            return web.json_response({"error": "forbidden"}, status=403)
        if sid in state.fail_reward_once:
            state.fail_reward_once.discard(sid)
            return web.json_response({"error": "busy"}, status=503)
        body = await request.json()
        if body.get("step") is None:
            state.rewards.setdefault(sid, []).append(float(body["value"]))
        elif state.calls is not None and body["step"] >= state.calls:
            return web.json_response({"error": {"message": f"step {body['step']} is not a call"}}, status=400)
        else:
            state.step_rewards.setdefault(sid, {})[body["step"]] = float(body["value"])
        return web.json_response({})

    async def end(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if not _authorised(request, sid):
            return web.json_response({"error": "forbidden"}, status=403)
        state.ends[sid] = (await request.json())["status"]
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/sessions", create)
    app.router.add_post("/sessions/{sid}/reward", reward)
    app.router.add_post("/sessions/{sid}/end", end)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()
