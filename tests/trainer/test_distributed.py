"""Data-parallel training (stepline/trainer/distributed.py): two gloo ranks on CPU, each forwarding its share of the
groups, give the single-process update on the same batch (parameters to 1e-6) and stay bit-identical."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import FakeCall, episode_from_calls

from stepline.datapool.records import Group
from stepline.trainer.batch import build_batch
from stepline.trainer.config import TrainerConfig
from stepline.trainer.distributed import Ranks, parameters_digest
from stepline.trainer.loop import build_policy, objective
from stepline.trainer.update import update

# SGD with lr 1: the step is the (clipped) summed gradient itself, so a difference in the gradients shows up at
# full size (Adam's first step, ±lr·sign(g), would turn float noise in near-zero gradients into full-size steps).
# The second case is the loop's own AdamW with a critic, 2 minibatches × 2 epochs: the ranks must agree bit for bit.
CASES: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd", "fields": {}},
    "adamw-critic": {"optimizer": "adamw", "fields": {"critic": True, "advantage": "gae", "minibatches": 2,
                                                       "epochs": 2, "loss_aggregation": "token-mean"}},
}


def groups(n_groups: int = 3) -> list[Group]:
    """3 groups of unequal size (2, 3, 4 episodes): rank 0 forwards 2 of them, rank 1 one (np.array_split)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(10, 3000, (6,), generator=g).tolist()
        eps = []
        for i in range(k + 2):
            first = torch.randint(10, 3000, (4,), generator=g).tolist()
            second = torch.randint(10, 3000, (3,), generator=g).tolist()
            calls = [FakeCall(prompt, first, [-7.0] * 4), FakeCall(prompt + first + [5, 6], second, [-7.0] * 3)]
            eps.append(episode_from_calls(f"g{k}s{i}", calls, outcome=float((i + k) % 3), task_id=f"t{k}"))
        out.append(Group(f"g{k}", f"t{k}::h", eps, 0))
    return out


def run_update(model_dir: Path, out: Path, case: str, ranks: Ranks) -> dict[str, Any]:
    cfg = TrainerConfig(model_dir=model_dir, output_dir=out, progress=False, tensorboard=False, lr=1e-3,
                        micro_batch_episodes=2, **CASES[case]["fields"])
    torch.manual_seed(0)
    policy = build_policy(cfg)
    if CASES[case]["optimizer"] == "sgd":
        policy.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda _: 1.0)
    before = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    metrics = update(policy, build_batch(groups()), objective(cfg, 0, False), version=0, ranks=ranks)
    after = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    return {"step": after - before, "digest": parameters_digest(policy.model), "metrics": metrics}


def rank_main(rank: int, world: int, init: str, model_dir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    ranks = Ranks.join(rank, world, init)
    try:
        for case in CASES:
            torch.save(run_update(model_dir, out / f"{case}-r{rank}", case, ranks), out / f"{case}-{rank}.pt")
    finally:
        ranks.leave()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 2, f"file://{out}/rendezvous", tiny_model_dir, out))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], codes
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_the_single_process_update(case: str, two_ranks: Path, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    single = run_update(tiny_model_dir, tmp_path, case, Ranks())
    r0, r1 = (torch.load(two_ranks / f"{case}-{r}.pt", weights_only=False) for r in range(2))
    assert single["step"].abs().max() > 1e-4  # the update did move the weights
    assert r0["digest"] == r1["digest"]  # bit-identical on both ranks
    torch.testing.assert_close(r0["step"], single["step"], atol=1e-6, rtol=0)
    # both ranks forwarded. One minibatch [g0 g1 g2]: rank 0 g0 g1 (2 + 3 episodes), rank 1 g2 (4). Two
    # minibatches [g0 g1] [g2]: rank 0 g0 and g2 (2 + 4), rank 1 g1 (3) and nothing in the second minibatch.
    shares = [r0["metrics"]["rank_episodes"], r1["metrics"]["rank_episodes"]]
    assert sum(shares) == 9 and min(shares) > 0, shares
    assert r0["metrics"]["action_tokens"] == single["metrics"]["action_tokens"]  # counts cover every rank


def test_share_splits_contiguously() -> None:
    assert [Ranks(r, 2).share([1, 2, 3]) for r in range(2)] == [[1, 2], [3]]
    assert [Ranks(r, 3).share([7]) for r in range(3)] == [[7], [], []]
