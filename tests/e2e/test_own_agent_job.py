"""The README's own-agent job trains (slow: several minutes on 2 cores; .ci/run runs it after the suite):

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q -m slow tests/e2e/test_own_agent_job.py

Runs examples/own_agent.toml as written, an external command (examples/own_agent/agent.py, a plain `openai`
SDK program) with its own verifier, shortened to one RL update and two test tasks, on the pretrained
SmolLM2 the job names. It must make the update (rewards vary, so dynamic sampling keeps a group), record
it in summary.json without a warning, and the checkpoint it leaves must hold weights other than the
policy it started from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stepline.launch.job import load_job
from stepline.launch.run import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # minutes, not the suite default 300 s
ROOT = Path(__file__).resolve().parents[2]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_the_own_agent_job_makes_an_update_that_changes_the_weights(
        smollm2_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the harness command is written relative to the repository root
    cfg = load_job(ROOT / "examples" / "own_agent.toml", {
        "run_dir": str(tmp_path / "run"), "rl_updates": 1, "model.dir": str(smollm2_model_dir), "eval.limit": 2})
    summary = run_job(cfg)
    assert summary["rl_updates"] == summary["rl_updates_asked"] == 1, summary
    assert summary["warnings"] == [] and summary["rl_episodes_failed"] < summary["rl_episodes"], summary
    checkpoints = tmp_path / "run" / "rl" / "checkpoints"
    trained = weights(checkpoints / (checkpoints / "latest").read_text().strip() / "model")
    start = weights(smollm2_model_dir)
    changed = [name for name, tensor in trained.items()
               if name in start and not torch.equal(tensor.float(), start[name].float())]
    assert changed, "the update left every weight as it was"
