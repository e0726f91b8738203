"""Faults: the service's error answers, an unreachable service, kill -9 mid-stream, concurrent writers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
from pool_helpers import ServiceThread, call, session

from stepline.datapool import InvalidRecord, PoolError, open_pool
from stepline.datapool.client import PoolClient, PoolUnavailable
from stepline.datapool.records import SessionInfo
from stepline.datapool.steps import ROOT


def test_service_answers_bad_requests_with_4xx(tmp_path):
    with ServiceThread(f"sqlite:///{tmp_path}/p.db") as service:
        http = httpx.Client(base_url=service.url)
        cases = [("/v1/add_calls", b"\xc1 not msgpack", 400), ("/v1/nope", msgpack.packb({}), 404),
                 ("/v1/get_session", msgpack.packb({}), 400), ("/v1/get_session", msgpack.packb([1]), 400),
                 ("/v1/get_session", msgpack.packb({"session_id": "zz"}), 404),
                 ("/v1/create_session", msgpack.packb({"info": {"session_id": "s"}}), 400)]
        for path, content, status in cases:
            r = http.post(path, content=content)
            assert r.status_code == status, (path, r.content)
            assert msgpack.unpackb(r.content)["error"]["message"]
        http.close()
        client = PoolClient(service.url)
        client.create_session(session("s"))
        with pytest.raises(InvalidRecord, match="2 logprobs for 1 output tokens"):
            bad = call("s", 0, [1], [2])
            bad.output_logprobs = np.zeros(2, np.float32)
            client.add_calls([bad])
        client.close()


def test_unreachable_service_raises_pool_unavailable_not_pool_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = PoolClient(f"http://127.0.0.1:{port}", attempts=2)
    with pytest.raises(PoolUnavailable) as info:
        client.stats()
    assert not isinstance(info.value, PoolError)  # callers keep the batch and retry
    client.close()


def start_service(db: str, *command: str) -> tuple[subprocess.Popen, str]:
    args = command or ("pool", "serve")
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", *args, "--db", db, "--port", "0"],
                            stdout=subprocess.PIPE, text=True,  # Ctrl-C as in a terminal, even where the
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # suite runs in `&`
    line = proc.stdout.readline()  # "stepline pool: serving … on http://127.0.0.1:PORT"
    assert "serving" in line, line
    return proc, line.rsplit(" ", 1)[1].strip()


def test_pool_without_subcommand_serves_and_stops_on_ctrl_c(tmp_path):
    proc, url = start_service(f"sqlite:///{tmp_path}/p.db", "pool")
    try:
        assert httpx.get(f"{url}/health").json() == {"ok": True}
        client = PoolClient(url)
        client.create_session(session("s"))
        assert client.get_session("s").task_id == "t1"
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_kill_9_mid_stream_keeps_every_acknowledged_write(tmp_path):
    db = f"sqlite:///{tmp_path}/p.db"
    proc, url = start_service(db)
    client = PoolClient(url, attempts=1)
    sessions = [f"s{i}" for i in range(4)]
    for s in sessions:
        client.create_session(session(s))
    acked: list[list[int]] = []  # batches the service acknowledged
    in_flight: list[int] = []
    stop = threading.Event()

    def write() -> None:
        batch_no = 0
        while not stop.is_set():
            # 4 calls per batch, one per session: a second turn extends each session's first
            turn = batch_no
            batch = [call(s, turn, [7] * 50 + list(range(turn * 30)), list(range(turn * 30, turn * 30 + 30)))
                     for s in sessions]
            in_flight[:] = [turn]
            try:
                client.add_calls(batch)
            except PoolUnavailable:
                return
            acked.append([turn])
            batch_no += 1

    writer = threading.Thread(target=write)
    writer.start()
    while len(acked) < 5:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    stop.set()
    writer.join(30)
    client.close()
    assert len(acked) >= 5
    pool = open_pool(db)
    n_acked = len(acked)
    for s in sessions:
        got = [c.call_index for c in pool.get_calls(s)]
        # every acknowledged batch is there; the batch in flight is there entirely or not at all
        assert got in (list(range(n_acked)), list(range(n_acked + 1))), (s, got, n_acked)
        tree = pool.get_tree(s)
        # turn t's prompt is the 50 shared tokens + every earlier answer: each turn adds only its 30
        assert sum(len(n.tokens) for n in tree.nodes) == 50 + 30 * len(got)
    pool.close()


def test_concurrent_writers_and_a_reader_see_consistent_trees(db_url):
    setup = open_pool(db_url)
    setup.create_session(SessionInfo("shared", "t", "h"))
    setup.close()
    records = {}  # call_index -> (prompt, output): writer w writes indices w, w+2, w+4, …
    for w in range(2):
        history = [100 + w]
        for i in range(w, 40, 2):
            output = [w, i, i]
            records[i] = (list(history), output)
            history = history + output + [200 + i]
    errors: list[str] = []
    done = threading.Event()

    def writer(w: int) -> None:
        pool = open_pool(db_url)
        for i in range(w, 40, 2):
            pool.add_calls([call("shared", i, *records[i])])
        pool.close()

    def reader() -> None:
        pool = open_pool(db_url)
        while not done.is_set():
            tree = pool.get_tree("shared")
            by_id = {n.id: n for n in tree.nodes}
            for index, (end, acts) in tree.calls.items():
                path, node = [], end
                while node != ROOT:
                    path[:0] = by_id[node].tokens.tolist()
                    node = by_id[node].parent
                out = [t for a in acts for t in by_id[a].tokens.tolist()]
                if (path, out) != records[index]:
                    errors.append(f"call {index}: {path} + {out}")
        pool.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    read = threading.Thread(target=reader)
    read.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    read.join()
    assert errors == []
    final = open_pool(db_url)
    tree = final.get_tree("shared")
    assert sorted(tree.calls) == list(range(40))
    # each writer's history is a chain: 1 first token + per call 3 output + 1 observation token (not the last)
    assert sum(len(n.tokens) for n in tree.nodes) == 2 * (1 + 20 * 3 + 19)
    final.close()
