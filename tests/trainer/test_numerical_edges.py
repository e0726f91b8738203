"""Numerical edges found by checking against verl: k3 clamp, GSPO's capped log-ratio, masked NaN/inf
selected away, and the IS weights keeping float64. Each fails where that guard is removed."""

from __future__ import annotations

import math

import pytest
import torch

from stepline.trainer.algorithms import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    decoupled_weights,
    kl_penalty,
    masked_mean,
    sequence_ratio,
    step_ratio,
    truncated_is_weights,
)

torch.set_num_threads(1)


def test_k3_is_clamped_to_ten_with_no_gradient_outside() -> None:
    # log r = ref − logp.  logp − ref = −1: k3 = e − 1 − 1 = 0.71828, dk3/dlogp = 1 − e = −1.71828
    # logp − ref = −3: e³ − 1 − 3 = 16.09 > 10 -> 10, gradient 0;  −15: e^15 − 16 = 3.27e6 -> 10, gradient 0
    logp = torch.tensor([-1.0, -3.0, -15.0], dtype=torch.float64, requires_grad=True)
    k3 = kl_penalty(logp, torch.zeros(3, dtype=torch.float64), "k3")
    k3.sum().backward()
    assert k3.tolist() == pytest.approx([math.e - 2, 10.0, 10.0], abs=1e-12)
    assert logp.grad.tolist() == pytest.approx([1 - math.e, 0.0, 0.0], abs=1e-12)


def test_gspo_sequence_log_ratio_is_capped_at_ten() -> None:
    # one trajectory, log-ratios 6 and 18: mean 12 > 10 -> s = e^10 (not e^12 = 1.6e5), no gradient.
    # A = −0.5: L = max(0.5·s, 0.5·1.28) = 0.5·e^10 = 11013.2 per token (e^12 would give 81377)
    logp = torch.tensor([6.0, 18.0], dtype=torch.float64, requires_grad=True)
    traj = torch.zeros(2, dtype=torch.long)
    ratio = sequence_ratio(logp, torch.zeros(2, dtype=torch.float64), traj_ids=traj)
    loss = clipped_surrogate(ratio, torch.full((2,), -0.5, dtype=torch.float64)).loss
    loss.sum().backward()
    assert ratio.tolist() == pytest.approx([math.exp(10)] * 2)
    assert loss.tolist() == pytest.approx([0.5 * math.exp(10)] * 2)
    assert logp.grad.tolist() == [0.0, 0.0]
    # below the cap the gradient flows: log-ratios 1 and 3, mean 2, ds/dlogp_t = e²/2 per token
    below = torch.tensor([1.0, 3.0], dtype=torch.float64, requires_grad=True)
    sequence_ratio(below, torch.zeros(2, dtype=torch.float64), traj_ids=traj)[0].backward()
    assert below.grad.tolist() == pytest.approx([math.exp(2) / 2] * 2)


def test_nan_under_a_false_mask_stays_out_of_the_step_ratio() -> None:
    # step 0 = tokens 0..2, token 2 masked with NaN logprobs: log-ratios 0.5, 0.5 -> r = e^0.5 for the step
    logp = torch.tensor([-1.0, -2.0, float("nan")], requires_grad=True)
    old = torch.tensor([-1.5, -2.5, float("nan")])
    mask = torch.tensor([True, True, False])
    ratio = step_ratio(logp, old, step_ids=torch.zeros(3, dtype=torch.long), mask=mask)
    assert ratio.tolist() == pytest.approx([math.exp(0.5)] * 3)
    ratio[0].backward()
    # d r / d logp_t = r / 2 for the two selected tokens, exactly 0 (not NaN) for the masked one
    assert logp.grad.tolist() == pytest.approx([math.exp(0.5) / 2, math.exp(0.5) / 2, 0.0])


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_inf_and_nan_under_a_false_mask_stay_out_of_aggregate(mode: str) -> None:
    # one step/trajectory/episode of tokens [1, 2, inf], the inf masked: every mean mode gives (1 + 2) / 2,
    # the sum modes 1 + 2 = 3 (one trajectory), the token-sum-norm mode 3 / C with C = 2
    ids = torch.zeros(3, dtype=torch.long)
    mask = torch.tensor([True, True, False])
    for bad in (float("inf"), float("nan")):
        loss = torch.tensor([1.0, 2.0, bad], requires_grad=True)
        out = aggregate(loss, mask, mode, step_ids=ids, traj_ids=ids, episode_ids=ids, token_norm=2)
        expected = 3.0 if mode in ("token-sum", "seq-mean-token-sum") else 1.5
        assert float(out.detach()) == pytest.approx(expected)
        out.backward()
        assert loss.grad[2] == 0.0 and torch.isfinite(loss.grad).all()
    assert float(masked_mean(torch.tensor([1.0, 2.0, float("nan")]), mask)) == pytest.approx(1.5)


@pytest.mark.parametrize("level", ["token", "step"])
def test_is_weights_keep_float64(level: str) -> None:
    # log w = 0.1 exactly representable in float64 only: w = e^0.1 to 1e-15 (float32 would be off by ~5e-8)
    target = torch.tensor([0.1, 0.1], dtype=torch.float64)
    behaviour = torch.zeros(2, dtype=torch.float64)
    seg = torch.zeros(2, dtype=torch.long) if level == "step" else None
    for fn in (truncated_is_weights, decoupled_weights):
        w = fn(target, behaviour, cap=2.0, segment_ids=seg)
        assert w.dtype == torch.float64
        assert w.tolist() == pytest.approx([math.exp(0.1)] * 2, abs=1e-15)
    assert truncated_is_weights(target.float(), behaviour.float()).dtype == torch.float32
    assert truncated_is_weights(target.bfloat16(), behaviour.bfloat16()).dtype == torch.float32
