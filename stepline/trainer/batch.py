"""From claimed groups to what the update needs: step rows for the advantages, token views for the losses.

    batch = build_batch(groups, keep_group=...)     # Batch: E episodes, S step rows; skipped groups counted
    view = token_view(batch, [0, 1, 2])             # TokenView: one packed forest + per-token segment ids
    group_filter(cfg), shaping(cfg), episode_filter(cfg)   # the job's rules for which groups and episodes train

A *step row* is one (trajectory, call) pair, as the advantage estimators expect; a call shared by two
forks has two rows but its tokens exist once (docs/architecture.md §2.2: each sampled token trains once per update),
so its tokens point at one of its rows, the main trajectory's if it is on it. Per-step advantages reach
the tokens as `advantages[view.step_ids]`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from stepline.datapool.records import EpisodeData, Group, Trajectory
from stepline.trainer.algorithms import AdvantageInputs, group_index, has_reward_variance, overlong_penalty
from stepline.trainer.tree_forward import PackedForest, pack_forest, training_nodes

if TYPE_CHECKING:
    from stepline.trainer.config import TrainerConfig

__all__ = ["Batch", "TokenView", "build_batch", "episode_filter", "episode_tokens", "group_filter", "shaping", "token_view"]


@dataclass
class Batch:
    episodes: list[EpisodeData]  # E episodes that train
    outcome: torch.Tensor  # float32 [E]: terminal reward (plus any shaping)
    episode_group: torch.Tensor  # int64 [E]: group index (task × harness)
    step_episode: torch.Tensor  # int64 [S]
    step_traj: torch.Tensor  # int64 [S]: global trajectory index
    step_position: torch.Tensor  # int64 [S]: index of the step within its trajectory
    step_call: torch.Tensor  # int64 [S]: call index of the step
    step_reward: torch.Tensor  # float32 [S]: dense per-step reward
    step_state: torch.Tensor  # int64 [S]: anchor-state id: equal for steps whose observation tokens are equal
    episode_parent: torch.Tensor  # int64 [E]: the episode this one was forked from in the batch (-1: none)
    episode_branch: torch.Tensor  # int64 [E]: the call where it branched (0 for a root episode)
    token_rows: dict[tuple[int, int], int]  # (episode, call_index) -> the step row that owns the call's tokens
    contexts: list[np.ndarray]  # S views int32 [P]: each step's state s_t, the tokens before its action
    references: list[np.ndarray | None]  # E: token ids of the episode's gold answer (IGPO), None if it has none
    group_ids: list[str]  # every claimed group, trained or skipped (all are consumed)
    sessions: dict[str, list[str]]  # group id -> its session ids
    skipped: Counter = field(default_factory=Counter)  # reason -> groups skipped

    @property
    def num_steps(self) -> int:
        return int(self.step_episode.numel())

    def anchor_shared(self) -> float:
        """Of the steps after each trajectory's first, the share whose anchor state another episode of the same
        group also acted on: how often GiGPO's step groups hold more than one episode (first steps always do)."""
        later = (self.step_position > 0).nonzero().flatten().tolist()
        if not later:
            return 0.0
        group = self.episode_group[self.step_episode]
        episodes: dict[tuple[int, int], set[int]] = {}
        for row in later:
            episodes.setdefault((int(group[row]), int(self.step_state[row])), set()).add(int(self.step_episode[row]))
        return sum(len(episodes[(int(group[r]), int(self.step_state[r]))]) > 1 for r in later) / len(later)

    def owner_rows(self) -> torch.Tensor:
        """int64 [S]: for each step row, the row that owns its call's tokens (itself unless the call is shared)."""
        return torch.tensor([self.token_rows[(int(e), int(c))] for e, c in zip(self.step_episode, self.step_call)],
                            dtype=torch.int64)

    def advantage_inputs(self, values: torch.Tensor | None = None,
                         gold_prob: torch.Tensor | None = None) -> AdvantageInputs:
        return AdvantageInputs(outcome=self.outcome, episode_group=self.episode_group,
                               step_episode=self.step_episode, step_traj=self.step_traj,
                               step_position=self.step_position, step_reward=self.step_reward, values=values,
                               step_state=self.step_state, gold_prob=gold_prob, step_call=self.step_call,
                               episode_parent=self.episode_parent, episode_branch=self.episode_branch)


