"""What the gateway asks its engines at start, and /health when no engine is healthy."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
import httpx
import pytest
from fakes.engine import FakeEngine, recording_gateway

from stepline.gateway.engines import make_engine
from stepline.gateway.engines.probe import EngineMismatch, check_engines


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_the_engines_context_length_lowers_the_gateways(api, contract_models) -> None:
    model_a, _ = contract_models  # max_position_embeddings 4096
    async with FakeEngine(api=api, model_path=str(model_a), context_length=1024) as url, aiohttp.ClientSession() as http:
        engines = [make_engine(url, api, http, 5)]
        assert await check_engines(engines, model_a, None) == 1024
        assert await check_engines(engines, model_a, 4096) == 1024  # a setting above the engine's is lowered
        assert await check_engines(engines, model_a, 512) == 512  # one below it stays


async def test_an_engine_that_does_not_say_leaves_the_setting(contract_models) -> None:
    async with FakeEngine(api="sglang") as url, aiohttp.ClientSession() as http:
        assert await check_engines([make_engine(url, "sglang", http, 5)], contract_models[0], None) is None
    async with aiohttp.ClientSession() as http:  # nobody there: logged, not checked
        assert await check_engines([make_engine("http://127.0.0.1:9", "sglang", http, 5)], contract_models[0], 77) == 77


async def test_an_engine_serving_another_model_is_refused(contract_models, broken_checkpoints, tmp_path) -> None:
    model_a, model_b = contract_models
    async with aiohttp.ClientSession() as http:
        async with FakeEngine(api="vllm", model_path=str(broken_checkpoints["other-shape"])) as url:
            with pytest.raises(EngineMismatch, match="not --model .*mlp"):
                await check_engines([make_engine(url, "vllm", http, 5)], model_a, None)
        async with FakeEngine(api="vllm", model_path=str(model_b)) as url:  # same tensors, other values: fine
            assert await check_engines([make_engine(url, "vllm", http, 5)], model_a, None) is None


async def test_the_gateway_enforces_the_engines_limit_and_reports_degraded_health(contract_models, tmp_path) -> None:
    model = shutil.copytree(contract_models[0], tmp_path / "model")
    fake = FakeEngine(api="sglang", model_path=str(model), context_length=64)
    await fake.start()
    try:
        async with recording_gateway(Path(model), fake.url, tmp_path / "pool.db", kind="sglang") as (gw, _):
            async with httpx.AsyncClient(base_url=gw) as client:
                models = (await client.get("/v1/models")).json()
                assert models["data"][0]["context_length"] == 64
                assert (await client.get("/health")).status_code == 200
                await fake.stop()
                for _ in range(100):  # the router's next health check (every 2 s) finds it down
                    answer = await client.get("/health")
                    if answer.status_code != 200:
                        break
                    await asyncio.sleep(0.1)
                assert (answer.status_code, answer.json()["status"]) == (503, "degraded")
    finally:
        await fake.stop()
