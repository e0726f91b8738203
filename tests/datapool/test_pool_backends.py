"""One suite, every backend (SQLite and PostgreSQL): storage, validation, rewards, groups, claims."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_helpers import call, session

from stepline.datapool import InvalidRecord, PoolError, ReadOnlyPool, UnknownSession, open_pool
from stepline.datapool.records import Reward
from stepline.datapool.tree import RadixTree


def tree_shape(tree):
    return [(n.id, n.parent, n.kind, n.tokens.tolist(), n.logprobs.tolist(), n.call_index, n.weight_version)
            for n in tree.nodes], tree.calls


def test_calls_rebuild_after_reopen(pool_url):
    pool = open_pool(pool_url)
    pool.create_session(session("s1"))
    calls = [call("s1", 0, [1, 2, 3], [4, 5], request=b"req", sampling={"temperature": 1.0}),
             call("s1", 1, [1, 2, 3, 4, 5, 6], [7], version=1, finish_reason="length"),
             call("s1", 2, [1, 2, 9], [8], version=2)]
    pool.add_calls(calls[:2])
    pool.add_calls(calls[2:])
    warm = pool.get_tree("s1")
    pool.close()
    pool = open_pool(pool_url)  # a cold cache: the tree is replayed from storage
    assert tree_shape(pool.get_tree("s1")) == tree_shape(warm)
    expected = RadixTree("s1")
    for c in calls:
        expected.insert(c.call_index, c.prompt_ids, c.output_ids, c.output_logprobs, c.weight_version)
    assert tree_shape(warm) == tree_shape(expected.snapshot())
    got = pool.get_calls("s1")
    for a, b in zip(got, calls, strict=True):
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist() and a.output_ids.tolist() == b.output_ids.tolist()
        assert a.output_logprobs.tolist() == b.output_logprobs.tolist()
        assert (a.weight_version, a.finish_reason, a.request, a.sampling) == (b.weight_version, b.finish_reason,
                                                                             b.request, b.sampling)
    # tokens stored once: 3+2 | 1+1 | split [1,2]+[3]: 1+1 new → 9 unique tokens, 4 of them sampled
    assert pool.stats()["tokens"] == 9 and pool.stats()["action_tokens"] == 4
    pool.close()


def test_sessions_create_get_list_end(pool):
    pool.create_session(session("a", group="g"))
    pool.create_session(session("a", group="g"))  # same again: a no-op
    pool.create_session(session("b"))
    with pytest.raises(InvalidRecord, match="exists"):
        pool.create_session(session("a", task="other"))
    pool.end_session("b", "failed")
    assert pool.get_session("a").group_key == "g" and pool.get_session("b").group_key == "t1::h"
    assert [s.session_id for s in pool.list_sessions()] == ["a", "b"]
    assert [s.session_id for s in pool.list_sessions("failed")] == ["b"]
    assert pool.get_session("b").ended_at is not None
    with pytest.raises(UnknownSession):
        pool.get_session("zz")
    with pytest.raises(UnknownSession):
        pool.end_session("zz")
    with pytest.raises(InvalidRecord, match="end status"):
        pool.end_session("a", "open")


@pytest.mark.parametrize("bad, match", [
    (call("s1", 1, [1], [2, 3]), None),  # replaced below: logprob count
    (call("nope", 1, [1], [2]), "unknown session"),
    (call("s1", 1, [1, -4], [2]), "out of range"),
    (call("s1", 1, [1], [2**31]), "out of range"),
    (call("s1", -1, [1], [2]), "call_index"),
    (call("s1", 1, [1], [2], version=-1), "weight_version"),
])
def test_invalid_calls_write_nothing(pool, bad, match):
    if match is None:
        bad.output_logprobs = np.zeros(1, np.float32)
        match = "1 logprobs for 2 output tokens"
    pool.create_session(session("s1"))
    with pytest.raises(InvalidRecord, match=match):
        pool.add_calls([call("s1", 0, [1, 2], [3]), bad])
    assert pool.stats()["calls"] == 0 and pool.get_tree("s1").nodes == []
    pool.add_calls([call("s1", 0, [1, 2], [3])])  # the cache was not left with the refused batch
    assert len(pool.get_tree("s1").nodes) == 2


def test_resending_a_call_is_a_no_op_but_a_different_one_is_refused(pool):
    pool.create_session(session("s1"))
    pool.add_calls([call("s1", 0, [1, 2], [3])])
    pool.add_calls([call("s1", 0, [1, 2], [3]), call("s1", 1, [1, 2, 3, 4], [5])])
    assert pool.stats()["calls"] == 2
    with pytest.raises(InvalidRecord, match="different content"):
        pool.add_calls([call("s1", 1, [1, 2, 3, 4], [6])])


def test_rewards_terminal_step_named_and_delayed(pool):
    pool.create_session(session("s1"))
    pool.add_calls([call("s1", 0, [1], [2]), call("s1", 1, [1, 2, 3], [4])])
    pool.add_reward(Reward("s1", 0.5, step=0, name="format", weight=2.0))
    pool.end_session("s1")
    pool.add_reward(Reward("s1", 1.0))  # a delayed evaluator, after the end
    pool.add_reward(Reward("s1", 0.2, name="judge", weight=0.5))
    pool.add_reward(Reward("s1", 0.0, name="judge", weight=0.5))  # same name again: replaces
    ep = pool.get_episode("s1")
    assert ep.outcome == pytest.approx(1.0)  # 1.0 × 1 + 0.0 × 0.5
    steps = ep.trajectories[0].steps
    assert [s.reward for s in steps] == [1.0, 0.0]  # 0.5 × weight 2 on call 0
    with pytest.raises(InvalidRecord, match="unknown step 7"):
        pool.add_reward(Reward("s1", 1.0, step=7))
    with pytest.raises(InvalidRecord, match="unknown session"):
        pool.add_reward(Reward("zz", 1.0))
    with pytest.raises(InvalidRecord, match="finite"):
        pool.add_reward(Reward("s1", float("nan")))
    with pytest.raises(InvalidRecord, match="value 1e.300 is outside"):  # each factor finite, the product is not
        pool.add_reward(Reward("s1", 1e300, name="bonus", weight=1e10))
    with pytest.raises(InvalidRecord, match="value × weight"):  # each factor within the bound, the product not
        pool.add_reward(Reward("s1", 1e5, name="bonus", weight=1e5))
    assert pool.stats()["rewards"] == 3


def test_the_reward_bound_is_a_pool_option(tmp_path) -> None:
    wide = open_pool(f"sqlite:///{tmp_path / 'p.db'}?max_reward=1e9&synchronous=normal")
    try:
        wide.create_session(session("s1"))
        wide.add_reward(Reward("s1", 1e8))  # outside the default bound of 1e6, inside this pool's
        with pytest.raises(InvalidRecord, match=r"value × weight .* outside \[-1e\+09, 1e\+09\]"):
            wide.add_reward(Reward("s1", 1e5, name="bonus", weight=1e5))
    finally:
        wide.close()
    default = open_pool(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with pytest.raises(InvalidRecord, match="value 1e.08 is outside"):
            default.add_reward(Reward("s1", 1e8))
    finally:
        default.close()
    for bad in ("0", "nan", "big"):
        with pytest.raises(PoolError, match="max_reward"):
            open_pool(f"sqlite:///{tmp_path / 'q.db'}?max_reward={bad}")


def finish(pool, sid, reward: float | None = 1.0, status="completed", version=0, task="t1", group=None):
    pool.create_session(session(sid, task=task, group=group))
    pool.add_calls([call(sid, 0, [1, 2], [3], version=version)])
    pool.end_session(sid, status)
    if reward is not None:
        pool.add_reward(Reward(sid, reward))


def test_a_group_waits_for_every_session_of_its_key(pool):
    finish(pool, "a")
    pool.create_session(session("b"))  # same task × harness, still running
    assert pool.claim_groups("trainer", 0, 10) == []
    pool.end_session("b")
    assert pool.claim_groups("trainer", 0, 10) == []  # ended but not rewarded yet
    pool.add_reward(Reward("b", 0.0))
    [group] = pool.claim_groups("trainer", 0, 10)
    assert group.group_key == "t1::h" and sorted(e.info.session_id for e in group.episodes) == ["a", "b"]
    assert pool.claim_groups("trainer", 0, 10) == []  # handed out once
    finish(pool, "c")  # the same key again later: a new group
    [later] = pool.claim_groups("other", 0, 10)
    assert [e.info.session_id for e in later.episodes] == ["c"] and later.group_id != group.group_id


def test_group_size_explicit_group_and_failed_sessions(pool):
    finish(pool, "a", group="g")
    assert pool.claim_groups("tr", 0, 10, group_size=2) == []
    finish(pool, "b", group="g")
    finish(pool, "x", reward=None, status="failed", group="g")  # failed, never rewarded: left out
    [group] = pool.claim_groups("tr", 0, 10, group_size=2)
    assert group.group_key == "g" and [e.info.session_id for e in group.episodes] == ["a", "b"]


def test_stale_groups_are_skipped_and_counted(pool):
    finish(pool, "old", version=1, task="t1")
    finish(pool, "new", version=3, task="t2")
    [group] = pool.claim_groups("tr", 2, 10)
    assert group.group_key == "t2::h" and group.min_version == 3
    assert pool.stats()["groups_stale"] == 1 and pool.claim_groups("tr", 0, 10) == []


def test_max_groups_consume_and_release(pool):
    for i in range(3):
        finish(pool, f"s{i}", task=f"t{i}")
    first = pool.claim_groups("tr", 0, 2)
    assert [g.group_key for g in first] == ["t0::h", "t1::h"]
    with pytest.raises(InvalidRecord, match="handed to 'tr'"):
        pool.mark_consumed([first[0].group_id], "someone-else")
    pool.mark_consumed([first[0].group_id], "tr")
    pool.mark_consumed([first[0].group_id], "tr")  # again: a no-op
    pool.release_groups([first[1].group_id], "tr")
    with pytest.raises(InvalidRecord, match="consumed"):
        pool.release_groups([first[0].group_id], "tr")
    with pytest.raises(InvalidRecord, match="unknown group"):
        pool.mark_consumed(["nope"], "tr")
    again = pool.claim_groups("tr2", 0, 10)
    assert sorted(g.group_key for g in again) == ["t1::h", "t2::h"]
    stats = pool.stats()
    assert (stats["groups_consumed"], stats["groups_claimed"]) == (1, 2)


def test_episode_leaf_rules(pool):
    pool.create_session(session("s1"))
    pool.add_calls([call("s1", 0, [1, 2], [3]), call("s1", 1, [1, 2], [4]), call("s1", 2, [1, 2, 4, 5], [6])])
    assert len(pool.get_episode("s1", "all").trajectories) == 2
    [main] = pool.get_episode("s1", "main").trajectories
    assert main.tokens.tolist() == [1, 2, 4, 5, 6] and main.is_main
    with pytest.raises(InvalidRecord, match="leaf rule"):
        pool.get_episode("s1", "best")  # type: ignore[arg-type]


def test_read_only_pool_refuses_writes(pool_url):
    open_pool(pool_url).close()
    pool = open_pool(pool_url, read_only=True)
    with pytest.raises(ReadOnlyPool):
        pool.create_session(session("s1"))
    with pytest.raises(ReadOnlyPool):
        pool.claim_groups("tr", 0, 1)
    assert pool.list_sessions() == []
    pool.close()


def test_concurrent_claimers_never_share_a_group(pool_url):
    setup = open_pool(pool_url)
    for i in range(12):
        finish(setup, f"s{i}", task=f"t{i}")
    setup.close()
    got: dict[str, list[str]] = {}

    def claimer(name: str) -> None:
        p = open_pool(pool_url)
        got[name] = [g.group_key for _ in range(6) for g in p.claim_groups(name, 0, 1)]
        p.close()

    threads = [threading.Thread(target=claimer, args=(f"c{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [k for ks in got.values() for k in ks]
    assert sorted(keys) == sorted(f"t{i}::h" for i in range(12))  # each group exactly once


VOCAB = 3


@st.composite
def batches(draw):
    seqs, calls = [], []
    for _ in range(draw(st.integers(1, 8))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
        else:
            prompt = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        output = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
        seqs.append(prompt + output)
        calls.append((draw(st.sampled_from(["a", "b"])), prompt, output))
    cuts = sorted(draw(st.lists(st.integers(0, len(calls)), max_size=3)))
    return calls, cuts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_random_batches_replay_exactly(pool_url, data):
    calls, cuts = data
    name = f"{abs(hash((str(calls), tuple(cuts))))}"
    pool = open_pool(pool_url)
    records, counters = [], {"a": 0, "b": 0}
    for sid in ("a", "b"):
        pool.create_session(session(f"{name}{sid}"))
    for sid, prompt, output in calls:
        records.append(call(f"{name}{sid}", counters[sid], prompt, output))
        counters[sid] += 1
    for lo, hi in zip([0, *cuts], [*cuts, len(records)], strict=True):
        pool.add_calls(records[lo:hi])
    warm = {s: tree_shape(pool.get_tree(f"{name}{s}")) for s in ("a", "b")}
    pool.close()
    pool = open_pool(pool_url)
    for s in ("a", "b"):
        assert tree_shape(pool.get_tree(f"{name}{s}")) == warm[s]
        got = pool.get_calls(f"{name}{s}")
        want = [r for r in records if r.session_id == f"{name}{s}"]
        assert [(g.prompt_ids.tolist(), g.output_ids.tolist()) for g in got] == \
            [(w.prompt_ids.tolist(), w.output_ids.tolist()) for w in want]
    pool.close()


def test_reset_claims_hands_every_group_out_again(pool):
    if not hasattr(pool, "reset_claims"):
        pytest.skip("reset_claims works on a local copy of a pool (SQLite/PostgreSQL), not through the service")
    finish(pool, "a", task="t1")
    finish(pool, "b", task="t2")
    finish(pool, "c", task="t3", version=0)
    first = pool.claim_groups("tr", min_version=0, max_groups=1)
    pool.mark_consumed([first[0].group_id], "tr")
    assert len(pool.claim_groups("tr", min_version=1, max_groups=5)) == 0  # the other two: stale now
    assert pool.reset_claims() == 3
    again = pool.claim_groups("replay", min_version=0, max_groups=5)
    assert sorted(g.group_key for g in again) == ["t1::h", "t2::h", "t3::h"]
    assert pool.stats()["groups_claimed"] == 3 and pool.stats()["groups_consumed"] == 0