@dataclass
class TokenView:
    """The tokens of some episodes of a batch, packed for one forward pass (A action tokens)."""

    forest: PackedForest
    step_ids: torch.Tensor  # int64 [A]: step row of each token
    traj_ids: torch.Tensor  # int64 [A]: global trajectory of each token
    episode_ids: torch.Tensor  # int64 [A]: global episode of each token


def finite_group(group: Group) -> bool:
    """False if any reward (a factor, their product or the episode's sum) or any behaviour logprob on a training
    trajectory is NaN or infinite."""
    for ep in group.episodes:
        if not all(math.isfinite(r.value * r.weight) for r in ep.rewards) or not math.isfinite(ep.outcome):
            return False
        if not all(np.isfinite(n.logprobs).all() for n in training_nodes(ep) if n.kind == "act"):
            return False
    return True


def build_batch(groups: list[Group], keep_group: Callable[[Group], str | None] = lambda g: None,
                shaping: Callable[[EpisodeData], float] = lambda e: 0.0,
                keep_episode: Callable[[EpisodeData], bool] = lambda e: True,
                reference_ids: Callable[[EpisodeData], np.ndarray | None] = lambda e: None) -> Batch:
    """Flatten groups into step rows. `keep_group` returns a reason to skip a group (or None to keep it);
    groups with non-finite rewards or logprobs are always skipped; `shaping` adds to each outcome;
    `keep_episode` filters episodes of kept groups (SFT: chosen episodes only); `reference_ids` gives an
    episode's gold-answer tokens (stepline/trainer/information_gain.py) or None."""
    skipped: Counter = Counter()
    episodes: list[EpisodeData] = []
    for group in groups:
        reason = "non_finite" if not finite_group(group) else keep_group(group)
        reason = reason or (None if any(ep.trajectories for ep in group.episodes) else "empty")
        if reason:
            skipped[reason] += 1
            continue
        episodes.extend(ep for ep in group.episodes if ep.trajectories and keep_episode(ep))
    rows: dict[str, list] = {k: [] for k in ("episode", "traj", "position", "reward", "call", "state")}
    states: dict[bytes, int] = {}
    token_rows: dict[tuple[int, int], int] = {}
    contexts: list[np.ndarray] = []
    traj_counter = 0
    for e, ep in enumerate(episodes):
        for traj in sorted(ep.trajectories, key=lambda t: not t.is_main):  # the main trajectory claims shared steps
            for position, step in enumerate(traj.steps):
                token_rows.setdefault((e, step.call_index), len(rows["episode"]))
                rows["episode"].append(e)
                rows["traj"].append(traj_counter)
                rows["position"].append(position)
                rows["reward"].append(step.reward)
                rows["call"].append(step.call_index)
                rows["state"].append(states.setdefault(observation(traj, position), len(states)))
                contexts.append(traj.tokens[:step.action_start])
            traj_counter += 1
    parent, branch = fork_links(episodes)
    return Batch(
        episodes=episodes,
        outcome=torch.tensor([ep.outcome + shaping(ep) for ep in episodes], dtype=torch.float32),
        episode_group=group_index([ep.info.group_key for ep in episodes]),
        step_episode=torch.tensor(rows["episode"], dtype=torch.int64),
        step_traj=torch.tensor(rows["traj"], dtype=torch.int64),
        step_position=torch.tensor(rows["position"], dtype=torch.int64),
        step_reward=torch.tensor(rows["reward"], dtype=torch.float32),
        step_call=torch.tensor(rows["call"], dtype=torch.int64),
        step_state=torch.tensor(rows["state"], dtype=torch.int64),
        episode_parent=parent,
        episode_branch=branch,
        token_rows=token_rows,
        contexts=contexts,
        references=[reference_ids(ep) for ep in episodes],
        group_ids=[g.group_id for g in groups],
        sessions={g.group_id: [ep.info.session_id for ep in g.episodes] for g in groups},
        skipped=skipped,
    )


