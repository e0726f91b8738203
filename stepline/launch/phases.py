"""The phases of the main job that every launcher runs the same way, local (`stepline run`, run.py) or on Ray
(`stepline run --ray`, ray_run.py): the run directory, the base model, the trainer configs, the SFT warm start,
the evaluation before and after RL, the rollout history and the summary. Both launchers import this module; it
imports neither.

Every phase leaves its result in the run directory and is skipped when it is already there, so a job stopped
with Ctrl-C starts again where it stopped (the trainer resumes from its last checkpoint).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from stepline.launch.job import JobConfig, trainer_config

if TYPE_CHECKING:
    from stepline.rollout.config import RolloutConfig
    from stepline.trainer.config import TrainerConfig

__all__ = ["EVAL_AFTER_GROWTH", "RunDir", "build_base_model", "evaluate_once", "rl_seconds_left", "save_rollouts",
           "run_files", "save_cut_calls", "smallest_group", "time_bound", "trainer_configs", "warm_start", "warm_started", "write_summary"]


class RunDir:
    """Where each phase of a run keeps its result (its presence is what a resumed job skips)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base_model = root / "model-base"
        self.sft = root / "sft"  # demonstrations pool and the SFT trainer's output
        self.sft_model = root / "model-sft"
        self.rl = root / "rl"  # the RL trainer's output: metrics, checkpoints, pushed weights
        self.pool_db = root / "pool.db"
        self.logs = root / "logs"

    def eval_file(self, tag: str) -> Path:
        return self.root / "eval" / f"{tag}.json"

    def phases(self) -> dict[str, float]:
        """Seconds this run directory's jobs have spent in each phase so far."""
        path = self.root / "phases.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase into phases.json (seconds; a resumed job adds to what the stopped one spent)."""
        started = time.monotonic()
        try:
            yield
        finally:
            phases = self.phases()
            phases[name] = round(phases.get(name, 0.0) + time.monotonic() - started, 1)
            (self.root / "phases.json").write_text(json.dumps(phases, indent=1))



def warm_started(cfg: JobConfig) -> tuple[RunDir, TrainerConfig, Path]:
    """The phases every form of the job (local, Ray) begins with: the run directory, the base model, both trainer
    configs checked before anything long starts, the SFT warm start. Returns (run, RL config, SFT policy)."""
    run = RunDir(cfg.run_dir)
    for path in (run.root, run.logs, run.root / "eval"):
        path.mkdir(parents=True, exist_ok=True)
    (run.root / "job.json").write_text(cfg.model_dump_json(indent=1))
    with run.phase("model"):
        base = build_base_model(cfg, run)
    sft_cfg, rl_cfg = trainer_configs(cfg, run, base)
    with run.phase("sft"):
        policy = warm_start(cfg, run, base, sft_cfg)
    return run, rl_cfg, policy


def trainer_configs(cfg: JobConfig, run: RunDir, base: Path) -> list[TrainerConfig]:
    """The SFT and RL trainer configs; a bad field fails here, naming `sft.trainer.X` or `trainer.X`."""
    sft = {"seed": cfg.seed, "progress": False, **cfg.sft.trainer, "mode": "sft", "model_dir": base,
           "output_dir": run.sft / "train"}
    rl = {"seed": cfg.seed, "checkpoint_every": 1, "idle_timeout": 10.0, **cfg.trainer, "mode": "rl",
          "progress": False, "model_dir": base, "output_dir": run.rl, "max_updates": max(cfg.rl_updates, 1),
          "group_size": smallest_group(cfg.rollout), "max_seconds": rl_seconds_left(cfg, run)}
    return [trainer_config(sft, "sft.trainer"), trainer_config(rl, "trainer")]


EVAL_AFTER_GROWTH = 1.5  # the evaluation after RL over the one before: a trained policy's episodes run longer
                         # (measured 1.6-1.7x when RL stopped UI's early "Done.", 1.0-1.3x before that)


def rl_seconds_left(cfg: JobConfig, run: RunDir) -> float | None:
    """What is left of the RL phase's time bounds after what this job's runs spent so far (phases.json): of
    rl_minutes, the RL time spent; of job_minutes, every phase's, and EVAL_AFTER_GROWTH times what the evaluation
    before RL took, for the one after it. None: no bound."""
    phases = run.phases()
    left = []
    if cfg.rl_minutes is not None:
        left.append(cfg.rl_minutes * 60 - phases.get("rl", 0.0))
    if cfg.job_minutes is not None:
        left.append(cfg.job_minutes * 60 - sum(phases.values()) - EVAL_AFTER_GROWTH * phases.get("eval_before", 0.0))
    return max(min(left), 0.001) if left else None


def smallest_group(rollout: RolloutConfig) -> int:
    """The fewest sessions a group of this job has: the trainer's minimum group size."""
    return min([h.group_size or rollout.group_size for h in rollout.harnesses], default=rollout.group_size)


def build_base_model(cfg: JobConfig, run: RunDir) -> Path:
    from stepline.models import ModelShape, build_model

    if cfg.model.dir is not None:
        return cfg.model.dir
    if not (run.base_model / "config.json").is_file():
        m = cfg.model
        seed = cfg.seed if m.seed is None else m.seed
        shape = ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                           num_kv_heads=m.num_kv_heads, tie_embeddings=not m.vllm_compatible)
        build_model(run.base_model, kind=m.kind, seed=seed, shape=shape)
    return run.base_model


