"""Group packing benchmark: a training step over a run's real RL groups, the sessions of each group packed as one
trie (their common prompt forwarded once, stepline.trainer.tree_forward) against each session packed on its own (what the
trainer did before), on the run's own SFT model.

    .venv/bin/python benchmarks/bench_group_packing.py runs/quickstart            # 12 groups, best of 3
    .venv/bin/python benchmarks/bench_group_packing.py runs/quickstart --groups 24 --bf16 --top-layers 10

A step is what one micro-batch costs the trainer: forward of one group (micro_batch_episodes = its sessions) and
backward of the sum of its action tokens' logprobs, with the bottom layers frozen as `train_layers` does. Both
packings run in one process, alternating group by group, best of --repeats per group (robust on a shared machine).
Printed: tokens through the model, seconds, action tokens/s, the ratio, and the largest logprob difference
between the two packings (they score the same tokens in the same contexts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import stepline.trainer  # noqa: F401  (before torch: it sets OpenMP's wait policy, stepline/trainer/__init__.py)
from stepline.datapool import open_pool
from stepline.datapool.records import EpisodeData
from stepline.trainer.trainable import freeze_below_top
from stepline.trainer.tree_forward import forest_forward, pack_forest


def rl_groups(run: Path, count: int) -> list[list[EpisodeData]]:
    """The first `count` groups of RL sessions (two sessions or more) in the run's pool."""
    pool = open_pool(f"sqlite:///{run / 'pool.db'}")
    try:
        by_group: dict[str, list[str]] = defaultdict(list)
        for info in pool.list_sessions("completed"):
            if info.purpose != "eval":
                by_group[info.group_key].append(info.session_id)
        chosen = [ids for ids in by_group.values() if len(ids) >= 2][:count]
        return [[pool.get_episode(s) for s in ids] for ids in chosen]
    finally:
        pool.close()


def apart(episodes: list[EpisodeData]) -> list[EpisodeData]:
    """The same sessions, each under a harness name of its own: pack_forest builds one trie per harness, so each
    session is packed as its own tree (its own row)."""
    return [dataclasses.replace(ep, info=dataclasses.replace(ep.info, harness=ep.info.session_id)) for ep in episodes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a run directory of `stepline run` (pool.db, model-sft/)")
    p.add_argument("--model", type=Path, help="model directory (default RUN/model-sft)")
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top-layers", type=int, default=None, help="train only the top k layers (train_layers)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as autocast_bf16 does")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model or args.run / "model-sft", dtype=torch.float32,
                                                 attn_implementation="sdpa")
    if args.top_layers is not None:
        freeze_below_top(model, args.top_layers)
    groups = rl_groups(args.run, args.groups)
    if not groups:
        raise SystemExit(f"{args.run / 'pool.db'} holds no RL group of two sessions or more")
    forests = {"shared": [pack_forest(g) for g in groups], "apart": [pack_forest(apart(g)) for g in groups]}

    def step(forest) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext():
            lp = forest_forward(model, forest, with_entropy=False).logprobs
        lp.sum().backward()
        return time.perf_counter() - start, lp.detach()

    best = {k: [float("inf")] * len(groups) for k in forests}
    diffs = []
    for _ in range(args.repeats):
        for i in range(len(groups)):
            (ts, a), (tp, b) = step(forests["shared"][i]), step(forests["apart"][i])
            best["shared"][i], best["apart"][i] = min(best["shared"][i], ts), min(best["apart"][i], tp)
            diffs.append((a - b).abs())
    sessions = sum(len(g) for g in groups)
    actions = sum(len(f.targets) for f in forests["shared"])
    print(f"{len(groups)} RL groups ({sessions} sessions, {actions:,} action tokens) of {args.run}; "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, {'all' if args.top_layers is None else f'top {args.top_layers}'}"
          f" layers trained, {args.threads} threads, best of {args.repeats}")
    tokens = [sum(f.num_tokens for f in forests[k]) for k in ("shared", "apart")]
    seconds = [sum(best[k]) for k in ("shared", "apart")]
    rows = [  # (name, shared, apart, format); the gain is apart/shared for costs, shared/apart for the rate
        ("tokens through the model", *tokens, "{:,.0f}"),
        ("training step, all groups (s)", *seconds, "{:.2f}"),
        ("action tokens/s", actions / seconds[0], actions / seconds[1], "{:,.0f}"),
    ]
    print(f"{'':32s} {'shared':>10s} {'apart':>10s} {'gain':>8s}")
    for i, (name, shared, separate, fmt) in enumerate(rows):
        gain = shared / separate if i == 2 else separate / shared
        print(f"{name:32s} {fmt.format(shared):>10s} {fmt.format(separate):>10s} {gain:>7.2f}x")
    diff = torch.cat(diffs)
    print(f"same results: |logprob shared - apart| max {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}")
    print(f"per group (s, shared/apart): {np.round(np.array(best['shared']) / np.array(best['apart']), 2).tolist()}")


if __name__ == "__main__":
    main()
