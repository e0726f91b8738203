"""The optional critic: a small value head on the policy's final hidden states.

Its input is detached, so the critic learns its own weights without ever moving the policy (which also
makes a critic warm-up safe: the policy is untouched while the head catches up). Values are read at
each step's state boundary, the last prompt token (StepPO), from the same tree forward as the logprobs.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ValueHead"]


class ValueHead(nn.Module):
    """V(s) = w2 · tanh(W1 h + b1) + b2 on detached hidden states h [..., H] -> [..., 1]."""

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden_size, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden.detach().float())
