"""The BFCL agent: BFCL's question turns, its functions as OpenAI tools, one episode (model or ground truth).

Single-turn tasks are one model call; its tool calls are the answer (BFCL's single-turn FC protocol). A
multi-turn task walks the user turns; in each, the model calls tools, BFCL's API classes (opened from the
task's initial_config in the bridge) execute them and the results go back as tool messages, until the model
answers without a tool call or `max_turns` model calls of that user turn are spent (the episode then ends:
BFCL fails an entry whose model was force-quit).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from stepline.agents.bfcl.categories import CATEGORIES, is_multi_turn, split_of
from stepline.agents.bfcl.client import Bridge
from stepline.agents.common import Episode, OpenAIPolicy, RawCall, ToolCall, Turn, final_turn
from stepline.agents.common.loop import assistant_message

NAME = "bfcl"
MAX_TURNS = 10  # model calls per user turn (BFCL allows 20; its base tasks need at most 8 calls + the answer)
DONE = "Done."

Policy = Callable[[list[dict[str, Any]]], Turn]


class ExpertPolicy:
    """Plays BFCL's ground truth: `script[turn][step]` is the calls of one assistant message; after the
    last step of a user turn it answers DONE (single-turn tasks: all calls in one message, nothing after)."""

    def __init__(self, script: list[list[list[dict[str, Any]]]]):
        self.script = script

    def __call__(self, messages: list[dict[str, Any]]) -> Turn:
        turn = sum(1 for i, m in enumerate(messages) if m["role"] == "user" and (i == 0 or messages[i - 1]["role"] != "user")) - 1
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        step = sum(1 for m in messages[last_user:] if m["role"] == "assistant")
        steps = self.script[turn]
        if step >= len(steps):
            return final_turn(DONE)
        return Turn(None, [RawCall(f"call_{turn}_{step}_{k}", c["name"], json.dumps(c["arguments"]))
                           for k, c in enumerate(steps[step])])


def play(task_id: str, max_turns: int, max_tokens: int = 128, expert: bool = False) -> Episode:
    with Bridge() as bridge:
        task = bridge.ask("task", id=task_id)
        policy: Policy
        if expert:
            policy = ExpertPolicy(bridge.ask("expert", id=task_id))
        else:
            policy = OpenAIPolicy([], max_tokens=max_tokens)
            policy.tools = task["tools"]
        episode = Episode(harness=NAME, task_id=task_id, expert=expert,
                          model=policy.model if isinstance(policy, OpenAIPolicy) else "", tools=task["tools"])
        if is_multi_turn(task_id):
            bridge.ask("open", id=task_id)
        return _play_turns(policy, bridge, episode, task["turns"], max_turns)


def _play_turns(policy: Policy, bridge: Bridge, episode: Episode, turns: list[list[dict[str, Any]]],
                max_turns: int) -> Episode:
    from stepline.agents.common.loop import EndpointError

    multi = is_multi_turn(episode.task_id)
    try:
        for user in turns:
            episode.messages.extend(user)
            if not _play_user_turn(policy, bridge, episode, max_turns if multi else 1, multi):
                episode.finish = "max_turns"
                return episode
    except EndpointError as exc:
        episode.finish, episode.error = "error", str(exc)
        return episode
    episode.finish = "final_message" if multi or not episode.calls else "answer"
    return episode


def _play_user_turn(policy: Policy, bridge: Bridge, episode: Episode, max_calls: int, multi: bool) -> bool:
    """Model calls until an answer without tool calls (True) or `max_calls` of them (False; single-turn: True)."""
    for _ in range(max_calls):
        turn = policy(episode.messages)
        episode.turns += 1
        episode.messages.append(assistant_message(turn))
        episode.final = turn.content
        if not turn.tool_calls:
            return True
        calls = [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]
        results = bridge.ask("execute", calls=calls) if multi else [""] * len(calls)
        for call, result in zip(turn.tool_calls, results, strict=True):
            episode.calls.append(ToolCall(turn=episode.turns - 1, name=call.name, arguments=_arguments(call.arguments),
                                          result=result, error=result.startswith("Error")))
            if multi:
                episode.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not multi:
            return True
    return False


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


_TASKS: dict[str, list[str]] | None = None


def all_tasks() -> dict[str, list[str]]:
    """Task ids by category, in BFCL's file order (from the bridge, once per process)."""
    global _TASKS
    if _TASKS is None:
        with Bridge() as bridge:
            _TASKS = bridge.ask("tasks", categories=list(CATEGORIES))
    return _TASKS


def split_ids(split: str) -> list[str]:
    return [t for category in CATEGORIES for t in all_tasks().get(category, []) if split_of(t) == split]


def known(task_id: str) -> bool:
    return any(task_id in ids for ids in all_tasks().values())
