"""Expert demonstrations: each harness's scripted expert, played and scored, in the numbers the job asks for."""

from __future__ import annotations

from pathlib import Path

from stepline.rollout.config import HarnessSpec
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
