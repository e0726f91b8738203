"""Cost of the harnesses outside the model.

Search and UI: index build, one search, in-process expert episodes per second, one harness process
(`--expert`, start to exit), and episode size in tokens of the `tiny` model's chat template (what one
rollout costs the policy).

All three harnesses through the rollout driver (stepline/rollout/driver.py): episodes per second and CPU
seconds per episode of one `run` + one `verify` process per episode against the long-lived worker
(`persistent = true`, stepline/agents/common/serve.py), for model episodes over the real SDK whose "model" is
a ScriptedServer replaying the expert's answers; the session endpoints are an in-process stand-in,
so the driver's CPU column is the driver plus that scripted model.

    .venv/bin/python benchmarks/bench_agents.py [--episodes 24] [--driver-only]
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from stepline.agents.common.scripted_server import Reply, ScriptedServer
from stepline.agents.search import harness as search
from stepline.agents.search.index import Index
from stepline.agents.search.tasks import split_ids as search_ids
from stepline.agents.search.world import passages
from stepline.agents.terminal.tasks import get_task
from stepline.agents.terminal.tasks import task_ids as terminal_ids
from stepline.agents.ui import harness as ui
from stepline.agents.ui.tasks import split_ids as ui_ids
from stepline.rollout.client import SessionHandle
from stepline.rollout.config import HarnessSpec, RolloutConfig
from stepline.rollout.driver import RolloutDriver

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = {"search": (search.play, search_ids), "ui": (ui.play, ui_ids)}
SPLITS = {"search": search_ids, "terminal": terminal_ids, "ui": ui_ids}
CONCURRENCY = 4


def ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def episodes_per_s(name: str) -> float:
    play, ids = HARNESSES[name]
    started = time.perf_counter()
    for task_id in ids("test"):
        play(task_id, 4, expert=True)
    return len(ids("test")) / (time.perf_counter() - started)


def process_ms(name: str, n: int = 3) -> float:
    task_id = HARNESSES[name][1]("test")[0]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", f"stepline.agents.{name}.run", "--task", task_id, "--out", tmp, "--expert"]
        return ms(lambda: subprocess.run(argv, cwd=ROOT, check=True), n)


def episode_tokens(name: str) -> tuple[float, float]:
    """Median tokens of the first prompt and of the whole expert episode (tiny model's template)."""
    from transformers import AutoTokenizer

    from stepline.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(str(build_model(Path(tmp) / "m", kind="tiny", seed=0)))
    play, ids = HARNESSES[name]
    first, whole = [], []
    for task_id in ids("test"):
        episode = play(task_id, 4, expert=True)
        messages = [_hf(m) for m in episode.messages]
        prompt = tok.apply_chat_template(messages[:2], tools=episode.tools, add_generation_prompt=True, return_dict=True)
        first.append(len(prompt["input_ids"]))
        whole.append(len(tok.apply_chat_template(messages, tools=episode.tools, return_dict=True)["input_ids"]))
    return statistics.median(first), statistics.median(whole)


def _hf(message: dict) -> dict:
    """transformers' templates want tool-call arguments as a dict, not the JSON text."""
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


# --- through the rollout driver: one process per episode vs the long-lived worker ---


def expert_script(harness: str, task_ids: list[str]) -> dict[str, list[Reply]]:
    """First user message of each task -> the expert's answers, for a scripted model to replay."""
    script: dict[str, list[Reply]] = {}
    for task_id in task_ids:
        if harness == "terminal":
            task = get_task(task_id)
            script[task.prompt] = [Reply(None, [("bash", {"command": task.expert_command})]), Reply("done")]
            continue
        episode = HARNESSES[harness][0](task_id, 4, expert=True)
        script[episode.messages[1]["content"]] = [
            Reply(m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])])
            for m in episode.messages if m["role"] == "assistant"]
    return script


def replay(script: dict[str, list[Reply]]):
    def policy(body: dict[str, Any]) -> Reply:
        replies = script[next(m["content"] for m in body["messages"] if m["role"] == "user")]
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return replies[min(turn, len(replies) - 1)]

    return policy


class Sessions:
    """The gateway's session endpoints, in-process: every session points at the scripted model."""

    def __init__(self, model_url: str):
        self.url, self.model_url = "http://sessions.invalid", model_url

    async def open_session(self, task_id: str, harness: str, group_id: str | None, metadata: dict) -> SessionHandle:
        sid = uuid.uuid4().hex[:12]
        return SessionHandle(sid, f"key-{sid}", f"{self.model_url}/v1", self.model_url)

    async def post_reward(self, session_id: str, value: float) -> None:
        pass

    async def end_session(self, session_id: str, status: str) -> None:
        pass


