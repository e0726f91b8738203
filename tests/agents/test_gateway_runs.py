"""The search and UI harnesses end to end through the real gateway, driven by the rollout driver and
recording into a real SQLite pool: a scripted engine that plays the expert (each episode must score 1),
and the built-in CPU engine serving the tiny random model (episodes complete and land in the pool
with their rewards and groups)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fakes.engine import FakeEngine, Scripted, recording_gateway
from tokenizers import Tokenizer

from stepline.agents.common import Episode, run_episode
from stepline.agents.search.harness import play as search_play
from stepline.agents.ui.harness import SYSTEM, ExpertPolicy, make_app, make_tools
from stepline.agents.ui.harness import play as ui_play
from stepline.agents.ui.world import task_by_id, toggle_text
from stepline.datapool.records import HINDSIGHT_KEY
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessSpec, RolloutConfig
from stepline.rollout.driver import RolloutDriver

END = "<|im_end|>"
EXPERTS = {"search": ("search-0004", search_play), "ui": ("ui-0003", ui_play)}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def gateway(model_dir: Path, engine_url: str, tmp_path: Path, kind: str):
    return recording_gateway(model_dir, engine_url, tmp_path / "pool.db", kind)


def hermes_text(message: dict[str, Any]) -> str:
    """What the model writes for one assistant message: its text, then any Hermes <tool_call> blocks."""
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in message.get("tool_calls", [])]
    blocks = [f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls]
    return "\n".join([message["content"], *blocks] if message.get("content") else blocks)


@pytest.mark.parametrize("harness", sorted(EXPERTS))
async def test_expert_played_by_the_engine_through_the_gateway_scores_one(harness: str, tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    task_id, play = EXPERTS[harness]
    texts = [hermes_text(m) for m in play(task_id, 4, expert=True).messages if m["role"] == "assistant"]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    end = tok.token_to_id(END)
    script = [Scripted(tok.encode(t, add_special_tokens=False).ids + [end], text=t) for t in texts]
    engine = FakeEngine(script, eos_id=end, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    spec = HarnessSpec(name=harness, module=f"stepline.agents.{harness}", tasks=[task_id])
    async with engine as engine_url, gateway(tiny_model_dir, engine_url, tmp_path, "sglang") as (url, pool):
        async with GatewayClient(url, "adm") as client:
            driver = RolloutDriver(RolloutConfig(harnesses=[spec], group_size=1), client, tmp_path / "w")
            await driver.run(num_groups=1)
        (result,) = driver.results
        assert (result.status, result.reward) == ("completed", 1.0), result.reason
        episode = pool.get_episode(result.session_id)
        assert episode.info.harness == harness and episode.outcome == 1.0
        assert len(episode.tree.calls) == len(texts)  # every model call of the episode was recorded
        if harness == "ui":  # ask, tap the answer, tap Favorite: each plan step's credit at the call that reached it
            (trajectory,) = episode.trajectories
            assert [round(step.reward, 4) for step in trajectory.steps] == [round(0.5 / 3, 4)] * 3 + [0.0]


async def test_tiny_model_episodes_of_both_harnesses_land_in_the_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    from stepline.engine.testing import running_engine

    specs = [HarnessSpec(name=h, module=f"stepline.agents.{h}", tasks=[EXPERTS[h][0]], max_turns=2) for h in sorted(EXPERTS)]
    config = RolloutConfig(harnesses=specs, group_size=1, episode_timeout_s=120)
    with running_engine(tiny_model_dir) as engine_url:
        async with gateway(tiny_model_dir, engine_url, tmp_path, "builtin") as (url, pool):
            async with GatewayClient(url, "adm") as client:
                driver = RolloutDriver(config, client, tmp_path / "w")
                stats = await driver.run(num_groups=4)
            assert {h: stats[h]["episodes"] for h in EXPERTS} == {"search": 2, "ui": 2}
            for r in driver.results:
                assert r.status == "completed", r.reason  # the random model's episode runs to its end
                episode = pool.get_episode(r.session_id)
                assert episode.outcome == r.reward and 1 <= len(episode.tree.calls) <= 2
            groups = pool.claim_groups("test", min_version=0, max_groups=10, group_size=1)
            # one group per draw; the driver's group ids start with task::harness
            keys = sorted(g.episodes[0].info.group_key.rsplit("::", 1)[0] for g in groups)
            assert keys == ["search-0004::search"] * 2 + ["ui-0003::ui"] * 2


async def test_a_failed_ui_episode_is_recorded_again_under_what_it_did(tiny_model_dir: Path, tmp_path: Path) -> None:
    # "Turn on Do not disturb.": the policy opens Sound, reads down to Vibrate and turns that on instead
    task = task_by_id()["ui-0004"]
    wrong = replace(task, instruction=toggle_text("Vibrate", not task.data["toggles"]["Vibrate"]),
                    plan=(("tap", "Sound"), ("tap", "Vibrate")))
    policy = ExpertPolicy(wrong, make_app(wrong).render())
    app = make_app(wrong)
    episode = Episode(harness="ui", task_id=task.id)
    run_episode(policy, episode, system=SYSTEM, user="", tools=make_tools(app, wrong), max_turns=4)
    texts = [hermes_text(m) for m in episode.messages if m["role"] == "assistant"]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    end = tok.token_to_id(END)
    script = [Scripted(tok.encode(t, add_special_tokens=False).ids + [end], text=t) for t in texts]
    engine = FakeEngine(script, eos_id=end, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    spec = HarnessSpec(name="ui", module="stepline.agents.ui", tasks=[task.id], hindsight=True)
    async with engine as engine_url, gateway(tiny_model_dir, engine_url, tmp_path, "sglang") as (url, pool):
        async with GatewayClient(url, "adm") as client:
            driver = RolloutDriver(RolloutConfig(harnesses=[spec], group_size=1), client, tmp_path / "w")
            await driver.run(num_groups=1)
        (result,) = driver.results
        assert (result.reward, result.success, driver.relabelled) == (0.25, False, 1), result.reason
        (group,) = pool.claim_groups("test", min_version=0, max_groups=2, group_size=2)
        played, relabelled = sorted(group.episodes, key=lambda e: e.info.expert)
        assert played.info.session_id == result.session_id and not played.info.expert
        assert relabelled.info.expert and relabelled.info.metadata[HINDSIGHT_KEY] is True
        assert (played.outcome, relabelled.outcome) == (0.25, 1.0)
        # the same turns, the first user message naming what the episode did
        assert len(relabelled.tree.calls) == len(played.tree.calls) == len(texts)
        prompts = [tok.decode([int(t) for n in e.tree.nodes if n.kind == "obs" and n.call_index == 0 for t in n.tokens],
                              skip_special_tokens=False) for e in (played, relabelled)]
        assert task.instruction in prompts[0] and wrong.instruction not in prompts[0]
        assert wrong.instruction in prompts[1] and task.instruction not in prompts[1]
