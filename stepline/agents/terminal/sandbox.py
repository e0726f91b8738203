"""A throw-away shell sandbox: one directory, each command in fresh namespaces, with limits.

Enforcement, strongest available mode first (`detect_mode()` probes once per process):

- ``"namespace"`` (util-linux ``unshare``; as root, or as any user where user namespaces are allowed):
  each command runs as PID 1 of a new PID, mount and network namespace, chrooted into a root built
  in a private tmpfs: /usr, /etc… bind-mounted read-only, the sandbox directory bind-mounted at
  ``/work`` (the only writable host path), a private 16 MiB /tmp, /dev with null/zero/random only,
  no network. As root the command also runs under a per-episode unprivileged uid, so RLIMIT_NPROC
  counts only this episode's processes. When the command's shell exits, the kernel kills every
  process left in its PID namespace, so nothing outlives a command, let alone an episode.
- ``"plain"`` (no namespaces: best effort): a new session per command, killed as a process group;
  rlimits; as root a per-episode unprivileged uid (so root-owned paths are read-only, but
  world-writable ones such as /tmp are not protected, and a process that calls setsid escapes the
  group kill). The tests pin which guarantees hold in which mode.

Limits in both modes: wall time per command (the group is SIGKILLed), CPU seconds, address space,
file size, process count, and output bytes (the reader stops and kills the command past the cap).

Quotas per episode (`Limits.disk_bytes`, `Limits.inodes`; namespace mode only, as root or not): the
sandbox directory is a size- and inode-limited tmpfs in a mount namespace held by a child process
(stepline/agents/terminal/quota.py), so it never appears in the host's mount table and dies with the episode,
kill -9 included; `directory` is that tmpfs while the episode runs, and `close()` copies its files
back. Asking for quotas in plain mode raises `QuotaUnavailable`; `episode_limits()` is what episodes
use: the quotas where they can be enforced, else none, said on stderr. Whatever the mode, /work is
mounted nosuid and nothing the sandbox leaves carries a setuid or setgid bit.
A command also dies with the harness process (parent-death signal), so killing a harness at its
episode timeout leaves nothing behind in namespace mode.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from stepline.agents.terminal.quota import QuotaDisk, QuotaUnavailable

__all__ = ["CommandResult", "Limits", "Mode", "QuotaUnavailable", "Sandbox", "detect_mode", "episode_limits",
           "quotas_available"]

Mode = Literal["namespace", "plain"]

# Builds the root filesystem inside the new mount namespace, then execs the command in it.
_SETUP_SCRIPT = r"""
set -eu
R=/mnt
mount -t tmpfs -o size=1m,mode=755 sandbox-root "$R"
for d in bin sbin lib lib32 lib64 libx32 usr etc; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"
  elif [ -d "/$d" ]; then mkdir "$R/$d"; mount --rbind "/$d" "$R/$d"; mount -o remount,bind,ro "$R/$d"; fi
done
mkdir "$R/work" "$R/tmp" "$R/proc" "$R/dev"
mount --bind "$SANDBOX_DIR" "$R/work"
mount -o remount,bind,nosuid,nodev "$R/work"
mount -t tmpfs -o size=16m,mode=1777,nosuid,nodev sandbox-tmp "$R/tmp"
mount -t proc proc "$R/proc"
for n in null zero random urandom; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mount -o remount,ro,bind "$R"
# No exec: this shell stays PID 1 of the namespace. It keeps unshare's parent-death signal (a uid
# change would clear it), so killing the harness kills it, and its exit kills the whole namespace.
if [ -n "$SANDBOX_UID" ]; then
  chroot --userspec="$SANDBOX_UID:$SANDBOX_UID" "$R" /bin/bash -c 'cd /work && eval "$SANDBOX_CMD"'
else
  chroot "$R" setpriv --bounding-set=-all --inh-caps=-all --no-new-privs \
    /bin/bash -c 'cd /work && eval "$SANDBOX_CMD"'
