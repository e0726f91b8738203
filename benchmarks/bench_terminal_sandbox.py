"""Per-command cost of the terminal sandbox: namespace mode (unshare + chroot) with and without the per-episode
quota tmpfs (stepline/agents/terminal/quota.py) vs plain (rlimits only), and expert episodes per second on the test split
(setup + one command + check, in-process).

    .venv/bin/python benchmarks/bench_terminal_sandbox.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from stepline.agents.terminal.episode import expert_episode
from stepline.agents.terminal.sandbox import Limits, Sandbox, detect_mode
from stepline.agents.terminal.tasks import check, get_task, task_ids


def per_command_ms(mode: str, quota: bool, n: int = 40) -> float:
    limits = Limits() if quota else Limits(disk_bytes=None, inodes=None)
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(Path(tmp) / "box", limits, mode=mode)  # type: ignore[arg-type]
        box.prepare()
        times = []
        for _ in range(n):
            started = time.perf_counter()
            box.run("echo hi > a.txt")
            times.append(time.perf_counter() - started)
        box.close()
        return statistics.median(times) * 1000


def expert_episodes_per_s(n: int = 60) -> float:
    ids = task_ids("test")[:n]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        for task_id in ids:
            expert_episode(get_task(task_id), Path(tmp) / task_id)
            assert check(get_task(task_id), Path(tmp) / task_id / "sandbox") is None
        return len(ids) / (time.perf_counter() - started)


if __name__ == "__main__":
    runs = [("plain", False)] + ([("namespace", False), ("namespace", True)] if detect_mode() == "namespace" else [])
    ms = {run: per_command_ms(*run) for run in runs}
    for (mode, quota), value in ms.items():
        name = f"{mode}{' + quota' if quota else ''}"
        print(f"{name:<18} median per command {value:6.1f} ms   ratio to plain {value / ms['plain', False]:.2f}")
    print(f"expert episodes/s (test split, mode {detect_mode()}): {expert_episodes_per_s():.1f}")
