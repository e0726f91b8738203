"""Recorder: FIFO order, batching, back-pressure, pool outages and refusals, flush on close."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stepline.datapool import open_pool
from stepline.datapool.base import InvalidRecord, UnknownSession
from stepline.datapool.records import CallRecord, Reward, SessionInfo
from stepline.gateway.recorder import Delta, Recorder


def call(session: str, index: int) -> CallRecord:
    return CallRecord(
        session_id=session,
        call_index=index,
        prompt_ids=np.arange(4 + index, dtype=np.int32),
        output_ids=np.array([7, 8], dtype=np.int32),
        output_logprobs=np.array([-0.1, -0.2], dtype=np.float32),
        weight_version=0,
    )


class MemoryPool:
    """The write half of the pool interface, in memory; can be taken down or made to refuse calls."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, object]] = []
        self.batches: list[list[int]] = []
        self.down = 0  # the next `down` writes fail with ConnectionError
        self.refuse: set[int] = set()  # call indexes refused as invalid
        self.sessions: set[str] = set()
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # set once a write waits at the closed gate

    def _check(self) -> None:
        if not self.gate.is_set():
            self.waiting.set()
        self.gate.wait()
        with self.lock:
            if self.down:
                self.down -= 1
                raise ConnectionError("pool is down")

    def create_session(self, info: SessionInfo) -> None:
        self._check()
        self.sessions.add(info.session_id)
        self.ops.append(("session", info.session_id))

    def add_calls(self, records: list[CallRecord]) -> None:
        self._check()
        if any(r.call_index in self.refuse for r in records):
            raise InvalidRecord("bad record")
        self.batches.append([r.call_index for r in records])
        self.ops.extend(("call", r.call_index) for r in records)

    def add_reward(self, reward: Reward) -> None:
        self._check()
        if reward.session_id not in self.sessions:
            raise UnknownSession(reward.session_id)
        self.ops.append(("reward", reward.value))

    def end_session(self, session_id: str, status: str = "completed") -> None:
        self._check()
        self.ops.append(("end", status))


@pytest.fixture
async def pool_recorder():
    pool = MemoryPool()
    recorder = Recorder(pool, max_queue=100, batch_size=256, flush_interval=0.01, max_backoff=0.02)
    await recorder.start()
    yield pool, recorder
    await recorder.aclose()


async def test_fifo_order_and_one_batch_of_consecutive_calls(pool_recorder) -> None:
    pool, recorder = pool_recorder
    await recorder.create_session(SessionInfo("s", "task", "h"))
    for i in range(3):
        recorder.record_call(call("s", i))
    await recorder.add_reward(Reward("s", 1.0))
    await recorder.end_session("s", "completed")
    # the reward and the end were acknowledged only after every call queued before them
    assert pool.ops == [("session", "s"), ("call", 0), ("call", 1), ("call", 2), ("reward", 1.0), ("end", "completed")]
    assert pool.batches == [[0, 1, 2]]
    assert recorder.written == 3


async def test_raw_request_and_answer_are_compressed_in_the_worker(pool_recorder) -> None:
    import zstandard

    pool, recorder = pool_recorder
    records = []
    pool.add_calls = lambda batch: records.extend(batch)  # type: ignore[method-assign]
    raw = call("s", 0)
    raw.request, raw.response = b'{"messages": []}', b'{"choices": []}'
    recorder.record_call(raw, compress=True)
    recorder.record_call(call("s", 1))  # already compressed (or no bodies): left alone
    await recorder.flush()
    assert [r.call_index for r in records] == [0, 1]
    unzip = zstandard.ZstdDecompressor()
    assert unzip.decompress(records[0].request) == b'{"messages": []}'
    assert unzip.decompress(records[0].response) == b'{"choices": []}'
    assert records[1].request is None


async def test_batches_are_bounded() -> None:
    pool = MemoryPool()
    pool.gate.clear()  # hold the worker so the calls queue up
    recorder = Recorder(pool, batch_size=2)
    await recorder.start()
    recorder.record_call(call("s", 0))
    assert await asyncio.to_thread(pool.waiting.wait, 10)  # the worker is now blocked inside add_calls([0])
    for i in range(1, 6):
        recorder.record_call(call("s", i))
    pool.gate.set()
    await recorder.flush()
    await recorder.aclose()
    assert pool.batches == [[0], [1, 2], [3, 4], [5]]


