"""python -m stepline.agents.bfcl.verify --task ID --out DIR  ->  {"reward": 0|1, "success", "reason"}.

The episode's messages become the raw result BFCL's chat.completions handler would have recorded (per
user turn, per assistant message: its tool calls as [{name: arguments JSON}], or its text), and BFCL's own
evaluation of one entry scores it: the AST checker for single-turn tasks, the state-and-response checker
(which re-executes the calls on fresh API instances) for multi-turn ones. Reward 1 when it is valid.
"""

from __future__ import annotations

from typing import Any

from stepline.agents.bfcl.categories import category_of, is_multi_turn
from stepline.agents.bfcl.client import Bridge
from stepline.agents.bfcl.harness import NAME, known
from stepline.agents.common import Episode, Verdict, verify_command


def raw_result(episode: Episode) -> Any:
    """Per user turn, per assistant message: [{name: arguments}] or its text (single-turn: the first message's)."""
    turns: list[list[Any]] = []
    previous = None
    for message in episode.messages:
        if message["role"] == "user" and previous != "user":
            turns.append([])
        elif message["role"] == "assistant" and turns:
            calls = message.get("tool_calls") or []
            step = [{c["function"]["name"]: c["function"]["arguments"]} for c in calls] if calls else message.get("content") or ""
            turns[-1].append(step)
        previous = message["role"]
    if is_multi_turn(episode.task_id):
        return turns
    return turns[0][0] if turns and turns[0] else ""


def score(task_id: str, episode: Episode) -> Verdict:
    with Bridge() as bridge:
        verdict = bridge.ask("check", id=task_id, result=raw_result(episode))
    if verdict["valid"]:
        return Verdict(reward=1.0, success=True, reason=f"BFCL {category_of(task_id)}: valid")
    return Verdict(reward=0.0, success=False, reason=f"BFCL {category_of(task_id)}: {verdict['error_type']}: {verdict['error']}")


main = verify_command(NAME, score, known)

if __name__ == "__main__":
    main()
