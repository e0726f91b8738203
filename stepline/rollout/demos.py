"""Expert demonstrations for the SFT warm start, the rollout side: play each harness's scripted expert.

Each harness's `--expert` mode plays a scripted solver through the same tools and writes the
conversation it would have had with a model (`episode.json`: `messages` and `tools`, in the harness's
own API format), which the harness's verifier scores. `expert_episodes` runs them (a seeded sample of
each harness's train split); the composition root (`stepline/launch/demos.py`) turns them into pool sessions,
token for token as the gateway would have recorded them.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepline.rollout.config import HarnessError, HarnessSpec, list_tasks, task_kinds, tasks_matching
from stepline.rollout.driver import parse_verdict

__all__ = ["Demonstration", "expert_episodes"]

# (harness spec, task id, (episode.json contents, verifier reward) or None where the expert failed)
Demonstration = tuple[HarnessSpec, str, tuple[dict[str, Any], float] | None]


async def _expert_episode(spec: HarnessSpec, task_id: str, work: Path) -> tuple[dict[str, Any], float] | None:
    """Run the harness's scripted expert on a task and score it with the harness's verifier."""
    out = work / f"{spec.name}-{task_id}"
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"{spec.module}.run", "--task", task_id, "--out", str(out), "--expert",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    if await run.wait() != 0:
        return None
    verify = await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"{spec.module}.verify", "--task", task_id, "--out", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    stdout, _ = await verify.communicate()
    return json.loads((out / "episode.json").read_text()), parse_verdict(stdout.decode()).reward


def kind_weights(spec: HarnessSpec, ids: list[str], weights: Mapping[str, int]) -> list[int]:
    """Each id's weight: its kind's in `weights` (1 for a kind not named); a HarnessError for a kind the
    harness's tasks do not have."""
    kinds = task_kinds(spec)
    if unknown := sorted(set(weights) - set(kinds.values())):
        raise HarnessError(f"harness {spec.name!r}: sft.demo_kinds {unknown} are not kinds of its tasks "
                           f"(its kinds: {sorted(set(kinds.values()))})")
    return [weights.get(kinds.get(task_id, ""), 1) for task_id in ids]


def weighted_sample(rng: random.Random, ids: list[str], weights: list[int], k: int) -> list[str]:
    """`k` distinct ids (all when fewer), each drawn with probability proportional to its weight among those not
    yet drawn (Efraimidis and Spirakis' keys u^(1/w))."""
    keyed = sorted(zip(ids, weights, strict=True), key=lambda pair: rng.random() ** (1 / pair[1]), reverse=True)
    return [task_id for task_id, _ in keyed[:k]]


async def expert_episodes(specs: list[HarnessSpec], per_harness: int, concurrency: int, work: Path,
                          seed: int, counts: Mapping[str, int] | None = None,
                          matching: Mapping[str, str] | None = None,
                          kinds: Mapping[str, Mapping[str, int]] | None = None) -> list[Demonstration]:
    """`per_harness` expert episodes of each module harness (`counts[name]` where given), a seeded sample of
    its train split (of the task ids matching the regular expression `matching[name]` where given; a task of a
    kind weighted n in `kinds[name]` drawn as n tasks of weight 1 would be), at most `concurrency` at a time,
    played under `work`."""
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def one(spec: HarnessSpec, task_id: str) -> Demonstration:
        async with gate:
            return spec, task_id, await _expert_episode(spec, task_id, work)

    chosen: list[tuple[HarnessSpec, str]] = []
    for spec in specs:  # a seeded sample of the train split: task lists are ordered by kind and entity
        tasks = await asyncio.to_thread(list_tasks, spec, "train")
        tasks = tasks_matching(spec, tasks, (matching or {}).get(spec.name), "sft.demo_tasks_matching")
        wanted = (counts or {}).get(spec.name, per_harness)
        if weights := (kinds or {}).get(spec.name):
            sample = weighted_sample(rng, tasks, await asyncio.to_thread(kind_weights, spec, tasks, weights), wanted)
        else:
            sample = rng.sample(tasks, min(wanted, len(tasks)))
        chosen += [(spec, task) for task in sample]
    jobs = [one(spec, task) for spec, task in chosen]
    return list(await asyncio.gather(*jobs))
