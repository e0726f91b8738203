"""The prefix cache: multi-turn outputs identical with and without it, flush, weight-update invalidation, LRU."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stepline.engine.prefix_cache import PrefixCache, common_prefix
from stepline.engine.testing import running_engine
from stepline.models import build_model

TURNS = 4
NEW_TOKENS = 12
TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers x (K, V) x 2 kv-heads x head_dim 16 x fp32


def first_prompt(session: int, shared: int = 0) -> list[int]:
    """A 40-token first prompt; the first `shared` tokens are the same for every session (a system prompt)."""
    return [(7 * i) % 3000 + 10 for i in range(shared)] + [(31 * session + 11 * i) % 3000 + 10
                                                           for i in range(40 - shared)]


def observation(turn: int) -> list[int]:
    return [(13 * i + turn) % 3000 + 10 for i in range(10)]


def generate(client: httpx.Client, ids: list[int], temperature: float, seed: int) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": temperature, "sampling_seed": seed}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def conversation(client: httpx.Client, prompt: list[int], temperature: float, turns: int = TURNS) -> list[dict]:
    """An agent episode: each turn's prompt is the previous prompt + its output ids + an observation."""
    results = []
    for turn in range(turns):
        result = generate(client, prompt, temperature, seed=turn)
        results.append({"prompt": prompt, **result})
        prompt = prompt + result["output_ids"] + observation(turn)
    return results


def logprobs(result: dict) -> list[float]:
    return [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]


def cache_stats(client: httpx.Client) -> dict:
    return client.get("/model_info").json()["prefix_cache"]


