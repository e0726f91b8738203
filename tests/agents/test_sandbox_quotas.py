"""Per-episode disk and inode quotas of the terminal sandbox (a runaway writer: 320 MiB written in 0.9 s,
20,000 files, a setuid binary left behind).

The quota is a tmpfs in a mount namespace held by a child of the harness (stepline/agents/terminal/quota.py). The
first version mounted it in the host namespace and every sandbox not closed leaked its mount; so these
tests also look at every process's mount table, after a normal exit and after kill -9.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.agents.terminal import sandbox as sandbox_module
from stepline.agents.terminal.quota import SOURCE
from stepline.agents.terminal.sandbox import Limits, QuotaUnavailable, Sandbox, detect_mode, episode_limits

ROOT = Path(__file__).resolve().parents[2]
needs_namespace = pytest.mark.skipif(detect_mode() != "namespace", reason="quotas need namespace mode")


def _box(tmp_path: Path, **limits: int) -> Sandbox:
    box = Sandbox(tmp_path / "box", Limits(**limits))
    box.prepare()
    return box


def _mounted_anywhere(directory: Path) -> list[int]:
    """Pids whose mount namespace has the quota tmpfs on `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(
                    line.split()[:2] == [SOURCE, str(directory)] for line in (proc / "mounts").read_text().splitlines()):
                found.append(int(proc.name))
        except OSError:  # gone, or a zombie (its namespaces are already released)
            pass
    return found


def _wait_unmounted(directory: Path, within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _mounted_anywhere(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@needs_namespace
def test_writing_past_the_disk_quota_fails_with_a_clear_error(tmp_path: Path) -> None:
    box = _box(tmp_path, disk_bytes=2 << 20)
    result = box.run("head -c 3000000 /dev/zero > big")
    assert result.exit_code != 0
    assert "No space left on device" in result.output
    assert result.output.endswith(f"[sandbox disk quota of {2 << 20} bytes reached: No space left on device]")
    assert os.path.getsize(box.directory / "big") <= 2 << 20
    assert box.run("rm big && echo ok > small && cat small").output == "ok\n"  # room again once freed
    box.close()


@needs_namespace
def test_making_more_files_than_the_inode_quota_fails(tmp_path: Path) -> None:
    box = _box(tmp_path, inodes=50)
    result = box.run("for i in $(seq 100); do touch f$i || exit 1; done")
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert "[sandbox quota of 50 files and directories reached" in result.output
    assert len(list(box.directory.iterdir())) < 50  # the tmpfs's root counts as one
    box.close()


@needs_namespace
def test_files_come_back_at_close_without_setid_bits_and_no_bigger(tmp_path: Path) -> None:
    box = _box(tmp_path)
    (box.directory / "input.txt").write_text("from the task\n")  # task setup writes into the tmpfs
    result = box.run("cp /bin/true su && chmod u+s,g+s su && ln -s /etc/passwd link && mkdir d && echo x > d/a "
                     "&& ln d/a d/b && truncate -s 7M sparse && mkfifo fifo && cat input.txt")
    assert result.exit_code == 0 and result.output == "from the task\n"
    box.close()
    out = tmp_path / "box"
    assert (out / "input.txt").read_text() == "from the task\n" and (out / "d" / "a").read_text() == "x\n"
    assert os.stat(out / "su").st_mode & 0o6000 == 0  # the setuid and setgid bits are gone
    assert not os.path.lexists(out / "link")  # never followed, and a link out of the folder is dropped
    assert os.stat(out / "d" / "a").st_ino == os.stat(out / "d" / "b").st_ino  # one file, not two
    assert os.stat(out / "sparse").st_blocks == 0  # 7 MiB of hole stays a hole on the host disk
    assert box.directory == out


@needs_namespace
def test_the_quota_mount_never_appears_on_the_host(tmp_path: Path) -> None:
    box = _box(tmp_path)
    host = Path("/proc/self/mounts").read_text()
    assert SOURCE not in host and str(tmp_path / "box") not in host
    assert box.run("grep ' /work ' /proc/self/mounts").output.startswith(f"{SOURCE} /work tmpfs rw,nosuid,nodev")
    assert _mounted_anywhere(tmp_path / "box") != []  # it is there, in the holder's namespace only
    box.close()
    assert _wait_unmounted(tmp_path / "box") == []


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any uid may write (pytest's own tmp dirs are 0700 to root)."""
    path = Path(tempfile.mkdtemp(prefix="stepline-quota-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


HARNESS = (
    "import sys; from pathlib import Path; from stepline.agents.terminal.sandbox import Sandbox, Limits\n"
    "box = Sandbox(Path(sys.argv[1]), Limits(wall_s=1000)); box.prepare()\n"
    "print(box.run('echo hi > a; cat a').output, end='', flush=True)\n"
    "if sys.argv[2] == 'sleep': box.run('sleep 1000')\n"  # killed here with -9
)


@needs_namespace
@pytest.mark.parametrize("end", ["kill -9", "exit without close"])
def test_no_mount_outlives_the_harness(tmp_path: Path, end: str) -> None:
    box = tmp_path / "box"
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(box), "sleep" if end == "kill -9" else "exit"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert harness.stdout is not None
    assert harness.stdout.readline() == "hi\n"
    if end == "kill -9":
        assert _mounted_anywhere(box) != []
        harness.kill()
    harness.wait(30)
    harness.stdout.close()
    assert _wait_unmounted(box) == []
    assert SOURCE not in subprocess.run(["mount"], capture_output=True, text=True).stdout
    shutil.rmtree(box)  # nothing busy (the reverted host mount broke exactly this)


@needs_namespace
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops from root to nobody")
def test_quotas_hold_without_root(open_dir: Path) -> None:
    """Not root: the holder makes a user namespace too (wherever unprivileged user namespaces are allowed)."""
    script = HARNESS.replace("Limits(wall_s=1000)", "Limits(disk_bytes=1 << 20)") + (
        "r = box.run('head -c 2000000 /dev/zero > big'); print(r.exit_code != 0, 'No space left' in r.output)\n"
        "box.close(); print(sorted(p.name for p in Path(sys.argv[1]).iterdir()))\n")
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", script,
         str(open_dir / "box"), "exit"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TMPDIR": str(open_dir)})
    if "Permission denied" in done.stderr and "hi" not in done.stdout:
        pytest.skip(f"nobody cannot run this interpreter here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["hi", "True True", "['a', 'big']"]
    assert _wait_unmounted(open_dir / "box") == []


@needs_namespace
def test_a_lost_tmpfs_is_an_error_not_a_silent_host_write(tmp_path: Path) -> None:
    box = _box(tmp_path)
    os.kill(box._disk._holder.pid, 9)  # type: ignore[union-attr]  # e.g. a signal to the harness's process group
    with pytest.raises(QuotaUnavailable, match="tmpfs is gone"):
        box.run("echo x > a")
    box.close()
    assert list((tmp_path / "box").iterdir()) == []


def test_quotas_in_plain_mode_raise_quota_unavailable(tmp_path: Path) -> None:
    with pytest.raises(QuotaUnavailable, match="plain mode"):
        Sandbox(tmp_path / "box", Limits(), mode="plain")
    Sandbox(tmp_path / "box", Limits(disk_bytes=None, inodes=None), mode="plain").close()  # said so: runs


def test_episodes_without_quotas_say_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sandbox_module, "detect_mode", lambda: "plain")
    limits = episode_limits()
    assert limits.disk_bytes is None and limits.inodes is None
    assert "no disk or inode quota" in capsys.readouterr().err
    monkeypatch.setattr(sandbox_module, "detect_mode", lambda: "namespace")
    assert episode_limits() == Limits()  # 64 MiB and 8,192 files where they can be enforced
