"""Gateway overhead against a fast fake engine, all in one run; or two trees' gateways side by side.

    .venv/bin/python benchmarks/bench_gateway.py [--turns 20] [--context 4000] [--sessions 64] [--rounds 1]
    .venv/bin/python benchmarks/bench_gateway.py --compare DIR [--rounds 3]

Three processes: a FakeEngine (tests/fakes/engine.py, run as a script; SGLang /generate wire format, 16 tokens per answer, the last one EOS),
the gateway (`stepline gateway`, recording into a real SQLite pool), and this load generator.

1. Added latency: conversations of `--turns` turns on a `--context`-token document (the harness
   echoes its whole history each turn), one call at a time; each call is then replayed directly
   against the engine with the exact prompt ids the gateway sent (read back from the pool).
   Added = gateway − direct, paired per call.
2. Added time to first token when streaming: the same, streamed; first content chunk vs first engine event.
3. Throughput: `--sessions` concurrent sessions running such conversations.
4. Gateway CPU per call (all its threads, from /proc/<pid>/task/*/schedstat) at turn 1 vs turn 40,
   `--sessions` sessions in lockstep: cost must follow the new tokens, not the context length.

`--compare DIR` measures two gateways in one run: `before` = the checkout DIR of another commit (its gateway, and
pool service with `--pool-service`, run with PYTHONPATH=DIR, so `-m stepline.cli` is that tree's code) and `after` =
this tree. Both run at once, each with its own pool, behind the same fake engine, driven by this load generator, and
read back with this tree's pool code; the rounds alternate (before after, after before, ...) so that drift on the
machine falls on both alike. It prints each figure's median over the rounds for both, its range, and the ratio
after / before.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np
import orjson
from _services import free_port, wait_up

ROOT = Path(__file__).resolve().parents[1]  # the current tree ("after" in a comparison)
FAKE_ENGINE = ROOT / "tests" / "fakes" / "engine.py"  # the tests' fake, run as a script
ADMIN = {"Authorization": "Bearer bench"}
OUT_TOKENS = 16
EOS = 2  # <|im_end|> in the tiny model's vocabulary
TARGETS = {"p50_added_ms": 2.0, "calls_per_s": 1000.0, "cpu_ratio": 2.0, "ttft_added_ms": 1.0}



def cpu_ns(pid: int, main_only: bool = False) -> int:
    """CPU time of `pid`'s threads (or its main, event-loop thread), in ns (schedstat: ns resolution,
    unlike the clock ticks of /proc/<pid>/stat)."""
    total = 0
    for task in [str(pid)] if main_only else os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Bench:
    def __init__(self, http: aiohttp.ClientSession, gateway: str, engine: str, document: str) -> None:
        self.http, self.gateway, self.engine, self.document = http, gateway, engine, document
        self.ids = itertools.count()  # task ids stay unique over rounds

    async def new_session(self, name: str) -> dict:
        task_id = f"{name}-{next(self.ids)}"
        async with self.http.post(
            self.gateway + "/sessions", json={"task_id": task_id, "harness": "bench"}, headers=ADMIN
        ) as r:
            assert r.status == 201, await r.text()
            return await r.json()

    async def end(self, session: dict) -> None:
        url = f"{self.gateway}/sessions/{session['session_id']}/end"
        async with self.http.post(url, json={"status": "completed"}, headers=ADMIN) as r:
            assert r.status == 200, await r.text()

    def first_messages(self) -> list[dict]:
        return [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Read this document.\n\n{self.document}\n\nTurn 0: summarise it."},
        ]

    async def chat(self, session: dict, messages: list[dict], stream: bool = False) -> tuple[str, float, float]:
        """One chat call: (answer text, seconds to the first content chunk, seconds in all)."""
        body = orjson.dumps({"model": "stepline", "messages": messages, "max_tokens": OUT_TOKENS, "stream": stream})
        headers = {"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"}
        start = time.perf_counter()
        async with self.http.post(session["openai_base_url"] + "/chat/completions", data=body, headers=headers) as r:
            if not stream:
                data = orjson.loads(await r.read())
                assert r.status == 200, data
                done = time.perf_counter()
                return data["choices"][0]["message"]["content"] or "", done - start, done - start
            first, text = None, []
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                delta = orjson.loads(line[6:])["choices"]
                piece = delta[0]["delta"].get("content") if delta else None
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            done = time.perf_counter()
            return "".join(text), (first or done) - start, done - start

    async def direct(self, ids: list[int], stream: bool = False) -> tuple[float, float]:
        body = orjson.dumps(
            {
                "input_ids": ids,
                "return_logprob": True,
                "stream": stream,
                "sampling_params": {"max_new_tokens": OUT_TOKENS, "temperature": 1.0},
            }
        )
        start = time.perf_counter()
        async with self.http.post(
            self.engine + "/generate", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            if not stream:
                await r.read()
                done = time.perf_counter()
                return done - start, done - start
            first = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    first = first or time.perf_counter()
            done = time.perf_counter()
            return first - start, done - start

    async def conversation(
        self, session: dict, turns: int, stream: bool = False, on_turn=None
    ) -> list[tuple[float, float]]:
        messages, times = self.first_messages(), []
        for turn in range(turns):
            if on_turn is not None:
                await on_turn(turn)
            text, first, total = await self.chat(session, messages, stream)
            times.append((first, total))
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Turn {turn + 1}: go on with the next point, briefly."},
            ]
        return times


def recorded_calls(pool_url: str, session_id: str) -> list:
    """The session's calls as recorded: the exact prompt ids the engine received, and the timings."""
    from stepline.datapool import open_pool

    pool = open_pool(pool_url, read_only=True)
    try:
        return pool.get_calls(session_id)
    finally:
        pool.close()


