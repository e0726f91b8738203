"""Fair service across sessions: a victim session's 1-token call, unloaded and under another session's burst,
with the per-session sequence limit on and off, side by side in one run.

    .venv/bin/python benchmarks/bench_fairness.py [--requests 8] [--sequences 256] [--limit 64]
        [--latency 0.25] [--max-running 256] [--engine URL --model DIR --engine-kind sglang]

The burst: `--requests` concurrent Completions requests of one session, each `--sequences` engine sequences (a
batch of prompts x n). The victim: another session's 1-token chat call, one after another: `--probes` times
unloaded (median), then as long as the burst runs (median of the calls started while it ran, at least one). Each mode starts its own gateway (`stepline gateway`, SQLite pool) with
`--max-session-sequences` = `--limit` (on) or 0 (off), in front of the same engine.

Without `--engine`, the engine is the tests' FakeEngine run as a script (tests/fakes/engine.py): each sequence
computes for `--latency` s, at most `--max-running` at once and the rest queue in arrival order, as an engine's
batch slots do (vLLM's --max-num-seqs, 256 by default; SGLang's --max-running-requests). A burst larger than
that queues in the engine ahead of the victim unless the gateway holds the session to its share.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from _services import free_port, wait_up

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "engine.py"
ADMIN = {"Authorization": "Bearer bench"}
VICTIM = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1}





def start_gateway(args: argparse.Namespace, engine: str, model: Path, limit: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "stepline.cli", "gateway", "--engine", engine, "--engine-kind", args.engine_kind,
            "--model", str(model), "--pool", f"sqlite:///{tmp / f'pool-{limit}.db'}", "--port", str(port),
            "--admin-token", "bench", "--spill", str(tmp / f"spill-{limit}"), "--max-session-sequences", str(limit)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def new_session(http: aiohttp.ClientSession, gateway: str, name: str) -> dict:
    async with http.post(gateway + "/sessions", json={"task_id": name, "harness": "bench"}, headers=ADMIN) as r:
        assert r.status == 201, await r.text()
        return await r.json()


async def post(http: aiohttp.ClientSession, session: dict, path: str, body: dict) -> float:
    """Seconds one call took (asserting it succeeded)."""
    headers = {"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with http.post(session["openai_base_url"] + path, data=orjson.dumps(body), headers=headers) as r:
        data = await r.read()
        assert r.status == 200, data[:300]
    return time.perf_counter() - start


async def victim_calls(http: aiohttp.ClientSession, session: dict, probes: int) -> list[float]:
    return [await post(http, session, "/chat/completions", VICTIM) for _ in range(probes)]


async def victim_during(http: aiohttp.ClientSession, session: dict, burst: asyncio.Future) -> list[float]:
    """The victim's calls, one after another, each started while the burst still runs (at least one)."""
    times = [await post(http, session, "/chat/completions", VICTIM)]
    while not burst.done():
        times.append(await post(http, session, "/chat/completions", VICTIM))
    return times


def burst_body(sequences: int, max_n: int = 16) -> dict:
    """One Completions request of `sequences` engine sequences: prompts x n."""
    n = next(k for k in range(min(max_n, sequences), 0, -1) if sequences % k == 0 and sequences // k <= 64)
    return {"prompt": [f"Burst prompt {i}: count to ten." for i in range(sequences // n)], "n": n, "max_tokens": 1}


async def one_mode(args: argparse.Namespace, engine: str, model: Path, limit: int, tmp: Path) -> dict:
    proc, gateway = start_gateway(args, engine, model, limit, tmp)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=3600)) as http:
            await wait_up(http, gateway, proc)
            victim, burster = await new_session(http, gateway, "victim"), await new_session(http, gateway, "burst")
            await victim_calls(http, victim, 2)  # warm up
            unloaded = await victim_calls(http, victim, args.probes)
            body = burst_body(args.sequences)
            start = time.perf_counter()
            burst = asyncio.gather(*(post(http, burster, "/completions", body) for _ in range(args.requests)))
            await asyncio.sleep(args.latency / 2)  # the burst is in
            loaded = await victim_during(http, victim, burst)
            await burst
            burst_s = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(60)
    return {"unloaded": statistics.median(unloaded), "loaded": statistics.median(loaded), "worst": max(loaded),
            "probes": len(loaded), "burst_s": burst_s}


async def run(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, dict]:
    engine_proc = None
    engine = args.engine
    if engine is None:
        port = free_port()
        engine_argv = [sys.executable, str(FAKE_ENGINE), "--port", str(port), "--tokens", "1",
                       "--latency", str(args.latency), "--max-running", str(args.max_running)]
        engine_proc = subprocess.Popen(engine_argv, stdout=subprocess.DEVNULL)
        engine = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_up(http, engine, engine_proc)
        return {"on": await one_mode(args, engine, model, args.limit, tmp),
                "off": await one_mode(args, engine, model, 0, tmp)}
    finally:
        if engine_proc is not None:
            engine_proc.terminate()
            engine_proc.wait(60)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    where = args.engine or (f"fake engine: {args.latency:g} s per sequence, {args.max_running} at once")
    print(f"\nfairness: victim's 1-token call (median) vs another session's burst of "
          f"{args.requests} x {args.sequences}-sequence Completions requests; {where}; {os.cpu_count()} CPUs\n")
    print(f"{'limit':>18}{'unloaded (s)':>14}{'under burst (s)':>17}{'worst (s)':>11}{'calls':>7}{'ratio':>8}"
          f"{'burst (s)':>11}")
    for mode, label in (("off", "off (0)"), ("on", f"on ({args.limit})")):
        r = results[mode]
        print(f"{label:>18}{r['unloaded']:14.3f}{r['loaded']:17.3f}{r['worst']:11.3f}{r['probes']:7d}"
              f"{r['loaded'] / r['unloaded']:8.1f}{r['burst_s']:11.2f}")
    print(f"\ntarget: ratio with the limit on <= 2 (got {results['on']['loaded'] / results['on']['unloaded']:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="concurrent burst requests")
    parser.add_argument("--sequences", type=int, default=256, help="engine sequences per burst request")
    parser.add_argument("--limit", type=int, default=64, help="--max-session-sequences with the limit on")
    parser.add_argument("--probes", type=int, default=5, help="victim calls per measurement")
    parser.add_argument("--latency", type=float, default=0.25, help="fake engine: seconds each sequence computes")
    parser.add_argument("--max-running", type=int, default=256, help="fake engine: sequences computing at once")
    parser.add_argument("--engine", default=None, help="a running engine instead of the fake (needs --model)")
    parser.add_argument("--engine-kind", default="sglang", choices=["builtin", "sglang", "vllm"])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from stepline.models import build_model

            model = build_model(Path(tmp) / "tiny", kind="tiny", seed=0)
        report(asyncio.run(run(args, model, Path(tmp))), args)


if __name__ == "__main__":
    main()
