"""`stepline run --ray` on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster), the shortened
main job on the tiny model: two engine replicas, two gateways (one replica each), two rollout workers, two
data-parallel trainer ranks (gloo), a PostgreSQL pool; mid-job, rollout worker 0 and engine replica 1 are killed. Slow (several minutes); run with: pytest -m slow tests/test_ray_job.py
(needs `stepline[ray]` and STEPLINE_PG_URL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SHORT_JOB = {  # the shortened main job of tests/e2e/conftest.py
    "rl_updates": 2, "model.kind": "tiny", "model.hidden_size": 32, "model.num_layers": 1,
    "sft.demos_per_harness": 2, "sft.demos": {}, "sft.trainer": {"epochs": 2, "groups_per_update": 6, "lr": 3e-3, "tensorboard": False},
    "trainer.groups_per_update": 2, "trainer.minibatches": 1, "trainer.micro_batch_episodes": 4,
    "trainer.dynamic_sampling": False,
    "rollout.group_size": 2, "rollout.harnesses.2.group_size": 2, "rollout.max_concurrency": 4, "eval.limit": 1, "services.engine_threads": 1,
}
CLUSTER = {"cluster.engines": 2, "cluster.gateways": 2, "cluster.rollout_workers": 2, "cluster.trainers": 2,
           # the surviving worker's episodes fail while its engine restarts (a minute or two on a busy machine):
           # room for more batches than the 3 per update of the shortened job
           "max_batches_per_update": 5}


def _toml(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # numbers, booleans and strings are spelled alike in JSON and TOML


def _set(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={_toml(value)}")]


def short_job(tmp_path: Path) -> Path:
    """quickstart.toml without its train_layers (the tiny model has one layer; TOML cannot say None)."""
    text = (ROOT / "examples" / "quickstart.toml").read_text().replace("train_layers = 10\n", "")
    path = tmp_path / "job.toml"
    path.write_text(text.replace('run_dir = "../runs/quickstart"', 'run_dir = "run"'))
    return path


@pytest.fixture
def pg_schema_url() -> object:
    psycopg = pytest.importorskip("psycopg")
    base = os.environ.get("STEPLINE_PG_URL") or pytest.skip("needs STEPLINE_PG_URL (a PostgreSQL server)")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def kill_mid_job(address: str, namespace: str, pool_url: str, job: subprocess.Popen, timeout: float = 600) -> None:
    """Once rollout worker 0 has an episode in flight (an open session of its own in the pool): kill that worker's
    actor (ray.kill) and engine replica 1's process (SIGKILL of the pid its actor started)."""
    import ray

    deadline = time.monotonic() + timeout
    while not worker_zero_is_playing(pool_url):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before rollout worker 0 played"
        time.sleep(0.5)
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    try:
        ray.kill(ray.get_actor("stepline-rollout-0"))
        os.kill(ray.get(ray.get_actor("stepline-engine-1").pid.remote()), signal.SIGKILL)
    finally:
        ray.shutdown()


def worker_zero_is_playing(pool_url: str) -> bool:
    from stepline.datapool import open_pool

    try:
        pool = open_pool(pool_url, read_only=True)
    except Exception:  # noqa: BLE001  (the job has not created the pool's tables yet)
        return False
    try:
        return any(s.metadata.get("rollout_worker") == 0 for s in pool.list_sessions(status="open"))
    except Exception:  # noqa: BLE001
        return False
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_job_on_two_node_ray_cluster(tmp_path: Path, pg_schema_url: str) -> None:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from stepline.datapool import open_pool
    from stepline.trainer.checkpoint import latest_checkpoint

    namespace = f"stepline-test-{uuid.uuid4().hex[:8]}"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    out = tmp_path / "job.out"
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STEPLINE_PG_URL": pg_schema_url}
        argv = [sys.executable, "-m", "stepline.cli", "run", str(short_job(tmp_path)), "--ray",
                "--ray-address", cluster.address, *_set({**SHORT_JOB, **CLUSTER, "cluster.namespace": namespace})]
        with out.open("wb") as log:
            job = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                kill_mid_job(cluster.address, namespace, pg_schema_url, job)
                code = job.wait(timeout=1500)
            finally:
                if job.poll() is None:
                    job.kill()
        assert code == 0, out.read_text()[-6000:]
    finally:
        cluster.shutdown()
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "cluster.json").read_text())
    # every gateway served calls (each fronts its own replica, so each replica served them too) and stamps v2
    assert len(report["gateways"]) == 2 and all(g["calls"] > 0 for g in report["gateways"]), report
    assert [g["weight_version"] for g in report["gateways"]] == [2, 2]
    # the weights of the last update reached both replicas, the one restarted after its kill included
    # (its gateway loaded the current weights into it when it came back)
    assert len(report["engines"]) == 2 and [e["restarts"] for e in report["engines"]] == [0, 1], report
    assert all(str(e["weight_version"]) == "2" and e["model_path"].endswith("v000002") for e in report["engines"])
    # both trainer ranks took part in both updates (one of each update's two groups each), and their
    # parameters were bit-identical at the end
    ranks = report["trainers"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["updates"] for r in ranks] == [2, 2], ranks
    assert all(r["episodes"] > 0 for r in ranks) and ranks[0]["digest"] == ranks[1]["digest"], ranks
    rows = json.loads((run_dir / "rl" / "rollouts.json").read_text())
    assert {r["worker"] for r in rows} == {0, 1}  # both rollout workers played episodes
    # the killed worker: lost, its episodes in flight recorded as failed with the reason, and so in the pool
    assert report["lost_rollout_workers"] == [0]
    lost = [r for r in rows if r["worker"] == 0]
    assert lost and all(r["status"] == "failed" and "rollout worker 0 lost" in r["reason"] for r in lost), lost
    assert all(r["reason"] for r in rows if r["status"] == "failed")  # every failed episode says why
    pool = open_pool(pg_schema_url, read_only=True)
    try:
        assert {pool.get_session(r["session_id"]).status for r in lost} == {"failed"}
        stats = pool.stats()
        assert stats["groups_consumed"] >= 2 * 2 and stats["groups_claimed"] == 0
        sessions = [s for s in pool.list_sessions() if s.purpose != "eval"]
        # versions follow the pushes: training calls were served by versions 0..2, and nothing newer
        versions = {n.weight_version for s in sessions for n in pool.get_tree(s.session_id).nodes if n.kind == "act"}
        assert 0 in versions and versions <= {0, 1, 2}
    finally:
        pool.close()
    # no group trained twice: the updates trained 2 groups each, and no more groups than the pool handed
    # out once each (groups are keyed by id in the pool; a group trained twice would count twice here), and no
    # session is in two consumed groups
    metrics = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["groups"] for m in metrics] == [2, 2]
    assert sum(m["groups"] for m in metrics) <= stats["groups_consumed"]
    state = json.loads((latest_checkpoint(run_dir / "rl" / "checkpoints") / "state.json").read_text())
    trained = [sid for sids in state["consumed"].values() for sid in sids]
    assert len(trained) == len(set(trained))
