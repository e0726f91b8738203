"""Rollouts in a background thread, paced against the trainer through the pool.

The driver runs batches of `batch_groups` groups, one after another, and starts a new batch only while
fewer than `ahead` batches' worth of finished groups wait unclaimed in the pool: with ahead=1 the next
batch is rolled out while the trainer updates on the previous one (one-step off-policy; the trainer's
staleness bound checks it). After `max_batches` batches it stops; the trainer then goes idle and ends,
so a job whose groups never vary (nothing to learn from) still finishes. With `peers` drivers sharing one
pool (`stepline run --ray`: one per rollout worker), each counts its share (1/peers) of the groups taken.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stepline.datapool.base import Pool
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import RolloutConfig
from stepline.rollout.driver import RolloutDriver

__all__ = ["BackgroundRollouts", "Pacing"]


@dataclass(frozen=True)
class Pacing:
    """How far the rollouts may run ahead of the trainer (the module docstring)."""

    batch_groups: int  # groups per batch
    ahead: int  # finished batches that may wait unclaimed in the pool
    max_batches: int | None = None  # then the driver stops (None: until stopped)
    peers: int = 1  # drivers sharing the pool, each counting 1/peers of its taken groups


class BackgroundRollouts:
    def __init__(self, config: RolloutConfig, gateway_url: str, admin_token: str, work_dir: Path, pool: Pool,
                 pacing: Pacing, metadata: dict[str, Any] | None = None) -> None:
        self.config, self.gateway_url, self.admin_token = config, gateway_url, admin_token
        self.work_dir, self.pool = Path(work_dir), pool
        self.batch_groups, self.ahead, self.max_batches = pacing.batch_groups, pacing.ahead, pacing.max_batches
        self.peers = pacing.peers  # lowered by set_peers when a peer is lost
        self.metadata = dict(metadata or {})  # into every session's metadata (e.g. which rollout worker)
        self.driver: RolloutDriver | None = None
        self.history: list[dict[str, Any]] = []  # one row per finished episode, with its time
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._halt: asyncio.Event | None = None  # the driver's stop signal, set from stop()
        self._thread = threading.Thread(target=self._main, name="rollouts", daemon=True)
        self._started = time.time()
        self._baseline = 0  # groups the pool had taken before this run (a resumed job)

    def start(self) -> None:
        self._baseline = self._taken()
        self._thread.start()

    def stop(self, timeout: float = 120.0) -> None:
        """Start no new group; let the running episodes end properly (rewarded, ended), then return."""
        self._stop.set()
        if self._loop is not None and self._halt is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._halt.set)
            except RuntimeError:  # the loop closed between the check and the call: the driver is done
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def set_peers(self, peers: int) -> None:
        """Fewer drivers share the pool now (one was lost): count a larger share of the groups taken."""
        self.peers = max(1, peers)

    def running(self) -> bool:
        """True from start() until the driver has delivered its last batch (or failed, or was stopped)."""
        return self._thread.is_alive()

    def summary(self) -> dict[str, dict[str, float]]:
        return self.driver.summary() if self.driver else {}

    def _taken(self) -> int:
        stats = self.pool.stats()
        return stats["groups_claimed"] + stats["groups_consumed"] + stats["groups_stale"]

    def _main(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as exc:  # reported by the runner; the trainer stops on idle
            self.error = exc
            raise

    async def _produce(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._loop, self._halt = asyncio.get_running_loop(), asyncio.Event()
        async with GatewayClient(self.gateway_url, self.admin_token) as gateway:
            self.driver = RolloutDriver(self.config, gateway, self.work_dir)
            try:
                await self._batches()
            finally:
                await self.driver.close()  # the long-lived harness workers end with the rollouts

    async def _batches(self) -> None:
        assert self.driver is not None
        batches = 0
        while not self._stop.is_set() and (self.max_batches is None or batches < self.max_batches):
            taken = (await asyncio.to_thread(self._taken) - self._baseline) / self.peers
            waiting = batches * self.batch_groups - taken
            if waiting >= self.ahead * self.batch_groups:
                await asyncio.sleep(0.2)
                continue
            seen = len(self.driver.results)
            await self.driver.run(self.batch_groups, stop=self._halt, metadata=self.metadata)
            batches += 1
            now = time.time() - self._started
            self.history += [{**asdict(r), "t": now, "batch": batches} for r in self.driver.results[seen:]]
