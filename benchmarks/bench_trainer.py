"""Trainer benchmark: tree forward vs the naive per-step forward on multi-turn sessions.

    .venv/bin/python benchmarks/bench_trainer.py                   # 8 sessions × 10 turns, CPU or the GPU if any
    .venv/bin/python benchmarks/bench_trainer.py --turns 20 --hidden 512 --layers 8

Each session is a chain of turns (prompt, then per turn: sampled action + harness observation), stored
through the pool's own radix tree and steps view. A *training step* is forward + backward of the action
tokens' logprobs for all sessions:

- tree:  each session's tree once, tree attention mask, one padded row per session (trainer.tree_forward);
- naive: every step's full sequence (state + action) as its own row, right-padded, `rows` per forward
         (sorted by length, so padding is small) — how a trainer that treats each turn as one completion
         sees the data.

Both produce the same logprobs (checked, max |diff| printed). Times: both variants in one process,
alternating, best of --repeats (robust on a shared machine). Peak memory: one step in a fresh subprocess
per variant, above what the model and data hold (CUDA: max allocated; CPU: growth of the peak RSS).
Printed side by side with ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from datapool.records import Reward, SessionInfo
from datapool.steps import build_episode
from datapool.tree import RadixTree
from trainer.tree_forward import forest_forward, pack_forest


def make_sessions(n: int, turns: int, prompt: int, action: int, obs: int, vocab: int, seed: int):
    g = np.random.default_rng(seed)
    episodes = []
    for s in range(n):
        tree, seq = RadixTree(f"s{s}"), g.integers(10, vocab, prompt).astype(np.int32)
        for t in range(turns):
            out = g.integers(10, vocab, action).astype(np.int32)
            tree.insert(t, seq, out, np.full(action, -7.0, np.float32), 0)
            seq = np.concatenate([seq, out, g.integers(10, vocab, obs).astype(np.int32)])
        info = SessionInfo(f"s{s}", task_id="t", harness="h", status="completed")
        episodes.append(build_episode(info, [Reward(f"s{s}", 1.0)], tree.snapshot()))
    return episodes


def naive_rows(model, episodes, forest, rows: int) -> torch.Tensor:
    """Every step's full sequence as its own right-padded row, `rows` per forward; logprobs in forest order."""
    device = next(model.parameters()).device
    steps = [(e, traj, st) for e, ep in enumerate(episodes) for traj in ep.trajectories[:1] for st in traj.steps]
    steps.sort(key=lambda x: x[2].action_end)  # rows of similar length together: the least padding
    out = torch.zeros(len(forest.targets), device=device)
    for i in range(0, len(steps), rows):
        chunk = steps[i : i + rows]
        width = max(st.action_end for _, _, st in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        mask = torch.zeros(len(chunk), width, dtype=torch.int64)
        for r, (_, traj, st) in enumerate(chunk):
            ids[r, : st.action_end] = torch.from_numpy(traj.tokens[: st.action_end].astype(np.int64))
            mask[r, : st.action_end] = 1
        hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        hidden = hidden.last_hidden_state
        for r, (e, traj, st) in enumerate(chunk):
            src = hidden[r, st.action_start - 1 : st.action_end - 1]
            logits = model.get_output_embeddings()(src).float() / st.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[r, st.action_start : st.action_end, None].to(device))
            where = ((forest.episode == e) & (forest.call_index == st.call_index)).nonzero().squeeze(-1)
            out = out.index_put((where.to(device),), lp.squeeze(-1))
    return out


def _setup(args, model_dir: Path):
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    episodes = make_sessions(args.sessions, args.turns, args.prompt, args.action, args.obs, 3000, args.seed)
    forest = pack_forest(episodes)

    def step(variant: str) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        lp = forest_forward(model, forest, with_entropy=False).logprobs if variant == "tree" \
            else naive_rows(model, episodes, forest, args.rows)
        lp.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return lp.detach()

    return device, forest, step


def measure_time(args, model_dir: Path) -> dict:
    """Both variants in one process, alternating, best of `repeats` each (the machine may be shared)."""
    device, forest, step = _setup(args, model_dir)
    out = {v: {"logprobs": step(v).cpu().tolist(), "times": []} for v in ("tree", "naive")}  # warm-up
    for _ in range(args.repeats):
        for v in ("tree", "naive"):
            start = time.perf_counter()
            step(v)
            out[v]["times"].append(time.perf_counter() - start)
    for v, forward_tokens in (("tree", forest.num_tokens), ("naive", forest.naive_tokens)):
        out[v].update(seconds=min(out[v].pop("times")), action_tokens=len(forest.targets),
                      forward_tokens=forward_tokens)
    return out


def measure_memory(variant: str, args, model_dir: Path) -> dict:
    """Peak memory of one training step above what the model and data already hold (fresh process)."""
    device, _, step = _setup(args, model_dir)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(variant)
    peak = (torch.cuda.max_memory_allocated() - base if device.type == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024)
    return {"peak_bytes": int(peak)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--prompt", type=int, default=64, help="first prompt tokens")
    p.add_argument("--action", type=int, default=24, help="sampled tokens per turn")
    p.add_argument("--obs", type=int, default=24, help="observation tokens the harness adds per turn")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="naive: step sequences per forward")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=["time", "tree", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.only:
        result = measure_time(args, args.model_dir) if args.only == "time" else \
            measure_memory(args.only, args, args.model_dir)
        print(json.dumps(result))
        return
    from stepline.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "m", kind="tiny", hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=max(args.hidden // 64, 2), num_kv_heads=max(args.hidden // 128, 1))
        results = _subprocess("time", model_dir)
        for v in ("tree", "naive"):
            results[v].update(_subprocess(v, model_dir))
    _report(args, results)


def _subprocess(variant: str, model_dir: Path) -> dict:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", variant, "--model-dir", str(model_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(args, r: dict) -> None:
    tree, naive = r["tree"], r["naive"]
    diff = float(np.max(np.abs(np.array(tree["logprobs"]) - np.array(naive["logprobs"]))))
    print(f"{args.sessions} sessions × {args.turns} turns (prompt {args.prompt}, action {args.action}, "
          f"observation {args.obs} tokens); model hidden {args.hidden}, {args.layers} layers; {args.device}, "
          f"{args.threads} threads; forward + backward, best of {args.repeats}")
    rows = [  # (name, tree, naive, format, tree's gain = naive/tree, or tree/naive for a rate)
        ("tokens through the model", tree["forward_tokens"], naive["forward_tokens"], "{:,.0f}", False),
        ("training step (s)", tree["seconds"], naive["seconds"], "{:.3f}", False),
        ("training tokens/s (action)", tree["action_tokens"] / tree["seconds"],
         naive["action_tokens"] / naive["seconds"], "{:,.0f}", True),
        ("peak memory (MiB)", tree["peak_bytes"] / 2**20, naive["peak_bytes"] / 2**20, "{:,.1f}", False),
    ]
    print(f"{'':28s} {'tree':>10s} {'naive':>10s} {'tree gain':>10s}")
    for name, a, b, fmt, rate in rows:
        gain = (a / b if rate else b / a) if a and b else float("nan")
        print(f"{name:28s} {fmt.format(a):>10s} {fmt.format(b):>10s} {gain:>9.2f}×")
    print(f"same results: max |logprob tree - naive| = {diff:.2e} over {tree['action_tokens']} action tokens")


if __name__ == "__main__":
    main()
