"""The BFCL harness: bfcl-eval's own tasks and checkers through the bridge, the fixed split, the ground-truth
expert, model episodes through the OpenAI SDK, and hostile model output scoring 0 with a reason.

Needs the bfcl-eval environment (scripts/setup.sh); skips without it. The expert over every task is slow
(about 5 minutes): `pytest -m slow tests/agents/test_bfcl.py`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness_helpers import cli, endpoint, server_policy, verdict

from stepline.agents.bfcl import harness, verify
from stepline.agents.bfcl.categories import CATEGORIES, category_of, split_of
from stepline.agents.bfcl.client import SOCKET_ENV, Bridge, available, start_server
from stepline.agents.bfcl.report import table, wilson
from stepline.agents.common import Turn
from stepline.agents.common.loop import RawCall
from stepline.agents.common.scripted_server import Reply, ScriptedServer

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture(scope="module")
def bridge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One warm forking bridge for the in-process tests, as the worker has (each play/score connects)."""
    server = start_server(tmp_path_factory.mktemp("bfcl") / "bridge.sock")
    os.environ[SOCKET_ENV] = str(tmp_path_factory.getbasetemp() / "bfcl0" / "bridge.sock")
    yield
    os.environ.pop(SOCKET_ENV)
    server.kill()
    server.wait()


def _all_ids() -> list[str]:
    return [t for ids in harness.all_tasks().values() for t in ids]


def test_split_is_fixed_disjoint_and_covers_every_category() -> None:
    train, test = harness.split_ids("train"), harness.split_ids("test")
    assert not set(train) & set(test) and len(train) + len(test) == len(_all_ids()) == 2547
    assert {category_of(t) for t in test} == set(CATEGORIES)
    assert all(split_of(t) == "test" for t in test) and 0.17 < len(test) / len(_all_ids()) < 0.23
    done = cli("stepline.agents.bfcl.tasks", "--split", "test")
    assert done.returncode == 0 and json.loads(done.stdout) == test


def _expert_fails(task_ids: list[str]) -> dict[str, str]:
    verdicts = {t: verify.score(t, harness.play(t, harness.MAX_TURNS, expert=True)) for t in task_ids}
    return {t: v.reason for t, v in verdicts.items() if not (v.success and v.reward == 1.0)}


def test_tasks_whose_ground_truth_bfcls_checker_rejects_are_left_out(bridge_server: None) -> None:
    """Possible answers that contradict their function documents (a required parameter without a value, a
    parameter the function lacks): BFCL's checker rejects the expert's answer, so no answer could score."""
    listed = set(_all_ids())
    with Bridge() as bridge:
        for task_id in ("live_simple_106-63-0", "live_multiple_862-181-3", "live_multiple_964-207-0"):
            calls = bridge.ask("expert", id=task_id)[0][0]
            verdict = bridge.ask("check", id=task_id, result=[{c["name"]: json.dumps(c["arguments"])} for c in calls])
            assert task_id not in listed and not verdict["valid"], verdict


def test_expert_scores_one_on_a_sample_of_every_category(bridge_server: None) -> None:
    assert _expert_fails(_all_ids()[::25]) == {}  # 102 tasks, every category


@pytest.mark.slow
def test_expert_scores_one_on_every_task(bridge_server: None) -> None:
    assert _expert_fails(_all_ids()) == {}


def test_multi_turn_model_episode_through_the_openai_sdk(tmp_path: Path, bridge_server: None) -> None:
    """The ground truth served by a real HTTP endpoint: tools, executed calls and tool results round-trip."""
    task = "multi_turn_base_0"
    script = harness.ExpertPolicy(json.loads(json.dumps(_expert_script(task))))
    with ScriptedServer(server_policy(script)) as server:
        done = cli("stepline.agents.bfcl.run", "--task", task, "--out", str(tmp_path), env=endpoint(server.openai_base_url))
    assert done.returncode == 0, done.stderr
    assert verdict("bfcl", task, tmp_path).success
    first = server.requests[0]
    assert {t["function"]["name"] for t in first["tools"]} >= {"cd", "mv", "post_tweet"}
    tool_results = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_results[0]["content"] == '{"current_working_directory": "document"}'  # GorillaFileSystem.cd ran


def _expert_script(task_id: str) -> list:
    from stepline.agents.bfcl.client import Bridge

    with Bridge() as bridge:
        return bridge.ask("expert", id=task_id)


