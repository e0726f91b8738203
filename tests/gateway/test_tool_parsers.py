"""Every registered tool-call format: a scripted answer in that family's syntax parses into the API's
tool-call objects, whole and cut into any pieces (the streamed parse must agree), malformed or unknown
calls stay text, and unknown parser names are refused with the list of known ones."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, UnknownParser, collect, make_parser, parse_text

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "get_time": {}}
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {})

# parser -> (answer text, expected content, expected calls)
CASES: dict[str, tuple[str, str, list[tuple[str, dict]]]] = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "Let me check.", [WEATHER, TIME]),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Checking.", [WEATHER]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
    "llama3": ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "", [WEATHER]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {}}]', "", [WEATHER, TIME]),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time()]', "", [WEATHER, TIME]),
    "llama4_pythonic": ('Sure.<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "Sure.", [WEATHER]),
    "deepseekv3": ("Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Ok.", [WEATHER]),
    "deepseekv31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "", [WEATHER, TIME]),
    "kimi_k2": ('Ok.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>', "Ok.", [WEATHER]),
    "glm45": ("Ok.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Ok.", [WEATHER]),
}


def calls_of(out) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_parses_its_calls(name: str) -> None:
    text, content, calls = CASES[name]
    out = parse_text(text, name, "none", True, TOOLS)
    assert (out.content, calls_of(out)) == (content, calls)
    assert all(c.arguments == json.dumps(json.loads(c.arguments)) for c in out.tool_calls)  # tojson spacing


@pytest.mark.parametrize("name", sorted(CASES))
def test_unknown_tools_and_disabled_tools_stay_text(name: str) -> None:
    text, _, _ = CASES[name]
    for out in (parse_text(text, name, "none", True, {"other": {}}), parse_text(text, name, "none", False, TOOLS)):
        assert out.tool_calls == [] and out.content == text.strip()


@pytest.mark.parametrize("name", sorted(CASES))
def test_truncated_calls_stay_text(name: str) -> None:
    text, _, _ = CASES[name]
    cut = text[: len(text) - 7]  # the last call cut off by max_tokens: earlier complete calls still count
    out = parse_text(cut, name, "none", True, TOOLS)
    assert calls_of(out) == CASES[name][2][:-1] or calls_of(out) == []
    assert out.content.endswith(cut[-20:])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.data())
def test_any_split_parses_like_the_whole(name: str, data: st.DataObject) -> None:
    text = "<think>\nhmm\n</think>\n\n" + CASES[name][0]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser = make_parser(name, "qwen3", True, TOOLS)
    events, last = [], 0
    for cut in cuts + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    streamed, whole = collect(events + parser.finish()), parse_text(text, name, "qwen3", True, TOOLS)
    assert (streamed.reasoning, streamed.content, calls_of(streamed)) == ("hmm", CASES[name][1], CASES[name][2])
    assert (whole.reasoning, whole.content, calls_of(whole)) == ("hmm", CASES[name][1], CASES[name][2])


def test_plain_answers_are_content_for_every_format() -> None:
    for name in TOOL_PARSERS:
        out = parse_text("The answer is [42] {ok}.", name, "none", True, TOOLS)
        assert (out.content, out.tool_calls) == ("The answer is [42] {ok}.", [])


def test_a_bracketed_answer_that_is_no_call_stays_text() -> None:
    for name, text in (("pythonic", "[1, 2, 3] are the numbers"), ("llama3", '{"answer": 42}')):
        out = parse_text(text, name, "none", True, TOOLS)
        assert (out.content, out.tool_calls) == (text, [])


def test_reasoning_parsers() -> None:
    assert parse_text("plan</think>answer", "none", "deepseek-r1").reasoning == "plan"  # prompt opened <think>
    assert parse_text("<think>plan</think>answer", "none", "deepseek-r1").content == "answer"
    out = parse_text("◁think▷plan◁/think▷answer", "none", "kimi")
    assert (out.reasoning, out.content) == ("plan", "answer")
    out = parse_text("[THINK]plan[/THINK]answer", "none", "mistral")
    assert (out.reasoning, out.content) == ("plan", "answer")
    assert parse_text("<think>plan</think>answer", "none", "none").content == "<think>plan</think>answer"


def test_unknown_parser_names_list_the_known_ones() -> None:
    with pytest.raises(UnknownParser, match="known: hermes, qwen25"):
        make_parser("hermez", "qwen3", True, None)
    with pytest.raises(UnknownParser, match="deepseek-r1"):
        make_parser("hermes", "r1", True, None)
    assert {"hermes", "qwen25", "qwen3_coder", "llama3_json", "mistral", "pythonic", "deepseekv3", "kimi_k2",
            "glm45"} <= TOOL_PARSERS.keys()
    assert {"qwen3", "deepseek-r1", "kimi", "glm45", "none"} <= REASONING_PARSERS.keys()


def test_the_cli_refuses_unknown_parser_names(tmp_path) -> None:
    from click.testing import CliRunner

    from stepline.gateway.cli import gateway_command

    (tmp_path / "tokenizer.json").write_text("{}")  # passes the --model check; the parser names fail first
    args = ["--engine", "http://127.0.0.1:9", "--model", str(tmp_path), "--pool", "sqlite:///x.db"]
    result = CliRunner().invoke(gateway_command, args + ["--tool-parser", "hermez"])
    assert result.exit_code == 2 and "qwen3_coder" in result.output and "hermez" in result.output
    result = CliRunner().invoke(gateway_command, args + ["--reasoning-parser", "r1"])
    assert result.exit_code == 2 and "deepseek-r1" in result.output


def test_rendered_calls_parse_back() -> None:
    calls = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
             {"function": {"name": "get_time", "arguments": {}}}]
    for name in ("hermes", "llama3", "mistral", "pythonic"):
        fmt = TOOL_PARSERS[name]
        assert fmt is not None and fmt.render is not None
        assert calls_of(parse_text(fmt.render(calls), name, "none", True, TOOLS)) == [WEATHER, TIME]
