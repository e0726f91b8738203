"""The [rollout] table of a job file: which harnesses run, how often, and under which limits.

    [rollout]
    group_size = 4
    max_concurrency = 8
    [[rollout.harnesses]]
    name = "terminal"
    module = "stepline.agents.terminal"          # python -m stepline.agents.terminal.{tasks,run,verify,serve} (the harness contract)
    weight = 2.0                        # persistent = true (default): episodes played by one long-lived worker
    [[rollout.harnesses]]
    name = "mine"
    command = "python my_agent.py"      # any program: endpoint in OPENAI_*/ANTHROPIC_*, task in STEPLINE_TASK_ID
    verify_command = "python my_check.py"   # optional; else the program posts its own reward
    tasks = ["a", "b"]
    references = {a = "Pine", b = "42"}     # gold answers: session metadata["reference"] (IGPO); true: the module's
    [rollout.harnesses.tree_search]         # Tree-GRPO rollouts: M chains, then N forks per tree per round
    trees = 2
    branches = 2
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["HarnessError", "HarnessSpec", "RolloutConfig", "TreeSearch", "list_tasks", "regular_expression",
           "task_kinds", "task_references", "tasks_matching", "training_tasks"]


class HarnessError(RuntimeError):
    """A harness's tasks command failed or printed something else than its contract says (the message names it)."""


class TreeSearch(BaseModel):
    """Tree-search rollouts (Tree-GRPO): a group is `trees` episodes played to the end, then `rounds` rounds that
    each fork `branches` episodes per tree at a step boundary drawn at random from the tree's steps (a fork
    replays the steps before it and samples from there, stepline/gateway/forks.py). A group has
    trees × (1 + branches × rounds) sessions, in place of `group_size`."""

    model_config = ConfigDict(extra="forbid")

    trees: int = Field(2, ge=1, description="independent episodes per group (M): the roots of its trees")
    branches: int = Field(1, ge=1, description="forks per tree in each round (N)")
    rounds: int = Field(1, ge=1, description="rounds of forking (L); a later round may fork an earlier round's forks")

    @property
    def group_size(self) -> int:
        return self.trees * (1 + self.branches * self.rounds)


MOVED = ("agents.search", "agents.terminal", "agents.ui")  # the bundled harnesses' paths in older releases