async def test_outage_keeps_records_and_back_pressure_applies() -> None:
    pool = MemoryPool()
    pool.down = 5  # five failed writes, then the pool is back
    recorder = Recorder(pool, max_queue=3, flush_interval=0.001, max_backoff=0.02)
    await recorder.start()
    for i in range(3):
        recorder.record_call(call("s", i))
    assert not recorder.has_capacity()  # the app answers 503 now
    assert recorder.depth() == 3
    await recorder.flush()
    assert recorder.has_capacity()
    assert [op for op in pool.ops] == [("call", 0), ("call", 1), ("call", 2)]  # nothing lost, order kept
    assert recorder.pool_errors == 5 and recorder.dropped == 0
    await recorder.aclose()


async def test_a_refused_call_is_counted_and_logged_the_rest_written(pool_recorder, caplog) -> None:
    pool, recorder = pool_recorder
    pool.refuse = {1}
    with caplog.at_level(logging.ERROR, logger="stepline.gateway.recorder"):
        for i in range(3):
            recorder.record_call(call("s", i))
        await recorder.flush()
    assert [op for op in pool.ops] == [("call", 0), ("call", 2)]
    assert (recorder.written, recorder.dropped) == (2, 1)
    assert "pool refused call s/1" in caplog.text


async def test_a_refused_reward_raises_in_the_caller(pool_recorder) -> None:
    pool, recorder = pool_recorder
    with pytest.raises(UnknownSession):
        await recorder.add_reward(Reward("nobody", 1.0))
    await recorder.create_session(SessionInfo("s", "t", "h"))  # the recorder keeps working
    assert pool.ops == [("session", "s")]


async def test_aclose_flushes_everything() -> None:
    pool = MemoryPool()
    recorder = Recorder(pool, batch_size=16, flush_interval=1.0)
    await recorder.start()
    for i in range(100):
        recorder.record_call(call("s", i))
    await recorder.aclose()
    assert [op[1] for op in pool.ops] == list(range(100))
    assert max(len(b) for b in pool.batches) <= 16


async def test_aclose_gives_up_on_a_dead_pool_loudly(caplog) -> None:
    pool = MemoryPool()
    pool.down = 10**9
    recorder = Recorder(pool, max_backoff=0.01, close_timeout=0.1)
    await recorder.start()
    recorder.record_call(call("s", 0))
    recorder.record_call(call("s", 1))
    with caplog.at_level(logging.ERROR, logger="stepline.gateway.recorder"):
        await asyncio.wait_for(recorder.aclose(), 5)
    assert "2 call records NOT written" in caplog.text


