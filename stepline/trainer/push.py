"""Pushing weights to the engines: only the tensors that changed, the whole model where that cannot work.

    pusher = WeightPusher(root, source_dir, keep, deltas=sync.deltas)
    pusher.anchor_on(model, source_dir)     # the weights the engines start on (version 0), before a resume
    stats = pusher.push(model, version, sync)   # PushStats(kind, bytes, seconds)

A push is a delta (stepline.weightdelta) against the anchor: the tensors whose digest differs from the
anchor's, at this push or any earlier one since the anchor. With `train_layers = k` that is the top k layers
and the final norm; the frozen embedding (the largest tensor of a small model) never travels again. The delta
carries the full state's checksum; an engine that would not reach it refuses, and the push is made in full
(save_weights), which becomes the new anchor. So the full push is the fallback: the engines started on other
weights, one restarted after a full push, or the gateway's engines take no deltas (`sync.deltas` False:
offline training and SFT write full folders, which are their output; two refusals in a row, the second right
after a full push, mean engines that load no deltas, SGLang: every later push is full).

Digests are computed incrementally: a frozen parameter's digest once, the trainable tensors' at each push
(for SmolLM2 with the top 10 of 30 layers trained, a third of the layers' bytes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stepline.trainer.trainable import full_state_dict, has_lora
from stepline.trainer.weight_sync import WeightSync, WeightSyncError, prune_weights, save_weights
from stepline.weightdelta import checksum, digest, digests, unique_tensors, write_delta

__all__ = ["PushStats", "WeightPusher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushStats:
    kind: str  # "delta" | "full" | "full-after-refusal" (a delta the engines refused, then the full state)
    bytes: int  # bytes written for the engines (both folders after a refusal)
    seconds: float  # writing and loading, from the trainer's side


@dataclass
class _Anchor:
    folder: Path  # a full checkpoint folder: the model the engines start on, or the last full push
    version: int
    table: dict[str, bytes]  # its digest table


class WeightPusher:
    def __init__(self, root: Path, source_dir: Path, keep: int = 2, deltas: bool = True) -> None:
        self.root, self.source_dir, self.keep, self.deltas = Path(root), Path(source_dir), keep, deltas
        self.anchor: _Anchor | None = None
        self._touched: set[str] = set()  # tensors that differed from the anchor at some push since it
        self._frozen: dict[str, bytes] = {}  # digests of frozen parameters: they never change
        self._refused = 0  # deltas refused in a row

    def anchor_on(self, model: nn.Module, folder: Path, version: int = 0) -> None:
        """The engines serve `model`'s current weights, from `folder`, as `version` (at start: the model folder)."""
        if self.deltas:
            self.anchor = _Anchor(Path(folder), version, digests(_state(model)))

    def push(self, model: nn.Module, version: int, sync: WeightSync) -> PushStats:
        started = time.perf_counter()
        state = unique_tensors(_state(model))
        written = 0
        kind = "full"
        table = self._table(model, state) if self.deltas else None
        if table is not None and self.anchor is not None:
            path = self._write_delta(state, table, version)
            written = _size(path)
            try:
                sync.push(path, version)
                self._refused = 0
                prune_weights(self.root, self.keep, self.anchor.folder)
                return PushStats("delta", written, time.perf_counter() - started)
            except WeightSyncError as exc:
                if not exc.refused:
                    raise
                log.warning("the engines refused the delta for v%d (%s): pushing the full weights", version, exc)
                kind = "full-after-refusal"
                self._refused += 1
                if self._refused >= 2:  # refused right after a full push: these engines take no deltas (SGLang)
                    log.warning("the engines refused two deltas in a row: every push is full from now on")
                    self.deltas = False
        path = save_weights(model, self.root, version, self.source_dir, keep=self.keep)
        sync.push(path, version)
        if self.deltas and table is not None:
            self.anchor, self._touched = _Anchor(path, version, table), set()
        return PushStats(kind, written + _size(path), time.perf_counter() - started)

    def _table(self, model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
        """Digests of `state`, reusing those of frozen parameters."""
        frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
        table = {}
        for name, tensor in state.items():
            if tensor.data_ptr() in frozen:
                if name not in self._frozen:
                    self._frozen[name] = digest(name, tensor)
                table[name] = self._frozen[name]
            else:
                table[name] = digest(name, tensor)
        return table

    def _write_delta(self, state: dict[str, torch.Tensor], table: dict[str, bytes], version: int) -> Path:
        assert self.anchor is not None
        self._touched |= {name for name, d in table.items() if self.anchor.table.get(name) != d}  # new names too
        tensors = {name: state[name] for name in sorted(self._touched)}
        return write_delta(self.root / f"v{version:06d}", tensors, checksum(table), self.anchor.folder.resolve(),
                           self.anchor.version)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights under plain HF names, LoRA merged (what the engines load)."""
    return full_state_dict(model) if has_lora(model) else model.state_dict()


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
