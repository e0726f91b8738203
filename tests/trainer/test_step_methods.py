"""The step-level methods, by hand: MPO's turn ratio, EPIC's prefix ratio, CAPO's
action-level TD advantage, IGPO's information-gain rewards and the gold-answer forward, and the trust
regions (GAPO, RIPO, the stale-adaptive clip, DPPO's mask, DRPO's regulariser, CPPO's prefix budget)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from stepline.trainer.algorithms import (
    ADVANTAGES,
    CLIP_RULES,
    POLICY_LOSSES,
    RATIOS,
    AdvantageInputs,
    ClipInputs,
    Segments,
    gapo_clip_high,
    information_gain,
)
from stepline.trainer.information_gain import gold_probabilities

torch.set_num_threads(1)
LN = math.log


def test_turn_ratio_is_the_turns_product_with_each_tokens_own_gradient() -> None:
    # step 0 = tokens 0-1 with r = [2, 1.5], step 1 = token 2 with r = 0.5
    # value: Π over the turn = [3, 3, 0.5]; the geometric mean (`step`) would be sqrt(3) = 1.732051
    # d(Σ r)/d logp_j = value_j (only the token's own factor carries gradient) = [3, 3, 0.5]
    logp = torch.tensor([LN(2), LN(1.5), LN(0.5)], requires_grad=True)
    steps = torch.tensor([0, 0, 1])
    r = RATIOS["turn"](logp, torch.zeros(3), step_ids=steps)
    r.sum().backward()
    assert r.tolist() == pytest.approx([3.0, 3.0, 0.5])
    assert logp.grad.tolist() == pytest.approx([3.0, 3.0, 0.5])
    assert RATIOS["step"](logp, torch.zeros(3), step_ids=steps).tolist()[0] == pytest.approx(math.sqrt(3))
    # a masked token counts as r = 1: token 1 masked -> [2, 1 (its own value is not used), 0.5]
    masked = RATIOS["turn"](logp.detach(), torch.zeros(3), step_ids=steps, mask=torch.tensor([True, False, True]))
    assert masked.tolist()[0] == pytest.approx(2.0)


def test_prefix_ratio_accumulates_over_the_trajectory_in_order() -> None:
    # trajectories interleave: traj 0 = tokens 0, 2, 3 with r = [2, 0.5, 3]; traj 1 = token 1 with r = 1.5
    # prefix ratios: traj 0 -> [2, 2·0.5 = 1, 1·3 = 3]; traj 1 -> [1.5]  =>  [2, 1.5, 1, 3]
    # d(Σ r)/d logp_k = Σ of the prefix ratios at and after k in its trajectory: [2+1+3, 1.5, 1+3, 3]
    logp = torch.tensor([LN(2), LN(1.5), LN(0.5), LN(3)], requires_grad=True)
    r = RATIOS["prefix"](logp, torch.zeros(4), traj_ids=torch.tensor([0, 1, 0, 0]))
    r.sum().backward()
    assert r.tolist() == pytest.approx([2.0, 1.5, 1.0, 3.0])
    assert logp.grad.tolist() == pytest.approx([6.0, 1.5, 4.0, 3.0])
    # capped like the other unit ratios: cumulative log-ratio 6 + 6 = 12 -> e^10, no gradient beyond
    big = torch.tensor([6.0, 6.0], requires_grad=True)
    capped = RATIOS["prefix"](big, torch.zeros(2), traj_ids=torch.zeros(2, dtype=torch.long))
    assert capped.tolist() == pytest.approx([math.exp(6), math.exp(10)])


def two_step_trajectory(**extra: torch.Tensor) -> AdvantageInputs:
    return AdvantageInputs(outcome=torch.tensor([1.0]), episode_group=torch.tensor([0]),
                           step_episode=torch.tensor([0, 0]), step_traj=torch.tensor([0, 0]),
                           step_position=torch.tensor([0, 1]), **extra)


def test_capo_is_the_one_step_td_error_at_action_boundaries() -> None:
    # V = [0.5, 0.2], step rewards [0.1, 0], outcome 1 on the last step, γ = 0.9
    # A_0 = 0.1 + 0.9·0.2 − 0.5 = −0.22;  A_1 = (0 + 1) + 0.9·0 − 0.2 = 0.8
    # (GAE with λ = 0.95 would give A_0 = −0.22 + 0.9·0.95·0.8 = 0.464)
    x = two_step_trajectory(step_reward=torch.tensor([0.1, 0.0]), values=torch.tensor([0.5, 0.2]))
    assert ADVANTAGES["capo"](x, gamma=0.9).tolist() == pytest.approx([-0.22, 0.8])
    assert ADVANTAGES["gae"](x, gamma=0.9, lam=0.95).tolist()[0] == pytest.approx(0.464)


def igpo_inputs() -> AdvantageInputs:
    # one group: episode 0 has 3 steps, π(a*|s_t) = [0.2, 0.6, 0.5], outcome 1; episode 1 has 2 steps,
    # π(a*|s_t) = [0.2, 0.1], outcome 0
    return AdvantageInputs(outcome=torch.tensor([1.0, 0.0]), episode_group=torch.tensor([0, 0]),
                           step_episode=torch.tensor([0, 0, 0, 1, 1]), step_traj=torch.tensor([0, 0, 0, 1, 1]),
                           step_position=torch.tensor([0, 1, 2, 0, 1]),
                           gold_prob=torch.tensor([0.2, 0.6, 0.5, 0.2, 0.1]))


def test_information_gain_is_the_rise_of_the_gold_probability_per_turn() -> None:
    # IG_t = p_{t+1} − p_t, 0 on each last step: [0.6−0.2, 0.5−0.6, 0, 0.1−0.2, 0] = [0.4, −0.1, 0, −0.1, 0]
    x = igpo_inputs()
    assert information_gain(x.gold_prob, x).tolist() == pytest.approx([0.4, -0.1, 0.0, -0.1, 0.0])


def test_igpo_normalises_all_turn_rewards_of_the_group_then_discounts() -> None:
    # rewards r = IG, outcome on the last steps: [0.4, −0.1, 1, −0.1, 0]; mean 1.2/5 = 0.24
    # deviations [0.16, −0.34, 0.76, −0.34, −0.24], Σ² = 0.892, unbiased std sqrt(0.892/4) = 0.472229
    # r̃ = [0.338818, −0.719989, 1.609386, −0.719989, −0.508227]
    # γ = 1: A = suffix sums per trajectory = [1.228216, 0.889398, 1.609386, −1.228216, −0.508227]
    x = igpo_inputs()
    assert ADVANTAGES["igpo"](x).tolist() == pytest.approx([1.228216, 0.889398, 1.609386, -1.228216, -0.508227],
                                                           abs=1e-5)
    # γ = 0.5: A_0 = 0.338818 + 0.5·(−0.719989) + 0.25·1.609386 = 0.381170, A_1 = −0.719989 + 0.5·1.609386
    assert ADVANTAGES["igpo"](x, gamma=0.5).tolist() == pytest.approx(
        [0.381170, 0.084705, 1.609386, -0.974102, -0.508227], abs=1e-5)
    with pytest.raises(ValueError, match="gold_prob"):
        ADVANTAGES["igpo"](AdvantageInputs(**{**x.__dict__, "gold_prob": None}))


class BigramLM(nn.Module):
    """logits at position p = TABLE[input_ids[p]]: the next-token distribution depends on the last token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                logits_to_keep: int):
        return type("Out", (), {"logits": self.table[input_ids][:, -logits_to_keep:]})()


