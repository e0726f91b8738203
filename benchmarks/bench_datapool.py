"""Data pool benchmark: ingest rate per backend, bytes per unique token, storage vs full prompts.

    .venv/bin/python benchmarks/bench_datapool.py [--sessions 200 --turns 10 --batch 100]
    (PostgreSQL is measured when STEPLINE_PG_URL is set, in a throwaway schema.)

Each call adds 500 new tokens (250 observation + 250 sampled); calls are sent in batches across
sessions, as the gateway's recorder does. Targets: >= 2,000 calls/s into SQLite, <= 12 bytes per
unique token, >= 10x less storage than each call's full prompt for a 30-turn session.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, SessionInfo

OBS, ACT, VOCAB = 250, 250, 150_000


def make_calls(n_sessions: int, turns: int, system: int, seed: int = 0, obs: int = OBS, act: int = ACT
               ) -> list[list[CallRecord]]:
    """Calls turn by turn: calls[t] holds turn t of every session (prompt = all earlier tokens + `obs` new)."""
    rng = np.random.default_rng(seed)
    history = {f"s{i}": rng.integers(0, VOCAB, system, dtype=np.int32) for i in range(n_sessions)}
    out = []
    for t in range(turns):
        batch = []
        for sid, hist in history.items():
            prompt = np.concatenate([hist, rng.integers(0, VOCAB, obs, dtype=np.int32)])
            output = rng.integers(0, VOCAB, act, dtype=np.int32)
            logprobs = -rng.random(act, dtype=np.float32)
            batch.append(CallRecord(sid, t, prompt, output, logprobs, weight_version=t))
            history[sid] = np.concatenate([prompt, output])
        out.append(batch)
    return out


def ingest(url: str, calls: list[list[CallRecord]], batch: int) -> tuple[float, dict[str, int]]:
    """calls/s for add_calls in batches of `batch` (sessions created first, not timed)."""
    pool = open_pool(url)
    for rec in calls[0]:
        pool.create_session(SessionInfo(rec.session_id, "task", "harness"))
    flat = [r for turn in calls for r in turn]
    start = time.perf_counter()
    for i in range(0, len(flat), batch):
        pool.add_calls(flat[i: i + batch])
    elapsed = time.perf_counter() - start
    stats = pool.stats()
    pool.close()
    return len(flat) / elapsed, stats


def sqlite_bytes(path: Path) -> int:
    """Bytes the database needs once the WAL is checkpointed and free pages dropped."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("VACUUM")
    conn.close()
    return path.stat().st_size


def full_prompt_bytes(path: Path, calls: list[list[CallRecord]]) -> tuple[int, int]:
    """The naive layout: every call's full prompt + output + logprobs (raw bytes, and as SQLite rows)."""
    raw = sum(4 * len(r.prompt_ids) + 8 * len(r.output_ids) for turn in calls for r in turn)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE calls (session_id TEXT, call_index INTEGER, prompt BLOB, output BLOB, logprobs BLOB)")
    conn.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?)",
                     [(r.session_id, r.call_index, r.prompt_ids.tobytes(), r.output_ids.tobytes(),
                       r.output_logprobs.tobytes()) for turn in calls for r in turn])
    conn.commit()
    conn.close()
    return raw, sqlite_bytes(path)


def pg_url() -> tuple[str, str] | None:
    base = os.environ.get("STEPLINE_PG_URL")
    if not base:
        return None
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    return f"{base}{'&' if '?' in base else '?'}schema={schema}", schema


def pg_drop(schema: str) -> None:
    import psycopg

    with psycopg.connect(os.environ["STEPLINE_PG_URL"], autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def pg_bytes(schema: str) -> int:
    import psycopg

    with psycopg.connect(os.environ["STEPLINE_PG_URL"], autocommit=True) as conn:
        rows = conn.execute("SELECT SUM(pg_total_relation_size(quote_ident(schemaname) || '.'"
                            " || quote_ident(tablename))) FROM pg_tables WHERE schemaname = %s", (schema,)).fetchone()
    return int(rows[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stepline-bench-"))
    calls = make_calls(args.sessions, args.turns, system=0)
    n = args.sessions * args.turns
    print(f"ingest: {args.sessions} sessions x {args.turns} turns = {n} calls of {OBS + ACT} new tokens,"
          f" batches of {args.batch}")
    print(f"{'backend':<28}{'calls/s':>10}{'new tok/s':>12}{'bytes/token':>13}{'vs target':>11}")
    rows = []
    for name, url in [("sqlite (synchronous=FULL)", f"sqlite:///{tmp}/full.db"),
                      ("sqlite (synchronous=NORMAL)", f"sqlite:///{tmp}/normal.db?synchronous=normal")]:
        rate, stats = ingest(url, calls, args.batch)
        size = sqlite_bytes(Path(url[len("sqlite:///"):].split("?")[0]))
        rows.append((name, rate, size / stats["tokens"]))
    pg = pg_url()
    if pg:
        try:
            rate, stats = ingest(pg[0], calls, args.batch)
            rows.append(("postgresql", rate, pg_bytes(pg[1]) / stats["tokens"]))
        finally:
            pg_drop(pg[1])
    else:
        print("  (postgresql skipped: set STEPLINE_PG_URL)")
    rows.append(service_row(tmp, calls, args.batch))
    for name, rate, per_token in rows:
        print(f"{name:<28}{rate:>10,.0f}{rate * (OBS + ACT):>12,.0f}{per_token:>13.2f}{rate / 2000:>10.1f}x")
    print("targets: >= 2,000 calls/s into SQLite (ratio column), <= 12 bytes per unique token")

    print("\n30-turn sessions, 1,000-token system prompt, 500 new tokens per turn; storage per session:")
    print(f"{'turn shape':<34}{'stepline':>10}{'full prompts':>14}{'ratio':>8}{'as SQLite':>11}{'ratio':>8}")
    for obs, act in ((400, 100), (250, 250)):
        long = make_calls(50, 30, system=1000, seed=1, obs=obs, act=act)
        name = f"o{obs}a{act}"
        ingest(f"sqlite:///{tmp}/{name}.db", long, args.batch)
        ours = sqlite_bytes(tmp / f"{name}.db") / 50
        raw, naive = (b / 50 for b in full_prompt_bytes(tmp / f"{name}-naive.db", long))
        print(f"{f'+{obs} observed +{act} sampled':<34}{ours:>10,.0f}{raw:>14,.0f}{raw / ours:>7.1f}x"
              f"{naive:>11,.0f}{naive / ours:>7.1f}x")
    print("target: >= 10x smaller than storing each call's full prompt (+ output and logprobs) at 30 turns")


def service_row(tmp: Path, calls: list[list[CallRecord]], batch: int) -> tuple[str, float, float]:
    """The same ingest through the pool service (HTTP + msgpack) over SQLite."""
    import subprocess

    db = f"sqlite:///{tmp}/service.db"
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "pool", "serve", "--db", db, "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().rsplit(" ", 1)[1].strip()  # type: ignore[union-attr]
        rate, stats = ingest(url, calls, batch)
    finally:
        proc.terminate()
        proc.wait(30)
    return "service -> sqlite (FULL)", rate, sqlite_bytes(tmp / "service.db") / stats["tokens"]


if __name__ == "__main__":
    main()