fi
"""

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


class Limits(BaseModel):
    """Per-command limits of the sandbox."""

    wall_s: float = Field(10.0, gt=0, description="wall-clock seconds per command (then SIGKILL)")
    cpu_s: int = Field(10, gt=0, description="RLIMIT_CPU seconds per command")
    memory_bytes: int = Field(1 << 30, gt=0, description="RLIMIT_AS per process")
    file_bytes: int = Field(8 << 20, gt=0, description="RLIMIT_FSIZE: largest file a command may write")
    processes: int = Field(64, gt=0, description="RLIMIT_NPROC for the sandbox uid")
    output_bytes: int = Field(2048, gt=0, description="output returned to the agent (rest truncated)")
    disk_bytes: int | None = Field(64 << 20, gt=0, description="bytes the episode's files may take (None: no quota)")
    inodes: int | None = Field(8192, gt=0, description="files + directories the episode may make (None: no quota)")

    def quota(self) -> bool:
        return self.disk_bytes is not None or self.inodes is not None


@dataclass
class CommandResult:
    output: str  # stdout and stderr interleaved, truncated to Limits.output_bytes
    exit_code: int  # -9 when killed (timeout or output flood)
    timed_out: bool
    truncated: bool


@functools.cache
def detect_mode() -> Mode:
    """"namespace" if a namespaced command works here, else "plain". Probed once per process."""
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return "plain"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"stepline-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        argv, env = _namespace_argv(probe, "true", uid=None if os.geteuid() else 65534)
        ok = subprocess.run(argv, env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return "namespace" if ok else "plain"


def quotas_available(mode: Mode | None = None) -> bool:
    """Whether a sandbox in `mode` (None: the detected one) can enforce disk and inode quotas."""
    return (mode or detect_mode()) == "namespace"


def episode_limits() -> Limits:
    """The default limits with quotas where they can be enforced; without them (said on stderr) elsewhere."""
    if quotas_available():
        return Limits()
    print("terminal sandbox: plain mode (no namespaces here), so no disk or inode quota per episode", file=sys.stderr)
    return Limits(disk_bytes=None, inodes=None)


def _namespace_argv(directory: Path, command: str, uid: int | None) -> tuple[list[str], dict[str, str]]:
    flags = ["--mount", "--pid", "--net", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    env = {
        "PATH": _PATH,
        "HOME": "/work",
        "LANG": "C.UTF-8",
        "SANDBOX_DIR": str(directory.resolve()),
        "SANDBOX_UID": "" if uid is None else str(uid),
        "SANDBOX_CMD": command,
    }
    return ["unshare", *flags, "sh", "-c", _SETUP_SCRIPT], env


class Sandbox:
    """A directory in which an agent's shell commands run, one fresh confined shell per command."""

    def __init__(self, directory: Path, limits: Limits | None = None, mode: Mode | None = None) -> None:
        self.root = Path(directory)  # the ordinary directory; the files are here after close()
        self.root.mkdir(parents=True, exist_ok=True)
        self.limits = limits or Limits()
        self.mode: Mode = mode or detect_mode()
        # As root, run commands under an unprivileged uid of their own: the pid makes it unique
        # among live episodes, so RLIMIT_NPROC is per episode.
        self.uid: int | None = 1_000_000 + os.getpid() if os.geteuid() == 0 else None
        self._disk: QuotaDisk | None = None
        if self.limits.quota():
            if self.mode != "namespace":
                how = "forced" if mode is not None else "the only mode available here"
                raise QuotaUnavailable(
                    f"disk_bytes / inodes quotas need namespace mode, and this sandbox is in plain mode ({how}); "
                    "set Limits(disk_bytes=None, inodes=None) to run without quotas")
            self._disk = QuotaDisk(self.root, self.limits.disk_bytes, self.limits.inodes)

    @property
    def directory(self) -> Path:
        """Where the episode's files are now: the quota tmpfs while it runs, else the ordinary directory."""
        return self._disk.live if self._disk is not None else self.root

    def prepare(self) -> None:
        """Hand the directory (after task setup wrote its files) to the sandbox uid."""
        if self.uid is None:
            return
        for path in [self.directory, *self.directory.rglob("*")]:
            os.lchown(path, self.uid, self.uid)

    def run(self, command: str) -> CommandResult:
        argv, env, cwd = self._argv(command)
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self._child_limits,
        )
        try:
            result = self._collect(proc)
        finally:
            _kill_group(proc)
        full = self._disk.exhausted() if self._disk is not None else None
        if full is not None:
            result.output += f"\n{full}"
        return result

    def _argv(self, command: str) -> tuple[list[str], dict[str, str], str]:
        if self.mode == "namespace":
            argv, env = _namespace_argv(self.root, command, self.uid)
            enter = self._disk.enter_argv() if self._disk is not None else []
            return [*enter, *argv], env, "/"
        env = {"PATH": _PATH, "HOME": str(self.root), "LANG": "C.UTF-8"}
        return ["/bin/bash", "-c", command], env, str(self.root)

    def _child_limits(self) -> None:
        """Runs in the child between fork and exec: rlimits, and (plain mode, root) the uid drop."""
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.mode == "plain" and self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        # If the harness itself is killed (the driver's episode timeout), the command dies with it
        # (namespace mode: unshare's death takes the whole PID namespace along). Set after setuid,
        # which clears it.
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def _collect(self, proc: subprocess.Popen[bytes]) -> CommandResult:
        """Read output until exit, the wall limit, or the output cap (then the command is killed)."""
        assert proc.stdout is not None
        deadline = time.monotonic() + self.limits.wall_s
        cap = self.limits.output_bytes
        chunks: list[bytes] = []
        size, timed_out, truncated = 0, False, False
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            data = _read_some(proc.stdout.fileno(), timeout=max(0.0, deadline - time.monotonic()))
            if data:
                chunks.append(data)
                size += len(data)
                if size > cap:
                    truncated = True
                    break
            elif data == b"" or proc.poll() is not None:  # EOF, or exited (plain mode: `cmd &`)
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
        if timed_out or truncated:
            _kill_group(proc)
        code = proc.wait()
        proc.stdout.close()
        text = b"".join(chunks)[:cap].decode("utf-8", errors="replace")
        if truncated:
            text += "\n[output truncated]"
        if timed_out:
            text += f"\n[killed after {self.limits.wall_s:g}s]"
        return CommandResult(output=text, exit_code=code, timed_out=timed_out, truncated=truncated)

    def close(self) -> None:
        """Nothing runs between commands; in plain mode sweep the sandbox uid once more. The files end up in
        the ordinary directory (copied out of the quota tmpfs), without setuid or setgid bits."""
        if self.mode == "plain" and self.uid is not None:
            subprocess.run(["pkill", "-KILL", "-U", str(self.uid)], check=False, capture_output=True)
        disk, self._disk = self._disk, None
        if disk is not None:
            disk.close()
        else:
            subprocess.run(["chmod", "-R", "ug-s", str(self.root)], env={"PATH": _PATH}, capture_output=True,
                           check=False)
        drop_escaping_links(self.root)


