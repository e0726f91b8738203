"""The rollout driver against a stand-in of the gateway's session endpoints: external-command
harnesses, faults (crash, hang, garbage, throwing verifier), retries, the harness mix, and the
terminal harness end to end with a scripted model."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from session_standin import session_standin

from stepline.agents.ui.world import tasks as ui_tasks
from stepline.launch.job import load_job
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessError, HarnessSpec, RolloutConfig, list_tasks, training_tasks
from stepline.rollout.driver import RolloutDriver, Score, format_stats, parse_verdict, run_rollouts

PY = sys.executable


def _config(*harnesses: HarnessSpec, **kw: object) -> RolloutConfig:
    return RolloutConfig(harnesses=list(harnesses), **{"group_size": 2, "max_concurrency": 4, **kw})  # type: ignore[arg-type]


async def test_external_command_harness_gets_its_session_and_is_scored(tmp_path: Path) -> None:
    # The harness records its environment; the verifier rewards 1 when the task id reached it.
    harness = HarnessSpec(
        name="ext", tasks=["t1", "t2"],
        command='env | grep -E "^(OPENAI|ANTHROPIC|STEPLINE)_" > "$STEPLINE_OUT_DIR/env.txt"',
        verify_command='grep -q "^STEPLINE_TASK_ID=t1$" "$STEPLINE_OUT_DIR/env.txt" && echo \'{"reward": 1}\' '
                       '|| echo \'{"reward": 0.25, "success": false, "reason": "other task"}\'',
    )
    config = _config(harness, keep_episodes=True)
    async with session_standin("http://model") as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(config, client, tmp_path)
        stats = await driver.run(num_groups=4)
    assert len(gw.sessions) == 8 and set(gw.ends.values()) == {"completed"}
    for sid, body in gw.sessions.items():
        env = dict(line.split("=", 1) for line in (tmp_path / sid / "env.txt").read_text().splitlines())
        assert env["OPENAI_BASE_URL"] == "http://model/v1" and env["ANTHROPIC_BASE_URL"] == "http://model"
        assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == body["api_key"]
        assert env["STEPLINE_TASK_ID"] == body["task_id"] and env["STEPLINE_SESSION_ID"] == sid
        assert gw.rewards[sid] == [1.0 if body["task_id"] == "t1" else 0.25]
    # Groups: G=2 sessions of one task share an explicit group id, and groups differ.
    groups: dict[str, set[str]] = {}
    for body in gw.sessions.values():
        groups.setdefault(body["group_id"], set()).add(body["task_id"])
    assert len(groups) == 4 and all(len(tasks) == 1 for tasks in groups.values())
    # 4 groups drawn from a shuffled cycle of 2 tasks: each task twice -> 4 of 8 episodes succeed.
    assert stats["ext"]["episodes"] == 8 and stats["ext"]["success_rate"] == 0.5
    assert stats["ext"]["mean_reward"] == pytest.approx((4 * 1.0 + 4 * 0.25) / 8)


async def test_a_verdicts_step_rewards_train_and_a_refused_one_costs_only_itself(tmp_path: Path) -> None:
    verdict = '{"reward": 0.25, "step_rewards": {"0": 0.25, "1": 0.5, "7": 1.0}}'
    harness = HarnessSpec(name="ext", tasks=["t1"], command="true", verify_command=f"echo '{verdict}'")
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        gw.calls = 2
        trained = RolloutDriver(_config(harness), client, tmp_path / "train")
        await trained.run(num_groups=1)
        evaluated = RolloutDriver(_config(harness), client, tmp_path / "eval", purpose="eval")
        await evaluated.run(num_groups=1)
    for result in trained.results:  # the session has 2 calls: the step reward of call 7 is refused, the rest lands
        assert gw.rewards[result.session_id] == [0.25] and gw.ends[result.session_id] == "completed"
        assert gw.step_rewards[result.session_id] == {0: 0.25, 1: 0.5}
        assert "step reward of call 7" in result.reason
    assert not any(r.session_id in gw.step_rewards for r in evaluated.results)  # evaluation takes the score alone


async def test_a_relabelling_the_gateway_refuses_costs_only_itself(tmp_path: Path) -> None:
    # the stand-in has no demonstration endpoint: the relabelled session ends failed and unrewarded, the episode goes on
    episode = '{"messages": [{"role": "user", "content": "Turn on Vibrate."}, {"role": "assistant", "content": "Done."}]}'
    verdict = '{"reward": 0.25, "hindsight": "Turn on Wi-Fi."}'
    harness = HarnessSpec(name="ext", tasks=["t1"], hindsight=True, verify_command=f"echo '{verdict}'",
                          command=f"mkdir -p $STEPLINE_OUT_DIR/episode && echo '{episode}' > $STEPLINE_OUT_DIR/episode/episode.json")
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(_config(harness, group_size=1), client, tmp_path)
        await driver.run(num_groups=1)
    (result,) = driver.results
    assert (result.reward, driver.relabelled) == (0.25, 0) and "hindsight not recorded" in result.reason
    (relabelled,) = [sid for sid, body in gw.sessions.items() if body["metadata"].get("hindsight")]
    assert gw.sessions[relabelled]["metadata"]["expert"] is True
    assert gw.sessions[relabelled]["group_id"] == gw.sessions[result.session_id]["group_id"]
    assert (gw.ends[relabelled], relabelled in gw.rewards) == ("failed", False)
    assert (gw.ends[result.session_id], gw.rewards[result.session_id]) == ("completed", [0.25])


async def test_crash_hang_and_garbage_end_as_failed_and_the_job_goes_on(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    good = HarnessSpec(name="good", tasks=["a"], command="true", verify_command="echo '{\"reward\": 1.0}'")
    crash = HarnessSpec(name="crash", tasks=["a"], command="echo boom >&2; exit 3", verify_command="echo never")
    hang = HarnessSpec(name="hang", tasks=["a"], command=f"sleep 1000 & echo $! > {pidfile}; sleep 1000",
                       verify_command="echo never")
    garbage = HarnessSpec(name="garbage", tasks=["a"], command="head -c 300 /dev/urandom",
                          verify_command="head -c 300 /dev/urandom")
    throws = HarnessSpec(name="throws", tasks=["a"], command="true",
                         verify_command=f"{PY} -c 'raise SystemExit(\"verifier bug\")'")
    config = _config(good, crash, hang, garbage, throws, episode_timeout_s=1.0, group_size=1, max_concurrency=8)
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(config, client, tmp_path / "work")
        for spec in config.harnesses:
            await driver.run_group(spec, "a")
    by = {r.harness: r for r in driver.results}
    assert (by["good"].status, by["good"].reward, by["good"].success) == ("completed", 1.0, True)
    assert by["crash"].status == "failed" and by["crash"].reason == "harness exited with 3: boom"
    assert by["hang"].status == "failed" and by["hang"].reason == "harness timed out after 1s"
    assert by["garbage"].status == "completed" and by["garbage"].reason.startswith("verifier error")
    assert by["throws"].reward == 0.0 and by["throws"].reason.startswith("verifier error")
    for r in driver.results:  # every session was rewarded (failed: failed_reward 0) and ended
        assert gw.rewards[r.session_id] == [r.reward] and gw.ends[r.session_id] == r.status
    # The hung harness's background child died with its process group.
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # dirs cleaned up
    text = format_stats(driver.summary())
    assert "crash" in text and "hang" in text


async def test_failed_episode_is_retried_in_a_new_session_of_the_same_group(tmp_path: Path) -> None:
    marker = tmp_path / "tried"
    flaky = HarnessSpec(name="flaky", tasks=["a"], command=f"test -e {marker} || {{ touch {marker}; exit 1; }}",
                        verify_command="echo '{\"reward\": 1}'")
    config = _config(flaky, group_size=1, retries=2, score_failed=False)
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(config, client, tmp_path / "work")
        results = await driver.run_group(flaky, "a")
    assert [(r.status, r.attempt) for r in driver.results] == [("failed", 0), ("completed", 1)]
    assert results[0].success
    first, second = driver.results
    assert gw.ends == {first.session_id: "failed", second.session_id: "completed"}
    assert first.session_id not in gw.rewards  # score_failed off: no reward, the pool leaves it out
    assert gw.sessions[first.session_id]["group_id"] == gw.sessions[second.session_id]["group_id"]
    assert [gw.sessions[s]["metadata"]["attempt"] for s in (first.session_id, second.session_id)] == [0, 1]


async def test_harness_without_verifier_posts_its_own_reward(tmp_path: Path) -> None:
    post = (f"{PY} -c \"import os, urllib.request as u; u.urlopen(u.Request(os.environ['STEPLINE_REWARD_URL'], "
            "data=b'{\\\"value\\\": 0.5}', headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
            "'Content-Type': 'application/json'}))\"")
    config = _config(HarnessSpec(name="self", tasks=["a"], command=post), group_size=1)
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(config, client, tmp_path)
        await driver.run(num_groups=1)
    (sid,) = gw.sessions
    assert gw.rewards[sid] == [0.5] and gw.ends[sid] == "completed"
    assert driver.results[0].reward is None


async def test_gateway_busy_answers_are_retried(tmp_path: Path) -> None:
    spec = HarnessSpec(name="ext", tasks=["a"], command="true", verify_command="echo '{\"reward\": 1}'")
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        original = client.post_reward

        async def flaky_first(session_id: str, value: float) -> None:
            gw.fail_reward_once.add(session_id)  # the stand-in answers 503 once, then accepts
            await original(session_id, value)

        client.post_reward = flaky_first  # type: ignore[method-assign]
        driver = RolloutDriver(_config(spec, group_size=1), client, tmp_path)
        await driver.run(num_groups=1)
    assert list(gw.rewards.values()) == [[1.0]] and driver.results[0].reason == ""


async def test_harness_mix_follows_the_weights(tmp_path: Path) -> None:
    ok = "echo '{\"reward\": 1}'"
    a = HarnessSpec(name="a", tasks=["x"], command="true", verify_command=ok, weight=3.0)
    b = HarnessSpec(name="b", tasks=["y"], command="true", verify_command="echo '{\"reward\": 0}'", weight=1.0)
    config = _config(a, b, group_size=1, max_concurrency=8)
    async with session_standin() as gw:
        stats, results = await run_rollouts(config, gw.url, num_groups=40, admin_token="admin")
    assert stats["a"]["episodes"] + stats["b"]["episodes"] == 40
    assert 22 <= stats["a"]["episodes"] <= 38  # expectation 30 (3:1), seeded draw
    assert stats["a"]["success_rate"] == 1.0 and stats["b"]["success_rate"] == 0.0
    assert stats["a"]["episodes_per_s"] > 0


async def test_training_draws_only_the_tasks_the_curriculum_matches(tmp_path: Path) -> None:
    # The harness prints its task id; only ids matching the pattern reach training, evaluation sees every task.
    spec = HarnessSpec(name="cat", module="stepline.agents.search", train_tasks_matching="^search-000[0-4]$")
    every = list_tasks(spec)
    assert training_tasks(spec) == [t for t in every if t in {"search-0000", "search-0001", "search-0002",
                                                              "search-0003", "search-0004"}] != every
    ran = HarnessSpec(name="ext", tasks=["keep-1", "keep-2", "drop-1"], train_tasks_matching="^keep-",
                      command="echo $STEPLINE_TASK_ID >> " + str(tmp_path / "ids"), verify_command="echo '{\"reward\": 1}'")
    async with session_standin() as gw:
        await run_rollouts(_config(ran, group_size=1), gw.url, num_groups=6, admin_token="admin")
    assert set((tmp_path / "ids").read_text().split()) == {"keep-1", "keep-2"}
    with pytest.raises(ValueError, match="not a regular expression"):
        HarnessSpec(name="x", module="m", train_tasks_matching="(")
    with pytest.raises(HarnessError, match="train_tasks_matching '\\^z' matches none of its 3 tasks"):
        training_tasks(HarnessSpec(name="x", tasks=["a", "b", "c"], command="true", train_tasks_matching="^z"))


def test_training_draws_only_the_kinds_the_curriculum_names() -> None:
    spec = HarnessSpec(name="ui", module="stepline.agents.ui", train_kinds=["toggle", "buy"])
    kinds = {t.id: t.kind for t in ui_tasks() if t.split == "train"}
    drawn = training_tasks(spec)
    assert drawn == [t for t in list_tasks(spec) if kinds[t] in ("toggle", "buy")]
    assert {kinds[t] for t in drawn} == {"toggle", "buy"} and len(drawn) < len(kinds)
    with pytest.raises(HarnessError, match=r"train_kinds \['tap'\] are not kinds of its tasks \(its kinds: \['add', 'ask'"):
        training_tasks(HarnessSpec(name="ui", module="stepline.agents.ui", train_kinds=["toggle", "tap"]))
    with pytest.raises(HarnessError, match=r"train_kinds \['ask'\] match none of its 1 tasks"):  # ui-0000: a toggle
        training_tasks(HarnessSpec(name="ui", module="stepline.agents.ui", train_kinds=["ask"],
                                   train_tasks_matching="^ui-0000$"))
    with pytest.raises(HarnessError, match="--kinds failed: (?s:.*)this harness.s tasks have no kinds"):
        training_tasks(HarnessSpec(name="s", module="stepline.agents.search", train_kinds=["x"]))
    with pytest.raises(ValueError, match="train_kinds reads a module's task kinds"):
        HarnessSpec(name="x", tasks=["a"], command="true", train_kinds=["toggle"])


def test_a_kind_weighted_curriculum_repeats_each_task_of_a_kind_by_its_weight() -> None:
    """{toggle = 3, buy = 1}: each toggle task comes 3 times per pass over the tasks, each buy task once, so
    the shuffled draw gives toggles 3 times their share; the other kinds are left out as with a list."""
    kinds = {t.id: t.kind for t in ui_tasks() if t.split == "train"}
    spec = HarnessSpec(name="ui", module="stepline.agents.ui", train_kinds={"toggle": 3, "buy": 1})
    drawn = training_tasks(spec)
    toggles = [t for t in list_tasks(spec) if kinds[t] == "toggle"]
    buys = [t for t in list_tasks(spec) if kinds[t] == "buy"]
    assert sorted(drawn) == sorted(toggles * 3 + buys) and len(toggles) > 0 and len(buys) > 0
    with pytest.raises(ValueError, match=r"a kind's weight is how many times .* at least 1 .*\{'toggle': 0\}"):
        HarnessSpec(name="ui", module="stepline.agents.ui", train_kinds={"toggle": 0})


def test_config_validation_and_job_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of module or command"):
        HarnessSpec(name="x")
    with pytest.raises(ValueError, match="needs a tasks list"):
        HarnessSpec(name="x", command="true")
    with pytest.raises(ValueError, match="duplicate names"):
        RolloutConfig(harnesses=[HarnessSpec(name="t", module="m"), HarnessSpec(name="t", module="m")])
    job = tmp_path / "job.toml"
    job.write_text('[rollout]\ngroup_size = 3\n[[rollout.harnesses]]\nname = "terminal"\nmodule = "stepline.agents.terminal"\n')
    config = load_job(job).rollout  # the one job loader (stepline.launch.job)
    assert config.group_size == 3 and config.harnesses[0].module == "stepline.agents.terminal"


def test_parse_verdict() -> None:
    assert parse_verdict('noise\n{"reward": 1, "success": true, "reason": "ok"}\n') == Score(1.0, True, "ok")
    assert parse_verdict('{"reward": 0.5}') == Score(0.5, False, "")
    # a training episode is rewarded what the verifier says training should optimise; success stays the score's
    guess = '{"reward": 1.0, "success": true, "reason": "r", "train_reward": 0.0}'
    assert parse_verdict(guess, train=True) == Score(0.0, True, "r")
    assert parse_verdict(guess) == Score(1.0, True, "r")
    with pytest.raises(ValueError, match="train_reward is not a finite number"):
        parse_verdict('{"reward": 1.0, "train_reward": "no"}', train=True)
    # step rewards ({call index: reward}, JSON's string keys) are for training; evaluation reads the score alone
    stepped = '{"reward": 0.25, "step_rewards": {"0": 0.25, "2": 0.5}}'
    assert parse_verdict(stepped, train=True).step_rewards == {0: 0.25, 2: 0.5}
    assert parse_verdict(stepped).step_rewards is None
    for steps in ['[0.25]', '{"-1": 0.25}', '{"first": 0.25}', '{"0": "high"}', '{"0": true}']:
        with pytest.raises(ValueError, match="step_rewards"):
            parse_verdict(f'{{"reward": 0.25, "step_rewards": {steps}}}', train=True)
    # a failed episode's hindsight message (what it did achieve) is for training too, and must be a message's text
    relabelled = '{"reward": 0.25, "hindsight": "Turn on Wi-Fi."}'
    assert (parse_verdict(relabelled, train=True).hindsight, parse_verdict(relabelled).hindsight) == ("Turn on Wi-Fi.", None)
    with pytest.raises(ValueError, match="hindsight is not a message's text"):
        parse_verdict('{"reward": 0.25, "hindsight": ["Turn on Wi-Fi."]}', train=True)
    for bad in ["", "not json", '{"reward": "1"}', '{"reward": NaN}', "[1]", '{"reward": true}']:
        with pytest.raises((ValueError, KeyError)):
            parse_verdict(bad)


async def test_terminal_harness_through_the_driver_with_a_scripted_model(tmp_path: Path) -> None:
    """The real terminal harness (module contract) driven by the driver; the 'model' answers each
    task's prompt with its expert command, so every episode must score 1."""
    from stepline.agents.common.scripted_server import Reply, ScriptedServer
    from stepline.agents.terminal.tasks import get_task, task_ids

    tasks = task_ids("test")[:4]
    solution = {get_task(t).prompt: get_task(t).expert_command for t in tasks}

    def policy(body: dict) -> Reply:
        if len(body["messages"]) > 1:
            return Reply("done")
        return Reply(None, [("bash", {"command": solution[body["messages"][0]["content"]]})])

    spec = HarnessSpec(name="terminal", module="stepline.agents.terminal", tasks=tasks)
    with ScriptedServer(policy) as model:
        async with session_standin(model.url) as gw, GatewayClient(gw.url, "admin") as client:
            driver = RolloutDriver(_config(spec, group_size=2, max_concurrency=4), client, tmp_path)
            stats = await driver.run(num_groups=2)
    assert stats["terminal"]["episodes"] == 4 and stats["terminal"]["success_rate"] == 1.0, driver.results
    assert all(r == [1.0] for r in gw.rewards.values())


