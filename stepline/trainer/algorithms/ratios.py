"""Importance ratios π_θ/π_old at the token, step and sequence level.

Every registered function: `fn(logp [N], old_logp [N], *, step_ids [N], traj_ids [N], mask [N] | None)
-> ratio [N]`, differentiable in `logp` (the old log-probs are treated as constants). Step and sequence
ratios are one value per segment, broadcast back to the segment's tokens, so clipping them token by
token clips the segment as one unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import segment_cumsum, segment_mean, segment_sum

# exp(±20) ≈ 4.9e8: far beyond any clip range, yet never inf (verl clamps each token's log-ratio the same way).
LOG_RATIO_LIMIT = 20.0
# The mean log-ratio of a step or sequence is capped above at 10 (exp(10) ≈ 2.2e4), as verl caps GSPO's
# combined sequence log-ratio; beyond it the ratio is constant, so it carries no gradient.
SEGMENT_LOG_RATIO_CAP = 10.0


def _log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def segment_ratio(logp: Tensor, old_logp: Tensor, segment_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Geometric mean of the token ratios of each segment, broadcast to its tokens:

    r_seg = exp( min( (1/|seg|) Σ_{t∈seg, mask_t} (log π_θ(t) − log π_old(t)), 10 ) ),  [N] -> [N].
    Masked tokens neither enter the mean nor need a sensible value (NaN there stays out). The cap at 10
    is verl's for GSPO (zero gradient beyond it): with A < 0 an unbounded ratio is an unbounded loss.
    """
    if logp.numel() == 0:
        return logp
    num = int(segment_ids.max()) + 1
    mean = segment_mean(_log_ratio(logp, old_logp), segment_ids, num, mask)
    return torch.exp(mean.clamp(max=SEGMENT_LOG_RATIO_CAP))[segment_ids]


def token_ratio(
    logp: Tensor, old_logp: Tensor, *, step_ids: Tensor | None = None, traj_ids: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """PPO per-token ratio (Schulman et al. 2017): r_t = exp(log π_θ(a_t|s_t) − log π_old(a_t|s_t)), [N]."""
    return torch.exp(_log_ratio(logp, old_logp))


def step_ratio(
    logp: Tensor, old_logp: Tensor, *, step_ids: Tensor, traj_ids: Tensor | None = None, mask: Tensor | None = None
) -> Tensor:
    """Per-step ratio: the geometric mean of the step's token ratios (StepPO; GSPO's rule applied to a
    step instead of a whole response), clipped as one unit. A step is the unit of credit, so it is
    also the unit of the off-policy correction (docs/architecture.md §3). [N] -> [N]."""
    return segment_ratio(logp, old_logp, step_ids, mask)


def sequence_ratio(
    logp: Tensor, old_logp: Tensor, *, step_ids: Tensor | None = None, traj_ids: Tensor, mask: Tensor | None = None
) -> Tensor:
    """GSPO sequence ratio (Zheng et al. 2025, Group Sequence Policy Optimization):
    s_i = exp( (1/|y_i|) Σ_t log(π_θ(y_i,t)/π_old(y_i,t)) ) over all action tokens of trajectory i. [N] -> [N]."""
    return segment_ratio(logp, old_logp, traj_ids, mask)


def _masked_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor | None) -> Tensor:
    log_r = _log_ratio(logp, old_logp)
    return log_r if mask is None else torch.where(mask.bool(), log_r, torch.zeros_like(log_r))


def turn_ratio(
    logp: Tensor, old_logp: Tensor, *, step_ids: Tensor, traj_ids: Tensor | None = None, mask: Tensor | None = None
) -> Tensor:
    """MPO's complete-turn ratio (the paper "Multi-scale Policy Optimisation for long-horizon
    agents"): the value of every token's ratio is the whole turn's likelihood ratio, but the other
    tokens' factors are stop-gradient, so token j keeps its own score gradient:

    r_j = sg( Π_{k∈turn(j), k≠j} r_k ) · r_j = exp( sg(Σ_{k≠j} log r_k) + log r_j ),  capped at e^10.
    Unlike `step` (the geometric mean, a length-normalised ratio), this is the product: the turn's exact
    probability ratio, so the clip acts on the turn as a whole. [N] -> [N]; masked tokens count as r = 1.
    """
    if logp.numel() == 0:
        return logp
    log_r = _masked_log_ratio(logp, old_logp, mask)
    total = segment_sum(log_r, step_ids, int(step_ids.max()) + 1)[step_ids]
    return torch.exp(((total - log_r).detach() + log_r).clamp(max=SEGMENT_LOG_RATIO_CAP))


def prefix_ratio(
    logp: Tensor, old_logp: Tensor, *, step_ids: Tensor | None = None, traj_ids: Tensor, mask: Tensor | None = None
) -> Tensor:
    """EPIC's prefix ratio (the paper "Exact-KL Prefix Importance ratio Clipping"; the
    cumulative prefix ratio is also the "theoretically rigorous" correction of MinPRO, arXiv:2601.22718):

    r_{≤t} = Π_{k≤t} π_θ(y_k)/π_old(y_k) = exp( Σ_{k≤t} log r_k ),  capped above at e^10 (no gradient beyond)
    over the trajectory's action tokens in order (observation tokens come from the environment, ratio 1).
    It feels the drift of the whole prefix a token was sampled after (token ratios do not), yet keeps a
    value per position (GSPO's sequence ratio does not). Gradient flows into every earlier token. Tokens
    of a call shared by forks train once, under their owning trajectory (docs/architecture.md §2), so a fork's
    prefix starts after them. [N] -> [N]; masked tokens count as r = 1.
    """
    if logp.numel() == 0:
        return logp
    log_r = _masked_log_ratio(logp, old_logp, mask)
    cumulative = segment_cumsum(log_r, traj_ids)
    return torch.exp(cumulative.clamp(-LOG_RATIO_LIMIT, SEGMENT_LOG_RATIO_CAP))


RATIOS: dict[str, Callable[..., Tensor]] = {
    "token": token_ratio,
    "step": step_ratio,
    "sequence": sequence_ratio,
    "turn": turn_ratio,
    "prefix": prefix_ratio,
}
