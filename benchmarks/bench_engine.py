"""Built-in engine speed: tokens/s at concurrency 1, 8 and 32, or episodes/s of multi-turn agent episodes.

    .venv/bin/python benchmarks/bench_engine.py [--model DIR] [--tokens 64] [--seconds 8] [--threads 1]
        [--dtype bfloat16] [--baseline-src DIR] [--engine URL --engine-kind vllm]
    .venv/bin/python benchmarks/bench_engine.py --episodes --model models/smollm2 [--concurrent 8] [--turns 4]
        [--baseline-src DIR] [--repeats 1]

Every engine runs as its own process (`stepline engine`, `--threads` torch threads); without
`--model` the tiny model is built in a temporary folder.

Throughput (default): `c` clients each send requests back to back for `--seconds` (sampled,
temperature 1, ignore_eos, `--tokens` new tokens each, a 32-token prompt); tokens/s = tokens of all
requests / time until the last one finished, side by side with the ratio to concurrency 1. Target:
the 8-client figure is at least 4x the 1-client one (continuous batching, not serialisation).
`--engine URL --engine-kind K` also measures a running engine (vLLM, SGLang) on the same model, the
same way, both through the gateway's own adapters (`stepline.gateway.engines.make_engine`, a 32-token id prompt
each), and prints the two side by side: when to switch.

Episodes (`--episodes`): `--concurrent` search-agent-shaped episodes at once, each `--turns` turns:
the first prompt is the chat template's system prompt with two search tools plus a question
(~`--prompt-tokens`, the system part shared by all episodes), each next prompt appends the previous
output ids and a `--obs-tokens` tool response, and each turn samples `--out-tokens` tokens
(temperature 1, ignore_eos, seeded per episode and turn). Engines compared, each fresh: the prefix
cache off in float32 (the engine's behaviour before the prefix cache), on in float32, on in
bfloat16; with `--baseline-src DIR` (a checkout of an older commit, e.g. made with
`git archive <commit> stepline | tar -x -C DIR`) that code's engine comes first. Prints episodes/s
with the ratio to the first engine (goal: >= 3x with the prefix cache in bf16), and how far each
engine's returned logprobs are from a float32 teacher-forced forward over the same sampled tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from _services import free_port

CONCURRENCY = (1, 8, 32)
TARGET_RATIO_AT_8 = 4.0
TARGET_EPISODE_RATIO = 3.0



def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
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


class Engine:
    """`stepline engine` in its own process, from this checkout or from `src` (an older one)."""

    def __init__(self, model: Path, threads: int, flags: list[str], src: Path | None = None) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ)
        if src is not None:  # `python -m` puts the working folder first on sys.path: run from src
            env["PYTHONPATH"] = os.pathsep.join([str(src.resolve()), env.get("PYTHONPATH", "")])
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "engine", "--model", str(model.resolve()),
                                      "--port", port, "--threads", str(threads), *flags], env=env,
                                     cwd=None if src is None else src)

    def __enter__(self) -> str:
        try:
            wait_healthy(self.url, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


# ---- throughput mode ---------------------------------------------------------------------------

async def client(http: httpx.AsyncClient, worker: int, deadline: float, tokens: int, vocab: int) -> int:
    generated, r = 0, 0
    while time.perf_counter() < deadline:
        r += 1
        body = {"input_ids": [(worker * 97 + r * 13 + i) % (vocab - 10) + 10 for i in range(32)],
                "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
                                    "sampling_seed": worker * 1000 + r}}
        response = await http.post("/generate", json=body)
        response.raise_for_status()
        generated += response.json()["meta_info"]["completion_tokens"]
    return generated


async def measure(url: str, concurrency: int, seconds: float, tokens: int, vocab: int) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await client(http, 0, time.perf_counter() + 0.5, 8, vocab)  # warm up
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(http, w, start + seconds, tokens, vocab) for w in range(concurrency)))
        return sum(counts) / (time.perf_counter() - start)


async def adapter_client(engine, worker: int, deadline: float, tokens: int, vocab: int) -> int:
    from stepline.gateway.engines import SamplingParams

    generated, r = 0, 0
    while time.perf_counter() < deadline:
        r += 1
        prompt = [(worker * 97 + r * 13 + i) % (vocab - 10) + 10 for i in range(32)]
        sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, seed=worker * 1000 + r)
        generated += len((await engine.generate(prompt, sampling)).output_ids)
    return generated


async def measure_adapter(url: str, kind: str, concurrency: int, seconds: float, tokens: int, vocab: int) -> float:
    import aiohttp

    from stepline.gateway.engines import make_engine

    async with aiohttp.ClientSession() as http:
        engine = make_engine(url, kind, http, timeout=600)
        await adapter_client(engine, 0, time.perf_counter() + 0.5, 8, vocab)  # warm up
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(adapter_client(engine, w, start + seconds, tokens, vocab) for w in range(concurrency)))
        return sum(counts) / (time.perf_counter() - start)


def side_by_side(model: Path, name: str, args: argparse.Namespace) -> None:
    """The built-in engine (its own process) and the running engine at --engine, through the adapters."""
    from transformers import AutoTokenizer

    vocab = min(len(AutoTokenizer.from_pretrained(model)), 3000)
    with Engine(model, args.threads, [] if args.dtype is None else ["--dtype", args.dtype]) as url:
        builtin = {c: asyncio.run(measure_adapter(url, "builtin", c, args.seconds, args.tokens, vocab))
                   for c in CONCURRENCY}
    other = {c: asyncio.run(measure_adapter(args.engine, args.engine_kind, c, args.seconds, args.tokens, vocab))
             for c in CONCURRENCY}
    print(f"{name}, {args.tokens} new tokens/request, {args.seconds:.0f} s per level; built-in engine with "
          f"{args.threads} torch thread(s), dtype {args.dtype or 'float32'}; {args.engine_kind} at {args.engine}")
    print(f"{'concurrency':>12} {'built-in tok/s':>15} {args.engine_kind + ' tok/s':>15} {'ratio':>7}")
    for c in CONCURRENCY:
        print(f"{c:>12} {builtin[c]:>15.1f} {other[c]:>15.1f} {other[c] / builtin[c]:>6.2f}x")


def throughput(model: Path, name: str, args: argparse.Namespace) -> None:
    if args.engine is not None:
        side_by_side(model, name, args)
        return
    flags = [] if args.dtype is None else ["--dtype", args.dtype]
    if args.baseline_src is not None:
        name += f", engine of {args.baseline_src}"
    with Engine(model, args.threads, flags, args.baseline_src) as url:
        vocab = min(httpx.get(f"{url}/model_info").json()["vocab_size"], 3000)
        rates = {c: asyncio.run(measure(url, c, args.seconds, args.tokens, vocab)) for c in CONCURRENCY}
    print(f"{name}, {args.tokens} new tokens/request, {args.seconds:.0f} s per level, "
          f"engine torch threads {args.threads}, dtype {args.dtype or 'float32'}")
    print(f"{'concurrency':>12} {'tokens/s':>10} {'vs c=1':>8}")
    for c, rate in rates.items():
        print(f"{c:>12} {rate:>10.1f} {rate / rates[1]:>7.1f}x")
    ratio = rates[8] / rates[1]
    verdict = "OK" if ratio >= TARGET_RATIO_AT_8 else "BELOW TARGET"
    print(f"c=8 / c=1 = {ratio:.1f}x (target >= {TARGET_RATIO_AT_8:.0f}x): {verdict}")


# ---- episode mode ------------------------------------------------------------------------------

SYSTEM = (
    "You are a research assistant that answers questions by searching the web. Think about what you need "
    "to know, call the search tool with a focused query, read the results, and search again when they are "
    "not enough. Quote the sources you use by their URL. Keep each reasoning step short. When you are "
    "confident, answer with the final answer inside <answer></answer> tags; if the results contradict each "
    "other, say which source you trust and why. Never invent a URL. Prefer primary sources such as official "
    "documentation, papers and standards over blog posts. Dates matter: when a question asks about the "
    "current state of something, check the dates of the results and prefer the most recent one. "
)
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web; returns the top results with title, URL and snippet.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "The search query, a few keywords."},
            "top_k": {"type": "integer", "description": "How many results to return (1-10, default 5)."}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "open_page", "description": "Fetch a web page and return its main text, cut to 2000 characters.",
        "parameters": {"type": "object", "properties": {
            "url": {"type": "string", "description": "The URL of a page from the search results."}},
            "required": ["url"]}}},
]
QUESTIONS = [
    "Which river flows through the capital of the country that hosted the 1992 Summer Olympics?",
    "Who designed the first programmable computer that used binary floating-point arithmetic?",
    "What is the boiling point of water at the summit of the highest mountain in Africa?",
    "Which element has the highest melting point, and in what year was it first isolated?",
    "How many moons of Neptune were discovered by the Voyager 2 probe in 1989?",
    "What was the population of the largest city in Australia at its most recent census?",
    "Which composer wrote the opera that premiered at the opening of the Suez Canal era in Cairo?",
    "What is the deepest lake in Europe, and which two countries border it?",
]


@dataclass
class Turn:
    prompt: list[int]
    output_ids: list[int]
    logprobs: list[float]
    cached_tokens: int


def first_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Chat-template prompts with tools: one shared system prompt (padded to reach ~length) + a question."""
    def render(system: str, question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    system = SYSTEM
    while len(render(system, QUESTIONS[0])) < length:
        system += SYSTEM
    # Cut the system prompt (a shared prefix) so the first question's prompt has `length` tokens.
    system_ids = tokenizer.encode(system, add_special_tokens=False)
    lo, hi = 1, len(system_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(render(tokenizer.decode(system_ids[:mid]), QUESTIONS[0])) <= length:
            lo = mid
        else:
            hi = mid - 1
    system = tokenizer.decode(system_ids[:lo])
    return [render(system, QUESTIONS[e % len(QUESTIONS)] + ("" if e < len(QUESTIONS) else f" (case {e})"))
            for e in range(count)]


def observation(tokenizer, episode: int, turn: int, length: int) -> list[int]:
    """A `length`-token tool response closing the assistant turn and opening the next one."""
    head = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n", add_special_tokens=False)
    tail = tokenizer.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    body = " ".join(f"[{k}] Result {k} for query {episode}.{turn}: https://example.org/{episode}/{turn}/{k} "
                    f"A page about the topic of question {episode}, updated in 20{10 + k}, with figures."
                    for k in range(1, 8))
    body_ids = tokenizer.encode(body, add_special_tokens=False)[: max(length - len(head) - len(tail), 0)]
    return head + body_ids + tail


async def episode(http: httpx.AsyncClient, e: int, prompt: list[int], observations: list[list[int]],
                  out_tokens: int) -> list[Turn]:
    turns = []
    for t, obs in enumerate(observations):
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": out_tokens, "temperature": 1.0, "ignore_eos": True,
                                    "sampling_seed": 1000 * e + t}}
        response = await http.post("/generate", json=body)
        response.raise_for_status()
        result = response.json()
        meta = result["meta_info"]
        turns.append(Turn(prompt, result["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
                          meta.get("cached_tokens", 0)))
        prompt = prompt + result["output_ids"] + obs
    return turns


async def run_episodes(url: str, prompts: list[list[int]], observations: list[list[list[int]]],
                       out_tokens: int) -> tuple[float, list[list[Turn]]]:
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=len(prompts))) as http:
        warm = {"input_ids": prompts[0][:16], "sampling_params": {"max_new_tokens": 4}}
        (await http.post("/generate", json=warm)).raise_for_status()
        await http.post("/flush_cache")
        start = time.perf_counter()
        episodes = await asyncio.gather(*(episode(http, e, p, observations[e], out_tokens)
                                          for e, p in enumerate(prompts)))
        return time.perf_counter() - start, episodes