class HarnessSpec(BaseModel):
    """One harness of the job: a module speaking the harness contract, or any external command."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="harness name recorded on sessions (groups are task × harness)")
    module: str | None = Field(None, description="package with tasks/run/verify modules, e.g. stepline.agents.terminal")
    command: str | None = Field(None, description="external harness, run by /bin/sh with the endpoint in env")
    verify_command: str | None = Field(None, description="external verifier (prints a JSON line with reward)")
    tasks: list[str] | None = Field(None, description="task ids (default: the module's tasks command)")
    weight: float = Field(1.0, gt=0, description="relative share of groups drawn from this harness")
    group_size: int | None = Field(None, ge=1, description="sessions per task of this harness (None: the rollout's "
                                   "group_size); larger groups find a success on hard tasks more often")
    split: Literal["train", "test"] = Field("train", description="task split used for training rollouts")
    train_tasks_matching: str | None = Field(
        None, description="a regular expression: training rollouts draw only the task ids it matches (a curriculum "
                          "over tasks, e.g. the categories the warm start solves at times); demonstrations and "
                          "evaluation still use every task of their split")
    train_kinds: list[str] | dict[str, int] | None = Field(
        None, min_length=1, description="training rollouts draw only tasks of these kinds (a module's `tasks --kinds`; "
                                        "a curriculum over kinds, e.g. leaving out the kind whose reward pulls the "
                                        "policy everywhere); a table {kind = n} also weights them: each task of the "
                                        "kind comes n times in each pass over the tasks. Demonstrations and evaluation "
                                        "use every kind once")
    max_turns: int | None = Field(None, ge=1, description="--max-turns passed to a module harness")
    max_tokens: int | None = Field(None, ge=1, le=4096, description="--max-tokens passed to a module harness")
    persistent: bool = Field(
        True, description="a module harness plays its episodes in one long-lived worker (`python -m <module>.serve`, "
                          "forking a child per episode) instead of one `run` and one `verify` process per episode; "
                          "a module without a serve submodule falls back to processes")
    references: bool | dict[str, str] = Field(
        False, description="put each task's gold answer into its sessions' metadata[\"reference\"] (IGPO): a table "
                           "task id -> answer, or true for a module's own (`python -m <module>.tasks --references`)")
    tree_search: TreeSearch | None = Field(None, description="Tree-GRPO rollouts: groups of forked episodes (None: "
                                           "group_size independent episodes)")
    temperature: float | None = Field(
        None, ge=0, le=2, description="sampling temperature of this harness's training episodes, over [rollout] "
                                      "temperature (exploration where its samples agree); evaluation keeps the "
                                      "evaluation's or the rollouts' temperature")
    expert_per_group: int = Field(
        0, ge=0, description="off-policy guidance (LUFFY): this many of each training group's episodes are played by "
                             "the module's scripted expert (`run --expert`) and recorded as expert sessions, which "
                             "the trainer takes with ratio 1; the group's baseline counts them. Never in evaluation")
    hindsight: bool = Field(
        False, description="hindsight relabelling (HER): a failed training episode whose verdict names the first user "
                           "message under which it succeeds (`hindsight`) is recorded again under it, in its group, as "
                           "an expert session with outcome 1 (with trainer.expert_sft_coef > 0: cross-entropy beside RL)")

    @field_validator("module")
    @classmethod
    def _current_module_path(cls, module: str | None) -> str | None:
        """The bundled harnesses live under stepline.agents; the old top-level path gets the new one named."""
        if module is not None and ".".join(module.split(".")[:2]) in MOVED:
            raise ValueError(f"module {module!r} moved into the stepline package: use 'stepline.{module}'")
        return module

    @field_validator("train_kinds")
    @classmethod
    def _whole_repeats(cls, kinds: list[str] | dict[str, int] | None) -> list[str] | dict[str, int] | None:
        if isinstance(kinds, dict) and (bad := {kind: n for kind, n in kinds.items() if n < 1}):
            raise ValueError(f"a kind's weight is how many times each of its tasks comes per pass, at least 1 "
                             f"(leave a kind out to draw none of it): {bad}")
        return kinds

    @field_validator("train_tasks_matching")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        return None if pattern is None else regular_expression(pattern)

    @model_validator(mode="after")
    def _one_program(self) -> HarnessSpec:
        if (self.module is None) == (self.command is None):
            raise ValueError(f"harness {self.name!r}: give exactly one of module or command")
        if self.command is not None and not self.tasks:
            raise ValueError(f"harness {self.name!r}: an external command needs a tasks list")
        if self.expert_per_group and (self.module is None or self.tree_search is not None):
            raise ValueError(f"harness {self.name!r}: expert_per_group needs a module harness (its --expert mode) "
                             "and no tree_search")
        if self.train_kinds is not None and self.module is None:
            raise ValueError(f"harness {self.name!r}: train_kinds reads a module's task kinds (`tasks --kinds`)")
        if self.references is True and self.module is None:
            raise ValueError(f"harness {self.name!r}: references = true reads a module's gold answers; an external "
                             "command gives them as a table {task id = answer}")
        return self


class RolloutConfig(BaseModel):
    """How the rollout driver runs episodes."""

    model_config = ConfigDict(extra="forbid")

    harnesses: list[HarnessSpec] = Field(default_factory=list, description="the harness mix")
    group_size: int = Field(4, ge=1, description="sessions per task (G); one group is G episodes of one task")
    max_concurrency: int = Field(8, ge=1, description="episodes running at once")
    temperature: float | None = Field(
        None, ge=0, le=2, description="sampling temperature of every call of these episodes, set by the gateway "
                                      "whatever the harness asks (0: greedy; None: the harness's own, and the "
                                      "engine's 1.0 where it sets none)")
    episode_timeout_s: float = Field(
        300.0, gt=0, description="wall time of one episode (a harness process, or a worker's child), then SIGKILL")
    verify_timeout_s: float = Field(60.0, gt=0, description="wall time of one verifier (process or worker child)")
    retries: int = Field(0, ge=0, description="re-runs of a failed episode in a new session (the failure stays recorded)")
    failed_reward: float = Field(0.0, description="reward posted for a failed episode (crash, hang, non-zero exit)")
    score_failed: bool = Field(
        True, description="post failed_reward for failed episodes; false posts none (the pool leaves them out of groups)")
    seed: int = Field(0, description="seed of the harness and task draw")
    keep_episodes: bool = Field(False, description="keep each episode's directory (logs, episode.json)")
    work_dir: Path | None = Field(None, description="where episode directories go (default: a temporary dir)")

    @model_validator(mode="after")
    def _valid_harnesses(self) -> RolloutConfig:
        names = [h.name for h in self.harnesses]
        if len(set(names)) != len(names):
            raise ValueError(f"harnesses: duplicate names in {names}")
        for h in self.harnesses:
            if h.expert_per_group >= (size := h.group_size or self.group_size):
                raise ValueError(f"harness {h.name!r}: expert_per_group {h.expert_per_group} leaves none of its "
                                 f"groups of {size} to the policy")
        return self


def task_references(spec: HarnessSpec, split: str | None = None) -> dict[str, str]:
    """Gold answers by task id: the spec's table, a module's `tasks --references`, or none."""
    if isinstance(spec.references, dict) or not spec.references:
        return dict(spec.references or {})
    return _module_table(spec, "--references", "gold answers", split)


def _module_table(spec: HarnessSpec, flag: str, what: str, split: str | None = None) -> dict[str, str]:
    """{task id: text} from a module's `tasks --split S FLAG`; a HarnessError saying what failed."""
    argv = [sys.executable, "-m", f"{spec.module}.tasks", "--split", split or spec.split, flag]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HarnessError(f"harness {spec.name!r}: {' '.join(argv)} failed: {done.stderr.strip()[-300:]}")
    table = json.loads(done.stdout)
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise HarnessError(f"harness {spec.name!r}: the tasks command printed no table of {what}")
    return table


