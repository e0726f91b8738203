"""`stepline train JOB.toml` and `stepline replay JOB.toml --pool FILE`.

The job file here is small on purpose: a [trainer] table (`TrainerConfig`) and a [pool] table with the
pool's `url`; the full job config (rollouts, services) is composed by the `stepline` package.

    [trainer]
    model_dir = "runs/model"
    max_updates = 100
    [pool]
    url = "sqlite:///runs/pool.db"

Relative paths in [trainer] are resolved against the job file's folder. The admin token may come from
the environment (STEPLINE_ADMIN_TOKEN) instead of the file.
"""

from __future__ import annotations

import os
import sqlite3
import tomllib
from contextlib import closing
from pathlib import Path

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.config import TrainerConfig

__all__ = ["TrainJob", "load_job", "replay_command", "train_command"]

SQLITE_MAGIC = b"SQLite format 3\x00"


class PoolSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field("sqlite:///pool.db", description="pool URL: sqlite:///…, postgresql://…, http://…")


class TrainJob(BaseModel):
    """The part of a job file the trainer reads (other tables are left to their owners)."""

    model_config = ConfigDict(extra="ignore")
    trainer: TrainerConfig
    pool: PoolSection = PoolSection()


def load_job(path: Path) -> TrainJob:
    """Parse and check a job file; errors name the table and field (e.g. `trainer.max_staleness`)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"cannot read job file {path}: {exc}") from exc
    table = raw.setdefault("trainer", {})
    for key in ("model_dir", "output_dir"):
        if key in table and not Path(table[key]).is_absolute():
            table[key] = str(Path(path).resolve().parent / table[key])
    table.setdefault("admin_token", os.environ.get("STEPLINE_ADMIN_TOKEN"))
    try:
        return TrainJob.model_validate(raw)
    except ValidationError as exc:
        raise click.ClickException(_explain(path, exc)) from exc


def _explain(path: Path, exc: ValidationError) -> str:
    lines = [f"invalid job file {path}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def _quiet_hf() -> None:
    """HF's own progress bars (loading, saving shards) would tear through the trainer's live bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _sync(cfg: TrainerConfig):
    from trainer.weight_sync import GatewayWeightSync, NoWeightSync

    return GatewayWeightSync(cfg.gateway_url, cfg.admin_token) if cfg.gateway_url else NoWeightSync()


@click.command("train")
@click.argument("job", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def train_command(job: Path) -> None:
    """Train from JOB.toml against the pool in its [pool] table (rollouts run elsewhere, into that pool)."""
    from datapool import open_pool
    from trainer.loop import train

    spec = load_job(job)
    _quiet_hf()
    pool = open_pool(spec.pool.url)
    sync = _sync(spec.trainer)
    try:
        state = train(spec.trainer, pool, sync)
    finally:
        sync.close()
        pool.close()
    click.echo(f"trained {state.update} updates; policy version {state.version}; output in {spec.trainer.output_dir}")


@click.command("replay")
@click.argument("job", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--pool", "pool_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a stored SQLite pool or an exported pool file")
def replay_command(job: Path, pool_file: Path) -> None:
    """Train offline from a stored or exported pool (no engine, no staleness bound; stops when it is used up).

    A SQLite pool is copied into the output folder first, so the stored pool is never modified and a
    restarted replay continues where it stopped."""
    from datapool import open_pool
    from trainer.loop import train
    from trainer.weight_sync import NoWeightSync

    spec = load_job(job)
    _quiet_hf()
    url, fresh = _replay_url(pool_file, spec.trainer.output_dir)
    pool = open_pool(url)
    if fresh:  # the stored run consumed its groups; its copy hands every group out again
        pool.reset_claims()
    try:
        state = train(spec.trainer, pool, NoWeightSync(), offline=True)
    finally:
        pool.close()
    click.echo(f"replayed {len(state.consumed)} groups in {state.update} updates; output in {spec.trainer.output_dir}")


def _replay_url(pool_file: Path, output_dir: Path) -> tuple[str, bool]:
    """(URL of the pool to replay, whether it is a fresh copy whose claims should be reset)."""
    with open(pool_file, "rb") as f:
        is_sqlite = f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    if not is_sqlite:
        return str(pool_file), True  # an export file: loaded in memory, claims not persisted
    copy = Path(output_dir) / "replay-pool.db"
    fresh = not copy.exists()
    if fresh:
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_suffix(".tmp")
        # SQLite's backup API: a consistent copy, including commits still in the source's WAL
        with closing(sqlite3.connect(f"file:{pool_file}?mode=ro", uri=True)) as src, \
                closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
        tmp.rename(copy)
    return f"sqlite:///{copy.resolve()}", fresh
