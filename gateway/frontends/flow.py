"""The path of one chat-style call (Chat Completions, Responses, Messages), API-independent.

    prompt ids (TITO) → engine (n choices) → parse reasoning / tool calls → the API's answer
    → one CallRecord per choice, and each choice remembered as a turn the next call can extend.

A front end supplies the request in canonical form (`ChatCall`) and an `Emitter` that writes its
answer: whole (`answer`) or as a stream of server-sent events. Nothing is recorded for a call that
fails, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from aiohttp import web

from gateway.engines import Generation, SamplingParams, StreamDelta
from gateway.frontends.core import Core, now
from gateway.frontends.errors import ApiError, invalid
from gateway.parsers.base import Event, ParsedOutput, StreamParser, collect
from gateway.sessions import Session
from gateway.templating import Message, TemplateError
from gateway.tito import Prompt

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
    base = replace(call.sampling, max_new_tokens=budget,
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


async def run(core: Core, session: Session, call: ChatCall, raw: bytes, emitter: Emitter) -> dict:
    """A whole (non-streamed) call: returns the API answer after queueing its records."""
    timings = {"received": now()}
    prompt, samplings = await core.offload(len(raw), build_prompt, core, session, call)
    timings["dispatched"] = now()
    gens, version = await core.generate(session, prompt.ids, samplings)
    timings["done"] = now()
    choices = []
    for index, gen in enumerate(gens):
        parser = _parser(core, call)
        choices.append(Choice(index, gen, collect(parser.feed(gen.text) + parser.finish())))
    answer = emitter.answer(choices, prompt)
    _commit(core, session, call, raw, prompt, samplings, version, timings, choices, answer)
    core.observe(call.api, False, timings, len(prompt.ids), gens)
    return answer


async def stream(core: Core, request: web.Request, session: Session, call: ChatCall, raw: bytes,
                 emitter: Emitter) -> web.StreamResponse:
    """A streamed call: text reaches the client as the engine produces it."""
    timings = {"received": now()}
    prompt, samplings = await core.offload(len(raw), build_prompt, core, session, call)
    timings["dispatched"] = now()
    upstream = await core.open_stream(session, prompt.ids, samplings)
    response = web.StreamResponse(headers=SSE_HEADERS)
    parsers = [_parser(core, call, incremental=True) for _ in samplings]  # calls stream as they are written
    progress = [Progress() for _ in samplings]
    try:
        await response.prepare(request)
        await response.write(emitter.start(prompt))
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
        choices = [Choice(i, p.final, collect(p.events)) for i, p in enumerate(progress)]  # type: ignore[arg-type]
        # recorded before the last event: the harness holds a whole answer only once its record is durable
        _commit(core, session, call, raw, prompt, samplings, upstream.version, timings, choices,
                emitter.answer(choices, prompt))
        await core.durable()
        await response.write(emitter.end(choices, prompt))
    except ApiError as err:  # after the headers: the API's in-stream error event; nothing recorded
        await _try_write(response, emitter.error(err))
        return response
    except (ConnectionResetError, ConnectionError):  # the client went away: nothing recorded
        return response
    finally:
        await upstream.aclose()
    core.observe(call.api, True, timings, len(prompt.ids), [c.generation for c in choices])
    return response


def _commit(core: Core, session: Session, call: ChatCall, raw: bytes, prompt: Prompt, samplings: list[SamplingParams],
            version: int, timings: dict[str, float], choices: list[Choice], answer: dict) -> None:
    for choice in choices:
        choice.call_index = core.record(session, call.api, prompt.ids, choice.generation, samplings[choice.index],
                                        version, timings, raw, answer)
        output = np.asarray(choice.generation.output_ids, dtype=np.int32)
        session.tokens.remember(prompt, assistant_message(choice.parsed), output)


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, ConnectionError):
        pass


def usage(prompt: Prompt, choices: list[Choice]) -> tuple[int, int]:
    return len(prompt.ids), sum(len(c.generation.output_ids) for c in choices)
