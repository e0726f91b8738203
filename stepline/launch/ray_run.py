"""`stepline run JOB.toml --ray [--ray-address ADDR]`: the same job, its parts placed on a Ray cluster.

    model + SFT warm start (here, on the driver) → engines (N replicas) → gateways (each fronting its share
    of the engines, all writing to one PostgreSQL pool) → evaluate (before, through gateway 0)
    → RL: rollout workers (actors, worker i against gateway i mod G) + the trainer ranks (one actor each,
    data parallel; rank 0 claims and pushes weights to every gateway) → evaluate (after) → cluster report, plot + summary

Ray places the parts (SPREAD over the nodes, each with its `[cluster]` resources) and carries URLs between
them; every part is the process or loop it is on one machine (stepline/launch/ray_parts.py). Without an address a
local Ray instance starts. The run directory must be on a file system every node sees (weights travel
through it, as on one machine). Faults: an engine replica's actor restarts its process; a lost rollout
worker's open sessions end as failed with the reason (`Lost`). Not wired yet: FSDP sharding, the NCCL weight
path, restarting a gateway, a rollout worker or a trainer rank.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from stepline.launch.job import JobConfig, JobError, PartResources
from stepline.launch.phases import (
    RunDir,
    evaluate_once,
    rl_seconds_left,
    save_cut_calls,
    save_rollouts,
    warm_started,
    write_summary,
)
from stepline.launch.wiring import ProcessSpec, job_system, processes

__all__ = ["run_ray_job"]

_ROOT = Path(__file__).resolve().parents[1]  # the checkout the driver runs; the workers import the same code


@dataclass
class Placed:
    """The service actors of one run and their URLs (engines[i] belongs to gateway i // per_gateway)."""

    engines: list[Any] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    gateways: list[Any] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)
    lost_workers: list[int] = field(default_factory=list)  # rollout workers lost during the job


def run_ray_job(cfg: JobConfig, address: str | None) -> dict[str, Any]:
    """The main job on Ray; returns the summary (run_dir/summary.json) with the cluster report added."""
    import ray

    pool_url = cfg.cluster.pool_url or os.environ.get("STEPLINE_PG_URL")
    if not pool_url or not pool_url.startswith("postgresql://"):
        raise JobError("stepline run --ray needs a PostgreSQL pool: set cluster.pool_url or STEPLINE_PG_URL")
    run, rl_cfg, policy = warm_started(cfg)
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": str(_ROOT)}}, log_to_driver=False,
             namespace=cfg.cluster.namespace)
    token = secrets.token_urlsafe(16)
    try:
        from stepline.launch.ray_parts import TrainerPart

        # the trainer's process starts now: its imports (seconds to minutes on a busy machine) overlap
        # the services' start and the first evaluation instead of delaying the first update
        trainers = [actor(TrainerPart, f"stepline-trainer-{r}", cfg.cluster.trainer).remote(r, cfg.cluster.trainers)
                    for r in range(cfg.cluster.trainers)]
        with placed_services(cfg, run, policy, token, pool_url) as placed:
            url = placed.gateway_urls[0]
            rl_cfg = rl_cfg.model_copy(update={"model_dir": policy, "gateway_url": url, "admin_token": token})
            with run.phase("eval_before"):
                evaluate_once(cfg, run, url, token, "before")
            rl_cfg = rl_cfg.model_copy(update={"max_seconds": rl_seconds_left(cfg, run)})  # SFT and eval now counted
            with run.phase("rl"):
                updates = train_on_ray(cfg, run, rl_cfg, placed, pool_url, trainers)
            with run.phase("eval_after"):
                evaluate_once(cfg, run, url, token, f"after-{updates}")
            report = cluster_report(placed, run)
    finally:
        ray.shutdown()
    (run.root / "cluster.json").write_text(json.dumps(report, indent=1))
    summary = write_summary(cfg, run)
    summary["cluster"] = report
    return summary


def actor(cls: type, name: str, part: PartResources) -> Any:
    """`ray.remote(cls)` with the part's resources, spread over the nodes."""
    import ray

    return ray.remote(cls).options(name=name, num_cpus=part.num_cpus, num_gpus=part.num_gpus,
                                   resources=dict(part.resources), scheduling_strategy="SPREAD")


