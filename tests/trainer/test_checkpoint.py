"""kill -9 then restart: training continues from the checkpoint, no group is trained twice or lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from trainer_helpers import rollout, toy_target
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.datapool import open_pool
from stepline.gateway.templating import ChatTemplate
from stepline.trainer.checkpoint import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint
from stepline.trainer.config import TrainerConfig
from stepline.trainer.loop import build_policy, train
from stepline.trainer.weight_sync import NoWeightSync

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path, critic=True, progress=False)
    a = build_policy(cfg)
    with torch.no_grad():
        a.model.model.norm.weight.add_(0.5)
    a.optimizer.param_groups[0]["lr"] = 0.123
    state = TrainerState(update=3, version=3, optimizer_steps=3, consumed={"g1": ["s1", "s2"]}, unacked=["g1"])
    save_checkpoint(tmp_path, state, a.model, a.optimizer, a.scheduler, a.value_head)
    expected_rng = torch.rand(3)
    b = build_policy(cfg)
    restored = load_checkpoint(latest_checkpoint(tmp_path), b.model, b.optimizer, b.scheduler, b.value_head)
    assert restored == state
    torch.testing.assert_close(b.model.model.norm.weight, a.model.model.norm.weight)
    torch.testing.assert_close(b.model.lm_head.weight, b.model.model.embed_tokens.weight)  # still tied
    torch.testing.assert_close(torch.rand(3), expected_rng)  # RNG restored to the moment of saving
    assert b.optimizer.param_groups[0]["lr"] == 0.123


def test_restart_releases_claims_it_never_learnt_of(tiny_model_dir: Path, tmp_path: Path) -> None:
    # a trainer died right after the pool committed its claim: the restarted one releases and trains those groups
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout(model, pool, 0, toy_target(model, 3000, 750), tasks=3, samples=2, tokens=3)
    orphans = pool.claim_groups("trainer", min_version=0, max_groups=2)
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", groups_per_update=3,
                        dynamic_sampling=False, progress=False, tensorboard=False)
    state = train(cfg, pool, NoWeightSync(), offline=True)
    assert state.update == 1 and sorted(s for m in state.consumed.values() for s in m) == \
        sorted(s.session_id for s in pool.list_sessions())
    assert pool.claimed_groups("trainer") == [] and len(orphans) == 2
    pool.close()
    # the checkpoint's model directory is a policy one serves as it is (`stepline up --model ...`): weights,
    # tokenizer and chat template
    served = latest_checkpoint(tmp_path / "run" / "checkpoints") / "model"
    template = ChatTemplate.from_model_dir(served)
    assert template.render([{"role": "user", "content": "hi"}], None, True) == \
        ChatTemplate.from_model_dir(tiny_model_dir).render([{"role": "user", "content": "hi"}], None, True)
    source = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert AutoTokenizer.from_pretrained(served)("hi").input_ids == source("hi").input_ids


def test_kill_9_then_restart_trains_every_group_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool_path = tmp_path / "pool.db"
    pool = open_pool(f"sqlite:///{pool_path}")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout(model, pool, 0, toy_target(model, 3000, 750), tasks=16, samples=2, tokens=3)
    sessions = {s.session_id for s in pool.list_sessions()}
    pool.close()
    job = tmp_path / "job.toml"
    job.write_text(f'[trainer]\nmodel_dir = "{tiny_model_dir}"\noutput_dir = "run"\ngroups_per_update = 2\n'
                   f'checkpoint_every = 2\nmax_staleness = 100\nidle_timeout = 0.5\nprogress = false\n'
                   f'tensorboard = false\ndynamic_sampling = false\n[pool]\nurl = "sqlite:///{pool_path}"\n')
    metrics = tmp_path / "run" / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "stepline.cli", "train", str(job)]

    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # past the first checkpoint
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stderr.close()
    killed_at = len(metrics.read_text().splitlines())
    checkpointed = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text())
    assert checkpointed["update"] < 8  # it was stopped before the end

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text())
    trained = [s for members in final["consumed"].values() for s in members]
    assert sorted(trained) == sorted(sessions)  # every session once: none twice, none lost
    assert final["update"] == 8 and final["unacked"] == []
    updates = [json.loads(line)["update"] for line in metrics.read_text().splitlines()]
    # the second run continued from the checkpoint: update numbers restart right after it
    assert updates[killed_at:] == list(range(checkpointed["update"] + 1, 9))
    pool = open_pool(f"sqlite:///{pool_path}")
    stats = pool.stats()
    assert stats["groups_claimed"] == 0 and stats["groups_consumed"] == len(final["consumed"]) == 16
    pool.close()
