"""Policy losses: the clipped surrogate (clip-higher, dual-clip) and how per-token losses aggregate.

`clipped_surrogate` returns a per-token loss [N] and where each clip was active; `aggregate` turns
[N] into the scalar to minimise. Per-episode normalisation is the default: an episode that became
many steps or forks weighs the same as a short one (docs/architecture.md §3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import compact, segment_mean, segment_sum


class Surrogate(NamedTuple):
    loss: Tensor  # float [N]: per-token loss to minimise (not masked, not aggregated)
    clipped: Tensor  # bool [N]: the PPO clip was active (A>0 & r>1+ε_high, or A<0 & r<1−ε_low): no gradient
    dual_clipped: Tensor  # bool [N]: A<0 & r>c: the loss is capped at −c·A, no gradient
    ratio: Tensor | None = None  # float [N]: the ratio the loss used, for logging (set by POLICY_LOSSES)


@dataclass(frozen=True)
class Segments:
    """The units a policy loss forms its ratio over: each of the N action tokens' step and trajectory, and the
    tokens that count. Every policy loss takes one (POLICY_LOSSES); the default is per token, unmasked."""

    level: str = "token"  # the ratio's unit, a key of RATIOS: token | step | sequence
    step_ids: Tensor | None = None  # long [N]: the token's step (level "step")
    traj_ids: Tensor | None = None  # long [N]: the token's trajectory (level "sequence"; cppo's prefixes)
    mask: Tensor | None = None  # bool [N]: tokens that count (None: all)


TOKENS = Segments()  # per token, every token counts


def clamp_ratio(ratio: Tensor, clip_low: float | Tensor, clip_high: float | Tensor) -> Tensor:
    """clip(r, 1 − ε_low, 1 + ε_high) with ε floats or per-token tensors [N] (adaptive trust regions)."""
    if isinstance(clip_low, Tensor) or isinstance(clip_high, Tensor):
        low = torch.as_tensor(clip_low, dtype=ratio.dtype, device=ratio.device)
        high = torch.as_tensor(clip_high, dtype=ratio.dtype, device=ratio.device)
        return torch.minimum(torch.maximum(ratio, 1.0 - low), 1.0 + high)
    return ratio.clamp(1.0 - clip_low, 1.0 + clip_high)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, *, clip_low: float | Tensor = 0.2, clip_high: float | Tensor = 0.28,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO clipped surrogate (Schulman et al. 2017) with decoupled clip range and optional dual-clip.

    L_t = −min( r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t )   — ε_high > ε_low is DAPO's clip-higher
    (Yu et al. 2025): low-probability tokens may grow further, which keeps entropy from collapsing.
    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for A_t < 0,
    L_t = min(L_t, −c A_t) with c > 1, so a token whose ratio exploded cannot drive an unbounded update.
    ratio [N] (grad), advantages [N] (treated as constants) -> Surrogate of [N] tensors; ε may be
    per-token tensors [N] (see trust_regions.CLIP_RULES).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * clamp_ratio(ratio, clip_low, clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        cap = -dual_clip * adv
        is_dual = (adv < 0) & (loss > cap)
        loss = torch.where(is_dual, cap, loss)
    return Surrogate(loss, is_clipped, is_dual)


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Σ mask·x / Σ mask (0 when nothing is selected), scalar."""
    if mask is None:
        return x.mean() if x.numel() else x.sum()
    sel = mask.bool()
    return torch.where(sel, x, torch.zeros_like(x)).sum() / sel.sum().to(x.dtype).clamp(min=1.0)


def surrogate_stats(s: Surrogate, mask: Tensor | None = None) -> dict[str, float]:
    """Clip fractions over the selected tokens, for logging."""
    return {
        "clip_frac": float(masked_mean(s.clipped.float(), mask)),
        "dual_clip_frac": float(masked_mean(s.dual_clipped.float(), mask)),
    }


# --- aggregation: [N] -> scalar ---------------------------------------------------------------

# mode -> (the ids whose segments are the units, or None for tokens; per-unit reduction of the token losses)
_MODES: dict[str, tuple[str | None, str]] = {
    "token-mean": (None, "mean"),
    "token-sum": (None, "sum"),
    "seq-mean-token-mean": ("traj_ids", "mean"),
    "seq-mean-token-sum": ("traj_ids", "sum"),
    "seq-mean-token-sum-norm": ("traj_ids", "sum-norm"),
    "step-mean": ("step_ids", "mean"),
    "episode-mean": ("episode_ids", "mean"),
}


