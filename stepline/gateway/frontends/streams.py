"""Engine streams plumbing shared by dispatch and resumption: a session's sequence slot held for a stream's
life, n choice streams merged as their chunks arrive, and closing an async iterator that may not be a generator.

    in_slot(limit, session_id, stream)   the stream once a sequence slot of the session is free
    indexed(stream)                      (0, delta) for one choice
    merge(streams)                       (choice index, delta) of n streams; the first failure ends them all
    aclose(stream)                       close it if it can be closed
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from stepline.gateway.engines import StreamDelta
from stepline.gateway.fairness import SequenceLimit

__all__ = ["aclose", "in_slot", "indexed", "merge"]


async def in_slot(limit: SequenceLimit, session_id: str,
                  stream: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    """`stream` once a sequence slot of the session is free, holding the slot until it ends."""
    async with limit.slot(session_id):
        try:
            async for delta in stream:
                yield delta
        finally:
            await aclose(stream)


async def indexed(stream: AsyncIterator[StreamDelta]) -> AsyncIterator[tuple[int, StreamDelta]]:
    try:
        async for delta in stream:
            yield 0, delta
    finally:
        await aclose(stream)


async def merge(streams: list[AsyncIterator[StreamDelta]]) -> AsyncIterator[tuple[int, StreamDelta]]:
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
            await aclose(stream)


async def aclose(stream: Any) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
