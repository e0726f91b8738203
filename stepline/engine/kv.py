"""A batch's KV cache as one left-padded DynamicCache, plus the operations continuous batching needs.

Rows are sequences; columns are cache slots. A sequence that joined later than the others sits
right-aligned behind zero-filled padding slots, masked out by the 2D attention mask kept with it.
Padding slots hold zeros (never NaN), so masked attention weights of exactly 0 keep rows independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

__all__ = ["BatchCache"]


@dataclass
class BatchCache:
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] long, 1 for a real slot, 0 for left padding

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def merge(self, other: BatchCache) -> BatchCache:
        """Rows of self then rows of other, both left-padded to the longer length."""
        width = max(self.length, other.length)
        a, b = self._left_pad(width), other._left_pad(width)
        for la, lb in zip(a.cache.layers, b.cache.layers):
            la.keys = torch.cat([la.keys, lb.keys], dim=0)
            la.values = torch.cat([la.values, lb.values], dim=0)
        return BatchCache(a.cache, torch.cat([a.mask, b.mask], dim=0))

    def select(self, rows: list[int]) -> BatchCache:
        """Keep only `rows` (in that order), then drop slot columns that are padding in every row."""
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.mask[index]
        start = int((mask.cumsum(dim=1) == 0).sum(dim=1).min()) if rows else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        return BatchCache(self.cache, mask[:, start:])

    def grow(self) -> torch.Tensor:
        """Add one real slot to every row (the token being decoded); return the new mask."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self.mask

    def _left_pad(self, width: int) -> BatchCache:
        pad = width - self.length
        if pad == 0:
            return self
        for layer in self.cache.layers:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, pad, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, pad, 0))
        return BatchCache(self.cache, torch.nn.functional.pad(self.mask, (pad, 0)))
