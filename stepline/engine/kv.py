"""A batch's KV cache: one preallocated store, a row per running sequence, each row with its own length.

Row r holds its sequence's K/V in slots [0, lengths[r]); slots past a row's length are never attended
(the attention mask stops at it) and hold zeros or finite stale values of an earlier row, never NaN,
so masked weights of exactly 0 keep rows independent. A step feeding n tokens per row writes them at
each row's own slots [lengths[r], lengths[r] + n) in place, and attention reads a view of the first
max(lengths) + n slots.

Why this and not transformers' DynamicCache (which an earlier version used, left-padded): DynamicCache
appends a decoded token with torch.cat per layer, which copies the whole batch's K/V every step; on
SmolLM2-135M (30 layers) with 32 sequences of 700 tokens that cat was 73% of a decode step. Left
padding also made every admission and retirement re-copy the whole batch. Here a step writes one slot
per row, a sequence joins by copying its own slots into a free row (`add`), and a finished one leaves
by moving the last row into its place (`remove`). The store grows (rows by doubling, slots by
SPARE_SLOTS) only when full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

__all__ = ["SPARE_SLOTS", "BatchCache", "KVShape"]

SPARE_SLOTS = 128  # free slots per row after a reallocation: decode reallocates once per 128 steps


@dataclass(frozen=True)
class KVShape:
    """What one token's K/V look like in a model: layers x (K, V) x kv-heads x head_dim, in dtype."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model) -> KVShape:
        """The KV shape of a transformers causal LM; refuses models whose layers are not all full
        attention (sliding windows or linear attention would need other slots than these)."""
        config = model.config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(config)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"the built-in engine serves full-attention models only; this one has {other} layers")
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, heads, head_dim, model.dtype)

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class _RowLayer(CacheLayerMixin):
    """transformers' handle on one layer of a BatchCache: `update` writes into the shared store."""

    is_sliding = False

    def __init__(self, batch: BatchCache, index: int) -> None:
        super().__init__()
        self.batch, self.index, self.is_initialized = batch, index, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the store exists before any forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.batch.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.width + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchCache:
    """The KV of `rows` sequences: store [layers, 2, row capacity, heads, slot capacity, head_dim]."""

    def __init__(self, shape: KVShape, rows: int = 1, slots: int = SPARE_SLOTS) -> None:
        self.shape = shape
        self.store = torch.zeros((shape.layers, 2, rows, shape.heads, slots, shape.head_dim), dtype=shape.dtype)
        self.lengths: list[int] = []
        self.cache = Cache(layers=[_RowLayer(self, i) for i in range(shape.layers)])
        self._step: tuple[torch.Tensor, torch.Tensor, int] | None = None  # inside forward: (rows, starts, n)

    @classmethod
    def single(cls, shape: KVShape, prefix: list[torch.Tensor], room: int) -> BatchCache:
        """One row holding the K/V segments `prefix` (each [layers, 2, heads, n, head_dim], in token
        order, as the prefix cache returns them), with room for `room` more slots: the cache a prefill
        starts from."""
        m = sum(segment.shape[3] for segment in prefix)
        batch = cls(shape, rows=1, slots=m + room)
        at = 0
        for segment in prefix:
            batch.store[:, :, 0, :, at:at + segment.shape[3]] = segment
            at += segment.shape[3]
        batch.lengths = [m]
        return batch

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Slots attended in the current step before its new tokens: the longest row."""
        return max(self.lengths, default=0)

    @property
    def nbytes(self) -> int:
        """Memory of the store, filled or not (/get_server_info's kv_store_bytes)."""
        return self.store.numel() * self.store.element_size()

    def forward(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed input_ids [rows, n] (row r's tokens at positions lengths[r]...); return the last
        position's logits [rows, vocab]. Only that position goes through the LM head (logits_to_keep=1):
        a prefill's [prompt, vocab] logits would otherwise cost a matmul whose rows nobody reads."""
        n = input_ids.shape[1]
        self._reserve(self.rows, self.width + n)
        starts = torch.tensor(self.lengths, dtype=torch.long)
        positions = starts[:, None] + torch.arange(n)
        # Equal rows need no mask beyond causality, which the model builds itself (and SDPA then runs
        # its unmasked kernel); unequal rows get a boolean mask stopping each at its own length.
        mask = None if len(set(self.lengths)) == 1 else (
            torch.arange(self.width + n)[None, None, :] <= positions[:, :, None])[:, None]
        self._step = (torch.arange(self.rows), starts, n)
        try:
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                        use_cache=True, logits_to_keep=1)
        finally:
            self._step = None
        self.lengths = [length + n for length in self.lengths]
        return out.logits[:, -1]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by the model inside `forward`: store this step's K/V ([rows, heads, n, head_dim]) at each
        row's slots and return the K/V views attention reads."""
        assert self._step is not None, "the batch cache is written only inside BatchCache.forward"
        rows, starts, n = self._step
        k_store, v_store = self.store[layer, 0], self.store[layer, 1]
        if n == 1:
            k_store[rows, :, starts] = keys[:, :, 0]
            v_store[rows, :, starts] = values[:, :, 0]
        else:
            for r, start in enumerate(self.lengths):
                k_store[r, :, start:start + n] = keys[r]
                v_store[r, :, start:start + n] = values[r]
        end = self.width + n
        return k_store[:self.rows, :, :end], v_store[:self.rows, :, :end]

    def add(self, other: BatchCache) -> None:
        """Append other's rows after this one's (a copy of their filled slots only)."""
        first, width = self.rows, other.width
        self._reserve(first + other.rows, width)
        self.store[:, :, first:first + other.rows, :, :width] = other.store[:, :, :other.rows, :, :width]
        self.lengths = self.lengths + other.lengths

    def remove(self, rows: list[int]) -> list[int]:
        """Drop `rows`, each replaced by the current last row (one row copy per removed row, not a
        re-copy of the batch). Returns, for each remaining row in its new place, its old index."""
        order = list(range(self.rows))
        for row in sorted(set(rows), reverse=True):
            last = len(order) - 1
            if row != last:
                length = self.lengths[last]
                self.store[:, :, row, :, :length] = self.store[:, :, last, :, :length]
                self.lengths[row], order[row] = length, order[last]
            self.lengths.pop()
            order.pop()
        self._shrink()
        return order

    def row_kv(self, row: int) -> torch.Tensor:
        """Row `row`'s filled slots, [layers, 2, heads, n, head_dim]: a view into the store, valid until
        the next forward, add or remove (the prefix cache copies what it keeps)."""
        return self.store[:, :, row, :, :self.lengths[row]]

    def _reserve(self, rows: int, slots: int) -> None:
        """Make room for `rows` rows of `slots` slots: rows grow by doubling, slots by SPARE_SLOTS."""
        _, _, row_cap, _, slot_cap, _ = self.store.shape
        if rows <= row_cap and slots <= slot_cap:
            return
        self._resize(max(rows, 2 * row_cap) if rows > row_cap else row_cap,
                     slots + SPARE_SLOTS if slots > slot_cap else slot_cap)

    def _shrink(self) -> None:
        """Give memory back once at most half the rows or slots are used (the longest sequence or many
        rows left): the store is a rows x slots rectangle, sized by the largest batch and the longest
        row it has held. Halving hysteresis keeps a batch near a boundary from reallocating each step."""
        _, _, row_cap, _, slot_cap, _ = self.store.shape
        rows, slots = max(self.rows, 1), self.width + SPARE_SLOTS
        if row_cap > 2 * rows or slot_cap > 2 * slots:
            self._resize(min(rows, row_cap), min(slots, slot_cap))

    def _resize(self, row_cap: int, slot_cap: int) -> None:
        """A new store of that capacity holding the filled slots of every row (one copy of them)."""
        store = self.store.new_zeros((*self.store.shape[:2], row_cap, self.shape.heads, slot_cap,
                                      self.shape.head_dim))
        width = self.width
        store[:, :, :self.rows, :, :width] = self.store[:, :, :self.rows, :, :width]
        self.store = store
