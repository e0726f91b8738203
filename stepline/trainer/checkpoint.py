"""Checkpoints: a trainer killed with -9 restarts where it stopped, and no group is trained twice or lost.

The rule that makes it hold: *consumed* is committed together with the model. A group that was claimed
and trained goes into the checkpoint's `consumed` list; only after that checkpoint is on disk is it
marked consumed in the pool. After a crash the restarted trainer asks the pool which groups it still
holds (`Pool.claimed_groups`):

    in the checkpoint               -> trained into the restored model: (re-)mark it consumed, never again
    claimed, not in the checkpoint  -> the model that trained it is lost (or it never arrived): release it

A checkpoint is a directory `ckpt-{update:06d}` (HF model in safetensors with the source model's tokenizer and
chat template, so `model/` serves as it is unless LoRA adapters are in it; optimizer, scheduler, value head, RNG
states, `state.json`) written under a temporary name and renamed; `latest` names the newest one and is replaced
atomically, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stepline.trainer.weight_sync import copy_tokenizer_files

__all__ = ["TrainerState", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


@dataclass
class TrainerState:
    """The loop's counters and the groups trained into the model (group id -> its session ids)."""

    update: int = 0  # policy updates done
    version: int = 0  # weight version of the current policy (stamps the engines' calls after a push)
    optimizer_steps: int = 0
    consumed: dict[str, list[str]] = field(default_factory=dict)  # every group trained into this model
    unacked: list[str] = field(default_factory=list)  # consumed since the previous checkpoint (pool not told yet)


def save_checkpoint(root: Path, state: TrainerState, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, value_head: nn.Module | None = None, keep: int = 2,
                    tokenizer_from: Path | None = None) -> Path:
    """Write the checkpoint of `state.update`; `tokenizer_from`: the model directory whose tokenizer files go
    beside the weights. Keeps the newest `keep`."""
    root = Path(root)
    out = root / f"ckpt-{state.update:06d}"
    tmp = root / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, tmp / "model")
    extra = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state(),
             "value_head": value_head.state_dict() if value_head is not None else None}
    torch.save(extra, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(state.__dict__))
    _fsync_dir(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _atomic_write(root / "latest", out.name)
    for old in sorted(root.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def latest_checkpoint(root: Path) -> Path | None:
    pointer = Path(root) / "latest"
    return Path(root) / pointer.read_text().strip() if pointer.is_file() else None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    value_head: nn.Module | None = None) -> TrainerState:
    """Restore everything saved by `save_checkpoint` into the given objects; return the loop state."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    tied = {k for k in missing if tied and "lm_head" in k}  # tied embeddings are saved once
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
    extra = torch.load(path / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(extra["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    if value_head is not None and extra["value_head"] is not None:
        value_head.load_state_dict(extra["value_head"])
    _set_rng_state(extra["rng"])
    return TrainerState(**json.loads((path / "state.json").read_text()))


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
