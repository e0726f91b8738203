"""Clipped surrogate (clip-higher, dual-clip) and aggregation modes, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from stepline.trainer.algorithms import AGGREGATIONS, aggregate, clipped_surrogate, count_units, surrogate_stats

torch.set_num_threads(1)

RATIO = [0.5, 1.0, 1.5, 0.5, 1.5, 4.0]
ADV = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])


def surrogate(dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, object]:
    ratio = torch.tensor(RATIO, requires_grad=True)
    s = clipped_surrogate(ratio, ADV, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    s.loss.sum().backward()
    return s.loss.detach(), ratio.grad, s


def test_clip_higher_is_asymmetric() -> None:
    # L = max(-A r, -A clip(r, 0.8, 1.28)):
    #  A=+1 r=0.5: max(-0.5, -0.8) = -0.5 (unclipped, dL/dr = -1)
    #  A=+1 r=1.0: -1 (inside the range, dL/dr = -1)
    #  A=+1 r=1.5: max(-1.5, -1.28) = -1.28 (clipped high at 1 + 0.28, no gradient)
    #  A=-1 r=0.5: max(0.5, 0.8) = 0.8 (clipped low at 1 - 0.2, no gradient)
    #  A=-1 r=1.5: max(1.5, 1.28) = 1.5 (PPO never clips this side, dL/dr = +1)
    #  A=-1 r=4.0: max(4.0, 1.28) = 4.0 (dL/dr = +1)
    loss, grad, s = surrogate(None)
    assert torch.allclose(loss, torch.tensor([-0.5, -1.0, -1.28, 0.8, 1.5, 4.0]))
    assert torch.allclose(grad, torch.tensor([-1.0, -1.0, 0.0, 0.0, 1.0, 1.0]))
    assert s.clipped.tolist() == [False, False, True, True, False, False]
    assert not s.dual_clipped.any()


def test_dual_clip_caps_negative_advantages_and_stops_their_gradient() -> None:
    # c = 3: A=-1 r=4 -> min(4, -3·(-1)) = 3, no gradient; A=-1 r=1.5 -> min(1.5, 3) = 1.5, gradient flows
    loss, grad, s = surrogate(3.0)
    assert torch.allclose(loss, torch.tensor([-0.5, -1.0, -1.28, 0.8, 1.5, 3.0]))
    assert torch.allclose(grad, torch.tensor([-1.0, -1.0, 0.0, 0.0, 1.0, 0.0]))
    assert s.dual_clipped.tolist() == [False] * 5 + [True]
    # positive advantages are never dual-clipped, however large the ratio
    big = clipped_surrogate(torch.tensor([10.0]), torch.tensor([1.0]), dual_clip=3.0)
    assert float(big.loss) == pytest.approx(-1.28) and not big.dual_clipped.any()
    # 2 of 6 PPO-clipped, 1 of 6 dual-clipped
    assert surrogate_stats(s) == pytest.approx({"clip_frac": 2 / 6, "dual_clip_frac": 1 / 6})


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(torch.ones(1), torch.ones(1), dual_clip=0.9)


def test_advantages_get_no_gradient() -> None:
    adv = ADV.clone().requires_grad_()
    clipped_surrogate(torch.tensor(RATIO, requires_grad=True), adv).loss.sum().backward()
    assert adv.grad is None


# Layout: episode 0 = trajectory 0 (step 0: tokens 0-1; step 1: token 2) + a fork, trajectory 1
# (step 2: token 3); episode 1 = trajectory 2 (step 3: tokens 4-5). Token 5 is masked.
LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
MASK = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
IDS = {
    "step_ids": torch.tensor([0, 0, 1, 2, 3, 3]),
    "traj_ids": torch.tensor([0, 0, 0, 1, 2, 2]),
    "episode_ids": torch.tensor([0, 0, 0, 0, 1, 1]),
}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.0),  # (1 + 2 + 3 + 4 + 5) / 5
        ("seq-mean-token-mean", 11 / 3),  # trajectories: mean(1,2,3) = 2, 4, 5 -> 11 / 3
        ("step-mean", 3.375),  # steps: 1.5, 3, 4, 5 -> 13.5 / 4
        ("episode-mean", 3.75),  # episodes: mean(1,2,3,4) = 2.5, 5 -> 7.5 / 2
    ],
)
def test_aggregation_modes(mode: str, expected: float) -> None:
    assert float(aggregate(LOSS, MASK, mode, **IDS)) == pytest.approx(expected)
    assert float(AGGREGATIONS[mode](LOSS, MASK, **IDS)) == pytest.approx(expected)


def test_episode_mean_is_the_default_and_a_forked_episode_weighs_one() -> None:
    # episode 0 has 4 tokens in 3 steps and 2 forks, episode 1 one token; each weighs 1/2
    loss = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert float(aggregate(loss, MASK, **IDS)) == pytest.approx(0.5)


def test_fully_masked_units_do_not_count() -> None:
    mask = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    assert float(aggregate(LOSS, mask, "episode-mean", **IDS)) == pytest.approx(2.5)
    assert count_units(mask, "episode-mean", **IDS) == 1
    assert float(aggregate(LOSS, torch.zeros(6, dtype=torch.bool), "token-mean")) == 0.0


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_with_num_units_sum_to_the_full_loss(mode: str) -> None:
    # split by episode (a micro-batch never splits a unit): tokens 0-3 and 4-5
    full = aggregate(LOSS, MASK, mode, token_norm=3, **IDS)
    units = count_units(MASK, mode, **IDS)
    parts = [slice(0, 4), slice(4, 6)]
    summed = sum(
        aggregate(LOSS[p], MASK[p], mode, num_units=units, token_norm=3, **{k: v[p] for k, v in IDS.items()})
        for p in parts
    )
    assert float(summed) == pytest.approx(float(full))


def test_missing_ids_and_unknown_mode_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="episode_ids"):
        aggregate(LOSS, MASK, "episode-mean")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(LOSS, MASK, "sum")


def test_sum_aggregations_by_hand() -> None:
    # trajectory 0 = tokens [1, 2, 3], trajectory 1 = tokens [4, 5 (masked)]; C = 4 (the constant of Dr. GRPO)
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([True, True, True, True, False])
    traj = torch.tensor([0, 0, 0, 1, 1])
    # token-sum: 1 + 2 + 3 + 4 = 10;  seq-mean-token-sum: (6 + 4) / 2 = 5;  sum-norm: (6/4 + 4/4) / 2 = 1.25
    assert float(aggregate(loss, mask, "token-sum")) == pytest.approx(10.0)
    assert float(aggregate(loss, mask, "seq-mean-token-sum", traj_ids=traj)) == pytest.approx(5.0)
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", traj_ids=traj, token_norm=4)) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="token_norm"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", traj_ids=traj)
    # micro-batches: each trajectory alone with the minibatch's unit count adds up to the whole
    for mode in ("token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        units = count_units(mask, mode, traj_ids=traj)
        whole = aggregate(loss, mask, mode, traj_ids=traj, token_norm=4)
        parts = sum(aggregate(loss[s], mask[s], mode, traj_ids=traj[s], num_units=units, token_norm=4)
                    for s in (slice(0, 3), slice(3, 5)))
        assert float(parts) == pytest.approx(float(whole))
