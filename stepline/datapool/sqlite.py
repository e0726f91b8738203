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

from stepline.datapool.base import PoolError
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

    def __init__(self, path: str, read_only: bool = False, synchronous: str = "FULL") -> None:
        if synchronous.upper() not in SYNCHRONOUS:
            raise PoolError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
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
        with self._lock:
            cur = self.conn.cursor()
            cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
