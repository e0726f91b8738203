"""`stepline replay JOB.toml --pool FILE`: offline training from a stored pool, which stays untouched."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from trainer_helpers import rollout, toy_target
from transformers import AutoModelForCausalLM

from stepline.cli import main
from stepline.datapool import open_pool

torch.set_num_threads(1)


def test_replay_trains_offline_from_a_stored_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    stored = tmp_path / "stored.db"
    pool = open_pool(f"sqlite:///{stored}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    target = toy_target(model, 3000, 750)
    for version in (0, 5, 9):  # data of several old policy versions: offline replay has no staleness bound
        rollout(model, pool, version, target, tasks=2, samples=3, tokens=3)
    pool.close()
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "replay"\ngroups_per_update = 2\n'
                   'progress = false\ntensorboard = false\ndynamic_sampling = false\nold_logprobs = "recompute"\n')

    result = CliRunner().invoke(main, ["replay", str(job), "--pool", str(stored)])
    assert result.exit_code == 0, result.output
    assert "replayed 6 groups in 3 updates" in result.output
    lines = (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["episodes"] for line in lines] == [6, 6, 6]

    again = CliRunner().invoke(main, ["replay", str(job), "--pool", str(stored)])  # restart: nothing left
    assert "replayed 6 groups in 3 updates" in again.output
    pool = open_pool(f"sqlite:///{stored}")
    assert pool.stats()["groups_consumed"] == 0 and pool.stats()["groups_claimed"] == 0  # the stored pool is untouched
    pool.close()


def test_replay_of_a_finished_run_trains_on_the_groups_it_consumed(tiny_model_dir: Path, tmp_path: Path) -> None:
    stored = tmp_path / "run.db"
    pool = open_pool(f"sqlite:///{stored}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout(model, pool, 0, toy_target(model, 3000, 750), tasks=4, samples=2, tokens=3)
    online = pool.claim_groups("trainer", min_version=0, max_groups=4)  # the online trainer took them all
    pool.mark_consumed([g.group_id for g in online], "trainer")
    pool.close()
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "replay"\ngroups_per_update = 2\n'
                   'progress = false\ntensorboard = false\ndynamic_sampling = false\n')
    result = CliRunner().invoke(main, ["replay", str(job), "--pool", str(stored)])
    assert result.exit_code == 0, result.output
    assert "replayed 4 groups in 2 updates" in result.output


def test_bad_job_fails_before_anything_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\nadvantage = "nope"\ngroups_per_update = 3\n'
                   'minibatches = 2\n[pool]\nurl = "sqlite:///never-created.db"\n')
    result = CliRunner().invoke(main, ["train", str(job)])
    assert result.exit_code != 0
    assert "trainer.advantage: Value error, unknown name 'nope'" in result.output
    assert not (tmp_path / "never-created.db").exists() and not Path("never-created.db").exists()


def test_replay_of_a_poisoned_reward_skips_its_group_and_keeps_every_tensor_finite(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # a pool written before rewards were bounded: one reward of 1e300 × weight 1e10, each factor finite, the
    # product not; replaying it once left 26 of 26 tensors NaN/inf
    stored = tmp_path / "stored.db"
    pool = open_pool(f"sqlite:///{stored}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout(model, pool, 0, toy_target(model, 3000, 750), tasks=2, samples=3, tokens=3)
    pool.close()
    with sqlite3.connect(stored) as db:
        sid = db.execute("SELECT MIN(sid) FROM sessions").fetchone()[0]
        db.execute("UPDATE rewards SET value = 1e300, weight = 1e10 WHERE sid = ?", (sid,))
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "replay"\ngroups_per_update = 2\n'
                   'progress = false\ntensorboard = false\ndynamic_sampling = false\n')
    result = CliRunner().invoke(main, ["replay", str(job), "--pool", str(stored)])
    assert result.exit_code == 0, result.output
    (line,) = (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["skipped_non_finite"] == 1 and json.loads(line)["episodes"] == 3  # the other group
    (weights,) = sorted((tmp_path / "replay" / "weights").glob("v*/model.safetensors"))[-1:]
    tensors = load_file(weights)
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values())
