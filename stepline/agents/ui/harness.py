"""The UI agent: its prompt, its tools over a simulated app and a simulated user, one episode, replay."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from stepline.agents.common import (
    Episode,
    OpenAIPolicy,
    Tool,
    ToolCall,
    ToolError,
    Turn,
    final_turn,
    run_episode,
    said,
    tool_turn,
)
from stepline.agents.ui.apps import APPS
from stepline.agents.ui.screen import App
from stepline.agents.ui.world import DEFAULT_REPLY, Task, task_by_id

NAME = "ui"
MAX_TURNS = 4  # up to 3 actions + "Done."
SYSTEM = "You use a phone app. Do the user's task with the tools. If a detail is missing, ask the user. Then reply Done."
ACTIONS = ("tap", "type", "scroll", "back", "ask_user")
NODE_LINE = re.compile(r"^\[(\d+)\] \w+ (.+?)(?:: .*)?$")


def make_app(task: Task) -> App:
    return APPS[task.app](task.data)


def make_tools(app: App, task: Task) -> list[Tool]:
    def ask_user(question: str) -> str:
        return task.user_reply or DEFAULT_REPLY

    return [
        Tool("tap", "Tap an element by id.", {"id": "integer"}, app.tap),
        Tool("type", "Type text into a field.", {"id": "integer", "text": "string"}, app.type),
        Tool("scroll", "Scroll the list up or down.", {"direction": "string"}, app.scroll),
        Tool("back", "Go back.", {}, app.back),
        Tool("ask_user", "Ask the user a question.", {"question": "string"}, ask_user),
    ]


def replay(task: Task, calls: Iterable[ToolCall]) -> App:
    """A fresh app with the recorded actions applied in order (invalid ones change nothing)."""
    return replay_with_progress(task, calls)[0]


def replay_with_progress(task: Task, calls: Iterable[ToolCall]) -> tuple[App, list[int]]:
    """`replay`, and the turn at which each of the task's plan goals was reached, in the plan's order (as many
    turns as goals reached).

    A goal is reached by the action it names on the element it names (the label as shown on the screen
    the action was taken on; "{reply}" is the simulated user's answer); scrolls, backs and other actions
    neither reach nor undo one."""
    app = make_app(task)
    goals = [tuple(part.replace("{reply}", task.user_reply or "") for part in goal) for goal in task.plan]
    turns: list[int] = []
    for call, valid in stepped(app, task, calls):
        if valid and len(turns) < len(goals) and _reaches(app, call, goals[len(turns)]):
            turns.append(call.turn)
    return app, turns


def stepped(app: App, task: Task, calls: Iterable[ToolCall]) -> Iterator[tuple[ToolCall, bool]]:
    """Each recorded action with whether the tools take its arguments, `app` as it stood when the action was
    taken (the actions before it applied); the action is applied when the caller asks for the next one."""
    tools = {tool.name: tool for tool in make_tools(app, task)}
    for call in calls:
        tool = tools.get(call.name)
        fn = tool.fn if tool is not None and set(call.arguments) == set(tool.parameters) else None
        yield call, fn is not None
        if fn is not None:
            try:
                fn(**call.arguments)
            except ToolError:
                pass


def _reaches(app: App, call: ToolCall, goal: tuple[str, ...]) -> bool:
    action, *args = goal
    if action == "ask":
        return call.name == "ask_user"
    if call.name != action:
        return False
    try:
        node_id = int(call.arguments["id"])  # as the app reads it
    except (KeyError, TypeError, ValueError):
        return False
    label = find_label(app.render(), node_id)
    return label == args[0] and (action == "tap" or str(call.arguments.get("text")) == args[1])


def shown(screen: str) -> Iterator[tuple[int, str]]:
    """(id, label) of each element on the screen, top to bottom."""
    for match in map(NODE_LINE.match, screen.splitlines()):
        if match:
            yield int(match.group(1)), match.group(2)


def find_label(screen: str, node_id: int) -> str | None:
    """The label of the element shown with this id on the screen (None when no such element is shown)."""
    return next((label for i, label in shown(screen) if i == node_id), None)


def find_id(screen: str, label: str) -> int | None:
    return next((i for i, shown_label in shown(screen) if shown_label == label), None)


def read_down_to(screen: str, node_id: int) -> list[str]:
    """The screen's lines below its title, from the top down to the element with this id."""
    lines = screen.splitlines()[1:]
    end = next(k for k, line in enumerate(lines) if (m := NODE_LINE.match(line)) and int(m.group(1)) == node_id)
    return lines[: end + 1]


class ExpertPolicy:
    """Follows the task's plan by reading the rendered screens; scrolls down to reach hidden items. Each action
    comes after the screen's lines copied from the top down to its element, then a sentence that names the element
    ("[1] button Display\n[2] button Sound\nTap Sound."): the id a model must write is then the last one it copied,
    where the screen shows each id before its label (copied forwards, not looked up backwards from the label)."""

    def __init__(self, task: Task, first_screen: str):
        self.goals = list(task.plan)
        self.screen, self.reply = first_screen, ""  # the last screen seen; the user's last answer
        self.turn, self.asked = 0, False

    def __call__(self, messages: list[dict[str, Any]]) -> Turn:
        if messages[-1]["role"] == "tool":  # ask_user answers with the user's words, every other tool with a screen
            if self.asked:
                self.reply = messages[-1]["content"]
            else:
                self.screen = messages[-1]["content"]
        turn, self.asked = self.turn, False
        self.turn += 1
        if not self.goals:
            return final_turn("Done.")
        action, *args = self.goals[0]
        if action == "ask":
            self.goals.pop(0)
            self.asked = True
            return tool_turn("ask_user", turn, question=args[0])
        label = args[0].replace("{reply}", self.reply)
        node_id = find_id(self.screen, label)
        if node_id is None:
            if "(more below)" not in self.screen:
                return final_turn("I could not do it.")
            return said(f"{label} is not shown: scroll down.", tool_turn("scroll", turn, direction="down"))
        self.goals.pop(0)
        read = "\n".join(read_down_to(self.screen, node_id))
        if action == "tap":
            return said(f"{read}\nTap {label}.", tool_turn("tap", turn, id=node_id))
        text = args[1].replace("{reply}", self.reply)
        return said(f"{read}\nType {text} into {label}.", tool_turn("type", turn, id=node_id, text=text))


def first_message(instruction: str, screen: str) -> str:
    """The user's message that opens an episode: the instruction, then the app's first screen."""
    return f"{instruction}\n\n{screen}"


def play(task_id: str, max_turns: int, max_tokens: int = 128, expert: bool = False) -> Episode:
    task = task_by_id()[task_id]
    app = make_app(task)
    tools = make_tools(app, task)
    screen = app.render()
    policy: ExpertPolicy | OpenAIPolicy = ExpertPolicy(task, screen) if expert else OpenAIPolicy(tools, max_tokens=max_tokens)
    model = policy.model if isinstance(policy, OpenAIPolicy) else ""
    episode = Episode(harness=NAME, task_id=task_id, expert=expert, model=model)
    run_episode(policy, episode, system=SYSTEM, user=first_message(task.instruction, screen), tools=tools,
                max_turns=max_turns)
    episode.state = {"app": task.app, "data": app.data, "screen": app.render()}
    return episode


def known(task_id: str) -> bool:
    return task_id in task_by_id()