def drop_escaping_links(root: Path) -> list[Path]:
    """Remove the symlinks under `root` that resolve outside it, and return them. Inside the sandbox a link to
    /etc/shadow or / names the chroot's read-only view; in the episode folder the verifier reads, it would name
    the host's files. Links within the folder (relative ones to its own files) stay."""
    top = os.path.realpath(root)
    links = [Path(folder) / name for folder, dirs, files in os.walk(root)  # never into a linked directory
             for name in dirs + files if os.path.islink(os.path.join(folder, name))]
    # all judged before any is removed: a link to a removed link would resolve inside
    dropped = [path for path in links if os.path.commonpath([top, os.path.realpath(path)]) != top]
    if dropped:
        print(f"terminal sandbox: {len(dropped)} symlinks pointing outside the episode folder removed "
              f"(first: {dropped[0].relative_to(root)} -> {os.readlink(dropped[0])})", file=sys.stderr)
    for path in dropped:
        path.unlink()
    return dropped


def _read_some(fd: int, timeout: float) -> bytes | None:
    """Up to 64 KiB from fd; b"" at EOF; None when nothing arrived within the timeout."""
    ready, _, _ = select.select([fd], [], [], min(timeout, 0.5))
    if not ready:
        return None
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 2.0) -> None:
    """SIGKILL the command's process group and wait (bounded) until its last member is reaped."""
    deadline = time.monotonic() + grace_s
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        while time.monotonic() < deadline:  # orphans (the namespace's pid 1) are reaped by init
            os.killpg(proc.pid, 0)
            time.sleep(0.005)
    except ProcessLookupError:
        pass
