"""The spill file: calls acknowledged while the pool is down survive a restart.

Before it, a pool outage followed by a gateway crash or shutdown lost every queued call (4 of 4 in the
report); these tests pin that each acknowledged call reaches the pool once, after a restart."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, SessionInfo
from stepline.gateway.recorder import Delta, Recorder
from stepline.gateway.spill import Spill, SpillInUse


def call(session: str, index: int) -> CallRecord:
    return CallRecord(session_id=session, call_index=index, prompt_ids=np.arange(3 + index, dtype=np.int32),
                      output_ids=np.array([7, 8], dtype=np.int32),
                      output_logprobs=np.array([-0.1, -0.2], dtype=np.float32), weight_version=0,
                      request=b'{"messages": []}', response=b'{"id": "%d"}' % index)


class Flaky:
    """An SQLite pool whose writes fail (as a dead pool service's would) while `down`."""

    def __init__(self, path: Path) -> None:
        self.pool = open_pool(f"sqlite:///{path}")
        self.down = False

    def __getattr__(self, name: str):
        attr = getattr(self.pool, name)
        if name in ("create_session", "add_calls", "add_reward", "end_session") and callable(attr):
            def write(*args, **kwargs):
                if self.down:
                    raise ConnectionError("pool service unreachable")
                return attr(*args, **kwargs)
            return write
        return attr


def recorder(pool: object, spill: Path) -> Recorder:
    return Recorder(pool, flush_interval=0.001, max_backoff=0.02, close_timeout=30.0,  # type: ignore[arg-type]
                    spill=Spill(spill))


async def test_calls_acknowledged_during_an_outage_are_written_once_after_a_restart(tmp_path: Path) -> None:
    pool = Flaky(tmp_path / "pool.db")
    first = recorder(pool, tmp_path / "gw.spill")
    await first.start()
    await first.create_session(SessionInfo("s", "t", "h"))
    pool.down = True
    acks = [first.record_call(call("s", i), compress=True) for i in range(5)]
    # each answer may leave: the call is durable although the pool took none of them
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(a) for a in acks)), 10)
    await asyncio.wait_for(first.aclose(), 10)  # shutdown does not wait out close_timeout: it is spilled
    assert pool.pool.get_tree("s").calls == {}
    assert (tmp_path / "gw.spill").stat().st_size > 0

    pool.down = False
    for _ in range(2):  # the second start replays nothing new: the file was truncated after the commit
        again = recorder(pool, tmp_path / "gw.spill")
        await again.start()
        await again.flush()
        await again.aclose()
    assert sorted(pool.pool.get_tree("s").calls) == [0, 1, 2, 3, 4]
    assert pool.pool.stats()["calls"] == 5
    assert (tmp_path / "gw.spill").stat().st_size == 0


async def test_replaying_calls_the_pool_already_holds_adds_nothing(tmp_path: Path) -> None:
    """A crash between the pool's commit and the spill file's truncation re-sends: exactly once still."""
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.create_session(SessionInfo("s", "t", "h"))
    pool.add_calls([call("s", 0), call("s", 1)])
    spill = Spill(tmp_path / "gw.spill")
    spill.append([call("s", 0), call("s", 1), call("s", 2)])
    spill.close()
    rec = recorder(pool, tmp_path / "gw.spill")
    await rec.start()
    await rec.flush()
    await rec.aclose()
    assert rec.replayed == 3 and rec.dropped == 0
    assert pool.stats()["calls"] == 3 and sorted(pool.get_tree("s").calls) == [0, 1, 2]


async def test_pool_recovery_writes_the_spilled_calls_and_empties_the_file(tmp_path: Path) -> None:
    pool = Flaky(tmp_path / "pool.db")
    rec = recorder(pool, tmp_path / "gw.spill")
    await rec.start()
    await rec.create_session(SessionInfo("s", "t", "h"))
    pool.down = True
    acks = [rec.record_call(call("s", i)) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(a) for a in acks)), 10)
    assert (tmp_path / "gw.spill").stat().st_size > 0
    pool.down = False
    await asyncio.wait_for(rec.flush(), 10)
    assert sorted(pool.pool.get_tree("s").calls) == [0, 1, 2]
    assert (tmp_path / "gw.spill").stat().st_size == 0
    await rec.aclose()


