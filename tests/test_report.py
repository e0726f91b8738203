"""The run report: 95% intervals, the training-reward quarters, and the plot from a run directory."""

import json

import pytest

from stepline.report import batch_rewards, format_summary, plot_run, reward_quarters, summarise, wilson


def test_wilson_interval_by_hand():
    # 25 of 50: p = .5, z^2 = 3.8416; centre = (.5 + 3.8416/100) / (1 + 3.8416/50) = .5;
    # half = 1.96 / 1.076832 * sqrt(.25/50 + 3.8416/10000) = 1.82016 * 0.0733769 = 0.133557
    assert wilson(25, 50) == pytest.approx((0.366443, 0.633557), abs=1e-6)
    # 0 of 50 is not "exactly 0": the upper bound is 3.8416/50 / (1 + 3.8416/50) = 0.071350
    assert wilson(0, 50) == pytest.approx((0.0, 0.071350), abs=1e-6)
    assert wilson(0, 0) == (0.0, 1.0)


def test_reward_quarters():
    series = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    # 8 batches -> quarters of 2: (0.1 + 0.2) / 2 and (0.7 + 0.8) / 2
    assert reward_quarters(series) == pytest.approx({"first": 0.15, "last": 0.75, "points_per_quarter": 2})
    assert reward_quarters(series[:1]) is None


def test_batch_rewards_count_every_episode():
    rows = [{"harness": "search", "reward": 1.0, "batch": 1}, {"harness": "search", "reward": 0.0, "batch": 1},
            {"harness": "ui", "reward": 1.0, "batch": 1}, {"harness": "ui", "reward": None, "batch": 2}]
    # batch 1: (1 + 0 + 1) / 3; batch 2: a failed episode without a reward counts as 0
    assert batch_rewards(rows) == pytest.approx([2 / 3, 0.0])
    assert batch_rewards(rows, "search") == pytest.approx([0.5])


def _eval(rates: dict[str, float], n: int, version: int) -> dict:
    return {"weight_version": version,
            "harnesses": {h: {"episodes": n, "success_rate": r, "mean_reward": r} for h, r in rates.items()}}


def test_summary_and_plot_from_a_run_directory(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "rl").mkdir()
    (tmp_path / "eval" / "before.json").write_text(json.dumps(_eval({"search": 0.2, "ui": 0.4}, 50, 0)))
    (tmp_path / "eval" / "after-4.json").write_text(json.dumps(_eval({"search": 0.5, "ui": 0.6}, 50, 4)))
    (tmp_path / "eval" / "after-2.json").write_text(json.dumps(_eval({"search": 0.9, "ui": 0.9}, 50, 2)))
    metrics = [{"update": u, "reward_mean": 0.5} for u in range(1, 5)]
    (tmp_path / "rl" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics))
    rollouts = [{"harness": h, "reward": 0.1 * b, "batch": b, "t": 10.0 * b, "status": "completed"}
                for b in range(1, 5) for h in ("search", "ui")]
    (tmp_path / "rl" / "rollouts.json").write_text(json.dumps(rollouts))
    summary = summarise(tmp_path)  # after RL = the evaluation after the most updates
    assert summary["mean_sft"] == pytest.approx(0.3) and summary["mean_rl"] == pytest.approx(0.55)
    assert summary["improvement"] == pytest.approx(0.25)
    assert summary["test_tasks"] == {"search": 50, "ui": 50}
    # mean of two rates, each n = 50: var = (.5 * .5 / 50 + .6 * .4 / 50) / 4 = 0.00245; half = 1.96 * 0.049497
    assert summary["mean_ci95_rl"] == pytest.approx((0.55 - 0.097015, 0.55 + 0.097015), abs=1e-5)
    assert summary["train_reward_quarters"] == pytest.approx({"first": 0.1, "last": 0.4, "points_per_quarter": 1})
    assert summary["rl_updates"] == 4 and summary["rl_episodes"] == 8
    text = format_summary(summary)
    assert "search" in text and "+0.250" in text
    out = plot_run(tmp_path, tmp_path / "progress.png")
    assert out.stat().st_size > 10_000  # a drawn figure, not an empty canvas


def test_resumed_run_keeps_earlier_episodes(tmp_path):
    from stepline.launch.phases import save_rollouts

    path = tmp_path / "rollouts.json"
    save_rollouts(path, [{"harness": "ui", "reward": 1.0, "batch": 0}, {"harness": "ui", "reward": 0.0, "batch": 1}])
    save_rollouts(path, [{"harness": "ui", "reward": 0.5, "batch": 0}])  # the resumed run counts from 0 again
    assert [r["batch"] for r in json.loads(path.read_text())] == [0, 1, 2]
    assert batch_rewards(json.loads(path.read_text())) == pytest.approx([1.0, 0.0, 0.5])
