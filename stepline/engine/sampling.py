"""Next-token sampling: pure functions of logits and uniform draws.

The logprob returned with a token is that of the distribution the engine sampled from *after
temperature* and *before* top-k/top-p truncation:

    logprob(t) = log_softmax(logits / T)[t]        T > 0
    logprob(t) = log_softmax(logits)[t]            T == 0 (greedy: argmax of the raw logits)

so a trainer reproduces it with a teacher-forced forward and the same temperature. Top-k/top-p only
restrict which tokens may be drawn (as in SGLang, whose returned logprobs ignore them too).

A token is drawn by inverse CDF from one uniform number u in [0, 1) per sequence: over the vocabulary
in id order, or, when top-k/top-p truncate, over the tokens sorted by probability. (Id order keeps a
draw stable under the ~1e-7 logit noise between a batched and an unbatched forward; sorting
near-equal probabilities would reorder them.) The caller draws u from the sequence's own torch.Generator, so a seeded
sequence samples the same tokens whatever else shares its batch. `sample_batch` is the fast path
for a whole batch; `sample_token` its obvious one-row twin (a test checks they agree).
"""

from __future__ import annotations

import torch

__all__ = ["sample_batch", "sample_token", "truncate_top_k_top_p"]


def truncate_top_k_top_p(sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of probabilities sorted in descending order: beyond top_k, and beyond the nucleus.

    sorted_probs: [B, V]; top_k: [B] long (<= 0: no limit); top_p: [B] float (>= 1: no cut).
    Token i of a row stays while i < top_k and the mass strictly before it is < top_p (Holtzman et al.,
    2020). The most likely token always stays, so no row is all zero. Returns [B, V], unnormalised.
    """
    rank = torch.arange(sorted_probs.shape[-1]).expand_as(sorted_probs)
    k = torch.where(top_k > 0, top_k, sorted_probs.shape[-1])[:, None]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (rank < k) & (mass_before < top_p[:, None])
    keep[:, 0] = True
    return sorted_probs * keep


def sample_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [B, V]; temperature, top_p, u: [B] float; top_k: [B] long.

    Rows with temperature 0 are greedy (u unused). Returns (tokens [B] long, logprobs [B] float).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(logits / scale, dim=-1)  # [B, V]
    truncated = (top_k > 0) | (top_p < 1.0)
    if not bool(greedy.any() | truncated.any()):  # the common case: plain sampling for every row
        tokens = _inverse_cdf(logprobs.exp(), u)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
    tokens = logits.argmax(dim=-1)
    plain = (~greedy & ~truncated).nonzero()[:, 0]
    if len(plain):
        tokens[plain] = _inverse_cdf(logprobs[plain].exp(), u[plain])
    cut = (~greedy & truncated).nonzero()[:, 0]
    if len(cut):
        sorted_lp, order = logprobs[cut].sort(dim=-1, descending=True)
        weights = truncate_top_k_top_p(sorted_lp.exp(), top_k[cut], top_p[cut])
        tokens[cut] = order.gather(1, _inverse_cdf(weights, u[cut])[:, None])[:, 0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of weights [B, V] (unnormalised), the index i with cdf[i-1] <= u * total < cdf[i]."""
    cdf = weights.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return index.clamp(max=cdf.shape[-1] - 1)[:, 0]


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> tuple[int, float]:
    """One row [V], step by step: the reference for `sample_batch`. Returns (token_id, logprob)."""
    logits = logits.float()
    if temperature <= 0:
        token = int(logits.argmax())
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if top_k <= 0 and top_p >= 1.0:
        probs, order = logprobs.exp(), torch.arange(len(logits))
    else:
        probs, order = logprobs.exp().sort(descending=True)
    total, cumulative = 0.0, []
    for i, p in enumerate(probs.tolist()):
        mass_before = total
        keep = i == 0 or ((top_k <= 0 or i < top_k) and mass_before < top_p)
        total += p
        cumulative.append(p if keep else 0.0)
    cdf = torch.tensor(cumulative).cumsum(0)
    index = min(int((cdf <= u * float(cdf[-1])).sum()), len(cdf) - 1)
    token = int(order[index])
    return token, float(logprobs[token])