@dataclass
class DriverRun:
    episodes: int
    successes: int
    wall_s: float
    harness_cpu_s: float  # the harness processes, or the worker and its children
    driver_cpu_s: float  # this process: driver, session stand-in, scripted model


def cpu_of(pid: int) -> float:
    """utime + stime of a live process and of its reaped children (/proc/PID/stat fields 14-17)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def cpu_now() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


async def drive(harness: str, persistent: bool, episodes: int, work: Path) -> DriverRun:
    """`episodes` model episodes of the test split through the driver, after one untimed warm-up
    episode (which starts the worker: its start-up is reported apart)."""
    tasks = SPLITS[harness]("test")[:episodes]
    with ScriptedServer(replay(expert_script(harness, tasks))) as model:
        spec = HarnessSpec(name=harness, module=f"stepline.agents.{harness}", tasks=tasks, persistent=persistent)
        config = RolloutConfig(harnesses=[spec], group_size=1, max_concurrency=CONCURRENCY)
        async with RolloutDriver(config, Sessions(model.url), work) as driver:  # type: ignore[arg-type]
            await driver.run_episode(spec, tasks[0], None)
            worker = driver.workers.get(spec.module or "")
            pid = worker.pid if worker else None
            before_pid = cpu_of(pid) if pid else 0.0
            own0, kids0 = cpu_now()
            started = time.perf_counter()
            results = await asyncio.gather(*(driver.run_episode(spec, t, None) for t in tasks))
            wall = time.perf_counter() - started
            own1, kids1 = cpu_now()
            harness_cpu = cpu_of(pid) - before_pid if pid else kids1 - kids0
    return DriverRun(len(results), sum(r.success for r in results), wall, harness_cpu, own1 - own0)


def worker_start_s(harness: str) -> float:
    """CPU seconds of one worker from start to its ready line (interpreter, imports, warm-up)."""
    proc = subprocess.Popen([sys.executable, "-m", f"stepline.agents.{harness}.serve"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    spent = cpu_of(proc.pid)
    proc.stdin.close()
    proc.wait()
    return spent


def driver_table(episodes: int) -> None:
    print(f"\nthrough the rollout driver, {episodes} expert-replaying model episodes per row, "
          f"max_concurrency {CONCURRENCY}:")
    print(f"{'harness':<9} {'path':<12} {'ep/s':>6} {'ratio':>6} {'harness CPU s/ep':>17} {'driver CPU s/ep':>16}"
          f" {'success':>8}")
    for harness in SPLITS:
        runs = {}
        for persistent in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                runs[persistent] = asyncio.run(drive(harness, persistent, episodes, Path(tmp)))
        base = runs[False].episodes / runs[False].wall_s
        for persistent, run in runs.items():
            rate = run.episodes / run.wall_s
            print(f"{harness:<9} {'worker' if persistent else 'per-process':<12} {rate:>6.2f} {rate / base:>6.1f}"
                  f" {run.harness_cpu_s / run.episodes:>17.3f} {run.driver_cpu_s / run.episodes:>16.3f}"
                  f" {run.successes:>4}/{run.episodes}")
        print(f"{harness:<9} worker start-up (once): {worker_start_s(harness):.2f} CPU s")


@click.command()
@click.option("--episodes", default=24, show_default=True, help="episodes per harness and path (driver table)")
@click.option("--driver-only", is_flag=True, help="only the driver table")
def main(episodes: int, driver_only: bool) -> None:
    if not driver_only:
        docs = passages()
        build = ms(lambda: Index(docs), 3)
        one = ms(lambda: search.search("Fefeda"), 200)
        print(f"search index: {len(docs)} passages, build {build:.1f} ms, one search {one:.2f} ms")
        rates = {name: episodes_per_s(name) for name in HARNESSES}
        procs = {name: process_ms(name) for name in HARNESSES}
        for name in HARNESSES:
            first, whole = episode_tokens(name)
            print(f"{name:<7} expert episodes/s in-process {rates[name]:7.0f}   one --expert process {procs[name]:6.0f} ms"
                  f"   (process/episode ratio {procs[name] * rates[name] / 1000:5.0f})"
                  f"   tokens: first prompt {first:.0f}, episode {whole:.0f}")
    driver_table(episodes)


if __name__ == "__main__":
    main()
