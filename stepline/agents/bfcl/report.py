"""python -m stepline.agents.bfcl.report RUN_DIR/eval/before.json [RUN_DIR/eval/after.json ...]

Success of the bfcl harness's episodes of each evaluation report, per BFCL category, under the leaderboard's
column names, with 95% Wilson intervals: a markdown table, one column per report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from stepline.agents.bfcl.categories import METRICS, category_of
from stepline.agents.bfcl.harness import NAME


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a rate (E. B. Wilson, 1927): inside [0, 1] even at 0 or n successes."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def per_category(report: dict) -> dict[str, tuple[int, int]]:
    """category -> (successes, episodes) of the report's bfcl episodes."""
    out: dict[str, tuple[int, int]] = {}
    for episode in report.get("episodes", []):
        if episode.get("harness") == NAME:
            s, n = out.get(category_of(episode["task_id"]), (0, 0))
            out[category_of(episode["task_id"])] = (s + bool(episode.get("success")), n + 1)
    return out


def table(reports: dict[str, dict]) -> str:
    counts = {name: per_category(r) for name, r in reports.items()}
    lines = ["| BFCL metric | category | " + " | ".join(reports) + " |", "|---|---|" + "---|" * len(reports)]
    for category, metric in METRICS.items():
        cells = []
        for name in reports:
            s, n = counts[name].get(category, (0, 0))
            low, high = wilson(s, n)
            cells.append(f"{s / n:.3f} [{low:.2f}, {high:.2f}] (n={n})" if n else "–")
        lines.append(f"| {metric} | {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command()
@click.argument("reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(reports: tuple[Path, ...]) -> None:
    click.echo(table({path.stem: json.loads(path.read_text()) for path in reports}))


if __name__ == "__main__":
    main()
