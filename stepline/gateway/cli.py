"""`stepline gateway`: the recording gateway in front of one or more engines.

    stepline gateway --engine http://127.0.0.1:30000 [--engine URL ...] [--engine-kind builtin|sglang|vllm]
                     --model DIR --pool sqlite:///pool.db --port 8000 [--admin-token T] [--spill FILE | --no-spill]

`running_gateway` composes the parts (shared upstream HTTP session, adapters, router, recorder,
weight gate, the app) and shuts them down in order: stop accepting, finish in-flight calls, flush
the recorder, close the pool. The benchmark and tests use it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import click
from aiohttp import web

from stepline.datapool.base import Pool
from stepline.gateway.config import GatewaySettings
from stepline.gateway.engines import ENGINE_KINDS, make_engine
from stepline.gateway.engines.probe import EngineMismatch, check_engines
from stepline.gateway.fleet import EngineRouter, WeightGate
from stepline.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
from stepline.gateway.recorder import Recorder
from stepline.gateway.spill import Spill, SpillInUse, default_state_dir
from stepline.modeldir import model_dir_option

__all__ = ["Gateway", "gateway_command", "running_gateway"]

log = logging.getLogger("stepline.gateway")


@dataclass
class Gateway:
    """A running gateway's parts (for tests and benchmarks)."""

    url: str
    router: EngineRouter
    recorder: Recorder
    gate: WeightGate
    app: web.Application


@asynccontextmanager
async def running_gateway(
    settings: GatewaySettings,
    engine_urls: list[str],
    model_dir: Path,
    pool: Pool,
    engine_kind: str = "builtin",
    engine_timeout: float = 600.0,
) -> AsyncIterator[Gateway]:
    """Serve the gateway on settings.host:settings.port (0: a free port) until the block exits.
    The pool is not closed here (the caller opened it). The engines get `settings.engine_token` as
    Bearer on every call and are taken to serve `settings.initial_version`."""
    from stepline.gateway.app import create_app

    # one upstream session for every engine call (docs/architecture.md §6); aiohttp's default of 100 connections
    # would cap the calls in flight
    limit = settings.max_connections
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
    headers = {"Authorization": f"Bearer {settings.engine_token}"} if settings.engine_token else None
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        router = EngineRouter([make_engine(u, engine_kind, http, engine_timeout, model_dir) for u in engine_urls])
        recorder = Recorder(pool, spill=Spill(settings.spill_path) if settings.spill_path else None)
        gate = WeightGate(router, max_wait=settings.max_wait_paused, initial_version=settings.initial_version,
                          grace=settings.update_grace)
        await router.start()
        try:  # the engines' model and context length against model_dir (stepline.gateway.engines.probe)
            context = await check_engines(router.clients, model_dir, settings.context_length)
        except BaseException:
            await router.aclose()
            raise
        settings = settings.model_copy(update={"context_length": context})
        await recorder.start()
        app = create_app(settings, router, recorder, gate, model_dir)
        # handler_cancellation: a client that hangs up cancels its handler, and with it the engine request
        # (the engine aborts a request whose connection closed); keepalive_timeout also bounds how long
        # a connection may take to send a request's headers
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                               keepalive_timeout=settings.read_timeout)
        await runner.setup()
        try:
            site = web.TCPSite(runner, settings.host, settings.port)
            await site.start()
            host, port = runner.addresses[0][:2]
            yield Gateway(f"http://{host}:{port}", router, recorder, gate, app)
        finally:
            await runner.cleanup()  # stop accepting, let in-flight handlers finish
            await recorder.aclose()  # every recorded call reaches the pool
            await router.aclose()


