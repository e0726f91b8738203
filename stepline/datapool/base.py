"""The pool interface that the embedded pool (SQLite / PostgreSQL) and the HTTP client both implement.

The gateway writes through it (sessions, calls, rewards, ends); the trainer reads through it
(claim ready groups, mark them consumed). `datapool.open_pool(url)` returns the right implementation:
`sqlite:///path.db`, `postgresql://…`, or `http://host:port` (the pool service).

Exceptions (all subclasses of `PoolError`):

    PoolError
    ├── InvalidRecord      a record contradicts itself or refers to something unknown (nothing written)
    ├── UnknownSession     no such session
    ├── ReadOnlyPool       a write to a pool opened read-only
    ├── PoolCorrupt        the database is damaged (garbage pages, not a database): permanent, never retried
    └── PoolFull           the database's disk is full: nothing written; retried by writers that must keep
                           their records (`is_unavailable`), answered at once to the others

Not errors of the records but of the moment (`is_unavailable`): the pool service unreachable
(`client.PoolUnavailable`, a ConnectionError), the database locked, out of disk (`PoolFull`), its connection lost.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Sequence
from typing import Protocol

from stepline.datapool.records import CallRecord, EpisodeData, Group, LeafRule, Reward, SessionInfo, SessionTree


class PoolError(Exception):
    """Base class of the pool's errors."""


class InvalidRecord(PoolError):
    """A record contradicts itself (e.g. logprob count != output length) or refers to something unknown."""


class UnknownSession(PoolError):
    """The session id is not in the pool."""


class ReadOnlyPool(PoolError):
    """A write was attempted on a pool opened read-only."""


class PoolCorrupt(PoolError):
    """The database is damaged: every operation on it fails the same way until it is restored or repaired."""


class PoolFull(PoolError):
    """The database's disk (or its size limit) is full: nothing was written."""


def is_unavailable(exc: BaseException) -> bool:
    """True when a pool failed for now and the same write may succeed later: unreachable, the database
    locked, out of disk or its connection lost. Anything else a pool raises is a refusal (`PoolError`)
    or a bug, and retrying it would only hide it."""
    if isinstance(exc, PoolFull | ConnectionError | TimeoutError | sqlite3.OperationalError):
        return True
    psycopg = sys.modules.get("psycopg")  # imported by the PostgreSQL pool, only where one is used
    return psycopg is not None and isinstance(exc, psycopg.OperationalError)


class Pool(Protocol):
    # --- writes (gateway, rollout driver, evaluators) ---
    def create_session(self, info: SessionInfo) -> None: ...
    def add_calls(self, records: list[CallRecord]) -> None:
        """Insert a batch atomically: each call extends its session's tree (cost ∝ new tokens)."""
    def add_reward(self, reward: Reward) -> None: ...
    def end_session(self, session_id: str, status: str = "completed") -> None: ...
    def abandon_idle(self, idle_seconds: float, keep: Sequence[str] = ()) -> int:
        """End as `abandoned` the open sessions created more than idle_seconds ago and not leased, except those
        in `keep` (the caller's own, still live), and those whose lease lapsed; returns how many."""
    def renew_leases(self, session_ids: Sequence[str], seconds: float) -> list[str]:
        """Lease open sessions to the caller for `seconds` from now (a lapsed lease ends its session as
        `abandoned` at the next claim or sweep); returns those of the ids no longer open."""

    # --- reads ---
    def get_session(self, session_id: str) -> SessionInfo: ...
    def list_sessions(self, status: str | None = None) -> list[SessionInfo]: ...
    def get_tree(self, session_id: str) -> SessionTree: ...
    def get_calls(self, session_id: str) -> list[CallRecord]:
        """The session's calls as the gateway recorded them (full prompts rebuilt), in insertion order."""
    def get_episode(self, session_id: str, leaf_rule: LeafRule = "drop_superseded") -> EpisodeData: ...
    def stats(self) -> dict[str, int]: ...

    # --- the trainer's side ---
    def claim_groups(
        self,
        consumer: str,
        min_version: int,
        max_groups: int,
        group_size: int | None = None,
        leaf_rule: LeafRule = "drop_superseded",
    ) -> list[Group]:
        """Hand out ready groups (every session ended and rewarded; all action tokens at version >=
        min_version; at least `group_size` sessions if given) to `consumer`. A group is the set of ready,
        unclaimed sessions sharing a group key; sessions of the same key that arrive later form a new
        group. A claimed group is never handed to another consumer. Groups older than min_version are
        marked stale and skipped."""
    def mark_consumed(self, group_ids: list[str], consumer: str) -> None: ...
    def release_groups(self, group_ids: list[str], consumer: str) -> None:
        """Give back claimed but unconsumed groups (e.g. after a trainer restart)."""
    def claimed_groups(self, consumer: str) -> list[str]:
        """Ids of the groups handed to `consumer` and not yet consumed or released, oldest first: what a
        trainer restarted after a crash gives back (it may have died before it learnt of a claim)."""

    def close(self) -> None: ...
