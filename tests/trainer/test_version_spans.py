"""A call resumed across a weight update reaches the trainer with each token's version: the step reports the
oldest (the staleness bound compares it), the packed forest carries the version of every action token, and the
per-token staleness mask drops exactly the old piece's tokens."""

from __future__ import annotations

import numpy as np

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, Reward, SessionInfo
from stepline.trainer.algorithms.corrections import fresh_mask
from stepline.trainer.tree_forward import pack_forest


def test_a_resumed_call_s_versions_reach_the_trainer(tmp_path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path}/pool.db")
    pool.create_session(SessionInfo("s", "t", "h"))
    # dispatched under version 3; cut by the update to 5 after 2 tokens and resumed for 3 more
    logprobs = np.array([-0.1, -0.2, -0.3, -0.4, -0.5], np.float32)
    pool.add_calls([CallRecord("s", 0, np.array([1, 2, 3], np.int32), np.array([7, 8, 9, 10, 11], np.int32),
                               logprobs, 3, version_spans=[(0, 3), (2, 5)])])
    pool.add_reward(Reward("s", 1.0))
    pool.end_session("s")
    [group] = pool.claim_groups("trainer", min_version=3, max_groups=1)
    assert group.min_version == 3
    [step] = group.episodes[0].trajectories[0].steps
    assert (step.weight_version, step.version_spans) == (3, [(0, 3), (2, 5)])
    assert step.behaviour_logprobs.tolist() == logprobs.tolist()  # both pieces' logprobs, unchanged
    forest = pack_forest(group.episodes)
    assert forest.weight_version.tolist() == [3, 3, 5, 5, 5]
    assert forest.behaviour_logprobs.tolist() == logprobs.tolist()
    # policy at version 6 with a staleness bound of 1: the old piece is too stale, the resumed one trains
    assert fresh_mask(forest.weight_version, 6, 1).tolist() == [False, False, True, True, True]
    # with a bound the old piece is outside, the pool hands out no group (marked stale)
    pool.create_session(SessionInfo("u", "t2", "h"))
    pool.add_calls([CallRecord("u", 0, np.array([1], np.int32), np.array([7, 8], np.int32),
                               np.array([-0.1, -0.2], np.float32), 3, version_spans=[(0, 3), (1, 5)])])
    pool.add_reward(Reward("u", 1.0))
    pool.end_session("u")
    assert pool.claim_groups("trainer", min_version=4, max_groups=1) == []
