"""The PostgreSQL pool (psycopg 3): several writers and machines on one database.

`postgresql://user@host:port/db?schema=NAME` keeps the pool's tables in schema NAME (created if
missing); tests use a fresh schema each.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from stepline.datapool.base import PoolCorrupt, PoolError, PoolFull
from stepline.datapool.sql import CLAIM_LOCK, POSTGRES, SqlPool


def split_schema(url: str) -> tuple[str, str | None]:
    """Remove the `schema` query parameter from a PostgreSQL URL: (url, schema)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    schema = next((v for k, v in query if k == "schema"), None)
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit(parts._replace(query=rest)), schema


class PostgresPool(SqlPool):
    dialect = POSTGRES

    def __init__(self, url: str, read_only: bool = False) -> None:
        url, schema = split_schema(url)
        try:
            conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
            if schema:
                if not read_only:
                    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        except psycopg.Error as exc:
            raise PoolError(f"cannot open PostgreSQL pool: {exc}") from exc
        super().__init__(conn, read_only)
        self._lock = threading.RLock()
        self._open_schema()

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Any]:
        try:
            with self._lock, self.conn.transaction(), self.conn.cursor() as cur:
                if not write:  # several statements, one snapshot
                    cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield cur
        except psycopg.errors.DiskFull as exc:  # SQLSTATE 53100
            raise PoolFull(f"the PostgreSQL pool cannot grow: {exc} (free disk space)") from exc
        except (psycopg.errors.DataCorrupted, psycopg.errors.IndexCorrupted) as exc:  # XX001, XX002
            raise PoolCorrupt(f"the PostgreSQL pool is damaged: {exc}") from exc

    def _lock_claims(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (CLAIM_LOCK,))
