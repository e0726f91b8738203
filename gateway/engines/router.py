"""Session-sticky routing over several engines, with background health checks.

A session is assigned an engine on its first call (crc32 of the id over the healthy engines) and
keeps it, so its growing prefix stays in that engine's cache. When an engine fails its health check
(or a call finds it unreachable), new sessions go elsewhere, and sessions assigned to it move to a
healthy one on their next call: a dead engine cannot serve them, and their cache there is gone anyway.
An engine that answers again (restarted, perhaps on the base weights) is first handed to `on_recovery`:
the weight gate loads the weights the gateway serves now into it, so every call stays stamped truly.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gateway.engines.base import EngineClient, EngineUnavailable

log = logging.getLogger(__name__)


class EngineRouter:
    def __init__(
        self, clients: list[EngineClient], health_interval: float = 2.0, max_sessions: int = 1_000_000
    ) -> None:
        if not clients:
            raise ValueError("EngineRouter needs at least one engine")
        self.clients = list(clients)
        self.health_interval = health_interval
        self.max_sessions = max_sessions  # assignment table bound: the oldest sessions are forgotten first
        self.healthy: dict[str, bool] = {c.url: True for c in self.clients}  # optimistic until checked
        self._assigned: OrderedDict[str, EngineClient] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        # awaited before an engine that was down goes back into rotation (set by the weight gate)
        self.on_recovery: Callable[[EngineClient], Awaitable[None]] | None = None

    def for_session(self, session_id: str) -> EngineClient:
        """The engine serving this session; raises EngineUnavailable when every engine is down."""
        client = self._assigned.get(session_id)
        if client is not None and self.healthy[client.url]:
            return client
        live = [c for c in self.clients if self.healthy[c.url]]
        if not live:
            raise EngineUnavailable("no healthy engine", retry_after=self.health_interval)
        client = live[zlib.crc32(session_id.encode()) % len(live)]
        self._assigned[session_id] = client
        if len(self._assigned) > self.max_sessions:
            self._assigned.popitem(last=False)
        return client

    def forget(self, session_id: str) -> None:
        """Drop a finished session's assignment."""
        self._assigned.pop(session_id, None)

    def mark_unhealthy(self, client: EngineClient) -> None:
        """A call found the engine unreachable: route around it until a health check passes again."""
        if self.healthy.get(client.url):
            log.warning("engine %s marked unhealthy after a failed call", client.url)
        self.healthy[client.url] = False

    async def check_health(self) -> None:
        """Ask every engine; one that answers again after being down is first brought up to date by
        `on_recovery` (the weight gate loads the weights it serves now) and stays down while that fails."""
        results = await asyncio.gather(*(c.health() for c in self.clients))
        for client, ok in zip(self.clients, results):
            if ok and not self.healthy[client.url] and self.on_recovery is not None:
                try:
                    await self.on_recovery(client)
                except Exception as exc:  # noqa: BLE001  (any failure keeps it out of rotation; logged, retried)
                    log.warning("engine %s answers again but could not be brought up to date: %s", client.url, exc)
                    ok = False
            if ok != self.healthy[client.url]:
                log.warning("engine %s is %s", client.url, "healthy again" if ok else "DOWN")
            self.healthy[client.url] = ok

    def live(self) -> list[EngineClient]:
        """The engines in rotation now."""
        return [c for c in self.clients if self.healthy[c.url]]

    async def start(self) -> None:
        if self._task is not None:  # already running
            return
        await self.check_health()
        self._task = asyncio.create_task(self._loop(), name="engine-health")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_health()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
