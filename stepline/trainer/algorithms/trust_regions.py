"""Trust regions beyond PPO's fixed ratio clip: per-token clip bounds (GAPO, RIPO, the stale-adaptive
region, a bound in the r − 1 − log r coordinate) and policy losses that bound the sampled token's
probability shift instead of its ratio (DPPO's binary-TV mask, DRPO's quadratic regulariser, CPPO's
position-weighted prefix budget).

Clip rules: `CLIP_RULES[name](c: ClipInputs, **hyper) -> ClipBounds` with ε_low, ε_high as floats or
tensors [N]; the clipping losses (ppo, cispo, gmpo) accept either. Within a step or sequence ratio the
bounds are constant over the unit (they are computed from the unit's mean), so it still clips as one.
Divergence losses: `fn(logp, old_logp, advantages, seg, *, ...) -> Surrogate` (seg.level "token"),
registered in POLICY_LOSSES; their binary total variation of a sampled token y is |π_θ(y) − π_old(y)| (the TV distance
of the two-outcome distributions {y, not y}).
Each function's docstring names its paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import compact, segment_count, segment_cumsum, segment_mean, segment_sum
from stepline.trainer.algorithms.losses import TOKENS, Segments, Surrogate
from stepline.trainer.algorithms.ratios import LOG_RATIO_LIMIT

Bound = float | Tensor


@dataclass(frozen=True)
class ClipInputs:
    """What a clip rule may read. N action tokens, E episodes."""

    clip_low: float  # the configured ε_low
    clip_high: float  # the configured ε_high
    old_logp: Tensor  # float [N]: the ratio's denominator (engine logprobs, or the trainer's at update start)
    advantages: Tensor  # float [N]
    episode_ids: Tensor  # long [N]: index into outcome / episode_group
    outcome: Tensor  # float [E]
    episode_group: Tensor  # long [E]: task × harness group
    segment_ids: Tensor | None = None  # long [N]: the ratio's unit (step or trajectory); None per token
    mask: Tensor | None = None  # bool [N]
    behaviour_logp: Tensor | None = None  # float [N]: the engine's logprobs μ (stale-adaptive rule)


class ClipBounds(NamedTuple):
    low: Bound  # ε_low: the ratio is clipped below at 1 − ε_low
    high: Bound  # ε_high: above at 1 + ε_high


def _unit_mean(x: Tensor, c: ClipInputs) -> Tensor:
    """x [N] averaged over the ratio's unit and broadcast back (x itself per token)."""
    if c.segment_ids is None or x.numel() == 0:
        return x
    return segment_mean(x, c.segment_ids, int(c.segment_ids.max()) + 1, c.mask)[c.segment_ids]


def fixed_clip(c: ClipInputs) -> ClipBounds:
    """The configured ε_low, ε_high for every token (PPO; DAPO's clip-higher when ε_high > ε_low)."""
    return ClipBounds(c.clip_low, c.clip_high)


@torch.no_grad()
def gapo_clip_high(outcome: Tensor, group: Tensor, *, clip_low: float, clip_max: float,
                   threshold: float = 0.5) -> Tensor:
    """GAPO's group-adaptive upper clip (the paper "Group Adaptive Policy Optimisation"):

    ε_high(c) = ε_low + (ε_max − ε_low) · (k − c) / (k − 1)
    k = episodes in the group, c = those whose outcome ≥ threshold (correct). A rare correct rollout
    (c = 1) may grow its tokens up to 1 + ε_max; when all are correct (c = k) the clip is symmetric.
    outcome [E], group [E] -> ε_high [E]; a group of one gets ε_max.
    """
    g, num = compact(group)
    k = segment_count(g, num).to(outcome.dtype)
    correct = segment_sum((outcome >= threshold).to(outcome.dtype), g, num)
    share = ((k - correct) / (k - 1).clamp(min=1)).where(k > 1, torch.ones_like(k))
    return clip_low + (clip_max - clip_low) * share[g]


def gapo_clip(c: ClipInputs, *, clip_max: float = 0.4, threshold: float = 0.5) -> ClipBounds:
    """GAPO as a clip rule: ε_low as configured, ε_high per episode from `gapo_clip_high`."""
    high = gapo_clip_high(c.outcome, c.episode_group, clip_low=c.clip_low, clip_max=clip_max, threshold=threshold)
    return ClipBounds(c.clip_low, high.to(c.old_logp.device)[c.episode_ids])


