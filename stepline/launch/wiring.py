"""The one wiring: which processes make up the system, for every launcher.

    system = job_system(cfg, policy, pool, state, cluster)  # `stepline run` (cluster None) and `run --ray`
    system = up_system(options, state)                      # `stepline up`
    specs = processes(system)                                # [ProcessSpec]: engines, the pool service, gateways

A `ProcessSpec` is a name, an argv and the environment variables it needs beyond the launcher's. Addresses and
secrets are placeholders the launcher fills (`fill`): `{host}` and `{port}` (where the process listens),
`{url:NAME}` (the base URL of process NAME, started before it), `{admin_token}`, `{engine_token}` and
`{pool_<right>_token}`. The local launcher (`start_local`, used by `up` and `run`) fills them with 127.0.0.1,
a free port and the tokens it made; the Ray launcher with the address of the node its actor landed on
(stepline/launch/ray_parts.py). So `up`, `run` and `run --ray` start the same processes for the same settings.

Each setting is declared once, in `[services]` (stepline.launch.job.ServicesSection), whose engine and gateway
defaults are those of the engine (stepline.engine.options.EngineOptions) and the gateway
(stepline.gateway.config.GatewaySettings); `up`'s options are fields of that table (`services_option`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from stepline.launch.job import ClusterSection, JobConfig, ServicesSection
from stepline.launch.services import (
    Child,
    EngineSpec,
    GatewaySpec,
    PoolSpec,
    Services,
    engine_token,
    fill,
    free_port,
)

__all__ = ["POOL_RIGHTS", "ProcessSpec", "System", "engine_dtype", "engine_spec", "job_system", "processes",
           "services_option", "start_local", "up_system"]

POOL_RIGHTS = ("read", "write", "claim")  # a pool service's tokens: STEPLINE_POOL_<RIGHT>_TOKEN


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the system, its addresses and secrets left as placeholders (the module docstring)."""

    name: str  # engine, pool, gateway (engine-1, gateway-1, ... when there are several): its log is logs/NAME.log
    role: str  # engine | pool | gateway
    index: int  # among the processes of its role
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # beyond the launcher's own environment

    def filled(self, values: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """(argv, env) with the placeholders named in `values` replaced."""
        return fill(list(self.argv), values), dict(zip(self.env, fill(list(self.env.values()), values), strict=True))

    def needs(self) -> list[str]:
        """The processes whose URL this one's argv names (they start, and answer, first)."""
        return re.findall(r"\{url:([^}]+)\}", " ".join(self.argv))


@dataclass(frozen=True)
class System:
    """What the processes are built from: the settings ([services]) and how many of each part."""

    policy: Path  # the model the engines serve and the gateways render with
    services: ServicesSection  # the engine and gateway settings
    pool: str  # the pool URL the gateways write to (ignored with serve_pool)
    state: Path  # where each gateway keeps its spill file
    engines: int = 1
    gateways: int = 1  # each fronts engines / gateways of the engines
    engine_command: tuple[str, ...] | None = None  # an external engine's argv ({model} {host} {port}); None: built-in
    serve_pool: str | None = None  # the database of a pool service to start (`up --serve-pool`); None: none


def job_system(cfg: JobConfig, policy: Path, pool: str, state: Path, cluster: ClusterSection | None = None) -> System:
    """The system of a job: on one machine (cluster None) one engine and one gateway; on Ray the [cluster]
    table's counts and engine command."""
    if cluster is None:
        return System(policy, cfg.services, pool, state)
    command = tuple(cluster.engine_command) if cluster.engine_command else None
    return System(policy, cfg.services, pool, state, cluster.engines, cluster.gateways, command)


def up_system(services: ServicesSection, model: Path, state: Path, pool_url: str | None, serve_pool: bool) -> System:
    """The system of `stepline up`: the pool URL it was given, else SQLite in `state` (served by a pool service
    with --serve-pool)."""
    database = f"sqlite:///{(state / 'pool.db').resolve()}"
    serve = database if pool_url is None and serve_pool else None
    return System(model, services, pool_url or database, state, serve_pool=serve)


def processes(system: System) -> list[ProcessSpec]:
    """The processes `system` runs, in start order: engines (none when [services] names a running one), the pool
    service (if any), the gateways. ValueError when the engine cannot be started (SGLang without a command)."""
    svc = system.services
    engines: list[str] = [svc.engine_url] if svc.engine_url else []
    specs = []
    if not svc.engine_url:
        specs = [_engine(system, i, _name("engine", i, system.engines)) for i in range(system.engines)]
        engines = [f"{{url:{s.name}}}" for s in specs]
    pool = system.pool
    if system.serve_pool is not None:
        tokens = {f"STEPLINE_POOL_{r.upper()}_TOKEN": f"{{pool_{r}_token}}" for r in POOL_RIGHTS}
        specs.append(ProcessSpec("pool", "pool", 0, tuple(PoolSpec(system.serve_pool, "{port}", "{host}").to_argv()),
                                 tokens))
        pool = "{url:pool}"
    share = max(len(engines) // system.gateways, 1)
    for g in range(system.gateways):
        name = _name("gateway", g, system.gateways)
        spill = system.state / ("stepline.gateway.spill" if system.gateways == 1 else f"{name}.spill")
        gateway = GatewaySpec(tuple(engines[g * share:(g + 1) * share] or engines), system.policy, pool, "{port}",
                              svc.engine_kind, "{host}", spill, svc.session_idle_timeout, svc.context_length,
                              responses_truncated=svc.responses_truncated,
                              max_session_sequences=svc.max_session_sequences,
                              partial_rollouts=svc.partial_rollouts)
        env = {"STEPLINE_ADMIN_TOKEN": "{admin_token}"}
        if system.serve_pool is not None:
            env["STEPLINE_POOL_TOKEN"] = "{pool_write_token}"
        specs.append(ProcessSpec(name, "gateway", g, tuple(gateway.to_argv()), env))
    return specs


def _name(role: str, index: int, count: int) -> str:
    return role if count == 1 else f"{role}-{index}"


def _engine(system: System, index: int, name: str) -> ProcessSpec:
    """Engine replica `index`: the external command, vLLM from its environment, or the built-in engine."""
    from stepline.launch.vllm_server import vllm_argv, vllm_env, vllm_python

    svc = system.services
    if system.engine_command:
        return ProcessSpec(name, "engine", index, tuple(fill(list(system.engine_command),
                                                             {"model": str(system.policy)})))
    if svc.engine_kind == "sglang":
        raise ValueError("services.engine_kind = sglang: without --ray the job needs services.engine_url of a "
                         "running SGLang server")
    if svc.engine_kind == "builtin":
        return ProcessSpec(name, "engine", index, tuple(engine_spec(svc, system.policy, "{port}", "{host}").to_argv()))
    python = vllm_python(svc.vllm_python)
    argv = vllm_argv(python, system.policy, "{host}", "{port}", engine_dtype(svc), svc.context_length, svc.vllm_args)
    env = vllm_env(svc.engine_threads, "{engine_token}", svc.vllm_kv_cache_gib)
    # through the lifeline: vLLM is not a stepline process and must still die with the launcher
    return ProcessSpec(name, "engine", index, (sys.executable, "-m", "stepline.launch.lifeline", *argv), env)


def engine_dtype(svc: ServicesSection) -> str:
    """float32 or bfloat16 (auto: bfloat16 where this CPU has bf16 units and runs bf16 matmuls faster)."""
    import torch

    from stepline.trainer.precision import fast_bf16

    if svc.engine_dtype != "auto":
        return svc.engine_dtype
    return "bfloat16" if fast_bf16(torch.device("cpu")) else "float32"


def engine_spec(svc: ServicesSection, policy: Path, port: int | str, host: str | None = None) -> EngineSpec:
    """The built-in engine the job starts on its policy ([services] table)."""
    return EngineSpec(policy, port, host, svc.context_length, engine_dtype(svc), svc.prefix_cache_mb,
                      svc.engine_threads)


def start_local(children: Services, specs: list[ProcessSpec], secrets: Mapping[str, str],
                ports: Mapping[str, int] | None = None) -> dict[str, str]:
    """Start `specs` on this machine in order, each on 127.0.0.1 at a free port (`ports`: a chosen one by name),
    waiting for the processes one names before starting it and for all at the end; their base URLs by name."""
    urls: dict[str, str] = {}
    started: dict[str, Child] = {}
    for spec in specs:
        for needed in spec.needs():
            children.wait(started[needed], urls[needed])
        port = (ports or {}).get(spec.name) or free_port()
        urls[spec.name] = f"http://127.0.0.1:{port}"
        values = {"host": "127.0.0.1", "port": str(port), "engine_token": engine_token(), **secrets,
                  **{f"url:{name}": url for name, url in urls.items()}}
        started[spec.name] = children.start(spec.name, *spec.filled(values))
    for name, child in started.items():
        children.wait(child, urls[name])
    return urls


def services_option(flag: str, name: str, **kwargs: Any) -> Any:
    """A click option for the [services] field `name`: its default and its doc are the field's."""
    info = ServicesSection.model_fields[name]
    text = info.description or ""
    return click.option(flag, name, default=info.default, show_default=info.default is not None,
                        help=text[:1].upper() + text[1:] + ".", **kwargs)
