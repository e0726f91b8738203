"""Observability: per-update metrics to JSONL (one line per update) and TensorBoard, and a live progress bar.

    log = MetricsLog(output_dir, tensorboard=True)   # output_dir/metrics.jsonl, output_dir/tb/
    log.write(update, metrics); log.close()
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["MetricsLog", "progress_bar"]


class MetricsLog:
    def __init__(self, output_dir: Path, tensorboard: bool = True) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(output_dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(output_dir / "tb"))

    def write(self, update: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"update": update, "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, update)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def progress_bar(total: int | None, enabled: bool = True) -> Progress:
    """A rich progress bar over updates; its task's description carries the latest reward and tokens/s."""
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), disable=not enabled)
    progress.add_task("", total=total)
    return progress