def test_gold_probability_is_the_length_normalised_teacher_forced_likelihood() -> None:
    # after token 0 the model says [0.2, 0.6, 0.2]; after token 1 [4/6, 1/6, 1/6]; after token 2 uniform
    table = torch.log(torch.tensor([[0.2, 0.6, 0.2], [4 / 6, 1 / 6, 1 / 6], [1 / 3, 1 / 3, 1 / 3]]))
    model = BigramLM(table)
    # row 0: state [2, 0], answer [1, 0]: p(1 | …0) = 0.6, p(0 | …1) = 4/6 -> exp(mean log) = sqrt(0.4) = 0.632456
    # row 1: state [0, 2], answer [1]: p(1 | …2) = 1/3 (a shorter row: padding must not matter)
    # row 2 repeats row 0 (computed once, same value)
    contexts = [np.array([2, 0]), np.array([0, 2]), np.array([2, 0])]
    golds = [np.array([1, 0]), np.array([1]), np.array([1, 0])]
    p = gold_probabilities(model, contexts, golds, batch_size=2)
    assert p.tolist() == pytest.approx([math.sqrt(0.4), 1 / 3, math.sqrt(0.4)])
    with pytest.raises(ValueError, match="nothing"):
        gold_probabilities(model, [np.array([0])], [np.array([], dtype=np.int64)])