def cluster_processes(cfg: JobConfig, run: RunDir, policy: Path, pool_url: str) -> list[ProcessSpec]:
    """The job's processes on the cluster (stepline.launch.wiring, with the [cluster] table's counts)."""
    try:
        return processes(job_system(cfg, policy, pool_url, run.root, cfg.cluster))
    except ValueError as exc:
        raise JobError(str(exc)) from None


@contextmanager
def placed_services(cfg: JobConfig, run: RunDir, policy: Path, token: str, pool_url: str) -> Iterator[Placed]:
    """Engine replicas, then the gateways over them; on exit gateways stop first (they flush), then engines."""
    import ray

    from stepline.launch.ray_parts import ServicePart
    from stepline.launch.services import engine_token

    c, placed = cfg.cluster, Placed()
    secrets = {"STEPLINE_ENGINE_TOKEN": engine_token()}
    values = {"admin_token": token, "engine_token": secrets["STEPLINE_ENGINE_TOKEN"]}
    timeout = cfg.services.startup_timeout_s
    specs = cluster_processes(cfg, run, policy, pool_url)

    def place(spec: ProcessSpec, part: PartResources, restarts: int = 0) -> Any:
        argv, env = spec.filled(values)
        return actor(ServicePart, f"stepline-{spec.role}-{spec.index}", part).remote(
            spec.name, argv, run.logs, {**secrets, **env}, restarts=restarts)

    try:
        engines = [s for s in specs if s.role == "engine"]
        placed.engines = [place(s, c.engine, c.engine_restarts) for s in engines]
        placed.engine_urls = ray.get([e.start.remote(timeout) for e in placed.engines])
        values |= {f"url:{s.name}": url for s, url in zip(engines, placed.engine_urls, strict=True)}
        placed.gateways = [place(s, c.gateway) for s in specs if s.role == "gateway"]
        placed.gateway_urls = ray.get([g.start.remote(timeout) for g in placed.gateways])
        yield placed
    finally:
        for group in (placed.gateways, placed.engines):
            ray.get([part.stop.remote() for part in group])
            for part in group:
                ray.kill(part)


