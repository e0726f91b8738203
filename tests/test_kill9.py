"""Kill -9 under a steady stream of calls: acknowledged records lost = 0.

Real processes on loopback: the fake engine (tests/fakes/engine.py), the pool service and the gateway, or
`stepline up --serve-pool` in front of the fake engine. Harness threads keep calling; every answer
they got (status 200) names a call id, and after the crash and a restart on the same files each of
those ids must be in the pool. Before the spill file, the report lost 4 of 4 (pool down, then the
gateway killed) and 1 of 30 (`up --serve-pool` killed: its pool went first and the gateway dropped
its queue).

The slow tests (`pytest -m slow tests/test_kill9.py`) add the rest of the bar, one per process
killed: no session stays open (orphans end as abandoned) and the trainer's side then gets every completed
group exactly once. Gateway and pool service are killed under a running `stepline train` (which must ride
out the pool's outage, stepline/trainer/claims.py); the whole `up --serve-pool` stack is killed at once and the
claim API is asked after the next `up`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest
import zstandard

from stepline.datapool import open_pool
from stepline.datapool.records import END_REASON_KEY
from stepline.launch.services import GatewaySpec, PoolSpec, free_port, port_of
from stepline.trainer.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("STEPLINE_POOL", "STEPLINE_ENGINE",
                                                                    "STEPLINE_ADMIN"))},
       "OMP_NUM_THREADS": "1", "STEPLINE_ADMIN_TOKEN": "adm"}


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """`argv` (a spec's, stepline/launch/services.py) killable with -9: no lifeline, so it lives on when we go."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:  # a loaded machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy:\n{log.read_text()}")


class Stream:
    """Harness threads, one session each, calling without pause; `acked` holds the id of every answer."""

    def __init__(self, gateway: str, sessions: int = 3, opened: list[dict] | None = None) -> None:
        self.acked: set[str] = set()
        self._stop = threading.Event()
        opened = opened or [open_session(gateway, "t") for _ in range(sessions)]
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in opened]
        for thread in self._threads:
            thread.start()

    def _run(self, session: dict) -> None:
        with httpx.Client(base_url=session["openai_base_url"], timeout=30,
                          headers={"Authorization": f"Bearer {session['api_key']}"}) as client:
            while not self._stop.is_set():
                try:
                    reply = client.post("/chat/completions", json={
                        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
                except httpx.HTTPError:  # the gateway died under the call: not acknowledged
                    time.sleep(0.05)
                    continue
                if reply.status_code == 200:
                    self.acked.add(reply.json()["id"])

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(40)


def open_session(gateway: str, task_id: str) -> dict:
    return httpx.post(f"{gateway}/sessions", json={"task_id": task_id, "harness": "h"},
                      headers={"Authorization": "Bearer adm"}, timeout=10).json()


def recorded_ids(db: Path) -> set[str]:
    """The answer id of every call in the pool (each call stores its answer, zstd'd JSON)."""
    pool = open_pool(f"sqlite:///{db}")
    unzip = zstandard.ZstdDecompressor()
    try:
        return {orjson.loads(unzip.decompress(c.response))["id"]
                for s in pool.list_sessions() for c in pool.get_calls(s.session_id)}
    finally:
        pool.close()


def wait_recorded(db: Path, acked: set[str], timeout: float = 20.0) -> set[str]:
    """The acknowledged ids still missing from the pool once it stops changing (replay is asynchronous)."""
    deadline = time.monotonic() + timeout
    while (missing := acked - recorded_ids(db)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return missing


@contextmanager
def fake_engine(tmp_path: Path) -> Iterator[str]:
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "engine.log"
    proc = spawn([sys.executable, str(ROOT / "tests" / "fakes" / "engine.py"), "--port", port_of(url), "--tokens", "4"], log)
    try:
        healthy(url, proc, log)
        yield url
    finally:
        proc.kill()
        proc.wait()


def pool_service(db: Path, pool_url: str, tmp_path: Path) -> subprocess.Popen:
    """`stepline pool serve` on the SQLite file `db` at `pool_url`, once healthy."""
    proc = spawn(PoolSpec(f"sqlite:///{db}", port_of(pool_url)).to_argv(), tmp_path / "pool.log")
    healthy(pool_url, proc, tmp_path / "pool.log")
    return proc


def test_kill9_gateway_and_pool_service_lose_no_acknowledged_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    db, spill = tmp_path / "pool.db", tmp_path / "stepline.gateway.spill"
    pool_url = f"http://127.0.0.1:{free_port()}"

    def gateway(engine: str) -> tuple[str, subprocess.Popen]:
        url = f"http://127.0.0.1:{free_port()}"
        spec = GatewaySpec((engine,), tiny_model_dir, pool_url, port_of(url), "sglang", spill=spill)
        proc = spawn(spec.to_argv(), tmp_path / "gateway.log")
        healthy(url, proc, tmp_path / "gateway.log")
        return url, proc

    acked: set[str] = set()
    with fake_engine(tmp_path) as engine:
        pool = pool_service(db, pool_url, tmp_path)
        procs = [pool]
        try:
            # 1. the pool is up; the gateway is killed while calls are in flight
            url, gw = gateway(engine)
            procs.append(gw)
            stream = Stream(url)
            time.sleep(1.5)
            gw.kill()
            stream.stop()
            acked |= stream.acked
            # 2. the pool service is killed too, the stream goes on (answers wait for the spill file),
            #    then the gateway is killed
            url, gw = gateway(engine)
            procs.append(gw)
            stream = Stream(url)
            time.sleep(1.0)
            pool.kill()
            time.sleep(3.0)
            gw.kill()
            stream.stop()
            outage = stream.acked
            acked |= outage
            assert spill.stat().st_size > 0  # the calls of the outage are waiting there
            # 3. both come back: the new gateway replays the spill file into the pool
            pool = pool_service(db, pool_url, tmp_path)
            procs.append(pool)
            _, gw = gateway(engine)
            procs.append(gw)
            missing = wait_recorded(db, acked)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert len(acked) > 20 and outage - recorded_ids(db) == set() and len(outage) > 0
    assert missing == set(), f"{len(missing)} of {len(acked)} acknowledged calls lost"


@pytest.mark.slow  # about 25 s: two gateway and two pool-service starts
def test_kill9_a_gateway_started_without_spill_loses_no_acknowledged_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A hand-started `stepline gateway` (no --spill) while its pool service is down, killed with -9: before the
    spill file was on by default it lost 9 of 9 acknowledged calls; its default one (STATE_DIR/gateway-PORT.spill)
    keeps them, and the same gateway started again writes them."""
    db, pool_url = tmp_path / "pool.db", f"http://127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{free_port()}"
    env = {**ENV, "STEPLINE_STATE_DIR": str(tmp_path / "state")}

    def gateway(engine: str) -> subprocess.Popen:
        argv = GatewaySpec((engine,), tiny_model_dir, pool_url, port_of(url), "sglang").to_argv()
        with (tmp_path / "gateway.log").open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        healthy(url, proc, tmp_path / "gateway.log")
        return proc

    with fake_engine(tmp_path) as engine:
        pool = pool_service(db, pool_url, tmp_path)
        procs = [pool]
        try:
            procs.append(gw := gateway(engine))
            stream = Stream(url)
            time.sleep(1.0)
            pool.kill()
            time.sleep(2.0)
            gw.kill()
            stream.stop()
            assert (tmp_path / "state" / f"gateway-{port_of(url)}.spill").stat().st_size > 0
            procs.append(pool := pool_service(db, pool_url, tmp_path))
            procs.append(gateway(engine))
            missing = wait_recorded(db, stream.acked)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert stream.acked and missing == set(), f"{len(missing)} of {len(stream.acked)} acknowledged calls lost"


def _up(model: Path, engine: str, state: Path, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """`stepline up --serve-pool` in front of the fake engine: the process, its gateway URL and what it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "up", "--model", str(model), "--engine",
                             engine, "--engine-kind", "sglang", "--serve-pool", "--port", "0", "--state-dir",
                             str(state), "--admin-token", "adm", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    text = ""
    while "OPENAI_BASE_URL" not in text:
        line = proc.stdout.readline()
        assert line, f"up exited: {text}"
        text += line
    return proc, re.search(r"gateway\s+(http://\S+)", text).group(1), text


def test_kill9_up_serve_pool_loses_no_acknowledged_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with fake_engine(tmp_path) as engine:
        proc, url, _ = _up(tiny_model_dir, engine, state)
        children = _children(proc.pid)
        stream = Stream(url)
        time.sleep(2.0)
        proc.kill()  # every child gets SIGTERM at once (stepline.launch.lifeline); the pool service may go first
        proc.wait()
        for pid in children:
            _wait_gone(pid, 40)
        stream.stop()
        again, _, _ = _up(tiny_model_dir, engine, state)  # the next `up` on the same state dir writes what was spilled
        try:
            missing = wait_recorded(state / "pool.db", stream.acked)
        finally:
            again.send_signal(signal.SIGINT)
            again.wait(60)
    assert len(stream.acked) > 10
    assert missing == set(), f"{len(missing)} of {len(stream.acked)} acknowledged calls lost"


def _children(parent: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(name))
        except OSError:
            pass
    return out


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"child {pid} still running {timeout} s after its parent was killed")


def _play(session: dict, reward: float | None, end: bool) -> None:
    """One call, then (optionally) a terminal reward and the end, as a harness and its verifier would."""
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    reply = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=30, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "go"}]})
    assert reply.status_code == 200, reply.text
    base = session["openai_base_url"].rsplit("/s/", 1)[0]
    if reward is not None:
        assert httpx.post(f"{base}/sessions/{session['session_id']}/reward", json={"value": reward},
                          headers=auth, timeout=30).status_code == 200
    if end:
        assert httpx.post(f"{base}/sessions/{session['session_id']}/end", headers=auth, timeout=30).status_code == 200


