"""The one wiring (stepline/launch/wiring.py): `up`, `run` and `run --ray` start the same processes for the same
settings, and each setting has one declaration whose default the command-line options show.

Nothing is started here: the specs are compared as built (Ray need not be installed: the Ray launcher's spec
function is `ray_run.cluster_processes`, which imports no ray).
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from stepline.engine.cli import engine_command
from stepline.engine.options import EngineOptions
from stepline.gateway.cli import gateway_command
from stepline.gateway.config import GatewaySettings
from stepline.launch.job import JobConfig, JobError, ServicesSection
from stepline.launch.phases import RunDir
from stepline.launch.ray_run import cluster_processes
from stepline.launch.up import up_command
from stepline.launch.wiring import job_system, processes, up_system

POOL = "postgresql://stepline@db/stepline"
SETTINGS = {"context_length": 512, "session_idle_timeout": 60.0, "engine_dtype": "bfloat16", "prefix_cache_mb": 8.0,
            "responses_truncated": "completed", "max_session_sequences": 8, "partial_rollouts": False}


def local_run_specs(cfg: JobConfig, run: RunDir, policy: Path, pool: str) -> list:
    """What `stepline run` builds (run.services), with the pool it would be given."""
    return processes(job_system(cfg, policy, pool, run.root))


def test_up_run_and_ray_build_the_same_processes_for_the_same_settings(tmp_path: Path) -> None:
    policy, run = tmp_path / "policy", RunDir(tmp_path / "run")
    cfg = JobConfig.model_validate({"services": SETTINGS})
    ran = local_run_specs(cfg, run, policy, POOL)
    on_ray = cluster_processes(cfg, run, policy, POOL)
    up = processes(up_system(ServicesSection(**SETTINGS), policy, run.root, POOL, serve_pool=False))
    assert ran == on_ray == up
    assert [s.name for s in ran] == ["engine", "gateway"]
    engine, gateway = (list(s.argv) for s in ran)
    # the job's settings reach both processes: the engine's limit and dtype, the gateway's limit and idle timeout
    assert engine[engine.index("--context-length") + 1] == "512" and engine[engine.index("--dtype") + 1] == "bfloat16"
    assert gateway[gateway.index("--context-length") + 1] == "512"
    assert gateway[gateway.index("--session-idle-timeout") + 1] == "60.0"
    assert gateway[gateway.index("--responses-truncated") + 1] == "completed"
    assert gateway[gateway.index("--max-session-sequences") + 1] == "8"
    assert "--no-partial-rollouts" in gateway
    assert gateway[gateway.index("--engine") + 1] == "{url:engine}" and gateway[gateway.index("--pool") + 1] == POOL
    assert ran[1].needs() == ["engine"]
    assert "admin" not in " ".join(gateway) and ran[1].env == {"STEPLINE_ADMIN_TOKEN": "{admin_token}"}


def test_the_cluster_splits_the_engines_among_its_gateways(tmp_path: Path) -> None:
    cfg = JobConfig.model_validate({"cluster": {"engines": 4, "gateways": 2}})
    specs = cluster_processes(cfg, RunDir(tmp_path), tmp_path / "policy", POOL)
    assert [s.name for s in specs] == ["engine-0", "engine-1", "engine-2", "engine-3", "gateway-0", "gateway-1"]
    assert specs[4].needs() == ["engine-0", "engine-1"] and specs[5].needs() == ["engine-2", "engine-3"]
    assert [s.index for s in specs] == [0, 1, 2, 3, 0, 1]
    spills = [a for s in specs[4:] for a in s.argv if a.endswith(".spill")]
    assert spills == [str(tmp_path / "gateway-0.spill"), str(tmp_path / "gateway-1.spill")]


def test_an_external_engine_command_gets_the_policy_and_the_node_address(tmp_path: Path) -> None:
    cfg = JobConfig.model_validate({"services": {"engine_kind": "sglang"}, "cluster": {"engine_command": [
        "python", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}", "--port", "{port}"]}})
    engine, gateway = cluster_processes(cfg, RunDir(tmp_path), tmp_path / "p", POOL)
    assert engine.argv[4:] == (str(tmp_path / "p"), "--host", "{host}", "--port", "{port}")
    assert gateway.argv[gateway.argv.index("--engine-kind") + 1] == "sglang"
    with pytest.raises(ValueError, match="without --ray the job needs services.engine_url"):
        local_run_specs(cfg, RunDir(tmp_path), tmp_path / "p", POOL)


def test_a_running_engine_is_not_started(tmp_path: Path) -> None:
    settings = {"engine_url": "http://10.0.0.5:30000", "engine_kind": "sglang"}
    specs = processes(up_system(ServicesSection(**settings), tmp_path, tmp_path, None, serve_pool=True))
    assert [s.name for s in specs] == ["pool", "gateway"]
    pool, gateway = specs
    assert pool.argv[pool.argv.index("--db") + 1] == f"sqlite:///{(tmp_path / 'pool.db').resolve()}"
    assert set(pool.env) == {"STEPLINE_POOL_READ_TOKEN", "STEPLINE_POOL_WRITE_TOKEN", "STEPLINE_POOL_CLAIM_TOKEN"}
    assert gateway.needs() == ["pool"] and gateway.env["STEPLINE_POOL_TOKEN"] == "{pool_write_token}"
    assert gateway.argv[gateway.argv.index("--engine") + 1] == "http://10.0.0.5:30000"


def test_the_ray_launcher_names_an_engine_it_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPLINE_VLLM_PYTHON", raising=False)
    cfg = JobConfig.model_validate({"model": {"vllm_compatible": True, "num_heads": 2, "num_kv_heads": 1},
                                    "services": {"engine_kind": "vllm"}})
    with pytest.raises(JobError, match="set services.vllm_python"):
        cluster_processes(cfg, RunDir(tmp_path), tmp_path, POOL)


def defaults(command: click.Command) -> dict[str, object]:
    """Each option's default as the command applies it (an option read from the environment left out)."""
    ctx = click.Context(command)
    out = {}
    for p in command.params:
        if isinstance(p, click.Option) and p.name and not callable(p.default):
            out[p.name] = p.get_default(ctx)
    return out


