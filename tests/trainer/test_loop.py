"""The training loop end to end on CPU: the toy reward goes up; pushes, metrics, checkpoints happen."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from trainer_helpers import SamplerSync, toy_target

from stepline.datapool import open_pool
from stepline.trainer.config import TrainerConfig
from stepline.trainer.loop import train

torch.set_num_threads(1)


def test_toy_reward_goes_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The "engine" samples in-process and writes CallRecords into an embedded SQLite pool; each weight push
    # loads the new policy into it and produces the next round. Reward = fraction of sampled tokens in a
    # target set a fresh model hits ~25% of the time.
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", lr=1e-2, groups_per_update=4,
                        max_updates=20, checkpoint_every=10, progress=False, tensorboard=True, max_staleness=1,
                        idle_timeout=10)
    engine = SamplerSync(tiny_model_dir, pool, None, tasks=4, samples=6)
    engine.target = toy_target(engine.model, vocab=3000, size=750)
    engine.start(version=0)
    state = train(cfg, pool, engine)

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in lines]
    assert len(rewards) == 20 and state.update == 20
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards
    assert [v for _, v in engine.pushes] == list(range(1, 21))
    assert pool.stats()["groups_consumed"] == 80  # 20 updates × 4 groups, all marked consumed at the end
    assert len(state.consumed) == 80 and not state.unacked
    assert (tmp_path / "run" / "checkpoints" / "ckpt-000020" / "state.json").is_file()
    assert any((tmp_path / "run" / "tb").iterdir())
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["v000019", "v000020"]
    pool.close()


def test_metrics_per_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", lr=1e-3, groups_per_update=2,
                        max_updates=1, progress=False, tensorboard=False)
    engine = SamplerSync(tiny_model_dir, pool, None, tasks=2, samples=4, temperature=0.7)
    engine.target = toy_target(engine.model, vocab=3000, size=750)
    engine.start(version=0)
    train(cfg, pool, engine)
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward_mean", "reward/toy", "adv_mean", "adv_std", "ratio_mean", "ratio_max", "clip_frac_mean",
                "approx_kl_behaviour_mean", "entropy_mean", "staleness_mean", "tokens_per_s", "tree_token_saving",
                "grad_norm", "lr", "policy_loss"):
        assert key in m, key
    # first update of a fresh policy: recomputed logprobs equal the engine's (ratios 1), nothing is stale
    assert abs(m["ratio_min"] - 1) < 1e-4 and abs(m["ratio_max"] - 1) < 1e-4, m
    assert m["staleness_max"] == 0
    # two turns share the first prompt and answer: the tree forward packs 8+6+3+6 = 23 tokens per session
    # where the naive one processes (8+6) + (17+6) = 37; the 4 sessions of a task share their 8-token prompt
    # (and any sampled tokens that coincide): at most 4 * 23 - 3 * 8 = 68 packed of 4 * 37 = 148
    assert m["tree_token_saving"] >= 1 - 68 / 148 - 1e-9
    pool.close()


def test_groups_that_all_skip_are_consumed_without_an_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    engine = SamplerSync(tiny_model_dir, pool, torch.arange(4096), tasks=3, samples=2)  # every token hits: reward 1
    engine.start(version=0)
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", progress=False, tensorboard=False)
    state = train(cfg, pool, engine, offline=True)
    assert state.update == 0 and len(state.consumed) == 3 and engine.pushes == []
    assert pool.stats()["groups_consumed"] == 3
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # one line per update, and there was none
    pool.close()


def test_online_updates_wait_for_a_full_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Groups arrive one at a time from a rollout thread; with groups_per_update = 3 the first (and only)
    # update trains on all three, not on whatever was ready when the trainer first looked.
    import threading
    import time

    from trainer_helpers import rollout

    from stepline.trainer.weight_sync import NoWeightSync

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    model = SamplerSync(tiny_model_dir, pool, None).model
    target = toy_target(model, vocab=3000, size=750)

    def arrive() -> None:
        for k in range(3):
            rollout(model, pool, 0, target, tasks=1, samples=4, tag=f"g{k}-")
            time.sleep(0.3)

    producer = threading.Thread(target=arrive)
    producer.start()
    # group_size = 4: a group is ready with its 4 sessions (without it, a loaded machine let the trainer claim a
    # group whose 4th session was still being written: 11 episodes)
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", groups_per_update=3, max_updates=1,
                        group_size=4, dynamic_sampling=False, poll_interval=0.05, progress=False, tensorboard=False)
    train(cfg, pool, NoWeightSync())
    producer.join()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["groups"] == 3 and first["episodes"] == 12
    pool.close()


def test_a_slow_producer_is_waited_for_while_it_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The job's own rollouts may take longer than idle_timeout for their first batch (a slow CPU): while
    # `producing` answers True the trainer keeps waiting; once it answers False idle_timeout ends the loop.
    import threading
    import time

    from trainer_helpers import rollout

    from stepline.trainer.weight_sync import NoWeightSync

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    model = SamplerSync(tiny_model_dir, pool, None).model
    target = toy_target(model, vocab=3000, size=750)

    def arrive() -> None:
        time.sleep(1.5)  # longer than idle_timeout
        rollout(model, pool, 0, target, tasks=2, samples=4, tag="late-")

    producer = threading.Thread(target=arrive)
    producer.start()
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", groups_per_update=2, max_updates=3,
                        dynamic_sampling=False, poll_interval=0.05, idle_timeout=0.3, progress=False,
                        tensorboard=False)
    state = train(cfg, pool, NoWeightSync(), producing=producer.is_alive)
    producer.join()
    assert state.update == 1  # the late batch trained; then the producer was done and the pool stayed empty
    pool.close()


def test_the_time_bound_ends_a_loop_that_would_wait_forever(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A producer that never finishes and never delivers keeps the loop waiting; max_seconds ends it.
    import time

    from stepline.trainer.weight_sync import NoWeightSync

    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    cfg = TrainerConfig(model_dir=tiny_model_dir, output_dir=tmp_path / "run", groups_per_update=2, max_updates=3,
                        poll_interval=0.05, idle_timeout=0.1, max_seconds=0.5, progress=False, tensorboard=False)
    started = time.monotonic()
    state = train(cfg, pool, NoWeightSync(), producing=lambda: True)
    assert state.update == 0 and time.monotonic() - started < 30
    pool.close()
