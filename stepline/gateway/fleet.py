"""The engines behind the gateway: which one serves a session (the router) and under which weight
version (the weight gate), and swapping the weights of all of them safely.

## The router

Session-sticky routing over several engines, with background health checks.

A session is assigned an engine on its first call (crc32 of the id over the healthy engines) and
keeps it, so its growing prefix stays in that engine's cache. When an engine fails its health check
(or a call finds it unreachable), new sessions go elsewhere, and sessions assigned to it move to a
healthy one on their next call: a dead engine cannot serve them, and their cache there is gone anyway.
An engine that answers again (restarted, perhaps on the base weights) is first handed to `on_recovery`:
the weight gate loads the weights the gateway serves now into it, so every call stays stamped truly.

## The weight gate

`WeightGate.admit` stamps each call at dispatch with the weight version serving it. An update, in order:
1. closes admission: new calls are held (up to `max_wait` s, then `Paused`: the app answers 503 with
   Retry-After) and go on once the update is done, under the new version;
2. gives in-flight calls `grace` s to finish on the old weights;
3. has the engines cut short the calls still running: each engine's pause (SGLang's and the built-in
   engine's default mode, and the vLLM adapter's, is `abort`) ends its running requests now, with the
   tokens sampled so far and finish_reason "abort", then resumes at once. Their tokens all come from the
   old weights, so the version stamped at dispatch stays true; a request still on its way to the engine
   is served and cut short in the next round, once a second, until no call is in flight. With partial
   rollouts (stepline/gateway/frontends/resume.py) the dispatcher knows such a call by `cut_since`, releases
   its admission and is admitted again, waiting for the new version, to go on from the tokens it has;
4. asks every engine in rotation to pause, load the checkpoint and resume, then bumps the version and
   reopens. An engine that is down misses the update; when it answers again, the router hands it to
   `resync` first, which loads the current checkpoint into it (unless it already serves that version). The
   checkpoint may be a delta (stepline.weightdelta: only the tensors changed since its anchor); an engine that
   lacks its base is given the anchor first (`load_into`).
So a long stream delays an update by `grace` s at most, and never fails a call that arrives during it.
If any engine fails to load, the engines that did load it are moved back to the previous checkpoint
(when it is known), the old version keeps serving, and the error is raised to the caller.

Exceptions: `Paused` (admission timed out during an update), `UpdateRefused` (a bad request:
version not increasing, another update running), `engines.EngineError` (an engine failed to load).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

from stepline.gateway.engines import EngineClient, EngineError, EngineRejected, EngineUnavailable
from stepline.weightdelta import read_manifest

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



class Paused(Exception):
    """New calls are paused for a weight update; retry after `retry_after` s."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"weights are being updated; retry after {retry_after:g} s")
        self.retry_after = retry_after


class UpdateRefused(Exception):
    """The update request itself is unacceptable (answered 409)."""


class Admission:
    """`async with gate.admit(units) as version:` counts `units` engine requests in flight until each is
    `release`d or the block exits; `mark` is the gate's abort rounds at entry (`WeightGate.cut_since`)."""

    __slots__ = ("gate", "held", "mark", "max_wait", "units", "version")

    def __init__(self, gate: WeightGate, units: int, max_wait: float) -> None:
        self.gate, self.units, self.max_wait = gate, units, max_wait
        self.held = 0
        self.mark = gate.cuts
        self.version = gate.version  # the version stamped at entry

    async def __aenter__(self) -> int:
        gate = self.gate
        while not gate._open.is_set():
            try:
                await asyncio.wait_for(gate._open.wait(), self.max_wait)
            except TimeoutError:
                raise Paused(gate.retry_after) from None
        gate.in_flight += self.units
        gate._drained.clear()
        self.held, self.mark, self.version = self.units, gate.cuts, gate.version
        return gate.version

    def release(self) -> None:
        """One of the units is done (its engine request ended): it no longer holds up an update."""
        if self.held:
            self.held -= 1
            self.gate._leave(1)

    async def __aexit__(self, *exc: object) -> None:
        held, self.held = self.held, 0
        self.gate._leave(held)


