"""`Pool.claimed_groups` (added for the trainer's crash recovery): on every implementation, the groups handed
to a consumer and neither consumed nor released, oldest first."""

from __future__ import annotations

from pool_helpers import call, session

from stepline.datapool.records import Reward


def ready(pool, sid: str, task: str) -> None:
    pool.create_session(session(sid, task=task))
    pool.add_calls([call(sid, 0, [1, 2, 3], [4, 5])])
    pool.add_reward(Reward(sid, 1.0))
    pool.end_session(sid)


def test_claimed_groups_lists_open_claims_of_one_consumer(pool) -> None:
    for i, task in enumerate(["a", "b", "c", "d"]):
        ready(pool, f"s{i}", task)
    first = [g.group_id for g in pool.claim_groups("trainer", min_version=0, max_groups=3)]
    other = [g.group_id for g in pool.claim_groups("someone-else", min_version=0, max_groups=1)]
    assert pool.claimed_groups("trainer") == first and pool.claimed_groups("someone-else") == other
    pool.mark_consumed(first[:1], "trainer")
    pool.release_groups(first[1:2], "trainer")
    assert pool.claimed_groups("trainer") == first[2:]
    assert pool.claimed_groups("nobody") == []