def clip_inputs(old_logp: torch.Tensor, adv: torch.Tensor, **kw) -> ClipInputs:
    n = len(old_logp)
    base = dict(clip_low=0.2, clip_high=0.28, old_logp=old_logp, advantages=adv,
                episode_ids=torch.zeros(n, dtype=torch.long), outcome=torch.zeros(1),
                episode_group=torch.zeros(1, dtype=torch.long))
    return ClipInputs(**{**base, **kw})


def test_gapo_widens_the_upper_clip_for_rare_correct_rollouts() -> None:
    # ε_high(c) = 0.2 + (0.4 − 0.2)·(k − c)/(k − 1), k = 4: group 0 has c = 1 -> 0.4; group 1 c = 3 -> 0.266667;
    # group 2 all correct (c = 4) -> 0.2
    outcome = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    group = torch.arange(3).repeat_interleave(4)
    high = gapo_clip_high(outcome, group, clip_low=0.2, clip_max=0.4)
    assert high.tolist() == pytest.approx([0.4] * 4 + [0.2 + 0.2 / 3] * 4 + [0.2] * 4)
    # in the loss: r = 1.35, A = 1 for the correct episode of each of groups 0 and 1:
    # group 0 keeps the unclipped −1.35 (and its gradient), group 1 is clipped to −1.266667
    c = clip_inputs(torch.zeros(2), torch.ones(2), episode_ids=torch.tensor([0, 4]), outcome=outcome,
                    episode_group=group)
    bounds = CLIP_RULES["gapo"](c, clip_max=0.4)
    logp = torch.full((2,), LN(1.35), requires_grad=True)
    s = POLICY_LOSSES["ppo"](logp, torch.zeros(2), torch.ones(2), clip_low=bounds.low,
                             clip_high=bounds.high)
    s.loss.sum().backward()
    assert s.loss.tolist() == pytest.approx([-1.35, -(1.2 + 0.2 / 3)])
    assert logp.grad.tolist() == pytest.approx([-1.35, 0.0])


def test_ripo_clip_scales_with_one_over_sqrt_of_the_old_probability() -> None:
    # δ = 0.02: π_old = 0.01 -> ε = sqrt(2) = 1.414214; π_old = 0.5 -> ε = sqrt(0.04) = 0.2
    old = torch.log(torch.tensor([0.01, 0.5]))
    bounds = CLIP_RULES["ripo"](clip_inputs(old, torch.ones(2)), delta=0.02)
    assert bounds.high.tolist() == pytest.approx([math.sqrt(2), 0.2])
    # r = 2, A = 1: the rare token is inside its region (2 < 2.414), the common one is clipped at 1.2
    s = POLICY_LOSSES["ppo"](old + LN(2), old, torch.ones(2), clip_low=bounds.low, clip_high=bounds.high)
    assert s.loss.tolist() == pytest.approx([-2.0, -1.2])
    # per step the old probability is the step's geometric mean: sqrt(0.01·0.5) = 0.070711 -> ε = 0.531829
    steps = CLIP_RULES["ripo"](clip_inputs(old, torch.ones(2), segment_ids=torch.zeros(2, dtype=torch.long)))
    assert steps.high.tolist() == pytest.approx([math.sqrt(0.02 / math.sqrt(0.005))] * 2)


