"""The SQLite pool (the embedded default): one file in WAL mode.

`synchronous=FULL` (the default here) makes every acknowledged batch survive a power loss, not only a
killed process; `sqlite:///pool.db?synchronous=normal` trades that for speed (a killed process still
loses nothing acknowledged in WAL mode).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from stepline.datapool.base import PoolCorrupt, PoolError, PoolFull
from stepline.datapool.sql import SQLITE, SqlPool

SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def is_sqlite_file(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def copy_database(src: str | os.PathLike[str], dst: Path) -> None:
    """A consistent copy of the SQLite pool `src` at `dst` (SQLite's backup API: it includes commits still in
    the source's WAL, and `src` is opened read-only); written beside `dst` and renamed, so `dst` is whole."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    with closing(sqlite3.connect(f"file:{src}?mode=ro", uri=True)) as source, closing(sqlite3.connect(tmp)) as copy:
        source.backup(copy)
    tmp.rename(dst)


class SqlitePool(SqlPool):
    dialect = SQLITE

    def __init__(self, path: str, read_only: bool = False, synchronous: str = "FULL", create: bool = False) -> None:
        if synchronous.upper() not in SYNCHRONOUS:
            raise PoolError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
        check_pool_file(path, create)
        self.path = path
        try:
            if read_only and path != ":memory:":
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                                       check_same_thread=False, timeout=30)
            else:
                conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
                # 16 KiB pages: a call row (~3 KB of packed tokens) wastes a quarter of a 4 KiB page;
                # measured 8.3 -> 6.8 bytes per unique token (benchmarks/bench_datapool.py). New files only.
                conn.execute("PRAGMA page_size=16384")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
            conn.execute("PRAGMA busy_timeout=30000")
        except sqlite3.Error as exc:
            raise PoolError(f"cannot open SQLite pool {path!r}: {exc}") from exc
        super().__init__(conn, read_only)
        self._lock = threading.RLock()  # one connection, possibly shared by a service's threads
        self._open_schema()

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Any]:
        with self._lock, _damage_named(self.path):
            cur = self.conn.cursor()
            cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield cur
            except BaseException:
                if self.conn.in_transaction:  # SQLite may have rolled back itself (a full disk)
                    cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")


@contextmanager
def _damage_named(path: str) -> Iterator[None]:
    """SQLite's errors of a damaged or full database, as the pool's (`PoolCorrupt`, `PoolFull`): the first is
    permanent, and neither is a "database is locked" to wait out."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            raise PoolCorrupt(f"the SQLite pool {path} is damaged ({exc}): restore it from a copy, or recover it "
                              "with `sqlite3 FILE .recover`") from exc
        if code is not None and code & 0xFF == sqlite3.SQLITE_FULL:
            raise PoolFull(f"the SQLite pool {path} cannot grow: {exc} (free disk space)") from exc
        raise


def check_pool_file(path: str, create: bool) -> None:
    """Refuse a file that is not a pool before SQLite opens it: an empty one (SQLite would silently start a new
    pool in it; `create` allows that) or one that is not an SQLite database."""
    if path == ":memory:" or not os.path.exists(path):
        return
    if os.path.getsize(path) == 0:
        if create:
            return
        raise PoolError(f"the pool file {path} is empty (0 bytes), not a pool: if a new pool is meant, open "
                        f"sqlite:///{path}?create=1 (or delete the file)")
    if not is_sqlite_file(path):
        raise PoolCorrupt(f"the pool file {path} is not an SQLite database: name the right file, or move this one "
                          "away to start a new pool")
