"""Segment reductions over flattened tensors: the one place that knows how ids map to rows.

Every algorithm in this package works on 1-D tensors whose entries belong to segments (a step, a
trajectory, an episode, a group) named by a `long` id tensor of the same length. Ids need not be
contiguous; `compact` maps them to 0..K-1 once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compact(ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary ids [M] to dense indices 0..K-1 (in sorted id order); return (indices [M], K)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return inverse, int(unique.numel())


def segment_sum(x: Tensor, seg: Tensor, num: int) -> Tensor:
    """Sum of x [M] per segment: out[k] = Σ_{i: seg[i]=k} x[i]; out [num]. Differentiable in x."""
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add(0, seg, x)


def segment_count(seg: Tensor, num: int, weight: Tensor | None = None) -> Tensor:
    """Number of (weighted) members per segment, float [num]."""
    w = torch.ones_like(seg, dtype=torch.float32) if weight is None else weight.to(torch.float32)
    return segment_sum(w, seg, num)


def segment_mean(x: Tensor, seg: Tensor, num: int, mask: Tensor | None = None) -> Tensor:
    """Masked mean of x [M] per segment, [num]; an empty (fully masked) segment gives 0, not NaN.

    Masked entries are selected away (torch.where), not multiplied by 0: a NaN or inf under a False mask
    (a padded or stale token) must not reach the segment's mean, nor its gradient.
    """
    if mask is None:
        w = torch.ones_like(x)
    else:
        w = mask.to(x.dtype)  # 0/1, or weights
        x = torch.where(w != 0, x * w, torch.zeros_like(x))
    total = segment_sum(x, seg, num)
    count = segment_sum(w, seg, num)
    return total / count.clamp(min=1e-12) * (count > 0).to(x.dtype)


def segment_max(x: Tensor, seg: Tensor, num: int) -> Tensor:
    """Max of x [M] per segment, [num] (no gradient needed where this is used)."""
    init = torch.full((num,), float("-inf"), dtype=x.dtype, device=x.device)
    return init.scatter_reduce(0, seg, x, reduce="amax", include_self=True)


def segment_min(x: Tensor, seg: Tensor, num: int) -> Tensor:
    """Min of x [M] per segment, [num]."""
    return -segment_max(-x, seg, num)


def segment_cumsum(x: Tensor, seg: Tensor) -> Tensor:
    """Inclusive running sum of x [M] within each segment, in the order the entries appear: out[i] =
    Σ_{j≤i, seg[j]=seg[i]} x[j]; [M]. Differentiable in x (a stable sort keeps each segment's order)."""
    if x.numel() == 0:
        return x
    order = torch.argsort(seg, stable=True)
    ordered = torch.cumsum(x[order], 0)
    dense, num = compact(seg[order])
    before = torch.cumsum(segment_sum(x[order], dense, num), 0) - segment_sum(x[order], dense, num)
    out = torch.empty_like(ordered)
    return out.index_copy(0, order, ordered - before[dense])
