"""The run view's series (pure): the trainer's metrics by update, and the pool's episodes by update window.

Charts are columns, as uPlot takes them: {"x": [...], "series": [{"label", "values": [...]}, ...]} with
`None` where a point is missing. Two sources:

- the trainer's `metrics.jsonl`, one line per update (loss, KL, entropy, clip fraction, staleness,
  trainer tokens/s, the reward of the groups it trained on);
- the pool's sessions, bucketed by the update during which they ended: window k holds the episodes
  that ended after update k-1 was logged and up to update k; episodes after the last update make up
  window last+1 (the batch being rolled out now). Per window: mean training reward and success rate
  per harness (success: the driver's verdict where rollouts.json has it, else reward >= 1), episodes/s,
  sampled tokens/s of the engine (eval sessions included: the engine served them), and the highest
  weight version that sampled a token. Without metrics (a bare pool), windows are equal slices of time.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from stepline.dashboard.sessions import SessionRow

__all__ = ["TRAINER_CHARTS", "pool_charts", "run_view", "trainer_charts", "windows"]

Chart = dict[str, Any]

# chart name -> (title, [(series label, metrics.jsonl key)])
TRAINER_CHARTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "loss": ("loss", [("policy loss", "policy_loss"), ("value loss", "value_loss")]),
    "kl": ("KL", [("to behaviour (approx.)", "approx_kl_behaviour_mean"), ("to reference", "kl_ref_mean")]),
    "entropy": ("entropy (nats/token)", [("mean", "entropy_mean")]),
    "clip": ("clip fraction", [("clipped", "clip_frac_mean"), ("dual-clipped", "dual_clip_frac_mean")]),
    "staleness": ("staleness (versions)", [("mean", "staleness_mean"), ("max", "staleness_max")]),
    "trainer_tps": ("trainer tokens/s", [("tokens/s", "tokens_per_s")]),
}
DEFAULT_WINDOWS = 30


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def trainer_charts(metrics: list[dict[str, Any]]) -> dict[str, Chart]:
    """The trainer's charts by update; a series the job never logged (no critic, no reference) is left out."""
    x = [row.get("update") for row in metrics]
    charts: dict[str, Chart] = {}
    for name, (title, series) in TRAINER_CHARTS.items():
        columns = [{"label": label, "values": [_finite(row.get(key)) for row in metrics]} for label, key in series]
        columns = [c for c in columns if any(v is not None for v in c["values"])]
        if columns:
            charts[name] = {"title": title, "x_label": "update", "x": x, "series": columns}
    harnesses = sorted({k.split("/", 1)[1] for row in metrics for k in row if k.startswith("reward/")})
    if harnesses:
        charts["trained_reward"] = {
            "title": "reward of the groups trained on", "x_label": "update", "x": x,
            "series": [{"label": h, "values": [_finite(row.get(f"reward/{h}")) for row in metrics]} for h in harnesses],
        }
    return charts


def windows(metrics: list[dict[str, Any]], rows: tuple[SessionRow, ...]) -> tuple[list[float], str]:
    """Right edges of the windows (unix seconds, increasing) and what a window is called."""
    times = [t for t in (_finite(m.get("time")) for m in metrics) if t is not None]
    if times:
        return sorted(times), "update"
    ends = [r.ended_at for r in rows if r.ended_at is not None]
    if not ends:
        return [], "window"
    start = min(r.created_at for r in rows)
    width = max(max(ends) - start, 1e-9) / DEFAULT_WINDOWS
    return [start + width * (k + 1) for k in range(DEFAULT_WINDOWS)], "window"


def _bucket(edges: list[float], t: float) -> int:
    """Window of an episode that ended at t: 1-based, len(edges)+1 past the last edge."""
    return bisect.bisect_left(edges, t) + 1


def _success(row: SessionRow) -> float | None:
    if row.success is not None:
        return float(row.success)
    return None if row.reward is None else float(row.reward >= 1.0)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pool_charts(rows: tuple[SessionRow, ...], edges: list[float], x_label: str) -> dict[str, Chart]:
    """The pool's charts by window (see the module docstring)."""
    ended = [r for r in rows if r.ended_at is not None]
    if not ended:
        return {}
    buckets: dict[int, list[SessionRow]] = {}
    for r in ended:
        buckets.setdefault(_bucket(edges, r.ended_at or 0.0), []).append(r)
    x = sorted(buckets)
    start = min(r.created_at for r in rows)
    left = {k: edges[k - 2] if k >= 2 else start for k in x}
    right = {k: edges[k - 1] if k <= len(edges) else max(r.ended_at or 0.0 for r in buckets[k]) for k in x}
    span = {k: max(right[k] - left[k], 1e-9) for k in x}
    train = {k: [r for r in buckets[k] if r.split == "train"] for k in x}
    harnesses = sorted({r.harness for rs in train.values() for r in rs})

    def per_harness(value: Any) -> list[dict[str, Any]]:
        return [{"label": h, "values": [_mean([v for r in train[k] if r.harness == h and (v := value(r)) is not None])
                                        for k in x]} for h in harnesses]

    def chart(title: str, series: list[dict[str, Any]]) -> Chart:
        return {"title": title, "x_label": x_label, "x": x, "series": series}

    versions = [max((r.max_version for r in buckets[k] if r.max_version is not None), default=None) for k in x]
    return {
        "reward": chart("training reward per harness (all episodes)", per_harness(lambda r: r.reward)),
        "success": chart("training success per harness", per_harness(_success)),
        "episodes_per_s": chart("episodes/s", [{"label": "train", "values": [len(train[k]) / span[k] for k in x]}]),
        "engine_tps": chart("engine sampled tokens/s", [
            {"label": "tokens/s", "values": [sum(r.action_tokens for r in buckets[k]) / span[k] for k in x]}]),
        "version": chart("weight version", [{"label": "highest sampled", "values": versions}]),
    }


def run_view(metrics: list[dict[str, Any]], rows: tuple[SessionRow, ...],
             evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the run view draws: charts, evaluations (with Wilson intervals) and the latest update."""
    edges, x_label = windows(metrics, rows)
    latest = metrics[-1] if metrics else None
    return {"trainer": trainer_charts(metrics), "pool": pool_charts(rows, edges, x_label), "evaluations": evaluations,
            "latest_update": {k: v for k, v in latest.items() if isinstance(v, int | float | None)} if latest else None,
            "updates": len(metrics)}
