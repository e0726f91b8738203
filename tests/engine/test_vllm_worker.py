"""Stepline's vLLM worker extension (stepline/engine/vllm_worker.py) outside vLLM: what it loads, what it refuses.

vLLM's worker is stood in for by a runner whose `reload_weights` copies the tensors into a transformers model by
name (what vLLM's layerwise reload does for these names); the real vLLM runs in tests/engines/test_vllm_tied.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from stepline.engine.vllm_worker import SteplineWorker
from stepline.models import build_model
from stepline.trainer.push import WeightPusher
from stepline.trainer.trainable import freeze_below_top
from stepline.trainer.weight_sync import RecordingWeightSync
from stepline.weightdelta import MANIFEST, checksum, folder_digests


@dataclass
class Runner:
    model: torch.nn.Module

    @torch.no_grad()
    def reload_weights(self, weights_iterator) -> None:
        served = self.model.state_dict()
        for name, tensor in weights_iterator:
            served[name].copy_(tensor)

    def get_model(self) -> torch.nn.Module:
        return self.model


@dataclass
class Config:
    model: str


class Worker(SteplineWorker):
    def __init__(self, folder: Path) -> None:
        self.model_runner = Runner(AutoModelForCausalLM.from_pretrained(folder))
        self.model_config = Config(str(folder))


def test_full_folders_and_deltas_load_and_a_wrong_checksum_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "other", seed=1)
    worker = Worker(tiny_model_dir)
    assert worker.stepline_load(str(other)) == {"ok": True, "loaded": 26, "checksum": None}  # tied: no lm_head
    assert worker.stepline_checksum() == checksum(folder_digests(other))

    model = AutoModelForCausalLM.from_pretrained(other)
    freeze_below_top(model, 1)
    pusher = WeightPusher(tmp_path / "w", other)
    pusher.anchor_on(model, other, version=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    pusher.push(model, 2, RecordingWeightSync(deltas=True))
    delta = tmp_path / "w" / "v000002"
    manifest = json.loads((delta / MANIFEST).read_text())
    (delta / MANIFEST).write_text(json.dumps({**manifest, "checksum": "0" * 32}))
    refused = worker.stepline_load(str(delta))
    served = worker.model_runner.model
    assert not refused["ok"] and "lacks its base" in refused["message"]
    assert not torch.equal(served.model.norm.weight, model.model.norm.weight)  # nothing was loaded
    (delta / MANIFEST).write_text(json.dumps(manifest))
    loaded = worker.stepline_load(str(delta))
    assert loaded == {"ok": True, "loaded": 1, "checksum": manifest["checksum"]}
    assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), model.state_dict().values()))


def test_an_unreadable_folder_is_an_answer_not_a_crash(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = Worker(tiny_model_dir)
    assert worker.stepline_load(str(tmp_path))["ok"] is False  # no *.safetensors
    (tmp_path / MANIFEST).write_text("{")
    assert "unreadable" in worker.stepline_load(str(tmp_path))["message"]
