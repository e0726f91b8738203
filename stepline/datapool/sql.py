"""The embedded pool: one implementation of `Pool` over SQL, with SQLite and PostgreSQL dialects.

Storage keeps each call's *new* tokens only (`calls.new_prompt`, `calls.output`, `calls.logprobs`,
packed little-endian int32/float32) and a reference to where its prompt's shared prefix comes from
(`base_call`, `base_len`: the first base_len tokens of call base_call's prompt + output). A session's
tree is rebuilt by replaying its calls in insertion order (`calls.ord`); a bounded cache keeps recent
trees so an insert costs O(new tokens) of writing. Observation tokens cost 4 bytes, action tokens 8.

The gateway sends a turn that extends an earlier call as a delta of it (`CallRecord.parent`, `prefix_len`,
`prefix_check`, `request_prefix`): its prompt is rebuilt from the tree before it is inserted (or the batch is
refused, InvalidRecord, naming what does not match), and its request body is stored as sent, the bytes after
the parent's (stepline.datapool.requests); reads rebuild whole prompts and bodies.

Consistency: a batch of calls is one transaction. Writers lock the sessions they extend (SQLite: the
database write lock, PostgreSQL: `SELECT … FOR UPDATE`) and check that their cached tree has as many
calls as the database, rebuilding it otherwise, so several writers on one session stay consistent.
Claims are serialised (SQLite write lock / a PostgreSQL advisory lock), so a group is never handed to
two consumers. Re-sending an acknowledged call (same session, call_index and content) is a no-op, so
clients may retry a batch whose answer was lost.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from stepline.datapool.base import InvalidRecord, PoolError, ReadOnlyPool, UnknownSession
from stepline.datapool.records import (
    END_REASON_KEY,
    NO_VERSION,
    CallRecord,
    EpisodeData,
    Group,
    LeafRule,
    Reward,
    SessionInfo,
    SessionTree,
    legacy_purpose,
)
from stepline.datapool.requests import REQUEST_LEN, REQUEST_OF, WholeRequests, body_len
from stepline.datapool.steps import LEAF_RULES, build_episode
from stepline.datapool.tree import RadixTree, StoredCall, delta_prompt, full_prompt, replay
from stepline.datapool.validation import MAX_REWARD, check_call, check_end_status, check_reward, check_session

SCHEMA_VERSION = 3  # 2: sessions.purpose, 3: sessions.lease_until (older pools are migrated when opened writable)
TERMINAL = -1  # rewards.step of a terminal reward (NULL would defeat the unique key)
CLAIM_LOCK = 7_301_001  # PostgreSQL advisory lock id serialising claims

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    sid {serial_pk}, session_id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL, harness TEXT NOT NULL,
    group_id TEXT, group_key TEXT NOT NULL, metadata {blob} NOT NULL, status TEXT NOT NULL,
    created_at {real} NOT NULL, ended_at {real},
    n_calls INTEGER NOT NULL DEFAULT 0,  -- calls stored so far (next calls.ord)
    min_version INTEGER,                 -- oldest weight version among its calls (NULL: no calls)
    has_terminal INTEGER NOT NULL DEFAULT 0,
    claim TEXT,                          -- groups.group_id once handed out (or marked stale)
    purpose TEXT NOT NULL DEFAULT 'train',  -- SessionInfo.purpose: train | eval | demo
    lease_until {real}                   -- unix time its gateway's lease lapses (NULL: not leased)
);
CREATE INDEX IF NOT EXISTS sessions_unclaimed ON sessions (claim, group_key);
CREATE TABLE IF NOT EXISTS calls (
    sid BIGINT NOT NULL, ord INTEGER NOT NULL, call_index INTEGER NOT NULL,
    base_call INTEGER NOT NULL, base_len INTEGER NOT NULL,
    new_prompt {blob} NOT NULL, output {blob} NOT NULL, logprobs {blob} NOT NULL,
    weight_version INTEGER NOT NULL, finish_reason TEXT NOT NULL, api TEXT NOT NULL,
    extra {blob} NOT NULL,               -- msgpack map of sampling, timings, request_len, request_of (and version_spans if resumed)
    request {blob}, response {blob},
    digest {blob} NOT NULL,              -- blake2b of the record's tokens as sent (idempotent re-sends)
    PRIMARY KEY (sid, call_index)
);
CREATE UNIQUE INDEX IF NOT EXISTS calls_order ON calls (sid, ord);
CREATE TABLE IF NOT EXISTS rewards (
    sid BIGINT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value {real} NOT NULL,
    weight {real} NOT NULL, created_at {real} NOT NULL, PRIMARY KEY (sid, step, name)
);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY, group_key TEXT NOT NULL, consumer TEXT NOT NULL,
    state TEXT NOT NULL,                 -- claimed | consumed | stale
    min_version INTEGER, created_at {real} NOT NULL
);
"""