def _statuses(db: Path) -> dict[str, str]:
    pool = open_pool(f"sqlite:///{db}")
    try:
        return {s.session_id: s.status for s in pool.list_sessions()}
    finally:
        pool.close()


@pytest.mark.slow  # about a minute: two gateway starts and a trainer (pytest -m slow tests/test_kill9.py)
def test_kill9_gateway_mid_job_orphans_are_abandoned_and_every_group_trains_once(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Finding 4 end to end: a trainer runs while the gateway is killed with sessions open. Those sessions would
    block their groups forever; the next gateway (session_idle_timeout 2 s) ends them as abandoned at start, and
    the trainer, which never stopped, trains every group exactly once: abandoned members with a terminal reward
    in it, those without left out (stepline/datapool/sql.py, the ready rule)."""
    db, spill = tmp_path / "pool.db", tmp_path / "stepline.gateway.spill"

    def gateway(engine: str, idle_timeout: float | None = None) -> tuple[str, subprocess.Popen]:
        url = f"http://127.0.0.1:{free_port()}"
        spec = GatewaySpec((engine,), tiny_model_dir, f"sqlite:///{db}", port_of(url), "sglang", spill=spill,
                           session_idle_timeout=idle_timeout)
        proc = spawn(spec.to_argv(), tmp_path / "gateway.log")
        healthy(url, proc, tmp_path / "gateway.log")
        return url, proc

    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "run"\ngroups_per_update = 1\n'
                   'max_updates = 4\ncheckpoint_every = 1\nmax_staleness = 100\nidle_timeout = 120\nprogress = false\n'
                   f'tensorboard = false\ndynamic_sampling = false\n[pool]\nurl = "sqlite:///{db}"\n')
    procs: list[subprocess.Popen] = []
    with fake_engine(tmp_path) as engine:
        try:
            url, gw = gateway(engine)
            procs.append(gw)
            # every member exists before any ends, so no group can be claimed short of a member
            s = {f"{task}{m}": open_session(url, task) for task in ("t0", "t1", "t2", "t3") for m in "ab"}
            ids = {name: session["session_id"] for name, session in s.items()}
            with (tmp_path / "trainer.log").open("wb") as log:
                trainer = subprocess.Popen([sys.executable, "-m", "stepline.cli", "train", str(job)], cwd=tmp_path,
                                           env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
            procs.append(trainer)
            stream = Stream(url, opened=[s["t2b"], s["t3b"]])  # two harnesses mid-episode when the gateway dies
            for name in ("t0a", "t0b", "t1a", "t1b", "t2a", "t3a"):
                _play(s[name], reward=float(name.endswith("a")), end=True)
            _play(s["t2b"], reward=1.0, end=False)  # rewarded, never ended: abandoned, still trains
            time.sleep(1.0)
            gw.kill()
            stream.stop()
            assert stream.acked and _statuses(db)[ids["t2b"]] == _statuses(db)[ids["t3b"]] == "open"
            time.sleep(2.0)  # the orphans are now older than the next gateway's idle timeout
            _, gw = gateway(engine, idle_timeout=2.0)
            procs.append(gw)
            assert trainer.wait(240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
            missing = wait_recorded(db, stream.acked)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    statuses = _statuses(db)
    assert statuses[ids["t2b"]] == statuses[ids["t3b"]] == "abandoned" and "open" not in statuses.values()
    final = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text())
    trained = sorted(sid for members in final["consumed"].values() for sid in members)
    # 4 groups, each once; the abandoned t3b had no reward, so t3 trained without it
    assert final["update"] == 4 and len(final["consumed"]) == 4 and final["unacked"] == []
    assert trained == sorted(ids[n] for n in ("t0a", "t0b", "t1a", "t1b", "t2a", "t2b", "t3a"))
    pool = open_pool(f"sqlite:///{db}")
    try:
        stats = pool.stats()
    finally:
        pool.close()
    assert stats["groups_consumed"] == 4 and stats["groups_claimed"] == 0
    assert missing == set(), f"{len(missing)} of {len(stream.acked)} acknowledged calls lost"
    print(f"\ngateway kill -9 mid-job: {len(stream.acked)} acknowledged calls of the orphans, all found;"
          f" 4 groups completed, 4 trained once ({len(trained)} sessions)")


@pytest.mark.slow  # about 15 s: one gateway start
def test_kill9_gateway_its_sessions_free_their_groups_once_their_lease_lapses(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A gateway killed with -9 leaves sessions open, and no gateway is left to sweep them: without leases their
    groups stayed unclaimable for session_idle_timeout (24 h). Leased for 2 s, the pool ends them as abandoned
    (with the reason) at the first claim after the lease lapses."""
    db = tmp_path / "pool.db"
    url = f"http://127.0.0.1:{free_port()}"
    with fake_engine(tmp_path) as engine:
        spec = GatewaySpec((engine,), tiny_model_dir, f"sqlite:///{db}", port_of(url), "sglang",
                           spill=tmp_path / "gateway.spill", session_lease=2.0)
        gw = spawn(spec.to_argv(), tmp_path / "gateway.log")
        try:
            healthy(url, gw, tmp_path / "gateway.log")
            s = {f"{task}{m}": open_session(url, task) for task in ("t0", "t1") for m in "ab"}
            for name in ("t0a", "t1a"):
                _play(s[name], reward=1.0, end=True)
            _play(s["t0b"], reward=0.0, end=False)  # rewarded, never ended: abandoned, still trains
            _play(s["t1b"], reward=None, end=False)  # mid-episode: abandoned, left out
            time.sleep(3.0)  # past the lease: a live gateway renews (every third of it), so nothing lapses
            assert set(_statuses(db).values()) == {"open", "completed"}
            gw.kill()
            gw.wait()
        finally:
            gw.kill()
            gw.wait()
    killed = time.monotonic()
    pool = open_pool(f"sqlite:///{db}")
    try:
        groups = []
        while len(groups) < 2 and time.monotonic() - killed < 2.0 + 10.0:  # the lease, and a loaded machine's slack
            groups += pool.claim_groups("trainer", 0, 10)
            time.sleep(0.2)
        members = sorted(e.info.session_id for g in groups for e in g.episodes)
        assert members == sorted(s[n]["session_id"] for n in ("t0a", "t0b", "t1a"))
        orphan = pool.get_session(s["t1b"]["session_id"])
        assert orphan.status == "abandoned" and "lease" in orphan.metadata[END_REASON_KEY]
    finally:
        pool.close()


def _trainer_job(tmp_path: Path, model: Path, pool_url: str, updates: int) -> subprocess.Popen:
    """`stepline train` on one group per update (cwd tmp_path, its output in tmp_path/run)."""
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{model}"\noutput_dir = "run"\ngroups_per_update = 1\n'
                   f'max_updates = {updates}\ncheckpoint_every = 1\nmax_staleness = 100\nidle_timeout = 120\n'
                   'poll_interval = 0.2\nprogress = false\ntensorboard = false\ndynamic_sampling = false\n'
                   f'[pool]\nurl = "{pool_url}"\n')
    with (tmp_path / "trainer.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "stepline.cli", "train", str(job)], cwd=tmp_path,
                                env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)


