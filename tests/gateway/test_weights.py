"""WeightGate: versions stamped at dispatch, pause → drain → update → resume, failures keep the old version."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from fakes.engine import FakeEngine

from stepline.gateway.engines import EngineError, SamplingParams, make_engine
from stepline.gateway.fleet import EngineRouter, Paused, UpdateRefused, WeightGate


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_update_pauses_updates_resumes_every_engine(http) -> None:
    fakes = [FakeEngine(), FakeEngine()]
    async with fakes[0] as a, fakes[1] as b:
        router = EngineRouter([make_engine(u, "sglang", http, 5) for u in (a, b)])
        gate = WeightGate(router)
        async with gate.admit() as version:
            assert version == 0
        assert await gate.update_weights("/ckpt/1", 1) == 1
        async with gate.admit() as version:
            assert version == 1
        gen = await router.clients[0].generate([1, 2], SamplingParams())
    assert [f.events for f in fakes] == [["pause", "update:1", "resume", "generate"], ["pause", "update:1", "resume"]]
    assert gen.weight_version == 1 and (gate.version, gate.path) == (1, "/ckpt/1")


async def test_update_waits_for_in_flight_calls_and_holds_new_ones(http) -> None:
    fake = FakeEngine()
    async with fake as url:
        gate = WeightGate(EngineRouter([make_engine(url, "sglang", http, 5)]), max_wait=5)
        order: list[str] = []
        release = asyncio.Event()

        async def in_flight_call() -> None:
            async with gate.admit() as v:
                order.append(f"old call starts at v{v}")
                await release.wait()
                order.append("old call ends")

        async def new_call() -> None:
            async with gate.admit() as v:
                order.append(f"new call at v{v}")

        old = asyncio.create_task(in_flight_call())
        await asyncio.sleep(0.01)
        update = asyncio.create_task(gate.update_weights("/ckpt/1", 1))
        await asyncio.sleep(0.01)
        new = asyncio.create_task(new_call())
        await asyncio.sleep(0.05)
        assert fake.events == []  # nothing touches the engine while a call is in flight
        assert gate.in_flight == 1 and gate.updating
        release.set()
        await asyncio.gather(old, update, new)
    assert order == ["old call starts at v0", "old call ends", "new call at v1"]
    assert fake.events == ["pause", "update:1", "resume"]


async def test_new_calls_get_paused_after_max_wait(http) -> None:
    async with FakeEngine(update_delay=0.5) as url:
        gate = WeightGate(EngineRouter([make_engine(url, "sglang", http, 5)]), max_wait=0.05)
        update = asyncio.create_task(gate.update_weights("/ckpt/1", 1))
        await asyncio.sleep(0.01)
        with pytest.raises(Paused) as caught:
            async with gate.admit():
                pass
        assert caught.value.retry_after >= 1.0  # Retry-After is given in whole seconds
        await update
        async with gate.admit() as version:
            assert version == 1


async def test_failed_update_rolls_back_and_keeps_the_old_version(http) -> None:
    good, bad = FakeEngine(), FakeEngine(fail_updates=1)
    async with good as a, bad as b:
        router = EngineRouter([make_engine(u, "sglang", http, 5) for u in (a, b)])
        gate = WeightGate(router, initial_version=3, initial_path="/ckpt/3")
        with pytest.raises(EngineError, match="failed on 1 of 2 engines.*cannot load /ckpt/4"):
            await gate.update_weights("/ckpt/4", 4)
        assert (gate.version, gate.path) == (3, "/ckpt/3")
        assert "cannot load /ckpt/4" in (gate.last_error or "")
        async with gate.admit() as version:  # serving again, at the old version
            assert version == 3
    assert good.events == ["pause", "update:4", "update:3", "resume"]  # loaded, then rolled back
    assert bad.events == ["pause", "resume"]


async def test_refused_updates(http) -> None:
    async with FakeEngine(update_delay=0.2) as url:
        gate = WeightGate(EngineRouter([make_engine(url, "sglang", http, 5)]), initial_version=2)
        with pytest.raises(UpdateRefused, match="not newer"):
            await gate.update_weights("/ckpt", 2)
        first = asyncio.create_task(gate.update_weights("/ckpt/3", 3))
        await asyncio.sleep(0.01)
        with pytest.raises(UpdateRefused, match="another weight update"):
            await gate.update_weights("/ckpt/4", 4)
        assert await first == 3


async def test_a_call_still_on_its_way_when_the_engine_cuts_is_cut_in_the_next_round(http) -> None:
    """The engine ends only what it runs: a request that reaches it after the first cut (here it spends 0.3 s
    before it starts) streams on, and the next round, a second later, ends it; the update then goes ahead."""
    fake = FakeEngine(latency=0.3, token_delay=0.02, default_tokens=400)
    async with fake as url:
        engine = make_engine(url, "sglang", http, 5)
        gate = WeightGate(EngineRouter([engine]), max_wait=30, grace=0.05)

        async def long_stream():
            async with gate.admit() as version:
                return version, [d async for d in engine.stream([1, 2], SamplingParams(max_new_tokens=400))][-1]

        stream = asyncio.create_task(long_stream())
        await asyncio.sleep(0.01)  # admitted, on its way
        assert await gate.update_weights("/ckpt/1", 1) == 1
        version, last = await stream
    assert (version, last.final.finish_reason) == (0, "abort")
    assert 0 < len(last.final.output_ids) < 400
    # the request arrives ("generate"), round 1 finds nothing running, round 2 ends the stream; then the update
    assert fake.events == ["generate", "pause", "resume", "pause", "resume", "pause", "update:1", "resume"]
    assert fake.aborted == 1


async def test_an_engine_that_was_down_misses_the_update_and_loads_it_when_it_comes_back(http) -> None:
    # engine b dies; the update goes to a alone; b restarts on the same address on its base weights (v0):
    # the health check that finds it again first loads the gateway's current checkpoint into it
    a_fake, b_fake = FakeEngine(), FakeEngine()
    async with a_fake as a:
        b = await b_fake.start()
        router = EngineRouter([make_engine(u, "sglang", http, 5) for u in (a, b)])
        gate = WeightGate(router)
        await b_fake.stop()
        await router.check_health()
        assert [c.url for c in router.live()] == [a]
        assert await gate.update_weights("/ckpt/1", 1) == 1
        assert a_fake.events == ["pause", "update:1", "resume"]
        back = FakeEngine()
        await back.start(port=int(b.rsplit(":", 1)[1]))
        try:
            await router.check_health()
            assert back.events == ["update:1"] and back.weight_version == 1
            assert [c.url for c in router.live()] == [a, b]
            await router.check_health()  # already on version 1: nothing loads again
            assert back.events == ["update:1"]
        finally:
            await back.stop()
        await router.check_health()
        await a_fake.stop()
        await router.check_health()
        with pytest.raises(EngineError, match="no healthy engine"):
            await gate.update_weights("/ckpt/2", 2)
        assert gate.version == 1
