"""The call pipeline: one model call, from the request's edge to its record, for every API.

    edge      attribution (session key / URL / X-Session-Id), the body read and validated once
    Exchange  built once per request: session, API, raw body, prompt, sampling, weight version, timings
    dispatch  the weight gate stamps the version, the router picks the session's engine, n choices
    parse     reasoning and tool calls out of each choice (stepline.gateway.parsers)
    emit      the API's answer, whole or as server-sent events (the front end's `Emitter`)
    commit    one CallRecord per choice to the recorder (never waiting on the pool), and each choice
              remembered as a turn the next call can extend (TITO)

A chat-style front end (Chat Completions, Responses, Messages) turns its request into a `ChatCall` and
an `Emitter` and calls `run` or `stream`; Completions builds its prompts from text or ids and uses the
same dispatch and commit, and streams through the same loop, `stream_exchange` (with its own emitter, its
text unparsed, its own memory of turns). Nothing is recorded for a call that fails, streamed or not. With
a spill file an answer waits on `Core.durable()` before its last bytes (non-stream answers: `model_route`
does), so that nothing acknowledged is lost to a crash (stepline.gateway.spill).

`error_boundary` is the app's middleware: every failure becomes an answer in the caller's API format.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import numpy as np
import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from stepline.datapool.records import CallRecord
from stepline.gateway.config import GatewaySettings
from stepline.gateway.engines import EngineError, EngineUnavailable, Generation, SamplingParams, StreamDelta
from stepline.gateway.fleet import EngineRouter, Paused, WeightGate
from stepline.gateway.forks import Replayed
from stepline.gateway.frontends.errors import ApiError, Flavour, error_response, from_validation, invalid
from stepline.gateway.parsers import parser_spec
from stepline.gateway.parsers.base import Event, ParsedOutput, StreamParser, ToolSpecs
from stepline.gateway.parsers.stream import collect
from stepline.gateway.profile import ModelProfile
from stepline.gateway.recorder import GatewayMetrics, Recorder
from stepline.gateway.sessions import Prompt, Session, SessionStore, bearer_key, is_admin_key
from stepline.gateway.templating import ChatTemplate, Message, TemplateError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# the durability futures of the calls recorded by the request being handled (set by the app's route)
UNSYNCED: contextvars.ContextVar[list[Future[None]]] = contextvars.ContextVar("unsynced")
# the sessions whose calls the request being handled is making (set by the app's route; the reaper skips them)
CALLING: contextvars.ContextVar[list[Session] | None] = contextvars.ContextVar("calling", default=None)
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


@dataclass
class Exchange:
    """One model call on its way through the pipeline, built once per request (a Completions batch:
    one per prompt). The stages fill it in: the prompt and sampling, then the weight version at
    dispatch, and the timings as it goes."""

    session: Session
    api: str  # chat.completions | completions | responses | messages
    raw: bytes  # the request body as received (recorded with the call)
    prompt: Prompt = field(default_factory=lambda: Prompt(np.zeros(0, dtype=np.int32), 0, 0))
    samplings: list[SamplingParams] = field(default_factory=list)  # one per choice
    version: int = -1  # the weight version that serves it, stamped at dispatch
    timings: dict[str, float] = field(default_factory=lambda: {"received": now()})


Handler = Callable[["Core", web.Request], Awaitable[web.StreamResponse]]


def error_boundary(count: Callable[[str, int], None], flavour: Callable[[str], Flavour],
                   label: Callable[[str], str]) -> Any:
    """The app's middleware: every failure becomes an answer in the caller's API format (`flavour` of
    the path), counted (`count(label of the path, status)`: the app's metrics); nothing escapes as a bare 500."""

    @web.middleware
    async def errors(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            count(label(request.path), err.status)
            return error_response(flavour(request.path), err)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            if exc.status < 400:
                raise
            count(label(request.path), exc.status)
            message = "the request body is too large" if exc.status == 413 else exc.reason
            return error_response(flavour(request.path), ApiError(exc.status, message))
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            count(label(request.path), 500)
            return error_response(flavour(request.path), ApiError(500, "internal gateway error (logged)"))

    return errors


def model_route(core: Core, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A model API's route: a non-stream answer leaves only once its calls are durable."""

    async def route(request: web.Request) -> web.StreamResponse:
        calling: list[Session] = []
        unsynced_token, calling_token = UNSYNCED.set([]), CALLING.set(calling)
        try:
            response = await handler(core, request)
            await core.durable()
            return response
        finally:
            for session in calling:
                core.sessions.release(session)
            CALLING.reset(calling_token)
            UNSYNCED.reset(unsynced_token)

    return route


class Core:
    """The pipeline's components and the stages every front end shares."""

    def __init__(self, settings: GatewaySettings, router: EngineRouter, recorder: Recorder, gate: WeightGate,
                 template: ChatTemplate, profile: ModelProfile) -> None:
        self.settings = settings
        self.router = router
        self.recorder = recorder
        self.gate = gate
        self.template = template
        self.profile = profile
        self.metrics = GatewayMetrics(router, recorder, gate)  # this app's own registry
        strict = settings.strict_template or not profile.append_only
        self.sessions = SessionStore(template, strict, settings.max_live_sessions)
        self.context_length = settings.context_length or template.context_length
        self._parsers = parser_spec(profile.tool_parser, profile.reasoning_parser, profile.reasoning_forced)
        self._overloaded = ApiError(503, "the gateway's record queue is full; retry shortly",
                                    retry_after=settings.retry_after)

    # --- the edge: who is calling, with what ---
    def session_for(self, request: web.Request) -> Session:
        """The calling session: by session key, or by URL / X-Session-Id together with that session's
        key (or the admin token). The id alone is an address, not a credential: no key → 401, a key
        for another session → 403."""
        session_id = request.match_info.get("session") or request.headers.get("X-Session-Id")
        key = bearer_key(request.headers)
        keyed = self.sessions.by_key(key) if key else None
        if keyed is None and not is_admin_key(key, self.settings.admin_token):
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
        if (calling := CALLING.get()) is not None:  # a model call: not idle until its route returns
            self.sessions.hold(session)
            calling.append(session)
        return session

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
        return self._parsers.new(tools_enabled, tools, incremental)

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
        """A fork before its branch point: the source's recorded answers to this prompt (stepline/gateway/forks.py)."""
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

    async def generate(self, ex: Exchange) -> list[Generation]:
        """One engine request per choice, concurrently; stamps `ex.version`."""
        if (replayed := self.replayed(ex.session, ex.prompt.ids, len(ex.samplings))) is not None:
            ex.version = replayed[0].weight_version
            ex.timings["dispatched"] = ex.timings["done"] = now()
            return list(replayed)
        if not self.recorder.has_capacity():
            raise self._overloaded
        ids, samplings = ex.prompt.ids, ex.samplings  # int32 array: the adapters serialise it natively
        engine = None
        ex.timings["dispatched"] = now()
        try:
            async with self.gate.admit() as ex.version:
                engine = self.router.for_session(ex.session.info.session_id)
                if len(samplings) == 1:
                    return [await engine.generate(ids, samplings[0])]
                return list(await asyncio.gather(*(engine.generate(ids, s) for s in samplings)))
        except (EngineError, Paused) as exc:
            raise self.engine_error(exc, engine) from None
        finally:
            ex.timings["done"] = now()

    async def open_stream(self, ex: Exchange) -> EngineStream:
        """Start the engine streams and wait for the first chunk, so that failures before any token
        still get a proper error status (the SSE headers are not sent yet); stamps `ex.version`."""
        if (replayed := self.replayed(ex.session, ex.prompt.ids, len(ex.samplings))) is not None:
            ex.version = replayed[0].weight_version
            return EngineStream.whole(replayed, self)
        if not self.recorder.has_capacity():
            raise self._overloaded
        ids = ex.prompt.ids  # int32 array: the adapters serialise it natively
        admit = self.gate.admit()
        engine = None
        ex.timings["dispatched"] = now()
        try:
            ex.version = await admit.__aenter__()
        except Paused as exc:
            raise self.engine_error(exc, None) from None
        try:
            engine = self.router.for_session(ex.session.info.session_id)
            streams = [engine.stream(ids, s) for s in ex.samplings]
            merged = _indexed(streams[0]) if len(streams) == 1 else _merge(streams)
            first = await anext(merged, None)
            if first is None:
                raise EngineError("the engine's stream ended without any output")
        except BaseException as exc:
            await admit.__aexit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, EngineError):
                raise self.engine_error(exc, engine) from None
            raise
        return EngineStream(first, merged, admit, self, engine)

    def engine_error(self, exc: Exception, engine: Any) -> ApiError:
        """The answer to an engine failure or a paused gate (an unreachable engine is routed around)."""
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
    def record(self, ex: Exchange, choice: int, gen: Generation, answer: dict) -> int:
        """Queue the record of choice `choice`; returns its call index. The recorder's worker thread
        zstd-compresses the request and answer bytes, off the event loop. A replayed answer (a fork) is not
        recorded again: it keeps its source's call index."""
        if isinstance(gen, Replayed):
            ex.session.next_call = max(ex.session.next_call, gen.call_index + 1)
            return gen.call_index
        index = ex.session.take_call_index()
        record = CallRecord(
            session_id=ex.session.info.session_id,
            call_index=index,
            prompt_ids=ex.prompt.ids,
            output_ids=np.asarray(gen.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(gen.logprobs, dtype=np.float32),
            weight_version=ex.version,
            finish_reason=gen.finish_reason,
            api=ex.api,
            sampling=sampling_dict(ex.samplings[choice]),
            timings=ex.timings,
            request=ex.raw,
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

    def observe(self, ex: Exchange, stream: bool, gens: list[Generation]) -> None:
        timings = ex.timings
        first = timings["first_token"] - timings["received"] if "first_token" in timings else None
        for gen in gens:
            self.metrics.observe_call(ex.api, stream, gen.finish_reason, timings["done"] - timings["received"],
                                      prompt_tokens=len(ex.prompt.ids), completion_tokens=len(gen.output_ids),
                                      first_token_seconds=first)


class EngineStream:
    """An open engine stream (or n merged): iterate for (choice index, delta); `aclose` always."""

    def __init__(self, first: tuple[int, StreamDelta], rest: AsyncIterator[tuple[int, StreamDelta]],
                 admit: AbstractAsyncContextManager, core: Core, engine: Any) -> None:
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

        return cls(chunks[0], rest(), nullcontext(), core, None)

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for item in self._rest:
                yield item
        except (EngineError, Paused) as exc:
            raise self._core.engine_error(exc, self._engine) from None

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


# --- the chat-style path ---
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ChatCall:
    """A chat-style request, in the form the template and the engine take."""

    api: str  # chat.completions | responses | messages
    messages: list[Message]
    tools: list[dict] | None  # OpenAI function-tool dicts, as chat templates expect them
    sampling: SamplingParams
    max_tokens: int | None  # None: the gateway's default (always cut to the room left in the context)
    n: int = 1
    tools_enabled: bool = True  # False for tool_choice "none": tool-call text stays text
    stream: bool = False
    template_options: dict[str, Any] | None = None  # chat_template_kwargs (e.g. {"enable_thinking": false})


@dataclass
class Choice:
    index: int
    generation: Generation
    parsed: ParsedOutput
    call_index: int = -1


@dataclass
class Progress:
    """A streamed choice so far."""

    events: list[Event] = field(default_factory=list)
    final: Generation | None = None


class Emitter(Protocol):
    """Writes one API's answer. Stream methods return the bytes to send (possibly empty)."""

    def answer(self, choices: list[Choice], prompt: Prompt) -> dict: ...
    def start(self, prompt: Prompt) -> bytes: ...
    def events(self, index: int, events: list[Event], delta: StreamDelta) -> bytes: ...
    def finish(self, index: int, final: Generation, parsed: ParsedOutput) -> bytes: ...
    def end(self, choices: list[Choice], prompt: Prompt) -> bytes: ...
    def error(self, err: ApiError) -> bytes: ...


class PlainText:
    """The parser of an answer that is not parsed (Completions): all its text is content."""

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


Remember = Callable[[Exchange, Choice], None]  # keeps a committed choice as a turn the next call can extend


def assistant_message(parsed: ParsedOutput) -> Message:
    """The answer as the harness will echo it in its next call."""
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    return message


def build_prompt(core: Core, session: Session, call: ChatCall) -> tuple[Prompt, list[SamplingParams]]:
    core.check_tools(call.tools)
    try:
        prompt = session.tokens.prompt_for(call.messages, call.tools, call.template_options)
    except TemplateError as exc:
        raise invalid(str(exc) + core.tool_history_hint(call.messages), param="messages") from None
    budget = core.max_new_tokens(len(prompt.ids), call.max_tokens)
    base = replace(call.sampling, **session.sampling, max_new_tokens=budget,
                   stop_token_ids=sorted({*call.sampling.stop_token_ids, *core.template.stop_token_ids}))
    # n choices of one seeded call must differ from each other and still be reproducible
    samplings = [base if base.seed is None else replace(base, seed=choice_seed(base.seed, i)) for i in range(call.n)]
    return prompt, samplings


def choice_seed(seed: int, index: int) -> int:
    """The engine seed of choice `index` of a call seeded `seed` (any int64): inside [0, 2^63), which
    every engine accepts, so a seed near the top of the range cannot fail (or abort) the call."""
    return (seed + index) % 2**63


def _parser(core: Core, call: ChatCall, incremental: bool = False) -> StreamParser:
    specs = {t["function"]["name"]: t["function"].get("parameters") or {} for t in call.tools or []}
    return core.parser(call.tools_enabled and bool(specs), specs, incremental)


async def run(core: Core, ex: Exchange, call: ChatCall, emitter: Emitter) -> dict:
    """A whole (non-streamed) call: returns the API answer after queueing its records."""
    ex.prompt, ex.samplings = await core.offload(len(ex.raw), build_prompt, core, ex.session, call)
    gens = await core.generate(ex)
    choices = []
    for index, gen in enumerate(gens):
        parser = _parser(core, call)
        choices.append(Choice(index, gen, collect(parser.feed(gen.text) + parser.finish())))
    answer = emitter.answer(choices, ex.prompt)
    commit(core, ex, choices, answer, remember_turn)
    core.observe(ex, False, gens)
    return answer


async def stream(core: Core, request: web.Request, ex: Exchange, call: ChatCall, emitter: Emitter) -> web.StreamResponse:
    """A streamed chat-style call: text reaches the client as the engine produces it."""
    ex.prompt, ex.samplings = await core.offload(len(ex.raw), build_prompt, core, ex.session, call)
    parsers = [_parser(core, call, incremental=True) for _ in ex.samplings]  # calls stream as they are written
    return await stream_exchange(core, request, ex, emitter, parsers, remember_turn)


async def stream_exchange(core: Core, request: web.Request, ex: Exchange, emitter: Emitter,
                          parsers: Sequence[StreamParser], remember: Remember) -> web.StreamResponse:
    """The gateway's one SSE loop, for every API: `ex` holds its prompt and samplings, `parsers` one
    parser per choice; dispatch → parse → emit, then commit (`remember` keeps each choice as a turn)."""
    upstream = await core.open_stream(ex)
    response = web.StreamResponse(headers=SSE_HEADERS)
    progress = [Progress() for _ in ex.samplings]
    timings = ex.timings
    try:
        await response.prepare(request)
        await response.write(emitter.start(ex.prompt))
        async for index, delta in upstream:
            timings.setdefault("first_token", now())
            events = parsers[index].feed(delta.text)
            if delta.final is not None:
                events += parsers[index].finish()
            progress[index].events += events
            chunk = emitter.events(index, events, delta)
            if delta.final is not None:
                progress[index].final = delta.final
                chunk += emitter.finish(index, delta.final, collect(progress[index].events))
            if chunk:
                await response.write(chunk)
        if any(p.final is None for p in progress):
            raise ApiError(502, "engine: the stream ended without a final chunk", code="engine_error")
        timings["done"] = now()
        choices = [Choice(i, p.final, collect(p.events)) for i, p in enumerate(progress)]
        # recorded before the last event: the harness holds a whole answer only once its record is durable
        commit(core, ex, choices, emitter.answer(choices, ex.prompt), remember)
        await core.durable()
        await response.write(emitter.end(choices, ex.prompt))
    except ApiError as err:  # after the headers: the API's in-stream error event; nothing recorded
        await _try_write(response, emitter.error(err))
        return response
    except (ConnectionResetError, ConnectionError):  # the client went away: nothing recorded
        return response
    finally:
        await upstream.aclose()
    core.observe(ex, True, [c.generation for c in choices])
    return response


def commit(core: Core, ex: Exchange, choices: list[Choice], answer: dict, remember: Remember) -> None:
    """One record per choice, and each choice remembered as a turn the next call can extend."""
    for choice in choices:
        choice.call_index = core.record(ex, choice.index, choice.generation, answer)
        remember(ex, choice)


def remember_turn(ex: Exchange, choice: Choice) -> None:
    """The chat-style APIs' memory (TITO): the answer as the assistant message the harness will echo."""
    output = np.asarray(choice.generation.output_ids, dtype=np.int32)
    ex.session.tokens.remember(ex.prompt, assistant_message(choice.parsed), output)


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, ConnectionError):
        pass


def usage(prompt: Prompt, choices: list[Choice]) -> tuple[int, int]:
    return len(prompt.ids), sum(len(c.generation.output_ids) for c in choices)
