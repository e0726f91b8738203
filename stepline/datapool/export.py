"""Export / import a pool: a versioned, zstd-compressed stream of msgpack maps (lossless).

Format `stepline-pool` version 1. One zstd frame holding consecutive msgpack objects, arrays as the
msgpack ext types of `stepline.datapool.wire` (1: int32 LE, 2: float32 LE):

    {"format": "stepline-pool", "version": 1, "created_at": <unix s>}            header, first
    {"t": "session", "info": {SessionInfo fields}, "claim": <group id | nil>}
    {"t": "call", "session_id", "call_index", "base_call", "base_len",            in insertion order;
     "new_prompt": int32[], "output": int32[], "logprobs": float32[],            the prompt is the first
     "weight_version", "finish_reason", "api", "sampling", "timings",            base_len tokens of call
     "version_spans": [[start, version]…] (empty: one version; absent in older   base_call's prompt+output,
     files), "request": bin|nil, "response": bin|nil, "digest": bin}              then new_prompt
    {"t": "reward", "session_id", "value", "step": int|nil, "name", "weight", "created_at"}
    {"t": "group", "group_id", "group_key", "consumer", "state", "min_version", "created_at"}
    {"t": "end", "sessions": n, "calls": n, "rewards": n, "groups": n}           trailer, last

A session's calls and rewards follow its session map. A reader refuses another format or a newer
version, and a stream without its trailer (truncated).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zstandard

from stepline.datapool import wire
from stepline.datapool.base import InvalidRecord, PoolError
from stepline.datapool.requests import WholeRequests
from stepline.datapool.sql import SESSION_COLUMNS, TERMINAL, SqlPool, _floats, _ids, _session, spans_of
from stepline.datapool.tree import StoredCall, replay
from stepline.datapool.validation import check_session

FORMAT = "stepline-pool"
VERSION = 1
PLURAL = {"session": "sessions", "call": "calls", "reward": "rewards", "group": "groups"}
CALL_COLUMNS = ("call_index, base_call, base_len, new_prompt, output, logprobs, weight_version, finish_reason,"
                " api, extra, request, response, digest")


def _records(pool: SqlPool) -> Iterator[dict[str, Any]]:
    counts = {"sessions": 0, "calls": 0, "rewards": 0, "groups": 0}
    with pool._transaction(write=False) as cur:
        sessions = pool._x(cur, f"SELECT {SESSION_COLUMNS}, claim FROM sessions ORDER BY sid").fetchall()
        for row in sessions:
            sid, info = int(row[0]), _session(row[:-1])
            yield {"t": "session", "info": info, "claim": row[-1]}
            requests = WholeRequests()  # bodies stored as deltas are exported whole
            for c in pool._x(cur, f"SELECT {CALL_COLUMNS} FROM calls WHERE sid = ? ORDER BY ord", (sid,)).fetchall():
                yield _call_record(info.session_id, c, requests)
                counts["calls"] += 1
            for reward in pool._rewards(cur, sid, info.session_id):
                yield {"t": "reward", **wire.to_wire(reward)}
                counts["rewards"] += 1
            counts["sessions"] += 1
        for g in pool._x(cur, "SELECT group_id, group_key, consumer, state, min_version, created_at FROM groups"
                         " ORDER BY created_at, group_id").fetchall():
            yield {"t": "group", **dict(zip(("group_id", "group_key", "consumer", "state", "min_version",
                                             "created_at"), g, strict=True))}
            counts["groups"] += 1
    yield {"t": "end", **counts}


def _call_record(session_id: str, c: tuple, requests: WholeRequests) -> dict[str, Any]:
    index, base_call, base_len, prompt, output, logprobs, version, finish, api, extra, req, resp, digest = c
    meta = msgpack.unpackb(bytes(extra))
    req = requests.whole(int(index), None if req is None else bytes(req), meta)
    return {"t": "call", "session_id": session_id, "call_index": int(index), "base_call": int(base_call),
            "base_len": int(base_len), "new_prompt": _ids(prompt), "output": _ids(output),
            "logprobs": _floats(logprobs), "weight_version": int(version), "finish_reason": finish, "api": api,
            "sampling": meta["sampling"], "timings": meta["timings"], "version_spans": spans_of(meta),
            "request": None if req is None else bytes(req), "response": None if resp is None else bytes(resp),
            "digest": bytes(digest)}


def export_pool(pool: SqlPool, out: str | Path) -> dict[str, int]:
    """Write the whole pool to `out`; returns the trailer's counts."""
    packer = msgpack.Packer(default=wire._default, use_bin_type=True)
    with open(out, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as z:
        z.write(packer.pack({"format": FORMAT, "version": VERSION, "created_at": time.time()}))
        for record in _records(pool):
            z.write(packer.pack(wire.to_wire(record)))
    return {k: v for k, v in record.items() if k != "t"}


def read_export(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of an export file after its header (trailer included); checks format and version."""
    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z:
        try:
            unpacker = wire.unpacker(z)
            header = next(unpacker, None)
        except (zstandard.ZstdError, msgpack.UnpackException, ValueError) as exc:
            raise PoolError(f"{path}: not a Stepline pool export ({exc})") from exc
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise PoolError(f"{path}: not a Stepline pool export")
        if header.get("version", 0) > VERSION:
            raise PoolError(f"{path}: export format version {header['version']} is newer than {VERSION}")
        last = None
        try:
            for last in unpacker:
                yield last
        except (zstandard.ZstdError, msgpack.UnpackException, ValueError) as exc:
            raise PoolError(f"{path}: corrupt export ({exc})") from exc
        if not isinstance(last, dict) or last.get("t") != "end":
            raise PoolError(f"{path}: truncated export (no trailer)")


def import_pool(path: str | Path, pool: SqlPool) -> dict[str, int]:
    """Load an export into `pool` (one transaction; sessions must not exist there yet)."""
    pool._writable()
    counts = {"sessions": 0, "calls": 0, "rewards": 0, "groups": 0}
    with pool._transaction(write=True) as cur:
        current: tuple[int, str] | None = None
        stored: list[StoredCall] = []
        for rec in read_export(path):
            kind = rec.get("t")
            if kind in ("session", "group", "end") and current is not None:
                _finish_session(pool, cur, current, stored)
                current, stored = None, []
            if kind == "session":
                current = _insert_session(pool, cur, rec)
            elif kind == "call":
                stored.append(_insert_call(pool, cur, current, rec, len(stored)))
            elif kind == "reward":
                _insert_reward(pool, cur, current, rec)
            elif kind == "group":
                pool._x(cur, "INSERT INTO groups (group_id, group_key, consumer, state, min_version, created_at)"
                        " VALUES (?, ?, ?, ?, ?, ?)", tuple(rec[k] for k in (
                            "group_id", "group_key", "consumer", "state", "min_version", "created_at")))
            if kind in PLURAL:
                counts[PLURAL[kind]] += 1
    pool._trees.clear()
    return counts


def _insert_session(pool: SqlPool, cur: Any, rec: dict) -> tuple[int, str]:
    info = wire.decode_session(rec["info"])
    check_session(info)
    if pool._x(cur, "SELECT 1 FROM sessions WHERE session_id = ?", (info.session_id,)).fetchone():
        raise InvalidRecord(f"session {info.session_id!r} already exists in the target pool")
    row = pool._x(cur, "INSERT INTO sessions (session_id, task_id, harness, group_id, group_key, metadata, status,"
                  " created_at, ended_at, claim, purpose) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING sid",
                  (info.session_id, info.task_id, info.harness, info.group_id, info.group_key,
                   msgpack.packb(info.metadata), info.status, info.created_at, info.ended_at, rec["claim"],
                   info.purpose)).fetchone()
    return int(row[0]), info.session_id


def _insert_call(pool: SqlPool, cur: Any, current: tuple[int, str] | None, rec: dict, ord_: int) -> StoredCall:
    if current is None or rec["session_id"] != current[1]:
        raise PoolError("corrupt export: a call outside its session")
    call = StoredCall(rec["call_index"], rec["base_call"], rec["base_len"], np.asarray(rec["new_prompt"], np.int32),
                      np.asarray(rec["output"], np.int32), np.asarray(rec["logprobs"], np.float32),
                      rec["weight_version"], [(int(a), int(v)) for a, v in rec.get("version_spans", ())])
    extra = msgpack.packb({"sampling": rec["sampling"], "timings": rec["timings"],
                           **({"version_spans": call.version_spans} if call.version_spans else {})})
    pool._insert_calls(cur, [(current[0], ord_, call.call_index, call.base_call,
                              call.base_len, call.new_prompt.astype("<i4").tobytes(),
                              call.output_ids.astype("<i4").tobytes(), call.output_logprobs.astype("<f4").tobytes(),
                              call.weight_version, rec["finish_reason"], rec["api"], extra, rec["request"],
                              rec["response"], rec["digest"])])
    return call


def _insert_reward(pool: SqlPool, cur: Any, current: tuple[int, str] | None, rec: dict) -> None:
    if current is None or rec["session_id"] != current[1]:
        raise PoolError("corrupt export: a reward outside its session")
    step = TERMINAL if rec["step"] is None else rec["step"]
    pool._x(cur, "INSERT INTO rewards (sid, step, name, value, weight, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (current[0], step, rec["name"], rec["value"], rec["weight"], rec["created_at"]))
    if step == TERMINAL:
        pool._x(cur, "UPDATE sessions SET has_terminal = 1 WHERE sid = ?", (current[0],))


def _finish_session(pool: SqlPool, cur: Any, current: tuple[int, str], stored: list[StoredCall]) -> None:
    """Check that the calls replay into a tree, then set the session's call count and oldest version."""
    try:
        replay(current[1], stored)
    except (ValueError, KeyError, IndexError) as exc:
        raise PoolError(f"corrupt export: session {current[1]!r} does not replay ({exc})") from exc
    versions = [v for c in stored for _, v in (c.version_spans or [(0, c.weight_version)])]
    pool._x(cur, "UPDATE sessions SET n_calls = ?, min_version = ? WHERE sid = ?",
            (len(stored), min(versions) if versions else None, current[0]))


def load_export(path: str | Path) -> SqlPool:
    """An export file as an in-memory pool, read-only (claims allowed, kept in memory only)."""
    from stepline.datapool.sqlite import SqlitePool

    pool = SqlitePool(":memory:")
    import_pool(path, pool)
    pool.read_only, pool.claims_in_memory = True, True
    return pool
