"""Next-token sampling: the truncation rules and the logprob definition, with hand-computed values."""

from __future__ import annotations

import math

import torch

from stepline.engine.sampling import sample_token, truncate_top_k_top_p


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    # Sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95. Below 0.7: the first two.
    assert truncate_top_k_top_p(probs, top_k=-1, top_p=0.7).tolist() == [0.0, 0.5, 0.0, 0.3]
    # top_k=3 drops only the 0.05 token; both limits together keep the intersection.
    assert truncate_top_k_top_p(probs, top_k=3, top_p=1.0).tolist() == [0.15, 0.5, 0.0, 0.3]
    assert truncate_top_k_top_p(probs, top_k=1, top_p=0.9).tolist() == [0.0, 0.5, 0.0, 0.0]
    # A tiny top_p still keeps the most likely token.
    assert truncate_top_k_top_p(probs, top_k=-1, top_p=1e-6).tolist() == [0.0, 0.5, 0.0, 0.0]


def test_logprob_is_of_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    # Greedy: argmax 0, logprob = 2 - log(e^2 + e + 1) = 2 - log(11.107) = -0.40761.
    token, logprob = sample_token(logits, temperature=0.0, top_k=-1, top_p=1.0, generator=None)
    assert token == 0 and math.isclose(logprob, 2 - math.log(math.e**2 + math.e + 1), abs_tol=1e-6)
    assert math.isclose(logprob, -0.40761, abs_tol=1e-5)
    # T=2: logits/2 = [1, 0.5, 0]; logprob(token 1) = 0.5 - log(e + e^0.5 + 1) = 0.5 - 1.68027 = -1.18027.
    # top_k=2 does not change it: logprobs ignore top-k/top-p truncation.
    seen = {}
    for seed in range(40):
        token, logprob = sample_token(logits, 2.0, 2, 1.0, torch.Generator().manual_seed(seed))
        seen[token] = logprob
    assert set(seen) == {0, 1}  # top_k=2 never draws token 2
    assert math.isclose(seen[1], 0.5 - math.log(math.e + math.e**0.5 + 1), abs_tol=1e-6)
    assert math.isclose(seen[1], -1.18027, abs_tol=1e-5)


def test_a_seeded_generator_reproduces_the_draws() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_token(logits, 1.0, -1, 0.95, g)[0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
