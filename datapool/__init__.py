"""The data pool: sessions as radix trees of tokens, rewards, groups; embedded or as a service.

    from datapool import open_pool
    pool = open_pool("sqlite:///pool.db")      # or postgresql://…, http://host:port, or an export file
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlsplit

from datapool.base import InvalidRecord, Pool, PoolError, ReadOnlyPool, UnknownSession

__all__ = ["open_pool", "Pool", "PoolError", "InvalidRecord", "UnknownSession", "ReadOnlyPool"]


def open_pool(url: str, read_only: bool = False) -> Pool:
    """Open a pool by URL.

    - `sqlite:///relative.db`, `sqlite:////absolute.db` (SQLAlchemy's convention), `?synchronous=normal`
      to trade power-loss durability for speed; `sqlite:///:memory:` for a throwaway pool;
    - `postgresql://user@host:port/db[?schema=NAME]`;
    - `http://host:port`: the pool service (`stepline pool serve`);
    - a path to a SQLite pool database (opened as `sqlite:///` of it);
    - a path to an export file (`stepline pool export`): loaded in memory, read-only (claims allowed,
      not persisted).
    """
    if url.startswith("sqlite://"):
        from datapool.sqlite import SqlitePool

        parts = urlsplit(url)
        path = url[len("sqlite:///"):].split("?", 1)[0]
        options = dict(parse_qsl(parts.query))
        return SqlitePool(path or ":memory:", read_only=read_only, synchronous=options.get("synchronous", "FULL"))
    if url.startswith(("postgresql://", "postgres://")):
        from datapool.postgres import PostgresPool

        return PostgresPool(url, read_only=read_only)
    if url.startswith(("http://", "https://")):
        from datapool.client import PoolClient

        return PoolClient(url, read_only=read_only)
    if os.path.isfile(url):
        if _is_sqlite(url):  # a pool database named by its path, as `stepline run` prints it
            return open_pool(f"sqlite:///{os.path.abspath(url)}", read_only=read_only)
        from datapool.export import load_export

        return load_export(url)
    raise PoolError(f"cannot open pool {url!r}: expected sqlite:///…, postgresql://…, http://… or an export file")


def _is_sqlite(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(16) == b"SQLite format 3\x00"
