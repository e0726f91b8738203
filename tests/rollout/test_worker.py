"""The rollout driver with long-lived harness workers (stepline/rollout/worker.py, stepline/agents/common/serve.py):
the same verdicts as one process per episode, each episode with its own session key, and the faults
(a worker that crashes, hangs or lacks a serve module; an episode that times out or is cancelled)."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading
import time
from pathlib import Path

import pytest
from session_standin import session_standin

from stepline.agents.common.scripted_server import Reply, ScriptedServer
from stepline.rollout import worker as rollout_worker
from stepline.rollout.client import GatewayClient
from stepline.rollout.config import HarnessSpec, RolloutConfig
from stepline.rollout.driver import RolloutDriver

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"search": ["search-0004", "search-0009"], "ui": ["ui-0003", "ui-0008"],
         "terminal": ["write-cow-0", "count-fox-1"]}  # first task: the model plays the expert; second: it gives up


def expert_replies(harness: str, task_id: str) -> tuple[str, list[Reply]]:
    """The user prompt of a task and the expert's answers to it, as a scripted model would give them."""
    if harness == "terminal":
        from stepline.agents.terminal.tasks import get_task

        task = get_task(task_id)
        return task.prompt, [Reply(None, [("bash", {"command": task.expert_command})]), Reply("done")]
    from stepline.agents.search.harness import play as search_play
    from stepline.agents.ui.harness import play as ui_play

    episode = {"search": search_play, "ui": ui_play}[harness](task_id, 4, expert=True)
    replies = [Reply(m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])])
               for m in episode.messages if m["role"] == "assistant"]
    return episode.messages[1]["content"], replies


