"""Reasoning and tool calls out of sampled text: hand-written cases, malformed calls as text, and the
streamed parse agreeing with the whole parse for every way of cutting the text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.gateway.parsers import collect, make_parser, parse_text

CALL = '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'


def test_reasoning_content_and_tool_calls() -> None:
    out = parse_text("<think>\nplan\n</think>\n\nLooking." + "\n" + CALL + "\n" + CALL.replace('"x"', '"y"'),
                     tools={"get": {}})
    assert out.reasoning == "plan"
    assert out.content == "Looking."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get", {"q": "x"}), ("get", {"q": "y"})]
    assert out.tool_calls[0].arguments == '{"q": "x"}'  # the spacing the template's tojson writes
    assert out.tool_calls[0].id != out.tool_calls[1].id


def test_plain_text_has_no_reasoning() -> None:
    out = parse_text("Hello there.")
    assert (out.content, out.reasoning, out.tool_calls) == ("Hello there.", None, [])


def test_empty_reasoning_block() -> None:
    out = parse_text("<think>\n\n</think>\n\nHi")
    assert (out.reasoning, out.content) == ("", "Hi")


def test_malformed_tool_calls_come_back_as_text() -> None:
    bad_json = '<tool_call>\n{"name": "get", "arguments": {"q": }\n</tool_call>'
    unknown = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    unclosed = '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}'
    for text in (bad_json, unknown, unclosed):
        out = parse_text(text, tools={"get": {}})
        assert out.tool_calls == [] and out.content == text


def test_tool_calls_stay_text_when_tools_are_off() -> None:
    out = parse_text(CALL, tools_enabled=False)
    assert out.tool_calls == [] and out.content == CALL


def test_unclosed_reasoning_is_reasoning() -> None:
    out = parse_text("<think>\nstill thinking")
    assert (out.reasoning, out.content) == ("still thinking", "")


PIECES = ["<think>", "\n", "plan", "</think>", "\n\n", "Hi", " ", "<tool_call>", '{"name": "get", "arguments": {}}',
          "</tool_call>", "<", "tool", "x", "{", "}"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.data())
def test_any_split_of_a_stream_parses_like_the_whole(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parser = make_parser("hermes", "qwen3", True, {"get": {}})
    events = []
    last = 0
    for cut in cuts + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    streamed, whole = collect(events), parse_text(text, "hermes", "qwen3", True, {"get": {}})
    assert (streamed.content, streamed.reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
