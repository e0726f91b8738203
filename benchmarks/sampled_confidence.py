"""How sure the policy was of what it sampled in a run's test episodes (an analysis of finished runs, not a test).

    .venv/bin/python benchmarks/sampled_confidence.py ../runs/quickstart [more run dirs]

For RUN/eval/before.json and the last RUN/eval/after-N.json, per harness, from the engine's logprobs recorded in the
run's pool: sampled tokens per episode, their mean logprob, the share sampled at a probability below 0.5 (where
temperature 1 likely left the mode) and below 0.1 (a rare token), and the success of the episodes that sampled
such a token against those that sampled none: where a run's success at temperature 1 lags its greedy success, this
says whether sampling off the mode derails the episodes or the mode itself fails.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from stepline.datapool import open_pool
from stepline.datapool.base import UnknownSession
from stepline.report import eval_paths

RARE = math.log(0.1)
UNSURE = math.log(0.5)


def split_success(logprobs: list[np.ndarray], success: list[bool], below: float) -> str:
    """Success of the episodes that sampled a token below this logprob, then of those that sampled none."""
    hit = [bool((lp < below).any()) for lp in logprobs]
    parts = []
    for flag in (True, False):
        xs = [s for s, h in zip(success, hit) if h == flag]
        parts.append(f"{np.mean(xs):.2f} of {len(xs)}" if xs else "- of 0")
    return " / ".join(parts)


def summary(logprobs: list[np.ndarray], success: list[bool]) -> str:
    tokens = np.concatenate(logprobs) if logprobs else np.zeros(0)
    if not tokens.size:
        return f"{len(logprobs)} episodes, no sampled tokens"
    return (f"{len(logprobs)} episodes, {tokens.size / len(logprobs):.0f} tokens each, mean logprob {tokens.mean():.3f}, "
            f"p<0.5 {np.mean(tokens < UNSURE):.3f}, p<0.1 {np.mean(tokens < RARE):.4f}; success with a p<0.5 token / "
            f"without {split_success(logprobs, success, UNSURE)}, with a p<0.1 token / without "
            f"{split_success(logprobs, success, RARE)}")


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(runs: tuple[Path, ...]) -> None:
    for run in runs:
        pool = open_pool(f"sqlite:///{run / 'pool.db'}")
        paths = eval_paths(run)
        for path in paths[:1] + paths[1:][-1:]:  # before RL, and after its last update
            logprobs: dict[str, list[np.ndarray]] = defaultdict(list)
            success: dict[str, list[bool]] = defaultdict(list)
            for episode in json.loads(path.read_text())["episodes"]:
                try:
                    calls = pool.get_calls(episode["session_id"])
                except UnknownSession:  # a run resumed in a copy of another's directory lacks that run's pool
                    continue
                logprobs[episode["harness"]].append(np.concatenate([c.output_logprobs for c in calls] or [np.zeros(0)]))
                success[episode["harness"]].append(bool(episode["success"]))
            for harness in sorted(logprobs):
                print(f"{run.name} {path.stem} {harness}: {summary(logprobs[harness], success[harness])}")
        pool.close()


if __name__ == "__main__":
    main()