def http_urls(ctx: click.Context, param: click.Parameter, urls: tuple[str, ...]) -> tuple[str, ...]:
    """Engine base URLs: http:// or https:// each (a bare host:port is refused, naming it)."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http:// or https:// URL", ctx=ctx, param=param)
    return urls


@click.command("gateway")
@click.option("--engine", "engines", multiple=True, required=True, callback=http_urls,
              help="Engine base URL (repeat for several).")
@click.option(
    "--engine-kind",
    type=click.Choice(ENGINE_KINDS),
    default="builtin",
    show_default=True,
    help="Wire format of the engines: builtin and sglang speak /generate, vllm /v1/completions.",
)
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(path_type=Path),
    callback=model_dir_option(("tokenizer.json",)),
    help="Model directory: its tokenizer and chat template render the prompts.",
)
@click.option(
    "--pool",
    "pool_url",
    required=True,
    help="Data pool: sqlite:///path.db, postgresql://..., or http://host:port (stepline pool serve).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--admin-token",
    default=lambda: os.environ.get("STEPLINE_ADMIN_TOKEN"),
    help="Token for /admin/* and POST /sessions [env STEPLINE_ADMIN_TOKEN]; none: open to anyone.",
)
@click.option("--public-url", default=None, help="Base URL handed to harnesses (default: from each request's Host).")
@click.option("--model-name", default="stepline", show_default=True, help="Model id served on /v1/models.")
@click.option(
    "--context-length",
    default=None,
    type=click.IntRange(min=1),
    help="Prompt + output token limit (default: the model's max_position_embeddings; "
    "lowered to an engine's own limit, asked at start).",
)
@click.option(
    "--strict-template", is_flag=True, help="Render every turn with the template (fork where it rewrites history)."
)
@click.option(
    "--engine-token",
    default=lambda: os.environ.get("STEPLINE_ENGINE_TOKEN"),
    help="Bearer token for the engines (their control endpoints) [env STEPLINE_ENGINE_TOKEN].",
)
@click.option("--tool-parser", type=click.Choice(list(TOOL_PARSERS)), default=None,
              help="Tool-call parser (SGLang/vLLM --tool-call-parser names); default: detected from the template.")
@click.option("--reasoning-parser", type=click.Choice(list(REASONING_PARSERS)), default=None,
              help="Reasoning parser (SGLang/vLLM --reasoning-parser names); default: detected from the template.")
@click.option("--eot-token", default=None,
              help="End-of-turn token; default: the special token the template writes after an assistant turn.")
@click.option("--responses-truncated", type=click.Choice(["incomplete", "completed"]),
              default=GatewaySettings.model_fields["responses_truncated"].default,
              show_default=True, help="Responses API answers cut by max_output_tokens end as OpenAI's (status "
              "incomplete, response.incomplete) or as completed (which the OpenAI Agents SDK accepts); "
              "incomplete_details names max_output_tokens either way.")
@click.option("--inject-tools", is_flag=True,
              help="For templates that cannot show tools: render them into the system message (and tool calls / "
              "results as text) in the tool parser's format. Without it such requests get 400.")
@click.option(
    "--spill",
    "spill_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Spill file: calls acknowledged while the pool is unreachable (or at shutdown) are kept here and "
    "written at the next start; answers wait until each call is in the pool or this file "
    "[default: STATE_DIR/gateway-PORT.spill].",
)
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the default spill file lives [default: $STEPLINE_STATE_DIR, else "
              "$XDG_STATE_HOME/stepline, else ~/.local/state/stepline].")
@click.option("--no-spill", is_flag=True,
              help="No spill file: answers never wait on the pool, and calls acknowledged while it is down are lost "
              "if the gateway dies.")
@click.option("--engine-timeout", default=600.0, show_default=True, help="Seconds an engine call may take.")
@click.option("--session-idle-timeout", default=GatewaySettings.model_fields["session_idle_timeout"].default,
              show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Open sessions without a call for this long end as abandoned (and, at start, the pool's open "
              "sessions created longer ago: those a killed gateway left behind).")
@click.option("--session-lease", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds the gateway leases its open sessions in the pool for (renewed every third of it); "
              "if it dies, they end as abandoned once the lease lapses, so their groups become claimable.")
@click.option("--fork-idle-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Open forks without a call for this long end as abandoned (they would hold their group).")
@click.option("--max-forks-per-session", default=64, show_default=True, type=click.IntRange(min=0),
              help="Forks one session may make (429 beyond).")
@click.option("--max-forks-per-group", default=256, show_default=True, type=click.IntRange(min=0),
              help="Forks of one group open at once (429 beyond).")
@click.option("--max-session-sequences", default=GatewaySettings.model_fields["max_session_sequences"].default,
              show_default=True, type=click.IntRange(min=0),
              help="Engine sequences (choices x prompts) one session may have running at once; its further ones "
              "wait their turn, so one session's burst cannot crowd out the others (0: no limit).")
@click.option("--prepare-workers", default=GatewaySettings.model_fields["prepare_workers"].default, show_default=True,
              type=click.IntRange(min=0),
              help="Large requests prepared at once (worker threads), and the processes that tokenize long texts "
              "(0: one thread, long texts tokenized in the gateway's own process).")
@click.option("--initial-version", default=0, show_default=True, help="Weight version the engines serve at start.")
@click.option("--update-grace", default=5.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds in-flight calls may run on into a weight update before the engines end them.")
@click.option("--partial-rollouts/--no-partial-rollouts",
              default=GatewaySettings.model_fields["partial_rollouts"].default, show_default=True,
              help="A call a weight update cut short goes on under the new weights and is answered whole (off: "
              "answered truncated).")
def gateway_command(
    engines: tuple[str, ...], engine_kind: str, model_dir: Path, pool_url: str, engine_timeout: float, **options: Any
) -> None:
    """Run the recording gateway in front of one or more engines."""
    from stepline.datapool import open_pool

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options["spill_path"] = _spill_path(options.pop("spill_path"), options.pop("state_dir"),
                                        options.pop("no_spill"), options["port"])
    settings = GatewaySettings(**options)  # every other option is a setting of the same name
    if settings.admin_token is None:
        log.warning("no --admin-token: /admin/* and POST /sessions are open to anyone who can reach port %d",
                    settings.port)
    try:
        pool = open_pool(pool_url)
    except Exception as exc:  # the edge: any failure to open is the operator's URL or database
        raise click.ClickException(f"cannot open the pool {pool_url!r}: {exc}") from exc
    try:
        asyncio.run(_serve(settings, list(engines), engine_kind, model_dir, pool, engine_timeout))
    except (EngineMismatch, ValueError, SpillInUse) as exc:  # ValueError: an --eot-token not in the tokenizer, --inject-tools
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {settings.host}:{settings.port}: {exc}") from exc
    finally:
        pool.close()


def _spill_path(given: str | None, state_dir: Path | None, off: bool, port: int) -> str | None:
    """The spill file: the one named, else one per port in the state directory (so a hand-started gateway loses
    no acknowledged call either), or none with --no-spill."""
    if off:
        if given:
            raise click.UsageError("--spill and --no-spill exclude each other")
        log.warning("--no-spill: calls acknowledged while the pool is down are lost if this gateway dies")
        return None
    return given or str((state_dir or default_state_dir()) / f"gateway-{port}.spill")


async def _serve(
    settings: GatewaySettings, engines: list[str], kind: str, model_dir: Path, pool: Pool, timeout: float
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running_gateway(settings, engines, model_dir, pool, kind, timeout) as gw:
        from stepline.gateway.app import PROFILE_KEY

        print(f"stepline gateway on {gw.url} -> {', '.join(engines)} ({kind}); Ctrl-C stops", flush=True)
        print(f"model: {gw.app[PROFILE_KEY].describe()}", flush=True)
        await stop.wait()
        log.info("stopping: finishing in-flight calls and flushing records to the pool")