class WeightGate:
    def __init__(
        self,
        router: EngineRouter,
        max_wait: float = 5.0,
        initial_version: int = 0,
        initial_path: str | None = None,
        drain_timeout: float = 600.0,
        grace: float = 5.0,
    ) -> None:
        self.router = router
        self.max_wait = max_wait  # how long a new call waits for an update before Paused
        self.retry_after = max(1.0, max_wait)
        self.grace = grace  # how long in-flight calls may run on into an update before the engines end them
        self.drain_timeout = drain_timeout  # longest wait for in-flight calls before giving up the update
        self.version = initial_version
        self.path = initial_path  # checkpoint the engines serve now (for rolling back a partial update)
        self.in_flight = 0
        self.updating = False
        self.last_error: str | None = None
        self.updates: Counter[str] = Counter()  # weight updates by result: ok | failed (the app's metrics)
        self.cuts = 0  # rounds of abort so far (step 3): a call that ends "abort" after one was cut by an update
        # calls an update cut, by how they were answered: resumed (under the new weights, at least once) |
        # truncated (with the tokens sampled so far); counted by the dispatcher, read by the app's metrics
        self.cut_calls: Counter[str] = Counter()
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._swap = asyncio.Lock()  # an update and an engine's catch-up (resync) never interleave
        router.on_recovery = self.resync

    def admit(self, units: int = 1, max_wait: float | None = None) -> Admission:
        """Waits while an update runs (<= max_wait, default the gate's, then raises Paused); yields the version
        stamped at dispatch; counts `units` engine requests (a call's choices) in flight until each is released
        or the block exits."""
        return Admission(self, units, self.max_wait if max_wait is None else max_wait)

    def cut_since(self, admission: Admission) -> bool:
        """Whether a round of abort ran since `admission` entered: its engine request ending "abort" was cut by
        an update (not by a client that went away, nor by the engine for a reason of its own)."""
        return self.cuts != admission.mark

    def _leave(self, units: int) -> None:
        self.in_flight -= units
        if self.in_flight == 0:
            self._drained.set()

    async def update_weights(self, path: str, version: int) -> int:
        """Pause new calls, drain in-flight ones, update every engine, bump the version, resume."""
        if self.updating:
            raise UpdateRefused("another weight update is running")
        if version <= self.version:
            raise UpdateRefused(f"version {version} is not newer than the serving version {self.version}")
        self.updating = True
        self._open.clear()
        try:
            async with self._swap:
                await self._drain()
                await self._update_all(path, version)
        except Exception as exc:
            self.last_error = str(exc)
            self.updates["failed"] += 1
            log.error(
                "weight update to version %d (%s) failed; version %d keeps serving: %s",
                version,
                path,
                self.version,
                exc,
            )
            raise
        finally:
            self.updating = False
            self._open.set()
        self.version, self.path, self.last_error = version, path, None
        self.updates["ok"] += 1
        log.info("weights updated to version %d from %s", version, path)
        return version

    async def resync(self, client: EngineClient) -> None:
        """Bring an engine that was down (out of rotation, so it missed any update meanwhile) to the weights
        this gateway serves now, unless it already reports that version."""
        async with self._swap:
            if self.path is None:
                return  # version 0 from the engine's own start: nothing was loaded since
            info = await client.info()
            if info.weight_version == str(self.version):
                return
            log.warning("engine %s came back on %s: loading version %d from %s", client.url,
                        info.weight_version, self.version, self.path)
            await load_into(client, self.path, self.version)

    async def _drain(self) -> None:
        """Steps 2 and 3 of the module docstring: the grace, then rounds of abort until nothing is in flight."""
        if await self._drained_within(self.grace):
            return
        clients = self.router.live()
        deadline = asyncio.get_running_loop().time() + self.drain_timeout
        while True:
            log.info("weight update: %d calls still running after the grace; the engines end them", self.in_flight)
            self.cuts += 1
            try:
                await asyncio.gather(*(c.pause() for c in clients))
            finally:
                await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)
            if await self._drained_within(1.0):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(
                    f"{self.in_flight} calls still running after {self.drain_timeout:g} s; update abandoned"
                )

    async def _drained_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._drained.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _update_all(self, path: str, version: int) -> None:
        """Every engine in rotation loads the checkpoint; one that is down gets it when it comes back (resync)."""
        clients = self.router.live()
        if not clients:
            raise EngineError("no healthy engine to load the weights into")
        await asyncio.gather(*(c.pause() for c in clients))
        try:
            results = await asyncio.gather(*(c.update_weights(path, version) for c in clients), return_exceptions=True)
            failed = [(c, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
            if failed:
                await self._roll_back([c for c, r in zip(clients, results) if not isinstance(r, BaseException)])
                detail = "; ".join(f"{c.url}: {r}" for c, r in failed)
                # every engine refused the checkpoint itself (a 4xx: no such folder, tensors that do not fit):
                # the caller's mistake, answered 400, not an engine failure
                kind = EngineRejected if all(isinstance(r, EngineRejected) for _, r in failed) else EngineError
                raise kind(f"weight update failed on {len(failed)} of {len(clients)} engines: {detail}")
        finally:
            await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)

    async def _roll_back(self, updated: list[EngineClient]) -> None:
        if not updated:
            return
        if self.path is None:
            log.error(
                "engines %s loaded the new weights but the previous checkpoint is unknown: they serve "
                "newer weights than version %d until the next update",
                [c.url for c in updated],
                self.version,
            )
            return
        path = self.path
        results = await asyncio.gather(*(load_into(c, path, self.version) for c in updated), return_exceptions=True)
        for client, result in zip(updated, results):
            if isinstance(result, BaseException):
                log.error("rolling %s back to %s failed: %s", client.url, self.path, result)


async def load_into(client: EngineClient, path: str, version: int) -> None:
    """Load `path` into one engine. A delta (stepline.weightdelta) it lacks the base of (it restarted on the
    model folder after a full push, or is rolled back from a later delta) is preceded by the delta's anchor,
    the full folder it was taken against."""
    try:
        await client.update_weights(path, version)
    except EngineRejected:
        delta = read_manifest(path)
        if delta is None:
            raise
        log.info("engine %s lacks the base of %s: loading its anchor %s first", client.url, path, delta.anchor)
        await client.update_weights(delta.anchor, delta.anchor_version)
        await client.update_weights(path, version)
