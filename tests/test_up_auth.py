"""`stepline up --serve-pool`: the engine's control endpoints and the pool service
need the tokens `up` made, which reach the gateway through its environment and show in no argv."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgpack


def test_up_protects_engine_and_pool_and_still_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLINE_POOL", "STEPLINE_ENGINE"))}
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "up", "--model", str(tiny_model_dir), "--port", "0",
                             "--serve-pool", "--state-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "OMP_NUM_THREADS": "1"})
    try:
        lines: list[str] = []
        while not any("OPENAI_BASE_URL" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"up exited: {proc.stderr.read()}"
            lines.append(line)
        text = "".join(lines)
        engine = re.search(r"engine\s+(http://\S+)", text).group(1)
        pool = re.search(r"pool\s+(http://\S+)", text).group(1)
        base = re.search(r"OPENAI_BASE_URL=(\S+)", text).group(1)
        key = re.search(r"OPENAI_API_KEY=(\S+)", text).group(1)
        assert httpx.post(f"{engine}/pause_generation", json={}).status_code == 401
        assert httpx.post(f"{engine}/update_weight_version", json={"new_version": "777"}).status_code == 401
        assert httpx.post(f"{pool}/v1/list_sessions", content=msgpack.packb({})).status_code == 401
        assert httpx.post(f"{pool}/v1/claim_groups", content=msgpack.packb(
            {"consumer": "x", "min_version": 0, "max_groups": 1})).status_code == 401
        reply = httpx.post(f"{base}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text  # the gateway holds the engine's and the pool's tokens
        argv = " ".join(Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
                        for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid))
        assert "TOKEN" not in argv and "--admin-token" not in argv
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    assert proc.returncode == 0


def _child_of(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent


def test_run_hands_the_gateway_its_admin_token_through_the_environment(monkeypatch, tmp_path: Path) -> None:
    """`stepline run` put `--admin-token` in its gateway's argv, readable by anyone through `ps`."""
    import stepline.launch.services
    from stepline.launch.job import JobConfig
    from stepline.launch.phases import RunDir
    from stepline.launch.run import services

    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(stepline.launch.services, "start", lambda name, args, logs, env=None: started.append((args, env or {})))
    monkeypatch.setattr(stepline.launch.services, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(stepline.launch.services, "stop_all", lambda children: None)
    cfg = JobConfig.model_validate({"services": {"engine_url": "http://127.0.0.1:1", "engine_kind": "sglang"}})
    with services(cfg, RunDir(tmp_path), tmp_path, "secret-admin-token"):
        pass
    (argv, env), = started
    assert "secret-admin-token" not in " ".join(argv) and "--admin-token" not in argv
    assert env["STEPLINE_ADMIN_TOKEN"] == "secret-admin-token"
