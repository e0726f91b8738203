"""What every front end shares: attribution, body parsing, prompt limits, engine dispatch and recording.

A front end turns its API's request into prompt ids (through `TokenState` for the chat-style APIs),
asks `Core.generate` or `Core.open_stream` for the engine's output, parses it, answers in its own
format, and hands one `CallRecord` per choice to `Core.record` (which never waits on the pool).
With a spill file, a front end awaits `Core.durable()` before the last bytes of its answer (non-stream
answers: the app's route does), so that nothing acknowledged is lost to a crash (gateway.spill).
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeVar

import numpy as np
import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from datapool.records import CallRecord
from gateway import metrics
from gateway.config import GatewaySettings
from gateway.engines import EngineError, EngineRouter, EngineUnavailable, Generation, SamplingParams, StreamDelta
from gateway.forks import Replayed
from gateway.frontends.errors import ApiError, from_validation, invalid
from gateway.parsers import make_parser
from gateway.parsers.base import StreamParser, ToolSpecs
from gateway.profile import ModelProfile
from gateway.recorder import Recorder
from gateway.sessions import Session, SessionStore
from gateway.templating import ChatTemplate, Message
from gateway.weights import Paused, WeightGate

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# the durability futures of the calls recorded by the request being handled (set by the app's route)
UNSYNCED: contextvars.ContextVar[list[Future[None]]] = contextvars.ContextVar("unsynced")
_LONG_NUMBER = re.compile(rb"\d{19}")  # every integer outside the 64-bit range has at least 19 digits


def int64_violation(value: Any, path: str = "") -> str | None:
    """The dotted path of the first integer outside [-2^63, 2^63) in a parsed JSON value, or None.

    Such integers would pass the schema (Python ints are unbounded) and fail later, in orjson, msgpack
    or the database, after the engine already generated; so they are refused at the edge."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                return where or "body"
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item))
    return None


def check_int64(raw: bytes) -> None:
    """400 naming the field when the JSON body holds an integer beyond 64 bits (cheap scan first)."""
    if not _LONG_NUMBER.search(raw):
        return
    try:
        data = from_json(raw)
    except ValueError:
        return  # malformed JSON: the schema's parse reports it
    where = int64_violation(data)
    if where is not None:
        raise invalid(f"{where}: integers must lie in the 64-bit range [-2^63, 2^63)", param=where)


def bearer_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