def test_stale_clip_shrinks_only_the_endpoint_the_advantage_pushes_towards() -> None:
    # tokens 0, 1: trainer 0.5 vs engine 0.4 (d = ln 1.25 > 0), A = +1 and −1
    # tokens 2, 3: trainer 0.4 vs engine 0.5 (d = ln 0.8 < 0), A = −1 and +1
    # A > 0, d > 0: 1 + ε_high' = 1.28 / 1.25 = 1.024 -> ε_high' = 0.024 (token 0)
    # A < 0, d < 0: 1 − ε_low' = min(0.8 · 1.25, 1) = 1 -> ε_low' = 0 (token 2); tokens 1 and 3 keep (0.2, 0.28)
    old = torch.log(torch.tensor([0.5, 0.5, 0.4, 0.4]))
    behaviour = torch.log(torch.tensor([0.4, 0.4, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    bounds = CLIP_RULES["stale"](clip_inputs(old, adv, behaviour_logp=behaviour))
    assert bounds.high.tolist() == pytest.approx([0.024, 0.28, 0.28, 0.28], abs=1e-6)
    assert bounds.low.tolist() == pytest.approx([0.2, 0.2, 0.0, 0.2], abs=1e-6)
    with pytest.raises(ValueError, match="engine"):
        CLIP_RULES["stale"](clip_inputs(old, adv))


def test_dppo_masks_tokens_that_moved_more_than_delta_outwards() -> None:
    # π_old = 0.5; π_θ = [0.7, 0.55, 0.7, 0.3], A = [1, 1, −1, −1], δ = 0.1
    # sgn(A)·(π − π_old) = [0.2, 0.05, −0.2, 0.2] -> masked [T, F, F, T] (token 2 moves back: kept)
    # L = −r·A = [−1.4, −1.1, 1.4, 0.6]; d/dlogp = −A·r on kept tokens = [0, −1.1, 1.4, 0]
    logp = torch.log(torch.tensor([0.7, 0.55, 0.7, 0.3])).requires_grad_()
    s = POLICY_LOSSES["dppo"](logp, torch.full((4,), LN(0.5)), torch.tensor([1.0, 1.0, -1.0, -1.0]), delta=0.1)
    s.loss.sum().backward()
    assert s.clipped.tolist() == [True, False, False, True]
    assert s.loss.tolist() == pytest.approx([-1.4, -1.1, 1.4, 0.6])
    assert logp.grad.tolist() == pytest.approx([0.0, -1.1, 1.4, 0.0])
    with pytest.raises(ValueError, match="ratio 'token'"):
        POLICY_LOSSES["dppo"](logp, logp.detach(), torch.ones(4), Segments("step", step_ids=torch.zeros(4).long()))


def test_drpo_gradient_fades_to_zero_at_the_tv_boundary_and_reverses_beyond() -> None:
    # π_old = 0.5, δ = 0.1, L = −r A + |A| π_old (r − 1)² / (2δ);  dL/dlogp = r · (−A + |A| π_old (r − 1)/δ)
    # A = 1:  π = 0.55 (r 1.1): L = −1.1 + 0.5·0.01/0.2 = −1.075, grad 1.1·(−1 + 0.5) = −0.55
    #         π = 0.6  (r 1.2): on the boundary, grad 1.2·(−1 + 1) = 0;  π = 0.7 (r 1.4): grad 1.4·(−1 + 2) = 1.4
    # A = −2: π = 0.4  (r 0.8): L = 1.6 + 2·0.5·0.04/0.2 = 1.8, grad 0.8·(2 − 2) = 0 (the lower boundary)
    logp = torch.log(torch.tensor([0.55, 0.6, 0.7, 0.4])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0])
    s = POLICY_LOSSES["drpo"](logp, torch.full((4,), LN(0.5)), adv, delta=0.1)
    s.loss.sum().backward()
    assert s.loss.tolist()[0] == pytest.approx(-1.075)
    assert s.loss.tolist()[3] == pytest.approx(1.8)
    assert logp.grad.tolist() == pytest.approx([-0.55, 0.0, 1.4, 0.0], abs=1e-5)
    assert [s.clipped[0].item(), s.clipped[2].item()] == [False, True]  # (1 and 3 sit on the boundary)


def test_cppo_position_weights_and_prefix_budget() -> None:
    # π_old = 0.5 everywhere, A = +1, w_min = 0.5, δ = 0.1, δ_b = 0.1
    # traj 0 (3 tokens): π = [0.58, 0.62, 0.68], d = [0.08, 0.12, 0.18], w = [1, 0.75, 0.5], w·d = [0.08, 0.09, 0.09]
    #   no token exceeds δ pointwise (DPPO with δ = 0.1 would mask tokens 1 and 2), but the prefix budget
    #   D = [0.08, 0.17/1.75 = 0.097143, 0.26/2.25 = 0.115556] passes δ_b at token 2 -> masked [F, F, T]
    # traj 1 (2 tokens): π = [0.62, 0.45]: w = [1, 0.5]; token 0: w·d = 0.12 > δ -> masked; token 1 moves
    #   inwards (π < π_old with A > 0) -> kept
    logp = torch.log(torch.tensor([0.58, 0.62, 0.68, 0.62, 0.45])).requires_grad_()
    traj = torch.tensor([0, 0, 0, 1, 1])
    s = POLICY_LOSSES["cppo"](logp, torch.full((5,), LN(0.5)), torch.ones(5), Segments(traj_ids=traj), delta=0.1,
                              min_weight=0.5, prefix_delta=0.1)
    assert s.clipped.tolist() == [False, False, True, True, False]
    dppo = POLICY_LOSSES["dppo"](logp, torch.full((5,), LN(0.5)), torch.ones(5), delta=0.1)
    assert dppo.clipped.tolist() == [False, True, True, True, False]
    s.loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.16, -1.24, 0.0, 0.0, -0.9])


