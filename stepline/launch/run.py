"""`stepline run JOB.toml`: the whole loop on one machine, the README's main command.

    build the model → SFT warm start on expert demos → start engine + gateway → evaluate (before)
    → RL: harnesses roll out through the gateway while the trainer updates and pushes weights
    → evaluate (after) → plot + summary

The phases it shares with `stepline run --ray` (run directory, model, SFT, evaluation, summary) are
stepline/launch/phases.py; each leaves its result in the run directory and is skipped when it is already
there, so a job stopped with Ctrl-C starts again where it stopped (the trainer resumes from its last checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from stepline.launch.job import JobConfig, JobError, load_job, unused_by_run
from stepline.launch.phases import (
    RunDir,
    evaluate_once,
    rl_seconds_left,
    save_cut_calls,
    save_rollouts,
    warm_started,
    write_summary,
)
from stepline.launch.services import Services
from stepline.launch.wiring import job_system, processes, start_local

if TYPE_CHECKING:
    from stepline.trainer.config import TrainerConfig

__all__ = ["run_command", "run_job"]

log = logging.getLogger("stepline.launch.run")



def run_job(cfg: JobConfig) -> dict[str, Any]:
    """The main job; returns the summary (also written to run_dir/summary.json)."""
    run, rl_cfg, policy = warm_started(cfg)
    token = secrets.token_urlsafe(16)
    with services(cfg, run, policy, token) as gateway_url:
        rl_cfg = rl_cfg.model_copy(update={"model_dir": policy, "gateway_url": gateway_url, "admin_token": token})
        with run.phase("eval_before"):
            evaluate_once(cfg, run, gateway_url, token, "before")
        rl_cfg = rl_cfg.model_copy(update={"max_seconds": rl_seconds_left(cfg, run)})  # SFT and eval now counted
        with run.phase("rl"):
            updates = train_rl(cfg, run, rl_cfg)
        with run.phase("eval_after"):
            evaluate_once(cfg, run, gateway_url, token, f"after-{updates}")
        save_cut_calls(run, [gateway_metrics(gateway_url)])
    return write_summary(cfg, run)


def gateway_metrics(url: str) -> str:
    """The gateway's /metrics text ("" when it does not answer: the summary then counts nothing of it)."""
    import httpx

    try:
        return httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""



@contextmanager
def services(cfg: JobConfig, run: RunDir, policy: Path, token: str) -> Iterator[str]:
    """The job's processes on this machine (stepline.launch.wiring: the engine, unless the job names a running one,
    and the gateway); yields the gateway URL (run_dir/services.json names both while they run)."""
    try:
        specs = processes(job_system(cfg, policy, f"sqlite:///{run.pool_db}", run.root))
    except ValueError as exc:  # an engine the job cannot start (SGLang without --ray, vLLM without its python)
        raise JobError(str(exc)) from None
    with Services(run.logs, cfg.services.startup_timeout_s) as children:
        urls = start_local(children, specs, {"admin_token": token})  # tokens in the environment: ps shows argv
        engine = urls.get("engine", cfg.services.engine_url)
        (run.root / "services.json").write_text(json.dumps({"engine": engine, "engine_kind": cfg.services.engine_kind,
                                                            "gateway": urls["gateway"]}, indent=1))
        yield urls["gateway"]


FLOAT32_QUICKSTART_MINUTES = 75  # the quickstart's whole job, 40 updates, float32 on a 2-core AVX2 EPYC: 73.4 min


def slow_cpu_note(cfg: JobConfig) -> str | None:
    """A word before a job bounded by less than the quickstart needs on a CPU without bf16 units: in float32 its
    SFT and evaluations take ~20 min and an update ~80 s, so RL fits few updates (docs/results.md: The main job)."""
    import torch

    from stepline.trainer.precision import bf16_units

    if (cfg.job_minutes is None or cfg.job_minutes >= FLOAT32_QUICKSTART_MINUTES or torch.cuda.is_available()
            or bf16_units(torch.device("cpu"))):
        return None
    return (f"this CPU has no bf16 units (AVX512-BF16 or AMX): in float32 the quickstart's SFT and its two evaluations "
            f"took 20 min on a 2-core AVX2 EPYC (7 on AMX) and an RL update 80 s (33), so job_minutes = "
            f"{cfg.job_minutes:g} leaves RL few updates; with its 40 updates it took 73 min in all "
            f"(--set job_minutes={FLOAT32_QUICKSTART_MINUTES})")