def warm_start(cfg: JobConfig, run: RunDir, base: Path, sft: TrainerConfig) -> Path:
    """SFT on expert demonstrations (cached in run_dir/model-sft); the base model when there are none."""
    from stepline.datapool import open_pool
    from stepline.launch.demos import collect_demos
    from stepline.trainer.loop import train
    from stepline.trainer.weight_sync import NoWeightSync, saved_weights

    if cfg.sft.demos_per_harness == 0 and not any(cfg.sft.demos.values()):
        return base
    if (run.sft_model / "config.json").is_file():
        return run.sft_model
    run.sft.mkdir(exist_ok=True)
    pool = open_pool(f"sqlite:///{run.sft / 'demos.db'}")
    try:
        if not pool.stats()["sessions"]:
            written = collect_demos(pool, base, cfg.rollout.harnesses, cfg.sft.demos_per_harness, seed=cfg.seed,
                                    counts=cfg.sft.demos, matching=cfg.sft.demo_tasks_matching,
                                    kinds=cfg.sft.demo_kinds)
            click.echo(f"expert demonstrations: {written}")
        state = train(sft, pool, NoWeightSync(), offline=True)
    finally:
        pool.close()
    latest = saved_weights(run.sft / "train" / "weights")
    if not latest:
        raise click.ClickException("the SFT pass trained nothing (no demonstrations?)")
    latest[-1].rename(run.sft_model)
    click.echo(f"SFT warm start: {state.update} updates → {run.sft_model}")
    return run.sft_model



def evaluate_once(cfg: JobConfig, run: RunDir, gateway_url: str, token: str, tag: str) -> dict[str, Any]:
    """Success per harness on the test split through the policy the gateway serves now (cached by tag)."""
    import asyncio

    from stepline.rollout.driver import format_stats
    from stepline.rollout.evaluate import evaluate

    path = run.eval_file(tag)
    if path.is_file():
        return json.loads(path.read_text())
    click.echo(f"evaluating ({tag}) on the test split…")
    rollout = cfg.rollout.model_copy(update={"max_concurrency": cfg.eval.concurrency or cfg.rollout.max_concurrency})
    report = asyncio.run(evaluate(rollout, gateway_url, token, "test", cfg.eval.limit, cfg.eval.temperature))
    path.write_text(json.dumps(report, indent=1))
    click.echo(format_stats(report["harnesses"]))
    return report



def save_rollouts(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append this run's episodes to those a stopped run of the same job wrote (resume keeps history);
    batch numbers continue after the earlier run's."""
    earlier = json.loads(path.read_text()) if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)  # also when the trainer failed before making its folder
    offset = 1 + max((r.get("batch", 0) for r in earlier), default=-1)
    path.write_text(json.dumps(earlier + [{**r, "batch": r.get("batch", 0) + offset} for r in rows], indent=1))


_CUT = re.compile(r'^stepline_gateway_cut_calls_total\{answer="(\w+)"\} ([0-9.e+]+)$', re.M)


def save_cut_calls(run: RunDir, metrics: list[str]) -> dict[str, int]:
    """The calls weight updates cut short, by how the gateways answered them (resumed under the new weights |
    truncated), read from each gateway's /metrics text and added to those an earlier start of the job saved
    (rl/cut_calls.json, which the summary reports)."""
    path = run.rl / "cut_calls.json"
    counts = json.loads(path.read_text()) if path.is_file() else {"resumed": 0, "truncated": 0}
    for text in metrics:
        for answer, value in _CUT.findall(text):
            counts[answer] = counts.get(answer, 0) + int(float(value))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(counts))
    return counts


def time_bound(cfg: JobConfig) -> str | None:
    """The job's time bounds on the RL phase, as the job file writes them (None: none)."""
    bounds = [f"{name} = {value:g}" for name, value in (("rl_minutes", cfg.rl_minutes), ("job_minutes", cfg.job_minutes))
              if value is not None]
    return ", ".join(bounds) or None


def run_files(run: RunDir, plot: Path) -> dict[str, str]:
    """The files and folders the summary points at, those that exist only (a job with no update wrote no weights,
    one with tensorboard off no tb/)."""
    files = {"config": run.root / "job.json", "sft_model": run.sft_model, "metrics_jsonl": run.rl / "metrics.jsonl",
             "tensorboard": run.rl / "tb", "pool": run.pool_db, "rollouts": run.rl / "rollouts.json",
             "checkpoints": run.rl / "checkpoints", "weights": run.rl / "weights", "plot": plot, "logs": run.logs}
    return {name: str(path) for name, path in files.items() if path.exists()}


def write_summary(cfg: JobConfig, run: RunDir) -> dict[str, Any]:
    from stepline.report import plot_run, summarise

    summary = summarise(run.root, cfg.rl_updates, time_bound(cfg))
    summary["phases_s"] = run.phases()
    summary["files"] = run_files(run, plot_run(run.root, run.root / "progress.png"))
    (run.root / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


