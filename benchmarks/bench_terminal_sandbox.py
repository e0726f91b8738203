"""Per-command cost of the terminal sandbox: namespace mode (unshare + chroot) vs plain (rlimits only),
and expert episodes per second on the test split (setup + one command + check, in-process).

    .venv/bin/python benchmarks/bench_terminal_sandbox.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from agents.terminal.episode import expert_episode
from agents.terminal.sandbox import Sandbox, detect_mode
from agents.terminal.tasks import check, get_task, task_ids


def per_command_ms(mode: str, n: int = 40) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(Path(tmp) / "box", mode=mode)  # type: ignore[arg-type]
        box.prepare()
        times = []
        for _ in range(n):
            started = time.perf_counter()
            box.run("echo hi > a.txt")
            times.append(time.perf_counter() - started)
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
    modes = sorted({detect_mode(), "plain"})
    ms = {mode: per_command_ms(mode) for mode in modes}
    for mode in modes:
        print(f"{mode:<10} median per command {ms[mode]:6.1f} ms   ratio to plain {ms[mode] / ms['plain']:.2f}")
    print(f"expert episodes/s (test split, mode {detect_mode()}): {expert_episodes_per_s():.1f}")
