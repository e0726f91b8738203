"""Engine adapters against FakeEngine over real loopback HTTP: one suite for every wire format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from fakes.engine import FakeEngine, Scripted

from stepline.gateway.engines import (
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    SamplingParams,
    make_engine,
)
from stepline.gateway.fleet import EngineRouter

# (kind, FakeEngine api, SGLang incremental streaming)
FORMATS = [("sglang", "sglang", False), ("builtin", "sglang", True), ("vllm", "vllm", False)]
PROMPT = [1, 2, 3, 4]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
async def test_generate_keeps_stop_token_in_ids_not_text(http, kind, api, incremental) -> None:
    # scripted 5 6 2 7 with EOS 2: the engine stops after 2; ids keep it, text drops it
    async with FakeEngine([Scripted([5, 6, 2, 7])], api=api, eos_id=2, incremental=incremental) as url:
        gen = await make_engine(url, kind, http, timeout=5).generate(PROMPT, SamplingParams(max_new_tokens=10))
    assert gen.output_ids == [5, 6, 2]
    assert gen.logprobs == [-0.01, -0.02, -0.03]
    assert gen.text == "<5><6>"
    assert (gen.finish_reason, gen.matched_stop) == ("stop", 2)
    assert gen.prompt_tokens == 4
    assert gen.weight_version == 0


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
async def test_generate_sends_token_ids_and_sampling(http, kind, api, incremental) -> None:
    fake = FakeEngine([Scripted([5, 6, 7])], api=api)
    sampling = SamplingParams(
        max_new_tokens=2, temperature=0.5, top_p=0.9, top_k=40, stop=["x"], stop_token_ids=[9], seed=7
    )
    async with fake as url:
        gen = await make_engine(url, kind, http, timeout=5).generate(PROMPT, sampling)
    assert (gen.output_ids, gen.finish_reason) == ([5, 6], "length")
    path, body = fake.requests[-1]
    if api == "sglang":
        assert path == "/generate" and body["input_ids"] == PROMPT and body["return_logprob"] is True
        sp = body["sampling_params"]
        assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["top_k"]) == (2, 0.5, 0.9, 40)
        assert (sp["stop"], sp["stop_token_ids"], sp["sampling_seed"]) == (["x"], [9], 7)
    else:
        assert path == "/v1/completions" and body["prompt"] == PROMPT and body["return_token_ids"] is True
        assert (body["max_tokens"], body["seed"], body["logprobs"], body["model"]) == (2, 7, 1, "fake-model")


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
async def test_numpy_prompt_ids_are_sent_as_a_json_list(http, kind, api, incremental) -> None:
    fake = FakeEngine([Scripted([5])], api=api)
    async with fake as url:
        engine = make_engine(url, kind, http, timeout=5)
        gen = await engine.generate(np.asarray(PROMPT, dtype=np.int32)[::1], SamplingParams())
        [d async for d in engine.stream(np.arange(8, dtype=np.int32)[::2], SamplingParams())]  # not contiguous
    bodies = [body for path, body in fake.requests if path != "/v1/models"]
    key = "input_ids" if api == "sglang" else "prompt"
    assert [b[key] for b in bodies] == [PROMPT, [0, 2, 4, 6]]
    assert gen.prompt_tokens == 4


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
async def test_stream_deltas_add_up_to_the_generation(http, kind, api, incremental) -> None:
    script = [Scripted([5, 6, 7, 2], text="abc")] * 2
    async with FakeEngine(script, api=api, eos_id=2, incremental=incremental) as url:
        engine = make_engine(url, kind, http, timeout=5)
        whole = await engine.generate(PROMPT, SamplingParams())
        deltas = [d async for d in engine.stream(PROMPT, SamplingParams())]
    assert [d.output_ids for d in deltas if d.output_ids] == [[5], [6], [7], [2]]  # one token per event
    assert sum((d.logprobs for d in deltas), []) == [-0.01, -0.02, -0.03, -0.04]
    assert "".join(d.text for d in deltas) == "abc"
    assert [d.final is not None for d in deltas][-1] is True
    assert all(d.final is None for d in deltas[:-1])
    assert deltas[-1].final == whole


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
@pytest.mark.parametrize(
    "status,error,code", [(400, EngineRejected, 400), (500, EngineError, 502), (503, EngineUnavailable, 503)]
)
async def test_engine_http_errors_are_translated_and_not_retried(
    http, kind, api, incremental, status, error, code
) -> None:
    fake = FakeEngine(api=api, fail_next=[status])
    async with fake as url:
        with pytest.raises(error) as caught:
            await make_engine(url, kind, http, timeout=5).generate(PROMPT, SamplingParams())
    assert type(caught.value) is error and caught.value.status == code
    assert "scripted failure" in caught.value.message
    assert len([p for p, _ in fake.requests if p != "/v1/models"]) == 1  # an HTTP answer is never retried


@pytest.mark.parametrize("kind,api,incremental", FORMATS)
async def test_stream_error_status_is_translated(http, kind, api, incremental) -> None:
    async with FakeEngine(api=api, fail_next=[400]) as url:
        with pytest.raises(EngineRejected):
            [d async for d in make_engine(url, kind, http, timeout=5).stream(PROMPT, SamplingParams())]


async def test_unreachable_engine_is_unavailable_after_bounded_retries(http) -> None:
    fake = FakeEngine()
    url = await fake.start()
    await fake.stop()  # nothing listens on the port any more: connection refused
    engine = make_engine(url, "sglang", http, timeout=5)
    with pytest.raises(EngineUnavailable) as caught:
        await engine.generate(PROMPT, SamplingParams())
    assert caught.value.status == 503 and caught.value.retry_after > 0
    with pytest.raises(EngineUnavailable):
        [d async for d in engine.stream(PROMPT, SamplingParams())]
    assert await engine.health() is False


async def test_slow_engine_times_out(http) -> None:
    async with FakeEngine(latency=1.0) as url:
        with pytest.raises(EngineTimeout) as caught:
            await make_engine(url, "sglang", http, timeout=0.2).generate(PROMPT, SamplingParams())
    assert caught.value.status == 504


async def test_stalled_stream_times_out_after_the_first_tokens(http) -> None:
    async with FakeEngine([Scripted([5, 6, 7])], token_delay=1.0) as url:
        stream = make_engine(url, "sglang", http, timeout=0.2).stream(PROMPT, SamplingParams())
        assert (await anext(stream)).output_ids == [5]
        with pytest.raises(EngineTimeout, match="no answer within 0.2 s"):
            await anext(stream)
        await stream.aclose()


async def test_sglang_weight_update_pause_resume(http) -> None:
    fake = FakeEngine()
    async with fake as url:
        engine = make_engine(url, "sglang", http, timeout=5)
        await engine.pause()
        await engine.update_weights("/ckpt/3", 3)
        await engine.resume()
        gen = await engine.generate(PROMPT, SamplingParams())
    assert fake.events == ["pause", "update:3", "resume", "generate"]
    assert ("/update_weights_from_disk", {"model_path": "/ckpt/3", "weight_version": "3"}) in fake.requests
    assert gen.weight_version == 3


async def test_failed_weight_update_raises_with_the_engine_message(http) -> None:
    async with FakeEngine(fail_updates=1) as url:
        engine = make_engine(url, "sglang", http, timeout=5)
        with pytest.raises(EngineError, match="cannot load /bad"):
            await engine.update_weights("/bad", 1)
        assert (await engine.generate(PROMPT, SamplingParams())).weight_version == 0


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory) -> Path:
    from stepline.models import VLLM_SHAPE, build_model

    return build_model(tmp_path_factory.mktemp("vllm-model") / "m", shape=VLLM_SHAPE)


@pytest.mark.parametrize("extension", [True, False])
async def test_vllm_weight_update_loads_the_pushed_folder(http, untied_model_dir, extension) -> None:
    fake = FakeEngine(api="vllm", worker_extension=extension)
    async with fake as url:
        engine = make_engine(url, "vllm", http, timeout=5, model_dir=untied_model_dir)
        await engine.pause()
        await engine.update_weights(str(untied_model_dir), 4)
        await engine.resume()
        gen = await engine.generate(PROMPT, SamplingParams())
    # through Stepline's worker extension; without it (an untied model), vLLM's own reload with the folder by
    # keyword (reload_weights' first positional parameter is a weights iterator); vLLM's own version label set,
    # and /pause + /resume around it
    rpcs = [(body["method"], body["kwargs"]) for path, body in fake.requests if path == "/collective_rpc"]
    loaded = [("reload_weights", {"weights_path": str(untied_model_dir)})] if not extension else []
    assert rpcs == [("stepline_load", {"path": str(untied_model_dir)}), *loaded]
    assert ("/update_weight_version", {"new_version": "4"}) in fake.requests
    assert fake.events == ["pause", "update:1", "resume", "generate"]
    assert gen.weight_version == 4 and fake.version_label == "4"


async def test_vllm_refuses_a_checkpoint_that_does_not_fit_before_vllm_sees_it(http, untied_model_dir, tmp_path) -> None:
    import shutil

    from stepline.models import ModelShape, build_model

    wider = build_model(tmp_path / "wider", shape=ModelShape(hidden_size=64, num_heads=2, num_kv_heads=1,
                                                       tie_embeddings=False))
    truncated = shutil.copytree(untied_model_dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    fake = FakeEngine(api="vllm")
    async with fake as url:
        engine = make_engine(url, "vllm", http, timeout=5, model_dir=untied_model_dir)
        with pytest.raises(EngineRejected, match=r"does not fit the served model: .*\[64\] where the served model has"):
            await engine.update_weights(str(wider), 1)
        with pytest.raises(EngineRejected, match="unreadable"):
            await engine.update_weights(str(truncated), 1)
        with pytest.raises(EngineRejected, match="not a directory"):
            await engine.update_weights(str(tmp_path / "nowhere"), 1)
    assert not [path for path, _ in fake.requests if path == "/collective_rpc"]


async def test_vllm_takes_a_tied_model_only_through_the_worker_extension(http, tiny_model_dir) -> None:
    # vLLM 0.32's own reload keeps the old LM head of a tied model: without the extension the push is refused
    fake = FakeEngine(api="vllm", worker_extension=False)
    async with fake as url:
        engine = make_engine(url, "vllm", http, timeout=5, model_dir=tiny_model_dir)
        with pytest.raises(EngineRejected, match="tied word embeddings"):
            await engine.update_weights(str(tiny_model_dir), 1)
    assert [body["method"] for path, body in fake.requests if path == "/collective_rpc"] == ["stepline_load"]
    fake = FakeEngine(api="vllm")
    async with fake as url:
        await make_engine(url, "vllm", http, timeout=5, model_dir=tiny_model_dir).update_weights(str(tiny_model_dir), 1)
    assert fake.events == ["update:1"]


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        make_engine("http://x", "tgi", None, 1.0)  # type: ignore[arg-type]


async def test_router_is_sticky_and_fails_over_new_sessions(http) -> None:
    async with FakeEngine() as url_a, FakeEngine() as url_b:
        a, b = make_engine(url_a, "sglang", http, 5), make_engine(url_b, "sglang", http, 5)
        router = EngineRouter([a, b], health_interval=0.05)
        await router.start()
        try:
            first = {s: router.for_session(s) for s in (f"s{i}" for i in range(20))}
            assert {c.url for c in first.values()} == {url_a, url_b}  # both engines get sessions
            assert all(router.for_session(s) is c for s, c in first.items())  # sticky
            on_a = [s for s, c in first.items() if c is a]
            router.healthy[a.url] = False  # as a failed health check would
            assert all(router.for_session(f"new{i}") is b for i in range(10))
            assert all(router.for_session(s) is b for s in on_a)  # a dead engine cannot serve its sessions
            router.healthy[b.url] = False
            with pytest.raises(EngineUnavailable, match="no healthy engine"):
                router.for_session("another")
        finally:
            await router.aclose()


async def test_router_health_loop_notices_a_dead_engine(http) -> None:
    import asyncio

    dying = FakeEngine()
    async with FakeEngine() as url_a:
        url_b = await dying.start()
        router = EngineRouter([make_engine(url_a, "sglang", http, 5), make_engine(url_b, "sglang", http, 5)], 0.05)
        await router.start()
        try:
            assert router.healthy == {url_a: True, url_b: True}
            await dying.stop()
            for _ in range(100):
                if not router.healthy[url_b]:
                    break
                await asyncio.sleep(0.02)
            assert router.healthy == {url_a: True, url_b: False}
            assert {router.for_session(f"s{i}").url for i in range(10)} == {url_a}
        finally:
            await router.aclose()
