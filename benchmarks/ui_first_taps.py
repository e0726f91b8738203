"""How a run's UI test episodes open (an analysis of finished runs, not a test): does the policy read the id it taps?

    .venv/bin/python benchmarks/ui_first_taps.py ../runs/quickstart [more run dirs]

For the first call of every UI test episode in RUN/eval/before.json and the last RUN/eval/after-N.json, read from the
run's pool: a named tap ("Tap Sound." then {"id": n}, after any screen lines the policy read down to it) whose id is
the named element's on the task's first screen, one whose id is another element's, a named label that is not on the
screen, an `ask_user` call (and on how many tasks that need no question), a call with no screen line or sentence
before it (the form of the search and terminal harnesses' calls), or anything else. Guessing among three
sections matches 1 in 3.

Then the toggle tasks' path ("Turn on Vibrate.": open the section that holds the switch, then tap the switch): each
section the policy opened (the first listed or another; holding the switch or lacking it), and what it did there: back,
the right switch, one above or below it, a switch of a section that lacks it, or anything else.

Then every other task's first named tap (for a task that asks, the tap after the user's answer): the element the
task's plan taps first, an element listed above it (the policy stopped reading too early), one below it (it read past
it), or a label not on the first screen. Where to stop reading is the decision a reading task leaves the policy.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import click
from tokenizers import Tokenizer

from stepline.agents.ui.apps import SECTIONS
from stepline.agents.ui.harness import find_id, make_app
from stepline.agents.ui.world import task_by_id
from stepline.datapool import open_pool
from stepline.datapool.base import UnknownSession
from stepline.report import eval_paths

# "Tap Sound." then the call, after any screen lines read down to the element ("[2] button Sound", "(more below)")
NAMED_TAP = re.compile(r"^(?:(?:\[\d+\] .*|\(more (?:above|below)\))\n)*"
                       r"Tap (.+?)\.?\n<tool_call>\s*\{\"name\": \"tap\", \"arguments\": \{\"id\": (\d+)\}")


def first_call_kind(task_id: str, text: str) -> str:
    task = task_by_id()[task_id]
    if '"ask_user"' in text.split("</tool_call>")[0]:
        return "ask_user (task asks)" if task.kind == "ask" else "ask_user (no question needed)"
    match = NAMED_TAP.match(text)
    if match is None:
        return "a call with nothing read before it" if text.lstrip().startswith("<tool_call>") else "other"
    shown = find_id(make_app(task).render(), match.group(1))
    if shown is None:
        return "named label not on the screen"
    return "id of the named element" if shown == int(match.group(2)) else "id of another element"


BACK = re.compile(r"<tool_call>\s*\{\"name\": \"back\"")


def toggle_path(task_id: str, texts: list[str]) -> str:
    """Where a toggle task's episode went, step by step: each section it opened (the one holding the switch or a
    section that lacks it) and what it did there (back, or a switch tap as `_switch_tap` names it)."""
    task = task_by_id()[task_id]
    section, switch = (goal[1] for goal in task.plan)
    path: list[str] = []
    opened: str | None = None  # the section whose screen is shown; None on the list of sections
    for text in texts:
        match = NAMED_TAP.match(text)
        if opened is None:
            if match is None or match.group(1) not in SECTIONS:
                return " > ".join([*path, "no section tap"])
            opened = match.group(1)
            where = "first section" if opened == task.data["sections"][0] else "another section"
            path.append(f"{where} ({'holds it' if opened == section else 'lacks it'})")
        elif BACK.search(text):
            path.append("back")
            opened = None
        else:
            path.append(_switch_tap(match.group(1) if match else None, switch, SECTIONS[opened]))
            break
    return " > ".join(path)


def _switch_tap(named: str | None, switch: str, shown: tuple[str, ...]) -> str:
    """What a named tap on an open section's screen hit: the switch asked for, one listed above or below it (where
    the policy stopped reading too early or read past it), a switch of a section that lacks it, or no named tap."""
    if named is None:
        return "no tap or back"
    if named == switch:
        return "right switch"
    if named in shown and switch in shown:
        return f"switch {'above' if shown.index(named) < shown.index(switch) else 'below'} it"
    return "another switch"


def target_tap(task_id: str, texts: list[str]) -> str:
    """Whether a task's first named tap names the element its plan taps first (the user's answer, for a task that
    asks), an element above it or one below it on the task's first screen."""
    task = task_by_id()[task_id]
    want = next(goal[1] for goal in task.plan if goal[0] == "tap").replace("{reply}", task.user_reply or "")
    named = next((match.group(1) for text in texts if (match := NAMED_TAP.match(text))), None)
    if named is None:
        return "no named tap"
    if named == want:
        return "the element needed"
    screen = make_app(task).render()
    at, needed = find_id(screen, named), find_id(screen, want)
    if at is None or needed is None:
        return "a label not on the first screen"
    return "an element above it" if at < needed else "an element below it"


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(runs: tuple[Path, ...]) -> None:
    for run in runs:
        tokenizer = Tokenizer.from_file(str(run / "model-sft" / "tokenizer.json"))
        pool = open_pool(f"sqlite:///{run / 'pool.db'}")
        paths = eval_paths(run)
        for path in paths[:1] + paths[1:][-1:]:  # before RL, and after its last update
            kinds: Counter[str] = Counter()
            toggles: Counter[str] = Counter()
            targets: Counter[str] = Counter()
            for episode in json.loads(path.read_text())["episodes"]:
                if episode["harness"] != "ui":
                    continue
                try:
                    calls = pool.get_calls(episode["session_id"])
                except UnknownSession:  # a run resumed in a copy of another's directory lacks that run's pool
                    continue
                if not calls:
                    continue
                texts = [tokenizer.decode(call.output_ids.tolist()) for call in calls]
                kinds[first_call_kind(episode["task_id"], texts[0])] += 1
                kind = task_by_id()[episode["task_id"]].kind
                if kind == "toggle":
                    toggles[toggle_path(episode["task_id"], texts)] += 1
                else:
                    targets[f"{'ask' if kind == 'ask' else 'other'}: {target_tap(episode['task_id'], texts)}"] += 1
            print(f"{run.name} {path.stem}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
            print(f"{run.name} {path.stem} toggles: " + ", ".join(f"{k} {n}" for k, n in sorted(toggles.items())))
            print(f"{run.name} {path.stem} named taps: " + ", ".join(f"{k} {n}" for k, n in sorted(targets.items())))
        pool.close()


if __name__ == "__main__":
    main()
