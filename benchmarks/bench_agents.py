"""Cost of the search and UI harnesses outside the model: index build, one search, in-process expert
episodes per second, one harness process (`--expert`, start to exit), and episode size in tokens of
the `tiny` model's chat template (what one rollout costs the policy).

    .venv/bin/python benchmarks/bench_agents.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agents.search import harness as search
from agents.search.index import Index
from agents.search.tasks import split_ids as search_ids
from agents.search.world import passages
from agents.ui import harness as ui
from agents.ui.tasks import split_ids as ui_ids

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = {"search": (search.play, search_ids), "ui": (ui.play, ui_ids)}


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
        argv = [sys.executable, "-m", f"agents.{name}.run", "--task", task_id, "--out", tmp, "--expert"]
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


if __name__ == "__main__":
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