SESSION_COLUMNS = "sid, session_id, task_id, harness, group_id, metadata, status, created_at, ended_at, purpose"


@dataclass(frozen=True)
class Dialect:
    """What differs between the SQL engines: types in the schema, placeholders, locking."""

    name: str
    serial_pk: str
    blob: str
    real: str
    placeholder: str  # "?" or "%s"
    lock_rows: str  # suffix that locks selected rows for the transaction ("" where the DB is locked)
    has_meta: str  # a query answering one row when the pool's tables exist

    def sql(self, query: str) -> str:
        return query if self.placeholder == "?" else query.replace("?", self.placeholder)


SQLITE = Dialect("sqlite", "INTEGER PRIMARY KEY", "BLOB", "REAL", "?", "",
                 "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'")
POSTGRES = Dialect("postgresql", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", "BYTEA",
                   "DOUBLE PRECISION", "%s", " FOR UPDATE", "SELECT 1 WHERE to_regclass('meta') IS NOT NULL")


def _digest(r: CallRecord) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in (r.prompt_ids, r.output_ids, r.output_logprobs):
        h.update(len(part).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(part).tobytes())
    h.update(r.weight_version.to_bytes(8, "little", signed=True))
    for start, version in r.version_spans:  # none for a call of one version: its digest is as before spans
        h.update(start.to_bytes(8, "little") + version.to_bytes(8, "little"))
    if r.is_delta:  # a delta is digested as sent: its prefix is its parent's, digested with the parent
        for n in (r.parent, r.prefix_len, r.prefix_check):
            h.update(n.to_bytes(8, "little", signed=True))
    return h.digest()


def call_extra(r: CallRecord, request: dict[str, Any] | None = None) -> bytes:
    """`calls.extra`: msgpack of the sampling, timings, what `request` notes of the request body
    (stepline.datapool.requests) and (a resumed call's only) version spans."""
    extra: dict[str, Any] = {"sampling": r.sampling, "timings": r.timings, **(request or {})}
    if r.version_spans:
        extra["version_spans"] = r.version_spans
    return msgpack.packb(extra)


def spans_of(extra: dict[str, Any]) -> list[tuple[int, int]]:
    """The version spans a decoded `calls.extra` holds (empty: the call's one version)."""
    return [(int(s), int(v)) for s, v in extra.get("version_spans", ())]


def _ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4").astype(np.int32)