def test_a_torn_last_record_is_cut_and_later_appends_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "gw.spill"
    spill = Spill(path)
    spill.append([call("s", 0), call("s", 1)])
    spill.close()
    with path.open("ab") as f:  # a crash in the middle of an append (never fsync'd, never acknowledged)
        f.write(b"\x40\x00\x00\x00garbage")
    spill = Spill(path)
    assert [r.call_index for r in spill.load()] == [0, 1]
    spill.append([call("s", 2)])
    spill.close()
    loaded = Spill(path).load()
    assert [r.call_index for r in loaded] == [0, 1, 2]
    assert loaded[2].response == b'{"id": "2"}' and loaded[2].prompt_ids.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_waits_until_its_call_is_durable(tiny_model_dir: Path, tmp_path: Path, stream: bool) -> None:
    """With a spill file, an answer (stream or not) is sent only after its call is in the pool."""
    import httpx

    from tests.gateway.gateway_helpers import fake_engine, serve, tokenizer

    tok = tokenizer(tiny_model_dir)
    async with fake_engine(tok, ["hello"]) as engine, serve(tiny_model_dir, [engine], tmp_path,
                                                            spill_path=str(tmp_path / "gw.spill")) as served:
        session = await served.session()
        gate = asyncio.Event()
        real = served.pool.add_calls

        def held(records):  # the pool commits only once the test says so
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
            real(records)

        loop = asyncio.get_running_loop()
        served.pool.add_calls = held  # type: ignore[method-assign]
        async with httpx.AsyncClient(timeout=30) as client:
            reply = asyncio.create_task(client.post(
                f"{session['openai_base_url']}/chat/completions",
                headers={"Authorization": f"Bearer {session['api_key']}"},
                json={"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
            await asyncio.sleep(0.5)
            assert not reply.done()  # generated, recorded, not yet durable: no answer yet
            gate.set()
            assert (await reply).status_code == 200
        assert len(served.pool.get_tree(session["session_id"]).calls) == 1


def test_a_spill_file_has_one_gateway_at_a_time(tmp_path: Path) -> None:
    # the default spill file is one per port in the state directory: a second gateway on it would interleave its
    # calls with the first one's and truncate them once its own were written
    first = Spill(tmp_path / "gateway-8000.spill")
    with pytest.raises(SpillInUse, match="in use by another gateway"):
        Spill(tmp_path / "gateway-8000.spill")
    first.close()
    Spill(tmp_path / "gateway-8000.spill").close()  # free again once the first is closed


def test_the_gateway_command_spills_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from stepline.gateway.cli import _spill_path

    monkeypatch.setenv("STEPLINE_STATE_DIR", str(tmp_path / "state"))
    assert _spill_path(None, None, False, 8001) == str(tmp_path / "state" / "gateway-8001.spill")
    assert _spill_path(None, tmp_path / "mine", False, 8001) == str(tmp_path / "mine" / "gateway-8001.spill")
    assert _spill_path("x.spill", None, False, 8001) == "x.spill"
    assert _spill_path(None, None, True, 8001) is None


async def test_a_full_pool_disk_fails_creates_fast_says_degraded_and_spills_the_calls(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # before, session creates blocked past 30 s while /health said ok; SQLite's max_page_count stands in for the disk
    import httpx
    from gateway_helpers import fake_engine, serve, tokenizer

    chat = {"model": "m", "messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 4}
    async with fake_engine(tokenizer(qwen3_model_dir), []) as url, \
            serve(qwen3_model_dir, [url], tmp_path, spill_path=str(tmp_path / "gw.spill")) as served:
        s = await served.session()
        async with httpx.AsyncClient(base_url=served.url, timeout=20) as c:
            with served.pool._lock:
                pages = served.pool.conn.execute("PRAGMA page_count").fetchone()[0]
                served.pool.conn.execute(f"PRAGMA max_page_count = {pages}")
            key = {"Authorization": f"Bearer {s['api_key']}"}
            for _ in range(8):  # acknowledged: each is in the pool or the spill file
                assert (await c.post(f"{s['openai_base_url']}/chat/completions", json=chat,
                                     headers=key)).status_code == 200
            health = (await c.get("/health")).json()
            assert health["status"] == "degraded" and "PoolFull" in health["pool"]
            created = await c.post("/sessions", json={"task_id": "t", "harness": "h"},
                                   headers={"Authorization": "Bearer adm"})
            assert created.status_code == 503 and created.json()["error"]["code"] == "pool_full"
            assert "disk is full" in created.json()["error"]["message"]
            assert (tmp_path / "gw.spill").stat().st_size > 0
            with served.pool._lock:
                served.pool.conn.execute("PRAGMA max_page_count = 1000000")  # space freed
            await served.flush()
            assert len(served.calls(s["session_id"])) == 8
            assert (await c.get("/health")).json()["status"] == "ok"



def turns(session: str, n: int) -> list[tuple[CallRecord, Delta | None]]:
    """n turns, each the last one's prompt + answer + two new ids and its body one message longer: whole, and how
    each extends the one before."""
    out: list[tuple[CallRecord, Delta | None]] = []
    prompt, body = np.arange(100, 180, dtype=np.int32), b'{"messages": [{"role": "user", "content": "start"}]}'
    for i in range(n):
        record = replace(call(session, i), prompt_ids=prompt, output_ids=np.array([7, 8 + i], np.int32), request=body)
        parent = out[-1][0] if out else None
        out.append((record, parent and Delta(i - 1, len(parent.prompt_ids) + 2, parent.request)))
        prompt = np.concatenate([prompt, record.output_ids, [50 + i, 51 + i]]).astype(np.int32)
        body = body[:-2] + b', {"role": "user", "content": "turn %d"}]}' % i
    return out


async def test_spilled_deltas_replay_into_the_calls_recorded_whole(tmp_path: Path) -> None:
    """Turn 1 reached the pool, turns 2-4 (deltas, each of the one before) only the spill file: after the restart
    the pool holds the same session as one recorded whole."""
    import zstandard

    played = turns("s", 4)
    pool = Flaky(tmp_path / "pool.db")
    first = recorder(pool, tmp_path / "gw.spill")
    await first.start()
    await first.create_session(SessionInfo("s", "t", "h"))
    first.record_call(replace(played[0][0]), compress=True)
    await first.flush()
    pool.down = True
    acks = [first.record_call(replace(record), compress=True, delta=delta) for record, delta in played[1:]]
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(a) for a in acks if a)), 10)
    await asyncio.wait_for(first.aclose(), 10)
    spilled = Spill(tmp_path / "gw.spill")
    assert [r.parent for r in spilled.load()] == [0, 1, 2]  # spilled as deltas
    spilled.close()
    pool.down = False
    again = recorder(pool, tmp_path / "gw.spill")
    await again.start()
    await again.flush()
    await again.aclose()
    assert (again.replayed, again.dropped) == (3, 0)
    got = pool.pool.get_calls("s")
    unzstd = zstandard.ZstdDecompressor()
    assert [(c.prompt_ids.tolist(), c.output_ids.tolist(), unzstd.decompress(c.request)) for c in got] == [
        (r.prompt_ids.tolist(), r.output_ids.tolist(), r.request) for r, _ in played]
