"""The run report: 95% intervals, the training-reward quarters, and the plot from a run directory."""

import json

import pytest

from stepline.report import (
    batch_rewards,
    flat_groups,
    format_summary,
    plot_run,
    push_stats,
    reward_quarters,
    summarise,
    wilson,
)


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


def _rollouts(rewards_per_group: list[list[float]]) -> list[dict]:
    """One rollout batch; group g holds the episodes of task t-g with the given rewards."""
    return [{"harness": "adder", "task_id": f"t-{g}", "reward": r, "batch": 1, "status": "completed"}
            for g, rewards in enumerate(rewards_per_group) for r in rewards]


def test_flat_groups_are_those_whose_episodes_all_scored_alike():
    rows = _rollouts([[0.0, 0.0], [1.0, 1.0], [0.0, 0.5]])
    rows.append({"harness": "adder", "task_id": "t-0", "reward": 1.0, "batch": 2, "status": "completed"})
    # batch 1: t-0 flat (0, 0), t-1 flat (1, 1), t-2 varies; batch 2: t-0 alone, one reward: flat
    assert flat_groups(rows) == (3, 4)


def test_a_run_that_made_no_update_says_so(tmp_path):
    """Every group flat, no SFT: the summary says 'base', not 'SFT', and warns at both ends of its text."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "rl").mkdir()
    (tmp_path / "eval" / "before.json").write_text(json.dumps(_eval({"adder": 0.0}, 8, 0)))
    (tmp_path / "eval" / "after-0.json").write_text(json.dumps(_eval({"adder": 0.0}, 8, 0)))
    (tmp_path / "rl" / "rollouts.json").write_text(json.dumps(_rollouts([[0.0] * 4] * 6)))
    summary = summarise(tmp_path, asked_updates=4)
    assert summary["policy_before_rl"] == "base"
    assert (summary["rl_updates"], summary["rl_updates_asked"]) == (0, 4)
    assert len(summary["warnings"]) == 1 and summary["warnings"][0].startswith("RL made 0 of the 4 updates asked: "
                                                                                "6 of 6 groups drawn had no reward")
    text = format_summary(summary)
    assert text.count("WARNING: RL made 0 of the 4 updates asked") == 2
    assert "base model (no SFT) vs RL (0 of 4 updates" in text
    assert text.splitlines()[text.splitlines().index("Test success, base model (no SFT) vs RL (0 of 4 updates, "
                                                     "24 RL episodes, policy version 0):") + 1].split()[2] == "base"


def test_a_run_cut_short_by_its_time_bound_names_it(tmp_path):
    (tmp_path / "rl").mkdir()
    (tmp_path / "model-sft").mkdir()
    (tmp_path / "model-sft" / "config.json").write_text("{}")
    (tmp_path / "rl" / "metrics.jsonl").write_text("\n".join(json.dumps({"update": u}) for u in (1, 2)))
    (tmp_path / "rl" / "rollouts.json").write_text(json.dumps(_rollouts([[0.0, 1.0], [1.0, 1.0]])))
    summary = summarise(tmp_path, asked_updates=40, time_bound="job_minutes = 28")
    assert summary["policy_before_rl"] == "SFT"
    assert summary["warnings"] == ["RL made 2 of the 40 updates asked: 1 of 2 groups drawn had no reward variance "
                                   "(every episode scored alike) and were skipped; the time bound (job_minutes = 28) "
                                   "ended the phase."]
    # all the updates asked: nothing to warn about
    assert summarise(tmp_path, asked_updates=2)["warnings"] == []


def test_push_stats_from_the_trainer_metrics():
    # the first push in full (6 MiB), then deltas of 1 and 2 MiB: median of (6, 1, 2) MiB = 2, of (3, 1, 0.5) s = 1
    rows = [{"update": 1, "push_bytes": 6 * 2**20, "push_seconds": 3.0, "push_full": 1.0},
            {"update": 2, "push_bytes": 2**20, "push_seconds": 1.0, "push_full": 0.0},
            {"update": 3, "push_bytes": 2 * 2**20, "push_seconds": 0.5, "push_full": 0.0}, {"update": 4}]
    assert push_stats(rows) == {"pushes": 3, "full": 1, "mib_median": 2.0, "seconds_median": 1.0}
    assert push_stats([{"update": 1}]) is None
