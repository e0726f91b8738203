"""The group view: the episodes of one group (one task × harness, docs/architecture.md §3) side by side, with
their rewards and the advantages the trainer would compute for them under the job's [trainer] settings.

    group_rows(rows)                  one summary row per group key of the episodes table (pure)
    group_view(key, episodes, cfg)    the group as the trainer would claim it, with per-step advantages

The advantages come from the trainer's own code, not a copy of it: `stepline.trainer.batch.build_batch` with the
trainer's shaping and episode filter (`stepline.trainer.batch`), then the job's estimator from `ADVANTAGES` with its
`advantage_args`, on the episodes the pool would hand out (ended, with a terminal reward). Estimators that
need the policy or the critic (gae and capo read the critic's values, igpo the policy's belief in the gold
answer) are named but not computed: that takes the model, which the dashboard never loads. torch is imported
only when a group is opened.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepline.dashboard.sessions import SessionRow
from stepline.datapool.records import EpisodeData, Group

if TYPE_CHECKING:
    from stepline.trainer.config import TrainerConfig

__all__ = ["GroupQuery", "GroupRow", "group_rows", "group_view", "select_groups", "trainer_config"]

MODEL_ESTIMATORS = {"gae": "the critic's values", "capo": "the critic's values",
                    "igpo": "the policy's probability of the gold answer"}
MAX_GROUP = 256  # episodes one group view computes; the pool's groups are the driver's group_size (a few)


@dataclass(frozen=True)
class GroupRow:
    """One group as the groups table shows it."""

    group_key: str
    task_id: str
    harness: str
    split: str  # "eval" if any of its sessions is an evaluation session (they never train)
    episodes: int
    ended: int  # sessions no longer open
    rewarded: int  # sessions with a terminal reward
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    created_at: float  # its oldest session's


def group_rows(rows: tuple[SessionRow, ...]) -> list[GroupRow]:
    """The episodes table's rows folded by group key, oldest group first (pure)."""
    by_key: dict[str, list[SessionRow]] = {}
    for r in rows:
        by_key.setdefault(r.group_key, []).append(r)
    out = []
    for key, members in by_key.items():
        rewards = [r.reward for r in members if r.reward is not None and math.isfinite(r.reward)]
        out.append(GroupRow(
            group_key=key, task_id=members[0].task_id, harness=members[0].harness,
            split="eval" if any(r.split == "eval" for r in members) else "train", episodes=len(members),
            ended=sum(r.status != "open" for r in members), rewarded=sum(r.reward is not None for r in members),
            reward_mean=statistics.fmean(rewards) if rewards else None, reward_min=min(rewards, default=None),
            reward_max=max(rewards, default=None), created_at=min(r.created_at for r in members)))
    return sorted(out, key=lambda g: (g.created_at, g.group_key))


GroupSort = Literal["created", "reward", "episodes", "harness", "task"]
GROUP_SORT: dict[str, Callable[[GroupRow], Any]] = {
    "created": lambda g: g.created_at, "reward": lambda g: -1e300 if g.reward_mean is None else g.reward_mean,
    "episodes": lambda g: g.episodes, "harness": lambda g: g.harness, "task": lambda g: g.task_id,
}


class GroupQuery(BaseModel):
    """The groups table's query string; anything else is refused (400), naming the parameter."""

    model_config = ConfigDict(extra="forbid")

    offset: int = Field(0, ge=0, description="rows to skip")
    limit: int = Field(50, ge=1, le=500, description="rows per page")
    harness: str | None = Field(None, description="exact harness name")
    split: Literal["train", "eval"] | None = None
    q: str | None = Field(None, max_length=200, description="substring of the group key")
    varies: bool | None = Field(None, description="only groups whose rewards differ (or only those that do not)")
    sort: GroupSort = "created"
    order: Literal["asc", "desc"] = "desc"


def _varies(g: GroupRow) -> bool:
    return g.reward_min is not None and g.reward_max is not None and g.reward_max > g.reward_min


def select_groups(groups: list[GroupRow], query: GroupQuery) -> dict[str, Any]:
    """The page `query` asks for: {"total", "offset", "limit", "rows"} (pure)."""
    q = query.q.lower() if query.q else None
    matched = [g for g in groups
               if (query.harness is None or g.harness == query.harness) and (query.split is None or g.split == query.split)
               and (q is None or q in g.group_key.lower()) and (query.varies is None or _varies(g) == query.varies)]
    matched.sort(key=GROUP_SORT[query.sort], reverse=query.order == "desc")
    page = matched[query.offset: query.offset + query.limit]
    return {"total": len(matched), "offset": query.offset, "limit": query.limit, "rows": [asdict(g) for g in page]}


