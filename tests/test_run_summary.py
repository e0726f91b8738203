"""What `stepline run` writes at its end: the files it lists exist, and the live panel warns of skipped groups."""

from __future__ import annotations

from pathlib import Path

from stepline.launch.job import load_job
from stepline.launch.phases import RunDir, run_files, save_cut_calls, time_bound
from stepline.launch.progress import skip_warning
from stepline.report import summarise


def test_the_files_listed_are_those_that_exist(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for folder in (run.logs, run.rl / "checkpoints"):
        folder.mkdir(parents=True)
    for path in (run.root / "job.json", run.rl / "metrics.jsonl", run.pool_db, run.root / "progress.png"):
        path.write_text("")
    files = run_files(run, run.root / "progress.png")
    # no SFT ran, no update pushed weights, tensorboard off: model-sft/, rl/weights/ and rl/tb/ are not listed
    assert sorted(files) == ["checkpoints", "config", "logs", "metrics_jsonl", "plot", "pool"]
    assert all(Path(p).exists() for p in files.values())


def test_the_summary_counts_the_calls_weight_updates_cut(tmp_path: Path) -> None:
    """Each gateway's /metrics counts (as tests/gateway/test_partial_rollouts.py reads them), added up over the
    gateways and over the starts of a stopped and resumed job."""
    run = RunDir(tmp_path)
    assert summarise(run.root)["calls_cut_by_updates"] is None  # a run that saved no count
    metrics = ('# TYPE stepline_gateway_cut_calls counter\n'
               'stepline_gateway_cut_calls_total{answer="resumed"} 3.0\n'
               'stepline_gateway_cut_calls_created{answer="resumed"} 1.7e+09\n'
               'stepline_gateway_cut_calls_total{answer="truncated"} 0.0\n')
    save_cut_calls(run, [metrics, metrics.replace("3.0", "1.0")])  # two gateways
    save_cut_calls(run, [metrics.replace('truncated"} 0.0', 'truncated"} 2.0')])  # the job started again
    assert summarise(run.root)["calls_cut_by_updates"] == {"resumed": 7, "truncated": 2}


def test_the_time_bound_as_the_job_file_writes_it(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("job_minutes = 28\n")
    assert time_bound(load_job(job)) == "job_minutes = 28"
    job.write_text("rl_updates = 3\n")
    assert time_bound(load_job(job)) is None


def _rows(groups: list[list[float]]) -> list[dict]:
    return [{"harness": "h", "task_id": f"t{g}", "reward": r, "batch": 1} for g, rs in enumerate(groups) for r in rs]


def test_the_panel_warns_while_every_group_is_skipped_and_when_the_phase_ends_short() -> None:
    flat = _rows([[0.0, 0.0], [0.0, 0.0]])
    assert "no update yet: all 2 groups drawn had no reward variance" in (skip_warning(0, 4, flat, False) or "")
    assert skip_warning(0, 4, _rows([[0.0, 1.0]]), False) is None  # a group with signal: the update is coming
    assert skip_warning(1, 4, flat, False) is None
    assert "RL made 1 of the 4 updates asked" in (skip_warning(1, 4, flat, True) or "")
    assert skip_warning(4, 4, flat, True) is None
