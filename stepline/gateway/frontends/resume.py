"""Partial rollouts: a generation a weight update cut short goes on under the new weights, as one answer.

    Resumer(gate, router, limit, max_resumes)
        whole(session_id, ids, sampling, gen, admission)      -> the generation, resumed and spliced
        stream(session_id, ids, sampling, first, admission)   -> the deltas of every piece as one stream
    continuation(ids, pieces, sampling) -> the next engine request (None: the token budget is spent)
    splice(pieces)                      -> one Generation of the pieces, with their version spans

A weight update ends the calls still running after its grace (stepline/gateway/fleet.py, step 3): each ends
with finish_reason "abort" and the tokens sampled so far. The gate counts those rounds, so an engine request
that ends "abort" after one was cut by an update (`WeightGate.cut_since`), not by a client that went away.
Such a generation releases its admission (the update goes on), is admitted again, which waits for the new
version, and the engine is asked again with the prompt followed by the tokens sampled so far and
max_new_tokens reduced by them (AReaL's, slime's and verl's fully async "partial rollouts"). The pieces are
spliced: output ids, logprobs and text concatenated, the finish reason (and matched stop) of the last, and
`version_spans` (first output index, version) say which version sampled which tokens. The harness sees one
answer, or one uninterrupted stream.

At most `max_resumes` resumes per generation (0: partial rollouts off); past it, or when the resumed request
cannot be admitted (the update outlasts `wait` s) or fails before its first token, the answer ends with what it
has: finish_reason "abort", answered as truncated. The gate counts calls an update cut by how they were
answered (`WeightGate.cut_calls`: resumed, truncated). The engine decodes each piece's text on its own: a
character whose bytes straddle a cut, or a stop string that does, is not joined.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import cast

import numpy as np

from stepline.gateway.engines import EngineError, Generation, SamplingParams, StreamDelta
from stepline.gateway.fairness import SequenceLimit
from stepline.gateway.fleet import Admission, EngineRouter, Paused, WeightGate
from stepline.gateway.frontends.streams import aclose, in_slot

__all__ = ["MAX_RESUMES", "Piece", "Resumer", "continuation", "splice"]

log = logging.getLogger(__name__)

MAX_RESUMES = 4  # resumes of one generation at most: one per weight update it spans
Piece = tuple[int, Generation]  # (the version that served it, what the engine returned)
Request = tuple[np.ndarray, SamplingParams]


def continuation(ids: Sequence[int] | np.ndarray, pieces: Sequence[Piece], sampling: SamplingParams) -> Request | None:
    """The engine request that goes on from `pieces`: prompt + their output ids, max_new_tokens less what they
    produced; None when that leaves no budget."""
    done = [t for _, gen in pieces for t in gen.output_ids]
    left = sampling.max_new_tokens - len(done)
    if left <= 0:
        return None
    prompt = np.concatenate([np.asarray(ids, dtype=np.int32), np.asarray(done, dtype=np.int32)])
    return prompt, dataclasses.replace(sampling, max_new_tokens=left)


def splice(pieces: Sequence[Piece]) -> Generation:
    """The pieces as one generation. `version_spans` stays empty when every token comes from the first piece's
    version (the one stamped at dispatch)."""
    if len(pieces) == 1:
        return pieces[0][1]
    first, last = pieces[0][1], pieces[-1][1]
    spans: list[tuple[int, int]] = []
    start = 0
    for version, gen in pieces:
        if gen.output_ids and (not spans or spans[-1][1] != version):
            spans.append((start, version))
        start += len(gen.output_ids)
    if spans == [(0, pieces[0][0])]:
        spans = []
    return Generation(
        output_ids=[t for _, g in pieces for t in g.output_ids],
        logprobs=[lp for _, g in pieces for lp in g.logprobs],
        text="".join(g.text for _, g in pieces),
        finish_reason=last.finish_reason, matched_stop=last.matched_stop, prompt_tokens=first.prompt_tokens,
        weight_version=last.weight_version, version_spans=spans,
    )


class Resumer:
    def __init__(self, gate: WeightGate, router: EngineRouter, limit: SequenceLimit, max_resumes: int,
                 wait: float | None = None) -> None:
        self.gate, self.router, self.limit = gate, router, limit
        self.max_resumes = max_resumes  # 0: partial rollouts off
        # how long a resume waits for the update to end (its weights to load) before answering truncated
        self.wait = gate.drain_timeout if wait is None else wait

    def _next(self, ids: np.ndarray, pieces: list[Piece], cut: bool, sampling: SamplingParams) -> Request | None:
        if not cut or len(pieces) > self.max_resumes:
            return None
        return continuation(ids, pieces, sampling)

    def _answer(self, pieces: list[Piece], cut: bool) -> Generation:
        """The spliced answer, counted: resumed when it went on across an update, truncated when an update's
        cut ends it."""
        gen = splice(pieces)
        if len(pieces) > 1:
            self.gate.cut_calls["resumed"] += 1
        if cut:
            self.gate.cut_calls["truncated"] += 1
        return gen

    async def whole(self, session_id: str, ids: np.ndarray, sampling: SamplingParams, gen: Generation,
                    admission: Admission) -> Generation:
        """`gen`, served under `admission` (already released), resumed while an update cuts it."""
        pieces: list[Piece] = [(admission.version, gen)]
        cut = gen.finish_reason == "abort" and self.gate.cut_since(admission)
        while (request := self._next(ids, pieces, cut, sampling)) is not None:
            again = self.gate.admit(max_wait=self.wait)
            try:
                async with again as version:
                    engine = self.router.for_session(session_id)
                    async with self.limit.slot(session_id):
                        gen = await engine.generate(cast("list[int]", request[0]), request[1])
            except (EngineError, Paused) as exc:
                log.warning("session %s: resuming a generation cut by a weight update failed; answered "
                            "truncated: %s", session_id, exc)
                break
            pieces.append((version, gen))
            cut = gen.finish_reason == "abort" and self.gate.cut_since(again)
        return self._answer(pieces, cut)

    async def stream(self, session_id: str, ids: np.ndarray, sampling: SamplingParams,
                     first: AsyncIterator[StreamDelta], admission: Admission) -> AsyncIterator[StreamDelta]:
        """The deltas of `first` (served under one unit of `admission`) and of each resumed piece, as one stream:
        a cut piece's final chunk goes on without its `final`; the last chunk carries the spliced generation."""
        pieces: list[Piece] = []
        stream, held, unit = first, admission, True  # unit: the piece's unit of `held` is not released yet
        try:
            while True:
                final, body = None, StreamDelta([], [], "")
                async for delta in stream:
                    if delta.final is None:
                        yield delta
                    else:
                        final, body = delta.final, StreamDelta(delta.output_ids, delta.logprobs, delta.text)
                await aclose(stream)
                held.release()
                unit = False
                if final is None:
                    return  # the stream ended without a final chunk: the caller answers the error
                pieces.append((held.version, final))
                cut = final.finish_reason == "abort" and self.gate.cut_since(held)
                request = self._next(ids, pieces, cut, sampling)
                opened = None if request is None else await self._reopen(session_id, request)
                if opened is None:
                    body.final = self._answer(pieces, cut)
                    yield body
                    return
                (held, stream), unit = opened, True  # before the yield: a client gone there closes them
                yield body
        finally:
            await aclose(stream)
            if unit:
                held.release()

    async def _reopen(self, session_id: str, request: Request) -> tuple[Admission, AsyncIterator[StreamDelta]] | None:
        """A resumed piece's admission and stream, its first chunk received (None: it could not be admitted or
        served, and the answer ends truncated)."""
        again = self.gate.admit(max_wait=self.wait)
        stream = None
        try:
            await again.__aenter__()
            engine = self.router.for_session(session_id)
            stream = in_slot(self.limit, session_id, engine.stream(cast("list[int]", request[0]), request[1]))
            head = await anext(stream, None)
            if head is None:
                raise EngineError("the engine's stream ended without any output")
        except BaseException as exc:
            await aclose(stream)
            again.release()
            if not isinstance(exc, (EngineError, Paused)):
                raise
            log.warning("session %s: resuming a stream cut by a weight update failed; answered truncated: %s",
                        session_id, exc)
            return None
        return again, _chained(head, stream)


async def _chained(head: StreamDelta, rest: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    yield head
    try:
        async for delta in rest:
            yield delta
    finally:
        await aclose(rest)
