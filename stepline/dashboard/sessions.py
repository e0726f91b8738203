"""The episodes table: one summary row per session of the pool, kept current, filtered and paged here.

`SessionIndex.refresh` lists the pool's sessions (one cheap query) and summarises, through the pool's
own `get_episode`, only the sessions that are new or may still change (open, just ended, not yet
rewarded); a refresh stops after its time budget, so a pool of 10k sessions fills in over a few polls
while the table already pages through what is there. Queries (`select`) run on an immutable snapshot:
filtering, sorting and paging 10k rows in memory takes milliseconds.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stepline.datapool.base import Pool, PoolError
from stepline.datapool.records import EpisodeData, SessionInfo

__all__ = ["SessionIndex", "SessionQuery", "SessionRow", "select", "summarise"]

# What an unreachable, missing, half-created or busy pool raises: the table keeps its last state.
POOL_DOWN = (PoolError, sqlite3.Error, ConnectionError, PermissionError)
RECHECK_S = 300.0  # an ended session without a reward is re-read this long (a delayed reward may come)


@dataclass(frozen=True)
class SessionRow:
    """One session as the table shows it."""

    session_id: str
    harness: str
    task_id: str
    group_key: str
    status: str
    split: str  # "eval" for the evaluator's sessions (purpose eval), else "train"
    created_at: float
    ended_at: float | None
    reward: float | None  # terminal outcome (weighted sum of terminal components); None: none posted
    turns: int  # model calls
    tokens: int  # unique tokens of the tree (each shared prefix counted once)
    action_tokens: int  # sampled tokens
    min_version: int | None  # weight versions of its sampled tokens (None: no call sampled anything)
    max_version: int | None
    leaves: int  # more than one: the session forked (a retry or a rewritten history)
    success: bool | None = None  # the rollout driver's verdict, where the run recorded it
    reason: str = ""  # the driver's reason (why an episode failed, the verifier's words)


def summarise(ep: EpisodeData, verdict: dict[str, Any] | None = None) -> SessionRow:
    """The row of one session; `verdict`: its rollouts.json entry (success, reason), if any."""
    info, tree = ep.info, ep.tree
    acts = [n for n in tree.nodes if n.kind == "act"]
    versions = [n.weight_version for n in acts]
    parents = {n.parent for n in tree.nodes}
    terminal = [r for r in ep.rewards if r.step is None]
    verdict = verdict or {}
    return SessionRow(
        session_id=info.session_id, harness=info.harness, task_id=info.task_id, group_key=info.group_key,
        status=info.status, split="eval" if info.purpose == "eval" else "train", created_at=info.created_at,
        ended_at=info.ended_at, reward=ep.outcome if terminal else None, turns=len(tree.calls),
        tokens=sum(len(n.tokens) for n in tree.nodes), action_tokens=sum(len(n.tokens) for n in acts),
        min_version=min(versions) if versions else None, max_version=max(versions) if versions else None,
        leaves=sum(n.id not in parents for n in tree.nodes),
        success=verdict.get("success"), reason=str(verdict.get("reason") or ""),
    )


def _stale(row: SessionRow | None, info: SessionInfo, now: float) -> bool:
    """Whether a session's row must be (re)computed."""
    if row is None or row.status != info.status or info.status == "open":
        return True
    return row.reward is None and now - (info.ended_at or 0.0) < RECHECK_S


class SessionIndex:
    """Summary rows of a pool's sessions. `refresh` runs on the one thread that uses the pool; readers
    take `snapshot` (a tuple replaced whole, oldest session first) from any thread."""

    def __init__(self, open_pool: Callable[[], Pool]) -> None:
        self._open_pool = open_pool
        self._pool: Pool | None = None
        self._rows: dict[str, SessionRow] = {}
        self.snapshot: tuple[SessionRow, ...] = ()
        self.total = 0  # sessions the pool listed at the last refresh
        self.error: str | None = None  # why the last refresh could not read the pool
        self.stats: dict[str, int] = {}
        self.lock = threading.Lock()  # held while the pool is in use (one connection)

    def pool(self) -> Pool:
        """The pool, opened on first use (a run's pool.db may not exist yet)."""
        if self._pool is None:
            self._pool = self._open_pool()
        return self._pool

    def refresh(self, verdicts: dict[str, dict[str, Any]] | None = None, budget_s: float = 2.0) -> None:
        """Bring the rows up to date, for at most about `budget_s` of summarising."""
        try:
            with self.lock:
                self._refresh(verdicts or {}, budget_s)
            self.error = None
        except POOL_DOWN as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def _refresh(self, verdicts: dict[str, dict[str, Any]], budget_s: float) -> None:
        pool = self.pool()
        infos = pool.list_sessions()
        self.stats = dict(pool.stats())
        now, deadline = time.time(), time.monotonic() + budget_s
        # sessions never summarised first (oldest first), then those that may have changed: open sessions
        # re-read on every refresh must not starve the rest of a large pool
        stale = [i for i in infos if _stale(self._rows.get(i.session_id), i, now)]
        stale.sort(key=lambda i: (i.session_id in self._rows, i.created_at))
        for info in stale:
            self._rows[info.session_id] = summarise(pool.get_episode(info.session_id, "main"),
                                                    verdicts.get(info.session_id))
            if time.monotonic() > deadline:
                break
        for sid, verdict in verdicts.items():  # rollouts.json appears when the RL phase ends
            row = self._rows.get(sid)
            if row is not None and row.success is None and "success" in verdict:
                self._rows[sid] = summarise_verdict(row, verdict)
        self.total = len(infos)
        self.snapshot = tuple(sorted(self._rows.values(), key=lambda r: (r.created_at, r.session_id)))

    def close(self) -> None:
        with self.lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def summarise_verdict(row: SessionRow, verdict: dict[str, Any]) -> SessionRow:
    return SessionRow(**{**asdict(row), "success": verdict.get("success"), "reason": str(verdict.get("reason") or "")})


