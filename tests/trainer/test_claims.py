"""stepline.trainer.claims: the trainer rides out pool outages, and a claim whose answer was lost is given back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepline.datapool import open_pool
from stepline.datapool.base import InvalidRecord, Pool
from stepline.datapool.client import PoolUnavailable
from stepline.datapool.records import CallRecord, Reward, SessionInfo
from stepline.trainer.claims import Claims


class Outage:
    """A real pool whose listed methods fail as unavailable, `before` or `after` the pool ran them (after:
    the service committed, then died before its answer left)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.failing: dict[str, str] = {}  # method -> "before" | "after"

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.pool, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            when = self.failing.get(name)
            if when == "before":
                raise PoolUnavailable(f"{name}: connection refused")
            result = method(*args, **kwargs)
            if when == "after":
                raise PoolUnavailable(f"{name}: server disconnected without sending a response")
            return result
        return call


def ready_groups(tmp_path: Path, tasks: int) -> Pool:
    """`tasks` groups of 2 ended, rewarded sessions with one call each."""
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    for t in range(tasks):
        for m in "ab":
            sid = f"t{t}{m}"
            pool.create_session(SessionInfo(sid, f"t{t}", "h"))
            pool.add_calls([CallRecord(sid, 0, np.array([1, 2], np.int32), np.array([3], np.int32),
                                       np.array([-0.5], np.float32), 0)])
            pool.add_reward(Reward(sid, 1.0))
            pool.end_session(sid)
    return pool


def claim(claims: Claims, known: set[str], n: int = 1) -> list[str]:
    groups = claims.claim(known, min_version=0, max_groups=n, group_size=None, leaf_rule="drop_superseded")
    return [g.group_id for g in groups]


def members(pool: Pool, group_ids: list[str]) -> list[str]:
    """The sessions the pool's claim column gives to these groups."""
    rows = pool.conn.execute(  # type: ignore[attr-defined]
        f"SELECT session_id FROM sessions WHERE claim IN ({','.join('?' * len(group_ids))})", group_ids)
    return sorted(r[0] for r in rows)


def test_a_claim_whose_answer_was_lost_is_given_back_and_claimed_again(tmp_path: Path) -> None:
    pool = ready_groups(tmp_path, tasks=1)
    flaky = Outage(pool)
    claims = Claims(flaky, "trainer")  # type: ignore[arg-type]
    flaky.failing["claim_groups"] = "after"  # the pool committed the claim; the trainer never heard of it
    assert claim(claims, set()) == []
    assert len(pool.claimed_groups("trainer")) == 1  # held by us in the pool, unknown to the trainer
    del flaky.failing["claim_groups"]
    again = claim(claims, set())  # settles first: the unknown claim goes back, then the group is claimed anew
    assert len(again) == 1 and pool.claimed_groups("trainer") == again
    assert members(pool, again) == ["t0a", "t0b"] and claims.outages == 1
    assert claims.mark_consumed(again)
    assert pool.stats()["groups_consumed"] == 1 and pool.stats()["groups_claimed"] == 0
    assert claim(claims, set(again)) == []  # nothing trains twice
    pool.close()


def test_groups_the_trainer_holds_survive_the_settlement(tmp_path: Path) -> None:
    pool = ready_groups(tmp_path, tasks=3)
    flaky = Outage(pool)
    claims = Claims(flaky, "trainer")  # type: ignore[arg-type]
    pending = claim(claims, set())  # claimed, waiting for a full batch
    flaky.failing["claim_groups"] = "before"  # the service is down: nothing was committed
    assert claim(claims, set(pending)) == []
    del flaky.failing["claim_groups"]
    rest = claim(claims, set(pending), n=5)
    assert len(rest) == 2 and sorted(pool.claimed_groups("trainer")) == sorted(pending + rest)
    pool.close()


def test_consumes_during_an_outage_are_reported_and_refusals_raise(tmp_path: Path) -> None:
    pool = ready_groups(tmp_path, tasks=1)
    flaky = Outage(pool)
    claims = Claims(flaky, "trainer")  # type: ignore[arg-type]
    held = claim(claims, set())
    flaky.failing["mark_consumed"] = "after"  # committed, answer lost: the caller keeps the ids and resends
    assert not claims.mark_consumed(held)
    del flaky.failing["mark_consumed"]
    assert claims.mark_consumed(held) and pool.stats()["groups_consumed"] == 1
    with pytest.raises(InvalidRecord):  # a refusal is no outage: it reaches the caller
        claims.mark_consumed(["no-such-group"])
    pool.close()
