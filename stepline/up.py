"""`stepline up --model DIR`: engine, pool and gateway together, for a person pointing an agent at them.

Starts the built-in engine (unless --engine names a running one), the pool (embedded SQLite by default,
or `stepline pool serve` with --serve-pool), and the gateway, each as its own subprocess with its log
in STATE_DIR/logs; waits until each answers /health; opens one session and prints the base URL and key
to give an OpenAI or Anthropic agent; on Ctrl-C stops the gateway first (it flushes its records),
then the pool, then the engine. The gateway keeps a spill file in STATE_DIR: when `up` is killed with
-9 every child gets SIGTERM at once (stepline.lifeline), the pool service may go first, and the calls
the gateway could not write wait there for the next `up` on the same STATE_DIR.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

from stepline.dashboard.cli import dashboard_beside
from stepline.lifeline import PARENT_PID_ENV

__all__ = ["up_command"]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_token() -> str:
    """The token between the engine and the gateway: STEPLINE_ENGINE_TOKEN, else one made for this
    process (so `up` and `run` protect the engine they start without saying so)."""
    return os.environ.setdefault("STEPLINE_ENGINE_TOKEN", secrets.token_urlsafe(24))


def start(name: str, args: list[str], logs: Path, env: dict[str, str] | None = None) -> Child:
    """Start `stepline <args>` as child `name`; env: extra variables (tokens travel there, not in argv,
    so `ps` shows none of them)."""
    return start_program(name, [sys.executable, "-m", "stepline.cli", *args], logs, env)


def start_program(name: str, argv: list[str], logs: Path, env: dict[str, str] | None = None) -> Child:
    """Start `argv` as child `name`, its output in logs/NAME.log. A program that is not `stepline` must be
    started through `python -m stepline.lifeline` to die with us (stepline.lifeline)."""
    log = logs / f"{name}.log"
    out = log.open("ab")
    # own session: Ctrl-C reaches only `up`, which then stops the children in order; and a child dies
    # with us even when we are killed with -9 (stepline.lifeline)
    env = {**os.environ, "STEPLINE_ENGINE_TOKEN": engine_token(), PARENT_PID_ENV: str(os.getpid()), **(env or {})}
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    out.close()
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


def open_session(gateway: str, admin_token: str) -> dict:
    answer = httpx.post(
        f"{gateway}/sessions",
        json={"task_id": "manual", "harness": "manual"},
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=10.0,
    )
    answer.raise_for_status()
    return answer.json()


def instructions(gateway: str, engine: str, pool: str, admin_token: str, session: dict) -> str:
    return f"""
Stepline is up.
  engine   {engine}
  pool     {pool}
  gateway  {gateway}   (admin token: {admin_token})

A session is open for you (every call through it is recorded):
  OpenAI agents:     export OPENAI_BASE_URL={session["openai_base_url"]} OPENAI_API_KEY={session["api_key"]}
  Anthropic agents:  export ANTHROPIC_BASE_URL={session["anthropic_base_url"]} ANTHROPIC_API_KEY={session["api_key"]}

One session per episode: open more with
  curl -s -X POST {gateway}/sessions -H 'Authorization: Bearer {admin_token}' \\
       -d '{{"task_id": "my-task", "harness": "my-agent"}}'
then reward and end each:
  curl -s -X POST {gateway}/sessions/<id>/reward -H 'Authorization: Bearer <key>' -d '{{"value": 1.0}}'
  curl -s -X POST {gateway}/sessions/<id>/end -H 'Authorization: Bearer <key>' -d '{{"status": "completed"}}'

