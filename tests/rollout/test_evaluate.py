"""`stepline eval`: the test split of every harness, sessions tagged eval, success per harness as JSON."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from click.testing import CliRunner
from session_standin import StandIn, session_standin

from stepline.launch.commands import eval_command
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessSpec, RolloutConfig
from stepline.rollout.driver import RolloutDriver
from stepline.rollout.evaluate import evaluate

ONE = "echo '{\"reward\": 1, \"success\": true}'"
ZERO = "echo '{\"reward\": 0}'"


def _config() -> RolloutConfig:
    return RolloutConfig(harnesses=[
        HarnessSpec(name="good", tasks=["a", "b", "c"], command="true", verify_command=ONE),
        HarnessSpec(name="bad", tasks=["x", "y"], command="true", verify_command=ZERO, weight=5.0),
    ], group_size=4, retries=3)


async def test_every_task_once_tagged_eval() -> None:
    async with session_standin() as gw:
        report = await evaluate(_config(), gw.url, "admin", limit=2)
    assert report["harnesses"]["good"]["success_rate"] == 1.0 and report["harnesses"]["bad"]["success_rate"] == 0.0
    # limit 2 per harness, one session per task (group size and weights do not apply)
    assert sorted(body["task_id"] for body in gw.sessions.values()) == ["a", "b", "x", "y"]
    for body in gw.sessions.values():
        assert body["metadata"] == {"split": "test", "attempt": 0} and body["purpose"] == "eval"
        assert body["group_id"].startswith("eval::")
    assert report["weight_version"] is None  # the stand-in has no /health


async def test_sessions_carry_the_temperature_of_the_rollouts_or_of_the_evaluation() -> None:
    config = _config().model_copy(update={"temperature": 0.7})
    async with session_standin() as gw:
        await evaluate(config, gw.url, "admin", limit=1)
        trained = list(gw.sessions.values())
        gw.sessions.clear()
        await evaluate(config, gw.url, "admin", limit=1, temperature=0.0)
        greedy = list(gw.sessions.values())
        gw.sessions.clear()
        await evaluate(_config(), gw.url, "admin", limit=1)
        unset = list(gw.sessions.values())
    assert [b["sampling"] for b in trained] == [{"temperature": 0.7}] * 2
    assert [b["sampling"] for b in greedy] == [{"temperature": 0.0}] * 2
    assert all("sampling" not in b for b in unset)  # the harness's own sampling


async def test_a_harness_temperature_is_for_training_episodes_only(tmp_path: Path) -> None:
    hot = HarnessSpec(name="hot", tasks=["a"], command="true", verify_command=ONE, temperature=1.3)
    config = RolloutConfig(harnesses=[hot, *_config().harnesses], group_size=2, temperature=0.7)
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(config, client, tmp_path)
        for spec in config.harnesses:
            await driver.run_group(spec, spec.tasks[0])  # type: ignore[index]
        trained = {b["harness"]: b["sampling"] for b in gw.sessions.values()}
        gw.sessions.clear()
        await evaluate(config, gw.url, "admin", limit=1)
        evaluated = {b["harness"]: b["sampling"] for b in gw.sessions.values()}
    assert trained == {"hot": {"temperature": 1.3}, "good": {"temperature": 0.7}, "bad": {"temperature": 0.7}}
    assert evaluated == {"hot": {"temperature": 0.7}, "good": {"temperature": 0.7}, "bad": {"temperature": 0.7}}


@contextmanager
def standin_in_thread() -> Iterator[StandIn]:
    """The stand-in on its own loop, for a CLI that runs asyncio.run itself."""
    ready, stop = threading.Event(), None
    holder: list[StandIn] = []

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with session_standin() as gw:
            holder.append(gw)
            ready.set()
            await stop.wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    ready.wait(10)
    try:
        yield holder[0]
    finally:
        loop.call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        thread.join(10)
        loop.close()


def test_cli_prints_success_per_harness_and_writes_json(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        "[rollout]\n[[rollout.harnesses]]\nname = \"good\"\ncommand = \"true\"\ntasks = [\"a\"]\n"
        f"verify_command = \"\"\"{ONE}\"\"\"\n"
    )
    out = tmp_path / "eval.json"
    runner = CliRunner()
    assert runner.invoke(eval_command, [str(job)], env={"STEPLINE_GATEWAY_URL": ""}).exit_code == 2
    with standin_in_thread() as gw:
        result = runner.invoke(eval_command, [str(job), "--gateway", gw.url, "--admin-token", "admin", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "good" in result.output and "1.000" in result.output
    report = json.loads(out.read_text())
    assert report["split"] == "test" and report["harnesses"]["good"]["episodes"] == 1


def test_spread_takes_evenly_spaced_tasks():
    from stepline.rollout.evaluate import spread

    ids = [f"t{i}" for i in range(10)]
    # i * 10 // 3 for i = 0, 1, 2 -> 0, 3, 6: every kind of an ordered list is sampled, not just the first
    assert spread(ids, 3) == ["t0", "t3", "t6"]
    assert spread(ids, None) == ids and spread(ids, 50) == ids
