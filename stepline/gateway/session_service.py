"""The sessions service: a session's life in the pool, shared by the session routes and the idle-session reaper.

    SessionService(store, recorder, router, lease)
        open(session)                      commit a new session to the pool, leased to this gateway, then make it
                                           callable
        renew_leases()                     lease every open session of this gateway for `lease` s more; end here
                                           those the pool no longer holds open
        end(sessions, status)              end them here (no new call gets in), then in the pool, then let the
                                           router forget them; returns the pool's refusals
        abandon_orphans(idle_seconds)      end the pool's open sessions this gateway does not serve
        add_reward(reward), calls_before(session_id, call)

Every write goes through the recorder, so it is ordered after the calls queued before it and answers
once the pool has committed it.
"""

from __future__ import annotations

import logging

from stepline.datapool.base import PoolError
from stepline.datapool.records import CallRecord, Reward
from stepline.gateway.fleet import EngineRouter
from stepline.gateway.forks import recorded_prefix
from stepline.gateway.recorder import Recorder
from stepline.gateway.sessions import Session, SessionStore

__all__ = ["SessionService"]

log = logging.getLogger(__name__)


class SessionService:
    def __init__(self, store: SessionStore, recorder: Recorder, router: EngineRouter, lease: float = 60.0) -> None:
        self.store = store
        self.recorder = recorder
        self.router = router
        self.lease = lease  # seconds each renewal leases this gateway's sessions for (`session_lease`)

    async def open(self, session: Session) -> None:
        """Commit a new session to the pool (a `PoolError` when it refuses) and lease it from its first moment
        (a crash right after frees it too), then make it callable."""
        await self.recorder.create_session(session.info)
        await self._lease([session.info.session_id])
        self.store.add(session)

    async def renew_leases(self) -> None:
        """Lease every open session of this gateway for `lease` s from now (stepline/gateway/reaper.py)."""
        await self._lease(self.store.open_ids())

    async def _lease(self, session_ids: list[str]) -> None:
        """Those the pool no longer holds open (a lease that lapsed while it was out of reach) end here too, so a
        later call gets 409."""
        seconds = self.lease
        gone = await self.recorder.read(lambda pool: pool.renew_leases(session_ids, seconds))
        for sid in gone:
            session = self.store.get(sid)
            if session is not None and not session.ended:
                log.warning("session %s was ended by the pool (its lease lapsed): ended here too", sid)
                self.store.end(session)
                self.router.forget(sid)

    async def end(self, sessions: list[Session], status: str) -> list[tuple[Session, PoolError]]:
        """End `sessions` as `status`: all of them here before the first await (a call arriving meanwhile gets
        409, not half a record), then each in the pool, after its queued calls. Returns the ones the pool
        refused (ended meanwhile by another route, say), with its error; the router forgets them all."""
        for session in sessions:
            self.store.end(session)
        refused: list[tuple[Session, PoolError]] = []
        for session in sessions:
            try:
                await self.recorder.end_session(session.info.session_id, status)
            except PoolError as exc:
                refused.append((session, exc))
            finally:
                self.router.forget(session.info.session_id)
        return refused

    async def abandon_orphans(self, idle_seconds: float) -> None:
        """End as abandoned the pool's open sessions older than `idle_seconds` that this gateway does not serve."""
        await self.recorder.abandon_idle(idle_seconds, keep=self.store.open_ids())

    async def add_reward(self, reward: Reward) -> None:
        await self.recorder.add_reward(reward)

    async def calls_before(self, session_id: str, call: int) -> list[CallRecord]:
        """The recorded calls a fork of `session_id` at `call` replays (after every call queued before)."""
        return await self.recorder.read(lambda pool: recorded_prefix(pool, session_id, call))
