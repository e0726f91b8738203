"""The shortened main job's run, made once per test session: test_main_job.py checks it, and the
dashboard's browser test (test_dashboard_browser.py) serves it, so the job's ~4 minutes are paid once."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.launch.job import load_job
from stepline.launch.run import run_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def main_job_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_job(ROOT / "examples" / "quickstart.toml", {
        "run_dir": str(run_dir), "rl_updates": 2,
        "model.kind": "tiny", "model.hidden_size": 32, "model.num_layers": 1,
        "sft.demos_per_harness": 2, "sft.demos": {}, "sft.trainer": {"epochs": 2, "groups_per_update": 6, "lr": 3e-3,
                                                    "tensorboard": False},
        "trainer.groups_per_update": 2, "trainer.minibatches": 1, "trainer.micro_batch_episodes": 4, "trainer.dynamic_sampling": False,
        "trainer.train_layers": None,
        "rollout.group_size": 2, "rollout.harnesses.2.group_size": 2, "rollout.harnesses.2.weight": 1.0,  # every harness takes part
        "rollout.max_concurrency": 4, "eval.limit": 1,
    })
    return run_dir, run_job(cfg)
