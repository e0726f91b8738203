"""`stepline train`, `stepline replay` and `stepline eval`: one part of the system from a job file.

They read the job file through `stepline.launch.job.load_job`, as `stepline run` does (one schema, one error
format: "invalid job file F:\n  trainer.lr: ..."), and use the tables they need:

    [trainer]                        train, replay (`TrainerConfig`; model_dir and output_dir relative to the file)
    model_dir = "runs/model"
    max_updates = 100
    [pool]                           train (replay takes --pool FILE)
    url = "sqlite:///runs/pool.db"
    [[rollout.harnesses]]            eval

The gateway's admin token may come from the environment (STEPLINE_ADMIN_TOKEN) instead of the file.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import click

from stepline.launch.job import JobConfig, JobError, load_job, trainer_config
from stepline.modeldir import BUILD_HINT
from stepline.trainer.config import TrainerConfig

__all__ = ["eval_command", "replay_command", "train_command"]


def _job(path: Path) -> JobConfig:
    try:
        return load_job(path)
    except JobError as exc:
        raise click.ClickException(str(exc)) from exc


def _trainer(job: JobConfig, path: Path) -> TrainerConfig:
    """The job's whole TrainerConfig (the admin token defaults to $STEPLINE_ADMIN_TOKEN); a job without a
    [trainer] model_dir (one made for `stepline run`, which fills it in) is told what it needs."""
    if "model_dir" not in job.trainer:
        raise click.ClickException(
            f"invalid job file {path}:\n  trainer.model_dir: not set; `stepline train` and `replay` need the model to "
            f"train (`stepline run` fills it in): {BUILD_HINT}, then set [trainer] model_dir = \"DIR\"")
    table = {"admin_token": os.environ.get("STEPLINE_ADMIN_TOKEN"), **job.trainer}
    try:
        return trainer_config(table, source=f"job file {path}")
    except JobError as exc:
        raise click.ClickException(str(exc)) from exc


def _quiet_hf() -> None:
    """HF's own progress bars (loading, saving shards) would tear through the trainer's live bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@click.command("train")
@click.argument("job", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def train_command(job: Path) -> None:
    """Train on the episodes agents record into JOB.toml's [pool] (through a gateway: `stepline up`).

    It runs no rollouts of its own: it claims complete groups as they arrive, updates the policy from
    [trainer] model_dir, and pushes each new policy to [trainer] gateway_url (none: weights stay on disk)."""
    from stepline.datapool import open_pool
    from stepline.trainer.loop import train
    from stepline.trainer.weight_sync import GatewayWeightSync, NoWeightSync

    spec = _job(job)
    cfg = _trainer(spec, job)
    _quiet_hf()
    pool = open_pool(spec.pool.url)
    sync = GatewayWeightSync(cfg.gateway_url, cfg.admin_token) if cfg.gateway_url else NoWeightSync()
    try:
        state = train(cfg, pool, sync)
    finally:
        sync.close()
        pool.close()
    click.echo(f"trained {state.update} updates; policy version {state.version}; output in {cfg.output_dir}")


@click.command("replay")
@click.argument("job", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--pool", "pool_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a stored SQLite pool or an exported pool file")
def replay_command(job: Path, pool_file: Path) -> None:
    """Train offline from a stored or exported pool (no engine, no staleness bound; stops when it is used up).

    A SQLite pool is copied into the output folder first, so the stored pool is never modified and a
    restarted replay continues where it stopped."""
    from stepline.datapool import replay_pool
    from stepline.trainer.loop import train
    from stepline.trainer.weight_sync import NoWeightSync

    cfg = _trainer(_job(job), job)
    _quiet_hf()
    pool = replay_pool(pool_file, cfg.output_dir)
    try:
        state = train(cfg, pool, NoWeightSync(), offline=True)
    finally:
        pool.close()
    click.echo(f"replayed {len(state.consumed)} groups in {state.update} updates; output in {cfg.output_dir}")


def _reachable(gateway_url: str) -> None:
    """A gateway that cannot be reached stops `eval` before any episode runs, naming the URL."""
    import httpx

    try:
        httpx.get(f"{gateway_url.rstrip('/')}/health", timeout=10)
    except httpx.TransportError as exc:
        raise click.ClickException(f"--gateway {gateway_url}: no gateway answers there ({exc}); start one with "
                                   "`stepline up --model DIR`") from exc


@click.command("eval")
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--gateway", "gateway_url", default=lambda: os.environ.get("STEPLINE_GATEWAY_URL"),
              help="Gateway base URL (a running `stepline up`) [env STEPLINE_GATEWAY_URL].")
@click.option("--admin-token", default=lambda: os.environ.get("STEPLINE_ADMIN_TOKEN"),
              help="Admin token of the gateway [env STEPLINE_ADMIN_TOKEN].")
@click.option("--split", type=click.Choice(["train", "test"]), default="test", show_default=True)
@click.option("--limit", type=click.IntRange(1), default=None, help="At most this many tasks per harness.")
@click.option("--temperature", type=click.FloatRange(0, 2), default=None,
              help="Sampling temperature of every call, whatever the harness asks (0: greedy; default: the job's "
                   "[rollout] temperature, else the harness's own).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), default=Path("eval.json"),
              show_default=True, help="Where the JSON report goes.")
def eval_command(job_file: Path, gateway_url: str | None, admin_token: str | None, split: str, limit: int | None,
                 temperature: float | None, out_file: Path) -> None:
    """Success per harness on the test split, through the current policy."""
    from stepline.rollout.driver import format_stats
    from stepline.rollout.evaluate import evaluate

    if not gateway_url:
        raise click.UsageError("no gateway: pass --gateway URL (start one with `stepline up`)")
    config = _job(job_file).rollout
    if not config.harnesses:
        raise click.UsageError(f"{job_file} has no [[rollout.harnesses]]")
    _reachable(gateway_url)
    report = asyncio.run(evaluate(config, gateway_url, admin_token, split, limit, temperature))
    out_file.write_text(json.dumps(report, indent=1))
    click.echo(format_stats(report["harnesses"]))
    click.echo(f"weight version {report['weight_version']}; report written to {out_file}")
