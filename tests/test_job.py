"""One job loader for `stepline run`, `train`, `replay` and `eval`: a bad field fails at load, named the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stepline.cli import main
from stepline.launch.job import JobError, load_job, unused_by_run


def test_a_bad_trainer_field_is_named_at_load(tmp_path: Path) -> None:
    """No model yet (stepline run fills in model_dir later), yet names, types and ranges are checked now."""
    job = tmp_path / "job.toml"
    job.write_text('[trainer]\nlr = 0\nclip_hi = 0.3\ngroups_per_update = "eight"\n[sft.trainer]\nepochs = 0\n')
    with pytest.raises(JobError) as info:
        load_job(job)
    lines = str(info.value).splitlines()
    assert lines[0] == f"invalid job file {job}:"
    assert sorted(lines[1:]) == [
        "  sft.trainer.epochs: Input should be greater than or equal to 1",
        "  trainer.clip_hi: Extra inputs are not permitted",
        "  trainer.groups_per_update: Input should be a valid integer, unable to parse string as an integer",
        "  trainer.lr: Input should be greater than 0",
    ]


def test_good_trainer_fields_load_as_their_types(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[trainer]\nlr = 1\nbetas = [0.8, 0.9]\nadvantage = "grpo"\n')
    assert load_job(job).trainer == {"lr": 1.0, "betas": (0.8, 0.9), "advantage": "grpo"}  # only what was given


def test_train_and_run_give_the_same_error_for_a_bad_field(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[trainer]\nmodel_dir = "model"\nlr = -1\n[pool]\nurl = "sqlite:///never-created.db"\n')
    expected = f"invalid job file {job}:\n  trainer.lr: Input should be greater than 0"
    for command in ("train", "replay", "run"):
        args = [command, str(job), *(["--pool", str(job)] if command == "replay" else [])]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and f"Error: {expected}\n" in result.output, (command, result.output)
    assert not (tmp_path / "never-created.db").exists()


def test_train_names_the_fields_it_needs_filled_in(tmp_path: Path) -> None:
    """`stepline train` builds the whole TrainerConfig: a model_dir that is not a model fails, same format."""
    job = tmp_path / "job.toml"
    job.write_text('[trainer]\nmodel_dir = "nowhere"\n')
    result = CliRunner().invoke(main, ["train", str(job)])
    assert result.exit_code == 1
    assert f"invalid job file {job}:\n  trainer.model_dir: Value error, no Hugging Face model at" in result.output


def test_trainer_paths_are_relative_to_the_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "out"\n[sft.trainer]\noutput_dir = "s"\n')
    cfg = load_job(job)
    assert cfg.trainer["output_dir"] == tmp_path / "jobs" / "out" and cfg.trainer["model_dir"] == tiny_model_dir
    assert cfg.sft.trainer["output_dir"] == tmp_path / "jobs" / "s" and cfg.pool.url == "sqlite:///pool.db"


def test_an_unknown_table_is_refused_for_every_command(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[trainer]\nlr = 0.1\n[pools]\nurl = "sqlite:///x.db"\n')  # [pool] misspelt
    with pytest.raises(JobError, match="pools: Extra inputs are not permitted"):
        load_job(job)


def test_a_trainer_table_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('sft = 3\ntrainer = "x"\n')
    with pytest.raises(JobError) as info:
        load_job(job)
    assert "  sft: Input should be" in str(info.value) and "  trainer: Input should be" in str(info.value)


def test_the_rl_time_bound_counts_what_earlier_runs_spent(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rl_minutes` bounds the RL phase over resumes: the trainer gets what phases.json has not used up."""
    import json

    from stepline.launch.phases import RunDir, trainer_configs

    job = tmp_path / "job.toml"
    job.write_text("rl_minutes = 2\n")
    cfg, run = load_job(job), RunDir(tmp_path / "run")
    run.root.mkdir()
    assert trainer_configs(cfg, run, tiny_model_dir)[1].max_seconds == 120
    (run.root / "phases.json").write_text(json.dumps({"sft": 500.0, "rl": 100.0}))
    assert trainer_configs(cfg, run, tiny_model_dir)[1].max_seconds == pytest.approx(20)
    (run.root / "phases.json").write_text(json.dumps({"rl": 130.0}))
    assert 0 < trainer_configs(cfg, run, tiny_model_dir)[1].max_seconds < 0.01  # spent: no update starts
    job.write_text("rl_updates = 3\n")
    assert trainer_configs(load_job(job), run, tiny_model_dir)[1].max_seconds is None


