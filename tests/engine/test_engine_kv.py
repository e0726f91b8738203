"""BatchCache: rows of different lengths decoded together equal each sequence's own full forward,
through rows joining (`add`) and leaving (`remove`), from a cached prefix, and past a buffer regrowth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stepline.engine.kv import SPARE_SLOTS, BatchCache, KVShape


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits after `ids`, from one uncached forward of the whole sequence."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def prefilled(model, ids: list[int], prefix: list[torch.Tensor] | None = None) -> BatchCache:
    prefix = prefix or []
    m = sum(segment.shape[3] for segment in prefix)
    kv = BatchCache.single(KVShape.of(model), prefix, room=len(ids) - m + 1)
    with torch.inference_mode():
        logits = kv.forward(model, torch.tensor([ids[m:]]))
    assert torch.allclose(logits[0], reference_logits(model, ids), atol=1e-5)
    return kv


def test_rows_stay_independent_through_add_remove_and_growth(model) -> None:
    seqs = [list(range(10, 15)), list(range(40, 49)), [7, 8, 9]]
    batch = prefilled(model, seqs[0])
    for ids in seqs[1:]:
        batch.add(prefilled(model, ids))
    assert batch.lengths == [5, 9, 3]
    order = [0, 1, 2]
    for step in range(SPARE_SLOTS + 20):  # long enough to outgrow the slots allocated at admission
        if step == 3:
            order = [order[i] for i in batch.remove([0])]  # the last row moves into row 0
            assert order == [2, 1] and batch.lengths == [len(seqs[2]), len(seqs[1])]
        feed = [(step * 17 + 5 * s) % 3000 + 3 for s in order]
        with torch.inference_mode():
            logits = batch.forward(model, torch.tensor(feed)[:, None])
        for row, s in enumerate(order):
            seqs[s].append(feed[row])
            assert torch.allclose(logits[row], reference_logits(model, seqs[s]), atol=1e-4), (step, s)
    assert batch.lengths == [len(seqs[s]) for s in order]


def test_the_store_shrinks_when_the_long_rows_leave(model) -> None:
    batch = prefilled(model, list(range(10, 15)))
    for n in (300, 6, 7, 8):
        batch.add(prefilled(model, list(range(20, 20 + n))))
    rows, slots = batch.store.shape[2], batch.store.shape[4]
    assert (rows, slots) == (8, 300 + SPARE_SLOTS)  # rows doubled 1, 2, 4, 8; slots fit the longest
    order = batch.remove([1, 2, 3])  # the 300-token row and two more leave: 2 rows of at most 8 slots
    assert batch.lengths == [5, 8] and order == [0, 4]
    assert (batch.store.shape[2], batch.store.shape[4]) == (2, 8 + SPARE_SLOTS)
    with torch.inference_mode():
        logits = batch.forward(model, torch.tensor([[3], [4]]))
    assert torch.allclose(logits[1], reference_logits(model, list(range(20, 28)) + [4]), atol=1e-5)


def test_a_row_resumed_from_its_cached_kv_continues_exactly(model) -> None:
    ids = list(range(100, 140))
    kv = prefilled(model, ids)
    saved = kv.row_kv(0)
    assert saved.shape == (2, 2, 2, 40, 16)  # layers, (K, V), kv-heads, tokens, head_dim
    longer = ids + [5, 6, 7]
    prefilled(model, longer, prefix=[saved])  # reuses the 40 cached slots, computes 3
    prefilled(model, longer, prefix=[saved[:, :, :, :25]])  # a common prefix shorter than the entry
    prefilled(model, longer, prefix=[saved[:, :, :, :10], saved[:, :, :, 10:]])  # two tree nodes' segments
