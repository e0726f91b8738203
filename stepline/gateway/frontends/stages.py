"""The stages of a model call, shared by every front end: prompt → dispatch → parse → emit → commit.

    Stages(prompting, dispatch, ledger, offload)
        run(ex, call, emitter)                       a whole chat-style call: returns the API answer
        stream(request, ex, call, emitter)           a streamed chat-style call
        stream_exchange(request, ex, emitter, parsers, remember)   the one SSE loop, for every API

A chat-style front end (Chat Completions, Responses, Messages) turns its request into a `ChatCall` and an
`Emitter` and calls `run` or `stream`; Completions builds its prompts from text or ids and uses the same
dispatch and commit, and streams through the same loop (with its own emitter, its text unparsed, its own
memory of turns). Nothing is recorded for a call that fails, streamed or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from aiohttp import web

from stepline.gateway.engines import Generation, StreamDelta
from stepline.gateway.forks import Replayed
from stepline.gateway.frontends.dispatch import Dispatch
from stepline.gateway.frontends.edge import Offload
from stepline.gateway.frontends.errors import ApiError
from stepline.gateway.frontends.exchange import Choice, Exchange, now
from stepline.gateway.frontends.ledger import Ledger, Remember
from stepline.gateway.frontends.prompting import ChatCall, Prompting, build_prompt
from stepline.gateway.parsers.base import Event, ParsedOutput, StreamParser
from stepline.gateway.parsers.stream import collect
from stepline.gateway.sessions import Prompt
from stepline.gateway.templating import Message

__all__ = ["Emitter", "PlainText", "Stages", "assistant_message", "remember_turn"]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


@dataclass
class Progress:
    """A streamed choice so far."""

    events: list[Event] = field(default_factory=list)
    final: Generation | None = None


def assistant_message(parsed: ParsedOutput) -> Message:
    """The answer as the harness will echo it in its next call."""
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    return message


def remember_turn(ex: Exchange, choice: Choice) -> None:
    """The chat-style APIs' memory (TITO): the answer as the assistant message the harness will echo, under its
    call index where it was recorded (a fork's replayed answer was not: the pool holds no such call there)."""
    output = np.asarray(choice.generation.output_ids, dtype=np.int32)
    call = -1 if isinstance(choice.generation, Replayed) else choice.call_index
    ex.session.tokens.remember(ex.prompt, assistant_message(choice.parsed), output, call)


class Stages:
    def __init__(self, prompting: Prompting, dispatch: Dispatch, ledger: Ledger, offload: Offload) -> None:
        self.prompting = prompting
        self.dispatch = dispatch
        self.ledger = ledger
        self.offload = offload

    async def run(self, ex: Exchange, call: ChatCall, emitter: Emitter) -> dict:
        """A whole (non-streamed) call: returns the API answer after queueing its records."""
        ex.prompt, ex.samplings = await self.offload(len(ex.raw), build_prompt, self.prompting, ex.session, call)
        gens = await self.dispatch.generate(ex)
        choices = []
        for index, gen in enumerate(gens):
            parser = self.prompting.parser(call)
            choices.append(Choice(index, gen, collect(parser.feed(gen.text) + parser.finish())))
        answer = emitter.answer(choices, ex.prompt)
        self.ledger.commit(ex, choices, answer, remember_turn)
        self.ledger.observe(ex, False, gens)
        return answer

    async def stream(self, request: web.Request, ex: Exchange, call: ChatCall, emitter: Emitter) -> web.StreamResponse:
        """A streamed chat-style call: text reaches the client as the engine produces it."""
        ex.prompt, ex.samplings = await self.offload(len(ex.raw), build_prompt, self.prompting, ex.session, call)
        parsers = [self.prompting.parser(call, incremental=True) for _ in ex.samplings]  # calls stream as written
        return await self.stream_exchange(request, ex, emitter, parsers, remember_turn)

    async def stream_exchange(self, request: web.Request, ex: Exchange, emitter: Emitter,
                              parsers: Sequence[StreamParser], remember: Remember) -> web.StreamResponse:
        """The gateway's one SSE loop, for every API: `ex` holds its prompt and samplings, `parsers` one
        parser per choice; dispatch → parse → emit, then commit (`remember` keeps each choice as a turn)."""
        upstream = await self.dispatch.open_stream(ex)
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
            choices = [Choice(i, p.final, collect(p.events)) for i, p in enumerate(progress) if p.final is not None]
            # recorded before the last event: the harness holds a whole answer only once its record is durable
            self.ledger.commit(ex, choices, emitter.answer(choices, ex.prompt), remember)
            await self.ledger.durable()
            await response.write(emitter.end(choices, ex.prompt))
        except ApiError as err:  # after the headers: the API's in-stream error event; nothing recorded
            await _try_write(response, emitter.error(err))
            return response
        except (ConnectionResetError, ConnectionError):  # the client went away: nothing recorded
            return response
        finally:
            await upstream.aclose()
        self.ledger.observe(ex, True, [c.generation for c in choices])
        return response


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionResetError, ConnectionError):
        pass
