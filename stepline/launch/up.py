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

import click
import httpx

from stepline.dashboard.cli import dashboard_beside
from stepline.launch.services import EngineSpec, GatewaySpec, PoolSpec, Services, free_port, port_of, tail
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
    admin_token = admin_token or secrets.token_urlsafe(16)
    pool_tokens = {f"STEPLINE_POOL_{right}_TOKEN": secrets.token_urlsafe(24) for right in ("READ", "WRITE", "CLAIM")}
    with Services(logs, startup_timeout) as services:
        try:
            engine = None
            if engine_url is None:
                engine_url, engine_kind = f"http://127.0.0.1:{free_port()}", "builtin"
                engine = services.start("engine", EngineSpec(model_dir, port_of(engine_url),
                                                             context_length=context_length).to_argv())
            # the gateway asks the engine its model and context length when it starts: the engine answers first
            services.wait(engine, engine_url)
            database = f"sqlite:///{(state_dir / 'pool.db').resolve()}"
            pool = None
            if pool_url is None and serve_pool:
                pool_url = f"http://127.0.0.1:{free_port()}"
                pool = services.start("pool", PoolSpec(database, port_of(pool_url)).to_argv(), pool_tokens)
            pool_url = pool_url or database
            gateway_url = f"http://127.0.0.1:{port or free_port()}"
            gateway = GatewaySpec((engine_url,), model_dir, pool_url, port_of(gateway_url), engine_kind,
                                  spill=state_dir / "stepline.gateway.spill", session_idle_timeout=session_idle_timeout,
                                  context_length=context_length)
            gateway_child = services.start("gateway", gateway.to_argv(), {
                "STEPLINE_ADMIN_TOKEN": admin_token, "STEPLINE_POOL_TOKEN": pool_tokens["STEPLINE_POOL_WRITE_TOKEN"]})
            if pool is not None:
                services.wait(pool, pool_url)
            services.wait(gateway_child, gateway_url)
            click.echo(instructions(gateway_url, engine_url, pool_url, admin_token,
                                    open_session(gateway_url, admin_token)))
            click.echo(f"Logs: {logs}", err=True)
            reader = {"STEPLINE_POOL_TOKEN": pool_tokens["STEPLINE_POOL_READ_TOKEN"]}
            with dashboard_beside(["--pool", pool_url], dashboard_port, logs, reader, startup_timeout):
                dead = services.first_exit()
            raise click.ClickException(f"{dead.name} exited with code {dead.proc.returncode}:\n{tail(dead.log)}")
        except KeyboardInterrupt:
            click.echo("\nstopping...", err=True)
