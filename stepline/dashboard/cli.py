"""`stepline dashboard [RUN_DIR | --pool URL]`: serve the dashboard and print its URL."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

__all__ = ["dashboard_beside", "dashboard_command", "is_loopback", "serve_dashboard"]

DEFAULT_PORT = 8400


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def access_token(host: str, token: str | None) -> str | None:
    """The token the dashboard requires: the one given, else a fresh one on any non-loopback bind."""
    if token is not None:
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(18)


def dashboard_url(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve_dashboard(run_dir: Path | None, pool: str | None, host: str, port: int, token: str | None,
                    tokenizer: Path | None, leaf_rule: str | None, poll_s: float) -> None:
    """Serve until interrupted (prints the URL once bound)."""
    import asyncio

    from aiohttp import web

    from stepline.assets import AssetUnavailable, uplot_dir
    from stepline.dashboard.app import DashboardConfig, make_app

    try:
        vendor = uplot_dir(fetch=False)
    except AssetUnavailable as exc:
        click.echo(f"warning: {exc}; the dashboard shows tables only", err=True)
        vendor = None
    config = DashboardConfig(run_dir, pool, tokenizer, leaf_rule, token, poll_s, vendor)

    async def main() -> None:
        runner = web.AppRunner(make_app(config), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        click.echo(f"stepline dashboard: {dashboard_url(host, bound, token)}")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


@contextmanager
def dashboard_beside(target: list[str], port: int | None, logs: Path, env: dict[str, str] | None = None,
                     timeout: float = 60.0) -> Iterator[str | None]:
    """`stepline dashboard TARGET…` as a child of `stepline run` / `stepline up` on 127.0.0.1:PORT (0: a
    free port; None: no dashboard), printed and yielded as its URL; stopped on exit."""
    if port is None:
        yield None
        return
    from stepline.launch.services import free_port, port_of, start, stepline_argv, stop_all, wait_healthy

    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port or free_port()}"
    child = start("dashboard", stepline_argv("dashboard", *target, "--port", port_of(url)), logs, env)
    try:
        wait_healthy(child, url, timeout)
        click.echo(f"dashboard: {url}/")
        yield url + "/"
    finally:
        stop_all([child])


POOL_SCHEMES = ("sqlite://", "postgresql://", "postgres://", "http://", "https://")


def pool_url(ctx: click.Context, param: click.Parameter, url: str | None) -> str | None:
    """A pool URL of a known scheme, or a path that exists (a pool file); a SQLite pool may not exist yet."""
    if url is not None and not url.startswith(POOL_SCHEMES) and not Path(url).exists():
        raise click.BadParameter(f"{url!r} is neither a pool URL ({', '.join(POOL_SCHEMES[:4])}…) nor a file that exists",
                                 ctx=ctx, param=param)
    return url


@click.command("dashboard")
@click.argument("run_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--pool", callback=pool_url, help="Show a pool alone (sqlite:///…, postgresql://…, http://… of `stepline pool serve`); "
                             "with RUN_DIR: instead of its pool.db.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address; any other than loopback requires an access token (made and printed, or --token).")
@click.option("--token", envvar="STEPLINE_DASHBOARD_TOKEN", help="Access token to require (env STEPLINE_DASHBOARD_TOKEN).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Decode tokens with this model directory's tokenizer.json (default: the run's model).")
@click.option("--leaf-rule", type=click.Choice(["all", "drop_superseded", "main"]),
              help="Which leaves train (default: the job's trainer.leaf_rule).")
@click.option("--poll", "poll_s", type=click.FloatRange(0.2, 600), default=2.0, show_default=True,
              help="Seconds between refreshes from the run's files and the pool.")
def dashboard_command(run_dir: Path | None, pool: str | None, port: int, host: str, token: str | None,
                      tokenizer: Path | None, leaf_rule: str | None, poll_s: float) -> None:
    """Serve a read-only web dashboard of a run (charts, episodes table, episode trees) or of a pool."""
    if run_dir is None and pool is None:
        raise click.UsageError("give a RUN_DIR or --pool URL")
    serve_dashboard(run_dir, pool, host, port, access_token(host, token), tokenizer, leaf_rule, poll_s)
