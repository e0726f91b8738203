"""The sessions service: a session's life in the pool, shared by the session routes and the idle-session reaper.

    SessionService(store, recorder, router)
        open(session)                      commit a new session to the pool, then make it callable
        end(sessions, status)              end them here (no new call gets in), then in the pool, then let the
                                           router forget them; returns the pool's refusals
        abandon_orphans(idle_seconds)      end the pool's open sessions this gateway does not serve
        add_reward(reward), calls_before(session_id, call)

Every write goes through the recorder, so it is ordered after the calls queued before it and answers
once the pool has committed it.
"""

from __future__ import annotations

from stepline.datapool.base import PoolError
from stepline.datapool.records import CallRecord, Reward
from stepline.gateway.fleet import EngineRouter
from stepline.gateway.forks import recorded_prefix
from stepline.gateway.recorder import Recorder
from stepline.gateway.sessions import Session, SessionStore

__all__ = ["SessionService"]


class SessionService:
    def __init__(self, store: SessionStore, recorder: Recorder, router: EngineRouter) -> None:
        self.store = store
        self.recorder = recorder
        self.router = router

    async def open(self, session: Session) -> None:
        """Commit a new session to the pool (a `PoolError` when it refuses), then make it callable."""
        await self.recorder.create_session(session.info)
        self.store.add(session)

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
