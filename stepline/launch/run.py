"""`stepline run JOB.toml`: the whole loop on one machine, the README's main command.

    build the model → SFT warm start on expert demos → start engine + gateway → evaluate (before)
    → RL: harnesses roll out through the gateway while the trainer updates and pushes weights
    → evaluate (after) → plot + summary

Every phase leaves its result in the run directory and is skipped when it is already there, so a job
stopped with Ctrl-C starts again where it stopped (the trainer resumes from its last checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from stepline.launch.job import JobConfig, JobError, ServicesSection, load_job, trainer_config, unused_by_run
from stepline.launch.services import Child, EngineSpec, GatewaySpec, Services, engine_token, free_port, port_of

if TYPE_CHECKING:
    from stepline.rollout.config import RolloutConfig
    from stepline.trainer.config import TrainerConfig

__all__ = ["run_command", "run_job"]

log = logging.getLogger("stepline.launch.run")


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
    return write_summary(cfg, run)


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
    from stepline.models import build_model

    if cfg.model.dir is not None:
        return cfg.model.dir
    if not (run.base_model / "config.json").is_file():
        m = cfg.model
        seed = cfg.seed if m.seed is None else m.seed
        build_model(run.base_model, kind=m.kind, seed=seed, hidden_size=m.hidden_size, num_layers=m.num_layers,
                    num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, tie_embeddings=not m.vllm_compatible)
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
                                    counts=cfg.sft.demos)
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


@contextmanager
def services(cfg: JobConfig, run: RunDir, policy: Path, token: str) -> Iterator[str]:
    """The engine (unless the job names a running one) and the gateway, as subprocesses; yields the gateway URL
    (run_dir/services.json names both while they run)."""
    with Services(run.logs, cfg.services.startup_timeout_s) as children:
        engine_url, kind = cfg.services.engine_url, cfg.services.engine_kind
        if engine_url is None and kind == "sglang":  # cluster.engine_command starts SGLang under --ray only
            raise JobError("services.engine_kind = sglang: without --ray the job needs services.engine_url of a "
                           "running SGLang server")
        if engine_url is None:
            engine_url = f"http://127.0.0.1:{free_port()}"
            children.wait(start_engine(children, cfg.services, policy, engine_url), engine_url)
        gateway_url = f"http://127.0.0.1:{free_port()}"
        gateway = GatewaySpec((engine_url,), policy, f"sqlite:///{run.pool_db}", port_of(gateway_url), kind,
                              spill=run.root / "stepline.gateway.spill")
        # the admin token in the environment: ps shows argv
        children.wait(children.start("gateway", gateway.to_argv(), {"STEPLINE_ADMIN_TOKEN": token}), gateway_url)
        (run.root / "services.json").write_text(json.dumps({"engine": engine_url, "engine_kind": kind,
                                                            "gateway": gateway_url}, indent=1))
        yield gateway_url


def start_engine(children: Services, svc: ServicesSection, policy: Path, url: str) -> Child:
    """The engine the job starts on its policy: the built-in one, or vLLM from its own environment."""
    from stepline.launch.vllm_server import vllm_argv, vllm_env, vllm_python

    if svc.engine_kind != "vllm":
        return children.start("engine", engine_spec(svc, policy, port_of(url)).to_argv())
    try:
        python = vllm_python(svc.vllm_python)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    argv = vllm_argv(python, policy, url, engine_dtype(svc), svc.context_length, svc.vllm_args)
    env = vllm_env(svc.engine_threads, engine_token(), svc.vllm_kv_cache_gib)
    return children.start("engine", [sys.executable, "-m", "stepline.launch.lifeline", *argv], env)


def engine_dtype(svc: ServicesSection) -> str:
    """float32 or bfloat16 (auto: bfloat16 where this CPU has bf16 units)."""
    import torch

    from stepline.trainer.precision import fast_bf16

    if svc.engine_dtype != "auto":
        return svc.engine_dtype
    return "bfloat16" if fast_bf16(torch.device("cpu")) else "float32"


def slow_cpu_note(cfg: JobConfig) -> str | None:
    """A word before a time-bounded job starts on a CPU without bf16 units: SFT and evaluation then take most of
    the bound (docs/results.md: The main job)."""
    import torch

    from stepline.trainer.precision import fast_bf16

    if cfg.job_minutes is None or torch.cuda.is_available() or fast_bf16(torch.device("cpu")):
        return None
    return (f"this CPU has no bf16 units (AVX512-BF16 or AMX): float32 runs at about a fifth of an AMX CPU's speed "
            f"(the quickstart's SFT: 9.7 min against 2.0) and bf16 slower still, so the warm start and the "
            f"evaluations take most of job_minutes = {cfg.job_minutes:g} and RL fits few updates")


def engine_spec(svc: ServicesSection, policy: Path, port: int | str, host: str | None = None) -> EngineSpec:
    """The built-in engine the job starts on its policy ([services] table)."""
    return EngineSpec(policy, port, host, svc.context_length, engine_dtype(svc), svc.prefix_cache_mb,
                      svc.engine_threads)


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


def train_rl(cfg: JobConfig, run: RunDir, tcfg: TrainerConfig) -> int:
    """Rollouts in a background thread, the trainer in this one, until rl_updates updates are done or the
    time bound ends them; returns the updates done."""
    from stepline.datapool import open_pool
    from stepline.launch.progress import RLProgress
    from stepline.rollout.pacing import BackgroundRollouts
    from stepline.trainer.loop import train
    from stepline.trainer.weight_sync import GatewayWeightSync

    if cfg.rl_updates == 0:
        return 0
    pool = open_pool(f"sqlite:///{run.pool_db}")
    sync = GatewayWeightSync(tcfg.gateway_url, tcfg.admin_token)
    rollouts = BackgroundRollouts(cfg.rollout, tcfg.gateway_url, tcfg.admin_token, run.root / "episodes", pool,
                                  batch_groups=tcfg.groups_per_update, ahead=cfg.groups_ahead,
                                  max_batches=cfg.rl_updates * cfg.max_batches_per_update)
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


def save_rollouts(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append this run's episodes to those a stopped run of the same job wrote (resume keeps history);
    batch numbers continue after the earlier run's."""
    earlier = json.loads(path.read_text()) if path.is_file() else []
    offset = 1 + max((r.get("batch", 0) for r in earlier), default=-1)
    path.write_text(json.dumps(earlier + [{**r, "batch": r.get("batch", 0) + offset} for r in rows], indent=1))


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
