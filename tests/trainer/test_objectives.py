"""Policy losses by name (CISPO, GMPO), SAPO's conditional KL, IcePop and sequence-level MIS, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from stepline.trainer.algorithms import (
    POLICY_LOSSES,
    Segments,
    clipped_surrogate,
    icepop_weights,
    mis_weights,
    ppo_loss,
    sapo_kl_term,
)

torch.set_num_threads(1)
LN = math.log


def test_ppo_loss_is_the_clipped_surrogate_of_its_ratio_level() -> None:
    logp = torch.tensor([LN(1.5), LN(0.5)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    s = ppo_loss(logp, torch.zeros(2), adv)
    assert torch.allclose(s.loss, clipped_surrogate(torch.tensor([1.5, 0.5]), adv).loss)
    assert s.ratio.tolist() == pytest.approx([1.5, 0.5])


def test_cispo_clips_the_weight_and_keeps_every_gradient() -> None:
    # r = [1.5, 1, 0.5], A = [1, 1, -1]; w = sg(clip(r, 0.8, 1.28)) = [1.28, 1, 0.8]
    # L = −w·A·log π = [−1.28·ln 1.5, −1·0, 0.8·ln 0.5] = [−0.518987, 0, −0.554518]; dL/dlogp = −w·A
    logp = torch.tensor([LN(1.5), 0.0, LN(0.5)], requires_grad=True)
    s = POLICY_LOSSES["cispo"](logp, torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]))
    s.loss.sum().backward()
    assert s.loss.tolist() == pytest.approx([-1.28 * LN(1.5), 0.0, 0.8 * LN(0.5)], abs=1e-6)
    assert logp.grad.tolist() == pytest.approx([-1.28, -1.0, 0.8])  # PPO would give 0 for tokens 0 and 2
    assert s.clipped.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="dual_clip"):
        POLICY_LOSSES["cispo"](logp, torch.zeros(3), torch.ones(3), dual_clip=3.0)


def test_gmpo_geometric_mean_of_log_space_clipped_ratios() -> None:
    traj = torch.zeros(2, dtype=torch.long)
    # A = +1, log r = [0.6, −0.1], ε = 0.4: ℓ = [min(0.6, 0.4), −0.1] = [0.4, −0.1]; mean 0.15
    # ρ = e^0.15 = 1.161834, L = −ρ per token; d(ΣL)/dlogp = [0 (clipped), −2·ρ/2] = [0, −1.161834]
    logp = torch.tensor([0.6, -0.1], requires_grad=True)
    s = POLICY_LOSSES["gmpo"](logp, torch.zeros(2), torch.ones(2), Segments("sequence", traj_ids=traj),
                              clip_low=0.4, clip_high=0.4)
    s.loss.sum().backward()
    assert s.loss.tolist() == pytest.approx([-math.exp(0.15)] * 2)
    assert logp.grad.tolist() == pytest.approx([0.0, -math.exp(0.15)])
    assert s.clipped.tolist() == [True, False]
    # A = −1, log r = [−0.6, 0.1]: ℓ = max(log r, clip) = [−0.4, 0.1]; mean −0.15; L = +e^−0.15 = 0.860708
    per_traj = Segments("sequence", traj_ids=traj)
    neg = POLICY_LOSSES["gmpo"](torch.tensor([-0.6, 0.1]), torch.zeros(2), -torch.ones(2), per_traj,
                                clip_low=0.4, clip_high=0.4)
    assert neg.loss.tolist() == pytest.approx([math.exp(-0.15)] * 2)
    # the A < 0 side is not clipped upwards: log r = [0.6, −0.1] keeps 0.6; mean 0.25 -> L = e^0.25 = 1.284025
    up = POLICY_LOSSES["gmpo"](torch.tensor([0.6, -0.1]), torch.zeros(2), -torch.ones(2), per_traj,
                               clip_low=0.4, clip_high=0.4)
    assert up.loss.tolist() == pytest.approx([math.exp(0.25)] * 2)


def test_sapo_term_acts_only_on_positive_tokens_below_tau() -> None:
    # r = [0.5, 0.5, 1.5, 0.9], A = [1, −1, 1, 1], τ = 0.8: only token 0 (A > 0, r < τ) -> ln 0.5 = −0.693147
    logp = torch.tensor([LN(0.5), LN(0.5), LN(1.5), LN(0.9)], requires_grad=True)
    term = sapo_kl_term(logp, torch.zeros(4), torch.tensor([1.0, -1.0, 1.0, 1.0]), tau=0.8)
    assert term.tolist() == pytest.approx([LN(0.5), 0.0, 0.0, 0.0])
    # in the loss with γ = 0.1: −γ·term = +0.0693 (a penalty); its gradient −0.1 raises log π of token 0
    (-0.1 * term).sum().backward()
    assert logp.grad.tolist() == pytest.approx([-0.1, 0.0, 0.0, 0.0])


def test_icepop_masks_tokens_outside_the_band() -> None:
    # ρ = [0.4, 1, 3, 6] in [0.5, 5]? -> [0 (too low), 1, 3, 0 (too high)]; TIS at C = 5 would keep all four
    w = icepop_weights(torch.tensor([LN(0.4), 0.0, LN(3.0), LN(6.0)]), torch.zeros(4), low=0.5, high=5.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, 3.0, 0.0])
    with pytest.raises(ValueError, match="low < high"):
        icepop_weights(torch.zeros(1), torch.zeros(1), low=2.0, high=1.0)


def test_mis_rejects_whole_sequences_whose_product_ratio_exceeds_the_cap() -> None:
    # trajectory 0: ρ = 1.2 · 1.5 = 1.8 ≤ 2 -> 1.8 on each token (its masked NaN token is left out)
    # trajectory 1: ρ = 1.5 · 1.5 = 2.25 > 2 -> rejected, 0 on each token
    target = torch.tensor([LN(1.2), LN(1.5), float("nan"), LN(1.5), LN(1.5)], dtype=torch.float64)
    seg = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([True, True, False, True, True])
    w = mis_weights(target, torch.zeros(5, dtype=torch.float64), cap=2.0, segment_ids=seg, mask=mask)
    assert w.dtype == torch.float64
    assert w.tolist() == pytest.approx([1.8, 1.8, 1.8, 0.0, 0.0])
