"""Off-policy corrections, KL estimators, entropy and the value loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from stepline.trainer.algorithms import (
    KL_ESTIMATORS,
    RATIOS,
    clipped_surrogate,
    clipped_value_loss,
    decoupled_weights,
    entropy_from_logits,
    fresh_mask,
    kl_penalty,
    logprobs_and_entropy,
    token_logprobs_from_logits,
    truncated_is_weights,
)

torch.set_num_threads(1)

BEHAVIOUR = torch.tensor([-1.0, -2.0, -1.0, -0.5])
TARGET = BEHAVIOUR + torch.tensor([0.5, -0.2, 1.0, 0.1])
STEPS = torch.tensor([0, 0, 1, 1])


def test_tis_per_token_truncates_at_the_cap() -> None:
    # exp(0.5) = 1.648721, exp(-0.2) = 0.818731, exp(1.0) = 2.718 -> capped at 2, exp(0.1) = 1.105171
    w = truncated_is_weights(TARGET.requires_grad_(), BEHAVIOUR, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.648721, 0.818731, 2.0, 1.105171]), atol=1e-6)
    assert not w.requires_grad  # a weight, never a path for gradients


def test_tis_per_step_is_the_geometric_mean() -> None:
    # step 0: mean(0.5, -0.2) = 0.15 -> 1.161834; step 1: mean(1.0, 0.1) = 0.55 -> 1.733253, capped 1.5
    w = truncated_is_weights(TARGET, BEHAVIOUR, cap=1.5, segment_ids=STEPS)
    assert torch.allclose(w, torch.tensor([1.161834, 1.161834, 1.5, 1.5]), atol=1e-6)
    # masking token 2 leaves step 1 = exp(0.1)
    mask = torch.tensor([True, True, False, True])
    assert float(truncated_is_weights(TARGET, BEHAVIOUR, cap=1.5, segment_ids=STEPS, mask=mask)[3]) == pytest.approx(
        math.exp(0.1), abs=1e-6
    )


def test_decoupled_objective_clips_around_the_proximal_policy() -> None:
    # μ (engine) = -1.0, π_prox = -0.8, π_θ = -0.7, A = 1, ε_high = 0.28, cap 2:
    # ratio π_θ/π_prox = e^0.1 = 1.105171 (inside the clip), weight π_prox/μ = e^0.2 = 1.221403
    # loss = -1.221403 · 1.105171 = -1.349859; dL/dlogp = -1.349859 (d ratio/d logp = ratio)
    logp = torch.tensor([-0.7], requires_grad=True)
    prox, behaviour = torch.tensor([-0.8]), torch.tensor([-1.0])
    ratio = RATIOS["token"](logp, prox)
    loss = clipped_surrogate(ratio, torch.ones(1)).loss * decoupled_weights(prox, behaviour, cap=2.0)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(-1.349859, abs=1e-6)
    assert float(logp.grad) == pytest.approx(-1.349859, abs=1e-6)
    # had the clip been centred on μ, the ratio e^0.3 = 1.35 would exceed 1.28 and the gradient vanish


def test_staleness_bound() -> None:
    versions = torch.tensor([5, 4, 3, 2])
    assert fresh_mask(versions, current_version=5, bound=2).tolist() == [True, True, True, False]
    assert fresh_mask(versions, current_version=5, bound=0).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="staleness bound"):
        fresh_mask(versions, 5, -1)


def test_kl_estimators_by_hand() -> None:
    # log π - log π_ref = [0.5, -1.0]; log r = [-0.5, 1.0]
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5]))  # ½·0.25, ½·1
    # k3 = e^{log r} - 1 - log r: e^-0.5 - 1 + 0.5 = 0.106531; e - 1 - 1 = 0.718282
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.allclose(k3, torch.tensor([0.106531, 0.718282]), atol=1e-6)
    # d k3 / d logp = 1 - r: 1 - e^-0.5 = 0.393469; 1 - e = -1.718282
    k3.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([0.393469, -1.718282]), atol=1e-6)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_are_unbiased(kind: str) -> None:
    # exact expectation over a 3-outcome policy p against reference q: Σ_x p(x) k(x) = KL(p ‖ q)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    kl = float((p * (p / q).log()).sum())
    estimate = float((p * KL_ESTIMATORS[kind](p.log(), q.log())).sum())
    assert estimate == pytest.approx(kl, abs=1e-6)


def test_entropy_by_hand() -> None:
    # uniform over 2: ln 2 = 0.693147; p = [0.25, 0.75]: 0.25·ln4 + 0.75·ln(4/3) = 0.346574 + 0.215762
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([0.693147, 0.562335]), atol=1e-6)


def test_chunked_entropy_and_logprobs_equal_unchunked_with_gradients() -> None:
    torch.manual_seed(0)
    logits = torch.randn(10, 7, requires_grad=True)
    ids = torch.randint(0, 7, (10,))
    full = entropy_from_logits(logits, chunk_size=100) + token_logprobs_from_logits(logits, ids, chunk_size=100)
    (g_full,) = torch.autograd.grad(full.sum(), logits)
    part = entropy_from_logits(logits, chunk_size=3) + token_logprobs_from_logits(logits, ids, chunk_size=3)
    (g_part,) = torch.autograd.grad(part.sum(), logits)
    assert torch.allclose(full, part, atol=1e-6) and torch.allclose(g_full, g_part, atol=1e-6)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(token_logprobs_from_logits(logits, ids, chunk_size=4), ref, atol=1e-6)


def test_logprobs_and_entropy_in_one_pass_equal_the_two_helpers() -> None:
    # one pass over logits / T gives what the two helpers give separately; entropy_grad=False: no graph for H
    torch.manual_seed(0)
    logits = torch.randn(10, 7, requires_grad=True)
    ids = torch.randint(0, 7, (10,))
    lp, ent = logprobs_and_entropy(logits, ids, temperature=torch.full((10,), 0.5), chunk_size=3)
    assert torch.allclose(lp, token_logprobs_from_logits(logits / 0.5, ids), atol=1e-6)
    assert ent is not None and ent.requires_grad and torch.allclose(ent, entropy_from_logits(logits / 0.5), atol=1e-6)
    _, detached = logprobs_and_entropy(logits, ids, entropy_grad=False, chunk_size=3)
    assert detached is not None and not detached.requires_grad
    assert logprobs_and_entropy(logits, ids, entropy=False)[1] is None


def test_clipped_value_loss() -> None:
    # V = [1.0, 0.0, 0.6], V_old = 0.5, G = [2, 0, 2], ε = 0.2
    #  0: unclipped (1-2)² = 1; clipped V = 0.5 + 0.2 = 0.7 -> (0.7-2)² = 1.69; ½·max = 0.845, no gradient
    #  1: unclipped 0; clipped V = 0.5 - 0.2 = 0.3 -> 0.09; ½·0.09 = 0.045, no gradient
    #  2: inside the range: ½·(0.6-2)² = 0.98, dL/dV = V - G = -1.4
    values = torch.tensor([1.0, 0.0, 0.6], requires_grad=True)
    old, returns = torch.full((3,), 0.5), torch.tensor([2.0, 0.0, 2.0])
    loss = clipped_value_loss(values, old, returns, clip=0.2)
    loss.sum().backward()
    assert torch.allclose(loss, torch.tensor([0.845, 0.045, 0.98]), atol=1e-6)
    assert torch.allclose(values.grad, torch.tensor([0.0, 0.0, -1.4]), atol=1e-6)
    unclipped = clipped_value_loss(values, old, returns, clip=None)
    assert torch.allclose(unclipped, torch.tensor([0.5, 0.0, 0.98]), atol=1e-6)