def _trained(tmp_path: Path) -> tuple[dict, list[str]]:
    """The trainer's final state and the sessions it trained, sorted."""
    final = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text())
    return final, sorted(sid for members in final["consumed"].values() for sid in members)


def _wait_updates(tmp_path: Path, trainer: subprocess.Popen, n: int, timeout: float = 240.0) -> None:
    """Until the trainer has logged n updates (its metrics file, one line per update)."""
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-3000:]
        time.sleep(0.1)


def _pool_stats(db: Path) -> dict[str, int]:
    pool = open_pool(f"sqlite:///{db}")
    try:
        return pool.stats()
    finally:
        pool.close()


@pytest.mark.slow  # about a minute: a trainer beside a gateway and two pool-service starts
def test_kill9_pool_service_mid_job_loses_nothing_and_every_group_trains_once(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The pool service dies (-9) while harnesses call, end their sessions and a trainer claims: the gateway
    answers from its spill file meanwhile, rewards and ends wait; after a restart on the same file every
    acknowledged call is in the pool, every session ended, and the trainer, never restarted, trains each of
    the 4 groups exactly once."""
    db, spill = tmp_path / "pool.db", tmp_path / "stepline.gateway.spill"
    pool_url = f"http://127.0.0.1:{free_port()}"

    procs: list[subprocess.Popen] = []
    with fake_engine(tmp_path) as engine:
        try:
            procs.append(pool := pool_service(db, pool_url, tmp_path))
            url = f"http://127.0.0.1:{free_port()}"
            spec = GatewaySpec((engine,), tiny_model_dir, pool_url, port_of(url), "sglang", spill=spill)
            procs.append(gw := spawn(spec.to_argv(), tmp_path / "gateway.log"))
            healthy(url, gw, tmp_path / "gateway.log")
            s = {f"{task}{m}": open_session(url, task) for task in ("t0", "t1", "t2", "t3") for m in "ab"}
            ids = {name: session["session_id"] for name, session in s.items()}
            procs.append(trainer := _trainer_job(tmp_path, tiny_model_dir, pool_url, updates=4))
            stream = Stream(url, opened=[s["t2b"], s["t3a"], s["t3b"]])
            for name in ("t0a", "t0b", "t1a", "t1b"):
                _play(s[name], reward=1.0 if name.endswith("a") else 0.0, end=True)
            _wait_updates(tmp_path, trainer, 1)  # the trainer is past its start, claiming every 0.2 s
            pool.kill()
            # during the outage: a call answered from the spill file, its reward and end waiting for the pool
            during = threading.Thread(target=_play, args=(s["t2a"], 1.0, True))
            during.start()
            time.sleep(3.0)
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert spill.stat().st_size > 0  # the outage's calls are waiting there
            procs.append(pool_service(db, pool_url, tmp_path))
            during.join(60)
            stream.stop()
            for name in ("t2b", "t3a", "t3b"):
                _play(s[name], reward=float(name.endswith("a")), end=True)
            assert trainer.wait(240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
            missing = wait_recorded(db, stream.acked)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert len(stream.acked) > 20 and missing == set(), f"{len(missing)} of {len(stream.acked)} acknowledged lost"
    assert set(_statuses(db).values()) == {"completed"}
    final, trained = _trained(tmp_path)
    assert final["update"] == 4 and len(final["consumed"]) == 4 and final["unacked"] == []
    assert trained == sorted(ids.values())  # 8 sessions in 4 groups, each trained once
    stats = _pool_stats(db)
    assert stats["groups_consumed"] == 4 and stats["groups_claimed"] == 0
    print(f"\npool service kill -9 mid-job: {len(stream.acked)} calls acknowledged, all found; 4 groups completed,"
          f" 4 trained once ({len(trained)} sessions); trainer outages waited out:"
          f" {(tmp_path / 'trainer.log').read_text().count('pool unavailable')}")


@pytest.mark.slow  # under a minute: two `up` starts
def test_kill9_whole_up_serve_pool_stack_loses_nothing_and_every_group_is_claimed_once(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """`up --serve-pool`, its pool service and its gateway all killed with -9 at once (no SIGTERM, no flush)
    while harnesses call, with two sessions mid-episode; the next `up` on the same state dir
    (`--session-idle-timeout 2`) writes what was spilled, abandons the orphans, and the trainer's claim API
    then hands out each completed group once: every member that ended or was rewarded, nothing twice."""
    state = tmp_path / "state"
    with fake_engine(tmp_path) as engine:
        proc, url, _ = _up(tiny_model_dir, engine, state)
        stack = [*_children(proc.pid), proc.pid]
        s = {f"{task}{m}": open_session(url, task) for task in ("t0", "t1", "t2") for m in "ab"}
        ids = {name: session["session_id"] for name, session in s.items()}
        stream = Stream(url, opened=[s["t1b"], s["t2b"]])
        for name in ("t0a", "t0b", "t1a", "t2a"):
            _play(s[name], reward=float(name.endswith("a")), end=True)
        _play(s["t1b"], reward=1.0, end=False)  # rewarded, never ended: abandoned, still trains
        time.sleep(1.0)
        for pid in stack:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        for pid in stack[:-1]:
            _wait_gone(pid, 40)
        stream.stop()
        before = _statuses(state / "pool.db")  # the killed stack's sessions, its own "manual" one too
        assert before[ids["t1b"]] == before[ids["t2b"]] == "open"
        time.sleep(2.0)  # older than the next gateway's idle timeout
        again, _, text = _up(tiny_model_dir, engine, state, "--session-idle-timeout", "2")
        try:
            missing = wait_recorded(state / "pool.db", stream.acked)
            statuses = _wait_statuses(state / "pool.db", set(before))
            groups = _claim_all(state / "pool.db")
        finally:
            again.send_signal(signal.SIGINT)
            again.wait(60)
    assert len(stream.acked) > 10 and missing == set(), f"{len(missing)} of {len(stream.acked)} acknowledged lost"
    fresh = re.search(r"OPENAI_BASE_URL=\S*/s/([^/\s]+)/v1", text).group(1)  # the next `up`'s own, live session
    assert [sid for sid, status in statuses.items() if status == "open"] == [fresh]
    assert statuses[ids["t1b"]] == statuses[ids["t2b"]] == "abandoned"
    # 3 groups once each; the abandoned t2b had no reward, so t2 is t2a alone; a second claim gets nothing
    expected = [[ids["t0a"], ids["t0b"]], [ids["t1a"], ids["t1b"]], [ids["t2a"]]]
    assert sorted(sorted(g) for g in groups[0]) == sorted(sorted(g) for g in expected)
    assert groups[1] == []
    print(f"\nup --serve-pool stack kill -9: {len(stream.acked)} calls acknowledged, all found; 3 groups completed,"
          f" 3 claimed once ({sum(map(len, groups[0]))} sessions)")


def _wait_statuses(db: Path, sessions: set[str], timeout: float = 20.0) -> dict[str, str]:
    """Statuses once none of `sessions` is open any more (the next gateway abandons at start), or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = _statuses(db)
        if all(statuses[sid] != "open" for sid in sessions) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


def _claim_all(db: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The trainer's side of the pool: claim every ready group, mark it consumed, then claim again."""
    pool = open_pool(f"sqlite:///{db}")
    try:
        first = pool.claim_groups("trainer", min_version=0, max_groups=100)
        pool.mark_consumed([g.group_id for g in first], "trainer")
        second = pool.claim_groups("trainer", min_version=0, max_groups=100)
    finally:
        pool.close()
    return ([[e.info.session_id for e in g.episodes] for g in first],
            [[e.info.session_id for e in g.episodes] for g in second])
