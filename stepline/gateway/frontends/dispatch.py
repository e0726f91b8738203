"""Dispatch: one model call to the engine, whole or streamed, and the engine's failures as API errors.

    Dispatch(router, gate, recorder, retry_after, limit, partial_rollouts)
        generate(ex)     -> one Generation per choice (n engine requests, concurrently)
        open_stream(ex)  -> EngineStream: (choice, delta) as the engine produces them; n streams merged
        engine_error(exc, engine) -> ApiError (an unreachable engine is routed around)

The weight gate (stepline.gateway.fleet) stamps each call with the version that serves it; the router picks
the session's engine. A fork before its branch point is answered from the source's recorded calls instead
(stepline.gateway.forks). With the record queue full, a call is refused with a ready-made 503 before it
reaches the engine. Each engine request (one choice) takes one of its session's sequence slots first
(stepline.gateway.fairness): a session's sequences beyond the limit wait their turn. With partial rollouts, a
choice a weight update cut short goes on under the new weights (stepline.gateway.frontends.resume).
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
from stepline.gateway.frontends.resume import MAX_RESUMES, Resumer
from stepline.gateway.frontends.streams import aclose, in_slot, indexed, merge
from stepline.gateway.recorder import Recorder
from stepline.gateway.sessions import Session

__all__ = ["Dispatch", "EngineStream"]

log = logging.getLogger(__name__)


class Dispatch:
    """The engine side of a call: admission by the weight gate, the session's engine, engine errors."""

    def __init__(self, router: EngineRouter, gate: WeightGate, recorder: Recorder, retry_after: float,
                 limit: SequenceLimit | None = None, partial_rollouts: bool = True) -> None:
        self.router = router
        self.limit = limit or SequenceLimit(0)  # a session's engine sequences running at once
        self.gate = gate
        # a choice cut by a weight update goes on under the new weights (0 resumes: answered truncated)
        self.resumer = Resumer(gate, router, self.limit, MAX_RESUMES if partial_rollouts else 0)
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
        admission = self.gate.admit(len(samplings))  # one unit per engine request, released as each ends
        try:
            async with admission as ex.version:
                sid = ex.session.info.session_id
                engine = self.router.for_session(sid)

                async def one(sampling: SamplingParams) -> Generation:
                    async with self.limit.slot(sid):
                        gen = await engine.generate(ids, sampling)
                    admission.release()
                    return await self.resumer.whole(sid, ex.prompt.ids, sampling, gen, admission)

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
        admit = self.gate.admit(len(ex.samplings))  # one unit per engine request, released as each ends
        engine = None
        ex.timings["dispatched"] = now()
        try:
            ex.version = await admit.__aenter__()
        except Paused as exc:
            raise self.engine_error(exc, None) from None
        try:
            sid = ex.session.info.session_id
            engine = self.router.for_session(sid)
            streams = [self.resumer.stream(sid, ex.prompt.ids, s, in_slot(self.limit, sid, engine.stream(ids, s)), admit)
                       for s in ex.samplings]
            merged = indexed(streams[0]) if len(streams) == 1 else merge(streams)
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
            await aclose(self._rest)
        finally:
            await self._admit.__aexit__(None, None, None)
