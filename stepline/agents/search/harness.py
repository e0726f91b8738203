"""The search agent: its prompt, its tools and one episode (model or scripted expert)."""

from __future__ import annotations

import re
from typing import Any

from stepline.agents.common import Episode, OpenAIPolicy, Tool, Turn, final_turn, run_episode, tool_turn
from stepline.agents.search.index import index
from stepline.agents.search.world import Task, task_by_id

NAME = "search"
MAX_TURNS = 4  # search, search, answer (+1 spare)
SYSTEM = "Answer the question. Call search with a name to look it up. Call answer with only the answer."
NO_RESULTS = "No results."


def search(query: str) -> str:
    return "\n".join(index().search(str(query))) or NO_RESULTS


def answer(text: str) -> str:
    return "Answer recorded."


TOOLS = [
    Tool("search", "Search the documents for a name.", {"query": "string"}, search),
    Tool("answer", "Give the final answer.", {"text": "string"}, answer),
]

# what the answer looks like in the maker's passage, per relation
ANSWER_PATTERNS = {"born": r"born in (\w+)", "lives": r"lives in (\w+)", "spouse": r"married to (\w+)"}


def _find(result: str, title: str, pattern: str) -> str | None:
    """The group of `pattern` in the passage titled `title`, if that passage was returned."""
    for line in result.splitlines():
        if line.startswith(f"{title}:") and (match := re.search(pattern, line)):
            return match.group(1)
    return None


def expert_policy(task: Task):
    """A scripted solver that reads the tool results like an agent would (so it checks the tasks are solvable)."""

    def policy(messages: list[dict[str, Any]]) -> Turn:
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if not results:
            return tool_turn("search", 0, query=task.work)
        maker = _find(results[0], task.work, r"by (\w+)\.")
        if maker is None:
            return final_turn("I could not find it.")
        if len(results) == 1:
            return tool_turn("search", 1, query=maker)
        found = _find(results[1], maker, ANSWER_PATTERNS[task.relation])
        return tool_turn("answer", 2, text=found) if found else final_turn("I could not find it.")

    return policy


def play(task_id: str, max_turns: int, max_tokens: int = 128, expert: bool = False) -> Episode:
    task = task_by_id()[task_id]
    policy = expert_policy(task) if expert else OpenAIPolicy(TOOLS, max_tokens=max_tokens)
    episode = Episode(harness=NAME, task_id=task_id, expert=expert, model="" if expert else policy.model)
    return run_episode(policy, episode, system=SYSTEM, user=task.question, tools=TOOLS, max_turns=max_turns,
                       stop_tools=frozenset({"answer"}))


def known(task_id: str) -> bool:
    return task_id in task_by_id()
