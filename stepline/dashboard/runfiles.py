"""What a run directory holds, read while the job may still be writing it (no file is ever written here).

    RUN/job.json  RUN/phases.json  RUN/eval/<tag>.json  RUN/rl/metrics.jsonl  RUN/rl/rollouts.json
    RUN/pool.db   RUN/model-sft/ (or model-base/, or the job's model.dir): the tokenizer

A file that is missing, or half-written at the moment it is read, reads as empty: the view shows what
is there and fills in on the next poll.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepline.report import wilson

__all__ = ["RunFiles", "evaluations", "read_json", "read_jsonl"]

DEFAULT_LEAF_RULE = "drop_superseded"


def read_json(path: Path, default: Any = None) -> Any:
    """The file's JSON value, or `default` when it is missing or not (yet) complete JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One object per line; a line being written (not yet complete) is left out."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _eval_order(path: Path) -> tuple[int, str]:
    tail = path.stem.rsplit("-", 1)[-1]
    return (-1, "") if path.stem == "before" else (int(tail), "") if tail.isdigit() else (1 << 30, path.stem)


def evaluations(eval_dir: Path) -> list[dict[str, Any]]:
    """Each evaluation (before, after-k by k): per harness its success rate, episodes and the 95% Wilson
    interval (`stepline.report.wilson`, as the run's summary gives it)."""
    out = []
    for path in sorted(eval_dir.glob("*.json"), key=_eval_order):
        report = read_json(path)
        if not isinstance(report, dict) or not isinstance(report.get("harnesses"), dict):
            continue
        harnesses = {}
        for name, stats in report["harnesses"].items():
            n, rate = int(stats.get("episodes", 0)), float(stats.get("success_rate", 0.0))
            harnesses[name] = {"rate": rate, "n": n, "ci95": list(wilson(rate * n, n))}
        out.append({"tag": path.stem, "weight_version": report.get("weight_version"), "harnesses": harnesses})
    return out


@dataclass(frozen=True)
class RunFiles:
    """The files of one run directory (see the module docstring)."""

    root: Path

    @property
    def pool_url(self) -> str:
        return f"sqlite:///{self.root / 'pool.db'}"

    def job(self) -> dict[str, Any]:
        job = read_json(self.root / "job.json", {})
        return job if isinstance(job, dict) else {}

    def leaf_rule(self) -> str:
        """The trainer's leaf rule of the job (which leaves of a session's tree train)."""
        trainer = self.job().get("trainer") or {}
        return str(trainer.get("leaf_rule", DEFAULT_LEAF_RULE))

    def model_dir(self) -> Path | None:
        """Where the policy's tokenizer is: the SFT model, else the job's model.dir, else the base model."""
        named = (self.job().get("model") or {}).get("dir")
        for candidate in (self.root / "model-sft", Path(named) if named else None, self.root / "model-base"):
            if candidate is not None and (candidate / "tokenizer.json").is_file():
                return candidate
        return None

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.root / "rl" / "metrics.jsonl")

    def rollouts(self) -> list[dict[str, Any]]:
        """The RL episodes the rollout driver finished (written when the RL phase ends)."""
        rows = read_json(self.root / "rl" / "rollouts.json", [])
        return rows if isinstance(rows, list) else []

    def rollouts_mtime(self) -> float:
        try:
            return (self.root / "rl" / "rollouts.json").stat().st_mtime
        except OSError:
            return 0.0

    def phases(self) -> dict[str, float]:
        phases = read_json(self.root / "phases.json", {})
        return phases if isinstance(phases, dict) else {}

    def evaluations(self) -> list[dict[str, Any]]:
        return evaluations(self.root / "eval")
