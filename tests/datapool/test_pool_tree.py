"""The radix tree: hand-built cases and property tests (random calls rebuild exactly, tokens stored once)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.datapool.tree import ROOT, RadixTree, StoredCall, common_prefix_len, replay


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def lps(n: int, base: float = -0.5) -> np.ndarray:
    return np.full(n, base, dtype=np.float32)


def add(tree: RadixTree, call: int, prompt, output, version: int = 0):
    return tree.insert(call, ids(*prompt), ids(*output), lps(len(output), -0.1 * (call + 1)), version)


def shape(tree: RadixTree) -> list[tuple[int, int, str, list[int], int]]:
    return [(n.id, n.parent, n.kind, n.tokens.tolist(), n.call_index) for n in tree.snapshot().nodes]


def test_second_turn_stores_only_its_new_tokens():
    tree = RadixTree("s")
    add(tree, 0, [1, 2, 3], [4, 5])
    got = add(tree, 1, [1, 2, 3, 4, 5, 6, 7], [8], version=1)
    # the prompt's first 5 tokens are call 0's prompt + output; only [6, 7] are new
    assert (got.base_call, got.base_len, got.new_prompt.tolist()) == (0, 5, [6, 7])
    assert shape(tree) == [(0, ROOT, "obs", [1, 2, 3], 0), (1, 0, "act", [4, 5], 0),
                           (2, 1, "obs", [6, 7], 1), (3, 2, "act", [8], 1)]
    assert tree.calls == {0: (0, [1]), 1: (2, [3])}
    assert tree.nodes[3].weight_version == 1 and tree.nodes[2].weight_version == -1
    assert tree.n_tokens == 8


def test_fork_inside_an_observation_node_splits_it():
    tree = RadixTree("s")
    add(tree, 0, [1, 2, 3], [4])
    add(tree, 1, [1, 2, 9], [10])
    # node 0 keeps the head [1, 2]; the tail [3] becomes node 2 and adopts call 0's action
    assert shape(tree) == [(0, ROOT, "obs", [1, 2], 0), (2, 0, "obs", [3], 0), (1, 2, "act", [4], 0),
                           (3, 0, "obs", [9], 1), (4, 3, "act", [10], 1)]
    assert tree.calls[0] == (2, [1])
    assert tree.sequence(0).tolist() == [1, 2, 3, 4]


def test_fork_inside_an_action_splits_it_and_keeps_the_call_whole():
    tree = RadixTree("s")
    add(tree, 0, [1], [4, 5, 6])
    add(tree, 1, [1, 4, 7], [8])  # the harness kept only the first token of call 0's answer
    assert tree.calls[0] == (0, [1, 2])
    assert [tree.nodes[i].tokens.tolist() for i in tree.calls[0][1]] == [[4], [5, 6]]
    assert tree.nodes[2].logprobs.tolist() == [np.float32(-0.1)] * 2
    assert tree.sequence(0).tolist() == [1, 4, 5, 6]
    assert tree.sequence(1).tolist() == [1, 4, 7, 8]


def test_retry_adds_a_sibling_action_even_with_equal_tokens():
    tree = RadixTree("s")
    add(tree, 0, [1, 2], [3, 4])
    add(tree, 1, [1, 2], [3, 4], version=1)
    assert tree.calls == {0: (0, [1]), 1: (0, [2])}
    assert tree.n_tokens == 6
    # a next turn continuing the equal answers hangs below the latest one
    got = add(tree, 2, [1, 2, 3, 4, 5], [6])
    assert (got.base_call, got.base_len) == (1, 4)


def test_deepest_path_wins_over_the_longest_single_node():
    tree = RadixTree("s")
    add(tree, 0, [1], [3, 4])
    add(tree, 1, [1, 3, 4, 5, 6], [7])  # continues call 0: path 1 | 3 4 | 5 6 | 7
    add(tree, 2, [1], [3, 4, 5])  # a retry whose action shares 3 4 5 with that path
    got = add(tree, 3, [1, 3, 4, 5, 6, 7, 9], [0])
    assert (got.base_call, got.base_len) == (1, 6)


def test_replay_rebuilds_the_same_tree():
    tree, stored = RadixTree("s"), []
    for call, (p, o) in enumerate([([1, 2, 3], [4]), ([1, 2, 3, 4, 5], [6]), ([1, 9], [7]), ([1, 9], [8])]):
        got = add(tree, call, p, o)
        stored.append(StoredCall(call, got.base_call, got.base_len, got.new_prompt, ids(*o),
                                 lps(len(o), -0.1 * (call + 1)), 0))
    assert shape(replay("s", stored)) == shape(tree)


def test_common_prefix_len():
    assert common_prefix_len(ids(1, 2, 3), ids(1, 2, 4, 5)) == 2
    assert common_prefix_len(ids(1, 2), ids(1, 2, 4)) == 2
    assert common_prefix_len(ids(), ids(1)) == 0


# ---- property tests ----

VOCAB = 4  # a tiny vocabulary makes accidental shared prefixes and equal sibling actions common


@st.composite
def call_sequences(draw):
    """Calls as a harness makes them: next turns, forks inside earlier spans, retries, compaction."""
    calls, sequences = [], []
    for _ in range(draw(st.integers(1, 12))):
        move = draw(st.sampled_from(["new", "extend", "fork", "retry", "compact"]))
        if move == "new" or not calls:
            prompt = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
        elif move == "retry":
            prompt = draw(st.sampled_from(calls))[0]
        else:
            base = draw(st.sampled_from(sequences))
            cut = len(base) if move == "extend" else draw(st.integers(0, len(base)))
            if move == "compact":
                cut = min(cut, 1)
            prompt = base[:cut] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
        output = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        calls.append((prompt, output))
        sequences.append(prompt + output)
    return calls


@settings(max_examples=300, deadline=None)
@given(call_sequences())
def test_random_calls_rebuild_exactly_and_store_each_token_once(calls):
    tree, stored = RadixTree("s"), []
    for call, (prompt, output) in enumerate(calls):
        earlier = [p + o for p, o in calls[:call]]
        got = add(tree, call, prompt, output, version=call)
        # the shared prefix is the longest one any earlier path offers: only new tokens are stored
        assert got.base_len == max([common_prefix_len(ids(*prompt), ids(*s)) for s in earlier], default=0)
        stored.append(StoredCall(call, got.base_call, got.base_len, got.new_prompt, ids(*output),
                                 lps(len(output), -0.1 * (call + 1)), call))
    new_tokens = sum(len(s.new_prompt) + len(s.output_ids) for s in stored)
    assert tree.n_tokens == new_tokens
    snap = tree.snapshot()
    seen = set()
    for node in snap.nodes:  # topological order, every node non-empty
        assert node.parent == ROOT or node.parent in seen
        assert len(node.tokens) > 0
        seen.add(node.id)
    for call, (prompt, output) in enumerate(calls):
        end, acts = snap.calls[call]
        assert tree.path_tokens(end).tolist() == prompt if end != ROOT else prompt == []
        assert tree.sequence(call).tolist() == prompt + output
        lp = [x for a in acts for x in tree.nodes[a].logprobs.tolist()]
        assert lp == lps(len(output), -0.1 * (call + 1)).tolist()
        assert all(tree.nodes[a].kind == "act" and tree.nodes[a].weight_version == call for a in acts)
    assert shape(replay("s", stored)) == shape(tree)
