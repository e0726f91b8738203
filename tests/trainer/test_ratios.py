"""Importance ratios against hand-computed values; gradients reach every token of a unit."""

from __future__ import annotations

import math

import torch

from stepline.trainer.algorithms import RATIOS

torch.set_num_threads(1)

# five tokens: step 0 = tokens 0-1, step 1 = tokens 2-4; trajectory 0 = all of them
OLD = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
LOG_RATIO = torch.tensor([0.2, -0.4, 0.3, 0.0, 0.6])
STEP_IDS = torch.tensor([0, 0, 1, 1, 1])
TRAJ_IDS = torch.zeros(5, dtype=torch.long)


def ratios(name: str, mask: torch.Tensor | None = None, logp: torch.Tensor | None = None) -> torch.Tensor:
    logp = OLD + LOG_RATIO if logp is None else logp
    return RATIOS[name](logp, OLD, step_ids=STEP_IDS, traj_ids=TRAJ_IDS, mask=mask)


def test_token_ratio() -> None:
    assert torch.allclose(ratios("token"), LOG_RATIO.exp())


def test_step_ratio_is_geometric_mean_broadcast() -> None:
    # step 0: mean(0.2, -0.4) = -0.1 -> e^-0.1 = 0.904837; step 1: mean(0.3, 0, 0.6) = 0.3 -> e^0.3 = 1.349859
    expected = torch.tensor([math.exp(-0.1)] * 2 + [math.exp(0.3)] * 3)
    assert torch.allclose(ratios("step"), expected, atol=1e-6)


def test_sequence_ratio_gspo() -> None:
    # mean over all five: (0.2 - 0.4 + 0.3 + 0 + 0.6) / 5 = 0.14 -> e^0.14 = 1.150274
    assert torch.allclose(ratios("sequence"), torch.full((5,), math.exp(0.14)), atol=1e-6)


def test_masked_tokens_do_not_enter_the_mean() -> None:
    # mask token 4: step 1 = mean(0.3, 0) = 0.15; sequence = (0.2 - 0.4 + 0.3 + 0) / 4 = 0.025
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    assert torch.allclose(ratios("step", mask)[2:4], torch.full((2,), math.exp(0.15)), atol=1e-6)
    assert torch.allclose(ratios("sequence", mask)[:4], torch.full((4,), math.exp(0.025)), atol=1e-6)


def test_ratios_start_at_one_on_policy() -> None:
    for name in RATIOS:
        assert torch.allclose(ratios(name, logp=OLD.clone()), torch.ones(5)), name


def test_step_ratio_gradient_reaches_every_token_of_the_step() -> None:
    # d r_step / d logp_t = r_step / |step| for each token t of the step; nothing flows into old_logp
    logp = (OLD + LOG_RATIO).requires_grad_()
    old = OLD.clone().requires_grad_()
    r = RATIOS["step"](logp, old, step_ids=STEP_IDS, traj_ids=TRAJ_IDS)
    r[0].backward()  # step 0 only
    assert torch.allclose(logp.grad, torch.tensor([math.exp(-0.1) / 2] * 2 + [0.0] * 3), atol=1e-6)
    assert old.grad is None


def test_huge_log_ratios_stay_finite() -> None:
    r = RATIOS["token"](torch.tensor([0.0]), torch.tensor([-1000.0]))
    assert torch.isfinite(r).all()
