"""A call resumed across a weight update (the gateway's partial rollouts) records which version sampled which of its
tokens (`CallRecord.version_spans`), on every backend: the tree holds one action node per span, a step reports the
oldest version, the session's oldest version is what claims compare, and export / import keep the spans."""

from __future__ import annotations

import pytest
from pool_helpers import call, session

from stepline.datapool import InvalidRecord, open_pool
from stepline.datapool.export import export_pool, import_pool
from stepline.datapool.records import Reward

# call 0 is resumed: output [7, 8] sampled by version 3 (the version stamped at dispatch), then [9, 10] by version 5
RESUMED = dict(version=3, version_spans=[(0, 3), (2, 5)])


def acts(pool, session_id: str) -> list[tuple[list[int], int, int]]:
    """(tokens, version, call) of each action node, in the tree's order."""
    return [(n.tokens.tolist(), n.weight_version, n.call_index) for n in pool.get_tree(session_id).nodes
            if n.kind == "act"]


def test_a_resumed_call_keeps_each_token_s_version(pool_url):
    pool = open_pool(pool_url)
    pool.create_session(session("s"))
    pool.add_calls([call("s", 0, [1, 2], [7, 8, 9, 10], **RESUMED),
                    call("s", 1, [1, 2, 7, 8, 9, 10, 11], [12], version=5)])  # the next turn extends the whole answer
    pool.close()
    pool = open_pool(pool_url)  # a cold cache: the tree is replayed from storage, spans included
    assert acts(pool, "s") == [([7, 8], 3, 0), ([9, 10], 5, 0), ([12], 5, 1)]
    recorded = pool.get_calls("s")
    assert [c.version_spans for c in recorded] == [[(0, 3), (2, 5)], []]
    assert recorded[0].weight_version == 3 and recorded[1].spans == [(0, 5)]
    steps = pool.get_episode("s").trajectories[0].steps
    # the step of the resumed call: its whole action, the oldest version for the staleness bound, and its spans
    assert [(s.action_start, s.action_end, s.weight_version, s.version_spans) for s in steps] == [
        (2, 6, 3, [(0, 3), (2, 5)]), (7, 8, 5, [(0, 5)])]
    assert steps[0].behaviour_logprobs.tolist() == [-0.25] * 4  # every piece's logprobs, unchanged


def test_resending_a_resumed_call_is_idempotent_only_with_the_same_spans(pool_url):
    pool = open_pool(pool_url)
    pool.create_session(session("s"))
    pool.add_calls([call("s", 0, [1], [7, 8, 9], **RESUMED)])
    pool.add_calls([call("s", 0, [1], [7, 8, 9], **RESUMED)])  # a lost acknowledgement: the same record again
    with pytest.raises(InvalidRecord, match="different content"):
        pool.add_calls([call("s", 0, [1], [7, 8, 9], version=3, version_spans=[(0, 3), (1, 5)])])
    assert len(pool.get_calls("s")) == 1


@pytest.mark.parametrize("spans", [[(1, 3)], [(0, 3), (0, 5)], [(0, 3), (3, 5)], [(0, -1)], [(0, 3, 1)], "x"])
def test_spans_that_do_not_cover_the_output_are_refused(pool_url, spans):
    pool = open_pool(pool_url)
    pool.create_session(session("s"))
    with pytest.raises(InvalidRecord, match="version_spans"):
        pool.add_calls([call("s", 0, [1], [7, 8, 9], version=3, version_spans=spans)])


def test_claims_see_the_oldest_version_of_a_resumed_call(pool_url):
    pool = open_pool(pool_url)
    for sid in ("a", "b"):
        pool.create_session(session(sid, task="t"))
        pool.add_reward(Reward(sid, 1.0))
        pool.end_session(sid)
    # a's first piece came from version 3; b's first piece was cut before any token, so all of it is version 5
    pool.add_calls([call("a", 0, [1], [7, 8, 9], **RESUMED),
                    call("b", 0, [1], [7, 8], version=3, version_spans=[(0, 5)])])
    assert pool.claim_groups("trainer", min_version=4, max_groups=1) == []  # a is older than the bound: stale
    assert pool.stats()["groups_stale"] == 1


def test_export_and_import_keep_the_spans(tmp_path):
    pool = open_pool(f"sqlite:///{tmp_path}/a.db")
    pool.create_session(session("s"))
    pool.add_calls([call("s", 0, [1, 2], [7, 8, 9, 10], **RESUMED)])
    export_pool(pool, tmp_path / "pool.stepline")
    copy = open_pool(f"sqlite:///{tmp_path}/b.db")
    import_pool(tmp_path / "pool.stepline", copy)
    assert acts(copy, "s") == acts(pool, "s") == [([7, 8], 3, 0), ([9, 10], 5, 0)]
    assert copy.get_calls("s")[0].version_spans == [(0, 3), (2, 5)]
