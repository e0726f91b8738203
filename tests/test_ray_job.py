"""`stepline run --ray` on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster), the shortened
main job on the tiny model: two engine replicas, two gateways (one replica each), two rollout workers, the
trainer as one actor, a PostgreSQL pool. Slow (several minutes); run with: pytest -m slow tests/test_ray_job.py
(needs `stepline[ray]` and STEPLINE_PG_URL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SHORT_JOB = {  # the shortened main job of tests/e2e/conftest.py
    "rl_updates": 2, "model.kind": "tiny", "model.hidden_size": 32, "model.num_layers": 1,
    "sft.demos_per_harness": 2, "sft.trainer": {"epochs": 2, "groups_per_update": 6, "lr": 3e-3, "tensorboard": False},
    "trainer.groups_per_update": 2, "trainer.minibatches": 1, "trainer.micro_batch_episodes": 4,
    "trainer.dynamic_sampling": False,
    "rollout.group_size": 2, "rollout.max_concurrency": 4, "eval.limit": 1, "services.engine_threads": 1,
}
CLUSTER = {"cluster.engines": 2, "cluster.gateways": 2, "cluster.rollout_workers": 2}


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


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_job_on_two_node_ray_cluster(tmp_path: Path, pg_schema_url: str) -> None:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from datapool import open_pool

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STEPLINE_PG_URL": pg_schema_url}
        argv = [sys.executable, "-m", "stepline.cli", "run", str(short_job(tmp_path)), "--ray",
                "--ray-address", cluster.address, *_set({**SHORT_JOB, **CLUSTER})]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        cluster.shutdown()
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "cluster.json").read_text())
    # every gateway served calls (each fronts its own replica, so each replica served them too) and stamps v2
    assert len(report["gateways"]) == 2 and all(g["calls"] > 0 for g in report["gateways"]), report
    assert [g["weight_version"] for g in report["gateways"]] == [2, 2]
    # the weights of the last update reached both replicas
    assert len(report["engines"]) == 2
    assert all(str(e["weight_version"]) == "2" and e["model_path"].endswith("v000002") for e in report["engines"])
    rows = json.loads((run_dir / "rl" / "rollouts.json").read_text())
    assert {r["worker"] for r in rows} == {0, 1}  # both rollout workers played episodes
    pool = open_pool(pg_schema_url, read_only=True)
    try:
        stats = pool.stats()
        assert stats["groups_consumed"] >= 2 * 2 and stats["groups_claimed"] == 0
        sessions = [s for s in pool.list_sessions() if s.purpose != "eval"]
        # versions follow the pushes: training calls were served by versions 0..2, and nothing newer
        versions = {n.weight_version for s in sessions for n in pool.get_tree(s.session_id).nodes if n.kind == "act"}
        assert 0 in versions and versions <= {0, 1, 2}
    finally:
        pool.close()
    # no group trained twice: the updates trained 2 groups each, and no more groups than the pool handed
    # out once each (groups are keyed by id in the pool; a group trained twice would count twice here)
    metrics = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["groups"] for m in metrics] == [2, 2]
    assert sum(m["groups"] for m in metrics) <= stats["groups_consumed"]