def logprob_errors(model_dir: Path, episodes: list[list[Turn]]) -> tuple[float, float]:
    """Max and mean |engine logprob - float32 teacher-forced logprob| over every sampled token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    with torch.inference_mode():
        for turns in episodes:
            last = turns[-1]
            ids = last.prompt + last.output_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # temperature 1
            for turn in turns:
                at = torch.arange(len(turn.prompt) - 1, len(turn.prompt) - 1 + len(turn.output_ids))
                expected = logprobs[at, torch.tensor(turn.output_ids)]
                diffs.append((expected - torch.tensor(turn.logprobs)).abs())
    every = torch.cat(diffs)
    return float(every.max()), float(every.mean())


def episodes_mode(model: Path, name: str, args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = first_prompts(tokenizer, args.concurrent, args.prompt_tokens)
    observations = [[observation(tokenizer, e, t, args.obs_tokens) for t in range(args.turns)]
                    for e in range(args.concurrent)]
    configs: list[tuple[str, list[str], Path | None]] = [
        ("no prefix cache, float32", ["--prefix-cache-mb", "0"], None),
        ("prefix cache, float32", [], None),
        ("prefix cache, bfloat16", ["--dtype", "bfloat16"], None),
    ]
    if args.baseline_src is not None:
        configs.insert(0, (f"engine of {args.baseline_src}", [], args.baseline_src))
    # Rounds run every engine once, in turn, so that load from other jobs on a shared machine spreads
    # over all of them; the table shows the median round (and the range).
    runs: dict[str, list[tuple[float, list[list[Turn]]]]] = {label: [] for label, _, _ in configs}
    for round_ in range(args.repeats):
        for label, flags, src in configs:
            with Engine(model, args.threads, flags, src) as url:
                runs[label].append(asyncio.run(run_episodes(url, prompts, observations, args.out_tokens)))
            print(f"  round {round_ + 1}, {label}: {runs[label][-1][0]:.1f} s", file=sys.stderr, flush=True)
    results = {label: sorted(r, key=lambda run: run[0])[len(r) // 2] for label, r in runs.items()}

    import torch
    torch.set_num_threads(max(args.threads, os.cpu_count() or 1))
    errors = {label: logprob_errors(model, eps) for label, (_, eps) in results.items()}

    first_lengths = sorted({len(p) for p in prompts})
    print(f"{name}: {args.concurrent} concurrent episodes x {args.turns} turns; first prompt "
          f"{first_lengths[0]}-{first_lengths[-1]} tokens, +{args.out_tokens} output +{args.obs_tokens} observation "
          f"tokens per turn; engine torch threads {args.threads}; median of {args.repeats} round(s)")
    print(f"{'engine':<34} {'episodes/s':>10} {'vs first':>8} {'wall s':>7} {'range s':>11} {'gen tok/s':>9} "
          f"{'prefilled':>9} {'cached':>7} {'max|dlp|':>9} {'mean|dlp|':>9}")
    base = None
    for label, (seconds, eps) in results.items():
        rate = len(eps) / seconds
        base = base or rate
        turns = [t for e in eps for t in e]
        generated = sum(len(t.output_ids) for t in turns)
        cached = sum(t.cached_tokens for t in turns)
        prefilled = sum(len(t.prompt) for t in turns) - cached
        worst, mean = errors[label]
        spread = f"{min(r[0] for r in runs[label]):.1f}-{max(r[0] for r in runs[label]):.1f}"
        print(f"{label:<34} {rate:>10.4f} {rate / base:>7.2f}x {seconds:>7.1f} {spread:>11} "
              f"{generated / seconds:>9.1f} {prefilled:>9} {cached:>7} {worst:>9.2e} {mean:>9.2e}")
    plain, cached32 = results["no prefix cache, float32"][1], results["prefix cache, float32"][1]
    same = sum(a.output_ids == b.output_ids for x, y in zip(plain, cached32) for a, b in zip(x, y))
    print(f"float32 turns with the same sampled tokens with and without the prefix cache: "
          f"{same}/{args.concurrent * args.turns}")
    print("|dlp|: |engine logprob - float32 teacher-forced logprob| over every sampled token")
    ratio = len(results["prefix cache, bfloat16"][1]) / results["prefix cache, bfloat16"][0] / base
    verdict = "OK" if ratio >= TARGET_EPISODE_RATIO else "BELOW GOAL"
    print(f"prefix cache bf16 vs first: {ratio:.2f}x (goal >= {TARGET_EPISODE_RATIO:.0f}x): {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: build the tiny model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the engine")
    parser.add_argument("--tokens", type=int, default=64, help="throughput: new tokens per request")
    parser.add_argument("--seconds", type=float, default=8.0, help="throughput: how long each concurrency level runs")
    parser.add_argument("--episodes", action="store_true", help="run the multi-turn episode benchmark")
    parser.add_argument("--concurrent", type=int, default=8, help="episodes: episodes at once")
    parser.add_argument("--turns", type=int, default=4, help="episodes: turns per episode")
    parser.add_argument("--prompt-tokens", type=int, default=350, help="episodes: first prompt length")
    parser.add_argument("--obs-tokens", type=int, default=60, help="episodes: observation tokens per turn")
    parser.add_argument("--out-tokens", type=int, default=30, help="episodes: new tokens per turn")
    parser.add_argument("--repeats", type=int, default=1, help="episodes: rounds over all engines (median shown)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="throughput: the engine's --dtype (default its own, float32)")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="episodes: also run the engine of this checkout (its stepline/), first; "
                             "throughput: run only that engine")
    parser.add_argument("--engine", default=None,
                        help="throughput: also measure this running engine (serving --model) side by side")
    parser.add_argument("--engine-kind", choices=["builtin", "sglang", "vllm"], default="vllm",
                        help="the wire format of --engine")
    args = parser.parse_args()
    if args.engine is not None and args.model is None:
        parser.error("--engine needs --model: the folder that engine serves")

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from stepline.models import build_model

            model, name = build_model(Path(tmp) / "tiny", kind="tiny", seed=0), "tiny model"
        else:
            model, name = args.model, f"model {args.model}"
        if args.episodes:
            episodes_mode(model, name, args)
        else:
            throughput(model, name, args)


if __name__ == "__main__":
    main()
