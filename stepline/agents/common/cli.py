"""The three commands every harness offers (the harness contract, see stepline/agents/README.md).

    python -m stepline.agents.<name>.tasks  --split train|test           -> JSON list of task ids
    python -m stepline.agents.<name>.run    --task ID --out DIR [--max-turns K] [--max-tokens N] [--expert]
                                                                -> DIR/episode.json; exit 1 if it broke
    python -m stepline.agents.<name>.verify --task ID --out DIR          -> one JSON line {"reward","success","reason"}
                                                                   (and, for training, "train_reward", "step_rewards")

Each harness module builds its command with one of the factories below and calls it under
`if __name__ == "__main__"`.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import click
from pydantic import BaseModel, Field

from stepline.agents.common.episode import Episode, EpisodeError, read_episode, write_episode

SPLITS = ("train", "test")


class Verdict(BaseModel):
    """A verifier's score for one episode."""

    reward: float = Field(ge=0.0, le=1.0)
    success: bool
    reason: str
    train_reward: float | None = Field(None, ge=0.0, le=1.0)  # what training optimises where it differs from the
                                                               # score (a harness's check of how the agent got there)
    # training only: a reward for the model call (0-based turn) that earned it, beside the episode's outcome (the
    # trainer's `dense` advantage credits it to that step and, discounted, to the steps before it)
    step_rewards: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(allow_inf_nan=False)]] | None = None
    # training only: for a failed episode, the first user message under which it would have succeeded (the instruction
    # it did carry out): the driver's hindsight relabelling records the episode under it as a demonstration
    hindsight: str | None = None


def failed(reason: str) -> Verdict:
    return Verdict(reward=0.0, success=False, reason=reason)


def tasks_command(split_ids: Callable[[str], list[str]],
                  references: Callable[[str], dict[str, str]] | None = None,
                  kinds: Callable[[str], dict[str, str]] | None = None) -> click.Command:
    """`--split` -> prints the split's task ids as one JSON list; `--references` (for a harness whose tasks
    have a gold answer) -> prints {task id: gold answer} instead (IGPO's reference); `--kinds` (for a harness
    whose tasks come in kinds) -> prints {task id: kind} (a curriculum over kinds)."""

    @click.command()
    @click.option("--split", type=click.Choice(SPLITS), default="train", show_default=True)
    @click.option("--references", "with_references", is_flag=True, help="print {task id: gold answer}")
    @click.option("--kinds", "with_kinds", is_flag=True, help="print {task id: kind}")
    def tasks(split: str, with_references: bool, with_kinds: bool) -> None:
        for flag, table, missing in ((with_references, references, "gold answers"), (with_kinds, kinds, "kinds")):
            if flag:
                if table is None:
                    raise click.UsageError(f"this harness's tasks have no {missing}")
                click.echo(json.dumps(table(split)))
                return
        click.echo(json.dumps(split_ids(split)))

    return tasks


def record_episode(harness: str, task_id: str, expert: bool, out_dir: Path, play: Callable[[], Episode]) -> Episode:
    """Play and write DIR/episode.json. Shared by `run` and the worker (stepline/agents/common/serve.py), so both
    record the same episode; a harness bug still leaves a scorable (0) episode that says why."""
    try:
        episode = play()
    except Exception as exc:  # the episode's edge (a process, or a worker's child)
        traceback.print_exc()
        episode = Episode(harness=harness, task_id=task_id, expert=expert, finish="error",
                          error=f"harness crashed: {type(exc).__name__}: {exc}")
    write_episode(out_dir, episode)
    return episode


def exit_for(episode: Episode) -> None:
    """The `run` exit status: 1 (with the reason on stderr) when the episode broke, else return."""
    if episode.error:
        click.echo(f"episode failed: {episode.error}", err=True)
        sys.exit(1)


def run_command(
    harness: str, play: Callable[[str, int, int, bool], Episode], known: Callable[[str], bool], default_max_turns: int
) -> click.Command:
    """`play(task_id, max_turns, max_tokens, expert) -> Episode`; writes DIR/episode.json, exits 1 when it broke."""

    @click.command()
    @click.option("--task", "task_id", required=True, help="task id (see the tasks command)")
    @click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
    @click.option("--max-turns", type=click.IntRange(1, 64), default=default_max_turns, show_default=True)
    @click.option("--max-tokens", type=click.IntRange(1, 4096), default=128, show_default=True,
                  help="max_tokens of each model call")
    @click.option("--expert", is_flag=True, help="play the scripted solver instead of asking a model")
    def run(task_id: str, out_dir: Path, max_turns: int, max_tokens: int, expert: bool) -> None:
        if not known(task_id):
            raise click.BadParameter(f"unknown task {task_id!r}", param_hint="--task")
        exit_for(record_episode(harness, task_id, expert, out_dir, lambda: play(task_id, max_turns, max_tokens, expert)))

    return run


def verify_command(harness: str, score: Callable[[str, Episode], Verdict], known: Callable[[str], bool]) -> click.Command:
    """Prints one Verdict JSON line; a missing/broken episode or a verifier that throws scores 0 with the reason."""

    @click.command()
    @click.option("--task", "task_id", required=True)
    @click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
    def verify(task_id: str, out_dir: Path) -> None:
        click.echo(verdict_for(harness, score, known, task_id, out_dir).model_dump_json(exclude_none=True))

    return verify


def verdict_for(
    harness: str, score: Callable[[str, Episode], Verdict], known: Callable[[str], bool], task_id: str, out_dir: Path
) -> Verdict:
    if not known(task_id):
        return failed(f"unknown task {task_id!r}")
    try:
        episode = read_episode(out_dir)
    except EpisodeError as exc:
        return failed(str(exc))
    if episode.harness != harness or episode.task_id != task_id:
        return failed(f"episode is for {episode.harness}/{episode.task_id}, not {harness}/{task_id}")
    if episode.error:
        return failed(f"episode broke: {episode.error}")
    try:
        return score(task_id, episode)
    except Exception as exc:  # the process edge: a verifier bug scores 0 and says why
        traceback.print_exc()
        return failed(f"verifier error: {type(exc).__name__}: {exc}")