class Core:
    def __init__(self, settings: GatewaySettings, router: EngineRouter, recorder: Recorder, gate: WeightGate,
                 template: ChatTemplate, sessions: SessionStore, profile: ModelProfile) -> None:
        self.settings = settings
        self.router = router
        self.recorder = recorder
        self.gate = gate
        self.template = template
        self.sessions = sessions
        self.profile = profile
        self.context_length = settings.context_length or template.context_length
        self._overloaded = ApiError(503, "the gateway's record queue is full; retry shortly",
                                    retry_after=settings.retry_after)

    # --- the edge: who is calling, with what ---
    def session_for(self, request: web.Request) -> Session:
        """The calling session: by session key, or by URL / X-Session-Id together with that session's
        key (or the admin token). The id alone is an address, not a credential: no key → 401, a key
        for another session → 403."""
        session_id = request.match_info.get("session") or request.headers.get("X-Session-Id")
        key = bearer_key(request)
        keyed = self.sessions.by_key(key) if key else None
        if keyed is None and not self._is_admin(key):
            raise ApiError(401, "send the session's API key (Authorization: Bearer <key> or x-api-key)"
                           if key is None else "this API key is not a session's", code="invalid_api_key")
        if session_id is None:
            if keyed is None:  # the admin token names no session
                raise ApiError(401, "no session: call /s/<session>/v1/... or set X-Session-Id", code="invalid_api_key")
            session = keyed
        else:
            found = self.sessions.get(session_id)
            if found is None:
                raise ApiError(404, f"unknown session {session_id!r}", code="unknown_session")
            if keyed is not None and keyed is not found:
                raise ApiError(403, "this API key belongs to another session", code="foreign_session")
            session = found
        if session.ended:
            raise ApiError(409, f"session {session.info.session_id} has ended", code="session_ended")
        self.sessions.touch(session)
        return session

    def _is_admin(self, key: str | None) -> bool:
        token = self.settings.admin_token
        return token is not None and key is not None and hmac.compare_digest(key.encode(), token.encode())

    async def read_body(self, request: web.Request) -> bytes:
        """The body, decompressed: too large → 413 (aiohttp counts it as it streams in); slower
        than `read_timeout` → 408 (a client sending a byte a minute must not hold a handler)."""
        try:
            async with asyncio.timeout(self.settings.read_timeout):
                return await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body took longer than {self.settings.read_timeout:g} s to arrive") from None

    async def read_json(self, request: web.Request, empty_ok: bool = False) -> tuple[bytes, Any]:
        """The raw body (too large → 413, too slow → 408) and its JSON object (malformed → 400)."""
        raw = await self.read_body(request)
        if empty_ok and not raw.strip():
            return raw, {}
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid(f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise invalid("the body must be a JSON object")
        return raw, data

    async def parse(self, model: type[M], request: web.Request) -> tuple[bytes, M]:
        """The raw body and its validated request (400 naming the field on any problem).

        Bodies past `offload_bytes` are parsed on a worker thread, so one large request never stalls
        the event loop (and with it every other session's calls)."""
        raw = await self.read_body(request)

        def validate() -> M:
            check_int64(raw)
            try:
                return model.model_validate_json(raw)  # one pass in pydantic-core: parse and validate
            except ValidationError as exc:
                raise from_validation(exc) from None

        return raw, await self.offload(len(raw), validate)

    async def offload(self, size: int, fn: Callable[..., R], *args: Any) -> R:
        """fn(*args), on a worker thread when the request it works on is large (`size` bytes)."""
        if size > self.settings.offload_bytes:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def max_new_tokens(self, prompt_len: int, requested: int | None) -> int:
        """New-token budget: the request's (or the default), cut to what the context has room for."""
        room = self.context_length - prompt_len
        if room <= 0:
            raise invalid(f"the prompt has {prompt_len} tokens; this model's context length is "
                          f"{self.context_length}", param="messages", code="context_length_exceeded")
        return min(requested or self.settings.default_max_tokens, room)

    def parser(self, tools_enabled: bool, tools: ToolSpecs, incremental: bool = False) -> StreamParser:
        p = self.profile
        return make_parser(p.tool_parser, p.reasoning_parser, tools_enabled, tools, p.reasoning_forced, incremental)

    def check_tools(self, tools: list[dict] | None) -> None:
        """400 when the request offers tools that the template would silently drop."""
        if tools and not self.profile.tools_supported and self.template.inject is None:
            raise invalid("this model's chat template cannot show tools to the model, so they would be silently "
                          "dropped; start the gateway with --inject-tools to render them into the system message "
                          f"in the {self.profile.tool_parser} tool-call format", param="tools",
                          code="tools_unsupported")

    def tool_history_hint(self, messages: list[Message]) -> str:
        """What to add to a template's error when the conversation holds tool calls or results that a
        template without tools support cannot take (Gemma 3: roles must alternate)."""
        if self.profile.tools_supported or self.template.inject is not None:
            return ""
        if not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            return ""
        return ("; this chat template has no tools support, so it cannot take tool calls or results: start the "
                "gateway with --inject-tools to send them to the model as text in the "
                f"{self.profile.tool_parser} tool-call format")

    # --- dispatch ---
    def replayed(self, session: Session, prompt_ids: np.ndarray, n: int) -> list[Replayed] | None:
        """A fork before its branch point: the source's recorded answers to this prompt (gateway/forks.py)."""
        replay = session.replay
        if replay is None:
            return None
        gens = replay.serve(prompt_ids, n)
        if gens is None:
            session.replay = None
            if replay.diverged:
                log.warning("fork %s: the harness sent another prompt than the recorded one at call %d; it "
                            "branches there", session.info.session_id, session.next_call)
        return gens

    async def generate(self, session: Session, prompt_ids: np.ndarray,
                       samplings: list[SamplingParams]) -> tuple[list[Generation], int]:
        """One engine request per choice, concurrently; returns the generations and the weight version."""
        if (replayed := self.replayed(session, prompt_ids, len(samplings))) is not None:
            return list(replayed), replayed[0].weight_version
        if not self.recorder.has_capacity():
            raise self._overloaded
        ids = prompt_ids  # int32 array: the adapters serialise it natively
        engine = None
        try:
            async with self.gate.admit() as version:
                engine = self.router.for_session(session.info.session_id)
                if len(samplings) == 1:
                    return [await engine.generate(ids, samplings[0])], version
                gens = await asyncio.gather(*(engine.generate(ids, s) for s in samplings))
                return list(gens), version
        except (EngineError, Paused) as exc:
            raise self._engine_error(exc, engine) from None

    async def open_stream(self, session: Session, prompt_ids: np.ndarray,
                          samplings: list[SamplingParams]) -> EngineStream:
        """Start the engine streams and wait for the first chunk, so that failures before any token
        still get a proper error status (the SSE headers are not sent yet)."""
        if (replayed := self.replayed(session, prompt_ids, len(samplings))) is not None:
            return EngineStream.whole(replayed, self)
        if not self.recorder.has_capacity():
            raise self._overloaded
        ids = prompt_ids  # int32 array: the adapters serialise it natively
        admit = self.gate.admit()
        engine = None
        try:
            version = await admit.__aenter__()
        except Paused as exc:
            raise self._engine_error(exc, None) from None
        try:
            engine = self.router.for_session(session.info.session_id)
            streams = [engine.stream(ids, s) for s in samplings]
            merged = _indexed(streams[0]) if len(streams) == 1 else _merge(streams)
            first = await anext(merged, None)
            if first is None:
                raise EngineError("the engine's stream ended without any output")
        except BaseException as exc:
            await admit.__aexit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, EngineError):
                raise self._engine_error(exc, engine) from None
            raise
        return EngineStream(version, first, merged, admit, self, engine)

    def _engine_error(self, exc: Exception, engine: Any) -> ApiError:
        if isinstance(exc, Paused):
            return ApiError(503, "weights are being updated; retry shortly", retry_after=exc.retry_after)
        if isinstance(exc, EngineUnavailable) and engine is not None:
            self.router.mark_unhealthy(engine)
        status = getattr(exc, "status", 502)
        retry = getattr(exc, "retry_after", None)
        if retry is None and status in (502, 503, 504):
            retry = self.settings.retry_after
        return ApiError(status, f"engine: {getattr(exc, 'message', None) or exc}", code="engine_error",
                        retry_after=retry)

    # --- recording ---
    def record(self, session: Session, api: str, prompt_ids: np.ndarray, gen: Generation,
               sampling: SamplingParams, version: int, timings: dict[str, float], request_body: bytes,
               answer: dict) -> int:
        """Queue the call's record; returns its call index. The recorder's worker thread zstd-compresses
        the request and answer bytes, off the event loop. A replayed answer (a fork) is not recorded again:
        it keeps its source's call index."""
        if isinstance(gen, Replayed):
            session.next_call = max(session.next_call, gen.call_index + 1)
            return gen.call_index
        index = session.take_call_index()
        record = CallRecord(
            session_id=session.info.session_id,
            call_index=index,
            prompt_ids=prompt_ids,
            output_ids=np.asarray(gen.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(gen.logprobs, dtype=np.float32),
            weight_version=version,
            finish_reason=gen.finish_reason,
            api=api,
            sampling=sampling_dict(sampling),
            timings=timings,
            request=request_body,
            response=orjson.dumps(answer),
        )
        done = self.recorder.record_call(record, compress=True)
        if done is not None and (unsynced := UNSYNCED.get(None)) is not None:
            unsynced.append(done)
        return index

    async def durable(self) -> None:
        """Wait until this request's recorded calls are in the pool or the spill file."""
        pending = UNSYNCED.get([])
        while pending:
            try:
                await asyncio.wrap_future(pending.pop())
            except Exception:  # noqa: BLE001 - pool and disk both failed: the recorder logged it; answer anyway
                pass

    def observe(self, api: str, stream: bool, timings: dict[str, float], prompt_len: int, gens: list[Generation]) -> None:
        first = timings["first_token"] - timings["received"] if "first_token" in timings else None
        for gen in gens:
            metrics.observe_call(api, stream, gen.finish_reason, timings["done"] - timings["received"],
                                 prompt_tokens=prompt_len, completion_tokens=len(gen.output_ids),
                                 first_token_seconds=first)


class EngineStream:
    """An open engine stream (or n merged): iterate for (choice index, delta); `aclose` always."""

    def __init__(self, version: int, first: tuple[int, StreamDelta], rest: AsyncIterator[tuple[int, StreamDelta]],
                 admit: AbstractAsyncContextManager, core: Core, engine: Any) -> None:
        self.version = version
        self._first: tuple[int, StreamDelta] | None = first
        self._rest = rest
        self._admit = admit
        self._core = core
        self._engine = engine

    @classmethod
    def whole(cls, gens: Sequence[Generation], core: Core) -> EngineStream:
        """Finished generations as a stream: one chunk per choice (a fork's replayed answers)."""
        chunks = [(i, StreamDelta(g.output_ids, g.logprobs, g.text, final=g)) for i, g in enumerate(gens)]

        async def rest() -> AsyncIterator[tuple[int, StreamDelta]]:
            for chunk in chunks[1:]:
                yield chunk

        return cls(gens[0].weight_version, chunks[0], rest(), nullcontext(), core, None)

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for item in self._rest:
                yield item
        except (EngineError, Paused) as exc:
            raise self._core._engine_error(exc, self._engine) from None

    async def aclose(self) -> None:
        try:
            await self._rest.aclose()
        finally:
            await self._admit.__aexit__(None, None, None)


async def _indexed(stream: AsyncIterator[StreamDelta]) -> AsyncIterator[tuple[int, StreamDelta]]:
    try:
        async for delta in stream:
            yield 0, delta
    finally:
        await _aclose(stream)


async def _merge(streams: list[AsyncIterator[StreamDelta]]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Interleave n streams as their chunks arrive; the first failure ends them all."""
    queue: asyncio.Queue[tuple[int, StreamDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await _aclose(stream)


async def _aclose(stream: Any) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def sampling_dict(s: SamplingParams) -> dict[str, Any]:
    """The sampling parameters for the record (by hand: dataclasses.asdict deep-copies, on the hot path)."""
    return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "stop": s.stop, "stop_token_ids": s.stop_token_ids, "seed": s.seed, "ignore_eos": s.ignore_eos}


def now() -> float:
    return time.time()
