"""Run one terminal episode and write OUT/episode.json (the harness contract, see stepline/agents/README.md).

    python -m stepline.agents.terminal.run --task ID --out DIR [--max-turns K] [--max-tokens N] [--expert]

The model is reached with the Anthropic SDK through ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
(model name ANTHROPIC_MODEL, default "policy"). The sandbox is OUT/sandbox; the verifier reads it.
Exit status: 0 the episode ran (whatever its score); 1 it broke (episode.json says why); 2 usage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import click

from stepline.agents.common import Episode
from stepline.agents.common.cli import exit_for, record_episode
from stepline.agents.common.loop import tls_context
from stepline.agents.terminal.episode import MessagesClient, expert_episode, model_episode
from stepline.agents.terminal.tasks import UnknownTask, get_task

NAME = "terminal"
MAX_TURNS = 4


def play(task_id: str, out: Path, max_turns: int, max_tokens: int, expert: bool) -> Episode:
    task = get_task(task_id)
    if expert:
        return expert_episode(task, out)
    import anthropic  # only model runs need the SDK (about a second of imports)

    client = anthropic.Anthropic(
        api_key=os.environ.get("ANTHROPIC_API_KEY") or "none", max_retries=5,
        timeout=float(os.environ.get("AGENT_REQUEST_TIMEOUT_S", "300")),
        http_client=anthropic.DefaultHttpxClient(verify=tls_context()),
    )
    model = os.environ.get("ANTHROPIC_MODEL", "policy")
    return model_episode(task, out, cast(MessagesClient, client.messages), model, max_turns, max_tokens)


@click.command()
@click.option("--task", "task_id", required=True, help="task id (see stepline.agents.terminal.tasks)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--max-turns", type=click.IntRange(1, 64), default=MAX_TURNS, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=128, show_default=True)
@click.option("--expert", is_flag=True, help="play the scripted solver instead of asking a model")
def main(task_id: str, out_dir: Path, max_turns: int, max_tokens: int, expert: bool) -> None:
    try:
        get_task(task_id)
    except UnknownTask as exc:
        raise click.BadParameter(str(exc), param_hint="--task") from exc
    exit_for(record_episode(NAME, task_id, expert, out_dir, lambda: play(task_id, out_dir, max_turns, max_tokens, expert)))


if __name__ == "__main__":
    main()
