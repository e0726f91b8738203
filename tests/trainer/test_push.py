"""Delta pushes (stepline/trainer/push.py, stepline/engine/deltas.py) through the real gateway and built-in engine:
the engine serves exactly what a fresh engine on the full checkpoint serves, and refuses a delta it lacks the base of."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from stepline.datapool import open_pool
from stepline.engine.testing import running_engine
from stepline.gateway.cli import running_gateway
from stepline.gateway.config import GatewaySettings
from stepline.models import build_model
from stepline.trainer.push import WeightPusher
from stepline.trainer.trainable import freeze_below_top, transformer_layers
from stepline.trainer.weight_sync import GatewayWeightSync, RecordingWeightSync, save_weights
from stepline.weightdelta import MANIFEST, read_manifest

torch.set_num_threads(1)

GREEDY = {"input_ids": [11, 12, 13, 14], "return_logprob": True,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}


def top_layer_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    freeze_below_top(model, 1)
    return model


@torch.no_grad()
def train_step(model: torch.nn.Module, seed: int) -> None:
    """What an optimizer step does to the trainable tensors: every one changes."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)


def served(url: str) -> tuple[list[int], list[float]]:
    out = httpx.post(f"{url}/generate", json=GREEDY, timeout=60).json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def fresh(model: torch.nn.Module, model_dir: Path, folder: Path) -> tuple[list[int], list[float]]:
    """What an engine started on the full checkpoint of `model` serves."""
    with running_engine(save_weights(model, folder, 1, model_dir)) as url:
        return served(url)


async def test_delta_pushes_serve_what_a_fresh_engine_on_the_full_checkpoint_serves(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "weights", tiny_model_dir, keep=2)
    pusher.anchor_on(model, tiny_model_dir)
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    stats, seen = [], []
    with running_engine(tiny_model_dir) as engine_url:
        async with running_gateway(GatewaySettings(port=0, admin_token="tok"), [engine_url], tiny_model_dir,
                                   pool) as gw:
            sync = GatewayWeightSync(gw.url, "tok")
            base = await asyncio.to_thread(served, engine_url)
            for version in (1, 2):
                train_step(model, version)
                stats.append(await asyncio.to_thread(pusher.push, model, version, sync))
                seen.append(await asyncio.to_thread(served, engine_url))
                seen.append(await asyncio.to_thread(fresh, model, tiny_model_dir, tmp_path / f"full{version}"))
            sync.close()
    pool.close()
    assert [s.kind for s in stats] == ["delta", "delta"]
    assert seen[0] != base and seen[2] != seen[0]  # each push changed what is served...
    assert seen[0] == seen[1] and seen[2] == seen[3]  # ...to exactly the full checkpoint's greedy ids and logprobs
    delta = read_manifest(tmp_path / "weights" / "v000002")
    assert delta is not None and delta.anchor == str(tiny_model_dir.resolve()) and delta.anchor_version == 0
    top = len(transformer_layers(model)) - 1
    assert all(n.startswith(f"model.layers.{top}.") or n == "model.norm.weight" for n in delta.tensors)
    full = (tmp_path / "full2" / "v000001" / "model.safetensors").stat().st_size
    assert stats[1].bytes < full / 2  # the embedding and the lower layer never travel again


def test_a_delta_with_a_wrong_checksum_is_refused_and_the_old_weights_keep_serving(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "weights", tiny_model_dir)
    pusher.anchor_on(model, tiny_model_dir)
    train_step(model, 1)
    pusher.push(model, 1, RecordingWeightSync(deltas=True))
    folder = tmp_path / "weights" / "v000001"
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "checksum": "0" * 32}))
    with running_engine(tiny_model_dir) as url:
        before = served(url)
        reply = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(folder)}, timeout=60)
        after = served(url)
        version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
    assert reply.status_code == 400
    assert "would not give the trainer's state" in reply.json()["message"]
    assert after[0] == before[0] and version == "0"
    assert after[1] == pytest.approx(before[1], abs=1e-5)  # (the second call reuses the prefix cache's K/V)


