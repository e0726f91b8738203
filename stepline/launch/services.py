"""The system's services as child processes: spec → argv → start → wait healthy → stop.

    spec = EngineSpec(model=policy, port=8001)              # typed, one per service: EngineSpec, PoolSpec, GatewaySpec
    with Services(logs, timeout=180) as services:
        engine = services.start("engine", spec.to_argv())  # its output in logs/engine.log
        services.wait(engine, "http://127.0.0.1:8001")     # until /health answers 200 (the log tail if it exits)
    # on exit: SIGTERM in reverse start order (the gateway first: it flushes its records), SIGKILL after a grace

The one wiring (stepline/launch/wiring.py) builds every launcher's argv with these specs, so a flag is spelt in one
place; `{host}`/`{port}` placeholders are filled by `fill`, here or on the Ray node. A spec field left None leaves the
subcommand's own default. Tokens travel in the child's environment, never in argv, where `ps` shows them.
Every child gets this process's pid (stepline.launch.lifeline) and its own session: Ctrl-C reaches only the parent,
which stops the children in order, and a child dies with the parent even when the parent is killed with -9.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import click
import httpx

from stepline.launch.lifeline import PARENT_PID_ENV

__all__ = ["Child", "EngineSpec", "GatewaySpec", "PoolSpec", "Services", "engine_token", "fill", "free_port", "start",
           "stepline_argv", "stop_all", "wait_healthy"]


def stepline_argv(*args: str) -> list[str]:
    """`stepline ARGS…` as this interpreter runs it."""
    return [sys.executable, "-m", "stepline.cli", *args]


def _option(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _flag(name: str, value: bool | None) -> list[str]:
    """`--name` or `--no-name` of a boolean option pair (none: its default)."""
    return [] if value is None else [f"--{name}" if value else f"--no-{name}"]


@dataclass(frozen=True)
class EngineSpec:
    """`stepline engine`: the built-in engine serving `model`."""

    model: Path
    port: int | str  # a number, or a placeholder the Ray part fills ("{port}")
    host: str | None = None
    context_length: int | None = None
    dtype: str | None = None
    prefix_cache_mb: float | None = None
    threads: int | None = None

    def to_argv(self) -> list[str]:
        return stepline_argv("engine", "--model", str(self.model), "--port", str(self.port),
                             *_option("--host", self.host), *_option("--dtype", self.dtype),
                             *_option("--prefix-cache-mb", self.prefix_cache_mb),
                             *_option("--context-length", self.context_length), *_option("--threads", self.threads))


@dataclass(frozen=True)
class PoolSpec:
    """`stepline pool serve`: the pool as its own service over database `db`."""

    db: str
    port: int | str
    host: str | None = None

    def to_argv(self) -> list[str]:
        return stepline_argv("pool", "serve", "--db", self.db, "--port", str(self.port), *_option("--host", self.host))


@dataclass(frozen=True)
class GatewaySpec:
    """`stepline gateway`: the recording gateway in front of `engines`, writing to `pool`."""

    engines: tuple[str, ...]
    model: Path
    pool: str
    port: int | str
    engine_kind: str = "builtin"
    host: str | None = None
    spill: Path | None = None
    session_idle_timeout: float | None = None
    context_length: int | None = None
    session_lease: float | None = None
    responses_truncated: str | None = None  # None: the gateway's default
    max_session_sequences: int | None = None
    partial_rollouts: bool | None = None

    def to_argv(self) -> list[str]:
        engines = [arg for url in self.engines for arg in ("--engine", url)]
        return stepline_argv("gateway", *engines, "--engine-kind", self.engine_kind, "--model", str(self.model),
                             "--pool", self.pool, *_option("--host", self.host), "--port", str(self.port),
                             *_option("--spill", self.spill), *_option("--session-idle-timeout", self.session_idle_timeout),
                             *_option("--context-length", self.context_length),
                             *_option("--session-lease", self.session_lease),
                             *_option("--responses-truncated", self.responses_truncated),
                             *_option("--max-session-sequences", self.max_session_sequences),
                             *_flag("partial-rollouts", self.partial_rollouts))


def fill(argv: list[str], values: Mapping[str, str]) -> list[str]:
    """Replace `{name}` placeholders in each argument (a plain replace: other braces stay as they are)."""
    out = []
    for arg in argv:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def engine_token() -> str:
    """The token between the engine and the gateway: STEPLINE_ENGINE_TOKEN, else one made for this
    process (so `up` and `run` protect the engine they start without saying so)."""
    return os.environ.setdefault("STEPLINE_ENGINE_TOKEN", secrets.token_urlsafe(24))


def start(name: str, argv: list[str], logs: Path, env: dict[str, str] | None = None) -> Child:
    """Start `argv` as child `name`, its output in logs/NAME.log; env: extra variables. A program that is not
    `stepline` must be started through `python -m stepline.launch.lifeline` to die with us (stepline.launch.lifeline)."""
    log = logs / f"{name}.log"
    env = {**os.environ, "STEPLINE_ENGINE_TOKEN": engine_token(), PARENT_PID_ENV: str(os.getpid()), **(env or {})}
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return Child(name, proc, log)


def wait_healthy(child: Child | None, url: str, timeout: float) -> None:
    """Poll url/health until 200; fail early (with the child's log tail) if the child exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.proc.poll() is not None:
            raise click.ClickException(f"{child.name} exited with code {child.proc.returncode}:\n{tail(child.log)}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    name = child.name if child else url
    raise click.ClickException(
        f"{name} did not become healthy within {timeout:g} s" + (f":\n{tail(child.log)}" if child else "")
    )


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def stop_all(children: list[Child], grace: float = 30.0) -> None:
    """Stop in reverse start order: gateway (flushes to the pool), pool, engine."""
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(grace)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


@dataclass
class Services:
    """The children one launcher starts, each waited for within `timeout` seconds, all stopped on exit."""

    logs: Path
    timeout: float
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children.append(start(name, argv, self.logs, env))
        return self.children[-1]

    def wait(self, child: Child | None, url: str) -> str:
        """Until url/health answers (child: the process behind it, whose exit fails early); the url."""
        wait_healthy(child, url, self.timeout)
        return url

    def first_exit(self, poll_s: float = 0.5) -> Child:
        """Block until some child exits; that child."""
        while True:
            for child in self.children:
                if child.proc.poll() is not None:
                    return child
            time.sleep(poll_s)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        stop_all(self.children)
