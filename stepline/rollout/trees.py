"""Tree-search rollouts (Tree-GRPO, Ji et al. 2025): a group grows as trees of forked episodes.

    M = trees episodes are played to the end (the roots); then, `rounds` times, each tree forks `branches`
    of its episodes at a step boundary drawn uniformly from the tree's steps, and the forks are played.

A fork at call k (stepline/gateway/forks.py) replays the source's calls before k with their exact ids and samples
from call k on, so the tree's episodes share their prefixes as the paper's trees do; the pool keeps each
fork's link (metadata.fork_of) and the trainer's `tree_grpo` advantage reads it. A branch point of an
episode is any of its own calls after the first (its steps' boundaries: the states after each earlier
step); an episode forked at k offers calls k+1 on. A tree with none (single-call episodes) forks its root
at call 0, a fresh sample from the task's first state. Every session stays open until the whole group is
played, so the trainer cannot claim a group before its forks exist (a group is ready when all its sessions
have ended). Failed episodes are leaves like any other (scored `failed_reward`); they are not retried.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stepline.rollout.client import GatewayClient, GatewayError, SessionHandle
from stepline.rollout.config import HarnessSpec, TreeSearch
from stepline.rollout.results import EpisodeResult

Opener = Callable[[], Awaitable[SessionHandle]]

__all__ = ["Player", "TreeEpisode", "branch_points", "draw_branches", "run_tree_group"]


class Player(Protocol):
    """What a tree group needs of the rollout driver (the driver is one; trees.py never imports it)."""

    gateway: GatewayClient
    slots: asyncio.Semaphore  # bounds the episodes running at once

    def open_session(self, spec: HarnessSpec, task_id: str, group_id: str | None,
                     metadata: dict[str, Any]) -> Awaitable[SessionHandle]: ...

    async def played(self, spec: HarnessSpec, task_id: str, open_session: Opener,
                     end: bool = True) -> tuple[EpisodeResult, SessionHandle | None]:
        """Open a session, play and score it, post its reward and (if `end`) end it."""
        ...

    def add_result(self, spec: HarnessSpec, result: EpisodeResult) -> None: ...


@dataclass
class TreeEpisode:
    handle: SessionHandle
    result: EpisodeResult
    branch: int  # the call it was forked at (0 for a root)
    calls: int  # calls the session made, the replayed ones included


def branch_points(tree: list[TreeEpisode]) -> list[tuple[int, int]]:
    """(episode index in the tree, call) where a fork may branch: each episode's calls after its own branch
    point, after its first call; the root's call 0 when there are none."""
    points = [(i, k) for i, ep in enumerate(tree) for k in range(ep.branch + 1, ep.calls)]
    return points or [(0, 0)]


def draw_branches(points: list[tuple[int, int]], n: int, rng: random.Random) -> list[tuple[int, int]]:
    """n branch points, distinct while there are enough."""
    return rng.sample(points, n) if len(points) >= n else rng.choices(points, k=n)


async def run_tree_group(driver: Player, spec: HarnessSpec, task_id: str, search: TreeSearch, group_id: str,
                         metadata: dict[str, Any], seed: int) -> list[EpisodeResult]:
    """One group of trees; returns every episode's result (roots first). `seed`: the rollouts' (with the group
    id it draws the branch points)."""
    rng = random.Random(f"{seed}:{group_id}")

    def root() -> Awaitable[SessionHandle]:
        return driver.open_session(spec, task_id, group_id, {**metadata, "attempt": 0})

    played = await asyncio.gather(*(_episode(driver, spec, task_id, root, 0) for _ in range(search.trees)))
    trees = [[ep] for ep in played if ep is not None]
    results = [ep.result for tree in trees for ep in tree]
    try:
        for round_ in range(1, search.rounds + 1):
            jobs = []
            for tree in trees:
                for i, call in draw_branches(branch_points(tree), search.branches, rng):
                    source = tree[i].handle.session_id
                    jobs.append((tree, _episode(driver, spec, task_id, _fork(driver, source, call, round_), call)))
            for (tree, _), ep in zip(jobs, await asyncio.gather(*(job for _, job in jobs))):
                if ep is not None:
                    tree.append(ep)
                    results.append(ep.result)
    finally:  # the group becomes claimable only now
        await asyncio.gather(*(_end(driver, ep) for tree in trees for ep in tree))
    return results


def _fork(driver: Player, source: str, call: int, round_: int) -> Opener:
    return lambda: driver.gateway.fork_session(source, call, {"round": round_})


async def _episode(driver: Player, spec: HarnessSpec, task_id: str, open_session: Opener,
                   branch: int) -> TreeEpisode | None:
    """Play one episode of a tree, rewarded but left open; None when no session could be opened."""
    async with driver.slots:
        result, handle = await driver.played(spec, task_id, open_session, end=False)
    driver.add_result(spec, result)
    if handle is None:
        return None
    try:
        calls = await driver.gateway.session_calls(handle.session_id)
    except GatewayError as exc:
        result.reason += f"; gateway: {exc}"
        calls = 0
    return TreeEpisode(handle, result, branch, calls)


async def _end(driver: Player, ep: TreeEpisode) -> None:
    try:
        await driver.gateway.end_session(ep.handle.session_id, ep.result.status)
    except GatewayError as exc:
        ep.result.reason += f"; gateway: {exc}"
