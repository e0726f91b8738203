"""The request edge: who is calling (session attribution), and the body read and validated once.

    Edge(settings, sessions)   session_for(request), read_json(request), parse(Model, request), offload, limits
    Offload(limit, workers)    fn(*args) on one of `workers` threads when the request it works on is large
    check_int64(raw)           400 naming the field of an integer beyond 64 bits

A large request (body over `offload_bytes`) is parsed, rendered and tokenized on a worker thread; the loop stays
free for everyone else only as far as that work lets go of the GIL. It does: the template's rendering is Python
code (the interpreter switches threads every few ms), the int64 scan goes in 64 KiB slices, and long texts are
tokenized in worker processes (stepline.gateway.tokenizing: the tokenizer would hold the GIL for seconds). What
still holds it for several ms at a time, for bodies of several MB only: the schema's parse (pydantic-core, ~5 ms
for 7.9 MB) and the template's string operations on huge messages (~11 ms). docs/results.md has the measurements.

A model call marks its session as calling (`CALLING`, set by the route, stepline.gateway.frontends.routes)
so that the idle-session reaper never ends a session with a call running.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from stepline.gateway.config import GatewaySettings
from stepline.gateway.frontends.errors import ApiError, from_validation, invalid
from stepline.gateway.sessions import Session, SessionStore, bearer_key, is_admin_key
from stepline.gateway.tokenizing import trim_heap

__all__ = ["CALLING", "Edge", "Limits", "Offload", "check_int64", "int64_violation"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# the sessions whose calls the request being handled is making (set by the model route; the reaper skips them)
CALLING: contextvars.ContextVar[list[Session] | None] = contextvars.ContextVar("calling", default=None)
_LONG_RUN = b"0" * 19  # every integer outside the 64-bit range has at least 19 digits
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # ASCII digits -> "0", the rest " "
_SLICE = 64 * 1024
TRIM_BYTES = 1 << 20  # requests from this size on hand their freed heap back


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
    # digits mapped to "0" (bytes.translate), then a substring search: ~0.7 ms per MB, against ~9 for the regex
    # \d{19}; in slices overlapping by 18 bytes, so that other threads (the event loop) get the GIL between them
    if not any(_LONG_RUN in raw[at: at + _SLICE + 18].translate(_DIGITS_AS_ZERO) for at in range(0, len(raw), _SLICE)):
        return
    try:
        data = from_json(raw)
    except ValueError:
        return  # malformed JSON: the schema's parse reports it
    where = int64_violation(data)
    if where is not None:
        raise invalid(f"{where}: integers must lie in the 64-bit range [-2^63, 2^63)", param=where)


class Offload:
    """fn(*args), on one of `workers` threads when the request it works on is larger than `limit` bytes (more
    large requests wait their turn), so that one large request does not hold the event loop (and with it
    every other session's calls) while it is prepared: as far as its work lets go of the GIL (the module
    docstring). The heap a request of `TRIM_BYTES` or more used is handed back to the system after it (glibc's
    malloc_trim, which walks the heap: not worth it after every 16 KiB body; freed memory otherwise stays with
    the process)."""

    def __init__(self, limit: int, workers: int = 2) -> None:
        self.limit = limit
        self._threads = ThreadPoolExecutor(max(workers, 1), thread_name_prefix="stepline-prepare")

    async def __call__(self, size: int, fn: Callable[..., R], *args: Any) -> R:
        if size <= self.limit:
            return fn(*args)
        context = contextvars.copy_context()
        run = _trimmed if size >= TRIM_BYTES else _plain
        return await asyncio.get_running_loop().run_in_executor(self._threads, run, context, fn, args)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def _plain(context: contextvars.Context, fn: Callable[..., R], args: tuple) -> R:
    return context.run(fn, *args)


def _trimmed(context: contextvars.Context, fn: Callable[..., R], args: tuple) -> R:
    try:
        return context.run(fn, *args)
    finally:
        trim_heap()


@dataclass(frozen=True)
class Limits:
    """How much one request may ask for (each checked by its front end, with a 400 naming the field)."""

    max_n: int  # choices per request
    max_prompts: int  # prompts in one Completions batch
    max_engine_requests: int  # prompts x n


class Edge:
    """Session lookup, reading and parsing: what every route does before its own work."""

    def __init__(self, settings: GatewaySettings, sessions: SessionStore) -> None:
        self.sessions = sessions
        self.limits = Limits(settings.max_n, settings.max_prompts, settings.max_engine_requests)
        self.admin_token = settings.admin_token
        self.read_timeout = settings.read_timeout
        self.offload = Offload(settings.offload_bytes, settings.prepare_workers)

    def session_for(self, request: web.Request) -> Session:
        """The calling session: by session key, or by URL / X-Session-Id together with that session's
        key (or the admin token). The id alone is an address, not a credential: no key → 401, a key
        for another session → 403."""
        session_id = request.match_info.get("session") or request.headers.get("X-Session-Id")
        key = bearer_key(request.headers)
        keyed = self.sessions.by_key(key) if key else None
        if keyed is None and not is_admin_key(key, self.admin_token):
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
        calling = CALLING.get()
        if calling is not None and session.info.expert:  # its calls would train as the expert's
            raise ApiError(409, f"session {session.info.session_id} is an expert's: its calls come from POST "
                           "/sessions/<id>/demonstration, not from the model", code="expert_session")
        self.sessions.touch(session)
        if calling is not None:  # a model call: not idle until its route returns
            self.sessions.hold(session)
            calling.append(session)
        return session

    async def read_body(self, request: web.Request) -> bytes:
        """The body, decompressed: too large → 413 (aiohttp counts it as it streams in); slower
        than `read_timeout` → 408 (a client sending a byte a minute must not hold a handler)."""
        try:
            async with asyncio.timeout(self.read_timeout):
                return await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body took longer than {self.read_timeout:g} s to arrive") from None

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
        """The raw body and its validated request (400 naming the field on any problem); large bodies are
        parsed on a worker thread (`Offload`)."""
        raw = await self.read_body(request)

        def validate() -> M:
            check_int64(raw)
            try:
                return model.model_validate_json(raw)  # one pass in pydantic-core: parse and validate
            except ValidationError as exc:
                raise from_validation(exc) from None

        return raw, await self.offload(len(raw), validate)
