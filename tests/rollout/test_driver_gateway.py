"""The rollout driver and evaluation through the real gateway, recording into a real SQLite pool:
a scripted engine that plays the expert (the episode must score 1), and the built-in CPU engine
serving the tiny random model (episodes complete end to end; groups and rewards land in the pool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes.engine import FakeEngine, Scripted, recording_gateway
from tokenizers import Tokenizer

from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessSpec, RolloutConfig
from stepline.rollout.driver import RolloutDriver
from stepline.rollout.evaluate import evaluate

END = "<|im_end|>"


def gateway(model_dir: Path, engine_url: str, tmp_path: Path, kind: str):
    return recording_gateway(model_dir, engine_url, tmp_path / "pool.db", kind)


def _terminal(tasks: list[str], max_turns: int = 2) -> HarnessSpec:
    return HarnessSpec(name="terminal", module="stepline.agents.terminal", tasks=tasks, max_turns=max_turns)


async def test_scripted_expert_through_the_gateway_scores_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.agents.terminal.tasks import get_task

    task = get_task("write-cow-0")
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    call = json.dumps({"name": "bash", "arguments": {"command": task.expert_command}})
    texts = [f"<tool_call>\n{call}\n</tool_call>", "done"]
    end = tok.token_to_id(END)
    script = [Scripted(tok.encode(t, add_special_tokens=False).ids + [end], text=t) for t in texts]
    engine = FakeEngine(script, eos_id=end, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    async with engine as engine_url, gateway(tiny_model_dir, engine_url, tmp_path, "sglang") as (url, pool):
        async with GatewayClient(url, "adm") as client:
            driver = RolloutDriver(RolloutConfig(harnesses=[_terminal([task.task_id])], group_size=1), client, tmp_path / "w")
            await driver.run(num_groups=1)
        result = driver.results[0]
        assert (result.status, result.reward, result.reason) == ("completed", 1.0, "ok")
        episode = pool.get_episode(result.session_id)
        assert episode.info.harness == "terminal" and episode.info.status == "completed"
        assert episode.outcome == 1.0 and len(episode.tree.calls) == 2


async def test_tiny_model_episodes_land_in_the_pool_with_rewards_and_groups(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.engine.testing import running_engine

    config = RolloutConfig(harnesses=[_terminal(["count-cow-0", "grep-cow-1"], max_turns=2)], group_size=2,
                           episode_timeout_s=120)
    with running_engine(tiny_model_dir) as engine_url:
        async with gateway(tiny_model_dir, engine_url, tmp_path, "builtin") as (url, pool):
            async with GatewayClient(url, "adm") as client:
                driver = RolloutDriver(config, client, tmp_path / "w")
                stats = await driver.run(num_groups=1)
            report = await evaluate(config, url, "adm", limit=1)
            assert stats["terminal"]["episodes"] == 2
            for r in driver.results:
                info = pool.get_session(r.session_id)
                assert info.status == r.status and pool.get_episode(r.session_id).outcome == r.reward
            groups = pool.claim_groups("test", min_version=0, max_groups=10, group_size=2)
            train = [g for g in groups if g.episodes[0].info.purpose == "train"]
            assert len(train) == 1 and {e.info.session_id for e in train[0].episodes} == {r.session_id for r in driver.results}
            (evaluated,) = report["episodes"]
            assert pool.get_session(evaluated["session_id"]).purpose == "eval"
            assert report["harnesses"]["terminal"]["episodes"] == 1 and report["weight_version"] == 0


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


async def test_an_expert_plays_its_share_of_a_training_group_and_none_of_an_evaluation(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """expert_per_group = 1: one episode of each training group is the UI expert's, recorded through the gateway as
    an expert session of the group (its calls the expert's turns, scored by the verifier); evaluation has none."""
    from stepline.agents.ui.world import tasks

    task = next(t for t in tasks() if t.split == "train" and t.kind == "toggle")
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    end = tok.token_to_id(END)
    engine = FakeEngine([Scripted(tok.encode("Done.", add_special_tokens=False).ids + [end], text="Done.")] * 4,
                        eos_id=end, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    ui = HarnessSpec(name="ui", module="stepline.agents.ui", tasks=[task.id], max_turns=4, expert_per_group=1)
    async with engine as engine_url, gateway(tiny_model_dir, engine_url, tmp_path, "sglang") as (url, pool):
        async with GatewayClient(url, "adm") as client:
            driver = RolloutDriver(RolloutConfig(harnesses=[ui], group_size=2), client, tmp_path / "w")
            await driver.run(num_groups=1)
            evaluation = RolloutDriver(RolloutConfig(harnesses=[ui], group_size=2), client, tmp_path / "e", purpose="eval")
            await evaluation.run(num_groups=1)
        [policy], [expert] = driver.results, driver.expert_results
        assert (policy.reward, expert.reward) == (0.0, 1.0)
        episode = pool.get_episode(expert.session_id)
        assert episode.info.metadata["expert"] is True
        assert episode.info.group_id == pool.get_episode(policy.session_id).info.group_id
        assert len(episode.tree.calls) == len(task.plan) + 1  # each plan step, then "Done."
        assert len(evaluation.results) == 2 and not evaluation.expert_results


def test_expert_per_group_leaves_the_policy_a_share_and_needs_a_module() -> None:
    with pytest.raises(ValueError, match="leaves none of its groups of 2"):
        RolloutConfig(harnesses=[HarnessSpec(name="ui", module="stepline.agents.ui", expert_per_group=2)], group_size=2)
    with pytest.raises(ValueError, match="needs a module harness"):
        HarnessSpec(name="mine", command="true", tasks=["a"], expert_per_group=1)