def _unit_total(loss: Tensor, sel: Tensor, ids: Tensor | None, name: str, reduce: str) -> tuple[Tensor, Tensor]:
    """(sum over units of each unit's token mean or token sum, number of units with a selected token)."""
    if ids is None:
        raise ValueError(f"this aggregation needs {name}")
    seg, num = compact(ids)
    w = sel.to(loss.dtype)
    present = segment_sum(w, seg, num) > 0
    if reduce == "mean":
        return segment_mean(loss, seg, num, w).sum(), present.sum()
    return torch.where(sel, loss, torch.zeros_like(loss)).sum(), present.sum()


def aggregate(
    loss: Tensor,
    mask: Tensor | None = None,
    mode: str = "episode-mean",
    *,
    step_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
    episode_ids: Tensor | None = None,
    num_units: float | None = None,
    token_norm: float | None = None,
) -> Tensor:
    """Reduce a per-token loss [N] to a scalar (m_t the mask; masked tokens are selected away).

    token-mean               Σ_t m_t L_t / Σ_t m_t (DAPO's token-level loss)
    token-sum                Σ_t m_t L_t (no normalisation: the gradient grows with the batch's tokens)
    seq-mean-token-mean      mean over trajectories of each trajectory's token mean (GRPO's original)
    seq-mean-token-sum       mean over trajectories of each trajectory's token sum (verl)
    seq-mean-token-sum-norm  mean over trajectories of (token sum / C), C = `token_norm`, a constant such as
                             the maximum generation length (Dr. GRPO, Liu et al. 2025, eq. 3: no 1/|o_i| length
                             bias). verl's mode of this name leaves out the 1/#trajectories; it is ours × #traj.
    step-mean                mean over steps of each step's token mean
    episode-mean             mean over episodes of each episode's token mean (the default)
    `num_units`: divide by this instead of the local count of units (tokens, trajectories, steps,
    episodes; 1 for token-sum) — pass the minibatch's count (`count_units`) when accumulating gradients
    over micro-batches, so the sum of the micro-batch losses equals the minibatch loss. A micro-batch must
    not split a unit.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    unit, reduce = _MODES[mode]
    sel = torch.ones_like(loss, dtype=torch.bool) if mask is None else mask.bool()
    if unit is None:
        total = torch.where(sel, loss, torch.zeros_like(loss)).sum()
        units = sel.sum() if reduce == "mean" else torch.ones((), dtype=torch.long)
    else:
        ids = {"traj_ids": traj_ids, "step_ids": step_ids, "episode_ids": episode_ids}[unit]
        total, units = _unit_total(loss, sel, ids, unit, reduce)
    if reduce == "sum-norm":
        if token_norm is None or token_norm <= 0:
            raise ValueError(f"{mode} needs token_norm > 0 (the constant C), got {token_norm}")
        total = total / token_norm
    denom = units.to(loss.dtype) if num_units is None else torch.tensor(float(num_units), dtype=loss.dtype)
    return total / denom.clamp(min=1.0)


def count_units(
    mask: Tensor,
    mode: str = "episode-mean",
    *,
    step_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
    episode_ids: Tensor | None = None,
) -> int:
    """How many units `aggregate` divides by over these tokens: selected tokens for token-mean, 1 for
    token-sum, else the number of trajectories / steps / episodes with at least one selected token. mask [N]."""
    unit, reduce = _MODES[mode]
    if unit is None:
        return int(mask.sum()) if reduce == "mean" else 1
    ids = {"traj_ids": traj_ids, "step_ids": step_ids, "episode_ids": episode_ids}[unit]
    if ids is None:
        raise ValueError(f"{mode} needs {unit}")
    return int(torch.unique(ids[mask.bool()]).numel())


def _mode(name: str) -> Callable[..., Tensor]:
    def reduce(loss: Tensor, mask: Tensor | None = None, **ids: Tensor | float | None) -> Tensor:
        return aggregate(loss, mask, name, **ids)  # type: ignore[arg-type]

    reduce.__name__ = name.replace("-", "_")
    reduce.__doc__ = f"aggregate(loss, mask, {name!r}, ...)"
    return reduce


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {name: _mode(name) for name in _MODES}