def first_user_text(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def scripted(script: dict[str, list[Reply]]):
    """A model that answers a conversation (known by its first user message) with the next scripted reply."""

    def policy(body: dict) -> Reply:
        replies = script.get(first_user_text(body), [])
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return replies[turn] if turn < len(replies) else Reply("I do not know.")

    return policy


def config(*specs: HarnessSpec, **kw: object) -> RolloutConfig:
    return RolloutConfig(harnesses=list(specs), **{"group_size": 1, "max_concurrency": 4, **kw})  # type: ignore[arg-type]


async def test_worker_and_processes_score_model_episodes_alike(tmp_path: Path) -> None:
    script = dict(expert_replies(h, tasks[0]) for h, tasks in TASKS.items())
    outcomes: dict[bool, dict[tuple[str, str], tuple]] = {}
    with ScriptedServer(scripted(script)) as model:
        for persistent in (True, False):
            specs = [HarnessSpec(name=h, module=f"stepline.agents.{h}", tasks=t, max_tokens=77, persistent=persistent)
                     for h, t in TASKS.items()]
            async with session_standin(model.url) as gw, GatewayClient(gw.url, "admin") as client:
                async with RolloutDriver(config(*specs), client, tmp_path / str(persistent)) as driver:
                    await asyncio.gather(*(driver.run_group(s, t) for s in specs for t in s.tasks or []))
                    assert {m: w.starts for m, w in driver.workers.items()} == (
                        {f"stepline.agents.{h}": 1 for h in TASKS} if persistent else {})
            outcomes[persistent] = {(r.harness, r.task_id): (r.status, r.reward, r.success, r.reason)
                                    for r in driver.results}
    assert outcomes[True] == outcomes[False]
    for (harness, task_id), (status, reward, success, _) in outcomes[True].items():
        assert (status, reward, success) == (("completed", 1.0, True) if task_id == TASKS[harness][0]
                                             else ("completed", 0.0, False)), (harness, task_id)
    assert {body["max_tokens"] for body in model.requests} == {77}


async def test_concurrent_episodes_in_one_worker_each_use_their_own_session_key(tmp_path: Path) -> None:
    """Two episodes of different tasks are held at their first model call until both have made it, so
    they run at once in one worker; every call of each must carry its own session's key."""
    tasks = TASKS["search"]
    script = dict(expert_replies("search", t) for t in tasks)
    both_asked = threading.Barrier(2, timeout=60)

    def policy(body: dict) -> Reply:
        if len(body["messages"]) == 2:
            both_asked.wait()
        return scripted(script)(body)

    spec = HarnessSpec(name="search", module="stepline.agents.search", tasks=tasks)  # persistent by default
    with ScriptedServer(policy) as model:
        async with session_standin(model.url) as gw, GatewayClient(gw.url, "admin") as client:
            async with RolloutDriver(config(spec), client, tmp_path) as driver:
                await asyncio.gather(*(driver.run_group(spec, t) for t in tasks))
                assert driver.workers["stepline.agents.search"].starts == 1
    assert [r.reward for r in driver.results] == [1.0, 1.0], driver.results
    key_of_task = {body["task_id"]: body["api_key"] for body in gw.sessions.values()}
    task_of_prompt = {expert_replies("search", t)[0]: t for t in tasks}
    seen: dict[str, set[str | None]] = {}
    for body, key in zip(model.requests, model.api_keys, strict=True):
        seen.setdefault(task_of_prompt[first_user_text(body)], set()).add(key)
    assert seen == {t: {key_of_task[t]} for t in tasks}


FAKE_SERVE = '''
"""A fake harness worker whose episodes misbehave on purpose (tests/rollout/test_worker.py)."""
import os, signal, sys, time
from pathlib import Path
from stepline.agents.common import Episode, Verdict, verdict_for
from stepline.agents.common.serve import ServedHarness, serve_command

DIR = Path(os.environ["FAKEH_DIR"])


def play(task_id, out, max_turns, max_tokens, expert):
    print("a stray print on stdout")  # must not reach the protocol
    if task_id == "hold":
        (DIR / "hold.pid").write_text(str(os.getpid()))
        time.sleep(120)
    if task_id == "crash":  # kill the worker while "hold" is in flight
        while not (DIR / "hold.pid").exists():
            time.sleep(0.02)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(120)
    if task_id == "die":
        print("dying", file=sys.stderr)
        os._exit(3)
    if task_id == "boom":
        raise RuntimeError("boom")
    return Episode(harness="fakeh", task_id=task_id, finish="final_message", final=os.environ["OPENAI_API_KEY"])


def score(task_id, episode):
    return Verdict(reward=1.0, success=True, reason=f"played with {episode.final}")


known = lambda task_id: task_id in {"ok", "hold", "crash", "die", "boom"}
main = serve_command(ServedHarness("fakeh", play, lambda t, out: verdict_for("fakeh", score, known, t, out), known, 4,
                                   lambda: print("warming up, on stdout")))

if __name__ == "__main__":
    print("importing, on stdout")
    marker = os.environ.get("FAKEH_HANG_ONCE")
    if marker and not Path(marker).exists():  # the first worker says ready, then never answers
        Path(marker).write_text(str(os.getpid()))
        print('{"ready": true}', flush=True)
        time.sleep(600)
    main()
'''


@pytest.fixture
def fake_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HarnessSpec:
    package = tmp_path / "pkgs" / "fakeh"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "serve.py").write_text(textwrap.dedent(FAKE_SERVE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkgs"), str(ROOT)]))
    monkeypatch.setenv("FAKEH_DIR", str(tmp_path))
    return HarnessSpec(name="fakeh", module="fakeh", tasks=["ok"])


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
        if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
            return True
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


async def test_episode_faults_inside_a_worker_fail_only_that_episode(fake_harness: HarnessSpec, tmp_path: Path) -> None:
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        async with RolloutDriver(config(fake_harness, keep_episodes=True), client, tmp_path / "w") as driver:
            results = {t: (await driver.run_episode(fake_harness, t, None)) for t in ["die", "boom", "ok"]}
            assert driver.workers["fakeh"].starts == 1
    assert (results["die"].status, results["die"].reason) == ("failed", "harness exited with 3: dying")
    assert (results["boom"].status, results["boom"].reason) == ("failed", "episode failed: harness crashed: RuntimeError: boom")
    ok = results["ok"]
    assert (ok.status, ok.reward) == ("completed", 1.0)
    assert ok.reason == f"played with {gw.sessions[ok.session_id]['api_key']}"  # the episode's own key
    assert "a stray print" in (tmp_path / "w" / ok.session_id / "harness.stdout").read_text()
    for r in results.values():
        assert gw.ends[r.session_id] == r.status and gw.rewards[r.session_id] == [r.reward]


async def test_a_crashed_worker_fails_its_episodes_in_flight_and_is_restarted(fake_harness: HarnessSpec,
                                                                               tmp_path: Path) -> None:
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        async with RolloutDriver(config(fake_harness), client, tmp_path / "w") as driver:
            hold, crash = await asyncio.gather(driver.run_episode(fake_harness, "hold", None),
                                               driver.run_episode(fake_harness, "crash", None))
            first = driver.workers["fakeh"]
            after = await driver.run_episode(fake_harness, "ok", None)
            assert first.starts == 2
    for r in (hold, crash):
        assert r.status == "failed" and r.reason.startswith("harness worker exited with -9"), r.reason
    assert gone(int((tmp_path / "hold.pid").read_text()))  # the worker's other child died with it
    assert (after.status, after.reward) == ("completed", 1.0)


async def test_a_hung_worker_is_killed_and_restarted(fake_harness: HarnessSpec, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEH_HANG_ONCE", str(tmp_path / "hung.pid"))
    monkeypatch.setattr(rollout_worker, "GRACE_S", 0.5)
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        cfg = config(fake_harness, episode_timeout_s=1.0, verify_timeout_s=1.0)
        async with RolloutDriver(cfg, client, tmp_path / "w") as driver:
            hung = await driver.run_episode(fake_harness, "ok", None)
            again = await driver.run_episode(fake_harness, "ok", None)
            assert driver.workers["fakeh"].starts == 2
    assert (hung.status, hung.reason) == ("failed", "harness worker hung: no answer in 2.5s; killed, to be restarted")
    assert gone(int((tmp_path / "hung.pid").read_text()))
    assert (again.status, again.reward) == ("completed", 1.0)
    assert gw.ends[hung.session_id] == "failed" and gw.rewards[hung.session_id] == [0.0]


async def test_cancelling_an_episode_kills_its_child_in_the_worker(fake_harness: HarnessSpec, tmp_path: Path) -> None:
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        async with RolloutDriver(config(fake_harness), client, tmp_path / "w") as driver:
            task = asyncio.create_task(driver.run_episode(fake_harness, "hold", None))
            pid_file = tmp_path / "hold.pid"
            deadline = time.monotonic() + 60
            while not pid_file.exists() or not pid_file.read_text():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert gone(int(pid_file.read_text()))
            worker = driver.workers["fakeh"].pid
            assert (await driver.run_episode(fake_harness, "ok", None)).reward == 1.0
            assert driver.workers["fakeh"].pid == worker  # the worker itself lives on


async def test_episode_timeout_kills_the_terminal_sandbox_and_the_worker_lives_on(tmp_path: Path) -> None:
    marker = "987.654"  # a sleep nobody else runs: how its process is found on the host
    task_id, *_ = TASKS["terminal"]
    prompt, _ = expert_replies("terminal", task_id)
    script = {prompt: [Reply(None, [("bash", {"command": f"touch started; sleep {marker}"})])]}
    spec = HarnessSpec(name="terminal", module="stepline.agents.terminal", tasks=[task_id])
    with ScriptedServer(scripted(script)) as model:
        async with session_standin(model.url) as gw, GatewayClient(gw.url, "admin") as client:
            cfg = config(spec, episode_timeout_s=5.0, keep_episodes=True)
            async with RolloutDriver(cfg, client, tmp_path) as driver:
                episode = asyncio.create_task(driver.run_episode(spec, task_id, None))
                # The command ran: its sleep shows on the host while the episode lasts (its files live in the
                # episode's quota tmpfs, which dies with the killed harness: stepline/agents/terminal/quota.py).
                while not (started := _sleepers(marker, within_s=0)) and not episode.done():
                    await asyncio.sleep(0.05)
                timed_out = await episode
                assert timed_out.reason == "harness timed out after 5s"
                assert started != []
                # Gone at once, long before the sandbox's own 10 s limit per command would end it
                # (stepline/agents/terminal/sandbox.py), and the episode never got to ask the model again.
                assert _sleepers(marker, within_s=3) == []
                assert len(model.requests) == 1
                worker = driver.workers["stepline.agents.terminal"].pid
                model.policy = scripted(dict([expert_replies("terminal", task_id)]))
                assert (await driver.run_episode(spec, task_id, None)).reward == 1.0
                assert driver.workers["stepline.agents.terminal"].pid == worker


def _sleepers(marker: str, within_s: float) -> list[int]:
    """Processes whose command line has the marker, once they had `within_s` to die."""
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marker in (proc / "cmdline").read_text() and \
                        (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


async def test_a_module_without_serve_runs_one_process_per_episode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkgs" / "plainh"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text("")
    (package / "verify.py").write_text('print(\'{"reward": 1, "reason": "process verifier"}\')')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkgs"), str(ROOT)]))
    spec = HarnessSpec(name="plain", module="plainh", tasks=["a"])
    async with session_standin() as gw, GatewayClient(gw.url, "admin") as client:
        async with RolloutDriver(config(spec), client, tmp_path / "w") as driver:
            first = await driver.run_episode(spec, "a", None)
            second = await driver.run_episode(spec, "a", None)
            assert driver.workers["plainh"].starts == 1  # tried once, then processes
    assert [(r.status, r.reward, r.reason) for r in (first, second)] == [("completed", 1.0, "process verifier")] * 2

