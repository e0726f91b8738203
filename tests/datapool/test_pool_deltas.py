"""A turn recorded as a delta of the call it extends (its parent's first `prefix_len` ids + only its new ids) reads
back exactly as the same turn recorded with its whole prompt, on every implementation of the pool (SQLite,
PostgreSQL, the service); a delta the pool cannot rebuild is refused, naming why, and writes nothing."""

from __future__ import annotations

from dataclasses import replace

import httpx
import numpy as np
import pytest
import zstandard
from pool_helpers import call, session

from stepline.datapool import InvalidRecord, open_pool, wire
from stepline.datapool.records import CallRecord, prefix_check

EOT = 99  # an end-of-turn id the gateway appends to a turn the model did not close (an observation token)


ZSTD = zstandard.ZstdCompressor()
BODIES = [b'{"messages": [{"role": "user", "content": "' + b"a long document " * 200 + b'"}' + tail + b"]}"
          for tail in (b"", b', {"role": "assistant"}', b', {"role": "assistant"}, {"role": "user"}')]


def conversation(sid: str) -> list[CallRecord]:
    """Five calls in their whole form: turns that extend the last answer (one with an end-of-turn appended),
    an exact retry, and a call that branches inside an earlier prompt; bodies each one message longer."""
    doc = list(range(1000, 1100))  # a 100-id first prompt: longer than the ids prefix_check covers
    c0 = call(sid, 0, doc, [5, 6, EOT], request=ZSTD.compress(BODIES[0]), sampling={"temperature": 0.7})
    c1 = call(sid, 1, doc + [5, 6, EOT, 7, 8], [9, 10], version=1, finish_reason="length",  # not closed
              request=ZSTD.compress(BODIES[1]))
    c2 = call(sid, 2, doc + [5, 6, EOT, 7, 8, 9, 10, EOT, 11], [12, EOT], version=1, request=ZSTD.compress(BODIES[2]))
    c3 = call(sid, 3, c2.prompt_ids.tolist(), [13, EOT], version=2,  # an exact retry of call 2's prompt
              request=ZSTD.compress(BODIES[2]))
    c4 = call(sid, 4, doc[:40] + [14, 15], [16], version=2)  # branches inside call 0's prompt
    return [c0, c1, c2, c3, c4]


def delta(record: CallRecord, parent: CallRecord, prefix_len: int) -> CallRecord:
    """`record` as the gateway sends it: the first `prefix_len` ids of `parent`'s prompt + output by reference,
    and its body as the bytes after those it shares with the parent's."""
    prompt = record.prompt_ids
    assert prompt[:prefix_len].tolist() == np.concatenate([parent.prompt_ids, parent.output_ids])[:prefix_len].tolist()
    request, skip = record.request, 0
    if request is not None and parent.request is not None:
        body, base = unzstd(request), unzstd(parent.request)
        skip = next((i for i, (a, b) in enumerate(zip(body, base)) if a != b), min(len(body), len(base)))
        request = ZSTD.compress(body[skip:])
    return replace(record, prompt_ids=prompt[prefix_len:], parent=parent.call_index, prefix_len=prefix_len,
                   prefix_check=prefix_check(prompt[:prefix_len]), request=request, request_prefix=skip)


def unzstd(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data)


def as_deltas(calls: list[CallRecord]) -> list[CallRecord]:
    c0, c1, c2, c3, c4 = calls
    return [c0, delta(c1, c0, 103), delta(c2, c1, 107), delta(c3, c2, 109), delta(c4, c0, 40)]


def readable(pool, sid: str) -> tuple:
    """Everything a reader sees of a session (export, replay, dashboard, steps and `show` read these)."""
    calls = [(c.call_index, c.prompt_ids.tolist(), c.output_ids.tolist(), c.output_logprobs.tolist(), c.weight_version,
              c.finish_reason, c.sampling, c.request and unzstd(c.request), c.parent, c.prefix_len, c.request_prefix)
             for c in pool.get_calls(sid)]
    tree = pool.get_tree(sid)
    nodes = [(n.id, n.parent, n.kind, n.tokens.tolist(), n.logprobs.tolist(), n.call_index, n.weight_version)
             for n in tree.nodes]
    steps = [(t.tokens.tolist(), t.loss_mask.tolist(), t.logprobs.tolist(),
              [(s.call_index, s.action_start, s.action_end) for s in t.steps])
             for t in pool.get_episode(sid, "all").trajectories]
    return calls, nodes, tree.calls, steps


