"""Next-token sampling: truncation rules, the logprob definition, inverse-CDF draws, batch = one-row twin."""

from __future__ import annotations

import math

import torch

from stepline.engine.sampling import sample_batch, sample_token, truncate_top_k_top_p


def test_top_k_top_p_per_row() -> None:
    sorted_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4, dtype=torch.float64)
    top_k = torch.tensor([-1, 3, 1, 0])
    top_p = torch.tensor([0.7, 1.0, 0.9, 1e-6], dtype=torch.float64)
    # Mass before each token: 0, 0.5, 0.8, 0.95.
    assert truncate_top_k_top_p(sorted_probs, top_k, top_p).tolist() == [
        [0.5, 0.3, 0.0, 0.0],  # top_p 0.7: mass before < 0.7 keeps the first two
        [0.5, 0.3, 0.15, 0.0],  # top_k 3
        [0.5, 0.0, 0.0, 0.0],  # top_k 1 wins over top_p 0.9
        [0.5, 0.0, 0.0, 0.0],  # a tiny top_p still keeps the most likely token
    ]


def test_logprob_is_of_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    # Greedy: argmax 0, logprob = 2 - log(e^2 + e + 1) = 2 - log(11.107) = -0.40761.
    token, logprob = sample_token(logits, temperature=0.0, top_k=-1, top_p=1.0, u=0.9)
    assert token == 0 and math.isclose(logprob, -0.40761, abs_tol=1e-5)
    # T=2: logits/2 = [1, 0.5, 0] -> probs e/5.3670 = 0.5065, 1.6487/5.3670 = 0.3072, 1/5.3670 = 0.1863.
    # top_k=2 keeps [0.5065, 0.3072] (total 0.8137), sorted. u=0.7 -> 0.5696 lies past 0.5065: token 1, whose
    # logprob is 0.5 - log(5.3670) = -1.18027 (the truncation does not change it). u=0.5 -> 0.4069: token 0.
    token, logprob = sample_token(logits, 2.0, 2, 1.0, u=0.7)
    assert token == 1 and math.isclose(logprob, -1.18027, abs_tol=1e-5)
    assert sample_token(logits, 2.0, 2, 1.0, u=0.5)[0] == 0


def test_inverse_cdf_draws_follow_the_probabilities() -> None:
    logits = torch.tensor([math.log(0.2), math.log(0.3), math.log(0.5)]).repeat(1000, 1)
    u = (torch.arange(1000) + 0.5) / 1000  # an even grid over [0, 1)
    ones = torch.ones(1000)
    tokens, _ = sample_batch(logits, ones, torch.full((1000,), -1), ones, u)
    # Id order: token 0 takes u < 0.2, token 1 the next 0.3, token 2 the rest.
    assert torch.bincount(tokens, minlength=3).tolist() == [200, 300, 500]
    assert tokens[199] == 0 and tokens[200] == 1 and tokens[499] == 1 and tokens[500] == 2
    # With top_p 0.9 the draw goes over tokens sorted by probability: 2 (0.5), 1 (0.3), 0 (0.2 kept:
    # mass before it is 0.8 < 0.9), so token 2 now takes u < 0.5.
    tokens, _ = sample_batch(logits, ones, torch.full((1000,), -1), torch.full((1000,), 0.9), u)
    assert torch.bincount(tokens, minlength=3).tolist() == [200, 300, 500]
    assert tokens[0] == 2 and tokens[499] == 2 and tokens[500] == 1


def test_batch_agrees_with_the_one_row_twin() -> None:
    g = torch.Generator().manual_seed(0)
    rows = 64
    logits = torch.randn(rows, 300, generator=g) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7] * (rows // 4))
    top_k = torch.tensor([-1, 5, 0, 40] * (rows // 4))
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * (rows // 4))
    u = torch.rand(rows, generator=g)
    tokens, logprobs = sample_batch(logits, temperature, top_k, top_p, u)
    for i in range(rows):
        token, logprob = sample_token(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(u[i]))
        assert int(tokens[i]) == token, i
        assert math.isclose(float(logprobs[i]), logprob, abs_tol=1e-5)