def regular_expression(pattern: str) -> str:
    """`pattern` when it compiles, else a ValueError saying why (for the settings that take one)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {pattern!r} ({exc})") from None
    return pattern


def tasks_matching(spec: HarnessSpec, ids: list[str], pattern: str | None, setting: str) -> list[str]:
    """The ids `pattern` finds a match in (all when None); a HarnessError naming `setting` when none."""
    if pattern is None:
        return ids
    kept = [task_id for task_id in ids if re.search(pattern, task_id)]
    if not kept:
        raise HarnessError(f"harness {spec.name!r}: {setting} {pattern!r} matches none of its {len(ids)} tasks "
                           f"(e.g. {ids[0]!r})")
    return kept


def training_tasks(spec: HarnessSpec) -> list[str]:
    """The task ids training rollouts draw from: the spec's split, narrowed by `train_tasks_matching` and
    `train_kinds` (an id repeated n times where its kind has weight n)."""
    ids = tasks_matching(spec, list_tasks(spec), spec.train_tasks_matching, "train_tasks_matching")
    if spec.train_kinds is None:
        return ids
    kinds = task_kinds(spec)
    unknown = sorted(set(spec.train_kinds) - set(kinds.values()))
    if unknown:
        raise HarnessError(f"harness {spec.name!r}: train_kinds {unknown} are not kinds of its tasks "
                           f"(its kinds: {sorted(set(kinds.values()))})")
    weights = spec.train_kinds if isinstance(spec.train_kinds, dict) else dict.fromkeys(spec.train_kinds, 1)
    kept = [task_id for task_id in ids for _ in range(weights.get(kinds.get(task_id, ""), 0))]
    if not kept:
        raise HarnessError(f"harness {spec.name!r}: train_kinds {spec.train_kinds} match none of its {len(ids)} tasks")
    return kept


def task_kinds(spec: HarnessSpec) -> dict[str, str]:
    """Task id -> kind, from `python -m <module>.tasks --kinds`."""
    return _module_table(spec, "--kinds", "task kinds")


def list_tasks(spec: HarnessSpec, split: str | None = None) -> list[str]:
    """Task ids of a harness: its explicit list, else `python -m <module>.tasks --split S`."""
    if spec.tasks is not None:
        return list(spec.tasks)
    argv = [sys.executable, "-m", f"{spec.module}.tasks", "--split", split or spec.split]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HarnessError(f"harness {spec.name!r}: {' '.join(argv)} failed: {done.stderr.strip()[-300:]}")
    ids = json.loads(done.stdout)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise HarnessError(f"harness {spec.name!r}: tasks command printed no list of task ids")
    return ids