@torch.no_grad()
def ripo_clip(c: ClipInputs, *, delta: float = 0.02) -> ClipBounds:
    """RIPO's isometric clip (the paper "Riemannian Isometric Policy Optimisation"):

    ε_t = sqrt( δ / π_old(y_t) ),   ratio clipped to [1 − ε_t, 1 + ε_t]
    A fixed step in the Fisher geometry of the categorical policy is a ratio step ∝ 1/sqrt(π): a
    low-probability token (a rare action) gets room to grow, a near-certain one almost none. δ is the
    trust-region radius (the summary: 0.02–0.05). For a step or sequence ratio π_old is the unit's
    geometric-mean token probability. [N] bounds.
    """
    old_p = torch.exp(_unit_mean(c.old_logp.detach().float(), c).clamp(min=-LOG_RATIO_LIMIT))
    eps = torch.sqrt(delta / old_p)
    return ClipBounds(eps, eps)


@torch.no_grad()
def stale_clip(c: ClipInputs) -> ClipBounds:
    """The stale-adaptive trust region (the paper "Stale but Stable"), as we read it: the detached
    log-ratio d = log π_old − log μ between the trainer's policy at update start and the engine's behaviour
    policy measures staleness, and only the endpoint the advantage pushes towards is shrunk, so that it is
    measured from μ instead of π_old when the token already drifted that way:

    A > 0, d > 0:  1 + ε_high' = max( (1 + ε_high) · e^{−d}, 1 )
    A < 0, d < 0:  1 − ε_low'  = min( (1 − ε_low) · e^{−d}, 1 )
    every other endpoint is unchanged. Needs behaviour_logp (old_logprobs = "recompute"). [N] bounds.
    """
    if c.behaviour_logp is None:
        raise ValueError("the stale-adaptive clip needs the engine's logprobs next to the trainer's")
    d = _unit_mean((c.old_logp.detach() - c.behaviour_logp.detach()).float(), c).clamp(-LOG_RATIO_LIMIT,
                                                                                        LOG_RATIO_LIMIT)
    adv = c.advantages.detach()
    shrink = torch.exp(-d)
    high = torch.full_like(d, c.clip_high)
    low = torch.full_like(d, c.clip_low)
    high = torch.where((adv > 0) & (d > 0), ((1 + c.clip_high) * shrink - 1).clamp(min=0.0), high)
    low = torch.where((adv < 0) & (d < 0), (1 - (1 - c.clip_low) * shrink).clamp(min=0.0), low)
    return ClipBounds(low, high)


def _k3_root(delta: float, start: float) -> float:
    """The root of f(r) = r − 1 − log r = δ on the side of 1 where `start` lies (Newton's method; f is convex, so
    from a start beyond the root, on the side away from 1, the iterates approach it monotonically)."""
    r = start
    for _ in range(60):
        r -= (r - 1 - math.log(r) - delta) / (1 - 1 / r)
    return r


def kl_clip(c: ClipInputs, *, delta: float = 0.02) -> ClipBounds:
    """A trust region in the reverse-KL coordinate f(r) = r − 1 − log r (the per-sample k3 estimate of
    KL(π_old ‖ π_θ)) instead of in r: the ratio may move while f(r) ≤ δ, i.e. r ∈ [r_lo, r_hi] with
    f(r_lo) = f(r_hi) = δ. The region is naturally asymmetric (δ = 0.02: [0.813105, 1.213550]). This is the
    coordinate EPIC clips its prefix ratio in (use it with ratio = "prefix"); EPIC's calibration of the bound
    by the geometric-mean behaviour probability is not reproduced here.
    """
    high = _k3_root(delta, 1 + 2 * math.sqrt(2 * delta) + 2 * delta) - 1
    low = 1 - _k3_root(delta, math.exp(-1 - delta))
    return ClipBounds(low, high)


CLIP_RULES: dict[str, Callable[..., ClipBounds]] = {
    "fixed": fixed_clip,
    "gapo": gapo_clip,
    "ripo": ripo_clip,
    "stale": stale_clip,
    "kl": kl_clip,
}


# --- divergence-bounded losses (per token) -----------------------------------------------------


def _per_token(level: str, name: str) -> None:
    if level != "token":
        raise ValueError(f"{name} bounds each sampled token's probability shift: it needs ratio 'token', not {level!r}")


