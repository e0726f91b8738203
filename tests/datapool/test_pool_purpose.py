"""`SessionInfo.purpose` (train / eval / demo) in every pool: stored and read back, an unknown value refused
(422 from the service), and the metadata keys that marked it before schema 2 read as the purpose."""

from __future__ import annotations

import sqlite3

import httpx
import msgpack
import pytest
from pool_helpers import ServiceThread

from stepline.datapool import open_pool
from stepline.datapool.base import InvalidRecord, PoolError
from stepline.datapool.records import PURPOSES, SessionInfo, legacy_purpose
from stepline.datapool.sql import SCHEMA_VERSION
from stepline.datapool.wire import decode_session


def test_every_purpose_is_stored_and_read_back(pool) -> None:
    assert PURPOSES == ("train", "eval", "demo")
    for purpose in PURPOSES:
        pool.create_session(SessionInfo(f"s-{purpose}", "t", "h", purpose=purpose))
    pool.create_session(SessionInfo("s-default", "t", "h"))
    assert {s.session_id: s.purpose for s in pool.list_sessions()} == {
        "s-train": "train", "s-eval": "eval", "s-demo": "demo", "s-default": "train"}
    assert pool.get_session("s-eval").purpose == "eval"
    assert pool.get_episode("s-demo").info.purpose == "demo"


def test_an_unknown_purpose_is_refused(pool) -> None:
    with pytest.raises(InvalidRecord, match="purpose must be one of"):
        pool.create_session(SessionInfo("s", "t", "h", purpose="bogus"))  # type: ignore[arg-type]
    assert pool.list_sessions() == []


def test_the_service_answers_422_for_an_unknown_purpose(tmp_path) -> None:
    info = {"session_id": "s", "task_id": "t", "harness": "h", "group_id": None, "metadata": {}, "status": "open",
            "created_at": 0.0, "ended_at": None, "purpose": "training"}
    with ServiceThread(f"sqlite:///{tmp_path}/p.db") as service:
        r = httpx.post(f"{service.url}/v1/create_session", content=msgpack.packb({"info": info}))
        assert r.status_code == 422, r.content
        error = msgpack.unpackb(r.content)["error"]
        assert error["type"] == "InvalidRecord" and "'training'" in error["message"]


def test_a_record_without_purpose_reads_the_old_metadata_keys() -> None:
    # an export or client from before the field: {"eval": true} / {"demo": true} marked the purpose
    old = {"session_id": "s", "task_id": "t", "harness": "h", "metadata": {"eval": True, "split": "test"}}
    assert decode_session(old).purpose == "eval"
    assert decode_session({**old, "metadata": {"demo": True}}).purpose == "demo"
    assert decode_session({**old, "metadata": {}}).purpose == "train"
    assert decode_session({**old, "purpose": "demo"}).purpose == "demo"  # the field wins when present
    assert legacy_purpose({"eval": False}) == "train"


def _as_schema_1(path) -> None:
    """Turn a schema-2 SQLite pool back into what schema 1 wrote: no purpose column."""
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE sessions DROP COLUMN purpose")
        db.execute("ALTER TABLE sessions DROP COLUMN lease_until")
        db.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")


def test_a_schema_1_pool_is_migrated_when_opened_writable(tmp_path) -> None:
    path = tmp_path / "old.db"
    pool = open_pool(f"sqlite:///{path}")
    pool.create_session(SessionInfo("ev", "t", "h", metadata={"eval": True, "split": "test"}))
    pool.create_session(SessionInfo("de", "t", "h", metadata={"demo": True}))
    pool.create_session(SessionInfo("rl", "t", "h", metadata={"attempt": 0}))
    pool.close()
    _as_schema_1(path)
    with pytest.raises(PoolError, match="open it writable once"):
        open_pool(f"sqlite:///{path}", read_only=True)
    pool = open_pool(f"sqlite:///{path}")
    try:
        assert {s.session_id: s.purpose for s in pool.list_sessions()} == {"ev": "eval", "de": "demo", "rl": "train"}
        pool.create_session(SessionInfo("new", "t", "h", purpose="eval"))
    finally:
        pool.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),)
    reader = open_pool(f"sqlite:///{path}", read_only=True)
    try:
        assert reader.get_session("new").purpose == "eval"
    finally:
        reader.close()
