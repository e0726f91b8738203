"""Dispatch: one model call to the engine, whole or streamed, and the engine's failures as API errors.

    Dispatch(router, gate, recorder, retry_after, limit)
        generate(ex)     -> one Generation per choice (n engine requests, concurrently)
        open_stream(ex)  -> EngineStream: (choice, delta) as the engine produces them; n streams merged
        engine_error(exc, engine) -> ApiError (an unreachable engine is routed around)

The weight gate (stepline.gateway.fleet) stamps each call with the version that serves it; the router picks
the session's engine. A fork before its branch point is answered from the source's recorded calls instead
(stepline.gateway.forks). With the record queue full, a call is refused with a ready-made 503 before it
reaches the engine. Each engine request (one choice) takes one of its session's sequence slots first
(stepline.gateway.fairness): a session's sequences beyond the limit wait their turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, cast

import numpy as np

from stepline.gateway.engines import EngineError, EngineUnavailable, Generation, SamplingParams, StreamDelta
from stepline.gateway.fairness import SequenceLimit
from stepline.gateway.fleet import EngineRouter, Paused, WeightGate
from stepline.gateway.forks import Replayed
from stepline.gateway.frontends.errors import ApiError
from stepline.gateway.frontends.exchange import Exchange, now
from stepline.gateway.recorder import Recorder
from stepline.gateway.sessions import Session

__all__ = ["Dispatch", "EngineStream"]

log = logging.getLogger(__name__)


class Dispatch:
    """The engine side of a call: admission by the weight gate, the session's engine, engine errors."""

    def __init__(self, router: EngineRouter, gate: WeightGate, recorder: Recorder, retry_after: float,
                 limit: SequenceLimit | None = None) -> None:
        self.router = router
        self.limit = limit or SequenceLimit(0)  # a session's engine sequences running at once
        self.gate = gate
        self.recorder = recorder  # asked only whether its queue has room
        self.retry_after = retry_after
        self._overloaded = ApiError(503, "the gateway's record queue is full; retry shortly", retry_after=retry_after)

    async def generate(self, ex: Exchange) -> list[Generation]:
        """One engine request per choice, concurrently; stamps `ex.version`."""
        if (replayed := _replayed(ex.session, ex.prompt.ids, len(ex.samplings))) is not None:
            ex.version = replayed[0].weight_version
            ex.timings["dispatched"] = ex.timings["done"] = now()
            return list(replayed)
        if not self.recorder.has_capacity():
            raise self._overloaded
        # an int32 array, which the adapters serialise natively (their signatures say list[int])
        ids, samplings = cast("list[int]", ex.prompt.ids), ex.samplings
        engine = None
        ex.timings["dispatched"] = now()
        try:
            async with self.gate.admit() as ex.version:
                sid = ex.session.info.session_id
                engine = self.router.for_session(sid)

                async def one(sampling: SamplingParams) -> Generation:
                    async with self.limit.slot(sid):
                        return await engine.generate(ids, sampling)

                if len(samplings) == 1:
                    return [await one(samplings[0])]
                return list(await asyncio.gather(*(one(s) for s in samplings)))
        except (EngineError, Paused) as exc:
            raise self.engine_error(exc, engine) from None
        finally:
            ex.timings["done"] = now()

    async def open_stream(self, ex: Exchange) -> EngineStream:
        """Start the engine streams and wait for the first chunk, so that failures before any token
        still get a proper error status (the SSE headers are not sent yet); stamps `ex.version`."""
        if (replayed := _replayed(ex.session, ex.prompt.ids, len(ex.samplings))) is not None:
            ex.version = replayed[0].weight_version
            return EngineStream.whole(replayed, self)
        if not self.recorder.has_capacity():
            raise self._overloaded
        ids = cast("list[int]", ex.prompt.ids)  # an int32 array: the adapters serialise it natively
        admit = self.gate.admit()
        engine = None
        ex.timings["dispatched"] = now()
        try:
            ex.version = await admit.__aenter__()
        except Paused as exc:
            raise self.engine_error(exc, None) from None
        try:
            sid = ex.session.info.session_id
            engine = self.router.for_session(sid)
            streams = [_in_slot(self.limit, sid, engine.stream(ids, s)) for s in ex.samplings]
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
            retry = self.retry_after
        return ApiError(status, f"engine: {getattr(exc, 'message', None) or exc}", code="engine_error",
                        retry_after=retry)


def _replayed(session: Session, prompt_ids: np.ndarray, n: int) -> list[Replayed] | None:
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


class EngineStream:
    """An open engine stream (or n merged): iterate for (choice index, delta); `aclose` always."""

    def __init__(self, first: tuple[int, StreamDelta], rest: AsyncIterator[tuple[int, StreamDelta]],
                 admit: AbstractAsyncContextManager, dispatch: Dispatch, engine: Any) -> None:
        self._first: tuple[int, StreamDelta] | None = first
        self._rest = rest
        self._admit = admit
        self._dispatch = dispatch
        self._engine = engine

    @classmethod
    def whole(cls, gens: Sequence[Generation], dispatch: Dispatch) -> EngineStream:
        """Finished generations as a stream: one chunk per choice (a fork's replayed answers)."""
        chunks = [(i, StreamDelta(g.output_ids, g.logprobs, g.text, final=g)) for i, g in enumerate(gens)]

        async def rest() -> AsyncIterator[tuple[int, StreamDelta]]:
            for chunk in chunks[1:]:
                yield chunk

        return cls(chunks[0], rest(), nullcontext(), dispatch, None)

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for item in self._rest:
                yield item
        except (EngineError, Paused) as exc:
            raise self._dispatch.engine_error(exc, self._engine) from None

    async def aclose(self) -> None:
        try:
            await _aclose(self._rest)
        finally:
            await self._admit.__aexit__(None, None, None)


async def _in_slot(limit: SequenceLimit, session_id: str,
                   stream: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    """`stream` once a sequence slot of the session is free, holding the slot until it ends."""
    async with limit.slot(session_id):
        try:
            async for delta in stream:
                yield delta
        finally:
            await _aclose(stream)


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