def _shift(logp: Tensor, old_logp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(ratio r [N] with gradient, π_old [N], π_θ − π_old [N] detached)."""
    log_r = (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_r)
    old_p = torch.exp(old_logp.detach())
    return ratio, old_p, (ratio.detach() - 1) * old_p


def dppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.2, clip_high: Bound = 0.28, dual_clip: float | None = None, delta: float = 0.1,
) -> Surrogate:
    """DPPO's binary-TV trust region (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879;
    the base of DRPO and CPPO): the ratio is not clipped; instead a token loses its
    gradient once its probability moved more than δ in the direction its advantage pushes:

    L_t = −r_t A_t · (1 − M_t),   M_t = sg( 1[ sgn(A_t) · (π_θ(y_t) − π_old(y_t)) > δ ] )
    (clip_low/clip_high are unused.) [N] -> Surrogate; `clipped` = M.
    """
    _per_token(seg.level, "dppo")
    if dual_clip is not None:
        raise ValueError("dual_clip applies to the ppo loss only")
    ratio, _, shift = _shift(logp, old_logp)
    adv = advantages.detach()
    masked = torch.sign(adv) * shift > delta
    loss = torch.where(masked, (-adv * ratio).detach(), -adv * ratio)
    return Surrogate(loss, masked, torch.zeros_like(masked), ratio)


def drpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.2, clip_high: Bound = 0.28, dual_clip: float | None = None, delta: float = 0.1,
) -> Surrogate:
    """DRPO, divergence-regularised policy optimisation (Yao et al. 2026, arXiv:2606.09821):
    DPPO's hard mask replaced by a smooth, |A|-weighted quadratic regulariser on the binary-TV shift:

    L_t = −r_t A_t + |A_t| · (π_θ(y_t) − π_old(y_t))² / (2 δ π_old(y_t))  =  −r_t A_t + |A_t| π_old (r_t − 1)² / (2δ)
    ∂L/∂π_θ = (|A| / π_old) · ( (π_θ − π_old)/δ − sgn(A) ): the push fades as the shift nears DPPO's boundary
    sgn(A)(π_θ − π_old) = δ, is exactly 0 there, and reverses (corrects) beyond it; the |A| weight makes the
    boundary independent of the reward scale. The coefficient 1/(2δπ_old) is our choice that puts the zero
    of the gradient on DPPO's boundary (the summary gives the form, not the constant). `clipped`: beyond it.
    """
    _per_token(seg.level, "drpo")
    if dual_clip is not None:
        raise ValueError("dual_clip applies to the ppo loss only")
    ratio, old_p, shift = _shift(logp, old_logp)
    adv = advantages.detach()
    loss = -adv * ratio + adv.abs() * old_p * (ratio - 1) ** 2 / (2 * delta)
    beyond = torch.sign(adv) * shift > delta
    return Surrogate(loss, beyond, torch.zeros_like(beyond), ratio)


def cppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, seg: Segments = TOKENS, *,
    clip_low: Bound = 0.2, clip_high: Bound = 0.28, dual_clip: float | None = None, delta: float = 0.1, min_weight: float = 0.5, prefix_delta: float = 0.05,
) -> Surrogate:
    """CPPO, cumulative prefix-divergence policy optimisation (the paper "Beyond Uniform
    Token-Level Trust Region"): DPPO's mask with a position-weighted threshold and a cumulative prefix budget.

    d_t = |π_θ(y_t) − π_old(y_t)| (binary TV),  w_t = 1 − (1 − w_min) · p_t / (L − 1)  (p_t = 0..L−1, the
    token's position among its trajectory's L action tokens: 1 at the start, w_min at the end)
    D_t = Σ_{k≤t} w_k d_k / Σ_{k≤t} w_k   (the weighted mean divergence of the prefix)
    M_t = sg( 1[ sgn(A_t)(π_θ − π_old) > 0 ] · 1[ w_t d_t > δ  or  D_t > δ_b ] ),   L_t = −r_t A_t (1 − M_t)
    Early tokens, whose drift every later token inherits, face the tight δ; late ones δ / w_min; and once the
    prefix has drifted by δ_b on average, every further outward update of the trajectory is masked.
    """
    _per_token(seg.level, "cppo")
    if dual_clip is not None:
        raise ValueError("dual_clip applies to the ppo loss only")
    traj_ids, mask = seg.traj_ids, seg.mask
    if traj_ids is None:
        raise ValueError("cppo needs traj_ids (positions and prefixes are per trajectory)")
    ratio, _, shift = _shift(logp, old_logp)
    adv = advantages.detach()
    sel = torch.ones_like(shift, dtype=torch.bool) if mask is None else mask.bool()
    ones = sel.to(shift.dtype)
    position = segment_cumsum(ones, traj_ids) - 1
    unit, num = compact(traj_ids)
    length = segment_sum(ones, unit, num)[unit]
    weight = 1 - (1 - min_weight) * position / (length - 1).clamp(min=1)
    weighted = torch.where(sel, weight * shift.abs(), torch.zeros_like(shift))
    weight_sum = segment_cumsum(torch.where(sel, weight, torch.zeros_like(weight)), traj_ids)
    prefix = segment_cumsum(weighted, traj_ids) / weight_sum.clamp(min=1e-12)
    outward = torch.sign(adv) * shift > 0
    masked = outward & ((weight * shift.abs() > delta) | (prefix > prefix_delta))
    loss = torch.where(masked, (-adv * ratio).detach(), -adv * ratio)
    return Surrogate(loss, masked, torch.zeros_like(masked), ratio)
