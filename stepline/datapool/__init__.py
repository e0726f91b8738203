"""The data pool: sessions as radix trees of tokens, rewards, groups; embedded or as a service.

    from stepline.datapool import open_pool
    pool = open_pool("sqlite:///pool.db")      # or postgresql://…, http://host:port, or an export file
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit

from stepline.datapool.base import InvalidRecord, Pool, PoolError, ReadOnlyPool, UnknownSession

if TYPE_CHECKING:
    from stepline.datapool.sql import SqlPool

__all__ = ["open_pool", "replay_pool", "Pool", "PoolError", "InvalidRecord", "UnknownSession", "ReadOnlyPool"]


def open_pool(url: str, read_only: bool = False) -> Pool:
    """Open a pool by URL.

    - `sqlite:///relative.db`, `sqlite:////absolute.db` (SQLAlchemy's convention), `?synchronous=normal`
      to trade power-loss durability for speed; `sqlite:///:memory:` for a throwaway pool;
    - `?create=1` to start a new pool in an empty (0-byte) file, which is otherwise refused as no pool;
    - on either SQL pool, `?max_reward=X`: the bound on a reward's |value|, |weight| and |value × weight|
      (default `validation.MAX_REWARD`, 1e6; beyond it the reward is refused naming the field);
    - `postgresql://user@host:port/db[?schema=NAME]`;
    - `http://host:port`: the pool service (`stepline pool serve`);
    - a path to a SQLite pool database (opened as `sqlite:///` of it);
    - a path to an export file (`stepline pool export`): loaded in memory, read-only (claims allowed,
      not persisted).
    """
    if url.startswith("sqlite://"):
        from stepline.datapool.sqlite import SqlitePool

        url, bound = _max_reward(url)
        parts = urlsplit(url)
        path = url[len("sqlite:///"):].split("?", 1)[0]
        options = dict(parse_qsl(parts.query))
        pool: SqlPool = SqlitePool(path or ":memory:", read_only=read_only,
                                   synchronous=options.get("synchronous", "FULL"), create=options.get("create") == "1")
        pool.max_reward = bound
        return pool
    if url.startswith(("postgresql://", "postgres://")):
        from stepline.datapool.postgres import PostgresPool

        url, bound = _max_reward(url)
        pool = PostgresPool(url, read_only=read_only)
        pool.max_reward = bound
        return pool
    if url.startswith(("http://", "https://")):
        from stepline.datapool.client import PoolClient

        return PoolClient(url, read_only=read_only)
    if os.path.isfile(url):
        from stepline.datapool.sqlite import is_sqlite_file

        if is_sqlite_file(url):  # a pool database named by its path, as `stepline run` prints it
            return open_pool(f"sqlite:///{os.path.abspath(url)}", read_only=read_only)
        from stepline.datapool.export import load_export

        return load_export(url)
    raise PoolError(f"cannot open pool {url!r}: expected sqlite:///…, postgresql://…, http://… or an export file")


def _max_reward(url: str) -> tuple[str, float]:
    """The URL without its `max_reward` option, and the bound (`MAX_REWARD` when absent): the largest |value|,
    |weight| and |value × weight| of a reward the pool accepts."""
    from stepline.datapool.validation import MAX_REWARD

    base, _, rest = url.partition("?")  # not urlunsplit: it drops a slash of sqlite:////absolute.db
    query = parse_qsl(rest)
    given = [v for k, v in query if k == "max_reward"]
    if not given:
        return url, MAX_REWARD
    try:
        bound = float(given[-1])
    except ValueError:
        bound = math.nan
    if not (math.isfinite(bound) and bound > 0):
        raise PoolError(f"max_reward must be a finite number > 0, got {given[-1]!r}")
    kept = urlencode([(k, v) for k, v in query if k != "max_reward"])
    return f"{base}?{kept}" if kept else base, bound


def replay_pool(pool_file: Path, work_dir: Path) -> SqlPool:
    """The pool an offline replay trains from, leaving `pool_file` untouched. A SQLite pool is copied once into
    work_dir/replay-pool.db: a restarted replay continues on that copy, and a fresh copy hands every group out
    again (the stored run consumed them). An export file is loaded in memory, every group handed out."""
    from stepline.datapool.export import load_export
    from stepline.datapool.sqlite import SqlitePool, copy_database, is_sqlite_file

    if not is_sqlite_file(pool_file):
        export = load_export(pool_file)
        export.reset_claims()  # held in memory only
        return export
    copy = Path(work_dir) / "replay-pool.db"
    fresh = not copy.exists()
    if fresh:
        copy_database(pool_file, copy)
    pool = SqlitePool(str(copy.resolve()))
    if fresh:
        pool.reset_claims()
    return pool
