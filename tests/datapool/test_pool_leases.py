"""Sessions leased to their gateway (every pool): a lease that lapses unrenewed ends its session as `abandoned`
with the reason, at the next claim or sweep, so a killed gateway's sessions free their groups; a renewed one
stays open however idle; a schema-2 pool gains the lease column when opened writable."""

from __future__ import annotations

import sqlite3
import time

import numpy as np

from stepline.datapool import open_pool
from stepline.datapool.records import END_REASON_KEY, CallRecord, Reward, SessionInfo
from stepline.datapool.sql import SCHEMA_VERSION


def _episode(pool, sid: str, reward: float | None, end: bool, created: float | None = None) -> None:
    pool.create_session(SessionInfo(sid, "task", "h", created_at=created or time.time()))
    pool.add_calls([CallRecord(sid, 0, np.array([1, 2], np.int32), np.array([3], np.int32),
                               np.array([-0.5], np.float32), 0)])
    if reward is not None:
        pool.add_reward(Reward(sid, reward))
    if end:
        pool.end_session(sid)


def test_a_lapsed_lease_frees_the_group_at_the_next_claim(pool) -> None:
    _episode(pool, "done", 1.0, True)
    _episode(pool, "crashed", None, False)  # its gateway was killed mid-episode
    _episode(pool, "live", None, False)  # another gateway's, renewed
    assert pool.renew_leases(["crashed"], 0.01) == []
    assert pool.renew_leases(["live"], 3600) == []
    time.sleep(0.05)  # the short lease lapses
    assert pool.claim_groups("t", 0, 10) == []  # "live" still holds the group
    crashed = pool.get_session("crashed")
    assert crashed.status == "abandoned" and "lease lapsed" in crashed.metadata[END_REASON_KEY]
    assert pool.get_session("live").status == "open"
    pool.add_reward(Reward("live", 0.0))
    pool.end_session("live")
    (group,) = pool.claim_groups("t", 0, 10)
    assert sorted(e.info.session_id for e in group.episodes) == ["done", "live"]  # no reward: "crashed" left out
    assert pool.renew_leases(["crashed", "live"], 60) == ["crashed", "live"]  # no longer open


def test_the_idle_sweep_spares_leased_sessions_and_says_why_it_abandons(pool) -> None:
    old = time.time() - 5000
    _episode(pool, "leased", None, False, created=old)  # a live gateway's long episode: it renews
    _episode(pool, "orphan", None, False, created=old)  # never leased (an older gateway's)
    pool.renew_leases(["leased"], 3600)
    assert pool.abandon_idle(3600) == 1
    assert pool.get_session("leased").status == "open"
    orphan = pool.get_session("orphan")
    assert orphan.status == "abandoned" and "no gateway serves it" in orphan.metadata[END_REASON_KEY]


def test_a_schema_2_pool_gains_leases_when_opened_writable(tmp_path) -> None:
    path = tmp_path / "old.db"
    pool = open_pool(f"sqlite:///{path}")
    _episode(pool, "s", None, False)
    pool.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE sessions DROP COLUMN lease_until")
        db.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")
    reader = open_pool(f"sqlite:///{path}", read_only=True)  # read as it is
    assert reader.get_session("s").status == "open"
    reader.close()
    pool = open_pool(f"sqlite:///{path}")
    try:
        assert pool.renew_leases(["s"], 60) == []
    finally:
        pool.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),)