async def added_latency(bench: Bench, pool_url: str, turns: int, conversations: int, stream: bool) -> dict:
    """Gateway vs direct, paired per call. Also, from the recorded timings (the gateway's own clock):
    `render` = received → dispatched (prompt building after the request was parsed and validated),
    `upstream` = dispatched → done (whole call) or → first token (stream), as the gateway saw it."""
    via, direct, render, upstream = [], [], [], []
    for c in range(conversations):
        session = await bench.new_session(f"latency-{stream}-{c}")
        times = await bench.conversation(session, turns, stream)
        await bench.end(session)  # acknowledged once every call is in the pool
        for record in recorded_calls(pool_url, session["session_id"]):
            direct.append(await bench.direct(record.prompt_ids.tolist(), stream))
            t = record.timings
            render.append((t["dispatched"] - t["received"]) * 1e3)
            upstream.append((t["first_token" if stream else "done"] - t["dispatched"]) * 1e3)
        via += times
    k = 0 if stream else 1  # first token (stream) or whole call
    added = [(g[k] - d[k]) * 1e3 for g, d in zip(via, direct, strict=True)]
    return {
        "gateway_p50": pct([g[k] * 1e3 for g in via], 50),
        "gateway_p99": pct([g[k] * 1e3 for g in via], 99),
        "direct_p50": pct([d[k] * 1e3 for d in direct], 50),
        "direct_p99": pct([d[k] * 1e3 for d in direct], 99),
        "added_p50": pct(added, 50),
        "added_p99": pct(added, 99),
        "render_p50": pct(render, 50),
        "upstream_p50": pct(upstream, 50),
        "calls": len(added),
    }


async def throughput(bench: Bench, gateway_pid: int, sessions: int, turns: int) -> dict:
    async def one(i: int) -> int:
        session = await bench.new_session(f"load-{i}")
        await bench.conversation(session, turns)
        return turns

    cpu0, loop0, start = cpu_ns(gateway_pid), cpu_ns(gateway_pid, main_only=True), time.perf_counter()
    calls = sum(await asyncio.gather(*(one(i) for i in range(sessions))))
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0.2)  # the recorder writes the last calls
    cpu, loop = (cpu_ns(gateway_pid) - cpu0) / 1e9, (cpu_ns(gateway_pid, main_only=True) - loop0) / 1e9
    return {
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed,
        "gateway_cpu_ms_per_call": cpu / calls * 1e3,
        "event_loop_cpu_ms_per_call": loop / calls * 1e3,
    }