def _floats(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


class SqlPool:
    """`Pool` over a DB-API connection. Subclasses (`stepline.datapool.sqlite`, `stepline.datapool.postgres`) open the
    connection and write `_transaction`; everything else is shared."""

    dialect: Dialect

    def __init__(self, conn: Any, read_only: bool = False, cache_sessions: int = 512) -> None:
        self.conn = conn
        self.read_only = read_only
        self.claims_in_memory = False  # export files opened read-only still allow claims (not persisted)
        self.max_reward = MAX_REWARD  # |value|, |weight|, |value × weight| of a reward at most (URL option max_reward)
        self._trees: OrderedDict[int, RadixTree] = OrderedDict()  # sid -> tree, LRU
        self._cache_sessions = cache_sessions

    # --- plumbing ---

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Any]:
        raise NotImplementedError

    def _x(self, cur: Any, query: str, params: Sequence[Any] = ()) -> Any:
        cur.execute(self.dialect.sql(query), params)
        return cur

    def _open_schema(self) -> None:
        """Create (or migrate) the schema; read-only, only check that this build reads it."""
        if not self.read_only:
            return self._create_schema()
        with self._transaction(write=False) as cur:
            if cur.execute(self.dialect.has_meta).fetchone() is None:
                return
            row = self._x(cur, "SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is not None and int(row[0]) == 1:
            raise PoolError("pool schema version 1 (sessions without a purpose): open it writable once to migrate it")
        if row is not None and int(row[0]) not in (2, SCHEMA_VERSION):  # 2 reads as 3 (leases are written only)
            raise PoolError(f"pool schema version {row[0]} is not supported (this build reads {SCHEMA_VERSION})")

    def _create_schema(self) -> None:
        d = self.dialect
        with self._transaction(write=False) as cur:
            exists = cur.execute(d.has_meta).fetchone() is not None
        with self._transaction(write=True) as cur:
            # DDL only on a fresh pool: on a live one it would take table locks writers deadlock on
            if not exists:
                self._lock_claims(cur)  # PostgreSQL: two processes creating one schema would collide
                for stmt in SCHEMA.format(serial_pk=d.serial_pk, blob=d.blob, real=d.real).split(";"):
                    if stmt.strip():
                        cur.execute(stmt)
            row = self._x(cur, "SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                self._x(cur, "INSERT INTO meta (key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) in (1, 2):
                if int(row[0]) == 1:
                    self._migrate_purpose(cur)
                self._migrate_leases(cur)
            elif int(row[0]) != SCHEMA_VERSION:
                raise PoolError(f"pool schema version {row[0]} is not supported (this build reads {SCHEMA_VERSION})")

    def _migrate_purpose(self, cur: Any) -> None:
        """Schema 1 → 2: add sessions.purpose, read from the metadata keys that marked it before."""
        self._lock_claims(cur)
        cur.execute("ALTER TABLE sessions ADD COLUMN purpose TEXT NOT NULL DEFAULT 'train'")
        rows = self._x(cur, "SELECT sid, metadata FROM sessions").fetchall()
        for sid, metadata in rows:
            purpose = legacy_purpose(msgpack.unpackb(bytes(metadata)))
            if purpose != "train":
                self._x(cur, "UPDATE sessions SET purpose = ? WHERE sid = ?", (purpose, sid))

    def _migrate_leases(self, cur: Any) -> None:
        """Schema 2 → 3: add sessions.lease_until (existing sessions are not leased)."""
        self._lock_claims(cur)
        cur.execute(f"ALTER TABLE sessions ADD COLUMN lease_until {self.dialect.real}")
        self._x(cur, "UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),))

    def _writable(self, claims: bool = False) -> None:
        if self.read_only and not (claims and self.claims_in_memory):
            raise ReadOnlyPool("this pool was opened read-only")

    def _sid(self, cur: Any, session_id: str, lock: bool = False) -> tuple[int, int]:
        """(sid, n_calls) of a session, or UnknownSession."""
        q = "SELECT sid, n_calls FROM sessions WHERE session_id = ?" + (self.dialect.lock_rows if lock else "")
        row = self._x(cur, q, (session_id,)).fetchone()
        if row is None:
            raise UnknownSession(f"unknown session {session_id!r}")
        return int(row[0]), int(row[1])

    def close(self) -> None:
        self._trees.clear()
        self.conn.close()

    # --- writes ---

    def create_session(self, info: SessionInfo) -> None:
        """Register a session. Re-creating one with the same task, harness and group is a no-op."""
        self._writable()
        check_session(info)
        created = info.created_at or time.time()
        with self._transaction(write=True) as cur:
            # ON CONFLICT: two writers creating one session at once both succeed (PostgreSQL)
            self._x(cur, "INSERT INTO sessions (session_id, task_id, harness, group_id, group_key, metadata,"
                    " status, created_at, ended_at, purpose) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (session_id) DO NOTHING",
                    (info.session_id, info.task_id, info.harness, info.group_id, info.group_key,
                     msgpack.packb(info.metadata), info.status, created, info.ended_at, info.purpose))
            row = self._x(cur, "SELECT task_id, harness, group_id FROM sessions WHERE session_id = ?",
                          (info.session_id,)).fetchone()
            if tuple(row) != (info.task_id, info.harness, info.group_id):
                raise InvalidRecord(f"session {info.session_id!r} exists with another task/harness/group")

    def add_calls(self, records: list[CallRecord]) -> None:
        """Insert a batch atomically (all or nothing); each call stores only its new tokens."""
        self._writable()
        records = [check_call(r) for r in records]
        if not records:
            return
        touched: set[int] = set()
        try:
            with self._transaction(write=True) as cur:
                rows, counts, versions = self._prepare_calls(cur, records, touched)
                self._insert_calls(cur, rows)
                for sid, n in counts.items():
                    self._x(cur, "UPDATE sessions SET n_calls = ?, min_version = CASE WHEN min_version IS NULL"
                            " OR min_version > ? THEN ? ELSE min_version END WHERE sid = ?",
                            (n, versions[sid], versions[sid], sid))
        except BaseException:
            for sid in touched:  # the cached trees saw inserts the database did not keep
                self._trees.pop(sid, None)
            raise

    def _prepare_calls(
        self, cur: Any, records: list[CallRecord], touched: set[int]
    ) -> tuple[list[tuple], dict[int, int], dict[int, int]]:
        sessions: dict[str, tuple[int, int]] = {}
        for session_id in sorted({r.session_id for r in records}):  # fixed lock order: no deadlocks
            try:
                sessions[session_id] = self._sid(cur, session_id, lock=True)
            except UnknownSession as exc:
                raise InvalidRecord(f"call for {exc}") from None
        counts = {sid: n for sid, n in sessions.values()}
        # held for the whole batch: the LRU cache may drop a tree while a large batch runs
        trees = {sid: self._tree(cur, sid, name, n) for name, (sid, n) in sessions.items()}
        versions: dict[int, int] = {}
        batch_digests: dict[tuple[int, int], bytes] = {}
        lengths: dict[tuple[int, int], int | None] = {}  # (sid, call) -> its whole request's length, this batch
        rows = []
        for r in records:
            sid = sessions[r.session_id][0]
            tree = trees[sid]
            digest = _digest(r)
            if r.call_index in tree.calls:
                known = batch_digests.get((sid, r.call_index)) or self._stored_digest(cur, sid, r.call_index)
                if known != digest:
                    raise InvalidRecord(f"call {r.call_index} of session {r.session_id!r} already exists"
                                        " with different content")
                continue
            touched.add(sid)
            ins = tree.insert(r.call_index, self._prompt(tree, r), r.output_ids, r.output_logprobs,
                              r.weight_version, r.version_spans)
            batch_digests[(sid, r.call_index)] = digest
            extra = call_extra(r, self._request_meta(cur, sid, r, lengths))
            rows.append((sid, counts[sid], r.call_index, ins.base_call, ins.base_len,
                         ins.new_prompt.astype("<i4").tobytes(), r.output_ids.astype("<i4").tobytes(),
                         r.output_logprobs.astype("<f4").tobytes(), r.weight_version, r.finish_reason, r.api,
                         extra, r.request, r.response, digest))
            counts[sid] += 1
            oldest = min(v for _, v in r.spans)
            versions[sid] = min(versions.get(sid, oldest), oldest)
        return rows, {sid: n for sid, n in counts.items() if sid in versions}, versions

    @staticmethod
    def _prompt(tree: RadixTree, r: CallRecord) -> np.ndarray:
        """The call's whole prompt (a delta's rebuilt from its parent in the tree, or InvalidRecord)."""
        if not r.is_delta:
            return r.prompt_ids
        try:
            return delta_prompt(tree, r)
        except ValueError as exc:
            raise InvalidRecord(f"call {r.call_index} of session {r.session_id!r} is a delta that cannot be "
                                f"rebuilt: {exc}") from None

    def _request_meta(self, cur: Any, sid: int, r: CallRecord, lengths: dict[tuple[int, int], int | None]) -> dict:
        """What `extra` notes of the call's request body (stepline.datapool.requests): its whole length, and for
        a delta body its parent and prefix, or InvalidRecord when the parent's body is shorter than that prefix."""
        length = body_len(r.request, r.request_prefix)
        lengths[(sid, r.call_index)] = length
        meta = {} if length is None else {REQUEST_LEN: length}
        if not r.request_prefix:
            return meta
        key = (sid, r.parent)
        parent_len = lengths[key] if key in lengths else self._stored_request_len(cur, sid, r.parent)
        if length is None or parent_len is None or r.request_prefix > parent_len:
            raise InvalidRecord(f"call {r.call_index} of session {r.session_id!r}: its request cannot be rebuilt: "
                                f"request_prefix {r.request_prefix} with call {r.parent}'s request of "
                                f"{parent_len} bytes, and its own of {length} (a zstd frame that states its size)")
        return {**meta, REQUEST_OF: [r.parent, r.request_prefix]}

    def _stored_request_len(self, cur: Any, sid: int, call_index: int) -> int | None:
        row = self._x(cur, "SELECT extra FROM calls WHERE sid = ? AND call_index = ?", (sid, call_index)).fetchone()
        return None if row is None else msgpack.unpackb(bytes(row[0])).get(REQUEST_LEN)

    def _insert_calls(self, cur: Any, rows: list[tuple]) -> None:
        if rows:
            cur.executemany(self.dialect.sql(
                "INSERT INTO calls (sid, ord, call_index, base_call, base_len, new_prompt, output, logprobs,"
                " weight_version, finish_reason, api, extra, request, response, digest)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"), rows)

    def _stored_digest(self, cur: Any, sid: int, call_index: int) -> bytes:
        row = self._x(cur, "SELECT digest FROM calls WHERE sid = ? AND call_index = ?", (sid, call_index)).fetchone()
        return bytes(row[0])

    def _tree(self, cur: Any, sid: int, session_id: str, n_calls: int) -> RadixTree:
        """The session's tree as of `n_calls` stored calls (cached; rebuilt if another writer added calls)."""
        tree = self._trees.get(sid)
        if tree is None or len(tree) != n_calls:
            rows = self._x(cur, "SELECT call_index, base_call, base_len, new_prompt, output, logprobs,"
                           " weight_version, extra FROM calls WHERE sid = ? ORDER BY ord", (sid,)).fetchall()
            stored = [StoredCall(int(c), int(b), int(n), _ids(p), _ids(o), _floats(lp), int(v),
                                 spans_of(msgpack.unpackb(extra)))
                      for c, b, n, p, o, lp, v, extra in rows]
            try:
                tree = replay(session_id, stored)
            except (ValueError, KeyError, IndexError) as exc:
                raise PoolError(f"session {session_id!r} is corrupt in storage: {exc}") from exc
            self._trees[sid] = tree
        self._trees.move_to_end(sid)
        while len(self._trees) > self._cache_sessions:
            self._trees.popitem(last=False)
        return tree

    def add_reward(self, reward: Reward) -> None:
        """Add (or replace: same session, step and name) a reward; sessions may have ended already."""
        self._writable()
        check_reward(reward, self.max_reward)
        step = TERMINAL if reward.step is None else reward.step
        with self._transaction(write=True) as cur:
            try:
                sid, _ = self._sid(cur, reward.session_id)
            except UnknownSession as exc:
                raise InvalidRecord(f"reward for {exc}") from None
            if step != TERMINAL and self._x(cur, "SELECT 1 FROM calls WHERE sid = ? AND call_index = ?",
                                            (sid, step)).fetchone() is None:
                raise InvalidRecord(f"reward for unknown step {step} of session {reward.session_id!r}")
            self._x(cur, "INSERT INTO rewards (sid, step, name, value, weight, created_at) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (sid, step, name) DO UPDATE SET value = excluded.value,"
                    " weight = excluded.weight, created_at = excluded.created_at",
                    (sid, step, reward.name, float(reward.value), float(reward.weight),
                     reward.created_at or time.time()))
            if step == TERMINAL:
                self._x(cur, "UPDATE sessions SET has_terminal = 1 WHERE sid = ?", (sid,))

    def end_session(self, session_id: str, status: str = "completed") -> None:
        """Mark a session ended (completed | failed | aborted); ending it again only updates the status."""
        self._writable()
        check_end_status(status)
        with self._transaction(write=True) as cur:
            sid, _ = self._sid(cur, session_id)
            self._x(cur, "UPDATE sessions SET status = ?, ended_at = COALESCE(ended_at, ?) WHERE sid = ?",
                    (status, time.time(), sid))

    def abandon_idle(self, idle_seconds: float, keep: Sequence[str] = ()) -> int:
        """End as `abandoned` every open session created more than idle_seconds ago but those in `keep` (the
        gateway's reaper; a gateway that was killed left them open, unreachable), and every open session whose
        lease lapsed. Returns how many."""
        self._writable()
        spared = set(keep)
        with self._transaction(write=True) as cur:
            now = time.time()
            lapsed = self._abandon_lapsed(cur, now)
            rows = self._x(cur, "SELECT sid, session_id, metadata FROM sessions WHERE status = 'open'"
                           " AND created_at < ? AND lease_until IS NULL" + self.dialect.lock_rows,
                           (now - idle_seconds,)).fetchall()
            orphans = [row for row in rows if row[1] not in spared]
            self._abandon(cur, orphans, now, f"open for more than {idle_seconds:g} s and no gateway serves it")
        return lapsed + len(orphans)

    def renew_leases(self, session_ids: Sequence[str], seconds: float) -> list[str]:
        """Lease these open sessions to the caller (a gateway) for `seconds` from now: once a lease lapses
        unrenewed, the session ends as `abandoned` (`end_reason` in its metadata) at the next claim or sweep,
        so a killed gateway's sessions free their groups. Returns those of the ids that are no longer open."""
        self._writable()
        if not session_ids:
            return []
        with self._transaction(write=True) as cur:
            now = time.time()
            self._abandon_lapsed(cur, now)
            wanted = sorted(set(session_ids))  # fixed lock order: no deadlocks
            cur.executemany(self.dialect.sql("UPDATE sessions SET lease_until = ? WHERE session_id = ?"
                                             " AND status = 'open'"), [(now + seconds, sid) for sid in wanted])
            marks = ", ".join("?" * len(wanted))
            open_ = {r[0] for r in self._x(cur, f"SELECT session_id FROM sessions WHERE status = 'open' AND"
                                           f" session_id IN ({marks})", wanted).fetchall()}
        return [sid for sid in wanted if sid not in open_]

    def _abandon_lapsed(self, cur: Any, now: float) -> int:
        """End as abandoned the open sessions whose lease lapsed (their gateway stopped renewing: it died)."""
        rows = self._x(cur, "SELECT sid, session_id, metadata FROM sessions WHERE status = 'open' AND lease_until < ?"
                       + self.dialect.lock_rows, (now,)).fetchall()
        self._abandon(cur, rows, now, "its gateway's lease lapsed (the gateway stopped renewing it)")
        return len(rows)

    def _abandon(self, cur: Any, rows: Sequence[Sequence[Any]], now: float, reason: str) -> None:
        """End (sid, session_id, metadata) rows as abandoned, the reason in their metadata."""
        updates = [(now, msgpack.packb({**msgpack.unpackb(bytes(meta)), END_REASON_KEY: reason}), int(sid))
                   for sid, _, meta in rows]
        cur.executemany(self.dialect.sql("UPDATE sessions SET status = 'abandoned', ended_at = ?, metadata = ?"
                                         " WHERE sid = ?"), updates)

    # --- reads ---

    def get_session(self, session_id: str) -> SessionInfo:
        with self._transaction(write=False) as cur:
            row = self._x(cur, f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = ?",
                          (session_id,)).fetchone()
        if row is None:
            raise UnknownSession(f"unknown session {session_id!r}")
        return _session(row)

    def list_sessions(self, status: str | None = None) -> list[SessionInfo]:
        q = f"SELECT {SESSION_COLUMNS} FROM sessions" + (" WHERE status = ?" if status else "") + " ORDER BY sid"
        with self._transaction(write=False) as cur:
            return [_session(row) for row in self._x(cur, q, (status,) if status else ()).fetchall()]

    def get_tree(self, session_id: str) -> SessionTree:
        with self._transaction(write=False) as cur:
            sid, n_calls = self._sid(cur, session_id)
            return self._tree(cur, sid, session_id, n_calls).snapshot()

    def get_episode(self, session_id: str, leaf_rule: LeafRule = "drop_superseded") -> EpisodeData:
        if leaf_rule not in LEAF_RULES:
            raise InvalidRecord(f"unknown leaf rule {leaf_rule!r}; expected one of {LEAF_RULES}")
        with self._transaction(write=False) as cur:
            row = self._x(cur, f"SELECT {SESSION_COLUMNS}, n_calls FROM sessions WHERE session_id = ?",
                          (session_id,)).fetchone()
            if row is None:
                raise UnknownSession(f"unknown session {session_id!r}")
            sid = int(row[0])
            tree = self._tree(cur, sid, session_id, int(row[-1])).snapshot()
            rewards = self._rewards(cur, sid, session_id)
            calls = self._x(cur, "SELECT call_index, finish_reason, extra FROM calls WHERE sid = ?", (sid,)).fetchall()
        finish = {int(c): fr for c, fr, _ in calls}
        # the trainer divides its logits by the call's sampling temperature (Step.temperature)
        temps = {int(c): float(msgpack.unpackb(extra)["sampling"].get("temperature") or 1.0) for c, _, extra in calls}
        return build_episode(_session(row[:-1]), rewards, tree, leaf_rule, finish, temps)

    def _rewards(self, cur: Any, sid: int, session_id: str) -> list[Reward]:
        rows = self._x(cur, "SELECT step, name, value, weight, created_at FROM rewards WHERE sid = ?"
                       " ORDER BY step, name", (sid,)).fetchall()
        return [Reward(session_id, float(v), None if s == TERMINAL else int(s), n, float(w), float(t))
                for s, n, v, w, t in rows]

    def get_calls(self, session_id: str) -> list[CallRecord]:
        """The session's calls as the gateway recorded them (full prompts rebuilt), in insertion order."""
        with self._transaction(write=False) as cur:
            sid, n_calls = self._sid(cur, session_id)
            tree = self._tree(cur, sid, session_id, n_calls)
            rows = self._x(cur, "SELECT call_index, base_call, base_len, new_prompt, output, logprobs,"
                           " weight_version, finish_reason, api, extra, request, response FROM calls"
                           " WHERE sid = ? ORDER BY ord", (sid,)).fetchall()
        out, requests = [], WholeRequests()
        for c, b, n, p, o, lp, v, fr, api, extra, req, resp in rows:
            meta = msgpack.unpackb(extra)
            request = requests.whole(int(c), None if req is None else bytes(req), meta)
            out.append(CallRecord(session_id, int(c), full_prompt(tree, int(b), int(n), _ids(p)), _ids(o),
                                  _floats(lp), int(v), fr, api, meta["sampling"], meta["timings"],
                                  request, None if resp is None else bytes(resp), spans_of(meta)))
        return out

    def stats(self) -> dict[str, int]:
        with self._transaction(write=False) as cur:
            sessions, open_ = self._x(cur, "SELECT COUNT(*), COALESCE(SUM(CASE WHEN status = 'open' THEN 1"
                                      " ELSE 0 END), 0) FROM sessions").fetchone()
            calls, tokens, act = self._x(cur, "SELECT COUNT(*), COALESCE(SUM(LENGTH(new_prompt) + LENGTH(output)),"
                                         " 0) / 4, COALESCE(SUM(LENGTH(output)), 0) / 4 FROM calls").fetchone()
            rewards = self._x(cur, "SELECT COUNT(*) FROM rewards").fetchone()[0]
            states = dict(self._x(cur, "SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
        return {"sessions": int(sessions), "open_sessions": int(open_), "calls": int(calls),
                "tokens": int(tokens), "action_tokens": int(act), "rewards": int(rewards),
                "groups_claimed": int(states.get("claimed", 0)), "groups_consumed": int(states.get("consumed", 0)),
                "groups_stale": int(states.get("stale", 0))}

    # --- the trainer's side ---

    def claim_groups(
        self,
        consumer: str,
        min_version: int,
        max_groups: int,
        group_size: int | None = None,
        leaf_rule: LeafRule = "drop_superseded",
    ) -> list[Group]:
        """See `stepline.datapool.base.Pool.claim_groups`. A session that failed, aborted or was abandoned without a
        terminal reward is left out of groups (it would otherwise block its key forever)."""
        self._writable(claims=True)
        if leaf_rule not in LEAF_RULES:
            raise InvalidRecord(f"unknown leaf rule {leaf_rule!r}; expected one of {LEAF_RULES}")
        if max_groups < 0 or (group_size is not None and group_size < 1):
            raise InvalidRecord("max_groups must be >= 0 and group_size >= 1")
        claimed: list[tuple[str, str, list[str], int | None]] = []
        with self._transaction(write=True) as cur:
            self._lock_claims(cur)
            if not self.read_only:  # a killed gateway's sessions free their groups with no gateway left to sweep
                self._abandon_lapsed(cur, time.time())
            candidates = self._x(cur, _READY_KEYS, (group_size or 1,)).fetchall()
            for key, oldest in candidates:
                if len(claimed) >= max_groups:
                    break
                stale = oldest is not None and int(oldest) < min_version
                group_id = uuid.uuid4().hex
                members = self._x(cur, "SELECT sid, session_id FROM sessions WHERE claim IS NULL AND group_key = ?"
                                  f" AND {_READY} ORDER BY sid", (key,)).fetchall()
                self._x(cur, "INSERT INTO groups (group_id, group_key, consumer, state, min_version, created_at)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (group_id, key, consumer, "stale" if stale else "claimed", oldest, time.time()))
                cur.executemany(self.dialect.sql("UPDATE sessions SET claim = ? WHERE sid = ?"),
                                [(group_id, sid) for sid, _ in members])
                if not stale:
                    claimed.append((group_id, key, [s for _, s in members], oldest))
        return [Group(gid, key, [self.get_episode(s, leaf_rule) for s in sessions],
                      NO_VERSION if oldest is None else int(oldest))
                for gid, key, sessions, oldest in claimed]

    def _lock_claims(self, cur: Any) -> None:
        """Serialise claims (SQLite's write transaction already does)."""

    def mark_consumed(self, group_ids: list[str], consumer: str) -> None:
        self._writable(claims=True)
        with self._transaction(write=True) as cur:
            for gid in group_ids:
                state = self._group_state(cur, gid, consumer)
                if state not in ("claimed", "consumed"):
                    raise InvalidRecord(f"group {gid!r} is {state}, it cannot be marked consumed")
                self._x(cur, "UPDATE groups SET state = 'consumed' WHERE group_id = ?", (gid,))

    def release_groups(self, group_ids: list[str], consumer: str) -> None:
        self._writable(claims=True)
        with self._transaction(write=True) as cur:
            for gid in group_ids:
                state = self._group_state(cur, gid, consumer)
                if state != "claimed":
                    raise InvalidRecord(f"group {gid!r} is {state}, only claimed groups can be released")
                self._x(cur, "UPDATE sessions SET claim = NULL WHERE claim = ?", (gid,))
                self._x(cur, "DELETE FROM groups WHERE group_id = ?", (gid,))

    def reset_claims(self) -> int:
        """Forget every hand-out (claimed, consumed and stale groups alike) so that a copy of a pool can be
        trained on again from the start: offline replay of a finished run. Returns the sessions freed."""
        self._writable(claims=True)
        with self._transaction(write=True) as cur:
            freed = self._x(cur, "UPDATE sessions SET claim = NULL WHERE claim IS NOT NULL").rowcount
            self._x(cur, "DELETE FROM groups")
        return int(freed)

    def claimed_groups(self, consumer: str) -> list[str]:
        with self._transaction(write=False) as cur:
            rows = self._x(cur, "SELECT group_id FROM groups WHERE consumer = ? AND state = 'claimed'"
                           " ORDER BY created_at, group_id", (consumer,)).fetchall()
        return [str(r[0]) for r in rows]

    def _group_state(self, cur: Any, group_id: str, consumer: str) -> str:
        row = self._x(cur, "SELECT consumer, state FROM groups WHERE group_id = ?" + self.dialect.lock_rows,
                      (group_id,)).fetchone()
        if row is None:
            raise InvalidRecord(f"unknown group {group_id!r}")
        if row[0] != consumer:
            raise InvalidRecord(f"group {group_id!r} was handed to {row[0]!r}, not {consumer!r}")
        return str(row[1])


# A session is ready when it ended and has a terminal reward; failed/aborted/abandoned ones without a
# reward are left out. A key is ready when all its unclaimed, not-left-out sessions are ready.
_READY = "status <> 'open' AND has_terminal = 1"
_READY_KEYS = f"""
SELECT group_key, MIN(min_version) FROM sessions
WHERE claim IS NULL AND NOT (status IN ('failed', 'aborted', 'abandoned') AND has_terminal = 0)
GROUP BY group_key
HAVING SUM(CASE WHEN {_READY} THEN 0 ELSE 1 END) = 0 AND COUNT(*) >= ?
ORDER BY MIN(sid)
"""


def _session(row: Sequence[Any]) -> SessionInfo:
    _, session_id, task, harness, group, metadata, status, created, ended, purpose = row
    return SessionInfo(session_id, task, harness, group, msgpack.unpackb(bytes(metadata)), status,
                       float(created), None if ended is None else float(ended), purpose)
