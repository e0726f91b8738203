"""Policy losses by name (PPO's clipped surrogate, CISPO, GMPO; DPPO, DRPO, CPPO from trust_regions.py)
and SAPO's conditional KL term.

Every registered loss: `fn(logp [N], old_logp [N], advantages [N], seg: Segments, *, clip_low, clip_high,
dual_clip) -> Surrogate` with a per-token loss [N] to aggregate; `seg.level` is the ratio level of RATIOS
(token | step | sequence), so each loss works per token, per step or per trajectory.
Advantages are constants; gradients flow through `logp` only. ε_low/ε_high may be per-token tensors [N]
(CLIP_RULES); a loss's own hyper-parameters (δ of dppo, ...) come as further keywords (policy_loss_args).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import segment_mean
from stepline.trainer.algorithms.losses import TOKENS, Segments, Surrogate, clamp_ratio, clipped_surrogate
from stepline.trainer.algorithms.ratios import LOG_RATIO_LIMIT, RATIOS, SEGMENT_LOG_RATIO_CAP
from stepline.trainer.algorithms.trust_regions import Bound, cppo_loss, dppo_loss, drpo_loss

_SEGMENT = {"step": "step_ids", "sequence": "traj_ids"}


def ppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.2, clip_high: Bound = 0.28, dual_clip: float | None = None,
) -> Surrogate:
    """PPO/DAPO clipped surrogate on the ratio of `seg.level` (see `clipped_surrogate` for the formula)."""
    ratio = segment_ratio(logp, old_logp, seg)
    s = clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    return s._replace(ratio=ratio)


def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.2, clip_high: Bound = 0.28, dual_clip: float | None = None,
) -> Surrogate:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl's "cispo"): clip the importance weight, not the update.

    L_t = −sg( clip(r_t, 1−ε_low, 1+ε_high) ) · A_t · log π_θ(a_t)
    Every token keeps a REINFORCE gradient, scaled by its clipped, detached ratio; PPO instead drops the
    gradient of clipped tokens (often the rare, decisive ones). `clipped`: the weight was clipped.
    """
    if dual_clip is not None:
        raise ValueError("dual_clip applies to the ppo loss only")
    ratio = segment_ratio(logp, old_logp, seg)
    weight = clamp_ratio(ratio.detach(), clip_low, clip_high)
    loss = -weight * advantages.detach() * logp
    clipped = weight != ratio.detach()
    return Surrogate(loss, clipped, torch.zeros_like(clipped), ratio)


def gmpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.4, clip_high: Bound = 0.4, dual_clip: float | None = None,
) -> Surrogate:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673; verl's "geo_mean").

    Per token the log-ratio is clipped in log space on the side the advantage pushes:
      ℓ_t = sgn(A) · min( sgn(A) · log r_t, sgn(A) · clip(log r_t, −ε_low, ε_high) )
    and the segment's ratio is the geometric mean of the clipped token ratios:
      ρ_seg = exp( mean_{t∈seg} ℓ_t ),   L_t = −A_t · ρ_seg(t)
    so one outlier token moves ρ by a factor e^{ℓ/|seg|}, not e^{ℓ} as in the arithmetic mean. The segment is
    the trajectory (level "sequence", the paper's), the step, or the token itself. ε are in log space (the
    paper uses 0.4, i.e. ratios in [e^−0.4, e^0.4]); the mean log-ratio is capped at 10 like the others.
    """
    if dual_clip is not None:
        raise ValueError("dual_clip applies to the ppo loss only")
    adv = advantages.detach()
    log_r = (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    sgn = torch.sign(adv)
    bounded = _clamp_log(log_r, clip_low, clip_high)
    ell = sgn * torch.minimum(sgn * log_r, sgn * bounded)
    if seg.level == "token" or logp.numel() == 0:
        mean = ell
    else:
        ids = {"step": seg.step_ids, "sequence": seg.traj_ids}[seg.level]
        if ids is None:
            raise ValueError(f"gmpo at level {seg.level!r} needs {_SEGMENT[seg.level]}")
        mean = segment_mean(ell, ids, int(ids.max()) + 1, seg.mask)[ids]
    ratio = torch.exp(mean.clamp(max=SEGMENT_LOG_RATIO_CAP))
    clipped = (ell != log_r) & (sgn != 0)
    return Surrogate(-adv * ratio, clipped, torch.zeros_like(clipped), ratio)


def segment_ratio(logp: Tensor, old_logp: Tensor, seg: Segments) -> Tensor:
    """The ratio [N] at the segments' level (RATIOS)."""
    return RATIOS[seg.level](logp, old_logp, step_ids=seg.step_ids, traj_ids=seg.traj_ids, mask=seg.mask)


def _clamp_log(log_r: Tensor, clip_low: Bound, clip_high: Bound) -> Tensor:
    if isinstance(clip_low, Tensor) or isinstance(clip_high, Tensor):
        low = torch.as_tensor(clip_low, dtype=log_r.dtype, device=log_r.device)
        high = torch.as_tensor(clip_high, dtype=log_r.dtype, device=log_r.device)
        return torch.minimum(torch.maximum(log_r, -low), high)
    return log_r.clamp(-clip_low, clip_high)


POLICY_LOSSES: dict[str, Callable[..., Surrogate]] = {
    "ppo": ppo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss, "dppo": dppo_loss, "drpo": drpo_loss, "cppo": cppo_loss,
}
# keyword arguments every policy loss receives from the update; the others are the loss's own policy_loss_args
COMMON_LOSS_ARGS = frozenset({"clip_low", "clip_high", "dual_clip"})


def sapo_kl_term(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, tau: float = 1.0) -> Tensor:
    """SAPO's conditional KL (Li et al. 2026, "Improving Search Agent with One Line of Code", arXiv:2603.10069):

    KL_cond,t = 1[ r_t < τ, A_t > 0 ] · log r_t,   r_t = π_θ(a_t) / π_old(a_t) per token,
    added to the objective with weight γ: J = PPO surrogate + γ · KL_cond, so the loss gets −γ · KL_cond ≥ 0
    for τ ≤ 1. Only positive-advantage tokens whose probability fell below τ × the old one are pulled back
    (importance-sampling distribution drift: their ratios collapse and PPO's clip never stops it); every
    other token is untouched. logp, old_logp, advantages [N] -> [N], gradient through logp.
    """
    log_r = (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    active = (log_r < math.log(tau)) & (advantages.detach() > 0)
    return torch.where(active, log_r, torch.zeros_like(log_r))