def fork_links(episodes: list[EpisodeData]) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent [E], branch [E]) from the sessions' fork links (SessionInfo.fork_of): the index of the episode a
    fork was forked from, if it is in the batch and in the same group (else -1: it is a root), and the call
    where it branched: the asked one, or its first recorded call where its harness diverged earlier."""
    index = {ep.info.session_id: e for e, ep in enumerate(episodes)}
    parent, branch = [], []
    for ep in episodes:
        link = ep.info.fork_of
        source = -1 if link is None else index.get(link.session_id, -1)
        if source >= 0 and episodes[source].info.group_key != ep.info.group_key:
            source = -1
        parent.append(source)
        branch.append(0 if link is None else min([link.call, *ep.tree.calls]))
    return torch.tensor(parent, dtype=torch.int64), torch.tensor(branch, dtype=torch.int64)


def observation(traj: Trajectory, position: int) -> bytes:
    """The anchor state of a trajectory's step (GiGPO): the tokens the harness added since the previous
    action (the whole prompt for the first step), as bytes; equal bytes = the same observed state."""
    start = traj.steps[position - 1].action_end if position else 0
    return traj.tokens[start:traj.steps[position].action_start].tobytes()


def token_view(batch: Batch, episode_indices: list[int]) -> TokenView:
    forest = pack_forest([batch.episodes[i] for i in episode_indices])
    global_episode = torch.tensor(episode_indices, dtype=torch.int64)[forest.episode]
    rows = torch.tensor([batch.token_rows[(int(e), int(c))] for e, c in zip(global_episode, forest.call_index)],
                        dtype=torch.int64)
    return TokenView(forest=forest, step_ids=rows, traj_ids=batch.step_traj[rows], episode_ids=global_episode)


def episode_tokens(episode: EpisodeData) -> int:
    """Tokens of an episode's own packed tree (its training nodes, shared prefixes once): what it adds to a row."""
    return int(sum(len(n.tokens) for n in training_nodes(episode)))


def action_tokens(episode: EpisodeData) -> int:
    """Sampled tokens of an episode's training trajectories, each counted once."""
    return int(sum(len(n.tokens) for n in training_nodes(episode) if n.kind == "act"))


# --- which groups and episodes train, and their shaped outcome (the trainer's loop and the dashboard's
# group view both use these) ---


def group_filter(cfg: TrainerConfig):
    """Evaluation sessions never train; dynamic sampling (RL): a group whose outcomes do not vary carries no signal,
    unless self-imitation is on and every episode of it succeeded, or negative reinforcement is on and none did."""

    def reason(group: Group) -> str | None:
        if any(ep.info.purpose == "eval" for ep in group.episodes):  # stepline eval's sessions
            return "eval"
        outcomes = [e.outcome for e in group.episodes]
        if cfg.mode == "rl" and cfg.dynamic_sampling and not has_reward_variance(outcomes):
            imitated = cfg.imitation_coef > 0 and bool(outcomes) and min(outcomes) >= cfg.imitation_min_outcome
            penalised = cfg.failure_coef > 0 and bool(outcomes) and max(outcomes) < cfg.imitation_min_outcome
            return None if imitated or penalised else "no_variance"
        return None

    return reason


def shaping(cfg: TrainerConfig):
    """DAPO overlong shaping on the episode's sampled tokens (0 when not configured)."""
    if cfg.overlong_max_len is None:
        return lambda episode: 0.0
    return lambda episode: float(overlong_penalty(torch.tensor([action_tokens(episode)]), max_len=cfg.overlong_max_len,
                                                  buffer_len=cfg.overlong_buffer, factor=cfg.overlong_factor)[0])


def episode_filter(cfg: TrainerConfig):
    """SFT trains on chosen episodes only: outcome >= sft_min_reward; abandoned ones only if count_abandoned."""
    chosen = cfg.mode != "sft" or cfg.sft_min_reward is None
    return lambda episode: ((cfg.count_abandoned or episode.info.status != "abandoned")
                            and (chosen or episode.outcome >= cfg.sft_min_reward))
