"""Score a terminal episode from the sandbox directory it left behind, never from what the agent said.

    python -m stepline.agents.terminal.verify --task ID --out DIR     # one JSON line: reward, success, reason
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from stepline.agents.common import Episode, Verdict, failed, verdict_for
from stepline.agents.terminal.tasks import check, get_task, is_task


def score(out_dir: Path, task_id: str, episode: Episode) -> Verdict:
    """Run the task's check on out_dir/sandbox (episode.json only says the episode ran)."""
    box = out_dir / "sandbox"
    if not box.is_dir() or box.is_symlink():
        return failed("no sandbox directory")
    reason = check(get_task(task_id), box)
    return Verdict(reward=1.0, success=True, reason="ok") if reason is None else failed(reason)


@click.command()
@click.option("--task", "task_id", required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
def main(task_id: str, out_dir: Path) -> None:
    verdict = verdict_for("terminal", functools.partial(score, out_dir), is_task, task_id, out_dir)
    click.echo(verdict.model_dump_json(exclude_none=True))


if __name__ == "__main__":
    main()
