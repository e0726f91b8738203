"""Commit: what a finished call leaves behind, its records, its memory of turns and its metrics.

    Ledger(recorder, metrics)
        commit(ex, choices, answer, remember)   one CallRecord per choice to the recorder (never waiting on
                                                the pool), each choice remembered as a turn (TITO)
        durable()                               waits until the request's records are in the pool or spill file
        observe(ex, stream, gens)               counts the finished call (stepline.gateway.metrics)

With a spill file, `record_call` hands back a future per record (`UNSYNCED`, set by the model route,
stepline.gateway.frontends.routes); an answer waits on `durable()` before its last bytes, so that nothing
acknowledged is lost to a crash (stepline.gateway.spill).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import orjson

from stepline.datapool.records import CallRecord
from stepline.gateway.engines import Generation, SamplingParams
from stepline.gateway.forks import Replayed
from stepline.gateway.frontends.exchange import Choice, Exchange
from stepline.gateway.metrics import GatewayMetrics
from stepline.gateway.recorder import Delta, Recorder
from stepline.gateway.sessions import LastRequest, Prompt

__all__ = ["UNSYNCED", "Ledger", "Remember", "sampling_dict"]

# the durability futures of the calls recorded by the request being handled (set by the model route)
UNSYNCED: contextvars.ContextVar[list[Future[None]]] = contextvars.ContextVar("unsynced")

Remember = Callable[[Exchange, Choice], None]  # keeps a committed choice as a turn the next call can extend


class Ledger:
    def __init__(self, recorder: Recorder, metrics: GatewayMetrics) -> None:
        self.recorder = recorder
        self.metrics = metrics

    def commit(self, ex: Exchange, choices: list[Choice], answer: dict, remember: Remember) -> None:
        """One record per choice, and each choice remembered as a turn the next call can extend; the request body
        is kept as the session's latest (a later turn that extends one of these calls sends only what it adds)."""
        last = ex.session.last_request
        for choice in choices:
            choice.call_index = self.record(ex, choice.index, choice.generation, answer, last)
            remember(ex, choice)
        recorded = tuple(c.call_index for c in choices if not isinstance(c.generation, Replayed))
        if recorded:
            ex.session.last_request = (recorded, ex.raw)

    def record(self, ex: Exchange, choice: int, gen: Generation, answer: dict,
               last_request: LastRequest | None = None) -> int:
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
            version_spans=gen.version_spans,
        )
        done = self.recorder.record_call(record, compress=True, delta=delta_of(ex.prompt, last_request))
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


def delta_of(prompt: Prompt, last_request: LastRequest | None) -> Delta | None:
    """How a prompt that begins with a recorded call's prompt + output extends that call (its record carries only
    what it adds; docs/architecture.md, "Recording a turn as a delta"); None for a prompt rendered afresh. The
    request body goes as a delta too where the session still holds the parent's (that of its latest request)."""
    base = prompt.base
    if base is None or base.call < 0 or base.recorded == 0:
        return None
    body = last_request[1] if last_request is not None and base.call in last_request[0] else None
    return Delta(base.call, min(base.recorded, prompt.reused), body)


def sampling_dict(s: SamplingParams) -> dict[str, Any]:
    """The sampling parameters for the record (by hand: dataclasses.asdict deep-copies, on the hot path)."""
    return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "stop": s.stop, "stop_token_ids": s.stop_token_ids, "seed": s.seed, "ignore_eos": s.ignore_eos}
