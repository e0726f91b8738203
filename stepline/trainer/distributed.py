"""Data-parallel training over N ranks with `torch.distributed` (gloo on CPU, NCCL on GPU).

    ranks = Ranks.join(rank, world, "tcp://HOST:PORT", device)   # every rank, once
    train(cfg, pool, sync, ranks=ranks)                           # rank 0: claims, pushes, checkpoints
    follow(cfg, ranks)                                            # ranks 1..N-1 (stepline.trainer.loop)

Rank 0 claims groups and builds each update's batch, then hands the batch to every rank (a broadcast of the
pickled `Batch`). Every rank computes the same advantages from the whole batch; within each minibatch rank r
forwards its share of the groups (contiguous parts, `share`). The loss is divided by the minibatch's unit count
summed over the ranks, so the gradients summed over the ranks (one all-reduce of the flattened gradients) are
the single-process gradient of the whole minibatch: clipping and the optimizer step are then the same on every
rank and the parameters stay identical (test: tests/trainer/test_distributed.py). Plain all-reduce data
parallel: every rank holds the whole model and optimizer (FSDP2 sharding is not wired).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["SINGLE", "Ranks", "RanksDiverged", "parameters_digest", "rank_report"]

T = TypeVar("T")


class RanksDiverged(RuntimeError):
    """The ranks' parameters differ after training (they must stay bit-identical)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks (world 1: no collective ever runs)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def join(cls, rank: int, world: int, init_method: str, device: str = "cpu",
             timeout_s: float = 3600.0) -> Ranks:
        """Join the process group (gloo on CPU, NCCL on CUDA); `init_method` is rank 0's tcp://HOST:PORT."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, world)

    def leave(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous part of `items` (np.array_split: sizes differ by one at most; may be empty)."""
        bounds = np.array_split(np.arange(len(items)), self.world)[self.rank]
        return [items[i] for i in bounds.tolist()]

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (pickled; the other ranks' argument is ignored)."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over the ranks (float64)."""
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (on the process group's device)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over the ranks (a rank that forwarded nothing adds
        zeros); one all-reduce of the flattened gradients."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n


SINGLE = Ranks()  # one process: the default everywhere


def parameters_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_report(ranks: Ranks, out_dir: Path, updates: int, episodes: int, model: torch.nn.Module) -> list[dict]:
    """Every rank's updates, forwarded episodes and parameter digest (a collective: all ranks call it at the
    end); rank 0 writes them to out_dir/ranks.json. Raises RanksDiverged where the digests differ."""
    rows = ranks.gather({"rank": ranks.rank, "updates": updates, "episodes": episodes,
                         "digest": parameters_digest(model)})
    if ranks.rank == 0:
        (Path(out_dir) / "ranks.json").write_text(json.dumps(rows, indent=1))
    if len({r["digest"] for r in rows}) > 1:
        raise RanksDiverged(f"trainer ranks hold different parameters after training: {rows}")
    return rows
