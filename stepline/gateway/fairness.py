"""Fair service across sessions: at most `limit` engine sequences of one session in the engines at once.

    SequenceLimit(limit)
        slot(session_id)      async context: one engine sequence (one choice of one prompt) of that session;
                              waits, first come first served, while the session already has `limit` running
        running(session_id)   sequences of the session in the engines now

A request counts one sequence per engine request it makes: `n` choices, a Completions batch of k prompts
with `n` each counts k x n. Sequences beyond the limit wait in the gateway (costing a coroutine, not an
engine slot) and start as the session's earlier ones finish, so one session's burst can hold at most
`limit` of the engines' batch slots and every other session's calls go in beside it. A single request larger
than the limit is split the same way, not refused: vLLM and SGLang queue sequences beyond their own
`max_num_seqs` / `max_running_requests` rather than fail them, and a harness that sends a legal request
(within `max_n`, `max_prompts`, `max_engine_requests`) expects an answer, later if the session is busy.

The wait happens inside the call's weight-gate admission (stepline.gateway.fleet), so all the choices of a call
are served by the weight version stamped on it. `limit` 0: no limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

__all__ = ["SequenceLimit"]


@dataclass
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # sequences running or waiting: the share is dropped when none is left
    running: int = 0


@dataclass
class SequenceLimit:
    limit: int  # engine sequences one session may have running at once (0: no limit)
    _shares: dict[str, _Share] = field(default_factory=dict)

    @asynccontextmanager
    async def slot(self, session_id: str) -> AsyncIterator[None]:
        if not self.limit:
            yield
            return
        share = self._shares.get(session_id)
        if share is None:
            share = self._shares[session_id] = _Share(asyncio.Semaphore(self.limit))
        share.users += 1
        try:
            async with share.slots:  # asyncio's semaphore wakes its waiters in arrival order
                share.running += 1
                try:
                    yield
                finally:
                    share.running -= 1
        finally:
            share.users -= 1
            if not share.users:
                del self._shares[session_id]

    def running(self, session_id: str) -> int:
        share = self._shares.get(session_id)
        return share.running if share is not None else 0