def test_a_delta_session_reads_back_as_the_same_session_recorded_whole(pool_url) -> None:
    pool = open_pool(pool_url)
    for sid in ("whole", "delta"):
        pool.create_session(session(sid))
    pool.add_calls(conversation("whole"))
    deltas = as_deltas(conversation("delta"))
    pool.add_calls(deltas[:1])
    pool.add_calls(deltas[1:2])
    pool.add_calls(deltas[2:])  # parents in earlier batches and in the same batch
    expected = readable(pool, "whole")
    assert expected[0][1][1] == conversation("x")[1].prompt_ids.tolist()  # the whole form, as recorded
    assert all(c[-3:] == (-1, 0, 0) for c in expected[0])  # readers get whole prompts, no delta fields
    assert [c[7] for c in expected[0]] == [*BODIES, BODIES[2], None]  # and whole bodies
    assert [d.request_prefix for d in deltas] == [0, len(BODIES[0]) - 2, len(BODIES[1]) - 2, len(BODIES[2]), 0]
    assert readable(pool, "delta") == expected
    pool.close()
    pool = open_pool(pool_url)  # a cold cache: the tree replayed from storage
    assert readable(pool, "delta") == expected
    pool.add_calls(deltas[1:3])  # re-sending acknowledged deltas (a lost answer) changes nothing
    assert readable(pool, "delta") == expected
    with pytest.raises(InvalidRecord, match="different content"):
        pool.add_calls([replace(deltas[2], prompt_ids=np.array([11, 11], np.int32))])
    pool.close()


def bad_deltas() -> list:
    c0, c1, c2, *_ = conversation("s1")
    good = delta(c2, c1, 107)
    return [
        pytest.param(good, "not in the pool", id="parent-lost"),  # call 1 was never written
        pytest.param(replace(delta(c1, c0, 103), prefix_len=104), "longer than call 0's prompt \\+ output",
                     id="wrong-length"),
        pytest.param(replace(delta(c1, c0, 103), prefix_check=12345), "does not match call 0's ids", id="other-ids"),
        pytest.param(replace(delta(c1, c0, 103), parent=1), "parent must be an earlier call", id="not-earlier"),
        pytest.param(replace(delta(c1, c0, 103), prefix_len=0), "prefix_len must be at least 1", id="empty-prefix"),
        pytest.param(replace(delta(c1, c0, 103), request_prefix=len(BODIES[0]) + 1),
                     f"request_prefix {len(BODIES[0]) + 1} with call 0's request of {len(BODIES[0])} bytes",
                     id="request-longer-than-the-parents"),
        pytest.param(replace(delta(c1, c0, 103), request=b"not zstd"), "zstd frame", id="request-not-zstd"),
    ]


@pytest.mark.parametrize("bad, match", bad_deltas())
def test_a_delta_the_pool_cannot_rebuild_is_refused_naming_why(pool, bad, match) -> None:
    pool.create_session(session("s1"))
    pool.add_calls(conversation("s1")[:1])
    with pytest.raises(InvalidRecord, match=match):
        pool.add_calls([bad])
    assert pool.stats()["calls"] == 1


def test_a_delta_of_another_sessions_call_is_refused(pool) -> None:
    for sid in ("s1", "s2"):
        pool.create_session(session(sid))
    pool.add_calls(conversation("s2")[:2])
    pool.add_calls(conversation("s1")[:1])
    c1, c2 = conversation("s2")[1:3]
    with pytest.raises(InvalidRecord, match="parent call 1 is not in the pool"):
        pool.add_calls([replace(delta(c2, c1, 107), session_id="s1")])
    assert [c.call_index for c in pool.get_calls("s1")] == [0]


def test_an_older_client_without_the_delta_fields_still_records_whole_calls(tmp_path) -> None:
    from pool_helpers import ServiceThread

    records = [wire.to_wire(c) for c in conversation("s1")[:2]]
    for r in records:
        for name in ("parent", "prefix_len", "prefix_check"):
            del r[name]
    with ServiceThread(f"sqlite:///{tmp_path}/pool.db") as service:
        pool = open_pool(service.url)
        pool.create_session(session("s1"))
        answer = httpx.post(f"{service.url}/v1/add_calls", content=wire.packb({"records": records}))
        assert answer.status_code == 200, answer.text
        assert [c.prompt_ids.tolist() for c in pool.get_calls("s1")] == [
            c.prompt_ids.tolist() for c in conversation("s1")[:2]]
        pool.close()


def test_an_export_of_a_delta_session_holds_the_session_recorded_whole(tmp_path) -> None:
    from stepline.datapool.export import export_pool, load_export

    pool = open_pool(f"sqlite:///{tmp_path}/pool.db")
    for sid in ("whole", "delta"):
        pool.create_session(session(sid))
    pool.add_calls(conversation("whole") + as_deltas(conversation("delta")))
    export_pool(pool, tmp_path / "pool.export")  # type: ignore[arg-type]
    expected = readable(pool, "whole")
    pool.close()
    loaded = load_export(tmp_path / "pool.export")
    assert readable(loaded, "delta") == readable(loaded, "whole") == expected
    loaded.close()
