"""The idle-session reaper: no session can block its group forever.

A session nobody ends (its harness crashed, or the gateway serving it was killed) would stay `open`,
and an open member keeps its whole group from being claimed. So:

- at start, the pool's open sessions created more than `session_idle_timeout` s ago end as
  `abandoned` (those a killed gateway left behind: nothing can reach them any more; with several
  gateways on one pool, keep the timeout above the longest episode);
- every min(timeout / 4, 300) s, sessions of this gateway with no call running and none ended for `session_idle_timeout` s
  end as `abandoned` (through the recorder, after their queued calls; a later call gets 409), and so do
  the pool's open sessions that are not this gateway's and were created more than the timeout ago: the
  orphans of a gateway killed after this one started, or too recently for the sweep at start.
  A session with a call running is never idle: a call held long (a weight update that does not end, a client
  that stops reading its stream) keeps its session, and so its group, open until the call ends.

An abandoned session with a terminal reward still trains with its group; one without is left out.
"""

from __future__ import annotations

import asyncio
import logging

from stepline.datapool.base import PoolError
from stepline.gateway.frontends.pipeline import Core

log = logging.getLogger(__name__)


async def reap_once(core: Core) -> int:
    """One sweep of this gateway's sessions; returns how many it ended."""
    timeout = core.settings.session_idle_timeout
    idle = core.sessions.idle(timeout)
    for session in idle:  # all ended before the first await: a call arriving meanwhile gets 409, not half a record
        core.sessions.end(session)
    for session in idle:
        try:
            await core.recorder.end_session(session.info.session_id, "abandoned")
        except PoolError as exc:  # e.g. it was ended meanwhile by another route: logged, the sweep goes on
            log.warning("abandoning %s: %s", session.info.session_id, exc)
        core.router.forget(session.info.session_id)
    if idle:
        log.info("abandoned %d sessions idle for more than %g s", len(idle), timeout)
    return len(idle)


async def abandon_orphans(core: Core) -> None:
    """End as abandoned the pool's open sessions older than the timeout that this gateway does not serve."""
    try:
        await core.recorder.abandon_idle(core.settings.session_idle_timeout, keep=core.sessions.open_ids())
    except PoolError as exc:  # a read-only pool, say: nothing to sweep
        log.warning("abandoning the pool's orphaned sessions: %s", exc)


async def run(core: Core) -> None:
    """The pool's orphans at start, then this gateway's idle sessions and the pool's orphans periodically,
    until cancelled."""
    await abandon_orphans(core)
    interval = min(core.settings.session_idle_timeout / 4, 300.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await reap_once(core)
            await abandon_orphans(core)
        except Exception:  # noqa: BLE001 - the pool is down: the recorder retries; sweep again later
            log.exception("idle-session sweep failed")
