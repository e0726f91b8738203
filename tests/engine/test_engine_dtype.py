"""`--dtype bfloat16`: weights and K/V in bf16, logprobs near float32's, kept across weight updates."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from stepline.engine.testing import running_engine
from stepline.models import build_model

PROMPT = list(range(30, 70))
BODY = {"input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5}}
BF16_TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 2  # 2 layers x (K, V) x 2 kv-heads x head_dim 16 x 2 bytes


def generate(url: str) -> dict:
    response = httpx.post(f"{url}/generate", json=BODY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_bf16_logprobs_are_near_a_float32_teacher_forced_forward(tiny_model_dir: Path) -> None:
    with running_engine(tiny_model_dir, dtype="bfloat16") as url:
        result = generate(url)
        info = httpx.get(f"{url}/get_server_info").json()
    assert info["dtype"] == "bfloat16"
    out = result["output_ids"]
    # The K/V it keeps is bf16: half float32's bytes per token.
    assert info["prefix_cache"]["bytes"] == (len(PROMPT) + len(out) - 1) * BF16_TINY_TOKEN_BYTES
    got = torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out)[:, None])[:, 0]
    assert float((got - expected).abs().max()) < 0.1


def test_a_weight_update_of_a_bf16_engine_stays_bf16(tiny_model_dir: Path, tmp_path: Path) -> None:
    new_weights = build_model(tmp_path / "seed1", kind="tiny", seed=1)
    with running_engine(tiny_model_dir, dtype="bfloat16", prefix_cache_mb=0) as url:
        reply = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(new_weights)}, timeout=60)
        assert reply.status_code == 200
        updated = generate(url)
    with running_engine(new_weights, dtype="bfloat16", prefix_cache_mb=0) as url:
        fresh = generate(url)
    assert updated["output_ids"] == fresh["output_ids"]
    assert updated["meta_info"]["output_token_logprobs"] == fresh["meta_info"]["output_token_logprobs"]


def test_an_unknown_dtype_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        with running_engine(tiny_model_dir, dtype="float16"):
            pass
