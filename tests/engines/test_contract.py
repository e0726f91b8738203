"""One contract for every engine the gateway drives, run through its adapter (conftest.BACKENDS):
what it samples and its logprobs, weight pushes, pause / resume, broken checkpoints, abandoned streams.

For the real engines the oracle is transformers on the weights being served: each greedy token is the
argmax of a teacher-forced float32 forward and its logprob that forward's log-softmax (to 1e-4). For the
fakes it is the FakeEngine's script (ids from the prompt length and the folder loaded, logprob
-(k + 1) / 100 for the k-th token), which pins what the adapters do with the wire format.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from oracle import teacher_forced

from stepline.gateway.engines import EngineClient, EngineError, Generation, SamplingParams, make_engine
from stepline.gateway.fleet import EngineRouter, WeightGate

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def engine(backend, contract_models) -> AsyncIterator[EngineClient]:
    async with aiohttp.ClientSession() as http:
        yield make_engine(backend.url, backend.kind, http, timeout=120, model_dir=contract_models[0])


def check_greedy(backend, gen: Generation, weights: Path) -> None:
    """The generation is what the served weights sample greedily, with their logprobs."""
    assert len(gen.output_ids) == len(gen.logprobs) == GREEDY.max_new_tokens
    if not backend.real:
        shift = backend.fake.shift()
        assert gen.output_ids == [10 + (len(PROMPT) + k + shift) % 1000 for k in range(GREEDY.max_new_tokens)]
        assert gen.logprobs == pytest.approx([-(k + 1) / 100 for k in range(GREEDY.max_new_tokens)])
        return
    chosen, best = teacher_forced(weights, PROMPT, gen.output_ids)
    assert gen.logprobs == pytest.approx(chosen, abs=1e-4)
    assert [c >= b - 1e-4 for c, b in zip(chosen, best)] == [True] * len(chosen)  # each token the argmax


async def push(engine: EngineClient, folder: Path, version: int) -> None:
    """What the weight gate does around one engine."""
    await engine.pause()
    try:
        await engine.update_weights(str(folder), version)
    finally:
        await engine.resume()


async def test_generation_ids_and_logprobs_are_the_models(backend, engine, contract_models) -> None:
    gen = await engine.generate(PROMPT, GREEDY)
    deltas = [d async for d in engine.stream(PROMPT, GREEDY)]
    check_greedy(backend, gen, contract_models[0])
    final = deltas[-1].final
    assert final is not None and final.output_ids == gen.output_ids
    assert sum((d.output_ids for d in deltas), []) == gen.output_ids
    assert sum((d.logprobs for d in deltas), []) == pytest.approx(gen.logprobs, abs=1e-5)
    assert (gen.finish_reason, gen.prompt_tokens) == ("length", len(PROMPT))


async def test_weight_push_changes_greedy_output_and_version(backend, engine, contract_models) -> None:
    model_a, model_b = contract_models
    before = await engine.generate(PROMPT, GREEDY)
    version = backend.next_version()
    await push(engine, model_b, version)
    after = await engine.generate(PROMPT, GREEDY)
    check_greedy(backend, after, model_b)
    assert after.output_ids != before.output_ids
    assert after.weight_version == version
    assert (await engine.info()).weight_version == str(version)  # the engine's own label, not only ours
    version = backend.next_version()  # back to model_a for the other tests
    await push(engine, model_a, version)
    assert (await engine.generate(PROMPT, GREEDY)).output_ids == before.output_ids


async def test_pause_holds_new_calls_until_resume(backend, engine, contract_models) -> None:
    await engine.pause()
    try:
        call = asyncio.create_task(engine.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.5)
        assert not call.done(), "a call was served while the engine was paused"
    finally:
        await engine.resume()
    check_greedy(backend, await asyncio.wait_for(call, 120), contract_models[0])


@pytest.mark.parametrize("broken", ["truncated", "other-shape", "missing"])
async def test_broken_checkpoint_is_refused_and_old_weights_keep_serving(
    backend, engine, contract_models, broken_checkpoints, broken
) -> None:
    before = await engine.generate(PROMPT, GREEDY)
    label = (await engine.info()).weight_version
    with pytest.raises(EngineError):
        await push(engine, broken_checkpoints[broken], backend.versions[-1] + 100)
    assert await engine.health()
    after = await engine.generate(PROMPT, GREEDY)
    assert (after.output_ids, after.weight_version) == (before.output_ids, before.weight_version)
    assert (await engine.info()).weight_version == label
    check_greedy(backend, after, contract_models[0])


async def test_a_stream_abandoned_by_its_client_is_aborted(backend, engine) -> None:
    long = SamplingParams(max_new_tokens=1024 - len(PROMPT) - 8, temperature=1.0, seed=1, ignore_eos=True)
    stream = engine.stream(PROMPT, long)
    got = [await anext(stream) for _ in range(3)]
    assert all(d.output_ids for d in got)
    assert await backend.running() >= 1
    await stream.aclose()  # the client goes away mid-generation
    for _ in range(300):  # the engine notices within its own check interval (the built-in engine: 1 s)
        if await backend.running() == 0:
            break
        await asyncio.sleep(0.1)
    assert await backend.running() == 0, "the engine kept generating for a client that left"
    assert len((await engine.generate(PROMPT, GREEDY)).output_ids) == GREEDY.max_new_tokens


async def test_an_update_during_a_long_stream_fails_no_new_call(backend, engine, contract_models) -> None:
    """The weight gate over this engine (stepline/gateway/fleet.py): the long stream, still running after the grace,
    is ended by the engine with what it sampled so far, all of it the old weights' (its stamp stays true);
    the calls that arrived during the update wait and are served by the new weights."""
    model_a, model_b = contract_models
    gate = WeightGate(EngineRouter([engine]), max_wait=300, grace=0.05, initial_version=backend.versions[-1],
                      initial_path=str(model_a))
    long = SamplingParams(max_new_tokens=1024 - len(PROMPT) - 8, temperature=1.0, seed=1, ignore_eos=True)
    started = asyncio.Event()

    async def long_stream() -> tuple[int, Generation]:
        async with gate.admit() as version:
            deltas = []
            async for delta in engine.stream(PROMPT, long):
                deltas.append(delta)
                if len(deltas) == 3:
                    started.set()
        assert deltas[-1].final is not None
        return version, deltas[-1].final

    async def new_call() -> tuple[int, Generation]:
        async with gate.admit() as version:
            return version, await engine.generate(PROMPT, GREEDY)

    stream = asyncio.create_task(long_stream())
    await asyncio.wait_for(started.wait(), 120)
    old, new = backend.versions[-1], backend.next_version()
    update = asyncio.create_task(gate.update_weights(str(model_b), new))
    await asyncio.sleep(0.01)
    calls = [asyncio.create_task(new_call()) for _ in range(3)]
    assert await asyncio.wait_for(update, 300) == new
    stamped, cut = await stream
    assert (stamped, cut.finish_reason) == (old, "abort")
    assert 3 <= len(cut.output_ids) < long.max_new_tokens
    if backend.real:  # sampled by the old weights, every token of it
        chosen, _ = teacher_forced(model_a, PROMPT, cut.output_ids, temperature=1.0)
        assert cut.logprobs == pytest.approx(chosen, abs=1e-4)
    for version, gen in await asyncio.gather(*calls):
        assert (version, gen.weight_version) == (new, new)
        check_greedy(backend, gen, model_b)
    await push(engine, model_a, backend.next_version())  # back to model_a for the other tests
