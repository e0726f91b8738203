"""A service started by `stepline up` / `stepline run` dies with its parent, even after kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import sys, time
from pathlib import Path
from stepline.launch.services import PoolSpec, free_port, start, wait_healthy
port = free_port()
child = start("pool", PoolSpec(sys.argv[1], port).to_argv(), Path(sys.argv[2]))
wait_healthy(child, f"http://127.0.0.1:{port}", 60)
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; nobody may be reaping it in a container


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_service_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"sqlite:///{tmp_path / 'p.db'}", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the pool service outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_bound_process_runs_on_and_does_not_pass_the_binding_on() -> None:
    code = ("import os; from stepline.launch.lifeline import PARENT_PID_ENV, die_with_parent; die_with_parent(); "
            "print(os.environ.get(PARENT_PID_ENV))")
    for env in ({}, {"STEPLINE_PARENT_PID": str(os.getpid())}):  # by hand, and started by a live parent
        run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
        assert run.returncode == 0 and run.stdout.strip() == "None", run.stderr


EXEC_PARENT = """
import sys, time
from pathlib import Path
from stepline.launch.services import start
child = start("sleeper", [sys.executable, "-m", "stepline.launch.lifeline", "/bin/sleep", "600"], Path(sys.argv[1]))
print(child.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_program_started_through_the_lifeline_exits_with_its_parent(tmp_path: Path) -> None:
    """What `stepline run` does for vLLM, which cannot call die_with_parent itself."""
    parent = subprocess.Popen([sys.executable, "-c", EXEC_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 20
        while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"/bin/sleep") and time.monotonic() < deadline:
            time.sleep(0.05)  # until the lifeline has become the program
        assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[:2] == [b"/bin/sleep", b"600"]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the program outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
