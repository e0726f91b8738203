"""How a run's UI test episodes open (an analysis of finished runs, not a test): does the policy read the id it taps?

    .venv/bin/python benchmarks/ui_first_taps.py ../runs/quickstart [more run dirs]

For the first call of every UI test episode in RUN/eval/before.json and the last RUN/eval/after-N.json, read from the
run's pool: a named tap ("Tap Sound." then {"id": n}, after any screen lines the policy read down to it) whose id is
the named element's on the task's first screen, one whose id is another element's, a named label that is not on the
screen, an `ask_user` call (and on how many tasks that need no question), or anything else. Guessing among three
sections matches 1 in 3.

Then the toggle tasks' path ("Turn on Vibrate.": tap the section that holds the switch, then the switch): the
section named in the first call right or wrong, and on the right section's screen the second call's named switch:
the right one, one the policy stopped reading at before it (above), one it read past it to (below), or no named tap.
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

# "Tap Sound." then the call, after any screen lines read down to the element ("[2] button Sound", "(more below)")
NAMED_TAP = re.compile(r"^(?:(?:\[\d+\] .*|\(more (?:above|below)\))\n)*"
                       r"Tap (.+?)\.?\n<tool_call>\s*\{\"name\": \"tap\", \"arguments\": \{\"id\": (\d+)\}")


def first_call_kind(task_id: str, text: str) -> str:
    task = task_by_id()[task_id]
    if '"ask_user"' in text.split("</tool_call>")[0]:
        return "ask_user (task asks)" if task.kind == "ask" else "ask_user (no question needed)"
    match = NAMED_TAP.match(text)
    if match is None:
        return "other"
    shown = find_id(make_app(task).render(), match.group(1))
    if shown is None:
        return "named label not on the screen"
    return "id of the named element" if shown == int(match.group(2)) else "id of another element"


def toggle_path(task_id: str, texts: list[str]) -> str:
    """Where a toggle task's episode went: section right or wrong, then which switch it named on that screen."""
    section, switch = (goal[1] for goal in task_by_id()[task_id].plan)
    taps = [match.group(1) if (match := NAMED_TAP.match(text)) else None for text in texts[:2]]
    if taps[0] != section:
        return "wrong section" if taps[0] else "no named section tap"
    named = taps[1] if len(taps) > 1 else None
    if named is None:
        return "right section, no named switch tap"
    if named == switch:
        return "right section, right switch"
    order = SECTIONS[section]
    if named not in order:
        return "right section, a label not on the screen"
    return f"right section, switch {'above' if order.index(named) < order.index(switch) else 'below'} it"


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(runs: tuple[Path, ...]) -> None:
    for run in runs:
        tokenizer = Tokenizer.from_file(str(run / "model-sft" / "tokenizer.json"))
        pool = open_pool(f"sqlite:///{run / 'pool.db'}")
        afters = sorted(run.glob("eval/after-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        for path in [run / "eval" / "before.json", *afters[-1:]]:
            kinds: Counter[str] = Counter()
            toggles: Counter[str] = Counter()
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
                if task_by_id()[episode["task_id"]].kind == "toggle":
                    toggles[toggle_path(episode["task_id"], texts)] += 1
            print(f"{run.name} {path.stem}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
            print(f"{run.name} {path.stem} toggles: " + ", ".join(f"{k} {n}" for k, n in sorted(toggles.items())))
        pool.close()


if __name__ == "__main__":
    main()