@pytest.fixture(scope="module")
def uncached(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    with running_engine(tiny_model_dir, prefix_cache_mb=0) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


@pytest.fixture
def cached(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    """A fresh engine with the prefix cache on (its counters start at zero)."""
    with running_engine(tiny_model_dir) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def assert_same_outputs(got: list[dict], expected: list[dict]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_turn_outputs_equal_those_without_the_cache(uncached: httpx.Client, cached: httpx.Client,
                                                          temperature: float) -> None:
    plain = conversation(uncached, first_prompt(0), temperature)
    reused = conversation(cached, first_prompt(0), temperature)
    assert_same_outputs(reused, plain)
    assert [r["meta_info"]["cached_tokens"] for r in plain] == [0] * TURNS
    # Turn k reuses all of turn k-1's prompt and output but its last sampled token, never fed to the model.
    expected = [0] + [len(r["prompt"]) + NEW_TOKENS - 1 for r in reused[:-1]]
    assert [r["meta_info"]["cached_tokens"] for r in reused] == expected
    stats = cache_stats(cached)
    final_ids = len(reused[-1]["prompt"]) + NEW_TOKENS - 1
    # Each prompt and each finished turn extends the same path: one leaf, the last turn's K/V, nothing twice.
    assert (stats["leaves"], stats["nodes"], stats["tokens"]) == (1, 2 * TURNS, final_ids)
    assert stats["bytes"] == final_ids * TINY_TOKEN_BYTES
    assert stats["hit_tokens"] == sum(expected) and stats["lookup_tokens"] == sum(len(r["prompt"]) for r in reused)
    info = cached.get("/get_server_info").json()
    assert info["prefix_cache"]["hit_tokens"] == sum(expected)
    assert info["kv_store_bytes"] == 0 and info["dtype"] == "float32"  # idle: no batch, no store
    assert cache_stats(uncached)["enabled"] is False and cache_stats(uncached)["nodes"] == 0


def test_sessions_sharing_a_system_prompt_reuse_the_common_prefix(uncached: httpx.Client,
                                                                  cached: httpx.Client) -> None:
    conversation(cached, first_prompt(1, shared=30), 1.0, turns=1)
    other = conversation(cached, first_prompt(2, shared=30), 1.0, turns=2)
    assert other[0]["meta_info"]["cached_tokens"] == 30
    assert_same_outputs(other, conversation(uncached, first_prompt(2, shared=30), 1.0, turns=2))
    stats = cache_stats(cached)
    # Two leaves under one shared 30-token node, whose K/V is held once.
    first_ids, other_ids = 40 + NEW_TOKENS - 1, len(other[-1]["prompt"]) + NEW_TOKENS - 1
    assert (stats["leaves"], stats["tokens"]) == (2, first_ids + other_ids - 30)


def test_samples_of_one_prompt_reuse_the_first_samples_prompt(uncached: httpx.Client, cached: httpx.Client) -> None:
    body = {"input_ids": first_prompt(6), "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": 3, "n": 3}}
    reused = cached.post("/generate", json=body).json()
    assert [r["meta_info"]["cached_tokens"] for r in reused] == [0, 39, 39]  # all of the prompt but its last token
    assert_same_outputs(reused, uncached.post("/generate", json=body).json())


def test_flush_cache_empties_it(uncached: httpx.Client, cached: httpx.Client) -> None:
    first = conversation(cached, first_prompt(3), 1.0, turns=1)[0]
    assert cache_stats(cached)["leaves"] == 1
    assert cached.post("/flush_cache").status_code == 200
    stats = cache_stats(cached)
    assert (stats["nodes"], stats["leaves"], stats["bytes"], stats["tokens"], stats["flushes"]) == (0, 0, 0, 0, 1)
    prompt = first["prompt"] + first["output_ids"] + observation(0)
    second = generate(cached, prompt, 1.0, seed=1)
    assert second["meta_info"]["cached_tokens"] == 0
    assert_same_outputs([second], [generate(uncached, prompt, 1.0, seed=1)])


def test_a_weight_update_invalidates_the_cache(tiny_model_dir: Path, cached: httpx.Client, tmp_path: Path) -> None:
    new_weights = build_model(tmp_path / "seed1", kind="tiny", seed=1)
    first = conversation(cached, first_prompt(4), 1.0, turns=1)[0]
    assert cached.post("/update_weights_from_disk", json={"model_path": str(new_weights)}).status_code == 200
    assert cache_stats(cached)["nodes"] == 0
    prompt = first["prompt"] + first["output_ids"] + observation(0)
    after = conversation(cached, prompt, 1.0, turns=2)
    assert after[0]["meta_info"]["cached_tokens"] == 0
    with running_engine(new_weights, prefix_cache_mb=0) as url, httpx.Client(base_url=url, timeout=60) as fresh:
        assert_same_outputs(after, conversation(fresh, prompt, 1.0, turns=2))
    assert after[1]["meta_info"]["cached_tokens"] > 0  # the new weights' K/V is cached again


def test_a_sequence_running_across_a_weight_update_is_not_cached(cached: httpx.Client, tmp_path: Path) -> None:
    new_weights = build_model(tmp_path / "seed1", kind="tiny", seed=1)
    prompt = first_prompt(5)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("result", cached.post("/generate", json=body).json()))
    worker.start()
    while cached.get("/model_info").json()["running_requests"] == 0:
        time.sleep(0.01)
    cached.post("/pause_generation", json={"mode": "in_place"})
    cached.post("/update_weights_from_disk", json={"model_path": str(new_weights)})
    cached.post("/continue_generation")
    worker.join(timeout=60)
    assert len(box["result"]["output_ids"]) == 300
    # Its K/V mixes both weights: reusing it would be wrong, so nothing was cached.
    assert cache_stats(cached)["nodes"] == 0
    follow_up = prompt + box["result"]["output_ids"] + observation(0)
    assert generate(cached, follow_up, 1.0, seed=0)["meta_info"]["cached_tokens"] == 0


def test_the_least_recently_used_entry_is_evicted_under_the_bound(tiny_model_dir: Path,
                                                                  uncached: httpx.Client) -> None:
    entry_bytes = (40 + NEW_TOKENS - 1) * TINY_TOKEN_BYTES  # one first turn's K/V
    bound = 2 * entry_bytes + 1000  # room for two first turns, not three
    with running_engine(tiny_model_dir, prefix_cache_mb=bound / 2**20) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        a, b, c = (conversation(client, first_prompt(10 + s), 1.0, turns=1)[0] for s in range(3))
        stats = cache_stats(client)
        # c's prompt did not fit: a's two nodes (its prompt, then the rest of its first turn) went.
        assert (stats["leaves"], stats["evictions"]) == (2, 2)
        assert stats["bytes"] == 2 * entry_bytes <= stats["max_bytes"]
        c_next = c["prompt"] + c["output_ids"] + observation(0)
        assert generate(client, c_next, 1.0, seed=1)["meta_info"]["cached_tokens"] == 40 + NEW_TOKENS - 1
        a_next = a["prompt"] + a["output_ids"] + observation(0)
        evicted = generate(client, a_next, 1.0, seed=1)
        assert evicted["meta_info"]["cached_tokens"] == 0  # a went first: the least recently used
        assert_same_outputs([evicted], [generate(uncached, a_next, 1.0, seed=1)])
        assert cache_stats(client)["bytes"] <= cache_stats(client)["max_bytes"]


# ---- PrefixCache on its own ------------------------------------------------------------------

def kv_for(ids: list[int]) -> torch.Tensor:
    """K/V whose values encode the token ids, so returned segments show which tokens they cover."""
    return torch.tensor(ids, dtype=torch.float32)[None, None, None, :, None].expand(1, 2, 1, len(ids), 2).clone()


TOKEN_BYTES = kv_for([0]).numel() * 4


def tokens_of(segments: list[torch.Tensor]) -> list[int]:
    return [int(t) for t in torch.cat(segments, dim=3)[0, 0, 0, :, 0].tolist()] if segments else []


def insert(cache: PrefixCache, ids: list[int]) -> None:
    cache.insert(ids, kv_for(ids))


def test_match_returns_the_longest_common_prefix_but_never_the_last_token() -> None:
    cache = PrefixCache(max_bytes=10**6)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 7])
    assert (cache.nodes, cache.leaves, cache.tokens, cache.bytes) == (3, 2, 5, 5 * TOKEN_BYTES)  # [1 2] shared
    for ids, expected in [([1, 2, 3, 4, 5], 4), ([1, 2, 3, 4], 3), ([1, 2, 7, 9], 3), ([1, 2, 8], 2),
                          ([1, 2, 3, 9], 3), ([9, 1, 2], 0)]:
        n, segments = cache.match(ids)
        assert n == expected and tokens_of(segments) == ids[:expected], ids
    assert cache.hit_tokens == 4 + 3 + 3 + 2 + 3


