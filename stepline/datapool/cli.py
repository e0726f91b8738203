"""`stepline pool …`: serve the pool, export / import it, show a session.

    stepline pool serve --db sqlite:///pool.db --port 8300     (also: stepline pool --db … --port …)
    stepline pool export DB OUT          stepline pool import FILE DB
    stepline pool show SESSION --db URL [--tokenizer DIR] [--leaf-rule drop_superseded]
"""

from __future__ import annotations

import asyncio

import click

from stepline.datapool.base import PoolError

DEFAULT_PORT = 8300


def _serve(db: str, host: str, port: int) -> None:
    from stepline.datapool.service import serve

    try:
        asyncio.run(serve(db, host, port))
    except KeyboardInterrupt:
        pass
    except PoolError as exc:
        raise click.ClickException(str(exc)) from exc


@click.group(invoke_without_command=True)
@click.option("--db", help="Pool database URL (sqlite:///pool.db, postgresql://…); serves it.")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.pass_context
def pool_group(ctx: click.Context, db: str | None, port: int, host: str) -> None:
    """The data pool: serve it over HTTP, export / import it, show a session's tree."""
    if ctx.invoked_subcommand is None:
        if db is None:
            click.echo(ctx.get_help())
            return
        _serve(db, host, port)


@pool_group.command("serve")
@click.option("--db", required=True, help="Pool database URL (sqlite:///pool.db, postgresql://…).")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True)
def serve_command(db: str, port: int, host: str) -> None:
    """Serve the pool over HTTP (msgpack bodies) for gateways and trainers."""
    _serve(db, host, port)


def _sql_pool(url: str, read_only: bool = False):  # noqa: ANN202 - a SqlPool
    from stepline.datapool import open_pool
    from stepline.datapool.sql import SqlPool

    if not url.startswith(("sqlite://", "postgresql://", "postgres://")):
        raise click.BadParameter(f"{url!r}: give the database URL (sqlite:///… or postgresql://…), not the service")
    pool = open_pool(url, read_only=read_only)
    assert isinstance(pool, SqlPool)
    return pool


@pool_group.command("export")
@click.argument("db")
@click.argument("out", type=click.Path(dir_okay=False))
def export_command(db: str, out: str) -> None:
    """Write the pool at DB to the file OUT (versioned msgpack stream, zstd)."""
    from stepline.datapool.export import export_pool

    pool = _sql_pool(db, read_only=True)
    try:
        counts = export_pool(pool, out)
    finally:
        pool.close()
    click.echo(f"exported {counts['sessions']} sessions, {counts['calls']} calls, {counts['rewards']} rewards,"
               f" {counts['groups']} groups to {out}")


@pool_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("db")
def import_command(file: str, db: str) -> None:
    """Load the export FILE into the pool at DB (its sessions must be new there)."""
    from stepline.datapool.export import import_pool

    pool = _sql_pool(db)
    try:
        counts = import_pool(file, pool)
    except PoolError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        pool.close()
    click.echo(f"imported {counts['sessions']} sessions, {counts['calls']} calls, {counts['rewards']} rewards,"
               f" {counts['groups']} groups into {db}")


@pool_group.command("show")
@click.argument("session")
@click.option("--db", required=True, help="Pool URL: database, service or export file.")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), help="Decode tokens with this tokenizer.")
@click.option("--leaf-rule", type=click.Choice(["all", "drop_superseded", "main"]), default="drop_superseded",
              show_default=True)
def show_command(session: str, db: str, tokenizer: str | None, leaf_rule: str) -> None:
    """Print SESSION's tree: steps, token counts, rewards, versions, which leaves train."""
    from rich.console import Console

    from stepline.datapool import open_pool
    from stepline.datapool.show import Decode, render_episode

    decode: Decode | None = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        decode = lambda ids: str(tok.decode(ids))  # noqa: E731
    pool = open_pool(db, read_only=True)
    try:
        episode = pool.get_episode(session, leaf_rule)  # type: ignore[arg-type]
        forks = [info for info in pool.list_sessions() if info.fork_of and info.fork_of.session_id == session]
    except PoolError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        pool.close()
    Console().print(render_episode(episode, decode, forks))