SortKey = Literal["created", "reward", "turns", "tokens", "version", "harness", "task", "status"]
SORT_FIELDS: dict[str, Callable[[SessionRow], Any]] = {
    "created": lambda r: r.created_at, "reward": lambda r: -1e300 if r.reward is None else r.reward,
    "turns": lambda r: r.turns, "tokens": lambda r: r.tokens,
    "version": lambda r: -1 if r.max_version is None else r.max_version,
    "harness": lambda r: r.harness, "task": lambda r: r.task_id, "status": lambda r: r.status,
}


class SessionQuery(BaseModel):
    """The episodes table's query string; anything else is refused (400), naming the parameter."""

    model_config = ConfigDict(extra="forbid")

    offset: int = Field(0, ge=0, description="rows to skip")
    limit: int = Field(50, ge=1, le=500, description="rows per page")
    harness: str | None = Field(None, description="exact harness name")
    status: Literal["open", "completed", "failed", "aborted", "abandoned"] | None = None
    split: Literal["train", "eval"] | None = None
    group: str | None = Field(None, description="exact group key (task::harness or the explicit group id)")
    q: str | None = Field(None, max_length=200, description="substring of the session id, task id or reason")
    min_reward: float | None = None
    max_reward: float | None = None
    version: int | None = Field(None, ge=0, description="sessions with tokens sampled at this weight version")
    forked: bool | None = Field(None, description="only sessions whose tree has more than one leaf (or only linear)")
    sort: SortKey = "created"
    order: Literal["asc", "desc"] = "desc"


def _keeps(query: SessionQuery) -> Callable[[SessionRow], bool]:
    q = query.q.lower() if query.q else None

    def keep(r: SessionRow) -> bool:
        return ((query.harness is None or r.harness == query.harness)
                and (query.status is None or r.status == query.status)
                and (query.split is None or r.split == query.split)
                and (query.group is None or r.group_key == query.group)
                and (q is None or q in r.session_id.lower() or q in r.task_id.lower() or q in r.reason.lower())
                and (query.min_reward is None or (r.reward is not None and r.reward >= query.min_reward))
                and (query.max_reward is None or (r.reward is not None and r.reward <= query.max_reward))
                and (query.version is None or (r.min_version is not None and r.max_version is not None
                                               and r.min_version <= query.version <= r.max_version))
                and (query.forked is None or (r.leaves > 1) == query.forked))

    return keep


def select(rows: tuple[SessionRow, ...], query: SessionQuery) -> dict[str, Any]:
    """The page `query` asks for: {"total" (rows that match), "offset", "limit", "rows"} (pure)."""
    keep = _keeps(query)
    matched = [r for r in rows if keep(r)]
    matched.sort(key=SORT_FIELDS[query.sort], reverse=query.order == "desc")
    page = matched[query.offset: query.offset + query.limit]
    return {"total": len(matched), "offset": query.offset, "limit": query.limit, "rows": [asdict(r) for r in page]}


def facets(rows: tuple[SessionRow, ...]) -> dict[str, Any]:
    """The values the filters offer: harnesses, statuses, the range of weight versions."""
    versions = [v for r in rows for v in (r.min_version, r.max_version) if v is not None]
    return {"harnesses": sorted({r.harness for r in rows}), "statuses": sorted({r.status for r in rows}),
            "versions": [min(versions), max(versions)] if versions else None}
