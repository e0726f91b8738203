"""A damaged pool says so: a file that is no pool is refused at start, a damaged database answers a permanent
error (never "retry"), a full disk a clear one at once, and the service's /health reports both."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from pool_helpers import ServiceThread

from stepline.datapool import open_pool
from stepline.datapool.base import PoolCorrupt, PoolError, PoolFull, is_unavailable
from stepline.datapool.records import CallRecord, SessionInfo


def _call(sid: str, index: int, prompt: int = 5000) -> CallRecord:
    return CallRecord(sid, index, np.arange(prompt, dtype=np.int32), np.array([3], np.int32),
                      np.array([-0.5], np.float32), 0)


def _damaged(path) -> None:
    """A pool whose later pages (the calls' data; the schema's pages intact) hold garbage, as a bad disk or a stray
    write leaves it."""
    pool = open_pool(f"sqlite:///{path}")
    for i in range(20):
        pool.create_session(SessionInfo(f"s{i}", "t", "h"))
        pool.add_calls([_call(f"s{i}", 0)])
    pool.close()  # the WAL checkpointed into the file
    data = bytearray(path.read_bytes())
    start = len(data) // 2 // 16384 * 16384  # a page boundary in the second half
    data[start:] = bytes((i * 131 + 7) % 251 for i in range(len(data) - start))
    path.write_bytes(bytes(data))


def test_an_empty_file_is_no_pool_unless_asked_to_start_one(tmp_path) -> None:
    empty = tmp_path / "pool.db"
    empty.touch()  # before, it opened silently as a new, empty pool
    with pytest.raises(PoolError, match=r"empty \(0 bytes\), not a pool.*\?create=1"):
        open_pool(f"sqlite:///{empty}")
    pool = open_pool(f"sqlite:///{empty}?create=1")
    pool.create_session(SessionInfo("s", "t", "h"))
    pool.close()
    assert open_pool(f"sqlite:///{empty}").get_session("s").status == "open"  # a pool now


def test_a_file_that_is_not_sqlite_is_refused_at_start(tmp_path) -> None:
    other = tmp_path / "pool.db"
    other.write_text("not a database\n" * 100)
    for url in (f"sqlite:///{other}", f"sqlite:///{other}?create=1"):
        with pytest.raises(PoolCorrupt, match="is not an SQLite database"):
            open_pool(url)
    assert other.read_text().startswith("not a database")  # left as it was


def test_a_damaged_database_is_a_permanent_error(tmp_path) -> None:
    path = tmp_path / "pool.db"
    _damaged(path)
    pool = open_pool(f"sqlite:///{path}")
    try:
        with pytest.raises(PoolCorrupt, match="is damaged") as caught:
            for i in range(20):
                pool.get_calls(f"s{i}")
        assert not is_unavailable(caught.value)  # no writer waits it out as an outage
    finally:
        pool.close()


def test_the_service_answers_a_damaged_database_once_and_health_says_so(tmp_path) -> None:
    path = tmp_path / "pool.db"
    _damaged(path)
    with ServiceThread(f"sqlite:///{path}") as service:
        client = open_pool(service.url)
        try:
            assert httpx.get(f"{service.url}/health").json() == {"ok": True}
            with pytest.raises(PoolCorrupt, match="is damaged"):  # it was 503 "retry", forever
                for i in range(20):
                    client.get_calls(f"s{i}")
            health = httpx.get(f"{service.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert "PoolCorrupt" in health.json()["pool"]
        finally:
            client.close()


def test_a_full_disk_fails_at_once_with_a_clear_error(tmp_path) -> None:
    # SQLite's max_page_count stands in for the disk: past it, writes fail with SQLITE_FULL as on a full disk
    with ServiceThread(f"sqlite:///{tmp_path / 'pool.db'}") as service:
        client = open_pool(service.url)
        try:
            client.create_session(SessionInfo("s", "t", "h"))
            pages = service.pool.conn.execute("PRAGMA page_count").fetchone()[0]
            service.pool.conn.execute(f"PRAGMA max_page_count = {pages}")
            with pytest.raises(PoolFull, match="cannot grow: database or disk is full") as caught:
                for i in range(50):
                    client.add_calls([_call("s", i)])
            assert is_unavailable(caught.value)  # a writer that must keep its records keeps and retries them
            health = httpx.get(f"{service.url}/health").json()
            assert health["status"] == "degraded" and "PoolFull" in health["pool"]
            service.pool.conn.execute("PRAGMA max_page_count = 1000000")  # space freed
            client.add_calls([_call("s", 60)])
            assert httpx.get(f"{service.url}/health").json() == {"ok": True}
        finally:
            client.close()
