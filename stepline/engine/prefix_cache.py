"""The engine's prefix cache: K/V of finished sequences in a radix tree over token ids, reused by later
prompts that begin with the same ids.

An agent episode's turn N+1 prompt is turn N's prompt + output ids + the new observation, so keeping
turn N's K/V turns a re-prefill of the whole conversation into a prefill of the new tokens. Sessions
that share only a beginning (the same system prompt and tools) share that part of the tree.

Each tree node holds the K/V of the tokens on the edge from its parent ([layers, 2, heads, n,
head_dim]); the K/V of a path's tokens is the concatenation of its nodes' segments. Since attention is
causal, the K/V of a token depends only on the tokens before it, so any path prefix is reusable.
`match` never returns a whole prompt: its last token is always fed again, so that forward yields the
logits the first new token is sampled from. A match walks one node per edge (a dict lookup and a
tuple comparison), whatever the number of cached sequences.

Eviction is least recently used, leaves first, until the segments' bytes fit `max_bytes`. Using or
adding a path refreshes its nodes deepest first, so every node is more recent than its descendants
and the least recent node is always a leaf: `_lru`'s first node. The scheduler thread owns the cache;
`stats()` may be read from any thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PrefixCache", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`.

    Compares slices (C loops) and bisects on a mismatch, so a 1000-token edge costs a few slice
    comparisons rather than a Python loop over its tokens.
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


class _Node:
    """Tokens of the edge from the parent and their K/V; children keyed by their first token."""

    __slots__ = ("children", "kv", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None) -> None:
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[int, _Node] = {}

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Radix tree of finished sequences' K/V keyed by token ids, bounded by `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._root = _Node((), None, None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # every node but the root, least recent first
        self.bytes = self.tokens = self.leaves = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.insertions = self.evictions = self.flushes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nodes(self) -> int:
        return len(self._lru)

    def match(self, ids: Sequence[int]) -> tuple[int, list[torch.Tensor]]:
        """The longest cached prefix of ids, leaving at least the last token to feed.

        Returns (m, K/V segments whose concatenation along dim 3 is the K/V of ids[:m]); (0, []) on a
        miss. The nodes used become the most recently used.
        """
        if not self.enabled:
            return 0, []
        limit = len(ids) - 1
        node, pos, path, segments = self._root, 0, [], []
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = common_prefix(child.tokens, tuple(ids[pos:pos + len(child.tokens)]), limit - pos)
            path.append(child)
            segments.append(child.kv if n == len(child.tokens) else child.kv[:, :, :, :n])
            pos += n
            if n < len(child.tokens):
                break
            node = child
        self._touch(path)
        self.lookups += 1
        self.lookup_tokens += len(ids)
        self.hit_tokens += pos
        return pos, segments

    def insert(self, ids: Sequence[int], kv: torch.Tensor) -> None:
        """Keep the K/V of `ids` (kv: [layers, 2, heads, len(ids), head_dim], may be a view; the cache
        copies only the segments it does not hold yet)."""
        if kv.shape[3] != len(ids):
            raise ValueError(f"K/V of {kv.shape[3]} tokens given for {len(ids)} ids")
        if not self.enabled or not ids:
            return
        node, pos, path = self._root, 0, []
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                rest = kv[:, :, :, pos:]
                if rest.numel() * rest.element_size() > self.max_bytes:
                    break  # larger than the whole bound: keeping it would evict everything, itself too
                child = _Node(tuple(ids[pos:]), rest.clone(), node)
                if not node.children and node is not self._root:
                    self.leaves -= 1  # node was a leaf, now the new one is
                node.children[ids[pos]] = child
                self.bytes += child.nbytes
                self.tokens += len(child.tokens)
                self.leaves += 1
                self.insertions += 1
                path.append(child)
                break
            n = common_prefix(child.tokens, tuple(ids[pos:pos + len(child.tokens)]), len(ids) - pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        self._touch(path)
        self._evict()

    def clear(self) -> None:
        """Drop every entry (/flush_cache, and a weight update: K/V of other weights must not be reused)."""
        self._root = _Node((), None, None)
        self._lru.clear()
        self.bytes = self.tokens = self.leaves = 0
        self.flushes += 1

    def stats(self) -> dict[str, Any]:
        """Counters for /model_info and /get_server_info (plain ints: safe to read from another thread)."""
        return {
            "enabled": self.enabled, "max_bytes": self.max_bytes, "bytes": self.bytes, "tokens": self.tokens,
            "leaves": self.leaves, "nodes": self.nodes, "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_tokens / self.lookup_tokens, 4) if self.lookup_tokens else 0.0,
            "insertions": self.insertions, "evictions": self.evictions, "flushes": self.flushes,
        }

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens: a new node holds the first n, child keeps the rest.
        Both segments are copied so that each owns exactly its bytes (an evicted half frees them)."""
        parent = child.parent
        head = _Node(child.tokens[:n], child.kv[:, :, :, :n].clone(), parent)
        child.tokens, child.kv, child.parent = child.tokens[n:], child.kv[:, :, :, n:].clone(), head
        head.children[child.tokens[0]] = child
        parent.children[head.tokens[0]] = head
        self._lru[head] = None  # placed by the caller's _touch
        return head

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):  # deepest first: ancestors end up more recent than descendants
            self._lru[node] = None
            self._lru.move_to_end(node)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            leaf = next(iter(self._lru))  # the least recent node is a leaf (see the module docstring)
            assert not leaf.children
            del self._lru[leaf]
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.bytes -= leaf.nbytes
            self.tokens -= len(leaf.tokens)
            self.evictions += 1
            if parent.children or parent is self._root:
                self.leaves -= 1