def trainer_config(job_trainer: dict[str, Any]) -> tuple[TrainerConfig, str | None]:
    """The job's RL trainer settings (job.json's [trainer] table over the defaults), and why they could
    not be read (then the defaults are used), if so."""
    from stepline.trainer.config import TrainerConfig

    try:
        return TrainerConfig.model_validate(job_trainer), None
    except ValidationError as exc:
        return TrainerConfig(), f"job.json's [trainer] table does not load ({exc.error_count()} errors): defaults shown"


def _left_out(ep: EpisodeData) -> str | None:
    """Why the pool would not hand this session to the trainer (stepline.datapool.sql claim_groups), if it would not."""
    if ep.info.status == "open":
        return "still open: the group is not ready"
    if not any(r.step is None for r in ep.rewards):
        return "no terminal reward"
    return None


def _estimate(batch: Any, cfg: TrainerConfig) -> tuple[list[float] | None, str | None]:
    """Per-step advantages [S] of the batch under the job's estimator, or why they are not computed here."""
    from stepline.trainer.algorithms import ADVANTAGES

    if cfg.advantage in MODEL_ESTIMATORS:
        return None, f"{cfg.advantage} needs {MODEL_ESTIMATORS[cfg.advantage]}: computed only inside the trainer"
    if batch.num_steps == 0:
        return [], None
    advantages = ADVANTAGES[cfg.advantage](batch.advantage_inputs(), **cfg.advantage_args)
    note = "reinforce_pp normalises over the whole batch: here over this group alone" if cfg.advantage == "reinforce_pp" else None
    return [float(a) for a in advantages.tolist()], note


def group_view(key: str, episodes: list[EpisodeData], cfg: TrainerConfig) -> dict[str, Any]:
    """The group `key` (its sessions' episodes, oldest first) as JSON: per episode its reward, the outcome
    the trainer uses (with overlong shaping), and per training trajectory the advantage of each step."""
    from stepline.trainer.batch import build_batch, episode_filter, group_filter, shaping

    ready = [ep for ep in episodes if _left_out(ep) is None]
    group = Group(key, key, ready, min((n.weight_version for ep in ready for n in ep.tree.nodes if n.kind == "act"),
                                        default=-1))
    skip = group_filter(cfg)(group) if ready else "empty"
    batch = build_batch([group], shaping=shaping(cfg), keep_episode=episode_filter(cfg))
    skip = skip or next(iter(batch.skipped), None)
    advantages, note = _estimate(batch, cfg) if batch.episodes else (None, None)
    index = {id(ep): e for e, ep in enumerate(batch.episodes)}
    cards = [_card(ep, index.get(id(ep)), batch, advantages) for ep in episodes]
    outcomes = [float(o) for o in batch.outcome.tolist()]
    first = episodes[0].info if episodes else None
    return {
        "group_key": key, "task_id": first.task_id if first else None, "harness": first.harness if first else None,
        "advantage": cfg.advantage, "advantage_args": dict(cfg.advantage_args), "leaf_rule": cfg.leaf_rule,
        "skip": skip, "note": note, "episodes": cards,
        "outcome_mean": statistics.fmean(outcomes) if outcomes else None,
        "outcome_std": statistics.stdev(outcomes) if len(outcomes) > 1 else None,
    }


def _card(ep: EpisodeData, e: int | None, batch: Any, advantages: list[float] | None) -> dict[str, Any]:
    """One episode of the group: episode `e` of `batch` (None: not trained) with its step rows."""
    steps = [] if e is None else [
        {"trajectory": int(batch.step_traj[s]), "position": int(batch.step_position[s]),
         "call": int(batch.step_call[s]), "step_reward": float(batch.step_reward[s]),
         "advantage": advantages[s] if advantages is not None else None}
        for s in range(batch.num_steps) if int(batch.step_episode[s]) == e]
    return {
        "session_id": ep.info.session_id, "status": ep.info.status,
        "reward": ep.outcome if any(r.step is None for r in ep.rewards) else None,
        "outcome": float(batch.outcome[e]) if e is not None else None,
        "left_out": _left_out(ep) or (None if e is not None else "not trained (see skip)"),
        "trajectories": len({s["trajectory"] for s in steps}), "steps": steps,
        "tokens": sum(len(n.tokens) for n in ep.tree.nodes),
    }