def test_the_job_time_bound_leaves_room_for_the_last_evaluation(tmp_path: Path) -> None:
    """`job_minutes` bounds the whole job: RL gets what the phases before it left, less the evaluation after it
    (half as long again as the one before); with `rl_minutes` too, the tighter bound wins."""
    import json

    from stepline.launch.phases import RunDir, rl_seconds_left

    job, run = tmp_path / "job.toml", RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "phases.json").write_text(json.dumps({"model": 10.0, "sft": 290.0, "eval_before": 150.0}))
    job.write_text("job_minutes = 30\n")
    assert rl_seconds_left(load_job(job), run) == pytest.approx(1800 - 450 - 1.5 * 150)
    job.write_text("job_minutes = 30\nrl_minutes = 10\n")
    assert rl_seconds_left(load_job(job), run) == pytest.approx(600)
    job.write_text("job_minutes = 30\nrl_minutes = 25\n")
    assert rl_seconds_left(load_job(job), run) == pytest.approx(1125)
    (run.root / "phases.json").write_text(json.dumps({"sft": 290.0, "eval_before": 150.0, "rl": 1300.0}))  # resumed
    assert 0 < rl_seconds_left(load_job(job), run) < 0.01


def test_a_bounded_job_on_a_cpu_without_bf16_units_says_what_to_expect(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import stepline.trainer.precision
    from stepline.launch.run import slow_cpu_note

    job = tmp_path / "job.toml"
    job.write_text("job_minutes = 28\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(stepline.trainer.precision, "bf16_units", lambda device: False)  # an AVX2-only CPU
    note = slow_cpu_note(load_job(job))
    assert note is not None and "no bf16 units" in note and "job_minutes = 28" in note and "job_minutes=75" in note
    for fields in ("rl_updates = 3\n",  # no time bound: slower, but nothing is cut short
                   "job_minutes = 75\n"):  # the bound the quickstart's 40 float32 updates fit in
        job.write_text(fields)
        assert slow_cpu_note(load_job(job)) is None
    job.write_text("job_minutes = 28\n")
    monkeypatch.setattr(stepline.trainer.precision, "bf16_units", lambda device: True)  # AVX512-BF16 or AMX
    assert slow_cpu_note(load_job(job)) is None


def test_run_names_the_tables_it_does_not_read(tmp_path: Path) -> None:
    """[pool] belongs to `train`/`replay` and [cluster] to `run --ray`: `stepline run` says so instead of
    silently ignoring them; a file without them gets no note."""
    job = tmp_path / "job.toml"
    job.write_text('run_dir = "r"\n[pool]\nurl = "postgresql://db/x"\n[cluster]\nengines = 2\n')
    plain, ray = unused_by_run(load_job(job), on_ray=False), unused_by_run(load_job(job), on_ray=True)
    assert len(plain) == 2 and str(tmp_path / "r" / "pool.db") in plain[0] and "run --ray` only" in plain[1]
    assert len(ray) == 1 and "[cluster] pool_url" in ray[0]
    job.write_text('run_dir = "r"\n[trainer]\nlr = 1e-4\n')
    assert unused_by_run(load_job(job), on_ray=False) == []


def test_run_says_an_imitation_anchor_without_experts_does_nothing() -> None:
    quickstart = Path(__file__).parents[1] / "examples" / "quickstart.toml"
    assert unused_by_run(load_job(quickstart), on_ray=False) == []
    notes = unused_by_run(load_job(quickstart, {"rollout.harnesses.2.expert_per_group": 0}), on_ray=False)
    assert len(notes) == 1 and notes[0].startswith("trainer.expert_sft_coef = 1.0") and "does nothing" in notes[0]
