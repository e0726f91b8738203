"""Leaf rules and the steps view on hand-built trees."""

from __future__ import annotations

import numpy as np
import pytest

from stepline.datapool.records import Reward, SessionInfo
from stepline.datapool.steps import build_episode, main_leaf, select_leaves, superseded_leaves, trajectories
from stepline.datapool.tree import RadixTree


def build(*calls):
    tree = RadixTree("s")
    for call, (prompt, output) in enumerate(calls):
        tree.insert(call, np.array(prompt, np.int32), np.array(output, np.int32),
                    np.full(len(output), -(call + 1) / 10, np.float32), call)
    return tree.snapshot()


def leaf_tokens(tree, leaf_ids):
    by_id = {n.id: n for n in tree.nodes}
    return [by_id[i].tokens.tolist() for i in leaf_ids]


def test_two_turn_trajectory_masks_only_actions():
    tree = build(([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5, 6, 7], [8]))
    rewards = [Reward("s", 0.5, step=1, name="tool_ok", weight=2.0), Reward("s", 1.0)]
    [traj] = trajectories(tree, "all", rewards, {1: "length"})
    assert traj.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_allclose(traj.logprobs, [0, 0, 0, -0.1, -0.1, 0, 0, -0.2], rtol=1e-6)
    assert traj.node_path == [(0, 0, 3), (1, 3, 5), (2, 5, 7), (3, 7, 8)]
    s0, s1 = traj.steps
    assert (s0.call_index, s0.action_start, s0.action_end, s0.weight_version, s0.done) == (0, 3, 5, 0, False)
    assert (s1.call_index, s1.action_start, s1.action_end, s1.weight_version, s1.done) == (1, 7, 8, 1, True)
    assert s0.reward == 0.0 and s1.reward == pytest.approx(1.0)  # 0.5 × weight 2; terminal not a step reward
    assert s1.finish_reason == "length" and s0.finish_reason == "stop"
    np.testing.assert_allclose(s0.behaviour_logprobs, [-0.1, -0.1], rtol=1e-6)
    assert traj.is_main


def test_retry_supersedes_the_older_sibling():
    # call 1 retries call 0 (same prompt); call 2 continues the retry
    tree = build(([1, 2], [3]), ([1, 2], [4]), ([1, 2, 4, 5], [6]))
    assert leaf_tokens(tree, select_leaves(tree, "all")) == [[3], [6]]
    assert leaf_tokens(tree, superseded_leaves(tree)) == [[3]]
    assert leaf_tokens(tree, select_leaves(tree, "drop_superseded")) == [[6]]
    assert leaf_tokens(tree, select_leaves(tree, "main")) == [[6]]
    [traj] = trajectories(tree, "drop_superseded")
    assert [s.call_index for s in traj.steps] == [1, 2]


def test_three_tries_keep_only_the_latest():
    tree = build(([1], [2]), ([1], [3]), ([1], [4]))
    assert leaf_tokens(tree, select_leaves(tree, "drop_superseded")) == [[4]]
    assert len(select_leaves(tree, "all")) == 3


def test_compaction_is_a_fork_not_a_retry():
    # calls 0-1 grow one context; call 2 compacts it to [1, 7] (diverges after the first token)
    tree = build(([1, 2, 3], [4]), ([1, 2, 3, 4, 5], [6]), ([1, 7], [8]))
    assert leaf_tokens(tree, select_leaves(tree, "drop_superseded")) == [[6], [8]]
    assert leaf_tokens(tree, select_leaves(tree, "main")) == [[8]]
    before, after = trajectories(tree, "drop_superseded")
    assert [s.call_index for s in before.steps] == [0, 1] and not before.is_main
    assert [s.call_index for s in after.steps] == [2] and after.is_main
    assert before.node_path[0] == after.node_path[0] == (0, 0, 1)  # the shared [1] is one node


def test_partly_kept_action_is_context_not_a_step():
    # call 1 keeps only [4] of call 0's answer [4, 5, 6]
    tree = build(([1], [4, 5, 6]), ([1, 4, 9], [7]))
    traj = next(t for t in trajectories(tree, "all") if t.is_main)
    assert traj.tokens.tolist() == [1, 4, 9, 7]
    assert [s.call_index for s in traj.steps] == [1]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1]


def test_main_leaf_of_an_empty_tree_and_unknown_rule():
    tree = RadixTree("s").snapshot()
    assert main_leaf(tree) is None and trajectories(tree, "main") == []
    with pytest.raises(ValueError, match="leaf rule"):
        select_leaves(tree, "best")  # type: ignore[arg-type]


def test_episode_outcome_sums_weighted_terminal_components():
    tree = build(([1], [2]))
    rewards = [Reward("s", 1.0), Reward("s", 0.5, name="style", weight=0.2), Reward("s", 3.0, step=0)]
    ep = build_episode(SessionInfo("s", "t", "h"), rewards, tree)
    assert ep.outcome == pytest.approx(1.1)  # 1.0 + 0.5 × 0.2; the step reward is not terminal
    assert ep.trajectories[0].steps[0].reward == 3.0
