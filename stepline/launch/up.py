"""`stepline up --model DIR`: engine, pool and gateway together, for a person pointing an agent at them.

Starts the built-in engine (unless --engine names a running one), the pool (embedded SQLite by default,
or `stepline pool serve` with --serve-pool), and the gateway, each as its own subprocess with its log
in STATE_DIR/logs; waits until each answers /health; opens one session and prints the base URL and key
to give an OpenAI or Anthropic agent; on Ctrl-C stops the gateway first (it flushes its records),
then the pool, then the engine. The gateway keeps a spill file in STATE_DIR: when `up` is killed with
-9 every child gets SIGTERM at once (stepline.launch.lifeline), the pool service may go first, and the calls
the gateway could not write wait there for the next `up` on the same STATE_DIR.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import click
import httpx

from stepline.dashboard.cli import dashboard_beside
from stepline.gateway.config import GatewaySettings
from stepline.launch.job import ServicesSection
from stepline.launch.services import Services, tail
from stepline.launch.wiring import POOL_RIGHTS, processes, services_option, start_local, up_system
from stepline.modeldir import model_dir_option

__all__ = ["up_command"]


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
    type=click.Path(path_type=Path),
    callback=model_dir_option(),
    help="Model directory (e.g. from `stepline make-model`).",
)
@click.option("--port", default=GatewaySettings.model_fields["port"].default, show_default=True,
              type=click.IntRange(0, 65535), help="Gateway port (0: free).")
@services_option("--engine", "engine_url")
@services_option("--engine-kind", "engine_kind", type=click.Choice(["builtin", "sglang", "vllm"]))
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
@services_option("--context-length", "context_length", type=click.IntRange(min=1))
@services_option("--startup-timeout", "startup_timeout_s", type=click.FloatRange(min=0, min_open=True))
@click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve `stepline dashboard` of the pool on 127.0.0.1 at this port (0: a free one).")
@services_option("--session-idle-timeout", "session_idle_timeout", type=click.FloatRange(min=0, min_open=True))
@services_option("--responses-truncated", "responses_truncated", type=click.Choice(["incomplete", "completed"]))
@services_option("--max-session-sequences", "max_session_sequences", type=click.IntRange(min=0))
@services_option("--partial-rollouts/--no-partial-rollouts", "partial_rollouts")
def up_command(model_dir: Path, port: int, pool_url: str | None, serve_pool: bool, state_dir: Path,
               admin_token: str | None, dashboard_port: int | None, **settings: Any) -> None:
    """Start engine, pool and gateway together and print how to point an agent at them."""
    svc = ServicesSection(**settings)  # every other option is a [services] field of the same name
    if svc.engine_url is None and svc.engine_kind == "sglang":
        raise click.UsageError("--engine-kind sglang needs --engine URL of a running SGLang server")
    try:
        specs = processes(up_system(svc, model_dir, state_dir, pool_url, serve_pool))
    except ValueError as exc:  # vLLM without its python
        raise click.UsageError(str(exc)) from None
    logs = state_dir / "logs"
    admin_token = admin_token or secrets.token_urlsafe(16)
    tokens = {f"pool_{right}_token": secrets.token_urlsafe(24) for right in POOL_RIGHTS}
    with Services(logs, svc.startup_timeout_s) as services:
        try:
            urls = start_local(services, specs, {"admin_token": admin_token, **tokens}, ports={"gateway": port})
            engine_url, gateway_url = urls.get("engine", svc.engine_url), urls["gateway"]
            pool = urls.get("pool", pool_url or f"sqlite:///{(state_dir / 'pool.db').resolve()}")
            click.echo(instructions(gateway_url, str(engine_url), pool, admin_token,
                                    open_session(gateway_url, admin_token)))
            click.echo(f"Logs: {logs}", err=True)
            reader = {"STEPLINE_POOL_TOKEN": tokens["pool_read_token"]}
            with dashboard_beside(["--pool", pool], dashboard_port, logs, reader, svc.startup_timeout_s):
                dead = services.first_exit()
            raise click.ClickException(f"{dead.name} exited with code {dead.proc.returncode}:\n{tail(dead.log)}")
        except KeyboardInterrupt:
            click.echo("\nstopping...", err=True)
