"""The live display of the RL phase: updates, episodes/s, reward per harness, staleness, loss."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stepline.report import flat_groups
from stepline.rollout.pacing import BackgroundRollouts

__all__ = ["RLProgress", "skip_warning"]


def last_metrics(path: Path) -> tuple[int, dict[str, Any]]:
    """(number of updates logged, the latest row) of the trainer's metrics.jsonl."""
    if not path.is_file():
        return 0, {}
    lines = path.read_text().splitlines()
    return len(lines), (json.loads(lines[-1]) if lines else {})


def skip_warning(updates: int, total: int, rollouts: list[dict[str, Any]], finished: bool) -> str | None:
    """The panel's loud line: groups are being skipped and no update came of them yet, or the phase ended short."""
    flat, groups = flat_groups(rollouts)
    if finished and updates < total:
        return (f"[bold red]RL made {updates} of the {total} updates asked[/] ({flat} of {groups} groups drawn had no "
                "reward variance and were skipped)")
    if updates == 0 and flat and flat == groups:
        return (f"[bold red]no update yet: all {groups} groups drawn had no reward variance[/] (every episode of a "
                "group scored alike: skipped, nothing to learn from)")
    return None


class RLProgress:
    """A rich Live panel refreshed from the trainer's metrics file and the rollout driver's stats."""

    def __init__(self, metrics_file: Path, rollouts: BackgroundRollouts, total_updates: int) -> None:
        self.metrics_file, self.rollouts = metrics_file, rollouts
        self.bar = Progress(TextColumn("[bold]RL updates"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.task = self.bar.add_task("", total=total_updates)
        self.total, self.finished = total_updates, False
        self.live = Live(self._render(), refresh_per_second=1, transient=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def __enter__(self) -> RLProgress:
        self.live.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.finished = True
        self.live.update(self._render())
        self.live.__exit__(*exc)

    def _refresh(self) -> None:
        while not self._stop.wait(1.0):
            self.live.update(self._render())

    def _render(self) -> Group:
        done, row = last_metrics(self.metrics_file)
        self.bar.update(self.task, completed=done)
        table = Table(box=None, pad_edge=False)
        for column in ("harness", "episodes", "failed", "success", "reward", "ep/s"):
            table.add_column(column, justify="right" if column != "harness" else "left")
        for name, s in self.rollouts.summary().items():
            table.add_row(name, f"{s['episodes']:.0f}", f"{s['failed']:.0f}", f"{s['success_rate']:.2f}",
                          f"{s['mean_reward']:.2f}", f"{s['episodes_per_s']:.2f}")
        keys = ("reward_mean", "policy_loss", "staleness_mean", "staleness_max", "tree_token_saving", "tokens_per_s")
        trainer = "  ".join(f"{k}={row[k]:.3g}" for k in keys if isinstance(row.get(k), (int, float)))
        warning = skip_warning(done, self.total, list(self.rollouts.history), self.finished)
        lines = [trainer or "waiting for the first update…", *([warning] if warning else [])]
        return Group(self.bar, table, *lines)
