"""No session blocks its group forever: idle sessions end as `abandoned`, those a
killed gateway left open included, and their group becomes claimable."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
from gateway_helpers import fake_engine, serve, tokenizer

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, Reward, SessionInfo

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _episode(pool, sid: str, created: float, reward: float | None, end: str | None, task: str = "task") -> None:
    pool.create_session(SessionInfo(sid, task, "h", created_at=created))
    pool.add_calls([CallRecord(sid, 0, np.array([1, 2], np.int32), np.array([3], np.int32),
                               np.array([-0.5], np.float32), 0)])
    if reward is not None:
        pool.add_reward(Reward(sid, reward))
    if end is not None:
        pool.end_session(sid, end)


def test_an_orphaned_open_session_no_longer_blocks_its_group(tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        now = time.time()
        _episode(pool, "done-1", now - 5000, 1.0, "completed")
        _episode(pool, "done-2", now - 5000, 0.0, "completed")
        _episode(pool, "orphan", now - 5000, None, None)  # its gateway was killed: open forever
        _episode(pool, "young", now, None, None, task="other")  # another group, still running
        _episode(pool, "live", now - 5000, None, None, task="third")  # old, but its gateway still serves it
        assert pool.claim_groups("t", 0, 10) == []
        assert pool.abandon_idle(3600, keep=["live"]) == 1
        assert pool.get_session("orphan").status == "abandoned"
        assert pool.get_session("young").status == pool.get_session("live").status == "open"
        (group,) = pool.claim_groups("t", 0, 10)
        assert sorted(e.info.session_id for e in group.episodes) == ["done-1", "done-2"]  # no reward: left out
    finally:
        pool.close()


async def test_the_gateway_abandons_its_idle_sessions_and_the_orphans_of_a_killed_one(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    _episode(pool, "orphan", time.time() - 5000, 1.0, None)  # left open by a gateway killed with -9
    pool.close()
    engine = fake_engine(tokenizer(qwen3_model_dir), [])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, session_idle_timeout=1.0) as served:
        s = await served.session()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            assert (await c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT)).status_code == 200
            for _ in range(200):  # the reaper sweeps every 0.25 s here; a bound, not a measurement
                if served.pool.get_session(s["session_id"]).status != "open":
                    break
                await asyncio.sleep(0.05)
            assert served.pool.get_session(s["session_id"]).status == "abandoned"
            late = await c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT)
            assert late.status_code == 409  # ended: a later call is refused, not half-recorded
        assert served.pool.get_session("orphan").status == "abandoned"
        assert len(served.calls(s["session_id"])) == 1


async def test_a_running_gateway_abandons_orphans_left_after_its_start_but_not_its_own_live_sessions(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # An orphan that appears after the sweep at start (a second gateway on the pool killed later, or killed
    # too recently for that sweep) is abandoned by a later sweep; this gateway's own session, older than the
    # timeout by creation but calling all along, stays open.
    engine = fake_engine(tokenizer(qwen3_model_dir), [])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, session_idle_timeout=1.0) as served:
        s = await served.session()
        await asyncio.sleep(0.5)  # past the sweep at start
        _episode(served.pool, "late-orphan", time.time() - 5000, 1.0, None)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            for _ in range(10):  # 2 s of calls every 0.2 s: older than the timeout, never idle for it
                assert (await c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT)).status_code == 200
                await asyncio.sleep(0.2)
            assert served.pool.get_session("late-orphan").status == "abandoned"
            assert served.pool.get_session(s["session_id"]).status == "open"


async def test_a_call_slower_than_the_timeout_is_not_reaped_while_it_runs(qwen3_model_dir: Path, tmp_path: Path) -> None:
    # A call queued behind a busy engine or held through a weight update can outlast the idle timeout: its
    # session is calling, not idle, so the answer comes back and is recorded; idleness counts from its end.
    engine = fake_engine(tokenizer(qwen3_model_dir), [], latency=2.5)
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, session_idle_timeout=1.0) as served:
        s = await served.session()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            slow = await c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT)  # 2.5 timeouts long
            assert slow.status_code == 200
            assert served.pool.get_session(s["session_id"]).status == "open"
            for _ in range(200):  # the reaper sweeps every 0.25 s here; a bound, not a measurement
                if served.pool.get_session(s["session_id"]).status != "open":
                    break
                await asyncio.sleep(0.05)
            assert served.pool.get_session(s["session_id"]).status == "abandoned"  # idle after its call ended
        assert len(served.calls(s["session_id"])) == 1


async def test_a_live_gateway_renews_its_idle_sessions_leases_so_they_follow_the_idle_timeout(
        qwen3_model_dir: Path, tmp_path: Path) -> None:
    # leased for 1 s, renewed every 0.33 s (a loaded 2-core machine can delay a 0.1 s renewal past a 0.3 s lease):
    # an idle session of a running gateway outlives several leases (the claim ends any session whose lease lapsed)
    engine = fake_engine(tokenizer(qwen3_model_dir), [])
    async with engine as url, serve(qwen3_model_dir, [url], tmp_path, session_lease=1.0) as served:
        s = await served.session()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}) as c:
            assert (await c.post(f"{s['openai_base_url']}/chat/completions", json=CHAT)).status_code == 200
        await asyncio.sleep(3.5)  # three and a half leases, no call
        assert served.pool.claim_groups("t", 0, 10) == []
        assert served.pool.get_session(s["session_id"]).status == "open"
