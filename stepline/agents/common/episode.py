"""What one episode of a harness leaves behind: `DIR/episode.json`.

The file is the harness's record of what happened (every tool call and its result, the final answer,
the final app state…). Verifiers score from it and from the task data, never from what the agent
claims. A broken episode still writes the file, with `error` set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

EPISODE_FILE = "episode.json"

Finish = Literal["answer", "final_message", "max_turns", "error"]


class EpisodeError(Exception):
    """The episode file is missing or unreadable (a verifier scores it 0 with this reason)."""


class ToolCall(BaseModel):
    """One tool call the agent made and what the tool answered."""

    turn: int  # index of the model call (0-based) whose answer contained this tool call
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # parsed JSON arguments ({} if unparsable)
    result: str = ""  # the text the harness sent back as the tool message
    error: bool = False  # the call failed (unknown tool, bad arguments, invalid action)


class Episode(BaseModel):
    """One episode of one harness on one task."""

    harness: str  # "search" | "ui" | "terminal" | …
    task_id: str
    expert: bool = False  # played by the scripted solver, no model
    model: str = ""  # model name sent to the endpoint
    turns: int = 0  # model calls made (expert: scripted turns)
    calls: list[ToolCall] = Field(default_factory=list)
    final: str | None = None  # the final answer / final message text, if any
    finish: Finish = "max_turns"
    error: str | None = None  # why the episode broke (endpoint down, garbage answer…); None if it ran
    state: dict[str, Any] | None = None  # harness-specific final state (UI app state, sandbox summary…)
    tools: list[dict[str, Any]] = Field(default_factory=list)  # tool schemas in the API's own format
    messages: list[dict[str, Any]] = Field(default_factory=list)  # full history in the API's own format


def write_episode(out_dir: Path, episode: Episode) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / EPISODE_FILE
    path.write_text(episode.model_dump_json(indent=1))
    return path


def read_episode(out_dir: Path) -> Episode:
    path = out_dir / EPISODE_FILE
    try:
        return Episode.model_validate(json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise EpisodeError(f"no {EPISODE_FILE} in {out_dir}") from exc
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise EpisodeError(f"unreadable {EPISODE_FILE}: {str(exc).splitlines()[0]}") from exc
