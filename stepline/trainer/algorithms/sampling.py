"""Batch shaping from DAPO (Yu et al. 2025): dynamic sampling and soft overlong punishment."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stepline.trainer.algorithms._segments import compact, segment_max, segment_min


def has_reward_variance(rewards: Sequence[float], *, eps: float = 1e-6) -> bool:
    """Dynamic sampling for one group: keep it only if its rewards differ (max − min > eps).

    A group whose samples all scored the same has group-relative advantage 0 everywhere: it costs a
    forward and backward pass and adds no gradient (DAPO §3.2). A group of one never varies."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > eps


def dynamic_sampling_mask(outcome: Tensor, episode_group: Tensor, *, eps: float = 1e-6) -> Tensor:
    """The same rule on tensors: outcome [E], episode_group long [E] -> bool [E], True for episodes whose
    group's outcomes vary."""
    g, num = compact(episode_group)
    return (segment_max(outcome, g, num) - segment_min(outcome, g, num) > eps)[g]


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:

    R_len(L) = 0                                  if L ≤ L_max − L_buf
             = (L_max − L_buf − L) / L_buf · f    if L_max − L_buf < L ≤ L_max
             = −f                                 if L > L_max
    buffer_len = 0 is the hard version: 0 up to L_max, −f beyond.
    lengths: int tensor of any shape (tokens of a response, a step or an episode) -> float, same shape.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in [0, max_len={max_len}], got {buffer_len}")
    excess = (lengths.to(torch.float32) - (max_len - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    penalty = -excess / max(buffer_len, 1) * factor  # buffer 0: excess is clamped to 0
    return torch.where(lengths > max_len, torch.full_like(penalty, -factor), penalty)
