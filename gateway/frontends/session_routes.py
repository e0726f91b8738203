"""`POST /sessions`, `POST /sessions/<id>/reward`, `POST /sessions/<id>/end`.

Creating a session needs the admin token when one is configured. Rewards and ends need the session's
own key or the admin token (a key of another session → 403); with no admin token configured, a
request without a key is accepted. Each answers once the pool has committed the write.
"""

from __future__ import annotations

import hmac
import math
import time
from typing import Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from datapool.base import PoolError, UnknownSession
from datapool.records import Reward
from gateway.frontends.core import Core, bearer_key
from gateway.frontends.errors import ApiError, from_validation
from gateway.sessions import Session


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NewSession(_Body):
    task_id: str = Field(min_length=1, max_length=1024)
    harness: str = Field(min_length=1, max_length=256)
    group_id: str | None = Field(None, max_length=1024)
    metadata: dict[str, Any] = Field(default_factory=dict)


class RewardBody(_Body):
    value: float
    step: int | None = Field(None, ge=0)
    name: str = Field("outcome", min_length=1, max_length=256)
    weight: float = 1.0

    @field_validator("value", "weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class EndBody(_Body):
    status: Literal["completed", "failed", "aborted"] = "completed"


def _is_admin(request: web.Request, admin_token: str | None) -> bool:
    key = bearer_key(request)
    return admin_token is not None and key is not None and hmac.compare_digest(key.encode(), admin_token.encode())


def _parse(model: type[_Body], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _pool_error(exc: PoolError) -> ApiError:
    return ApiError(404 if isinstance(exc, UnknownSession) else 400, f"pool: {exc}")


class SessionRoutes:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.admin_token = core.settings.admin_token

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/sessions", self.create), web.post("/sessions/{session}/reward", self.reward),
                web.post("/sessions/{session}/end", self.end)]

    async def create(self, request: web.Request) -> web.Response:
        if self.admin_token is not None and not _is_admin(request, self.admin_token):
            raise ApiError(401, "creating a session needs the admin token (Authorization: Bearer <token>)")
        _, data = await self.core.read_json(request)
        body: NewSession = _parse(NewSession, data)
        session = self.core.sessions.new(body.task_id, body.harness, body.group_id, body.metadata)
        try:
            await self.core.recorder.create_session(session.info)
        except PoolError as exc:
            raise _pool_error(exc) from None
        self.core.sessions.add(session)
        base = (self.core.settings.public_url or f"{request.scheme}://{request.host}").rstrip("/")
        sid = session.info.session_id
        answer = {"session_id": sid, "api_key": session.api_key, "openai_base_url": f"{base}/s/{sid}/v1",
                  "anthropic_base_url": f"{base}/s/{sid}"}
        return web.Response(status=201, body=orjson.dumps(answer), content_type="application/json")

    def _owned(self, request: web.Request) -> Session:
        """The session in the URL, if the caller may act on it."""
        sid = request.match_info["session"]
        session = self.core.sessions.get(sid)
        if session is None:
            raise ApiError(404, f"unknown session {sid!r}")
        if _is_admin(request, self.admin_token):
            return session
        key = bearer_key(request)
        if key is not None and key != session.api_key:
            raise ApiError(403, "this key may not act on this session")
        if key is None and self.admin_token is not None:
            raise ApiError(401, "send the session's API key or the admin token")
        return session

    async def reward(self, request: web.Request) -> web.Response:
        session = self._owned(request)
        _, data = await self.core.read_json(request)
        body: RewardBody = _parse(RewardBody, data)
        if body.step is not None and body.step >= session.next_call:
            raise ApiError(400, f"step {body.step} is not a call of this session (it has {session.next_call})",
                           param="step")
        reward = Reward(session.info.session_id, body.value, body.step, body.name, body.weight, time.time())
        try:
            await self.core.recorder.add_reward(reward)
        except PoolError as exc:
            raise _pool_error(exc) from None
        return web.Response(body=orjson.dumps({"ok": True}), content_type="application/json")

    async def end(self, request: web.Request) -> web.Response:
        session = self._owned(request)
        _, data = await self.core.read_json(request, empty_ok=True)
        body: EndBody = _parse(EndBody, data)
        if session.ended:
            raise ApiError(409, f"session {session.info.session_id} has already ended")
        self.core.sessions.end(session)  # first, so no new call slips in while the pool commits
        try:
            await self.core.recorder.end_session(session.info.session_id, body.status)
        except PoolError as exc:
            raise _pool_error(exc) from None
        self.core.router.forget(session.info.session_id)
        return web.Response(body=orjson.dumps({"ok": True, "status": body.status}), content_type="application/json")