def _scripted(task_id: str, turns: list[Turn], tmp_path: Path) -> tuple[int, str]:
    replies = iter(turns)
    with ScriptedServer(lambda body: _reply(next(replies, Turn("I am done.")))) as server:
        done = cli("stepline.agents.bfcl.run", "--task", task_id, "--out", str(tmp_path), env=endpoint(server.openai_base_url))
    return done.returncode, verdict("bfcl", task_id, tmp_path).reason


def _reply(turn: Turn) -> Reply:
    return Reply(turn.content, [(c.name, c.arguments) for c in turn.tool_calls])


def _call(name: str, arguments: str) -> Turn:
    return Turn(None, [RawCall("c", name, arguments)])


@pytest.mark.parametrize(("task", "turn", "reason"), [
    ("simple_python_0", Turn("The area is 25."), "ast_decoder:decoder_failed"),
    ("simple_python_0", _call("no_such_function", '{"base": 10}'), "simple_function_checker:wrong_func_name"),
    ("simple_python_0", _call("calculate_triangle_area", '{"base": "ten", "height": 5}'), "type_error"),
    ("simple_python_0", _call("calculate_triangle_area", "{not json"), "ast_decoder:decoder_failed"),
    ("multi_turn_base_0", _call("__import__", '{"name": "os"}'), "multi_turn:"),
    ("multi_turn_base_0", _call("cd", '{"folder=1,x": 2}'), "multi_turn:"),
    ("multi_turn_base_0", _call("cd", '{"folder": "no/such/dir"}'), "multi_turn:"),
])
def test_bad_model_output_scores_zero_with_a_reason(task: str, turn: Turn, reason: str, tmp_path: Path) -> None:
    code, why = _scripted(task, [turn], tmp_path)
    assert code == 0 and why.startswith(f"BFCL {category_of(task)}: ") and reason in why


def test_calls_that_raise_inside_bfcls_api_classes_score_zero(tmp_path: Path) -> None:
    """Well-formed calls with wrong argument types or names raise inside the API class (GorillaFileSystem.cd
    calls folder.rstrip): the model gets each error as the call's result, the episode goes on to its answer,
    and BFCL's checker scores it 0 with a reason."""
    raising = [({"folder": 5}, "'int' object has no attribute 'rstrip'"),
               ({"folder": {"a": 1}}, "'dict' object has no attribute 'rstrip'"),
               ({"folder": "document", "depth": 2}, "unexpected keyword argument 'depth'")]
    code, why = _scripted("multi_turn_base_0", [_call("cd", json.dumps(a)) for a, _ in raising], tmp_path)
    episode = json.loads((tmp_path / "episode.json").read_text())
    assert code == 0 and episode["finish"] != "error"
    results = [c["result"] for c in episode["calls"]]
    assert [c["error"] for c in episode["calls"]] == [True] * 3
    assert all(r.startswith("Error during execution: ") and raised in r for r, (_, raised) in zip(results, raising, strict=True))
    assert [m["content"] for m in episode["messages"] if m["role"] == "tool"] == results  # what the model was shown
    assert why.startswith("BFCL multi_turn_base: multi_turn:"), why


def test_hostile_calls_never_reach_bfcls_eval(tmp_path: Path) -> None:
    """A name or an argument key that would inject code is answered with an error and not executed."""
    marker = tmp_path / "pwned"
    code, _ = _scripted("multi_turn_base_0", [
        _call(f"__import__('pathlib').Path('{marker}').touch", "{}"),
        _call("cd", json.dumps({f"folder=__import__('pathlib').Path('{marker}').touch(),x": 1})),
    ], tmp_path / "ep")
    episode = json.loads((tmp_path / "ep" / "episode.json").read_text())
    assert code == 0 and not marker.exists()
    assert [c["result"].split(":")[0] for c in episode["calls"]] == ["Error", "Error"]


def test_report_is_per_category_with_bfcl_names_and_wilson_intervals() -> None:
    # Wilson for 1 of 2 at z=1.96: centre (0.5 + 0.9604) / 1.9208... = 0.5 exactly, by symmetry.
    low, high = wilson(1, 2)
    assert abs((low + high) / 2 - 0.5) < 1e-12 and 0.09 < low < 0.10
    report = {"episodes": [{"harness": "bfcl", "task_id": "live_simple_0-0-0", "success": True},
                           {"harness": "bfcl", "task_id": "live_simple_1-1-0", "success": False},
                           {"harness": "search", "task_id": "search-0004", "success": True}]}
    text = table({"before": report})
    assert "| Live Python Simple AST | live_simple | 0.500 [0.09, 0.91] (n=2) |" in text
    assert "| Multi Turn Base | multi_turn_base | – |" in text
