"""The steps view of a session tree (pure): which leaves train, and each trajectory's transitions.

Leaf rules (`LeafRule`):

- ``"all"``: every leaf of the tree is a trajectory.
- ``"drop_superseded"`` (default): a *retry* is a later call (higher call_index) whose prompt equals
  an earlier call's prompt (both prompts end at the same tree position). The earlier call's action
  subtree — its first action node and everything below it — is *superseded*, and its leaves are
  dead. Of n calls with one prompt only the latest keeps its subtree. The main leaf is never dead.
- ``"main"``: only the main trajectory: the path through the last call (highest call_index),
  continued below it (if later-arriving calls hang there) through the most recently created child.

A call is a step of a trajectory when its whole action lies on the trajectory's path; an action a
later prompt only partly kept (the harness edited or truncated it) is context (loss mask 0) on the
paths that keep only part of it. Calls with no output tokens have no step. A step's `weight_version` is the
oldest version among its action tokens (a call resumed across a weight update has several: `version_spans`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from stepline.datapool.records import EpisodeData, LeafRule, Node, Reward, SessionInfo, SessionTree, Step, Trajectory

ROOT = -1
LEAF_RULES: tuple[str, ...] = ("all", "drop_superseded", "main")


def children_map(tree: SessionTree) -> dict[int, list[int]]:
    """node id (ROOT for the root) -> child ids in creation order."""
    kids: dict[int, list[int]] = {ROOT: []}
    for node in tree.nodes:
        kids.setdefault(node.id, [])
        kids.setdefault(node.parent, []).append(node.id)
    return {k: sorted(v) for k, v in kids.items()}


def leaves(tree: SessionTree) -> list[int]:
    """All leaves, in the tree's (depth-first) node order."""
    kids = children_map(tree)
    return [n.id for n in tree.nodes if not kids[n.id]]


def main_leaf(tree: SessionTree) -> int | None:
    """The leaf of the path through the last call (None for an empty tree)."""
    if not tree.calls:
        return None
    end, acts = tree.calls[max(tree.calls)]
    node = acts[-1] if acts else end
    if node == ROOT:
        return None
    kids = children_map(tree)
    while kids[node]:
        node = kids[node][-1]
    return node


def superseded_leaves(tree: SessionTree) -> set[int]:
    """Leaves in the action subtree of a call that a later call with the same prompt retried."""
    by_prompt: dict[int, list[int]] = {}
    for call, (end, _) in tree.calls.items():
        by_prompt.setdefault(end, []).append(call)
    kids = children_map(tree)
    dead: set[int] = set()
    for calls in by_prompt.values():
        for call in sorted(calls)[:-1]:
            acts = tree.calls[call][1]
            if acts:
                dead |= _subtree_leaves(kids, acts[0])
    main = main_leaf(tree)
    return dead - {main} if main is not None else dead


def _subtree_leaves(kids: dict[int, list[int]], top: int) -> set[int]:
    out, stack = set(), [top]
    while stack:
        node = stack.pop()
        if kids[node]:
            stack.extend(kids[node])
        else:
            out.add(node)
    return out


def select_leaves(tree: SessionTree, rule: LeafRule) -> list[int]:
    """The leaves that train under `rule`, in node order."""
    if rule == "all":
        return leaves(tree)
    if rule == "drop_superseded":
        dead = superseded_leaves(tree)
        return [leaf for leaf in leaves(tree) if leaf not in dead]
    if rule == "main":
        main = main_leaf(tree)
        return [] if main is None else [main]
    raise ValueError(f"unknown leaf rule {rule!r}; expected one of {LEAF_RULES}")


def trajectory(
    tree: SessionTree,
    leaf: int,
    rewards: Iterable[Reward] = (),
    finish_reasons: dict[int, str] | None = None,
    is_main: bool = False,
    temperatures: dict[int, float] | None = None,
) -> Trajectory:
    """The root-to-`leaf` path with its steps (see the module docstring for which calls are steps)."""
    by_id = {n.id: n for n in tree.nodes}
    path, node = [], leaf
    while node != ROOT:
        path.append(by_id[node])
        node = by_id[node].parent
    path.reverse()
    starts = np.cumsum([0] + [len(n.tokens) for n in path])
    node_path = [(n.id, int(starts[i]), int(starts[i + 1])) for i, n in enumerate(path)]
    on_path = {n.id: i for i, n in enumerate(path)}
    tokens = np.concatenate([n.tokens for n in path]) if path else np.zeros(0, np.int32)
    loss_mask = np.zeros(len(tokens), dtype=np.int8)
    logprobs = np.zeros(len(tokens), dtype=np.float32)
    step_rewards = _step_rewards(rewards)
    steps = []
    for call in sorted({n.call_index for n in path if n.kind == "act"}):
        acts = tree.calls[call][1]
        if not all(a in on_path for a in acts):
            continue
        start, end = node_path[on_path[acts[0]]][1], node_path[on_path[acts[-1]]][2]
        loss_mask[start:end] = 1
        logprobs[start:end] = np.concatenate([by_id[a].logprobs for a in acts])
        spans = version_spans([by_id[a] for a in acts])
        steps.append(Step(
            call_index=call, action_start=start, action_end=end,
            behaviour_logprobs=logprobs[start:end].copy(),
            weight_version=min(v for _, v in spans),
            reward=step_rewards.get(call, 0.0),
            finish_reason=(finish_reasons or {}).get(call, "stop"),
            temperature=(temperatures or {}).get(call, 1.0),
            version_spans=spans,
        ))
    steps.sort(key=lambda s: s.action_start)
    if steps:
        steps[-1].done = True
    return Trajectory(tree.session_id, leaf, tokens.astype(np.int32, copy=False), loss_mask, logprobs,
                      steps, node_path, is_main)


def version_spans(acts: list[Node]) -> list[tuple[int, int]]:
    """(first index within the action, version) of each run of one version along a call's action nodes (a
    node split by a later prompt keeps its version: runs of one version are merged)."""
    spans: list[tuple[int, int]] = []
    start = 0
    for node in acts:
        if not spans or spans[-1][1] != node.weight_version:
            spans.append((start, node.weight_version))
        start += len(node.tokens)
    return spans


def _step_rewards(rewards: Iterable[Reward]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in rewards:
        if r.step is not None:
            out[r.step] = out.get(r.step, 0.0) + r.value * r.weight
    return out


def trajectories(
    tree: SessionTree,
    rule: LeafRule = "drop_superseded",
    rewards: Iterable[Reward] = (),
    finish_reasons: dict[int, str] | None = None,
    temperatures: dict[int, float] | None = None,
) -> list[Trajectory]:
    """The steps view: one `Trajectory` per leaf that trains under `rule`."""
    rewards = list(rewards)
    main = main_leaf(tree)
    return [trajectory(tree, leaf, rewards, finish_reasons, leaf == main, temperatures)
            for leaf in select_leaves(tree, rule)]


def build_episode(
    info: SessionInfo,
    rewards: list[Reward],
    tree: SessionTree,
    rule: LeafRule = "drop_superseded",
    finish_reasons: dict[int, str] | None = None,
    temperatures: dict[int, float] | None = None,
) -> EpisodeData:
    """Everything the trainer needs of one session."""
    return EpisodeData(info, rewards, tree, trajectories(tree, rule, rewards, finish_reasons, temperatures))
