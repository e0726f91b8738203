"""The terminal sandbox: confinement, limits, and that nothing outlives a command.

The machine's mode is probed (`detect_mode`): "namespace" enforces every guarantee below; "plain"
(no namespaces) is a best effort, and the tests it cannot pass are skipped with that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stepline.agents.terminal.sandbox import Limits, Sandbox, detect_mode

needs_namespace = pytest.mark.skipif(detect_mode() != "namespace", reason="plain mode: best effort only")
# Guarantees that hold in both modes are also checked in plain mode (as root it drops to a uid of its own).
both_modes = pytest.mark.parametrize("mode", sorted({detect_mode(), "plain"}))


def _box(tmp_path: Path, mode: str | None = None, **limits: float | None) -> Sandbox:
    if (mode or detect_mode()) == "plain":  # plain mode cannot enforce quotas (test_sandbox_quotas.py)
        limits = {"disk_bytes": None, "inodes": None, **limits}
    box = Sandbox(tmp_path / "box", Limits(**limits), mode=mode)  # type: ignore[arg-type]
    box.prepare()
    return box


def _processes_of(uid: int | None) -> list[int]:
    """Live pids owned by the sandbox uid (the uid is unique to this sandbox)."""
    if uid is None:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                pids.append(int(entry.name))
        except FileNotFoundError:
            pass
    return pids


@both_modes
def test_commands_run_in_the_sandbox_directory(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode)
    result = box.run("echo hello > a.txt && cat a.txt && ls")
    assert result.exit_code == 0 and result.output == "hello\na.txt\n"
    assert (box.directory / "a.txt").read_text() == "hello\n"
    box.close()
    assert (tmp_path / "box" / "a.txt").read_text() == "hello\n"  # where the verifier reads it


@pytest.mark.parametrize("mode", [detect_mode(), *(["plain"] if os.geteuid() == 0 else [])])
def test_cd_parent_cannot_write_outside(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode)
    result = box.run("cd .. && touch escaped.txt; cd ../.. && touch escaped.txt")
    assert result.exit_code != 0
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path.parent / "escaped.txt").exists()


@needs_namespace
def test_absolute_paths_cannot_write_outside(tmp_path: Path) -> None:
    box = _box(tmp_path)
    target = f"/tmp/stepline-escape-{uuid.uuid4().hex}"
    result = box.run(f"echo x > {tmp_path}/abs.txt; echo x > {target}; echo x > /etc/escape; echo x > /dev/shm/e")
    assert result.exit_code != 0
    assert not (tmp_path / "abs.txt").exists() and not Path(target).exists()
    assert not Path("/etc/escape").exists() and not Path("/dev/shm/e").exists()


@needs_namespace
def test_secrets_of_the_harness_do_not_reach_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    result = _box(tmp_path).run("env; ls /proc | grep -c '^[0-9]'")
    assert "sk-secret" not in result.output
    assert int(result.output.splitlines()[-1]) <= 5  # sees only its own pid namespace (sh, bash, ls, grep)


@both_modes
def test_sleep_forever_is_killed_at_the_wall_limit(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode, wall_s=1.0)
    started = time.monotonic()
    result = box.run("sleep 1000")
    assert result.timed_out and result.exit_code == -9
    assert time.monotonic() - started < 5
    assert _processes_of(box.uid) == []


@needs_namespace
def test_background_processes_die_with_their_command(tmp_path: Path) -> None:
    box = _box(tmp_path, wall_s=5.0)
    result = box.run("(sleep 1000 &) ; setsid sleep 1000 & echo started")
    assert result.output == "started\n" and not result.timed_out
    assert _processes_of(box.uid) == []


@needs_namespace
def test_fork_bomb_hits_the_process_limit_and_is_cleaned_up(tmp_path: Path) -> None:
    box = _box(tmp_path, wall_s=3.0, processes=32)
    started = time.monotonic()
    box.run(":(){ :|:& };:")
    assert time.monotonic() - started < 10
    assert _processes_of(box.uid) == []
    assert box.run("echo alive").output == "alive\n"  # the sandbox still works afterwards


@both_modes
def test_huge_output_is_truncated_and_the_command_stopped(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode, wall_s=10.0, output_bytes=100)
    started = time.monotonic()
    result = box.run("yes")
    assert result.truncated and not result.timed_out
    assert result.output == "y\n" * 50 + "\n[output truncated]"
    assert time.monotonic() - started < 5


@both_modes
def test_file_size_limit(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode, file_bytes=1 << 20)
    result = box.run("head -c 5000000 /dev/zero > big")
    assert result.exit_code != 0
    assert os.path.getsize(box.directory / "big") <= 1 << 20


@both_modes
def test_memory_limit(tmp_path: Path, mode: str) -> None:
    box = _box(tmp_path, mode, memory_bytes=64 << 20)
    result = box.run("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}")
    assert "200000000" not in result.output


@needs_namespace
def test_commands_die_with_a_killed_harness(tmp_path: Path) -> None:
    """The rollout driver SIGKILLs a harness at its episode timeout: its running command must go too."""
    script = (
        "import sys; from pathlib import Path; from stepline.agents.terminal.sandbox import Sandbox, Limits\n"
        "box = Sandbox(Path(sys.argv[1]), Limits(wall_s=1000)); box.prepare(); print(box.uid, flush=True)\n"
        "box.run('sleep 1000 & sleep 1000')\n"
    )
    harness = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "box")], stdout=subprocess.PIPE, text=True)
    assert harness.stdout is not None
    uid = int(harness.stdout.readline())
    deadline = time.monotonic() + 10
    while len(_processes_of(uid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_of(uid)) >= 2  # both sleeps run
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 5
    while _processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of(uid) == []


@both_modes
def test_symlinks_out_of_the_episode_folder_do_not_survive_close(tmp_path: Path, mode: str) -> None:
    # inside the sandbox these name its read-only view of the system; in the folder the verifier reads after the
    # episode they would name the host's /etc/shadow, /, and the project's files
    box = _box(tmp_path, mode)
    made = box.run("echo hi > f && mkdir d && ln -s /etc/shadow shadow && ln -s / root && ln -s ../.. up"
                   " && ln -s f ok && ln -s ../f d/ok && ln -s ../up d/chain && ln -s /srv/f abs")
    assert made.exit_code == 0, made.output
    box.close()
    out = tmp_path / "box"
    assert sorted(p.name for p in out.iterdir()) == ["d", "f", "ok"]
    assert sorted(p.name for p in (out / "d").iterdir()) == ["ok"]  # the link to a link out is gone too
    assert (out / "ok").is_symlink() and (out / "ok").read_text() == (out / "d" / "ok").read_text() == "hi\n"
