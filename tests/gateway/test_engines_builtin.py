"""The SGLang adapter against the real built-in engine on the `tiny` model, over loopback HTTP."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from stepline.gateway.engines import EngineRejected, SamplingParams, make_engine
from stepline.gateway.fleet import EngineRouter, WeightGate

pytest.importorskip("stepline.engine.testing")


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    import torch

    from stepline.engine.testing import running_engine

    torch.set_num_threads(1)
    with running_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def eos_id(tiny_model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id


PROMPT = [5, 6, 7, 8, 9]


async def test_generate_and_stream_agree_with_a_seed(engine_url: str) -> None:
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=123, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        engine = make_engine(engine_url, "builtin", http, timeout=60)
        gen = await engine.generate(PROMPT, sampling)
        deltas = [d async for d in engine.stream(PROMPT, sampling)]
    assert len(gen.output_ids) == len(gen.logprobs) == 6
    assert gen.finish_reason == "length" and gen.prompt_tokens == len(PROMPT)
    assert all(lp <= 0 for lp in gen.logprobs)
    # the same seed samples the same tokens; the deltas add up to the final generation
    assert sum((d.output_ids for d in deltas), []) == gen.output_ids == deltas[-1].final.output_ids
    assert sum((d.logprobs for d in deltas), []) == pytest.approx(gen.logprobs, abs=1e-4)
    assert "".join(d.text for d in deltas) == deltas[-1].final.text


async def test_stop_token_is_kept_in_ids(engine_url: str) -> None:
    sampling = SamplingParams(max_new_tokens=6, seed=7, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        engine = make_engine(engine_url, "builtin", http, timeout=60)
        free = await engine.generate(PROMPT, sampling)
        # stop on the last token that has not appeared before it: the same seed samples the same prefix
        k = max(i for i, t in enumerate(free.output_ids) if t not in free.output_ids[:i])
        stop = free.output_ids[k]
        sampling.stop_token_ids = [stop]
        gen = await engine.generate(PROMPT, sampling)
    assert gen.output_ids == free.output_ids[: k + 1]
    assert gen.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-4)
    assert (gen.finish_reason, gen.matched_stop) == ("stop", stop)


async def test_bad_request_is_rejected_not_retried(engine_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        engine = make_engine(engine_url, "builtin", http, timeout=60)
        with pytest.raises(EngineRejected, match="outside the vocabulary"):
            await engine.generate([10**8], SamplingParams(max_new_tokens=2))


async def test_weight_update_through_the_gate(engine_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, checkpoint)
    async with aiohttp.ClientSession() as http:
        router = EngineRouter([make_engine(engine_url, "builtin", http, timeout=60)])
        gate = WeightGate(router, initial_path=str(tiny_model_dir))
        assert await gate.update_weights(str(checkpoint), 1) == 1
        gen = await router.clients[0].generate(PROMPT, SamplingParams(max_new_tokens=1))
        assert gen.weight_version == 1
        with pytest.raises(Exception, match="not a directory"):
            await gate.update_weights(str(tmp_path / "missing"), 2)
        assert gate.version == 1


async def test_incremental_streams_give_the_same_deltas(tiny_model_dir: Path, engine_url: str) -> None:
    from stepline.engine.testing import running_engine

    sampling = SamplingParams(max_new_tokens=5, seed=11, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        cumulative = [d async for d in make_engine(engine_url, "builtin", http, 60).stream(PROMPT, sampling)]
        with running_engine(tiny_model_dir, incremental_streaming=True) as url:
            incremental = [d async for d in make_engine(url, "builtin", http, 60).stream(PROMPT, sampling)]
    assert [d.output_ids for d in incremental] == [d.output_ids for d in cumulative]
    assert [d.text for d in incremental] == [d.text for d in cumulative]
    assert incremental[-1].final.output_ids == cumulative[-1].final.output_ids
