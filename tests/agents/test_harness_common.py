"""stepline/agents/common: scoring, tool dispatch, the episode file and the verifier edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.agents.common import (
    Episode,
    EpisodeError,
    Tool,
    ToolError,
    Verdict,
    call_tool,
    exact_match,
    failed,
    normalize_answer,
    read_episode,
    token_f1,
    verdict_for,
    write_episode,
)
from stepline.agents.common.loop import OpenAIPolicy, RawCall, Turn, run_episode


def test_normalisation_drops_case_punctuation_and_articles() -> None:
    assert normalize_answer("  The Belo-Sika, city! ") == "belosika city"
    assert exact_match("the Belo.", "Belo") and not exact_match("Belo Sika", "Belo")


def test_token_f1_by_hand() -> None:
    # prediction "belo sika tuka" vs gold "belo tuka": common 2, precision 2/3, recall 2/2 -> F1 = 2*(2/3)/(5/3) = 0.8
    assert token_f1("Belo Sika Tuka", "Belo Tuka") == pytest.approx(0.8)
    assert token_f1("Kago", "Belo") == 0.0 and token_f1("", "Belo") == 0.0


def _echo(text: str) -> str:
    if text == "bad":
        raise ToolError("bad text")
    return f"echo {text}"


TOOLS = {"echo": Tool("echo", "Echo.", {"text": "string"}, _echo)}


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("echo", {"text": "hi"}, ("echo hi", False)),
    ("echo", {"text": "bad"}, ("error: bad text", True)),
    ("nope", {}, ("error: unknown tool 'nope'", True)),
    ("echo", None, ("error: arguments must be a JSON object", True)),
    ("echo", {"txt": "hi"}, ("error: echo takes (text)", True)),
])
def test_call_tool_turns_agent_mistakes_into_error_results(name: str, arguments: object, expected: tuple) -> None:
    assert call_tool(TOOLS, name, arguments) == expected


def test_loop_records_calls_and_stops_at_a_stop_tool() -> None:
    turns = iter([
        Turn(None, [RawCall("a", "echo", "{not json"), RawCall("b", "echo", '{"text": "x"}')]),
        Turn("", [RawCall("c", "echo", '{"text": "final"}')]),
    ])
    episode = run_episode(lambda messages: next(turns), Episode(harness="h", task_id="t"), system="s", user="u",
                          tools=list(TOOLS.values()), max_turns=5, stop_tools=frozenset({"echo"}))
    # The unparsable call is an error and does not stop; the next good echo stops the episode in turn 0.
    assert [c.error for c in episode.calls] == [True, False] and episode.turns == 1
    assert (episode.finish, episode.final) == ("answer", "x")
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert episode.messages[2]["tool_calls"][0]["function"]["arguments"] == "{not json"  # echoed verbatim


def test_loop_ends_at_max_turns_and_without_endpoint_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    episode = run_episode(lambda m: Turn(None, [RawCall("a", "echo", '{"text": "x"}')]), Episode(harness="h", task_id="t"),
                          system="s", user="u", tools=list(TOOLS.values()), max_turns=3)
    assert (episode.finish, episode.turns, len(episode.calls)) == ("max_turns", 3, 3)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    broken = run_episode(OpenAIPolicy(list(TOOLS.values())), Episode(harness="h", task_id="t"), system="s", user="u",
                         tools=list(TOOLS.values()), max_turns=3)
    assert (broken.finish, broken.error, broken.turns) == ("error", "OPENAI_BASE_URL is not set", 0)


def _score(task_id: str, episode: Episode) -> Verdict:
    if task_id == "boom":
        raise RuntimeError("verifier bug")
    return Verdict(reward=1.0, success=True, reason="ok")


def test_verdicts_for_missing_broken_foreign_and_throwing(tmp_path: Path) -> None:
    def verdict(task_id: str, out: Path) -> Verdict:
        return verdict_for("h", _score, lambda t: t in {"t", "boom"}, task_id, out)

    assert verdict("t", tmp_path / "none").reason.startswith("no episode.json")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "episode.json").write_text("{not json")
    with pytest.raises(EpisodeError):
        read_episode(tmp_path / "junk")
    assert verdict("t", tmp_path / "junk").reason.startswith("unreadable episode.json")
    write_episode(tmp_path / "ok", Episode(harness="h", task_id="t"))
    assert verdict("t", tmp_path / "ok") == Verdict(reward=1.0, success=True, reason="ok")
    assert verdict("x", tmp_path / "ok") == failed("unknown task 'x'")
    assert verdict("boom", tmp_path / "ok").reason == "episode is for h/t, not h/boom"
    write_episode(tmp_path / "boom", Episode(harness="h", task_id="boom"))
    assert verdict("boom", tmp_path / "boom") == failed("verifier error: RuntimeError: verifier bug")
    write_episode(tmp_path / "err", Episode(harness="h", task_id="t", error="endpoint down", finish="error"))
    assert verdict("t", tmp_path / "err") == failed("episode broke: endpoint down")