async def cpu_by_turn(bench: Bench, gateway_pid: int, sessions: int, turns: int) -> dict[int, float]:
    """Gateway CPU ms per call at each turn, the sessions moving in lockstep."""
    started: dict[int, int] = {}
    per_turn: dict[int, float] = {}
    barrier = asyncio.Barrier(sessions)

    async def on_turn(turn: int) -> None:
        if await barrier.wait() == 0:  # one session measures between turns
            await asyncio.sleep(0.1)  # the recorder has written the previous turn
            if turn > 0:
                per_turn[turn] = (cpu_ns(gateway_pid) - started[turn - 1]) / 1e6 / sessions
            started[turn] = cpu_ns(gateway_pid)
        await barrier.wait()

    sessions_ = [await bench.new_session(f"cpu-{i}") for i in range(sessions)]
    await asyncio.gather(*(bench.conversation(s, turns + 1, on_turn=on_turn) for s in sessions_))
    return per_turn


class Gateway(NamedTuple):
    proc: subprocess.Popen
    url: str
    pool_url: str
    log: Path


def spawn(stack: ExitStack, command: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """Start a process that `stack` stops (stderr to `log` when given, else to ours)."""
    stderr = stack.enter_context(log.open("wb")) if log is not None else None
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)

    def stop() -> None:
        proc.terminate()
        proc.wait(60)

    stack.callback(stop)
    return proc


def start_engine(stack: ExitStack) -> str:
    """The fake engine, run as a script with the current tree on the path (one engine for both sides)."""
    port = free_port()
    args = ["--port", str(port), "--tokens", str(OUT_TOKENS), "--eos", str(EOS)]
    spawn(stack, [sys.executable, str(FAKE_ENGINE), *args], dict(os.environ, PYTHONPATH=str(ROOT)))
    return f"http://127.0.0.1:{port}"


def start_gateway(
    stack: ExitStack, tree: Path, model_dir: Path, engine_url: str, work: Path, pool_service: bool
) -> Gateway:
    """`stepline gateway` of the checkout `tree` (PYTHONPATH=tree), recording into its own SQLite pool in `work`
    (through that checkout's `stepline pool serve` with `pool_service`). The trees compared so far (17cb02f and
    after) take the same options; adapt the list here per tree if one differs."""
    work.mkdir(parents=True, exist_ok=True)
    cli, env = [sys.executable, "-m", "stepline.cli"], dict(os.environ, PYTHONPATH=str(tree))
    pool_url = f"sqlite:///{work / 'pool.db'}"
    if pool_service:
        port = free_port()
        spawn(stack, [*cli, "pool", "serve", "--db", pool_url, "--port", str(port)], env, work / "pool.log")
        pool_url = f"http://127.0.0.1:{port}"
    port = free_port()
    args = ["--engine", engine_url, "--engine-kind", "sglang", "--model", str(model_dir), "--pool", pool_url,
            "--port", str(port), "--admin-token", "bench", "--context-length", "32768", "--state-dir", str(work)]
    proc = spawn(stack, [*cli, "gateway", *args], env, work / "gateway.log")
    return Gateway(proc, f"http://127.0.0.1:{port}", pool_url, work / "gateway.log")