def train_on_ray(cfg: JobConfig, run: RunDir, tcfg: Any, placed: Placed, pool_url: str, trainers: list[Any]) -> int:
    """Rollout workers (actors) and the trainer ranks (one actor each) until rl_updates updates are done or the
    time bound ends them; returns the updates done."""
    import ray

    from stepline.launch.ray_parts import RolloutPart
    from stepline.rollout.pacing import Pacing

    if cfg.rl_updates == 0:
        return 0
    c = cfg.cluster
    share = -(-tcfg.groups_per_update // c.rollout_workers)  # each worker's groups per batch (ceil)
    pacing = Pacing(share, cfg.groups_ahead, cfg.rl_updates * cfg.max_batches_per_update, peers=c.rollout_workers)
    workers = [actor(RolloutPart, f"stepline-rollout-{i}", c.rollout).remote(
        i, cfg.rollout.model_copy(update={"seed": cfg.rollout.seed + i}), placed.gateway_urls[i % c.gateways],
        tcfg.admin_token, run.root / "episodes" / f"worker-{i}", pool_url, pacing) for i in range(c.rollout_workers)]
    rows: list[dict[str, Any]] = []
    lost = Lost(workers, placed, tcfg.admin_token, pool_url)
    try:
        ray.get([w.start.remote() for w in workers])
        init = ray.get(trainers[0].rendezvous.remote())
        training = [t.train.remote(tcfg, init, pool_url, placed.gateway_urls, tcfg.admin_token, workers)
                    for t in trainers]
        while len(ray.wait(training, num_returns=len(training), timeout=2.0)[0]) < len(training):
            lost.check()
        return int(ray.get(training)[0]["update"])
    finally:
        errors = []
        for i, w in enumerate(workers):
            try:
                history, error = ([], None) if i in lost.rows else ray.get(w.finish.remote())
            except ray.exceptions.RayActorError as exc:
                lost.end(i, type(exc).__name__)
                history, error = [], None
            rows += [{**r, "worker": i} for r in history + lost.rows.get(i, [])]
            if error:
                errors.append(f"rollout worker {i}: {error}")
        save_rollouts(run.rl / "rollouts.json", rows)
        for part in (*workers, *trainers):
            ray.kill(part)
    if len(placed.lost_workers) == len(workers):
        errors.append("every rollout worker was lost")
    if errors:
        raise click.ClickException("; ".join(errors))


class Lost:
    """Watches the rollout workers while the trainer runs: a lost one's open sessions end as failed at once (so
    its unfinished groups complete and are never trained), and the others count a larger share of the pool."""

    def __init__(self, workers: list[Any], placed: Placed, admin_token: str, pool_url: str) -> None:
        self.workers, self.placed, self.admin_token, self.pool_url = workers, placed, admin_token, pool_url
        self.rows: dict[int, list[dict[str, Any]]] = {}  # lost worker -> its episodes ended as failed

    def check(self) -> None:
        import ray

        for i, w in enumerate(self.workers):
            if i in self.rows:
                continue
            try:
                ray.get(w.running.remote(), timeout=30)
            except ray.exceptions.RayActorError as exc:
                self.end(i, type(exc).__name__)
            except ray.exceptions.GetTimeoutError:
                continue

    def end(self, worker: int, cause: str) -> None:
        import ray

        self.placed.lost_workers.append(worker)
        gateway = self.placed.gateway_urls[worker % len(self.placed.gateway_urls)]
        self.rows[worker] = end_lost_sessions(gateway, self.admin_token, self.pool_url, worker, cause)
        alive = [w for i, w in enumerate(self.workers) if i not in self.rows]
        for w in alive:
            try:
                ray.get(w.set_peers.remote(len(alive)), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # found lost at the next check


def end_lost_sessions(gateway: str, admin_token: str, pool_url: str, worker: int, cause: str) -> list[dict[str, Any]]:
    """A lost rollout worker's open sessions end as failed (through its gateway, so later calls of an orphaned
    harness get 409), each an episode row with the reason; the groups they belong to never train."""
    import httpx

    from stepline.datapool import open_pool
    from stepline.launch.ray_parts import WORKER_KEY

    pool = open_pool(pool_url, read_only=True)
    try:
        lost = [s for s in pool.list_sessions(status="open") if s.metadata.get(WORKER_KEY) == worker]
    finally:
        pool.close()
    reason = f"rollout worker {worker} lost ({cause}) while the episode ran"
    rows = []
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30.0) as http:
        for s in lost:
            answer = http.post(f"/sessions/{s.session_id}/end", json={"status": "failed"})
            ended = reason if answer.status_code < 400 else f"{reason}; ending it: HTTP {answer.status_code}"
            rows.append({"harness": s.harness, "task_id": s.task_id, "session_id": s.session_id, "status": "failed",
                         "reward": None, "success": False, "reason": ended, "attempt": s.metadata.get("attempt", 0)})
    return rows


_CALLS = re.compile(r"^stepline_gateway_calls_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def cluster_report(placed: Placed, run: RunDir) -> dict[str, Any]:
    """What each part did, read from the parts themselves: calls per gateway (its /metrics), the weight
    version each gateway stamps (/health) and each engine serves (/get_model_info), and each trainer rank's
    updates, forwarded episodes and parameter digest (rl/ranks.json, written by rank 0 with several ranks)."""
    import ray

    gateways, texts = [], []
    for url, part in zip(placed.gateway_urls, placed.gateways, strict=True):
        (_, metrics), (_, health) = ray.get([part.get.remote("/metrics"), part.get.remote("/health")])
        gateways.append({"url": url, "calls": sum(float(v) for v in _CALLS.findall(metrics)),
                         "weight_version": json.loads(health)["weight_version"]})
        texts.append(metrics)
    engines = []
    for url, part in zip(placed.engine_urls, placed.engines, strict=True):
        (status, body), restarts = ray.get([part.get.remote("/get_model_info"), part.restarts_done.remote()])
        engines.append({"url": url, "restarts": restarts, **(json.loads(body) if status == 200 else {"status": status})})
    ranks = run.rl / "ranks.json"
    trainers = json.loads(ranks.read_text()) if ranks.exists() else []
    save_cut_calls(run, texts)  # the summary's calls cut by weight updates
    return {"gateways": gateways, "engines": engines, "trainers": trainers, "lost_rollout_workers": placed.lost_workers}
