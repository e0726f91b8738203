"""A model with tied word embeddings trains through a real vLLM: Stepline's worker extension
(stepline/engine/vllm_worker.py) loads full checkpoints and deltas in place, LM head included.

One vLLM starts on a tied tiny model (seed 0) with the extension; it is pushed a full checkpoint of another
model (seed 1), then a delta on top of it that changes the embedding (so the tied LM head) and the top layer;
a delta with a wrong checksum is refused. A second, fresh vLLM started on the full checkpoint of the final
weights must serve the same greedy ids and logprobs; transformers' forward on them is the oracle of both.
The same for SmolLM2-135M (the cached build; tied, 30 layers): a delta of its top 10 layers and its embedding, pushed
to the vLLM serving it, serves what a fresh vLLM on the full checkpoint serves.
Starting vLLM twice takes minutes on 2 busy cores: marked slow, skipped without `STEPLINE_VLLM_PYTHON`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import torch
from oracle import teacher_forced
from real_vllm import VLLM_STARTUP_S, running_vllm
from transformers import AutoModelForCausalLM

from stepline.gateway.engines import EngineRejected, SamplingParams, make_engine
from stepline.models import VLLM_SHAPE, build_model
from stepline.trainer.push import WeightPusher
from stepline.trainer.trainable import freeze_below_top
from stepline.trainer.weight_sync import RecordingWeightSync, save_weights
from stepline.weightdelta import MANIFEST

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * VLLM_STARTUP_S + 600)]  # two vLLM starts

TIED = replace(VLLM_SHAPE, tie_embeddings=True)
PROMPT = [11, 12, 13, 14, 15]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def trained(model_dir: Path, top: int = 1, scale: float = 0.3) -> torch.nn.Module:
    """The model after a step that moved its top layers and its (tied) embedding."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    freeze_below_top(model, top)
    model.model.embed_tokens.weight.requires_grad_(True)
    gen = torch.Generator().manual_seed(3)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
    return model


async def greedy(url: str, model_dir: Path) -> tuple[list[int], list[float]]:
    async with aiohttp.ClientSession() as http:
        gen = await make_engine(url, "vllm", http, timeout=120, model_dir=model_dir).generate(PROMPT, GREEDY)
    return gen.output_ids, gen.logprobs


async def push(url: str, model_dir: Path, folder: Path, version: int) -> None:
    async with aiohttp.ClientSession() as http:
        engine = make_engine(url, "vllm", http, timeout=120, model_dir=model_dir)
        await engine.pause()
        try:
            await engine.update_weights(str(folder), version)
        finally:
            await engine.resume()


async def test_a_tied_model_serves_exactly_the_pushed_weights(tmp_path: Path) -> None:
    start, other = (build_model(tmp_path / name, seed=seed, shape=TIED) for name, seed in (("a", 0), ("b", 1)))
    model = trained(other)
    pusher = WeightPusher(tmp_path / "weights", other, keep=5)
    pusher.anchor_on(AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32), other, version=1)
    pusher.push(model, 2, RecordingWeightSync(deltas=True))
    delta = tmp_path / "weights" / "v000002"
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in delta.iterdir():
        wrong.joinpath(f.name).write_bytes(f.read_bytes())
    (wrong / MANIFEST).write_text(json.dumps({**json.loads((delta / MANIFEST).read_text()), "checksum": "0" * 32}))
    final = save_weights(model, tmp_path / "full", 2, other)

    with running_vllm(start, tmp_path) as url:
        await push(url, start, other, 1)  # a full checkpoint of the tied model
        after_full = await greedy(url, start)
        await push(url, start, delta, 2)  # the embedding (so the tied head) and the top layer, in place
        after_delta = await greedy(url, start)
        with pytest.raises(EngineRejected, match="lacks its base"):
            await push(url, start, wrong, 3)
        after_refusal = await greedy(url, start)
    with running_vllm(final, tmp_path) as url:
        fresh = await greedy(url, final)

    assert after_delta[0] == fresh[0]
    assert after_delta[1] == pytest.approx(fresh[1], abs=1e-5)
    assert after_refusal[0] == after_delta[0]
    for (ids, logprobs), weights in ((after_full, other), (after_delta, final)):
        chosen, best = teacher_forced(weights, PROMPT, ids)
        assert logprobs == pytest.approx(chosen, abs=1e-4)
        assert [c >= b - 1e-4 for c, b in zip(chosen, best)] == [True] * len(chosen)
    assert after_full[0] != after_delta[0]


async def test_smollm2_serves_exactly_the_pushed_delta(tmp_path: Path) -> None:
    from stepline.pretrained import cached_build

    start = cached_build()
    model = trained(start, top=10, scale=0.05)
    pusher = WeightPusher(tmp_path / "weights", start)
    pusher.anchor_on(AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32), start)
    stats = pusher.push(model, 1, RecordingWeightSync(deltas=True))
    final = save_weights(model, tmp_path / "full", 1, start)
    with running_vllm(start, tmp_path) as url:
        before = await greedy(url, start)
        await push(url, start, tmp_path / "weights" / "v000001", 1)
        after = await greedy(url, start)
    with running_vllm(final, tmp_path) as url:
        fresh = await greedy(url, final)
    assert stats.kind == "delta" and stats.bytes < (final / "model.safetensors").stat().st_size / 2
    assert after[0] == fresh[0]
    assert after[1] == pytest.approx(fresh[1], abs=1e-5)
    assert after[1] != pytest.approx(before[1], abs=1e-3)  # the push changed what vLLM serves
