"""The terminal harness: task set, expert, verifier, and the model loop through the real Anthropic SDK."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stepline.agents.common import read_episode
from stepline.agents.common.scripted_server import RawReply, Reply, ScriptedServer
from stepline.agents.terminal.episode import expert_episode, new_episode, open_sandbox
from stepline.agents.terminal.tasks import NAMES, TEST_EVERY, get_task, task_ids
from stepline.agents.terminal.verify import score

ROOT = Path(__file__).resolve().parents[2]


def _cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )


def test_split_is_fixed_and_by_entity() -> None:
    train, test = task_ids("train"), task_ids("test")
    # 40 names, every 5th held out: 32 train / 8 test names × 9 kinds × 2 variants.
    assert (len(train), len(test)) == (32 * 9 * 2, 8 * 9 * 2)
    names = lambda ids: {get_task(i).name for i in ids}  # noqa: E731
    assert names(train).isdisjoint(names(test))
    assert names(test) == {NAMES[i] for i in range(TEST_EVERY - 1, len(NAMES), TEST_EVERY)}
    assert json.loads(_cli("stepline.agents.terminal.tasks", "--split", "test").stdout) == test


def test_tasks_are_deterministic_and_short() -> None:
    task = get_task("count-fox-1")
    assert task == get_task("count-fox-1")
    assert task.prompt == "Count the lines of fox.txt into count.txt."
    assert task.expert_command == "wc -l < fox.txt > count.txt"
    assert max(len(get_task(i).prompt) for i in task_ids("train")) < 60


def _expert_failure(task_id: str, root: Path) -> str | None:
    out = root / task_id
    episode = expert_episode(get_task(task_id), out)
    verdict = score(out, task_id, episode)
    return None if verdict.success else f"{task_id}: {verdict.reason} (tool said {episode.calls[0].result!r})"


def test_expert_solves_every_test_task(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        failures = [f for f in pool.map(lambda t: _expert_failure(t, tmp_path), task_ids("test")) if f]
    assert failures == []


def _random_command(rng: random.Random) -> str:
    name, other = rng.choice(NAMES), rng.choice(["count", "found", "sorted", "first", "backup", "keep"])
    return rng.choice([
        "ls", f"cat {name}.txt", f"echo {rng.choice(['red', 'gold', '3'])} > {other}.txt", "rm -f *.txt",
        f"mkdir {name}", f"touch {other}.txt", f"cp {name}.txt {other}.txt", f"sort {name}.txt",
    ])


def test_random_policy_scores_near_zero(tmp_path: Path) -> None:
    rng = random.Random(0)
    test = task_ids("test")[::3]  # 48 tasks, 2 random commands each
    solved = 0
    for task_id in test:
        out = tmp_path / task_id
        box = open_sandbox(get_task(task_id), out)
        for _ in range(2):
            box.run(_random_command(rng))
        solved += score(out, task_id, new_episode(get_task(task_id), False)).success
    assert solved / len(test) <= 0.05


def test_checks_read_only_regular_files_inside_the_sandbox(tmp_path: Path) -> None:
    task = get_task("write-fox-0")
    box = open_sandbox(task, tmp_path)
    (tmp_path / "outside.txt").write_text(task.word)
    box.run("ln -s ../outside.txt fox.txt")
    episode = new_episode(task, False)
    assert score(tmp_path, task.task_id, episode).reason == "fox.txt missing"


def test_expert_and_verify_cli(tmp_path: Path) -> None:
    run = _cli("stepline.agents.terminal.run", "--task", "sort-cow-1", "--out", str(tmp_path), "--expert")
    assert run.returncode == 0, run.stderr
    episode = read_episode(tmp_path)
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert episode.calls[0].arguments == {"command": "sort cow.txt > sorted.txt"}
    verdict = json.loads(_cli("stepline.agents.terminal.verify", "--task", "sort-cow-1", "--out", str(tmp_path)).stdout)
    assert verdict == {"reward": 1.0, "success": True, "reason": "ok"}
    assert _cli("stepline.agents.terminal.run", "--task", "nope", "--out", str(tmp_path)).returncode == 2


def test_model_episode_through_the_anthropic_sdk(tmp_path: Path) -> None:
    """A scripted endpoint answers with a tool call, then "done"; the harness echoes the full history."""
    word = get_task("write-fox-0").word  # pink
    replies = iter([Reply(None, [("bash", {"command": f"echo {word} > fox.txt"})]), Reply("done")])
    with ScriptedServer(lambda body: next(replies)) as server:
        env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "k"}
        run = _cli("stepline.agents.terminal.run", "--task", "write-fox-0", "--out", str(tmp_path), env=env)
        requests = server.requests
    assert run.returncode == 0, run.stderr
    assert requests[0]["system"].startswith("You are in a Linux shell")
    assert requests[0]["tools"][0]["name"] == "bash"
    second = requests[1]["messages"]
    assert second[:2] == [{"role": "user", "content": f"Write {word} to fox.txt."},
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1_0", "name": "bash",
                                                             "input": {"command": f"echo {word} > fox.txt"}}]}]
    assert second[2]["content"][0] == {"type": "tool_result", "tool_use_id": "toolu_1_0", "content": "(no output)",
                                       "is_error": False}
    episode = read_episode(tmp_path)
    assert (episode.turns, episode.finish, episode.final) == (2, "final_message", "done")
    verdict = json.loads(_cli("stepline.agents.terminal.verify", "--task", "write-fox-0", "--out", str(tmp_path)).stdout)
    assert verdict == {"reward": 1.0, "success": True, "reason": "ok"}


def test_garbage_endpoint_breaks_the_episode_with_a_reason(tmp_path: Path) -> None:
    with ScriptedServer(lambda body: RawReply(200, b"not json at all")) as server:
        env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "k"}
        run = _cli("stepline.agents.terminal.run", "--task", "write-fox-0", "--out", str(tmp_path), env=env)
    assert run.returncode == 1
    episode = read_episode(tmp_path)
    assert episode.finish == "error" and episode.error
    verdict = json.loads(_cli("stepline.agents.terminal.verify", "--task", "write-fox-0", "--out", str(tmp_path)).stdout)
    assert verdict["reward"] == 0.0 and verdict["reason"].startswith("episode broke")

