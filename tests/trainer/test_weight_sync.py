"""Weight sync: an HF directory per version, and the gateway's admin call with its token."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from stepline.trainer.weight_sync import GatewayWeightSync, RecordingWeightSync, WeightSyncError, save_weights

torch.set_num_threads(1)


def test_saved_weights_load_as_a_model_and_old_versions_go(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    for version in (1, 2, 3):
        path = save_weights(model, tmp_path, version, tiny_model_dir, keep=2)
    assert path == tmp_path / "v000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(loaded.model.norm.weight, model.model.norm.weight)


def test_gateway_push_sends_path_version_and_token(tmp_path: Path) -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, json={"weight_version": 7})

    sync = GatewayWeightSync("http://gw", "secret", transport=httpx.MockTransport(handler))
    sync.push(tmp_path / "v000007", 7)
    sync.close()
    assert seen == [("POST", "/admin/update_weights", "Bearer secret", {"path": str(tmp_path / "v000007"), "version": 7})]


def test_gateway_refusal_is_not_retried(tmp_path: Path) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(401, json={"error": "bad token"})

    sync = GatewayWeightSync("http://gw", "wrong", transport=httpx.MockTransport(handler))
    with pytest.raises(WeightSyncError, match="401"):
        sync.push(tmp_path, 1)
    assert len(calls) == 1


def test_unreachable_gateway_retries_then_fails(tmp_path: Path) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    sync = GatewayWeightSync("http://gw", None, attempts=5, backoff=0, transport=httpx.MockTransport(handler))
    with pytest.raises(WeightSyncError, match="unreachable"):
        sync.push(tmp_path, 1)
    assert len(calls) == 5


def test_recording_fake() -> None:
    fake = RecordingWeightSync()
    fake.push(Path("/w/v1"), 1)
    assert fake.pushes == [(Path("/w/v1"), 1)]
