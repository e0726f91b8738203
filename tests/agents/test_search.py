"""The search harness: collection, BM25 tool, expert, verifier, CLIs and runs through a real HTTP endpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness_helpers import cli, endpoint, random_policy, server_policy, verdict

from stepline.agents.common import Episode, read_episode, run_episode
from stepline.agents.common.scripted_server import RawReply, ScriptedServer
from stepline.agents.search.harness import MAX_TURNS, SYSTEM, TOOLS, expert_policy, play, search
from stepline.agents.search.index import index
from stepline.agents.search.tasks import split_ids
from stepline.agents.search.verify import score
from stepline.agents.search.world import N_CITIES, task_by_id, tasks


def test_split_is_fixed_disjoint_and_by_entity() -> None:
    train, test = split_ids("train"), split_ids("test")
    assert (len(train), len(test)) == (400, 100) and not set(train) & set(test)
    assert test[:3] == ["search-0004", "search-0009", "search-0014"]
    done = cli("stepline.agents.search.tasks", "--split", "test")
    assert done.returncode == 0 and json.loads(done.stdout) == test
    names = lambda split: {n for t in tasks() if t.split == split for n in (t.work, t.maker.name, t.spouse.name)}  # noqa: E731
    assert not names("train") & names("test")  # test questions are about entities no train task mentions


def test_questions_need_two_lookups() -> None:
    task = task_by_id()["search-0004"]
    assert task.question == "Where was the author of Kagone born?" and task.answer == "Pine"
    # The question alone finds the book, which names the author but not the answer.
    assert search(task.question).splitlines()[0] == "Kagone: book written by Fefeda."
    assert search("Fefeda").splitlines()[0] == "Fefeda: born in Pine, lives in Belo, married to Minebe."
    assert search("zzz qqq") == "No results."


def test_every_name_finds_its_own_passage_first() -> None:
    for task in tasks():
        for name in (task.work, task.maker.name, task.spouse.name):
            assert index().search(name)[0].startswith(f"{name}:")


def test_expert_solves_every_test_task() -> None:
    verdicts = [score(t, play(t, MAX_TURNS, expert=True)) for t in split_ids("test")]
    assert all(v.success and v.reward == 1.0 for v in verdicts)


def _random_call(rng: random.Random) -> tuple[str, dict]:
    words = sorted({t.maker.born for t in tasks()}) + ["Kalomi", "the director"]
    return rng.choice([("search", {"query": rng.choice(words)}), ("answer", {"text": rng.choice(words)})])


def test_random_policy_scores_near_zero() -> None:
    rng = random.Random(0)
    rewards = []
    for task_id in split_ids("test"):
        episode = run_episode(random_policy(rng, [_random_call]), Episode(harness="search", task_id=task_id),
                              system=SYSTEM, user=task_by_id()[task_id].question, tools=TOOLS, max_turns=MAX_TURNS,
                              stop_tools=frozenset({"answer"}))
        rewards.append(score(task_id, episode).reward)
    # Guessing one of N_CITIES cities is right about 1/24 of the time on 2/3 of the questions.
    assert sum(rewards) / len(rewards) < 0.1 and N_CITIES == 24


def test_scoring_is_f1_with_em_success_and_never_trusts_claims() -> None:
    episode = play("search-0004", MAX_TURNS, expert=True)
    episode.calls[-1].arguments = {"text": "Pine Belo"}
    verdict_ = score("search-0004", episode)  # F1 = 2 * (1/2 * 1) / (1/2 + 1) = 2/3
    assert not verdict_.success and abs(verdict_.reward - 2 / 3) < 1e-9
    episode.calls[-1].arguments, episode.final = {"text": "Belo"}, "Pine"  # the recorded call counts, not `final`
    assert score("search-0004", episode).reward == 0.0
    claimed = Episode(harness="search", task_id="search-0004", finish="max_turns", final="Pine")
    assert score("search-0004", claimed).reason == "no answer (max_turns)"


def test_expert_cli_then_verify(tmp_path: Path) -> None:
    done = cli("stepline.agents.search.run", "--task", "search-0009", "--out", str(tmp_path), "--expert")
    assert done.returncode == 0, done.stderr
    assert verdict("search", "search-0009", tmp_path).success
    assert cli("stepline.agents.search.run", "--task", "nope", "--out", str(tmp_path)).returncode == 2


def test_model_episode_through_the_openai_sdk(tmp_path: Path) -> None:
    task = task_by_id()["search-0014"]
    with ScriptedServer(server_policy(expert_policy(task))) as server:
        done = cli("stepline.agents.search.run", "--task", task.id, "--out", str(tmp_path), env=endpoint(server.openai_base_url))
    assert done.returncode == 0, done.stderr
    assert verdict("search", task.id, tmp_path).success
    first, last = server.requests[0], server.requests[-1]
    assert [t["function"]["name"] for t in first["tools"]] == ["search", "answer"] and first["max_tokens"] == 128
    assert last["messages"][:4] == read_episode(tmp_path).messages[:4]  # the full history is echoed each turn
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]


def test_down_or_garbage_endpoint_fails_the_episode_with_a_reason(tmp_path: Path) -> None:
    down = cli("stepline.agents.search.run", "--task", "search-0004", "--out", str(tmp_path / "down"), env=endpoint("http://127.0.0.1:9/v1"))
    assert down.returncode == 1 and "APIConnectionError" in read_episode(tmp_path / "down").error
    with ScriptedServer(lambda body: RawReply(200, b"<html>garbage", "text/html")) as server:
        garbage = cli("stepline.agents.search.run", "--task", "search-0004", "--out", str(tmp_path / "g"), env=endpoint(server.openai_base_url))
    assert garbage.returncode == 1 and read_episode(tmp_path / "g").finish == "error"
    assert verdict("search", "search-0004", tmp_path / "g").reason.startswith("episode broke: malformed chat completion")
