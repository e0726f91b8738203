"""The engine's prefix cache: K/V of finished sequences, reused by later prompts that begin with the same ids.

An agent episode's turn N+1 prompt is turn N's prompt + output ids + the new observation, so keeping
turn N's K/V turns a re-prefill of the whole conversation into a prefill of the new tokens. Sessions
that share only a beginning (the same system prompt and tools) reuse their longest common prefix.

An entry holds the K/V of exactly its `ids` ([layers, 2, heads, len(ids), head_dim]); since attention
is causal, its first m slots are the K/V of ids[:m], so any common prefix of an entry is reusable.
`match` never returns a whole prompt: the last token is always fed again, so its forward produces the
logits the first new token is sampled from. Entries that are a prefix of a newer entry are dropped
(the newer one answers every match they would), and the least recently used entries go when the
total exceeds `max_bytes`. The scheduler thread owns the cache; `stats()` may be read from any thread.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefixCache", "common_prefix"]


@dataclass(frozen=True)
class _Entry:
    ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, heads, len(ids), head_dim]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def common_prefix(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`.

    Compares tuple slices (C loops) and bisects on a mismatch, so a 1000-token prompt costs a few
    slice comparisons rather than a Python loop over its tokens.
    """
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU cache of finished sequences' K/V keyed by their token ids, bounded by `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._keys = itertools.count()
        self.bytes = self.tokens = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.insertions = self.evictions = self.flushes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of ids, leaving at least the last token to feed.

        Returns (m, K/V of ids[:m] as a view [layers, 2, heads, m, head_dim]), or (0, None) on a miss.
        The entry used becomes the most recently used.
        """
        if not self.enabled:
            return 0, None
        key = tuple(ids)
        best, best_len = None, 0
        for handle, entry in self._entries.items():
            n = common_prefix(entry.ids, key, len(key) - 1)
            if n > best_len:
                best, best_len = handle, n
        self.lookups += 1
        self.lookup_tokens += len(key)
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        self.hit_tokens += best_len
        return best_len, self._entries[best].kv[:, :, :, :best_len]

    def insert(self, ids: Sequence[int], kv: torch.Tensor) -> None:
        """Keep kv ([layers, 2, heads, len(ids), head_dim], owned by the cache from now on) for `ids`."""
        if kv.shape[3] != len(ids):
            raise ValueError(f"K/V of {kv.shape[3]} tokens given for {len(ids)} ids")
        entry = _Entry(tuple(ids), kv)
        if not self.enabled or entry.nbytes > self.max_bytes or not ids:
            return
        for handle, old in list(self._entries.items()):
            if old.ids[:len(entry.ids)] == entry.ids:  # already covered by a longer (or equal) entry
                self._entries.move_to_end(handle)
                return
            if entry.ids[:len(old.ids)] == old.ids:  # the new entry answers every match this one would
                self._drop(handle)
        self._entries[next(self._keys)] = entry
        self.bytes += entry.nbytes
        self.tokens += len(entry.ids)
        self.insertions += 1
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def clear(self) -> None:
        """Drop every entry (/flush_cache, and a weight update: K/V of other weights must not be reused)."""
        self._entries.clear()
        self.bytes = self.tokens = 0
        self.flushes += 1

    def stats(self) -> dict[str, Any]:
        """Counters for /model_info and /get_server_info (plain ints: safe to read from another thread)."""
        return {
            "enabled": self.enabled, "max_bytes": self.max_bytes, "bytes": self.bytes, "entries": len(self._entries),
            "tokens": self.tokens, "lookups": self.lookups, "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_tokens / self.lookup_tokens, 4) if self.lookup_tokens else 0.0,
            "insertions": self.insertions, "evictions": self.evictions, "flushes": self.flushes,
        }

    def _drop(self, handle: int) -> None:
        entry = self._entries.pop(handle)
        self.bytes -= entry.nbytes
        self.tokens -= len(entry.ids)
