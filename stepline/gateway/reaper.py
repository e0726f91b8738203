"""The idle-session reaper: no session can block its group forever.

A session nobody ends (its harness crashed, or the gateway serving it was killed) would stay `open`,
and an open member keeps its whole group from being claimed. So:

- at start, the pool's open sessions created more than `session_idle_timeout` s ago end as
  `abandoned` (those a killed gateway left behind: nothing can reach them any more; with several
  gateways on one pool, keep the timeout above the longest episode);
- every min(timeout / 4, fork timeout / 4, 300) s, sessions of this gateway with no call running and none ended for
  `session_idle_timeout` s (forks: `fork_idle_timeout` s, much shorter: a fork nobody plays, one of thousands a
  harness opened, would otherwise hold its group as long as an episode may run) end as `abandoned` (through the recorder, after their queued calls; a later call gets 409), and so do
  the pool's open sessions that are not this gateway's and were created more than the timeout ago: the
  orphans of a gateway killed after this one started, or too recently for the sweep at start.
  A session with a call running is never idle: a call held long (a weight update that does not end, a client
  that stops reading its stream) keeps its session, and so its group, open until the call ends.

Sessions are also leased to the gateway that serves them (`session_lease`, 60 s by default): it leases each one
as it opens and renews the lease on all its open sessions, idle or not, every third of it (`Pool.renew_leases`).
A gateway killed with -9 stops renewing, and once a lease lapses the pool itself ends that session as `abandoned`
(`metadata.end_reason` says why) at its next claim or sweep, so a crashed gateway's groups are claimable within
about a minute even with no gateway left; a live session keeps its lease and follows `session_idle_timeout`.
A session the pool reports no longer open (its lease lapsed while the pool was out of reach) ends here too.

An abandoned session with a terminal reward still trains with its group; one without is left out.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from stepline.datapool.base import PoolError
from stepline.gateway.session_service import SessionService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """How long a session of this gateway may be idle (`session_idle_timeout`), and a fork (`fork_idle_timeout`)."""

    idle: float
    fork_idle: float


async def reap_once(service: SessionService, timeouts: Timeouts) -> int:
    """One sweep of this gateway's sessions; returns how many it ended."""
    idle = service.store.idle(timeouts.idle, timeouts.fork_idle)
    for session, exc in await service.end(idle, "abandoned"):  # e.g. ended meanwhile by another route
        log.warning("abandoning %s: %s", session.info.session_id, exc)
    if idle:
        log.info("abandoned %d sessions idle for more than %g s (forks: %g s)", len(idle), timeouts.idle,
                 timeouts.fork_idle)
    return len(idle)


async def abandon_orphans(service: SessionService, timeout: float) -> None:
    """End as abandoned the pool's open sessions older than the timeout that this gateway does not serve."""
    try:
        await service.abandon_orphans(timeout)
    except PoolError as exc:  # a read-only pool, say: nothing to sweep
        log.warning("abandoning the pool's orphaned sessions: %s", exc)


async def renew_leases(service: SessionService) -> None:
    """Renew the lease on every open session of this gateway every third of the lease, until cancelled."""
    while True:
        await asyncio.sleep(service.lease / 3)
        try:
            await service.renew_leases()
        except Exception:  # noqa: BLE001 - the pool is down: the recorder retries; renew again later
            log.exception("renewing the session leases failed")


async def run(service: SessionService, timeouts: Timeouts) -> None:
    """Lease renewal, and the pool's orphans at start, then this gateway's idle sessions and the pool's orphans
    periodically, until cancelled."""
    await asyncio.gather(renew_leases(service), _sweep(service, timeouts))


async def _sweep(service: SessionService, timeouts: Timeouts) -> None:
    await abandon_orphans(service, timeouts.idle)
    interval = min(timeouts.idle / 4, timeouts.fork_idle / 4, 300.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await reap_once(service, timeouts)
            await abandon_orphans(service, timeouts.idle)
        except Exception:  # noqa: BLE001 - the pool is down: the recorder retries; sweep again later
            log.exception("idle-session sweep failed")
