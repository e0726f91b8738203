"""One terminal episode: an agent (a model behind the Anthropic Messages API, or the scripted
expert) drives a `bash` tool in a fresh sandbox at OUT/sandbox.

The model loop resends the full history every turn (as agents do), so the gateway can reuse the
token ids of earlier turns. The recorded `Episode.messages` are Anthropic content blocks, led by the
system prompt as a `{"role": "system"}` message (as the OpenAI harnesses record it); the API call
itself passes it as `system=`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from stepline.agents.common import EndpointError, Episode, Tool, ToolCall, anthropic_schema
from stepline.agents.terminal.sandbox import Limits, Sandbox, episode_limits
from stepline.agents.terminal.tasks import Task, setup

SYSTEM = "You are in a Linux shell. Use the bash tool to do the task, then say done."
BASH = Tool("bash", "Run a shell command in the task directory.", {"command": "string"})


class MessagesClient(Protocol):
    """The slice of `anthropic.Anthropic().messages` the loop uses."""

    def create(self, **kwargs: Any) -> Any: ...


def open_sandbox(task: Task, out: Path, limits: Limits | None = None) -> Sandbox:
    """A fresh sandbox at out/sandbox with the task's input files, owned by the sandbox uid; with disk and
    inode quotas wherever the machine can enforce them (`episode_limits`)."""
    box = Sandbox(out / "sandbox", limits or episode_limits())
    setup(task, box.directory)
    box.prepare()
    return box


def new_episode(task: Task, expert: bool, model: str = "") -> Episode:
    return Episode(
        harness="terminal", task_id=task.task_id, expert=expert, model=model, tools=[anthropic_schema(BASH)],
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}],
    )


def model_episode(task: Task, out: Path, client: MessagesClient, model: str, max_turns: int, max_tokens: int) -> Episode:
    """Let the model act until it stops calling tools, runs out of turns, or the endpoint fails."""
    episode = new_episode(task, expert=False, model=model)
    box = open_sandbox(task, out)
    try:
        for turn in range(max_turns):
            try:
                content = _ask(client, model, max_tokens, episode.messages[1:])
            except EndpointError as exc:
                episode.error, episode.finish = str(exc), "error"
                return episode
            episode.turns = turn + 1
            if not _step(box, episode, turn, content):
                return episode
        episode.finish = "max_turns"
        return episode
    finally:
        episode.state = _summary(box)
        box.close()


def expert_episode(task: Task, out: Path) -> Episode:
    """The scripted solver: the task's expert command through the same tool, then "done"."""
    episode = new_episode(task, expert=True)
    box = open_sandbox(task, out)
    use = {"type": "tool_use", "id": "toolu_0", "name": "bash", "input": {"command": task.expert_command}}
    try:
        _step(box, episode, 0, [use])
        _step(box, episode, 1, [{"type": "text", "text": "done"}])
    finally:
        episode.state = _summary(box)
        box.close()
    episode.turns = 2
    return episode


def _step(box: Sandbox, episode: Episode, turn: int, content: list[dict[str, Any]]) -> bool:
    """Record one assistant answer and run its tool calls; False when the episode is over."""
    episode.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
    uses = [block for block in content if block["type"] == "tool_use"]
    if not uses:
        episode.final = "".join(block.get("text", "") for block in content)
        episode.finish = "final_message"
        return False
    episode.messages.append({"role": "user", "content": [_run_tool(box, episode, turn, use) for use in uses]})
    return True


def _run_tool(box: Sandbox, episode: Episode, turn: int, use: dict[str, Any]) -> dict[str, Any]:
    """Execute one tool_use block; return its tool_result block."""
    given = use.get("input")
    args: dict[str, Any] = given if isinstance(given, dict) else {}
    command = args.get("command")
    if use.get("name") != "bash" or not isinstance(command, str) or set(args) != {"command"}:
        text, failed = "error: call bash with one string argument, command", True
    else:
        result = box.run(command)
        text, failed = result.output or "(no output)", result.exit_code != 0
    episode.calls.append(ToolCall(turn=turn, name=str(use.get("name")), arguments=args, result=text, error=failed))
    return {"type": "tool_result", "tool_use_id": use["id"], "content": text, "is_error": failed}


def _ask(client: MessagesClient, model: str, max_tokens: int, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One model call; the answer's content blocks as the minimal dicts the API accepts back."""
    import anthropic  # here, not at the top: expert runs (demonstrations) never pay for the SDK import

    try:
        response = client.create(
            model=model, max_tokens=max_tokens, system=SYSTEM, tools=[anthropic_schema(BASH)], messages=messages
        )
        return [_block(block) for block in response.content]
    except anthropic.APIError as exc:
        raise EndpointError(f"{type(exc).__name__}: {exc}") from exc
    except (AttributeError, TypeError, ValueError) as exc:
        raise EndpointError(f"malformed messages answer: {exc}") from exc


def _block(block: Any) -> dict[str, Any]:
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    if block.type == "text":
        return {"type": "text", "text": block.text}
    return block.model_dump(exclude_none=True)


def _summary(box: Sandbox) -> dict[str, Any]:
    """For people reading episode.json: which sandbox mode and quotas ran, and the files left behind."""
    files = sorted(str(p.relative_to(box.directory)) for p in box.directory.rglob("*"))[:50]
    quota = {"disk_bytes": box.limits.disk_bytes, "inodes": box.limits.inodes} if box.limits.quota() else None
    return {"api": "anthropic.messages", "sandbox_mode": box.mode, "quota": quota, "files": files}
