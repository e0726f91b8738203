"""Children of `stepline up` / `stepline run` die with their parent, even when it is killed with -9.

`stepline.launch.services.start` puts the parent's pid in the child's environment; the child's CLI entry calls
`die_with_parent()`, which asks Linux for SIGTERM when the parent goes (prctl PR_SET_PDEATHSIG). The
engine and the gateway treat SIGTERM as a clean shutdown (the gateway flushes its records first), so a
killed job leaves no engine holding its port and memory. A program that cannot make that call (vLLM) is
started as `python -m stepline.launch.lifeline PROGRAM ARGS...`: that asks for the signal, then execs PROGRAM.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["PARENT_PID_ENV", "die_with_parent", "exec_with_parent"]

PARENT_PID_ENV = "STEPLINE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when the process named by STEPLINE_PARENT_PID exits (Linux; elsewhere a no-op)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # popped: grandchildren are not bound to our parent
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # the parent was already gone before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def exec_with_parent(argv: list[str]) -> None:
    """Become `argv` (execv) bound to our parent: for a program that cannot call `die_with_parent` itself
    (vLLM). The death signal survives execve, except into a set-user-ID program."""
    die_with_parent()
    os.execv(argv[0], argv)


if __name__ == "__main__":  # python -m stepline.launch.lifeline PROGRAM ARGS...
    exec_with_parent(sys.argv[1:])
