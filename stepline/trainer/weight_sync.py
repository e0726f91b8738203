"""Weight sync: save the policy as a Hugging Face directory per version and tell the gateway to load it.

    path = save_weights(model, root, version, source_dir)    # root/v000003/ (safetensors + tokenizer files)
    sync.push(path, version)                                 # POST {gateway}/admin/update_weights

The gateway pauses its engines, loads the directory (built-in engine, SGLang `update_weights_from_disk`,
vLLM reload) and resumes; later calls are stamped with the new version. On a GPU cluster the faster path
skips the disk: the trainer and the engines join one NCCL group and the trainer broadcasts each tensor
(SGLang `init_weights_update_group` / `update_weights_from_distributed`); that belongs to the deployment
layer and slots in behind the same `WeightSync` interface.

Exceptions:

    WeightSyncError      the gateway refused the update (4xx/5xx) or stayed unreachable after retries
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import torch
from torch import nn

from stepline._retry import RetryPolicy, transport_error
from stepline.trainer.trainable import full_state_dict, has_lora

__all__ = ["FanOutWeightSync", "GatewayWeightSync", "NoWeightSync", "RecordingWeightSync", "WeightSync", "WeightSyncError",
           "save_weights", "saved_weights"]

# files of the source model directory the engine needs next to the weights
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt")


class WeightSyncError(Exception):
    """The gateway refused a weight update or could not be reached."""


class WeightSync(Protocol):
    def push(self, path: Path, version: int) -> None: ...
    def close(self) -> None: ...


def save_weights(model: nn.Module, root: Path, version: int, source_dir: Path, keep: int = 2) -> Path:
    """Save `model` to root/v{version:06d} as safetensors with the source's tokenizer files; keep the last `keep`.
    The folder is always the full model under plain HF names (LoRA adapters merged, frozen weights
    included: `stepline.trainer.trainable.full_state_dict`), since the engine loads nothing else."""
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # never written, so never pushed to an engine or resumed from
        raise ValueError(f"refusing to save weights v{version}: {len(bad)} tensors hold NaN/inf (first: {bad[0]})")
    out = Path(root) / f"v{version:06d}"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = full_state_dict(model) if has_lora(model) else None  # None: HF saves model.state_dict() itself
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
    for name in _TOKENIZER_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # an engine never sees a half-written directory
    for old in saved_weights(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def saved_weights(root: Path) -> list[Path]:
    """The complete weight folders `save_weights` left in root, oldest first (the last is the newest)."""
    return sorted(p for p in Path(root).glob("v[0-9]*") if p.is_dir() and not p.name.endswith(".tmp"))


class GatewayWeightSync:
    """POST /admin/update_weights {path, version} with the admin token. Transport errors retry with bounded
    backoff; an HTTP error status never retries (a 4xx will not get better)."""

    def __init__(self, gateway_url: str, admin_token: str | None, timeout: float = 600.0, attempts: int = 5,
                 backoff: float = 0.2, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(base_url=gateway_url, headers=headers, timeout=timeout, transport=transport)
        self._retry = RetryPolicy(attempts, backoff, max_backoff=5.0)

    def push(self, path: Path, version: int) -> None:
        try:
            response = self._retry.call(self._http.post, "/admin/update_weights", retry_on=transport_error(resend=True),
                                        json={"path": str(Path(path).resolve()), "version": version})
        except httpx.TransportError as exc:
            raise WeightSyncError(f"gateway unreachable at {self._http.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise WeightSyncError(f"gateway refused weights v{version}: {response.status_code} {response.text[:300]}")

    def close(self) -> None:
        self._http.close()


@dataclass
class FanOutWeightSync:
    """The same push to several syncs in order (one gateway per share of the engines, `stepline run --ray`);
    each gateway does its own pause → load → version → resume. The first failure stops the push."""

    syncs: list[WeightSync]

    def push(self, path: Path, version: int) -> None:
        for sync in self.syncs:
            sync.push(path, version)

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()


@dataclass
class RecordingWeightSync:
    """The fake for tests: records each push (path, version)."""

    pushes: list[tuple[Path, int]] = field(default_factory=list)

    def push(self, path: Path, version: int) -> None:
        self.pushes.append((Path(path), version))

    def close(self) -> None:
        pass


class NoWeightSync:
    """No gateway (replay, offline training): weights are saved, nobody is told."""

    def push(self, path: Path, version: int) -> None:
        pass

    def close(self) -> None:
        pass
