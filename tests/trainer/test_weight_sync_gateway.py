"""Weight sync against the real gateway and the built-in engine: the pushed version serves later calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from stepline.datapool import open_pool
from stepline.engine.testing import running_engine
from stepline.gateway.cli import running_gateway
from stepline.gateway.config import GatewaySettings
from stepline.trainer.weight_sync import GatewayWeightSync, WeightSyncError, save_weights

torch.set_num_threads(1)


async def test_push_reaches_the_engine_through_the_gateway(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(5.0)  # sharper distribution: the engine's logprobs must change
    path = save_weights(model, tmp_path / "weights", 1, tiny_model_dir)
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    request = {"input_ids": [11, 12, 13], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 3, "sampling_seed": 7, "ignore_eos": True}}
    with running_engine(tiny_model_dir) as engine_url:
        async with running_gateway(GatewaySettings(port=0, admin_token="tok"), [engine_url], tiny_model_dir,
                                   pool) as gw:
            async with httpx.AsyncClient(timeout=60) as http:
                before = (await http.post(f"{engine_url}/generate", json=request)).json()
                await asyncio.to_thread(GatewayWeightSync(gw.url, "tok").push, path, 1)
                health = (await http.get(f"{gw.url}/health")).json()
                after = (await http.post(f"{engine_url}/generate", json=request)).json()
                with pytest.raises(WeightSyncError, match="401|403"):
                    await asyncio.to_thread(GatewayWeightSync(gw.url, "wrong").push, path, 2)
    pool.close()
    assert health["weight_version"] == 1
    assert str(after["meta_info"]["weight_version"]) == "1"
    lp = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (before, after)]
    assert lp[0] != lp[1]