def test_each_default_is_declared_once() -> None:
    """`up`'s options that are [services] fields show the field's default; the gateway's and the engine's options
    that are fields of their settings show those defaults; and [services] takes the gateway's and engine's."""
    up = defaults(up_command)
    shared = {name: up[name] for name in ServicesSection.model_fields if name in up}
    assert set(shared) == {"engine_url", "engine_kind", "context_length", "startup_timeout_s", "session_idle_timeout",
                           "responses_truncated", "max_session_sequences", "partial_rollouts"}
    for name, value in shared.items():
        assert value == ServicesSection.model_fields[name].default, name
    assert up["port"] == GatewaySettings.model_fields["port"].default  # up's gateway listens where the gateway would
    for command, fields in ((gateway_command, GatewaySettings.model_fields), (engine_command, EngineOptions.model_fields)):
        given = defaults(command)
        checked = [name for name in fields if name in given]
        assert len(checked) >= 7, (command.name, checked)
        for name in checked:
            assert given[name] == fields[name].default, (command.name, name)
    svc = ServicesSection.model_fields
    assert svc["session_idle_timeout"].default == GatewaySettings.model_fields["session_idle_timeout"].default
    assert svc["max_session_sequences"].default == GatewaySettings.model_fields["max_session_sequences"].default
    assert svc["partial_rollouts"].default is GatewaySettings.model_fields["partial_rollouts"].default is True
    assert svc["prefix_cache_mb"].default == EngineOptions.model_fields["prefix_cache_mb"].default
    assert svc["engine_dtype"].default == EngineOptions.model_fields["dtype"].default
