"""python -m stepline.agents.ui.verify --task ID --out DIR  ->  {"reward": 0..1, "success", "reason"}.

The app's final state is rebuilt by replaying the episode's recorded actions on a fresh app (the
harness's own record of the state must agree with it), then compared with the task's goal state.
Success (the goal state reached) scores 1; short of it, an episode earns partial credit for the plan
steps it did reach in order (PARTIAL per the whole plan: tapping the right section of two steps scores
0.25), so a group in which nobody finishes still tells the better attempts from the worse.

Training takes the score only from an episode whose reading agrees with its actions (`train_reward`): every tap
or type follows lines of the screen it was taken on and a sentence naming the element it acts on ("[2] button
Sound", "Tap Sound."), as the expert's do. An id that lands on the goal after a reading of other lines, or of
another element, is a guess: reinforced, it teaches guessing ids and unlearns the reading that finds them.

Training also gets the partial credit where it was earned (`step_rewards`): PARTIAL per the whole plan at the turn
that reached each plan step, so a step-level advantage (the trainer's `dense`) credits the tap that opened the right
section, not the wrong switch tapped after it. An episode that misread gets none.

A failed episode that changed the app as one task would, asking nothing and reading as it acted, also gets the
first user message of that task (`hindsight`, stepline/agents/ui/hindsight.py): what it did, as a demonstration.
"""

from collections import Counter
from typing import Any

from stepline.agents.common import Episode, Verdict, failed, verify_command
from stepline.agents.ui.harness import NAME, find_label, first_message, known, make_app, replay_with_progress, stepped
from stepline.agents.ui.hindsight import achieved
from stepline.agents.ui.world import Task, task_by_id

PARTIAL = 0.5  # the reward of reaching every plan step but not the goal state (a later step undid it)


def score(task_id: str, episode: Episode) -> Verdict:
    task = task_by_id()[task_id]
    app, turns = replay_with_progress(task, episode.calls)
    data = app.data
    if episode.state is not None and episode.state.get("data") != data:
        return failed("the recorded app state differs from the replayed actions")
    if data != task.target:
        changed = "unchanged" if data == task.data else "changed, but not as asked"
        verdict = Verdict(reward=PARTIAL * len(turns) / len(task.plan), success=False,
                          reason=f"{task.app} state {changed} ({len(turns)} of {len(task.plan)} plan steps)")
    else:
        verdict = Verdict(reward=1.0, success=True, reason=f"{task.app} state matches the goal")
    if verdict.reward > 0 and misread(task, episode):
        return verdict.model_copy(update={"train_reward": 0.0})
    update: dict[str, Any] = {}
    if turns:  # a turn may reach two steps
        update["step_rewards"] = {turn: n * PARTIAL / len(task.plan) for turn, n in Counter(turns).items()}
    if not verdict.success:
        update["hindsight"] = hindsight(task, episode, data)
    return verdict.model_copy(update=update)


def hindsight(task: Task, episode: Episode, data: dict[str, Any]) -> str | None:
    """The first user message under which this failed episode succeeds: the instruction of what it did (an episode
    that changed the app as one task of the world would, asked nothing and read as it acted), else None."""
    if data == task.data or any(call.name == "ask_user" for call in episode.calls):
        return None
    instruction = achieved(task, data)
    if instruction is None or misread(task, episode):
        return None
    return first_message(instruction, make_app(task).render())


def misread(task: Task, episode: Episode) -> str | None:
    """Where a tap or type's reading disagrees with the screen it was taken on or with the element it acts on
    (None where every one agrees)."""
    texts = [message.get("content") or "" for message in episode.messages if message.get("role") == "assistant"]
    app = make_app(task)
    for call, _valid in stepped(app, task, episode.calls):
        if call.name not in ("tap", "type"):
            continue
        screen = app.render()
        lines = [line.strip() for line in (texts[call.turn] if call.turn < len(texts) else "").splitlines()]
        lines = [line for line in lines if line]
        node_id = call.arguments.get("id")
        label = find_label(screen, node_id) if isinstance(node_id, int) else None
        if label is None:
            return f"turn {call.turn} acts on id {node_id!r}, which the screen does not show"
        said = f"Tap {label}." if call.name == "tap" else f"Type {call.arguments.get('text')} into {label}."
        if not lines or lines[-1] != said:
            return f"turn {call.turn} acts on [{node_id}] {label} after {(lines or [''])[-1]!r}"
        shown = {line.strip() for line in screen.splitlines()}
        for line in lines[:-1]:
            if line.startswith("[") and line not in shown:
                return f"turn {call.turn} reads {line!r}, which the screen does not show"
    return None


main = verify_command(NAME, score, known)

if __name__ == "__main__":
    main()
