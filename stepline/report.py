"""The end of a run: the summary (test success before/after per harness) and the progress plot."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

__all__ = ["batch_rewards", "eval_paths", "flat_groups", "format_summary", "plot_run", "reward_quarters", "rl_warnings",
           "summarise", "wilson"]


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a success rate (95% for z = 1.96): it stays inside [0, 1] and is honest
    at 0 or n successes, where the normal approximation collapses to a width of 0."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def _success(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per harness: success rate, episodes and its 95% interval."""
    out = {}
    for name, s in report["harnesses"].items():
        n = int(s["episodes"])
        out[name] = {"rate": float(s["success_rate"]), "n": n, "ci95": wilson(float(s["success_rate"]) * n, n)}
    return out


def eval_paths(root: Path) -> list[Path]:
    """A run's eval reports in order: before, then after-k by k."""
    def order(path: Path) -> int:
        return -1 if path.stem == "before" else int(path.stem.split("-")[-1])

    return sorted((root / "eval").glob("*.json"), key=order)


def _evals(root: Path) -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, json.loads(p.read_text())) for p in eval_paths(root)]


def _mean_success(per_harness: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Mean over harnesses, with the interval of the pooled successes (a harness-weighted mean of rates
    whose n are equal; the pooled interval is the usual normal one on that mean)."""
    if not per_harness:
        return None
    rates = [h["rate"] for h in per_harness.values()]
    mean = sum(rates) / len(rates)
    var = sum(h["rate"] * (1 - h["rate"]) / max(h["n"], 1) for h in per_harness.values()) / len(rates) ** 2
    half = 1.96 * math.sqrt(var)
    return {"rate": mean, "ci95": (max(0.0, mean - half), min(1.0, mean + half))}


def _metrics(root: Path) -> list[dict[str, Any]]:
    path = root / "rl" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def batch_rewards(rollouts: list[dict[str, Any]], harness: str | None = None) -> list[float]:
    """Mean reward of every training episode (trained or skipped for no variance) per rollout batch, in
    order: the policy's own training reward, not only that of the groups the trainer kept."""
    batches: dict[int, list[float]] = {}
    for r in rollouts:
        if harness is None or r["harness"] == harness:
            batches.setdefault(r["batch"] if "batch" in r else r["t"], []).append(r["reward"] or 0.0)
    return [sum(v) / len(v) for _, v in sorted(batches.items())]


def reward_quarters(rewards: list[float]) -> dict[str, float] | None:
    """Mean of the first and of the last quarter of a series (at least one point each)."""
    if len(rewards) < 2:
        return None
    k = max(1, len(rewards) // 4)
    return {"first": sum(rewards[:k]) / k, "last": sum(rewards[-k:]) / k, "points_per_quarter": k}


def flat_groups(rollouts: list[dict[str, Any]]) -> tuple[int, int]:
    """(groups whose episodes all scored alike, groups) among the training episodes: a group is the episodes of
    one task × harness in one rollout batch. Dynamic sampling skips the flat ones (no reward variance)."""
    groups: dict[tuple[Any, ...], set[float]] = {}
    for r in rollouts:
        groups.setdefault((r.get("batch"), r["harness"], r.get("task_id")), set()).add(r["reward"] or 0.0)
    return sum(len(rewards) == 1 for rewards in groups.values()), len(groups)


def rl_warnings(updates: int, asked: int | None, rollouts: list[dict[str, Any]], time_bound: str | None = None) -> list[str]:
    """What a reader of the summary must not miss: an RL phase that made no update, or fewer than asked."""
    if not asked or updates >= asked:
        return []
    flat, total = flat_groups(rollouts)
    why = [f"{flat} of {total} groups drawn had no reward variance (every episode scored alike) and were skipped"
           if total else "no rollout group finished"]
    if time_bound and updates:
        why.append(f"the time bound ({time_bound}) ended the phase")
    if updates == 0:
        return [f"RL made 0 of the {asked} updates asked: {'; '.join(why)}. The policy after RL is the one before it; "
                "a policy that succeeds on some episodes of a task (a warm start, partial credit) gives groups signal."]
    return [f"RL made {updates} of the {asked} updates asked: {'; '.join(why)}."]


def summarise(root: Path, asked_updates: int | None = None, time_bound: str | None = None) -> dict[str, Any]:
    """The run's summary: test success before RL and after its last update (`after-k` with the largest k).

    `policy_before_rl` says what was evaluated before RL ("SFT" where a warm start ran, else "base");
    `warnings` holds what must not be missed (no update made, fewer than `asked_updates`)."""
    evals = _evals(root)
    before = _success(evals[0][1]) if evals and evals[0][0] == "before" else {}
    last = evals[-1][1] if evals and evals[-1][0] != "before" else None
    after = _success(last) if last else {}
    mean_sft, mean_rl = _mean_success(before), _mean_success(after)
    rollouts = json.loads((root / "rl" / "rollouts.json").read_text()) if (root / "rl" / "rollouts.json").is_file() else []
    metrics = _metrics(root)
    rates = lambda d: {h: v["rate"] for h, v in d.items()}  # noqa: E731
    nan = float("nan")
    return {
        "test_success_sft": rates(before), "test_success_rl": rates(after),
        "test_ci95_sft": {h: v["ci95"] for h, v in before.items()},
        "test_ci95_rl": {h: v["ci95"] for h, v in after.items()},
        "test_tasks": {h: v["n"] for h, v in (after or before).items()},
        "mean_sft": mean_sft["rate"] if mean_sft else nan, "mean_rl": mean_rl["rate"] if mean_rl else nan,
        "mean_ci95_sft": mean_sft["ci95"] if mean_sft else None, "mean_ci95_rl": mean_rl["ci95"] if mean_rl else None,
        "improvement": (mean_rl["rate"] - mean_sft["rate"]) if mean_sft and mean_rl else nan,
        "train_reward_quarters": reward_quarters(batch_rewards(rollouts)),
        "policy_before_rl": "SFT" if (root / "model-sft" / "config.json").is_file() else "base",
        "rl_updates": len(metrics), "rl_updates_asked": asked_updates, "rl_episodes": len(rollouts),
        "rl_episodes_failed": sum(r["status"] == "failed" for r in rollouts),
        "weight_version": last.get("weight_version") if last else None,
        "warnings": rl_warnings(len(metrics), asked_updates, rollouts, time_bound),
        "weight_pushes": push_stats(metrics),
        # calls weight updates cut short, by answer: resumed under the new weights | truncated (0 with the
        # gateway's partial_rollouts on); None where the run saved no count
        "calls_cut_by_updates": json.loads(cut.read_text()) if (cut := root / "rl" / "cut_calls.json").is_file() else None,
    }


def push_stats(metrics: list[dict[str, Any]]) -> dict[str, float] | None:
    """The trainer's weight pushes (stepline/trainer/push.py): how many, how many in full, and the median MiB
    written and seconds per push (writing and loading); None when the metrics record no push."""
    pushes = [m for m in metrics if m.get("push_bytes") is not None]
    if not pushes:
        return None
    return {"pushes": len(pushes), "full": sum(bool(m.get("push_full")) for m in pushes),
            "mib_median": statistics.median(m["push_bytes"] for m in pushes) / 2**20,
            "seconds_median": statistics.median(m["push_seconds"] for m in pushes)}


def plot_run(root: Path, out: Path) -> Path:
    """Left: mean training reward per harness of each rollout batch (every episode, kept or skipped);
    right: test success per harness at each evaluation, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rollouts_file = root / "rl" / "rollouts.json"
    rollouts = json.loads(rollouts_file.read_text()) if rollouts_file.is_file() else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for harness in sorted({r["harness"] for r in rollouts}):
        series = batch_rewards(rollouts, harness)
        left.plot(range(1, len(series) + 1), series, marker=".", label=harness)
    left.set(title="training reward per rollout batch (all episodes)", xlabel="rollout batch (an update takes one or more)",
             ylabel="mean reward", ylim=(-0.05, 1.05))
    evals = [(tag, _success(rep)) for tag, rep in _evals(root)]
    names = sorted({h for _, rep in evals for h in rep})
    for i, harness in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * 0.06 for j in range(len(evals))]  # side by side, not on top
        rows = [rep.get(harness, {"rate": float("nan"), "ci95": (float("nan"),) * 2}) for _, rep in evals]
        rates = [r["rate"] for r in rows]
        err = [[r["rate"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["rate"] for r in rows]]
        right.errorbar(xs, rates, yerr=err, marker="o", capsize=3, label=harness)
    right.set_xticks(range(len(evals)), [tag for tag, _ in evals])
    right.set(title="test success (95% interval)", xlabel="evaluation", ylabel="success rate", ylim=(-0.05, 1.05))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The table printed at the end of a run; its warnings first and last, so that neither end misses them."""
    harnesses = sorted(set(summary["test_success_sft"]) | set(summary["test_success_rl"]))
    ci = lambda c: f"[{c[0]:.2f}, {c[1]:.2f}]" if c else ""  # noqa: E731
    start = summary.get("policy_before_rl", "SFT")
    rows = [f"{'harness':<10} {'tasks':>5} {start:>6} {'95% CI':>13} {'RL':>6} {'95% CI':>13} {'delta':>7}"]
    for h in harnesses:
        a, b = summary["test_success_sft"].get(h, float("nan")), summary["test_success_rl"].get(h, float("nan"))
        rows.append(f"{h:<10} {summary['test_tasks'].get(h, 0):>5} {a:>6.3f} {ci(summary['test_ci95_sft'].get(h)):>13} "
                    f"{b:>6.3f} {ci(summary['test_ci95_rl'].get(h)):>13} {b - a:>+7.3f}")
    rows.append(f"{'mean':<10} {'':>5} {summary['mean_sft']:>6.3f} {ci(summary['mean_ci95_sft']):>13} "
                f"{summary['mean_rl']:>6.3f} {ci(summary['mean_ci95_rl']):>13} {summary['improvement']:>+7.3f}")
    quarters = summary.get("train_reward_quarters")
    if quarters:
        rows.append(f"training reward, first vs last quarter of rollout batches ({quarters['points_per_quarter']} each): "
                    f"{quarters['first']:.3f} -> {quarters['last']:.3f}")
    phases = summary.get("phases_s")
    if phases:
        rows.append("phases: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in phases.items()))
    files = "\n".join(f"  {k:<13} {v}" for k, v in summary.get("files", {}).items())
    warnings = "".join(f"\nWARNING: {w}" for w in summary.get("warnings", []))
    asked = summary.get("rl_updates_asked")
    updates = f"{summary['rl_updates']} of {asked}" if asked is not None else f"{summary['rl_updates']}"
    before = "SFT-only" if start == "SFT" else "base model (no SFT)"
    return (f"{warnings}\nTest success, {before} vs RL ({updates} updates, {summary['rl_episodes']} RL episodes,"
            f" policy version {summary['weight_version']}):\n" + "\n".join(rows) + f"\n\nFiles:\n{files}" + warnings)
