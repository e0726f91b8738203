"""The main job, shortened: every part of Stepline takes part in one run (docs/architecture.md §1).

Builds a tiny model, warm-starts it on expert demonstrations, starts the built-in engine and the
gateway as processes, evaluates, runs two RL updates with rollouts of all three harnesses through the
gateway, pushes weights, evaluates again — then checks the run directory and the pool. The run is
tests/e2e/conftest.py's `main_job_run`, made once per test session (the dashboard's browser test reads it too).
"""

from __future__ import annotations

import json
from pathlib import Path

from stepline.datapool import open_pool


def test_every_part_took_part(main_job_run: tuple[Path, dict]) -> None:
    run_dir, summary = main_job_run
    # the trainer ran both updates and pushed weights after each; the engine serves the last version
    assert summary["rl_updates"] == 2
    assert (run_dir / "rl" / "weights" / "v000002").is_dir()  # a delta (stepline.weightdelta) or a full folder
    assert summary["weight_version"] == 2

    pool = open_pool(f"sqlite:///{run_dir / 'pool.db'}", read_only=True)
    try:
        stats = pool.stats()
        sessions = pool.list_sessions()
        # calls recorded and trees built for the training sessions
        trained = [s for s in sessions if s.purpose != "eval"]
        assert stats["calls"] > 0 and trained
        harnesses = {s.harness for s in trained}
        assert harnesses == {"search", "terminal", "ui"} or len(harnesses) >= 2
        tree = pool.get_tree(trained[0].session_id)
        assert any(node.kind == "act" for node in tree.nodes)
        # groups consumed by the trainer: a full batch of two per update
        assert stats["groups_consumed"] >= 2 * 2
        # a reward was posted for every session, and every session ended
        for info in sessions:
            episode = pool.get_episode(info.session_id)
            assert info.status != "open", info.session_id
            assert any(r.step is None for r in episode.rewards), info.session_id
        # evaluation before RL ran on version 0, after RL on the pushed version 2 (stamped at dispatch)
        versions = {n.weight_version for s in sessions if s.purpose == "eval"
                    for n in pool.get_tree(s.session_id).nodes if n.kind == "act"}
        assert versions == {0, 2}
    finally:
        pool.close()


def test_run_directory_has_every_artifact(main_job_run: tuple[Path, dict]) -> None:
    run_dir, summary = main_job_run
    for name in ("job.json", "summary.json", "progress.png", "pool.db", "eval/before.json", "eval/after-2.json",
                 "rl/metrics.jsonl", "rl/rollouts.json"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "rl" / "checkpoints").iterdir())
    metrics = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert set(summary["test_success_sft"]) == {"search", "terminal", "ui"}
