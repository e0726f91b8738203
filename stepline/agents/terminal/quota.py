"""Per-episode disk and inode quotas: a size- and inode-limited tmpfs that no host mount table ever shows.

A holder process (``unshare --mount --propagation private``, plus ``--user --map-root-user`` when not
root) mounts a tmpfs (``size``, ``nr_inodes``, nosuid, nodev) over the sandbox directory inside a
mount namespace of its own, prints ``ready`` and then blocks reading its stdin. Each command enters
that namespace (``nsenter``) before building its own (stepline/agents/terminal/sandbox.py), so /work is the
tmpfs and writing past the quota fails with ENOSPC.

Why a holder and not a mount on the host: a mount in the host namespace outlives a sandbox that is
never closed (a killed harness, a test that forgets) and then blocks removing its directory. Here the
tmpfs lives exactly as long as the namespace, which lives as long as the holder: the holder exits at
EOF on its stdin, and the kernel closes the harness's end of that pipe however the harness dies
(kill -9 included), so the mount and its memory go with the episode.

While the episode runs its files are reached through ``/proc/<holder>/root/<dir>`` (`live`);
`close()` copies them back to the ordinary directory (no symlink followed, hard links and holes kept,
so the copy takes no more disk than the quota; setuid/setgid bits cleared) for the verifier. A killed
episode leaves its directory empty.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
SOURCE = "stepline-sandbox"  # the tmpfs's name in /proc/<pid>/mounts
_HOLD = f'mount -t tmpfs -o "$2" {SOURCE} "$1" && echo ready && exec cat >/dev/null'


class QuotaUnavailable(RuntimeError):
    """Disk or inode quotas were asked for where this machine cannot enforce them."""


class QuotaDisk:
    """The tmpfs of one episode, held by a child process; see the module docstring."""

    def __init__(self, directory: Path, disk_bytes: int | None, inodes: int | None, start_timeout_s: float = 10.0):
        self.directory = directory.resolve()
        self.disk_bytes, self.inodes = disk_bytes, inodes
        if any(self.directory.iterdir()):
            raise ValueError(f"{self.directory} is not empty: the episode's tmpfs would hide its files")
        options = ["nosuid", "nodev", "mode=0755"]
        options += [f"size={disk_bytes}"] if disk_bytes is not None else []
        options += [f"nr_inodes={inodes}"] if inodes is not None else []
        user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
        self._holder = subprocess.Popen(
            ["unshare", *user, "--mount", "--propagation", "private", "sh", "-c", _HOLD, "stepline-quota",
             str(self.directory), ",".join(options)],
            env={"PATH": _PATH}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self._await_ready(start_timeout_s)

    def _await_ready(self, timeout_s: float) -> None:
        assert self._holder.stdout is not None and self._holder.stderr is not None
        ready, _, _ = select.select([self._holder.stdout], [], [], timeout_s)
        if ready and self._holder.stdout.readline() == b"ready\n":
            return
        self._holder.kill()
        _, err = self._holder.communicate()
        raise QuotaUnavailable(f"could not mount the episode's tmpfs (unshare + mount): {err.decode()[-500:].strip()}")

    @property
    def live(self) -> Path:
        """The sandbox directory as the episode sees it (the tmpfs), from the harness's namespace."""
        return Path(f"/proc/{self._holder.pid}/root") / self.directory.relative_to("/")

    def enter_argv(self) -> list[str]:
        """The prefix that runs a command inside the holder's namespace (its user namespace too when not root)."""
        if (code := self._holder.poll()) is not None:  # signalled with the harness's group, say
            raise QuotaUnavailable(f"the episode's tmpfs is gone: its holder exited ({code}) before the episode ended")
        user = ["--user", "--preserve-credentials"] if os.geteuid() != 0 else []
        return ["nsenter", f"--target={self._holder.pid}", "--mount", *user, "--"]

    def exhausted(self) -> str | None:
        """A note for the agent when the tmpfs is full (writes then fail with ENOSPC), else None."""
        try:
            fs = os.statvfs(self.live)
        except OSError as exc:  # the holder died during the command, and its /proc root with it
            code = self._holder.wait(timeout=5)
            raise QuotaUnavailable(f"the episode's tmpfs is gone: its holder exited ({code}) before the episode "
                                   "ended") from exc
        if self.disk_bytes is not None and fs.f_bavail == 0:
            return f"[sandbox disk quota of {self.disk_bytes} bytes reached: No space left on device]"
        if self.inodes is not None and fs.f_favail == 0:
            return f"[sandbox quota of {self.inodes} files and directories reached: No space left on device]"
        return None

    def close(self) -> None:
        """Copy the files back to the ordinary directory, then let the holder (and the tmpfs) go."""
        if self._holder.poll() is None:
            _copy_out(self.live, self.directory)
        for pipe in (self._holder.stdin, self._holder.stdout, self._holder.stderr):
            if pipe is not None:
                pipe.close()  # stdin first: EOF ends the holder
        self._holder.wait(timeout=10)


def _copy_out(src: Path, dst: Path) -> None:
    """cp without following symlinks, keeping hard links and holes (so the copy takes no more disk than the
    tmpfs did), then setuid/setgid cleared. What cp cannot copy (a path past PATH_MAX, a file the episode made
    unreadable) is left out and said on stderr: the agent's doing, scored by the verifier, not a harness error."""
    done = subprocess.run(
        ["cp", "-R", "--no-dereference", "--preserve=mode,timestamps,links", "--sparse=always", f"{src}/.", f"{dst}/"],
        env={"PATH": _PATH}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"terminal sandbox: some files were not copied out of the episode's tmpfs: {done.stderr[-500:]}",
              file=sys.stderr)
    subprocess.run(["chmod", "-R", "ug-s", str(dst)], env={"PATH": _PATH}, capture_output=True, check=False)
