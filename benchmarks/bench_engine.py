"""Built-in engine throughput: generated tokens/s at concurrency 1, 8 and 32 on the tiny model.

    .venv/bin/python benchmarks/bench_engine.py [--tokens 64] [--seconds 8] [--threads 1]

Builds the tiny model, starts `stepline engine` as its own process, and runs `c` clients that each
send requests back to back for `--seconds` (sampled, temperature 1, ignore_eos, `--tokens` new tokens
each, a 32-token prompt); tokens/s = tokens of all requests / time until the last one finished.
Prints tokens/s per concurrency side by side with the ratio to concurrency 1. Target: the
8-client figure is at least 4x the 1-client one (continuous batching, not serialisation).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONCURRENCY = (1, 8, 32)
TARGET_RATIO_AT_8 = 4.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def client(http: httpx.AsyncClient, worker: int, deadline: float, tokens: int) -> int:
    generated, r = 0, 0
    while time.perf_counter() < deadline:
        r += 1
        body = {"input_ids": [(worker * 97 + r * 13 + i) % 3000 + 10 for i in range(32)],
                "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
                                    "sampling_seed": worker * 1000 + r}}
        response = await http.post("/generate", json=body)
        response.raise_for_status()
        generated += response.json()["meta_info"]["completion_tokens"]
    return generated


async def measure(url: str, concurrency: int, seconds: float, tokens: int) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await client(http, 0, time.perf_counter() + 0.5, 8)  # warm up
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(http, w, start + seconds, tokens) for w in range(concurrency)))
        return sum(counts) / (time.perf_counter() - start)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"engine exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit("engine did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each concurrency level runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the engine")
    args = parser.parse_args()

    from stepline.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tiny", kind="tiny", seed=0)
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "engine", "--model", str(model), "--port",
                                 str(port), "--threads", str(args.threads)])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            rates = {c: asyncio.run(measure(url, c, args.seconds, args.tokens)) for c in CONCURRENCY}
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(f"tiny model, {args.tokens} new tokens/request, {args.seconds:.0f} s per level, "
          f"engine torch threads {args.threads}")
    print(f"{'concurrency':>12} {'tokens/s':>10} {'vs c=1':>8}")
    for c, rate in rates.items():
        print(f"{c:>12} {rate:>10.0f} {rate / rates[1]:>7.1f}x")
    ratio = rates[8] / rates[1]
    verdict = "OK" if ratio >= TARGET_RATIO_AT_8 else "BELOW TARGET"
    print(f"c=8 / c=1 = {ratio:.1f}x (target >= {TARGET_RATIO_AT_8:.0f}x): {verdict}")


if __name__ == "__main__":
    main()