def train_rl(cfg: JobConfig, run: RunDir, tcfg: TrainerConfig) -> int:
    """Rollouts in a background thread, the trainer in this one, until rl_updates updates are done or the
    time bound ends them; returns the updates done."""
    from stepline.datapool import open_pool
    from stepline.launch.progress import RLProgress
    from stepline.rollout.pacing import BackgroundRollouts, Pacing
    from stepline.trainer.loop import train
    from stepline.trainer.weight_sync import GatewayWeightSync

    if cfg.rl_updates == 0:
        return 0
    pool = open_pool(f"sqlite:///{run.pool_db}")
    sync = GatewayWeightSync(tcfg.gateway_url, tcfg.admin_token)
    pacing = Pacing(tcfg.groups_per_update, cfg.groups_ahead, cfg.rl_updates * cfg.max_batches_per_update)
    rollouts = BackgroundRollouts(cfg.rollout, tcfg.gateway_url, tcfg.admin_token, run.root / "episodes", pool, pacing)
    try:
        with RLProgress(run.rl / "metrics.jsonl", rollouts, cfg.rl_updates):
            rollouts.start()
            state = train(tcfg, pool, sync, producing=rollouts.running)  # a slow first batch is no reason to stop
        if rollouts.error is not None:
            raise click.ClickException(f"the rollout driver failed: {rollouts.error!r}")
        return state.update
    finally:
        rollouts.stop()
        save_rollouts(run.rl / "rollouts.json", rollouts.history)
        sync.close()
        pool.close()



def _overrides(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r}: expected key=value", param_hint="--set")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value  # a bare string
    return out


@click.command("run")
@click.argument("job", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a job field, e.g. --set rl_updates=2 --set run_dir=runs/x (TOML values).")
@click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve `stepline dashboard` of the run on 127.0.0.1 at this port (0: a free one).")
@click.option("--ray", "on_ray", is_flag=True,
              help="Place the job's parts on a Ray cluster ([cluster] table; needs the stepline[ray] extra).")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="Ray cluster to join, e.g. 10.0.0.1:6379 or auto (default: start a local Ray instance).")
def run_command(job: Path, overrides: tuple[str, ...], dashboard_port: int | None, on_ray: bool,
                ray_address: str | None) -> None:
    """Run a whole job: model, SFT warm start, services, RL, evaluation, plot and summary."""
    from transformers.utils import logging as hf_logging

    from stepline.report import format_summary

    logging.basicConfig(level=os.environ.get("STEPLINE_LOG", "WARNING"))
    # `kill` (SIGTERM) stops the job as Ctrl-C does: services stopped, rollout history saved, resumable
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    hf_logging.disable_progress_bar()  # HF's loading/saving bars would tear through the live panel
    from stepline.dashboard.cli import dashboard_beside

    if ray_address and not on_ray:
        raise click.UsageError("--ray-address needs --ray")
    if on_ray:
        try:
            import ray  # noqa: F401

            from stepline.launch.ray_run import run_ray_job
        except ImportError as exc:
            raise click.ClickException("--ray needs Ray: pip install 'stepline[ray]'") from exc

    try:
        cfg = load_job(job, _overrides(overrides))
        for note in [*unused_by_run(cfg, on_ray), None if on_ray else slow_cpu_note(cfg)]:  # --ray: not this CPU
            if note:
                click.echo(f"note: {note}", err=True)
        with dashboard_beside([str(cfg.run_dir)], dashboard_port, cfg.run_dir / "logs"):
            summary = run_ray_job(cfg, ray_address) if on_ray else run_job(cfg)
    except JobError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_summary(summary))