async def test_cancelling_an_episode_kills_its_process_group_at_once(tmp_path: Path) -> None:
    """Ctrl-C cancels the rollout tasks: the harness and whatever it started die, the cancellation is not lost."""
    import asyncio

    from stepline.rollout.driver import run_process

    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    task = asyncio.create_task(run_process([sys.executable, "-c", script], os.environ, tmp_path, 60, tmp_path / "log"))
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 5
    grandchild = int(pid_file.read_text())
    await asyncio.sleep(0.2)
    stat = Path(f"/proc/{grandchild}/stat")
    state = stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "X"
    assert state in ("Z", "X"), "the harness's own child outlived the cancelled episode"


async def test_a_harness_group_size_overrides_the_rollouts(tmp_path: Path) -> None:
    hard = HarnessSpec(name="hard", tasks=["a"], command="true", verify_command="echo '{\"reward\": 0}'", group_size=5)
    easy = HarnessSpec(name="easy", tasks=["b"], command="true", verify_command="echo '{\"reward\": 1}'")
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        driver = RolloutDriver(_config(hard, easy, max_concurrency=8), client, tmp_path)
        for spec in (hard, easy):
            await driver.run_group(spec, spec.tasks[0])  # type: ignore[index]
        await driver.run_group(hard, "a", group_size=1)  # evaluation asks for 1 and gets 1
    sizes: dict[str, int] = {}
    for body in gw.sessions.values():
        sizes[body["group_id"]] = sizes.get(body["group_id"], 0) + 1
    assert sorted(sizes.values()) == [1, 2, 5]
