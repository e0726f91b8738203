"""Next-token sampling for one sequence: pure functions of a logits row.

The logprob returned with a token is that of the distribution the engine sampled from *after
temperature* and *before* top-k/top-p truncation:

    logprob(t) = log_softmax(logits / T)[t]        T > 0
    logprob(t) = log_softmax(logits)[t]            T == 0 (greedy: argmax of the raw logits)

so a trainer reproduces it with a teacher-forced forward and the same temperature. Top-k/top-p only
restrict which tokens may be drawn (as in SGLang, whose returned logprobs ignore them too).
"""

from __future__ import annotations

import torch

__all__ = ["sample_token", "truncate_top_k_top_p"]


def truncate_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside the top-k tokens and outside the smallest nucleus of mass >= top_p.

    probs: [V] (sums to 1). top_k <= 0 means no limit; top_p >= 1 means no nucleus cut. The most likely
    token is always kept, so the result is never all zero. Returns unnormalised [V] weights.
    """
    if top_k <= 0 and top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep token i while the mass strictly before it is < top_p (Holtzman et al., 2020).
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[int, float]:
    """Draw one token from a logits row [V]; return (token_id, logprob) with the logprob defined above."""
    logits = logits.float()
    if temperature <= 0.0 or top_k == 1:
        logprobs = torch.log_softmax(logits if temperature <= 0.0 else logits / temperature, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    weights = truncate_top_k_top_p(logprobs.exp(), top_k, top_p)
    token = int(torch.multinomial(weights, 1, generator=generator))
    return token, float(logprobs[token])