def test_an_entry_extending_another_adds_only_the_new_tokens() -> None:
    cache = PrefixCache(max_bytes=10**6)
    insert(cache, [1, 2])
    insert(cache, [1, 2, 3])
    assert (cache.nodes, cache.leaves, cache.tokens) == (2, 1, 3)
    insert(cache, [1, 2])  # already there: nothing added
    insert(cache, [1])  # a prefix of an edge: the edge is split, no token added
    assert (cache.leaves, cache.tokens, cache.insertions) == (1, 3, 2)
    assert tokens_of(cache.match([1, 2, 3, 0])[1]) == [1, 2, 3]


def test_lru_eviction_keeps_the_recently_matched_entry() -> None:
    cache = PrefixCache(max_bytes=20 * TOKEN_BYTES)
    for start in (100, 200):
        insert(cache, list(range(start, start + 10)))
    assert cache.match(list(range(100, 111)))[0] == 10  # 100.. is now the most recently used
    insert(cache, list(range(300, 310)))
    assert (cache.leaves, cache.evictions, cache.bytes) == (2, 1, 20 * TOKEN_BYTES)
    assert cache.match(list(range(200, 211)))[0] == 0
    assert cache.match(list(range(100, 111)))[0] == 10
    insert(cache, list(range(1000, 1030)))  # larger than the whole bound: not kept, nothing evicted
    assert (cache.leaves, cache.evictions, cache.tokens) == (2, 1, 20)


def test_eviction_takes_leaves_first_and_keeps_a_shared_prefix() -> None:
    cache = PrefixCache(max_bytes=5 * TOKEN_BYTES)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 5])  # tree: [1 2] -> [3 4], [5]: 5 tokens, at the bound
    insert(cache, [9])  # over it: the least recent leaf, [3 4], goes; [1 2] stays for [1 2 5]
    assert (cache.tokens, cache.leaves, cache.evictions) == (4, 2, 1)
    assert cache.match([1, 2, 3, 4, 0])[0] == 2
    assert cache.match([1, 2, 5, 0])[0] == 3
    insert(cache, [8, 8])  # [9] is now the least recent leaf
    assert cache.match([9, 0])[0] == 0 and cache.match([1, 2, 5, 0])[0] == 3


def test_a_disabled_cache_keeps_nothing() -> None:
    cache = PrefixCache(max_bytes=0)
    insert(cache, [1, 2, 3])
    assert (cache.nodes, cache.match([1, 2, 3, 4])) == (0, (0, []))


def test_common_prefix() -> None:
    a = tuple(range(1000))
    assert [common_prefix(a, a[:k] + (-1,) * 5, 2000) for k in (0, 1, 500, 999)] == [0, 1, 500, 999]
    assert common_prefix(a, a, 10) == 10 and common_prefix(a, a, 2000) == 1000
