"""Tree-search rollouts (stepline/rollout/trees.py) through the real gateway: the search harness plays a root episode,
the driver forks it at a step boundary, the fork replays the root's steps before it with their exact ids and
samples from there; both sessions carry the task's gold answer and the group is claimable only once both end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from fakes.engine import FakeEngine, Scripted, recording_gateway
from tokenizers import Tokenizer

from stepline.datapool.records import ForkPoint
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessSpec, RolloutConfig, TreeSearch
from stepline.rollout.driver import RolloutDriver
from stepline.rollout.trees import TreeEpisode, branch_points, draw_branches

END = "<|im_end|>"


def call(name: str, **arguments: str) -> str:
    return "<tool_call>\n%s\n</tool_call>" % json.dumps({"name": name, "arguments": arguments})


def test_branch_points_are_each_episodes_own_later_steps() -> None:
    ep = lambda branch, calls: TreeEpisode(None, None, branch, calls)  # type: ignore[arg-type]  # noqa: E731
    # root with 3 calls: calls 1, 2; a fork at 1 with 3 calls (1 replayed): call 2; a fork at 2 with 3: none
    assert branch_points([ep(0, 3), ep(1, 3), ep(2, 3)]) == [(0, 1), (0, 2), (1, 2)]
    assert branch_points([ep(0, 1)]) == [(0, 0)]  # one-call episodes: a fresh sample from the first state
    rng = random.Random(0)
    assert sorted(draw_branches([(0, 1), (0, 2)], 2, rng)) == [(0, 1), (0, 2)]  # distinct while there are enough
    assert len(draw_branches([(0, 1)], 3, rng)) == 3


def test_tree_search_and_references_are_checked() -> None:
    assert TreeSearch(trees=2, branches=3, rounds=2).group_size == 2 * (1 + 3 * 2)
    with pytest.raises(ValueError, match="references"):
        HarnessSpec(name="x", command="true", tasks=["a"], references=True)
    with pytest.raises(ValueError):
        HarnessSpec(name="x", module="stepline.agents.search", tree_search={"trees": 0})


async def test_a_tree_group_forks_through_the_gateway(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    end = tok.token_to_id(END)
    texts = [call("search", query="Kagone"), call("search", query="Fefeda"), call("answer", text="Belo"),  # the root
             call("answer", text="Nowhere"), call("answer", text="Nowhere")]  # the fork, at call 1 or 2
    script = [Scripted(tok.encode(t, add_special_tokens=False).ids + [end], text=t) for t in texts]
    engine = FakeEngine(script, eos_id=end, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    spec = HarnessSpec(name="search", module="stepline.agents.search", tasks=["search-0000"], references=True,
                       tree_search=TreeSearch(trees=1, branches=1))
    async with engine as engine_url, recording_gateway(tiny_model_dir, engine_url, tmp_path / "pool.db", "sglang") as (
            url, pool):
        async with GatewayClient(url, "adm") as client:
            driver = RolloutDriver(RolloutConfig(harnesses=[spec], seed=3), client, tmp_path / "w")
            await driver.run(num_groups=1)
        root, fork = driver.results
        assert (root.reward, fork.reward) == (1.0, 0.0) and fork.status == "completed"
        infos = {r.session_id: pool.get_session(r.session_id) for r in driver.results}
        link = infos[fork.session_id].fork_of
        assert link is not None and link.session_id == root.session_id and link.call in (1, 2)
        assert {i.metadata["reference"] for i in infos.values()} == {"Belo"}  # the task's gold answer
        assert {i.group_key for i in infos.values()} == {infos[root.session_id].group_key}
        assert all(i.status == "completed" for i in infos.values())
        # the fork's first recorded call is its branch point, with the root's prompt there, id for id
        root_calls = {c.call_index: c for c in pool.get_calls(root.session_id)}
        fork_calls = pool.get_calls(fork.session_id)
        assert fork_calls[0].call_index == link.call
        assert fork_calls[0].prompt_ids.tolist() == root_calls[link.call].prompt_ids.tolist()
        (group,) = pool.claim_groups("test", min_version=0, max_groups=5)
        assert {e.info.session_id for e in group.episodes} == set(infos)
        assert ForkPoint(root.session_id, link.call) == link
