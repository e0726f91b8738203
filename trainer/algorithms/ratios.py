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

from trainer.algorithms._segments import segment_mean

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


RATIOS: dict[str, Callable[..., Tensor]] = {
    "token": token_ratio,
    "step": step_ratio,
    "sequence": sequence_ratio,
}
