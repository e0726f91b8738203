"""`POST /sessions`, `GET /sessions/<id>`, `POST /sessions/<id>/reward`, `/end`, `/fork` and `/demonstration`.

Creating a session needs the admin token when one is configured. Reading, rewarding, ending and forking
one need the session's own key or the admin token (a key of another session → 403); with no admin token
configured, a request without a key is accepted. Each write answers once the pool has committed it.
A fork (stepline/gateway/forks.py) is a new session of the same task, harness and group that replays the source's
calls before `call` and samples from there. A demonstration records an expert's whole conversation as the calls
of a session opened with `metadata.expert = true` (off-policy guidance in a training group: the expert's episode
beside the policy's, stepline/gateway/demonstrations.py); it needs the admin token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stepline.datapool.base import PoolCorrupt, PoolError, PoolFull, UnknownSession
from stepline.datapool.records import EXPERT_KEY, FORK_KEY, Purpose, Reward
from stepline.gateway.demonstrations import records_from_conversation
from stepline.gateway.forks import ForkLimits, Replay
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import ApiError, from_validation
from stepline.gateway.session_service import SessionService
from stepline.gateway.sessions import Session, admin_allowed, bearer_key, is_admin_key
from stepline.gateway.templating import ChatTemplate


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NewSession(_Body):
    task_id: str = Field(min_length=1, max_length=1024)
    harness: str = Field(min_length=1, max_length=256)
    group_id: str | None = Field(None, max_length=1024)
    metadata: dict[str, Any] = Field(default_factory=dict)
    purpose: Purpose = Field("train", description="train | eval (never trained on) | demo (expert demonstrations)")
    sampling: SessionSampling | None = None


class SessionSampling(_Body):
    """What the runner fixes for every call of a session, whatever the harness asks: the exploration temperature
    of training rollouts, greedy decoding for an evaluation (verl's rollout vs val_kwargs). Unset: the request's."""

    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1: no top-k cut")


class ForkBody(_Body):
    call: int = Field(ge=0, description="the call the fork samples anew: calls 0..call-1 are the source's")
    metadata: dict[str, Any] = Field(default_factory=dict, description="added to the source's metadata")


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


class DemonstrationBody(BaseModel):
    """An expert's conversation as a harness's `--expert` mode writes it (OpenAI chat or Anthropic Messages form)."""

    model_config = ConfigDict(extra="forbid")
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class EndBody(_Body):
    status: Literal["completed", "failed", "aborted"] = "completed"


def _parse(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _pool_error(exc: PoolError) -> ApiError:
    if isinstance(exc, PoolFull):  # nothing written; worth a retry once space is freed
        return ApiError(503, f"pool: {exc}", code="pool_full", retry_after=30.0)
    if isinstance(exc, PoolCorrupt):  # permanent: a retry gets the same answer
        return ApiError(500, f"pool: {exc}", code="pool_corrupt")
    return ApiError(404 if isinstance(exc, UnknownSession) else 400, f"pool: {exc}")


class SessionRoutes:
    def __init__(self, edge: Edge, service: SessionService, template: ChatTemplate, public_url: str | None,
                 fork_limits: ForkLimits | None = None, version: Callable[[], int] = lambda: 0) -> None:
        self.edge = edge
        self.service = service
        self.store = service.store
        self.template = template  # a fork's replay decodes the recorded ids as the engines do
        self.public_url = public_url
        self.admin_token = edge.admin_token
        self.fork_limits = fork_limits or ForkLimits()
        self.version = version  # the weight version serving now: a demonstration is stamped with it

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/sessions", self.create), web.get("/sessions/{session}", self.show),
                web.post("/sessions/{session}/reward", self.reward), web.post("/sessions/{session}/end", self.end),
                web.post("/sessions/{session}/fork", self.fork),
                web.post("/sessions/{session}/demonstration", self.demonstration)]

    async def create(self, request: web.Request) -> web.Response:
        if not admin_allowed(bearer_key(request.headers), self.admin_token):
            raise ApiError(401, "creating a session needs the admin token (Authorization: Bearer <token>)")
        _, data = await self.edge.read_json(request)
        body: NewSession = _parse(NewSession, data)
        if FORK_KEY in body.metadata:
            raise ApiError(400, f"metadata.{FORK_KEY} is set by POST /sessions/<id>/fork", param=f"metadata.{FORK_KEY}")
        session = self.store.new(body.task_id, body.harness, body.group_id, body.metadata, body.purpose)
        if body.sampling is not None:
            session.sampling = body.sampling.model_dump(exclude_none=True)
        return await self._open(request, session)

    async def _open(self, request: web.Request, session: Session) -> web.Response:
        """Commit a new session to the pool, make it callable and answer its endpoint and key."""
        try:
            await self.service.open(session)
        except PoolError as exc:
            raise _pool_error(exc) from None
        base = (self.public_url or f"{request.scheme}://{request.host}").rstrip("/")
        sid = session.info.session_id
        answer = {"session_id": sid, "api_key": session.api_key, "openai_base_url": f"{base}/s/{sid}/v1",
                  "anthropic_base_url": f"{base}/s/{sid}", FORK_KEY: session.info.metadata.get(FORK_KEY)}
        return web.Response(status=201, body=orjson.dumps(answer), content_type="application/json")

    async def show(self, request: web.Request) -> web.Response:
        session = self._owned(request)
        info = session.info
        answer = {"session_id": info.session_id, "task_id": info.task_id, "harness": info.harness,
                  "group_id": info.group_id, "purpose": info.purpose, "calls": session.next_call, "ended": session.ended,
                  FORK_KEY: info.metadata.get(FORK_KEY)}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def fork(self, request: web.Request) -> web.Response:
        source = self._owned(request)
        _, data = await self.edge.read_json(request)
        body: ForkBody = _parse(ForkBody, data)
        sid, info = source.info.session_id, source.info
        if body.call >= source.next_call:
            raise ApiError(400, f"call {body.call} is not a call of session {sid} (it has {source.next_call})",
                           param="call")
        if FORK_KEY in body.metadata:
            raise ApiError(400, f"metadata.{FORK_KEY} is the fork's link, set by the gateway", param=f"metadata.{FORK_KEY}")
        self._check_fork_limits(source)
        try:  # after every call of the source queued before (the recorder reads in order)
            calls = await self.service.calls_before(sid, body.call)
        except PoolError as exc:
            raise _pool_error(exc) from None
        metadata = {**info.metadata, **body.metadata, FORK_KEY: {"session": sid, "call": body.call}}
        session = self.store.new(info.task_id, info.harness, info.group_id, metadata, info.purpose)
        template = self.template
        session.replay = Replay(calls, template.stop_token_ids, template.decode)
        session.sampling = dict(source.sampling)  # a branch samples as its trunk did
        answer = await self._open(request, session)
        source.forks += 1
        return answer

    async def demonstration(self, request: web.Request) -> web.Response:
        """Record an expert's conversation as the calls of a fresh expert session, once the pool has them."""
        if not admin_allowed(bearer_key(request.headers), self.admin_token):
            raise ApiError(401, "recording a demonstration needs the admin token (Authorization: Bearer <token>)")
        session = self._owned(request)
        sid = session.info.session_id
        if not session.info.expert:
            raise ApiError(400, f"session {sid} was not opened as an expert's (metadata.{EXPERT_KEY} = true): its "
                           "calls would train as the policy's own samples", param=f"metadata.{EXPERT_KEY}")
        if session.ended or session.next_call:
            raise ApiError(409, f"session {sid} has {'ended' if session.ended else 'calls already'}")
        _, data = await self.edge.read_json(request)
        body: DemonstrationBody = _parse(DemonstrationBody, data)
        try:
            records = records_from_conversation(self.template, body.model_dump(exclude_none=True), sid, self.version())
        except ValidationError as exc:
            raise from_validation(exc) from None
        except ValueError as exc:
            raise ApiError(400, f"demonstration: {exc}") from None
        if not records:
            raise ApiError(400, "demonstration: the conversation has no assistant turn", param="messages")
        session.next_call = len(records)
        for record in records:
            self.service.recorder.record_call(record)
        try:
            await self.service.recorder.flush()
        except PoolError as exc:
            raise _pool_error(exc) from None
        return web.Response(body=orjson.dumps({"ok": True, "calls": len(records)}), content_type="application/json")

    def _check_fork_limits(self, source: Session) -> None:
        """429 past the fork bounds: one session key must not open sessions without end (each is a pool row,
        and an open fork keeps its group from being claimed)."""
        limits, sid = self.fork_limits, source.info.session_id
        if source.forks >= limits.per_session:
            raise ApiError(429, f"session {sid} has made {source.forks} forks, the most one session may make "
                           f"(max_forks_per_session)", code="too_many_forks")
        open_forks = self.store.open_forks(source.info.group_key)
        if open_forks >= limits.per_group:
            raise ApiError(429, f"group {source.info.group_key!r} has {open_forks} open forks, the most one group may "
                           "have (max_forks_per_group); end some first", code="too_many_forks",
                           retry_after=limits.retry_after)

    def _owned(self, request: web.Request) -> Session:
        """The session in the URL, if the caller may act on it."""
        sid = request.match_info["session"]
        session = self.store.get(sid)
        if session is None:
            raise ApiError(404, f"unknown session {sid!r}")
        key = bearer_key(request.headers)
        if is_admin_key(key, self.admin_token):
            return session
        if key is not None and key != session.api_key:
            raise ApiError(403, "this key may not act on this session")
        if key is None and self.admin_token is not None:
            raise ApiError(401, "send the session's API key or the admin token")
        return session

    async def reward(self, request: web.Request) -> web.Response:
        session = self._owned(request)
        _, data = await self.edge.read_json(request)
        body: RewardBody = _parse(RewardBody, data)
        if body.step is not None and body.step >= session.next_call:
            raise ApiError(400, f"step {body.step} is not a call of this session (it has {session.next_call})",
                           param="step")
        reward = Reward(session.info.session_id, body.value, body.step, body.name, body.weight, time.time())
        try:
            await self.service.add_reward(reward)
        except PoolError as exc:
            raise _pool_error(exc) from None
        return web.Response(body=orjson.dumps({"ok": True}), content_type="application/json")

    async def end(self, request: web.Request) -> web.Response:
        session = self._owned(request)
        _, data = await self.edge.read_json(request, empty_ok=True)
        body: EndBody = _parse(EndBody, data)
        if session.ended:
            raise ApiError(409, f"session {session.info.session_id} has already ended")
        for _, exc in await self.service.end([session], body.status):  # ended here first: no new call slips in
            raise _pool_error(exc)
        return web.Response(body=orjson.dumps({"ok": True, "status": body.status}), content_type="application/json")