def document(model_dir: Path, tokens: int) -> str:
    """About `tokens` tokens of prose (this repository's README and docs/, repeated as needed)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # the README and docs/ of the current tree: the same prose for both sides of a comparison
    source = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok.encode(source).ids
    return tok.decode(ids[:tokens])


async def measure(bench: Bench, gateway: Gateway, args: argparse.Namespace) -> dict:
    """One round of the four measurements against one gateway."""
    pid = gateway.proc.pid
    return {
        "latency": await added_latency(bench, gateway.pool_url, args.turns, args.conversations, stream=False),
        "ttft": await added_latency(bench, gateway.pool_url, args.turns, max(1, args.conversations // 2), stream=True),
        "throughput": await throughput(bench, pid, args.sessions, args.turns),
        "cpu": await cpu_by_turn(bench, pid, args.sessions, 40),
    }


async def run(args: argparse.Namespace, model_dir: Path, sides: dict[str, Path], tmp: Path) -> dict[str, list[dict]]:
    """Start one fake engine and each side's gateway, then measure the sides in alternating rounds (A B, B A, ...)
    so that drift on the machine falls on both alike. Returns each side's rounds."""
    with ExitStack() as stack:
        engine_url = start_engine(stack)
        gateways = {
            name: start_gateway(stack, tree, model_dir, engine_url, tmp / name, args.pool_service)
            for name, tree in sides.items()
        }
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await wait_up(http, engine_url)
            for gateway in gateways.values():
                if gateway.pool_url.startswith("http"):
                    await wait_up(http, gateway.pool_url)
                await wait_up(http, gateway.url, gateway.proc, gateway.log)
            text = document(model_dir, args.context)
            benches = {name: Bench(http, gateway.url, engine_url, text) for name, gateway in gateways.items()}
            for bench in benches.values():
                await bench.conversation(await bench.new_session("warmup"), 3)
            results: dict[str, list[dict]] = {name: [] for name in sides}
            for round_ in range(args.rounds):
                for name in list(sides)[:: 1 if round_ % 2 == 0 else -1]:
                    results[name].append(await measure(benches[name], gateways[name], args))
    return results


def report(r: dict, args: argparse.Namespace) -> None:
    lat, ttft, tp, cpu = r["latency"], r["ttft"], r["throughput"], r["cpu"]
    ratio = cpu[40] / cpu[1]
    rows = [
        ("latency p50 (ms)", lat["direct_p50"], lat["gateway_p50"], lat["added_p50"], TARGETS["p50_added_ms"]),
        ("latency p99 (ms)", lat["direct_p99"], lat["gateway_p99"], lat["added_p99"], None),
        ("TTFT p50 (ms, stream)", ttft["direct_p50"], ttft["gateway_p50"], ttft["added_p50"], TARGETS["ttft_added_ms"]),
        ("TTFT p99 (ms, stream)", ttft["direct_p99"], ttft["gateway_p99"], ttft["added_p99"], None),
    ]
    pool = "pool service (HTTP) -> SQLite" if args.pool_service else "SQLite pool"
    print(
        f"\ngateway benchmark: {args.context}-token document, {args.turns}-turn conversations, "
        f"{OUT_TOKENS} tokens per answer, fake engine, {pool}; {os.cpu_count()} CPUs\n"
    )
    print(f"{'':26}{'direct':>10}{'gateway':>10}{'added':>10}{'target':>10}")
    for name, d, g, a, target in rows:
        print(f"{name:26}{d:10.2f}{g:10.2f}{a:10.2f}{(f'<= {target:g}' if target else ''):>10}")
    for name, r in (("whole call", lat), ("first token", ttft)):
        print(f"  inside the gateway, p50 ({name}): prompt building {r['render_p50']:.2f} ms, engine as seen by "
              f"the gateway {r['upstream_p50']:.2f} ms (direct {r['direct_p50']:.2f} ms)")
    total, loop = tp["gateway_cpu_ms_per_call"], tp["event_loop_cpu_ms_per_call"]
    print(
        f"\nthroughput, {args.sessions} sessions: {tp['calls_per_s']:.0f} calls/s ({tp['calls']} calls in "
        f"{tp['seconds']:.1f} s; target >= {TARGETS['calls_per_s']:g}); gateway CPU {total:.2f} ms/call "
        f"(event loop {loop:.2f}, recorder + pool {total - loop:.2f}) "
        f"-> at most {1e3 / loop:.0f} calls/s from its event loop"
    )
    print(
        f"gateway CPU per call: turn 1 {cpu[1]:.2f} ms, turn 20 {cpu[20]:.2f} ms, turn 40 {cpu[40]:.2f} ms; "
        f"ratio 40/1 = {ratio:.2f} (target <= {TARGETS['cpu_ratio']:g})"
    )
    misses = [
        name
        for name, ok in [
            ("p50 added latency", lat["added_p50"] <= TARGETS["p50_added_ms"]),
            ("throughput", tp["calls_per_s"] >= TARGETS["calls_per_s"]),
            ("CPU ratio", ratio <= TARGETS["cpu_ratio"]),
            ("TTFT added", ttft["added_p50"] <= TARGETS["ttft_added_ms"]),
        ]
        if not ok
    ]
    print("targets: " + ("all met" if not misses else "MISSED " + ", ".join(misses)))


