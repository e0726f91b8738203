"""Expert demonstrations: each harness's scripted expert, played and scored, in the numbers the job asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.rollout.config import HarnessError, HarnessSpec
from stepline.rollout.demos import expert_episodes


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
