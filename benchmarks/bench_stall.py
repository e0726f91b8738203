"""No request stalls the event loop: the gateway beside a bare aiohttp passthrough proxy, in one run.

    .venv/bin/python benchmarks/bench_stall.py [--big-mb 7.9] [--long-tokens 128000] [--short-tokens 4000]
        [--repeat 3] [--burst 4] [--turns 8]

Processes: a FakeEngine (tests/fakes/engine.py as a script, one token per answer), the gateway (`stepline gateway`
on the `qwen3-tiny` model: the real Qwen3 tokenizer and template; the `tiny` model where that is not cached), and
a passthrough proxy (this script, `--serve-passthrough`: reads each body and forwards it unchanged to a sink, this
script `--serve-sink`, that reads it and answers a fixed chat completion). The passthrough is the floor: what an
aiohttp server costs for the same bytes.

1. Stall: while one request is handled, /health is asked every 5 ms; the slowest answer and the 99th percentile,
   for a `--big-mb` MB chat body (many messages; refused as too long for the context once tokenized) and for a
   `--long-tokens`-token prompt (one user message; answered), each `--repeat` times after a warm-up.
2. Per-turn CPU: conversations on a `--short-tokens` and a `--long-tokens` document; turn 1 sends the document,
   turn 2 appends the answer and one short question. CPU of the gateway's processes (its threads and its
   tokenizer processes) per turn-2 call, mean of `--turns` conversations; the passthrough's for the same bodies.
3. RSS: of each proxy (the gateway with its tokenizer processes) before, right after and 3 s after `--burst`
   concurrent `--big-mb` MB requests.

`--gil-probe` instead measures, in this process, what holds the GIL: the `tokenizers` binding's `encode` and
`encode_batch` of a `--long-tokens` text on a thread while the main thread ticks every 1 ms (the longest gap
between ticks is how long the thread held the GIL), building its ids (`Encoding.ids`), orjson and pydantic parsing
a `--big-mb` MB chat body, and the Jinja chat template rendering it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had not but "
         "river mountain 1987 engine agent reward token policy gradient harbour lantern").split()
ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})


# --- the passthrough proxy and its sink (this script, run as a child) ---

def serve_sink(port: int) -> None:
    from aiohttp import web

    async def sink(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/{tail:.*}", sink)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_passthrough(port: int, upstream: str) -> None:
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app["http"].post(upstream + request.path, data=body,
                                            headers={"Content-Type": "application/json"}) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        async with aiohttp.ClientSession() as app["http"]:
            yield

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- measuring processes ---


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (the gateway's tokenizer processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except FileNotFoundError:
                pass
    return out


def cpu_ns(pid: int) -> int:
    """CPU time of the process tree's threads, ns (schedstat: ns resolution)."""
    total = 0
    for p in tree(pid):
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                total += int(Path(f"/proc/{p}/task/{task}/schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass
    return total


def rss_mb(pid: int, children: bool = True) -> float:
    total = 0
    for p in tree(pid) if children else [pid]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


class Target:
    """One proxy under test: the gateway (a session per conversation) or the passthrough (any key)."""

    def __init__(self, name: str, url: str, proc: subprocess.Popen, http: aiohttp.ClientSession) -> None:
        self.name, self.url, self.proc, self.http = name, url, proc, http

    async def base(self) -> tuple[str, dict]:
        if self.name == "passthrough":
            return self.url + "/v1", {}
        async with self.http.post(self.url + "/sessions", json={"task_id": "t", "harness": "bench"},
                                  headers=ADMIN) as r:
            assert r.status == 201, await r.text()
            s = await r.json()
        return s["openai_base_url"], {"Authorization": f"Bearer {s['api_key']}"}

    async def chat(self, base: tuple[str, dict], messages: list[dict]) -> tuple[int, dict]:
        body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 1})
        async with self.http.post(base[0] + "/chat/completions", data=body,
                                  headers={**base[1], "Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read())




# --- the workloads ---

def text_of(tokenizer, tokens: int, seed: int) -> str:  # type: ignore[no-untyped-def]
    """About `tokens` tokens of random words."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    text = " ".join(words)
    n = len(tokenizer.encode(text).ids)
    return " ".join(words[: int(len(words) * tokens / n)])


def big_messages(mb: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    chunk = " ".join(rng.choice(WORDS) for _ in range(2000))
    messages, size = [{"role": "system", "content": "You are helpful."}], 0
    while size < mb * 1e6 - len(chunk) - 64:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": chunk})
        size += len(chunk) + 40
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "go on"})
    return messages


async def stall(target: Target, messages: list[dict], repeat: int) -> dict:
    """The slowest /health answer (and its p99) while `messages` is handled, over `repeat` requests."""
    waits: list[float] = []
    statuses = []
    for _ in range(repeat):
        base = await target.base()
        call = asyncio.ensure_future(target.chat(base, messages))
        while True:  # the first probe goes out with the request
            start = time.perf_counter()
            async with target.http.get(target.url + "/health") as r:
                await r.read()
            waits.append(time.perf_counter() - start)
            if call.done():
                break
            await asyncio.sleep(0.005)
        statuses.append((await call)[0])
    waits.sort()
    return {"max_ms": waits[-1] * 1e3 if waits else 0.0, "p99_ms": waits[int(0.99 * (len(waits) - 1))] * 1e3
            if waits else 0.0, "probes": len(waits), "status": sorted(set(statuses))}


async def turn_cpu(target: Target, document: str, turns: int) -> float:
    """CPU ms of the target's processes per turn-2 call (turn 1 untimed)."""
    spent = 0
    for i in range(turns):
        base = await target.base()
        messages = [{"role": "user", "content": f"Conversation {i}. {document}\n\nSummarise."}]
        status, answer = await target.chat(base, messages)
        assert status == 200, answer
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the second point?"}]
        await asyncio.sleep(0.3)  # the recorder writes turn 1
        before = cpu_ns(target.proc.pid)
        status, answer = await target.chat(base, messages)
        await asyncio.sleep(0.3)  # and turn 2: its cost is counted
        spent += cpu_ns(target.proc.pid) - before
        assert status == 200, answer
    return spent / turns / 1e6


async def rss(target: Target, messages: list[dict], burst: int) -> list[tuple[float, float]]:
    """(the proxy's own RSS, with its tokenizer processes) before, right after and 3 s after the burst."""
    pid = target.proc.pid
    out = [(rss_mb(pid, False), rss_mb(pid))]
    bases = [await target.base() for _ in range(burst)]
    await asyncio.gather(*(target.chat(b, messages) for b in bases))
    out.append((rss_mb(pid, False), rss_mb(pid)))
    await asyncio.sleep(3)
    return [*out, (rss_mb(pid, False), rss_mb(pid))]


async def idle_cpu(target: Target) -> float:
    """CPU ms the target spends in 0.6 s doing nothing (its share of each turn-2 window is subtracted)."""
    before = cpu_ns(target.proc.pid)
    await asyncio.sleep(0.6)
    return (cpu_ns(target.proc.pid) - before) / 1e6


# --- what holds the GIL ---

def longest_gap(fn) -> float:  # type: ignore[no-untyped-def]
    """ms: the longest the main thread, ticking every 1 ms, waited while `fn` ran on another thread."""
    import threading

    done, gaps = threading.Event(), [0.0]
    worker = threading.Thread(target=lambda: (fn(), done.set()))
    last = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    return max(gaps) * 1e3


def gil_probe(args: argparse.Namespace, model: Path) -> None:
    from tokenizers import Tokenizer

    from stepline.gateway.frontends.chat import ChatRequest
    from stepline.gateway.templating import load_template

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = text_of(tok, args.long_tokens, 1)
    body = orjson.dumps({"model": "m", "messages": big_messages(args.big_mb, 3), "max_tokens": 1})
    template = load_template(model)
    [encoding] = tok.encode_batch([text], add_special_tokens=False)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    messages = orjson.loads(body)["messages"]
    rows = [
        (f"encode, {len(encoding)} tokens", timed(lambda: tok.encode(text, add_special_tokens=False)),
         longest_gap(lambda: tok.encode(text, add_special_tokens=False))),
        ("encode_batch (one text)", timed(lambda: tok.encode_batch([text], add_special_tokens=False)),
         longest_gap(lambda: tok.encode_batch([text], add_special_tokens=False))),
        ("Encoding.ids (the Python list)", timed(lambda: encoding.ids), longest_gap(lambda: encoding.ids)),
        (f"orjson.loads, {len(body) / 1e6:.1f} MB chat body", timed(lambda: orjson.loads(body)),
         longest_gap(lambda: orjson.loads(body))),
        ("pydantic ChatRequest.model_validate_json", timed(lambda: ChatRequest.model_validate_json(body)),
         longest_gap(lambda: ChatRequest.model_validate_json(body))),
        ("Jinja chat template, the same messages", timed(lambda: template.render(messages, None, True)),
         longest_gap(lambda: template.render(messages, None, True))),
    ]
    print(f"\nwhat holds the GIL (model {model.name}, {os.cpu_count()} CPUs)\n")
    print(f"{'':46}{'alone (ms)':>12}{'longest main-thread wait (ms)':>32}")
    for name, alone, gap in rows:
        print(f"{name:46}{alone:12.1f}{gap:32.1f}")


# --- the run ---

def start(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, tuple[subprocess.Popen, str]]:
    me = [sys.executable, str(Path(__file__).resolve())]
    ports = {name: free_port() for name in ("engine", "gateway", "sink", "passthrough")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    engine = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--port", str(ports["engine"]), "--tokens", "1"],
                              **quiet)  # type: ignore[call-overload]
    gateway = subprocess.Popen([sys.executable, "-m", "stepline.cli", "gateway", "--engine", url["engine"],
                                "--engine-kind", "sglang", "--model", str(model), "--pool",
                                f"sqlite:///{tmp / 'pool.db'}", "--port", str(ports["gateway"]), "--admin-token",
                                "bench", "--spill", str(tmp / "spill"), "--context-length",
                                str(args.long_tokens + 8192)], **quiet)  # type: ignore[call-overload]
    sink = subprocess.Popen([*me, "--serve-sink", str(ports["sink"])], **quiet)  # type: ignore[call-overload]
    passthrough = subprocess.Popen([*me, "--serve-passthrough", str(ports["passthrough"]), "--upstream", url["sink"]],
                                   **quiet)  # type: ignore[call-overload]
    return {"engine": (engine, url["engine"]), "gateway": (gateway, url["gateway"]), "sink": (sink, url["sink"]),
            "passthrough": (passthrough, url["passthrough"])}


async def run(args: argparse.Namespace, model: Path, tmp: Path) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    long_doc, short_doc = text_of(tokenizer, args.long_tokens, 1), text_of(tokenizer, args.short_tokens, 2)
    big = big_messages(args.big_mb, 3)
    procs = start(args, model, tmp)
    results: dict = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=3600)) as http:
            for name in ("engine", "gateway", "passthrough"):
                await wait_up(http, procs[name][1], procs[name][0])
            for name in ("gateway", "passthrough"):
                target = Target(name, procs[name][1], procs[name][0], http)
                await target.chat(await target.base(), [{"role": "user", "content": long_doc}])  # warm-up
                idle = await idle_cpu(target) / 2  # per 0.3 s: the idle part of each turn-2 window
                results[name] = {
                    "stall_big": await stall(target, big, args.repeat),
                    "stall_long": await stall(target, [{"role": "user", "content": long_doc}], args.repeat),
                    "turn_short": await turn_cpu(target, short_doc, args.turns) - idle,
                    "turn_long": await turn_cpu(target, long_doc, args.turns) - idle,
                    "rss": await rss(target, big, args.burst),
                }
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(60)
    return results