async def test_an_engine_on_other_weights_gets_the_full_push(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "other", seed=1)  # same tensors, other values: the delta's base is not there
    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "weights", tiny_model_dir)
    pusher.anchor_on(model, tiny_model_dir)
    train_step(model, 1)
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    with running_engine(other) as engine_url:
        async with running_gateway(GatewaySettings(port=0, admin_token="tok"), [engine_url], other, pool) as gw:
            sync = GatewayWeightSync(gw.url, "tok")
            first = await asyncio.to_thread(pusher.push, model, 1, sync)
            after_full = await asyncio.to_thread(served, engine_url)
            train_step(model, 2)
            second = await asyncio.to_thread(pusher.push, model, 2, sync)  # a delta against the full push
            after_delta = await asyncio.to_thread(served, engine_url)
            sync.close()
    pool.close()
    assert (first.kind, second.kind) == ("full-after-refusal", "delta")
    assert read_manifest(tmp_path / "weights" / "v000002").anchor_version == 1  # type: ignore[union-attr]
    assert after_delta == await asyncio.to_thread(fresh, model, tiny_model_dir, tmp_path / "fresh")
    assert after_full != after_delta


def test_a_delta_holds_every_tensor_changed_since_the_anchor(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A tensor changed at one push and not at the next still travels: an engine restarted on the anchor
    reaches the trainer's state from the newest delta alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "w", tiny_model_dir, keep=5)
    pusher.anchor_on(model, tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    pusher.push(model, 1, RecordingWeightSync(deltas=True))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    pusher.push(model, 2, RecordingWeightSync(deltas=True))
    first, second = (sorted(load_file(tmp_path / "w" / v / "delta.safetensors")) for v in ("v000001", "v000002"))
    assert first == ["model.norm.weight"]
    assert second == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("deltas", [False, True])
def test_without_deltas_every_push_is_a_full_folder(tiny_model_dir: Path, tmp_path: Path, deltas: bool) -> None:
    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "w", tiny_model_dir, deltas=deltas)
    pusher.anchor_on(model, tiny_model_dir)
    train_step(model, 1)
    stats = pusher.push(model, 1, RecordingWeightSync(deltas=deltas))
    assert stats.kind == ("delta" if deltas else "full")
    assert (tmp_path / "w" / "v000001" / ("delta.json" if deltas else "config.json")).is_file()


def test_a_delta_made_whole_is_the_pushed_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.weightdelta import materialize

    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "w", tiny_model_dir)
    pusher.anchor_on(model, tiny_model_dir)
    train_step(model, 1)
    pusher.push(model, 1, RecordingWeightSync(deltas=True))
    whole = AutoModelForCausalLM.from_pretrained(materialize(tmp_path / "w" / "v000001", tmp_path / "whole"))
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), model.state_dict().values()))


async def test_an_engine_lacking_the_base_of_a_delta_is_given_its_anchor_first(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """The gateway's catch-up of an engine that restarted on the model folder after a full push (fleet.load_into)."""
    import aiohttp

    from stepline.gateway.engines import make_engine
    from stepline.gateway.fleet import load_into

    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "w", tiny_model_dir, keep=5)  # no anchor yet: the first push is full
    train_step(model, 1)
    assert pusher.push(model, 1, RecordingWeightSync(deltas=True)).kind == "full"
    train_step(model, 2)
    assert pusher.push(model, 2, RecordingWeightSync(deltas=True)).kind == "delta"
    with running_engine(tiny_model_dir) as url:
        async with aiohttp.ClientSession() as http:
            await load_into(make_engine(url, "builtin", http, 60), str(tmp_path / "w" / "v000002"), 2)
        after = await asyncio.to_thread(served, url)
        version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
    assert version == "2"
    assert after == await asyncio.to_thread(fresh, model, tiny_model_dir, tmp_path / "fresh")


def test_engines_that_take_no_deltas_get_full_pushes_after_two_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.trainer.weight_sync import WeightSyncError

    class NoDeltas(RecordingWeightSync):
        def push(self, path: Path, version: int) -> None:
            if (Path(path) / MANIFEST).is_file():
                raise WeightSyncError("400 SGLang loads whole checkpoints", 400)
            super().push(path, version)

    model = top_layer_model(tiny_model_dir)
    pusher = WeightPusher(tmp_path / "w", tiny_model_dir)
    pusher.anchor_on(model, tiny_model_dir)
    kinds = []
    for version in (1, 2, 3):
        train_step(model, version)
        kinds.append(pusher.push(model, version, NoDeltas(deltas=True)).kind)
    assert kinds == ["full-after-refusal", "full-after-refusal", "full"]
