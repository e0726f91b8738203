"""Offline replay next to the online run it replays: training loss and reward-weighted likelihood.

    .venv/bin/stepline run examples/quickstart.toml           # the online run, RUN = runs/quickstart
    .venv/bin/python benchmarks/bench_replay.py runs/quickstart      # `stepline replay` of RUN/pool.db, then the comparison

The replay starts from the same SFT model with the same [trainer] settings and as many updates as the online
run made, through the `stepline replay` command a user would run (output in RUN-replay/). Reward-weighted
likelihood: the mean log-probability of the action tokens of the run's RL episodes, each token weighted by its
episode's reward (episodes with reward 0 drop out) — what a policy-gradient update raises.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from stepline.datapool import open_pool
from stepline.trainer.weight_sync import saved_weights


def toml_table(name: str, table: dict) -> str:
    """A flat table of scalars (all the [trainer] table of a job holds) as TOML."""
    return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items() if v is not None)


def losses(metrics: Path) -> list[float]:
    return [row["policy_loss"] for row in map(json.loads, metrics.read_text().splitlines()) if "policy_loss" in row]


def rewarded_actions(pool_db: Path) -> list[tuple[float, list[int], list[int]]]:
    """(reward, prompt ids, output ids) of every call of every rewarded RL (not evaluation) session."""
    pool = open_pool(f"sqlite:///{pool_db}")
    out = []
    try:
        for info in pool.list_sessions():
            if info.purpose == "eval":
                continue
            reward = pool.get_episode(info.session_id).outcome
            if reward <= 0:
                continue
            out += [(float(reward), list(c.prompt_ids), list(c.output_ids)) for c in pool.get_calls(info.session_id)]
    finally:
        pool.close()
    return out


@torch.no_grad()
def reward_weighted_logprob(model_dir: Path, actions: list[tuple[float, list[int], list[int]]]) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = weight = 0.0
    for reward, prompt, output in actions:
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        logp = logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])
        total += reward * float(logp.sum())
        weight += reward * len(output)
    return total / weight


def main(run: Path) -> None:
    job = json.loads((run / "job.json").read_text())
    replay_dir = run.parent / f"{run.name}-replay"
    online_losses = losses(run / "rl" / "metrics.jsonl")
    trainer = {**job["trainer"], "model_dir": str(run / "model-sft"), "output_dir": str(replay_dir),
               "group_size": job["rollout"]["group_size"], "max_updates": len(online_losses), "seed": job["seed"],
               "progress": False}
    replay_dir.mkdir(parents=True, exist_ok=True)
    (replay_dir / "replay.toml").write_text(toml_table("trainer", trainer))
    subprocess.run([sys.executable, "-m", "stepline.cli", "replay", str(replay_dir / "replay.toml"),
                    "--pool", str(run / "pool.db")], check=True)
    replay_losses = losses(replay_dir / "metrics.jsonl")

    actions = rewarded_actions(run / "pool.db")
    print(f"\nrun {run}: {len(online_losses)} online updates, {len(replay_losses)} replayed; "
          f"{len(actions)} calls of rewarded RL episodes")
    print(f"{'':28}{'online':>12}{'replay':>12}{'ratio':>8}")
    for name, a, b in (("policy loss, mean", np.mean(online_losses), np.mean(replay_losses)),
                       ("policy loss, last update", online_losses[-1], replay_losses[-1])):
        print(f"{name:28}{a:>12.3e}{b:>12.3e}{b / a if a else float('nan'):>8.2f}")
    if actions:
        sft = reward_weighted_logprob(run / "model-sft", actions)
        online = reward_weighted_logprob(saved_weights(run / "rl" / "weights")[-1], actions)
        replay = reward_weighted_logprob(saved_weights(replay_dir / "weights")[-1], actions)
        print(f"{'reward-weighted logprob':28}{online:>12.4f}{replay:>12.4f}{replay / online:>8.2f}"
              f"   (SFT model: {sft:.4f})")
    else:
        print("no RL episode was rewarded: the reward-weighted likelihood is undefined for this run")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
