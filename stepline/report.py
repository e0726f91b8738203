"""The end of a run: the summary (test success before/after per harness) and the progress plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_summary", "plot_run", "summarise"]


def _success(report: dict[str, Any]) -> dict[str, float]:
    return {name: float(s["success_rate"]) for name, s in report["harnesses"].items()}


def _evals(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """Eval reports in order: before, then after-k by k."""
    def order(path: Path) -> int:
        return -1 if path.stem == "before" else int(path.stem.split("-")[-1])

    return [(p.stem, json.loads(p.read_text())) for p in sorted((root / "eval").glob("*.json"), key=order)]


def summarise(root: Path, rl_updates: int) -> dict[str, Any]:
    evals = dict(_evals(root))
    before = _success(evals["before"]) if "before" in evals else {}
    after = _success(evals[f"after-{rl_updates}"]) if f"after-{rl_updates}" in evals else {}
    mean = lambda d: sum(d.values()) / len(d) if d else float("nan")  # noqa: E731
    rollouts = json.loads((root / "rl" / "rollouts.json").read_text()) if (root / "rl" / "rollouts.json").is_file() else []
    metrics = [json.loads(line) for line in (root / "rl" / "metrics.jsonl").read_text().splitlines()] \
        if (root / "rl" / "metrics.jsonl").is_file() else []
    return {
        "test_success_sft": before, "test_success_rl": after,
        "mean_sft": mean(before), "mean_rl": mean(after), "improvement": mean(after) - mean(before),
        "rl_updates": len(metrics), "rl_episodes": len(rollouts),
        "rl_episodes_failed": sum(r["status"] == "failed" for r in rollouts),
        "weight_version": evals[f"after-{rl_updates}"].get("weight_version") if after else None,
    }


def plot_run(root: Path, out: Path) -> Path:
    """Left: mean training reward per harness of each rollout batch over the RL phase;
    right: test success per harness at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rollouts_file = root / "rl" / "rollouts.json"
    rollouts = json.loads(rollouts_file.read_text()) if rollouts_file.is_file() else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for harness in sorted({r["harness"] for r in rollouts}):
        batches: dict[float, list[float]] = {}  # rows of one rollout batch share its end time t
        for r in rollouts:
            if r["harness"] == harness:
                batches.setdefault(r["t"], []).append(r["reward"] or 0.0)
        times = sorted(batches)
        left.plot([t / 60 for t in times], [sum(batches[t]) / len(batches[t]) for t in times], marker=".",
                  label=harness)
    left.set(title="training reward per rollout batch", xlabel="minutes into RL", ylabel="reward", ylim=(-0.05, 1.05))
    evals = _evals(root)
    names = sorted({h for _, rep in evals for h in rep["harnesses"]})
    for harness in names:
        right.plot([tag for tag, _ in evals], [rep["harnesses"].get(harness, {}).get("success_rate", float("nan"))
                                               for _, rep in evals], marker="o", label=harness)
    right.set(title="test success", xlabel="evaluation", ylabel="success rate", ylim=(-0.05, 1.05))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def format_summary(summary: dict[str, Any]) -> str:
    harnesses = sorted(set(summary["test_success_sft"]) | set(summary["test_success_rl"]))
    rows = [f"{'harness':<12} {'SFT':>6} {'RL':>6} {'delta':>7}"]
    for h in harnesses:
        a, b = summary["test_success_sft"].get(h, float("nan")), summary["test_success_rl"].get(h, float("nan"))
        rows.append(f"{h:<12} {a:>6.3f} {b:>6.3f} {b - a:>+7.3f}")
    rows.append(f"{'mean':<12} {summary['mean_sft']:>6.3f} {summary['mean_rl']:>6.3f} {summary['improvement']:>+7.3f}")
    files = "\n".join(f"  {k:<13} {v}" for k, v in summary.get("files", {}).items())
    return (f"\nTest success, SFT-only vs RL ({summary['rl_updates']} updates, {summary['rl_episodes']} RL episodes,"
            f" policy version {summary['weight_version']}):\n" + "\n".join(rows) + f"\n\nFiles:\n{files}")
