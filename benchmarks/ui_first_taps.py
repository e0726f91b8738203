"""How a run's UI test episodes open (an analysis of finished runs, not a test): does the policy read the id it taps?

    .venv/bin/python benchmarks/ui_first_taps.py ../runs/quickstart [more run dirs]

For the first call of every UI test episode in RUN/eval/before.json and the last RUN/eval/after-N.json, read from the
run's pool: a named tap ("Tap Sound." then {"id": n}, after any screen lines the policy read down to it) whose id is
the named element's on the task's first screen, one whose id is another element's, a named label that is not on the
screen, an `ask_user` call (and on how many tasks that need no question), or anything else. Guessing among three
sections matches 1 in 3.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import click
from tokenizers import Tokenizer

from stepline.agents.ui.harness import find_id, make_app
from stepline.agents.ui.world import task_by_id
from stepline.datapool import open_pool

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


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(runs: tuple[Path, ...]) -> None:
    for run in runs:
        tokenizer = Tokenizer.from_file(str(run / "model-sft" / "tokenizer.json"))
        pool = open_pool(f"sqlite:///{run / 'pool.db'}")
        afters = sorted(run.glob("eval/after-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        for path in [run / "eval" / "before.json", *afters[-1:]]:
            kinds: Counter[str] = Counter()
            for episode in json.loads(path.read_text())["episodes"]:
                calls = pool.get_calls(episode["session_id"]) if episode["harness"] == "ui" else []
                if calls:
                    kinds[first_call_kind(episode["task_id"], tokenizer.decode(calls[0].output_ids.tolist()))] += 1
            print(f"{run.name} {path.stem}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        pool.close()


if __name__ == "__main__":
    main()