def report(r: dict, args: argparse.Namespace, model: Path) -> None:
    g, p = r["gateway"], r["passthrough"]
    print(f"\nstall benchmark: model {model.name}, fake engine (1 token), {os.cpu_count()} CPUs; gateway vs a bare "
          f"aiohttp passthrough proxy\n")
    print(f"{'':46}{'gateway':>12}{'passthrough':>14}")
    for key, label in (("stall_big", f"/health stall, {args.big_mb:g} MB chat body"),
                       ("stall_long", f"/health stall, {args.long_tokens}-token prompt")):
        for stat in ("max_ms", "p99_ms"):
            print(f"{label + ' (' + stat[:-3] + ', ms)':46}{g[key][stat]:12.1f}{p[key][stat]:14.1f}")
        print(f"{'  answers (HTTP status), /health probes':46}{str(g[key]['status']) + ' ' + str(g[key]['probes']):>12}"
              f"{str(p[key]['status']) + ' ' + str(p[key]['probes']):>14}")
    for key, label in (("turn_short", f"CPU per turn 2, {args.short_tokens} tokens (ms)"),
                       ("turn_long", f"CPU per turn 2, {args.long_tokens} tokens (ms)")):
        print(f"{label:46}{g[key]:12.2f}{p[key]:14.2f}")
    print(f"{'  ratio long / short':46}{g['turn_long'] / g['turn_short']:12.2f}"
          f"{p['turn_long'] / max(p['turn_short'], 1e-9):14.2f}")
    for i, when in enumerate(("before", "right after", "3 s after")):
        own, total = g["rss"][i]
        print(f"{f'RSS {when} {args.burst} x {args.big_mb:g} MB (MB)':46}{f'{own:.0f} ({total:.0f})':>12}"
              f"{p['rss'][i][0]:14.0f}")
    print("  (the gateway's own process; in brackets with its tokenizer processes)")
    print("\ntargets: /health stall < 10 ms; turn 2 long/short <= 2; RSS 3 s after within 20% of before")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-mb", type=float, default=7.9, help="size of the large chat body, MB")
    parser.add_argument("--long-tokens", type=int, default=128_000)
    parser.add_argument("--short-tokens", type=int, default=4_000)
    parser.add_argument("--repeat", type=int, default=3, help="large requests per stall measurement")
    parser.add_argument("--burst", type=int, default=4, help="concurrent large requests of the RSS measurement")
    parser.add_argument("--turns", type=int, default=8, help="conversations per per-turn CPU figure")
    parser.add_argument("--gil-probe", action="store_true", help="measure what holds the GIL, in this process")
    parser.add_argument("--serve-sink", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-passthrough", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sink is not None:
        return serve_sink(args.serve_sink)
    if args.serve_passthrough is not None:
        return serve_passthrough(args.serve_passthrough, args.upstream)
    from stepline.assets import AssetUnavailable
    from stepline.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = build_model(Path(tmp) / "qwen3-tiny", kind="qwen3-tiny", seed=0)
        except AssetUnavailable:
            model = build_model(Path(tmp) / "tiny", kind="tiny", seed=0)
        if args.gil_probe:
            return gil_probe(args, model)
        report(asyncio.run(run(args, model, Path(tmp))), args, model)


if __name__ == "__main__":
    main()
