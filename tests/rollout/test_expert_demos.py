"""Expert demonstrations: each harness's scripted expert, played and scored, in the numbers the job asks for."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from stepline.rollout.config import HarnessError, HarnessSpec, list_tasks, task_kinds
from stepline.rollout.demos import expert_episodes, weighted_sample


async def test_demonstrations_per_harness_can_differ(tmp_path: Path) -> None:
    specs = [HarnessSpec(name="ui", module="stepline.agents.ui"), HarnessSpec(name="search", module="stepline.agents.search")]
    demos = await expert_episodes(specs, per_harness=1, concurrency=2, work=tmp_path, seed=0, counts={"ui": 3})
    by_harness = [spec.name for spec, _, _ in demos]
    assert sorted(by_harness) == ["search", "ui", "ui", "ui"]
    assert len({task for spec, task, _ in demos if spec.name == "ui"}) == 3  # distinct train tasks
    for _, _, result in demos:  # the expert solves every task it is given, in the harness's own messages
        assert result is not None
        episode, reward = result
        assert reward == 1.0 and any(m["role"] == "assistant" for m in episode["messages"])


async def test_demonstrations_come_only_from_the_tasks_a_pattern_matches(tmp_path: Path) -> None:
    # bfcl-like use: every search train task whose id ends in 0 (a tenth of them), the ui ones unfiltered
    specs = [HarnessSpec(name="search", module="stepline.agents.search"), HarnessSpec(name="ui", module="stepline.agents.ui")]
    demos = await expert_episodes(specs, per_harness=4, concurrency=2, work=tmp_path, seed=0, matching={"search": "0$"})
    search = [task for spec, task, _ in demos if spec.name == "search"]
    assert len(search) == 4 and all(task.endswith("0") for task in search)
    assert len([task for spec, task, _ in demos if spec.name == "ui"]) == 4
    with pytest.raises(HarnessError, match="sft.demo_tasks_matching '\\^nothing' matches none"):
        await expert_episodes(specs, per_harness=1, concurrency=2, work=tmp_path, seed=0, matching={"ui": "^nothing"})


def test_a_kinds_weight_draws_its_tasks_that_many_times_as_often() -> None:
    # 4 tasks of kind a weighted 3 against 4 of kind b: a draw of 1 takes an a-task with probability 12/16
    ids, weights = [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)], [3] * 4 + [1] * 4
    firsts = [weighted_sample(random.Random(seed), ids, weights, 1)[0] for seed in range(4000)]
    assert sum(task.startswith("a") for task in firsts) / len(firsts) == pytest.approx(0.75, abs=0.03)
    assert sorted(weighted_sample(random.Random(0), ids, weights, 20)) == sorted(ids)  # distinct, all when fewer


async def test_demonstrations_weighted_by_kind_and_an_unknown_kind_named(tmp_path: Path) -> None:
    spec = HarnessSpec(name="ui", module="stepline.agents.ui")
    kinds = task_kinds(spec)
    train = list_tasks(spec, "train")
    share = sum(kinds[task] == "toggle" for task in train) / len(train)  # a quarter: settings' tasks are toggles
    demos = await expert_episodes([spec], per_harness=12, concurrency=2, work=tmp_path, seed=0,
                                  kinds={"ui": {"toggle": 30}})
    toggles = sum(kinds[task] == "toggle" for _, task, _ in demos)
    assert share < 0.3 and toggles >= 9  # weight 30: ~10 of 12 (seeded), against 3 unweighted
    with pytest.raises(HarnessError, match=r"sft.demo_kinds \['toggel'\] are not kinds of its tasks"):
        await expert_episodes([spec], per_harness=1, concurrency=2, work=tmp_path, seed=0, kinds={"ui": {"toggel": 2}})
