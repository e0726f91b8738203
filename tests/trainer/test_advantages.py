"""Advantage estimators against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from stepline.trainer.algorithms import (
    ADVANTAGES,
    AdvantageInputs,
    group_index,
    group_normalize,
    imitation_bonus,
    leave_one_out,
    scale_negative,
)
from stepline.trainer.algorithms.advantages import value_targets

torch.set_num_threads(1)

# Eight episodes, one step each. Groups: 0 = {1, 0, 0}; 1 = {0.5} (single sample); 2 = {2, 2} (zero
# variance); 3 = {1, 3}.
OUTCOME = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 1.0, 3.0])
GROUP = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])


def one_step_each(outcome: torch.Tensor = OUTCOME, group: torch.Tensor = GROUP) -> AdvantageInputs:
    e = torch.arange(len(outcome))
    return AdvantageInputs(outcome, group, step_episode=e, step_traj=e, step_position=torch.zeros_like(e))


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol), actual


def test_grpo_with_std() -> None:
    # group 0: mean 1/3, centred [2/3, -1/3, -1/3], unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.57735
    #   -> [0.6667 / 0.57735, -0.3333 / 0.57735, ...] = [1.1547, -0.57735, -0.57735]
    # group 3: mean 2, centred [-1, 1], var 2 / 1 = 2, std 1.41421 -> [-0.70711, 0.70711]
    # single-sample group 1 and zero-variance group 2 -> 0
    adv = ADVANTAGES["grpo"](one_step_each())
    close(adv, [1.1547, -0.57735, -0.57735, 0.0, 0.0, 0.0, -0.70711, 0.70711])


def test_grpo_without_std_is_mean_centred() -> None:
    adv = ADVANTAGES["grpo"](one_step_each(), scale_by_std=False)
    close(adv, [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, -1.0, 1.0])


def test_zero_variance_is_exactly_zero_even_with_rounding() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; the group still carries no signal and must give exactly 0
    adv = group_normalize(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([5, 5, 5]))
    assert torch.equal(adv, torch.zeros(3))


def test_rloo() -> None:
    # group 0: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -0.5 (twice); group 3: 1 - 3 = -2, 3 - 1 = 2
    adv = ADVANTAGES["rloo"](one_step_each())
    close(adv, [1.0, -0.5, -0.5, 0.0, 0.0, 0.0, -2.0, 2.0])
    assert torch.equal(leave_one_out(torch.tensor([4.0]), torch.tensor([0])), torch.zeros(1))


def test_reinforce_pp_group_baseline_whitened_over_batch() -> None:
    # centred by group mean: [2/3, -1/3, -1/3, 0, 0, 0, -1, 1]; batch mean 0,
    # Σ sq = 4/9 + 1/9 + 1/9 + 1 + 1 = 2.6667; unbiased var 2.6667 / 7 = 0.380952; std 0.617213
    # -> 0.6667 / 0.617213 = 1.08012, 0.3333 / 0.617213 = 0.54006, 1 / 0.617213 = 1.62019
    adv = ADVANTAGES["reinforce_pp"](one_step_each())
    close(adv, [1.08012, -0.54006, -0.54006, 0.0, 0.0, 0.0, -1.62019, 1.62019])


def test_reinforce_pp_batch_baseline() -> None:
    # R = [1, 3], batch mean 2, centred [-1, 1], std sqrt(2) -> [-0.70711, 0.70711]; groups ignored
    adv = ADVANTAGES["reinforce_pp"](one_step_each(torch.tensor([1.0, 3.0]), torch.tensor([0, 1])), group_baseline=False)
    close(adv, [-0.70711, 0.70711])
    single = ADVANTAGES["reinforce_pp"](one_step_each(torch.tensor([1.0]), torch.tensor([0])))
    assert torch.equal(single, torch.zeros(1))


def gae_inputs() -> AdvantageInputs:
    # trajectory 3 (episode 0, outcome 1): 3 steps, V = [0.5, 0.2, 0.4], dense r = [0, 0.1, 0]
    # trajectory 7 (episode 1, outcome 0): 2 steps given out of order (position 1 first), V = [0.1, 0.3]
    return AdvantageInputs(
        outcome=torch.tensor([1.0, 0.0]),
        episode_group=torch.tensor([0, 0]),
        step_episode=torch.tensor([0, 1, 0, 1, 0]),
        step_traj=torch.tensor([3, 7, 3, 7, 3]),
        step_position=torch.tensor([0, 1, 1, 0, 2]),
        step_reward=torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0]),
        values=torch.tensor([0.5, 0.3, 0.2, 0.1, 0.4]),
    )


def test_step_gae() -> None:
    # γ = 0.9, λ = 0.5, γλ = 0.45. Trajectory 3: r = [0, 0.1, 0 + outcome 1]
    #   δ2 = 1 + 0 - 0.4 = 0.6;  δ1 = 0.1 + 0.9·0.4 - 0.2 = 0.26;  δ0 = 0 + 0.9·0.2 - 0.5 = -0.32
    #   A2 = 0.6;  A1 = 0.26 + 0.45·0.6 = 0.53;  A0 = -0.32 + 0.45·0.53 = -0.0815
    # Trajectory 7: δ1 = 0 + 0 - 0.3 = -0.3;  δ0 = 0 + 0.9·0.3 - 0.1 = 0.17
    #   A1 = -0.3;  A0 = 0.17 + 0.45·(-0.3) = 0.035
    # rows in input order: (3,0) (7,1) (3,1) (7,0) (3,2)
    x = gae_inputs()
    close(ADVANTAGES["gae"](x, gamma=0.9, lam=0.5), [-0.0815, -0.3, 0.53, 0.035, 0.6])
    # targets = A + V: [-0.0815 + 0.5, -0.3 + 0.3, 0.53 + 0.2, 0.035 + 0.1, 0.6 + 0.4]
    close(value_targets(x, gamma=0.9, lam=0.5), [0.4185, 0.0, 0.73, 0.135, 1.0])


def test_gae_with_lambda_one_is_monte_carlo_minus_value() -> None:
    # γ = λ = 1: A_t = (Σ_{k≥t} r_k) - V_t. Trajectory 3: returns [1.1, 1.1, 1.0] - V [0.5, 0.2, 0.4]
    # = [0.6, 0.9, 0.6]; trajectory 7: returns [0, 0] - V [0.1, 0.3] (positions 0, 1)
    close(ADVANTAGES["gae"](gae_inputs(), gamma=1.0, lam=1.0), [0.6, -0.3, 0.9, -0.1, 0.6])


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="values"):
        ADVANTAGES["gae"](one_step_each())


def test_positions_must_be_contiguous() -> None:
    x = AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0, 0]), torch.tensor([0, 0]),
                        torch.tensor([0, 2]), values=torch.zeros(2))
    with pytest.raises(ValueError, match="step_position"):
        ADVANTAGES["gae"](x)


def two_episodes_dense() -> AdvantageInputs:
    # episode 0 (outcome 1): 3 steps with dense rewards [0.2, 0, 0.5]; episode 1 (outcome 0): 1 step, r 0
    return AdvantageInputs(
        outcome=torch.tensor([1.0, 0.0]),
        episode_group=torch.tensor([0, 0]),
        step_episode=torch.tensor([0, 0, 0, 1]),
        step_traj=torch.tensor([0, 0, 0, 1]),
        step_position=torch.tensor([0, 1, 2, 0]),
        step_reward=torch.tensor([0.2, 0.0, 0.5, 0.0]),
    )


def test_dense_rewards_discounted_outcome_not() -> None:
    # γ_d = 0.5: G2 = 0.5; G1 = 0 + 0.5·0.5 = 0.25; G0 = 0.2 + 0.5·0.25 = 0.325
    # outcome term (mean-centred, group {1, 0}): +0.5 on every step of episode 0, -0.5 on episode 1
    adv = ADVANTAGES["dense"](two_episodes_dense(), gamma_dense=0.5)
    close(adv, [0.825, 0.75, 1.0, -0.5])


def test_turn_discount() -> None:
    # γ = 0.5, outcome advantage (no std) +0.5 for episode 0 (T = 3), -0.5 for episode 1 (T = 1)
    # A_t = γ^(T-1-t)·A: [0.25·0.5, 0.5·0.5, 1·0.5, 1·(-0.5)]
    adv = ADVANTAGES["turn_discount"](two_episodes_dense(), gamma=0.5, scale_by_std=False)
    close(adv, [0.125, 0.25, 0.5, -0.5])


def test_forks_share_the_episode_outcome() -> None:
    # episode 0 forked into trajectories 0 and 1 (2 steps each); GRPO gives every step of it the same A
    x = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 0, 0, 0, 1]),
                        torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 0, 1, 0]))
    close(ADVANTAGES["grpo"](x, scale_by_std=False), [0.5, 0.5, 0.5, 0.5, -0.5])


def test_no_nan_anywhere_on_degenerate_batches() -> None:
    x = one_step_each(torch.tensor([3.0]), torch.tensor([0]))
    x = AdvantageInputs(**{**x.__dict__, "values": torch.tensor([0.0]), "step_state": torch.tensor([0]),
                          "gold_prob": torch.tensor([0.5]), "step_call": torch.tensor([0]),
                          "episode_parent": torch.tensor([-1]), "episode_branch": torch.tensor([0])})
    for name, fn in ADVANTAGES.items():
        adv = fn(x)
        assert not torch.isnan(adv).any(), name
        assert math.isfinite(float(adv.sum()))


def test_group_index_from_keys() -> None:
    assert group_index(["a::h1", "b::h1", "a::h1", "a::h2"]).tolist() == [0, 1, 0, 2]


def test_dr_grpo_is_mean_centred_without_std() -> None:
    # Dr. GRPO: A_i = R_i − mean_g R (group 0 mean 1/3, group 3 mean 2); singles and zero variance -> 0
    close(ADVANTAGES["dr_grpo"](one_step_each()), [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, -1.0, 1.0])


def test_reinforce_pp_uses_discounted_step_rewards() -> None:
    # one group: episode 0 has 2 steps with step rewards [1, 0] and outcome 1; episode 1 has 1 step, outcome 0.
    # γ = 0.5: rewards per step r = [1, 0 + 1, 0 + 0]; G = [1 + 0.5·1, 1, 0] = [1.5, 1, 0]
    # baseline = group mean R = 0.5 -> centred [1.0, 0.5, -0.5]
    # weights 1/(rows of the episode) = [0.5, 0.5, 1]; weighted mean (0.5 + 0.25 − 0.5) / 2 = 0.125
    # var = (0.5·0.875² + 0.5·0.375² + 1·0.625²) / (2 − 1) = 0.84375, std 0.918559
    # -> [1.0, 0.5, -0.5] / 0.918559 = [1.08866, 0.54433, -0.54433]
    x = AdvantageInputs(outcome=torch.tensor([1.0, 0.0]), episode_group=torch.tensor([0, 0]),
                        step_episode=torch.tensor([0, 0, 1]), step_traj=torch.tensor([0, 0, 1]),
                        step_position=torch.tensor([0, 1, 0]), step_reward=torch.tensor([1.0, 0.0, 0.0]))
    close(ADVANTAGES["reinforce_pp"](x, gamma=0.5), [1.08866, 0.54433, -0.54433])
    # without step rewards and γ = 1 every step of an episode gets its episode's value: [1, 1, -1]·(0.5/0.7071)
    plain = AdvantageInputs(**{**x.__dict__, "step_reward": None})
    close(ADVANTAGES["reinforce_pp"](plain), [0.70711, 0.70711, -0.70711])


def test_gigpo_adds_step_groups_of_equal_anchor_states() -> None:
    # group 0: e0 visits states [S0, S1], R = 1; e1 [S0, S1], R = 0; e2 [S0, S2], R = 1. group 1: e3 [S1], R = 5.
    # episode level (no std): mean_g0 R = 2/3 -> A^E = [1/3, −2/3, 1/3], e3 alone -> 0
    # returns, γ = 0.5, no step rewards: e0 [0.5, 1], e1 [0, 0], e2 [0.5, 1], e3 [5]
    # step groups: (g0, S0) = [0.5, 0, 0.5] mean 1/3 -> [1/6, −1/3, 1/6]; (g0, S1) = [1, 0] -> [0.5, −0.5];
    #   (g0, S2) and (g1, S1) are visited once -> 0 (S1 of group 1 is not pooled with group 0's S1)
    # A = A^E + 0.5·A^S: e0 [1/3 + 1/12, 1/3 + 1/4], e1 [−2/3 − 1/6, −2/3 − 1/4], e2 [1/3 + 1/12, 1/3], e3 [0]
    x = AdvantageInputs(outcome=torch.tensor([1.0, 0.0, 1.0, 5.0]), episode_group=torch.tensor([0, 0, 0, 1]),
                        step_episode=torch.tensor([0, 0, 1, 1, 2, 2, 3]),
                        step_traj=torch.tensor([0, 0, 1, 1, 2, 2, 3]),
                        step_position=torch.tensor([0, 1, 0, 1, 0, 1, 0]),
                        step_state=torch.tensor([10, 11, 10, 11, 10, 12, 11]))
    adv = ADVANTAGES["gigpo"](x, step_weight=0.5, gamma=0.5, scale_by_std=False)
    close(adv, [5 / 12, 7 / 12, -5 / 6, -11 / 12, 5 / 12, 1 / 3, 0.0])
    with pytest.raises(ValueError, match="step_state"):
        ADVANTAGES["gigpo"](one_step_each())


def tree_inputs(outcome: list[float], group: list[int], steps: list[tuple[int, int]], parent: list[int],
                branch: list[int]) -> AdvantageInputs:
    """Steps as (episode, call index); positions numbered per episode in the order given."""
    episode = torch.tensor([e for e, _ in steps])
    position = torch.tensor([sum(1 for f, _ in steps[:i] if f == e) for i, (e, _) in enumerate(steps)])
    return AdvantageInputs(torch.tensor(outcome), torch.tensor(group), step_episode=episode, step_traj=episode,
                           step_position=position, step_call=torch.tensor([c for _, c in steps]),
                           episode_parent=torch.tensor(parent), episode_branch=torch.tensor(branch))


def test_tree_grpo_is_intra_plus_inter_tree_relative_at_each_subtree() -> None:
    # one group: tree 1 = A (calls 0, 1, 2), B forked from A at call 1 (calls 1, 2), C forked from A at call 2
    # (call 2); tree 2 = D alone (calls 0, 1). R: A 1, B 0, C 1, D 0.
    # tree 1: mean 2/3, unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = 1/√3; group: mean 1/2, std sqrt(4·(1/4) / 3) = 1/√3
    # leaves below each step: A0 {A, B, C} V = 2/3; A1 {A, C} (B shares only call 0) V = 1; A2 {A} V = 1;
    #   B1, B2 {B} V = 0; C2 {C} V = 1; D0, D1 {D} V = 0 (a tree of one adds no intra term)
    # A = √3·(V − 2/3) + √3·(V − 1/2):  A0 = √3/6 = 0.288675;  V = 1 -> √3·(1/3 + 1/2) = 1.443376;
    #   B -> √3·(−2/3 − 1/2) = −2.020726;  D -> √3·(−1/2) = −0.866025
    x = tree_inputs([1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2), (3, 0), (3, 1)],
                    parent=[-1, 0, 0, -1], branch=[0, 1, 2, 0])
    adv = ADVANTAGES["tree_grpo"](x, eps=0.0)
    close(adv, [0.288675, 1.443376, 1.443376, -2.020726, -2.020726, 1.443376, -0.866025, -0.866025])
    # the better sibling at the branching node (state after A's call 0) gets the larger advantage
    assert adv[1] > adv[3]
    with pytest.raises(ValueError, match="episode_parent"):
        ADVANTAGES["tree_grpo"](one_step_each())


def test_tree_grpo_fork_of_a_fork_before_its_branch_shares_only_the_common_prefix() -> None:
    # A (calls 0, 1, 2) R 1; B forked from A at call 2 (call 2) R 1; C forked from B at call 1 (calls 1, 2) R 0:
    # C passes through A's calls < min(1, 2) = 1 only. One tree = the group: mean 2/3, std 1/√3, A = 2√3·(V − 2/3)
    # A0 {A, B, C} V = 2/3 -> 0; A1 {A, B} V = 1 -> 2√3/3 = 1.154701; A2 {A} -> 1.154701; B2 {B} -> 1.154701;
    # C1, C2 {C} V = 0 -> −4√3/3 = −2.309401
    x = tree_inputs([1.0, 1.0, 0.0], [0, 0, 0], [(0, 0), (0, 1), (0, 2), (1, 2), (2, 1), (2, 2)],
                    parent=[-1, 0, 1], branch=[0, 2, 1])
    close(ADVANTAGES["tree_grpo"](x, eps=0.0), [0.0, 1.154701, 1.154701, 1.154701, -2.309401, -2.309401])


def test_tree_grpo_without_forks_is_grpo() -> None:
    e = torch.arange(len(OUTCOME))
    x = AdvantageInputs(OUTCOME, GROUP, step_episode=e, step_traj=e, step_position=torch.zeros_like(e),
                        step_call=torch.zeros_like(e), episode_parent=torch.full_like(e, -1),
                        episode_branch=torch.zeros_like(e))
    close(ADVANTAGES["tree_grpo"](x), ADVANTAGES["grpo"](x).tolist())


def test_imitation_bonus_rewards_only_episodes_that_reached_the_bar() -> None:
    outcome = torch.tensor([1.0, 0.0, 0.5, 1.0])
    torch.testing.assert_close(imitation_bonus(outcome, coef=0.3, min_outcome=1.0), torch.tensor([0.3, 0.0, 0.0, 0.3]))
    torch.testing.assert_close(imitation_bonus(outcome, coef=0.3, min_outcome=0.5), torch.tensor([0.3, 0.0, 0.3, 0.3]))
    # negative reinforcement: the episodes below the bar (0.0 and 0.5 for a bar of 1) get -0.2
    torch.testing.assert_close(imitation_bonus(outcome, coef=0.3, min_outcome=1.0, failure_coef=0.2),
                               torch.tensor([0.3, -0.2, -0.2, 0.3]))


def test_scale_negative_shrinks_only_the_negative_advantages() -> None:
    advantages = torch.tensor([0.8, -0.4, 0.0, -1.0])
    torch.testing.assert_close(scale_negative(advantages, torch.tensor([0.0, 0.0, 0.0, 0.5])),
                               torch.tensor([0.8, 0.0, 0.0, -0.5]))
    torch.testing.assert_close(scale_negative(advantages, torch.ones(4)), advantages)