Ctrl-C stops everything (the gateway flushes its records to the pool first).
""".rstrip()


@click.command("up")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Model directory (e.g. from `stepline make-model`).",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Gateway port (0: free).")
@click.option(
    "--engine", "engine_url", default=None, help="Use this running engine instead of starting the built-in one."
)
@click.option("--engine-kind", type=click.Choice(["builtin", "sglang", "vllm"]), default="builtin", show_default=True)
@click.option("--pool", "pool_url", default=None, help="Use this pool URL (default: SQLite in STATE_DIR).")
@click.option("--serve-pool", is_flag=True, help="Run the pool as its own service (stepline pool serve).")
@click.option(
    "--state-dir",
    default=Path("stepline-up"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the pool database and the logs go.",
)
@click.option("--admin-token", default=None, help="Admin token (default: a fresh random one, printed).")
@click.option("--context-length", default=None, type=click.IntRange(min=1),
              help="Prompt + output token limit of the built-in engine and the gateway (default: the model's; "
                   "the gateway lowers it to the engine's own limit).")
@click.option("--startup-timeout", default=180.0, show_default=True, help="Seconds each service may take to start.")
@click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve `stepline dashboard` of the pool on 127.0.0.1 at this port (0: a free one).")
@click.option("--session-idle-timeout", default=24 * 3600.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="The gateway's: open sessions without a call for this long end as abandoned, and at start "
                   "the pool's open sessions created longer ago (those a killed `up` left behind).")
def up_command(
    model_dir: Path,
    port: int,
    engine_url: str | None,
    engine_kind: str,
    pool_url: str | None,
    serve_pool: bool,
    state_dir: Path,
    admin_token: str | None,
    context_length: int | None,
    startup_timeout: float,
    dashboard_port: int | None,
    session_idle_timeout: float,
) -> None:
    """Start engine, pool and gateway together and print how to point an agent at them."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    admin_token = admin_token or secrets.token_urlsafe(16)
    pool_tokens = {f"STEPLINE_POOL_{right}_TOKEN": secrets.token_urlsafe(24) for right in ("READ", "WRITE", "CLAIM")}
    children: list[Child] = []
    limit = ["--context-length", str(context_length)] if context_length else []
    try:
        if engine_url is None:
            engine_url, engine_kind = f"http://127.0.0.1:{free_port()}", "builtin"
            children.append(start(
                "engine", ["engine", "--model", str(model_dir), "--port", engine_url.rsplit(":", 1)[1], *limit], logs
            ))
        # the gateway asks the engine its model and context length when it starts: the engine answers first
        wait_healthy(children[0] if children else None, engine_url, startup_timeout)
        database = f"sqlite:///{(state_dir / 'pool.db').resolve()}"
        if pool_url is None and serve_pool:
            pool_url = f"http://127.0.0.1:{free_port()}"
            children.append(
                start("pool", ["pool", "serve", "--db", database, "--port", pool_url.rsplit(":", 1)[1]], logs,
                      pool_tokens)
            )
        pool_url = pool_url or database
        gateway_url = f"http://127.0.0.1:{port or free_port()}"
        children.append(
            start(
                "gateway",
                [
                    "gateway",
                    "--engine",
                    engine_url,
                    "--engine-kind",
                    engine_kind,
                    "--model",
                    str(model_dir),
                    "--pool",
                    pool_url,
                    "--port",
                    gateway_url.rsplit(":", 1)[1],
                    "--spill",
                    str(state_dir / "gateway.spill"),
                    "--session-idle-timeout",
                    str(session_idle_timeout),
                    *limit,
                ],
                logs,
                {"STEPLINE_ADMIN_TOKEN": admin_token, "STEPLINE_POOL_TOKEN": pool_tokens["STEPLINE_POOL_WRITE_TOKEN"]},
            )
        )
        by_name = {c.name: c for c in children}
        wait_healthy(by_name.get("engine"), engine_url, startup_timeout)
        if "pool" in by_name:
            wait_healthy(by_name["pool"], pool_url, startup_timeout)
        wait_healthy(by_name["gateway"], gateway_url, startup_timeout)
        click.echo(instructions(gateway_url, engine_url, pool_url, admin_token, open_session(gateway_url, admin_token)))
        click.echo(f"Logs: {logs}", err=True)
        reader = {"STEPLINE_POOL_TOKEN": pool_tokens["STEPLINE_POOL_READ_TOKEN"]}
        with dashboard_beside(["--pool", pool_url], dashboard_port, logs, reader, startup_timeout):
            while all(c.proc.poll() is None for c in children):
                time.sleep(0.5)
        dead = next(c for c in children if c.proc.poll() is not None)
        raise click.ClickException(f"{dead.name} exited with code {dead.proc.returncode}:\n{tail(dead.log)}")
    except KeyboardInterrupt:
        click.echo("\nstopping...", err=True)
    finally:
        stop_all(children)
