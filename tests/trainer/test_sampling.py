"""Dynamic sampling and DAPO overlong shaping."""

from __future__ import annotations

import pytest
import torch

from stepline.trainer.algorithms import dynamic_sampling_mask, has_reward_variance, overlong_penalty

torch.set_num_threads(1)


def test_groups_without_reward_variance_are_dropped() -> None:
    assert has_reward_variance([0.0, 1.0, 0.0])
    assert not has_reward_variance([1.0, 1.0, 1.0])  # all solved: advantage 0 everywhere
    assert not has_reward_variance([0.7])  # a single sample has no baseline
    assert not has_reward_variance([])
    # groups: 0 = {0, 1} varies; 1 = {1, 1} does not; 2 = {3} single
    outcome = torch.tensor([0.0, 1.0, 1.0, 1.0, 3.0])
    group = torch.tensor([0, 0, 1, 1, 2])
    assert dynamic_sampling_mask(outcome, group).tolist() == [True, True, False, False, False]


def test_overlong_penalty_by_hand() -> None:
    # L_max = 20, L_buf = 4: free up to 16; 17 -> (16 - 17)/4 = -0.25; 18 -> -0.5; 20 -> -1; beyond -> -1
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert torch.allclose(overlong_penalty(lengths, max_len=20, buffer_len=4), expected)
    assert torch.allclose(overlong_penalty(lengths, max_len=20, buffer_len=4, factor=0.5), expected * 0.5)


def test_overlong_without_buffer_is_a_hard_cut() -> None:
    # buffer 0: nothing up to L_max = 20, the full -f beyond
    hard = overlong_penalty(torch.tensor([19, 20, 21]), max_len=20, buffer_len=0, factor=2.0)
    assert torch.equal(hard, torch.tensor([0.0, 0.0, -2.0]))


def test_overlong_buffer_must_fit() -> None:
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)