def test_kl_clip_bounds_the_ratio_where_r_minus_1_minus_log_r_reaches_delta() -> None:
    # δ = 0.02: r − 1 − log r = 0.02 at r = 0.813105 and r = 1.213550 (bisection) -> ε_low 0.186895, ε_high 0.213550
    bounds = CLIP_RULES["kl"](clip_inputs(torch.zeros(1), torch.ones(1)), delta=0.02)
    assert (bounds.low, bounds.high) == pytest.approx((1 - 0.8131051, 0.2135497), abs=1e-6)
    for r in (1 - bounds.low, 1 + bounds.high):
        assert r - 1 - math.log(r) == pytest.approx(0.02, abs=1e-12)


def test_gold_probabilities_match_an_unpadded_forward_of_each_row(tiny_model_dir) -> None:
    # the fast path (left padding, position ids, only the answer's logits) against its slow twin: one full forward
    # per row, no padding, log-softmax everywhere
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(10, 3000, (n,), generator=g).numpy() for n in (3, 11, 6)]
    golds = [torch.randint(10, 3000, (n,), generator=g).numpy() for n in (4, 1, 2)]
    fast = gold_probabilities(model, contexts, golds, batch_size=3)
    slow = []
    with torch.no_grad():
        for context, gold in zip(contexts, golds):
            ids = torch.as_tensor(np.concatenate([context, gold]).astype(np.int64))[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            answer = logp[len(context) - 1 : len(context) - 1 + len(gold)]
            picked = answer.gather(-1, torch.as_tensor(gold)[:, None].long())
            slow.append(math.exp(float(picked.mean())))
    assert fast.tolist() == pytest.approx(slow, rel=1e-4)
