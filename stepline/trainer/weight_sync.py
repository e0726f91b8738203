"""Weight sync: save the policy as a Hugging Face directory per version and tell the gateway to load it.

    path = save_weights(model, root, version, source_dir)    # root/v000003/ (safetensors + tokenizer files)
    sync.push(path, version)                                 # POST {gateway}/admin/update_weights

The folder may also be a delta (only the tensors that changed, stepline.weightdelta), which the trainer's
`WeightPusher` (stepline/trainer/push.py) writes where the sync says the gateway takes deltas (`sync.deltas`).

The gateway pauses its engines, loads the directory (built-in engine, SGLang `update_weights_from_disk`,
vLLM reload) and resumes; later calls are stamped with the new version. On a GPU cluster the faster path
skips the disk: the trainer and the engines join one NCCL group and the trainer broadcasts each tensor
(SGLang `init_weights_update_group` / `update_weights_from_distributed`); that belongs to the deployment
layer and slots in behind the same `WeightSync` interface.

Exceptions:

    WeightSyncError      the gateway refused the update (4xx/5xx) or stayed unreachable after retries;
                         `status` is the gateway's answer (None: unreachable)
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
           "copy_tokenizer_files", "prune_weights", "save_weights", "saved_weights"]

# files of the source model directory the engine needs next to the weights
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt")


class WeightSyncError(Exception):
    """The gateway refused a weight update or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the gateway's HTTP status; None when it was unreachable

    @property
    def refused(self) -> bool:
        """The gateway answered 4xx: the engines would not load this folder (a delta they lack the base of)."""
        return self.status is not None and 400 <= self.status < 500


class WeightSync(Protocol):
    @property
    def deltas(self) -> bool:
        """The receiving side loads delta folders (stepline.weightdelta), not only full checkpoints."""
        ...

    def push(self, path: Path, version: int) -> None: ...
    def close(self) -> None: ...


def save_weights(model: nn.Module, root: Path, version: int, source_dir: Path, keep: int = 2,
                 protect: Path | None = None) -> Path:
    """Save `model` to root/v{version:06d} as safetensors with the source's tokenizer files; keep the last `keep`
    (and `protect`: the full folder later deltas are taken against).
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
    copy_tokenizer_files(source_dir, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # an engine never sees a half-written directory
    prune_weights(root, keep, protect)
    return out


def copy_tokenizer_files(source_dir: Path, dest: Path) -> None:
    """Copy the tokenizer, chat template and generation config of `source_dir` that exist into `dest`."""
    for name in _TOKENIZER_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, Path(dest) / name)


def prune_weights(root: Path, keep: int, protect: Path | None = None) -> None:
    """Remove all but the newest `keep` weight folders in root, never `protect`."""
    for old in saved_weights(root)[:-keep]:
        if protect is None or old.resolve() != Path(protect).resolve():
            shutil.rmtree(old, ignore_errors=True)


def saved_weights(root: Path) -> list[Path]:
    """The complete weight folders `save_weights` left in root, oldest first (the last is the newest)."""
    return sorted(p for p in Path(root).glob("v[0-9]*") if p.is_dir() and not p.name.endswith(".tmp"))


class GatewayWeightSync:
    """POST /admin/update_weights {path, version} with the admin token. Transport errors retry with bounded
    backoff; an HTTP error status never retries (a 4xx will not get better)."""

    deltas = True  # the gateway hands delta folders to engines that load them, and refuses (4xx) where they cannot

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
            raise WeightSyncError(f"gateway refused weights v{version}: {response.status_code} {response.text[:300]}",
                                  response.status_code)

    def close(self) -> None:
        self._http.close()


@dataclass
class FanOutWeightSync:
    """The same push to several syncs in order (one gateway per share of the engines, `stepline run --ray`);
    each gateway does its own pause → load → version → resume. The first failure stops the push."""

    syncs: list[WeightSync]

    @property
    def deltas(self) -> bool:
        return all(sync.deltas for sync in self.syncs)

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
    deltas: bool = False

    def push(self, path: Path, version: int) -> None:
        self.pushes.append((Path(path), version))

    def close(self) -> None:
        pass


class NoWeightSync:
    """No gateway (replay, offline training): weights are saved (in full: the folders are the output), nobody is told."""

    deltas = False

    def push(self, path: Path, version: int) -> None:
        pass

    def close(self) -> None:
        pass