async def test_records_into_the_real_embedded_pool(tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    recorder = Recorder(pool)
    await recorder.start()
    await recorder.create_session(SessionInfo("s", "task", "h"))
    recorder.record_call(call("s", 0))
    recorder.record_call(call("s", 1))
    await recorder.end_session("s", "completed")
    await recorder.aclose()
    assert pool.get_session("s").status == "completed"
    tree = pool.get_tree("s")
    assert sorted(tree.calls) == [0, 1]
    pool.close()


async def test_pool_service_outage_loses_nothing(tmp_path: Path) -> None:
    """The pool service goes away mid-session and comes back on the same port: every call arrives, in order."""
    from aiohttp import web

    from stepline.datapool import open_pool
    from stepline.datapool.service import make_app

    url = f"sqlite:///{tmp_path / 'pool.db'}"

    async def serve(port: int) -> web.AppRunner:  # the service closes its database when it stops
        runner = web.AppRunner(make_app(open_pool(url)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await serve(0)
    port = runner.addresses[0][1]
    client = open_pool(f"http://127.0.0.1:{port}")
    recorder = Recorder(client, flush_interval=0.001, max_backoff=0.2)
    await recorder.start()
    await recorder.create_session(SessionInfo("s", "task", "h"))
    recorder.record_call(call("s", 0))
    await recorder.flush()
    await runner.cleanup()  # the service is down
    for i in range(1, 4):
        recorder.record_call(call("s", i))
    for _ in range(100):  # the client retries for ~1.5 s itself before the recorder sees the outage
        if recorder.pool_errors:
            break
        await asyncio.sleep(0.05)
    assert recorder.pool_errors >= 1 and recorder.depth() == 3  # kept, not dropped
    runner = await serve(port)
    await recorder.end_session("s", "completed")
    await recorder.aclose()
    await runner.cleanup()
    client.close()
    database = open_pool(url)
    assert sorted(database.get_tree("s").calls) == [0, 1, 2, 3]
    assert database.get_session("s").status == "completed" and recorder.dropped == 0
    database.close()


class BrokenPool(MemoryPool):
    """A pool whose code has a bug: every call write raises something that is no outage."""

    def add_calls(self, records: list[CallRecord]) -> None:
        self.batches.append([r.call_index for r in records])
        raise KeyError("a bug in the pool")


async def test_a_bug_in_the_pool_stops_the_recorder_loudly(caplog) -> None:
    """Only outages are retried: an error that is not one stops the recorder at once, with the traceback,
    instead of looking like an outage that never ends."""
    pool = BrokenPool()
    recorder = Recorder(pool, flush_interval=0.001, max_backoff=0.01)
    await recorder.start()
    await recorder.create_session(SessionInfo("s", "task", "h"))
    with caplog.at_level(logging.ERROR, logger="stepline.gateway.recorder"):
        recorder.record_call(call("s", 0))
        with pytest.raises(KeyError, match="a bug in the pool"):  # the waiting caller behind it gets the error
            await asyncio.wait_for(recorder.end_session("s", "completed"), 5)
    assert len(pool.batches) == 1  # tried once, not retried
    assert isinstance(recorder.failure, KeyError) and recorder.pool_errors == 0
    assert not recorder.has_capacity()  # the app answers 503 from now on
    assert "which is no outage" in caplog.text and "Traceback" in caplog.text
    with pytest.raises(RuntimeError, match="the recorder stopped"):
        await recorder.add_reward(Reward("s", 1.0))
    with caplog.at_level(logging.ERROR, logger="stepline.gateway.recorder"):
        await recorder.aclose()
    assert recorder.written == 0 and "records the pool never accepted" in caplog.text  # and says so


async def test_a_locked_database_is_an_outage_and_is_retried() -> None:
    import sqlite3

    pool = MemoryPool()
    calls = 0
    add_calls = pool.add_calls

    def locked_once(records: list[CallRecord]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise sqlite3.OperationalError("database is locked")
        add_calls(records)

    pool.add_calls = locked_once  # type: ignore[method-assign]
    recorder = Recorder(pool, flush_interval=0.001, max_backoff=0.01)
    await recorder.start()
    recorder.record_call(call("s", 0))
    await recorder.flush()
    await recorder.aclose()
    assert calls == 2 and recorder.pool_errors == 1 and recorder.failure is None
    assert pool.ops == [("call", 0)]



def turn_after(parent: CallRecord, index: int, new_ids: list[int]) -> CallRecord:
    """Call `index`: the parent's prompt + output + `new_ids`, its body the parent's with one more message."""
    record = call(parent.session_id, index)
    record.prompt_ids = np.concatenate([parent.prompt_ids, parent.output_ids, new_ids]).astype(np.int32)
    record.request = parent.request[:-2] + b', {"role": "user", "content": "turn %d"}]}' % index
    return record


async def test_a_turn_goes_as_a_delta_and_a_refused_delta_goes_whole(tmp_path: Path, caplog) -> None:
    import zstandard

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    sent: list[CallRecord] = []
    add_calls = pool.add_calls
    pool.add_calls = lambda records: (sent.extend(records), add_calls(records))[1]  # type: ignore[method-assign]
    recorder = Recorder(pool)
    await recorder.start()
    await recorder.create_session(SessionInfo("s", "task", "h"))
    c0 = call("s", 0)
    c0.request = b'{"messages": [{"role": "user", "content": "' + b"long history " * 500 + b'"}]}'
    c0.output_logprobs = np.array([0.5, -0.1], np.float32)  # refused (a logprob above 0): call 1's parent is lost
    c1 = turn_after(c0, 1, [9])
    c2 = turn_after(c1, 2, [10, 11])

    def delta(parent: CallRecord) -> Delta:
        return Delta(parent.call_index, len(parent.prompt_ids) + len(parent.output_ids), parent.request)

    with caplog.at_level(logging.WARNING, logger="stepline.gateway.recorder"):
        for record, parent in ((c0, None), (c1, c0), (c2, c1)):
            recorder.record_call(replace(record), compress=True, delta=parent and delta(parent))
        lost = replace(c2, call_index=3, prompt_ids=c2.prompt_ids[-2:], parent=0, prefix_len=4, prefix_check=0)
        recorder.record_call(lost)  # already a delta, with no whole form to fall back on
        await recorder.flush()
    assert (recorder.written, recorder.dropped) == (2, 2)
    assert "pool refused call s/1 as a delta" in caplog.text and "not in the pool" in caplog.text
    turn2 = next(r for r in sent if r.call_index == 2)  # its ids and its body after call 1's
    assert (turn2.parent, turn2.prompt_ids.tolist(), turn2.request_prefix) == (1, [10, 11], len(c1.request) - 2)
    got = pool.get_calls("s")
    assert [c.prompt_ids.tolist() for c in got] == [c1.prompt_ids.tolist(), c2.prompt_ids.tolist()]
    unzstd = zstandard.ZstdDecompressor()
    assert [unzstd.decompress(c.request) for c in got] == [c1.request, c2.request]
    await recorder.aclose()
    pool.close()