# Figures of a comparison: (label, better when "lower" or "higher", read from one round's results).
FIGURES = [
    ("added latency p50 (ms)", "lower", lambda r: r["latency"]["added_p50"]),
    ("added latency p99 (ms)", "lower", lambda r: r["latency"]["added_p99"]),
    ("prompt building p50 (ms)", "lower", lambda r: r["latency"]["render_p50"]),
    ("added TTFT p50 (ms, stream)", "lower", lambda r: r["ttft"]["added_p50"]),
    ("added TTFT p99 (ms, stream)", "lower", lambda r: r["ttft"]["added_p99"]),
    ("calls/s", "higher", lambda r: r["throughput"]["calls_per_s"]),
    ("gateway CPU per call (ms)", "lower", lambda r: r["throughput"]["gateway_cpu_ms_per_call"]),
    ("  event loop (ms)", "lower", lambda r: r["throughput"]["event_loop_cpu_ms_per_call"]),
    ("CPU per call turn 1 (ms)", "lower", lambda r: r["cpu"][1]),
    ("CPU per call turn 40 (ms)", "lower", lambda r: r["cpu"][40]),
    ("CPU turn 40 / turn 1", "lower", lambda r: r["cpu"][40] / r["cpu"][1]),
]


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "?") + ("+changes" if dirty else "")


def report_comparison(results: dict[str, list[dict]], sides: dict[str, Path], args: argparse.Namespace) -> None:
    """Each figure for both sides: median over the rounds [min–max], and the ratio of the medians, after / before."""
    pool = "pool service (HTTP) -> SQLite" if args.pool_service else "SQLite pool"
    print(
        f"\ngateway before / after: {args.rounds} alternating rounds each; {args.context}-token document, "
        f"{args.turns}-turn conversations, {args.sessions} sessions, fake engine, {pool}; {os.cpu_count()} CPUs"
    )
    for name, tree in sides.items():
        print(f"  {name}: {tree} at {commit(tree)}")
    print(f"\n{'':30}{'before':>24}{'after':>24}{'after/before':>14}")
    for label, better, read in FIGURES:
        cells, medians = [], []
        for name in sides:
            values = [read(r) for r in results[name]]
            medians.append(float(np.median(values)))
            cells.append(f"{medians[-1]:.2f} [{min(values):.2f}–{max(values):.2f}]")
        print(f"{label:30}{cells[0]:>24}{cells[1]:>24}{medians[1] / medians[0]:>10.3f} ({better} is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--context", type=int, default=4000, help="tokens in the first user message")
    parser.add_argument("--conversations", type=int, default=8, help="sequential conversations for the latency figures")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: build `tiny`)")
    parser.add_argument("--pool-service", action="store_true", help="record through `stepline pool serve` (HTTP)")
    parser.add_argument("--compare", type=Path, default=None, metavar="DIR",
                        help="also measure the gateway of this checkout (another commit) as `before`, alternating")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (default: 1, or 3 with --compare)")
    parser.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.compare else 1)
    sides = {"current": ROOT} if args.compare is None else {"before": args.compare.resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from stepline.models import build_model

            model_dir = build_model(Path(tmp) / "tiny", kind="tiny", seed=0)
        results = asyncio.run(run(args, model_dir, sides, Path(tmp)))
    if args.compare is None:
        for one in results["current"]:
            report(one, args)
    else:
        report_comparison(results, sides, args)
    if args.json:
        print(orjson.dumps(results, option=orjson.OPT_NON_STR_KEYS).decode())


if __name__ == "__main__":
    main()
