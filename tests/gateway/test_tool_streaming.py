"""Tool calls streamed as they are written: the first delta of a call carries its id, type and name,
later ones fragments of its arguments, and the fragments join into exactly the arguments of the
whole (non-streamed) answer, for every format with a scanner and any split of the text. Through the
gateway, the openai (Chat Completions, Responses) and anthropic SDKs' stream accumulators rebuild the
same calls as the non-streamed answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from gateway_helpers import fake_engine, serve, tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_parsers import CASES, TOOLS

from stepline.gateway.parsers import TOOL_PARSERS, Event, collect, make_parser, parse_text
from stepline.gateway.parsers.incremental import JsonArgs

STREAMED = sorted(n for n in CASES if (fmt := TOOL_PARSERS[n]) is not None and fmt.scanner is not None)
WHOLE_ONLY = sorted(n for n in CASES if n not in STREAMED)


def feed(name: str, text: str, cuts: list[int], tools: Any = TOOLS) -> list[Event]:
    parser = make_parser(name, "qwen3", True, tools, incremental=True)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return events + parser.finish()


def joined(events: list[Event]) -> dict[str, str]:
    """Call id -> its arguments as a client adds up the fragments (or gets them whole)."""
    out: dict[str, str] = {}
    for e in events:
        assert e.tool_call is not None or e.kind in ("content", "reasoning")
        if e.kind == "tool_open":
            assert e.tool_call is not None and e.tool_call.arguments == "" and e.tool_call.id not in out
            out[e.tool_call.id] = ""
        elif e.kind == "tool_args":
            assert e.tool_call is not None
            out[e.tool_call.id] += e.text
        elif e.kind == "tool_call" and e.tool_call is not None:
            out.setdefault(e.tool_call.id, e.tool_call.arguments)
    return out


def one_call_at_a_time(events: list[Event]) -> bool:
    """Each streamed call ends (tool_call) before the next opens, as Anthropic and Responses blocks must."""
    current = None
    for e in events:
        if e.kind == "tool_open":
            if current is not None:
                return False
            current = e.tool_call.id if e.tool_call else None
        elif e.kind == "tool_args" and (e.tool_call is None or e.tool_call.id != current):
            return False
        elif e.kind == "tool_call" and e.tool_call is not None and e.tool_call.id == current:
            current = None
    return current is None


def test_every_json_and_xml_family_streams_and_pythonic_goes_whole() -> None:
    assert STREAMED == ["deepseekv3", "deepseekv31", "glm45", "hermes", "kimi_k2", "llama3", "llama3_json", "mistral",
                        "qwen3_coder"]
    assert WHOLE_ONLY == ["llama4_pythonic", "pythonic"]  # Python literals: each call goes out once parsed


@pytest.mark.parametrize("name", STREAMED)
def test_one_character_at_a_time_opens_each_call_before_its_arguments_end(name: str) -> None:
    text, content, calls = CASES[name]
    events = feed(name, text, list(range(len(text))))
    opens = [e for e in events if e.kind == "tool_open"]
    assert [e.tool_call.name for e in opens if e.tool_call] == [n for n, _ in calls]
    fragments = [e for e in events if e.kind == "tool_args"]
    assert len(fragments) > len(calls)  # the arguments came in pieces, not at the end
    parsed, whole = collect(events), parse_text(text, name, "none", True, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert joined(events) == {c.id: c.arguments for c in parsed.tool_calls}
    assert [c.id for c in parsed.tool_calls] == [e.tool_call.id for e in opens if e.tool_call]
    assert one_call_at_a_time(events)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(STREAMED + WHOLE_ONLY), st.data())
def test_any_split_streams_the_arguments_of_the_whole_answer(name: str, data: st.DataObject) -> None:
    text = "<think>\nhmm\n</think>\n\n" + CASES[name][0]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    events = feed(name, text, cuts)
    parsed, whole = collect(events), parse_text(text, name, "qwen3", True, TOOLS)
    assert (parsed.reasoning, parsed.content) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert joined(events) == {c.id: c.arguments for c in parsed.tool_calls}
    assert one_call_at_a_time(events)


# hand-written: the raw JSON a model may write -> json.dumps(json.loads(raw), ensure_ascii=False)
ARGS = [
    ('{"city":"Paris","days":3}', '{"city": "Paris", "days": 3}'),
    ('{ "a" : [ 1 , 2.50 , -0.0 , 1E2 ] ,\n "b" : { } , "c" : [ ] }', '{"a": [1, 2.5, -0.0, 100.0], "b": {}, "c": []}'),
    ('{"t": true, "f": false, "n": null}', '{"t": true, "f": false, "n": null}'),
    ('{"q": "caf\\u00e9 \\"x\\" \\/ \\\\ \\n\\t"}', '{"q": "café \\"x\\" / \\\\ \\n\\t"}'),
    ('{"e": "\\ud83d\\ude00 ok", "k": "\\u0001"}', '{"e": "😀 ok", "k": "\\u0001"}'),
    ('{"nested": {"deep": [{"x": "}"}]}}', '{"nested": {"deep": [{"x": "}"}]}}'),
]


@pytest.mark.parametrize(("raw", "expected"), ARGS)
def test_json_arguments_are_rewritten_as_json_dumps_writes_them(raw: str, expected: str) -> None:
    assert expected == json.dumps(json.loads(raw), ensure_ascii=False)  # the vector itself is right
    whole = JsonArgs()
    assert whole.feed(raw + " trailing", 0) == (expected, len(raw))  # stops where the object ends
    one_by_one, out = JsonArgs(), ""
    for at in range(len(raw)):
        out += one_by_one.feed(raw[: at + 1], at)[0]
    assert out == expected and one_by_one.done


def test_a_number_is_held_until_it_ends() -> None:
    args = JsonArgs()
    assert args.feed('{"days": 1', 0) == ('{"days": ', 10)
    assert args.feed('{"days": 12}', 10) == ("12}", 2)


def test_xml_values_trim_one_newline_at_each_end_as_the_whole_parse_does() -> None:
    for value, expected in (("\nParis\n", "Paris"), ("\n\nParis\n\n", "\nParis\n"), ("\n", ""), ("", ""),
                            ("Par\nis", "Par\nis")):
        text = f"<tool_call>\n<function=get_weather>\n<parameter=city>{value}</parameter>\n</function>\n</tool_call>"
        events = feed("qwen3_coder", text, list(range(len(text))))
        (call,) = collect(events).tool_calls
        assert json.loads(call.arguments) == {"city": expected} and joined(events) == {call.id: call.arguments}


def test_a_call_cut_after_it_opened_ends_as_streamed_in_a_stream_and_is_text_whole() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'  # max_tokens cut it here
    events = feed("hermes", text, list(range(len(text))))
    parsed = collect(events)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert joined(events) == {parsed.tool_calls[0].id: '{"city": "Pa'} and parsed.content == ""
    whole = parse_text(text, "hermes", "none", True, TOOLS)
    assert (whole.tool_calls, whole.content) == ([], text)


def test_a_later_mismatch_keeps_what_was_streamed() -> None:
    # a duplicate key: json.loads keeps the last value, so the whole parse no longer extends the stream
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "city": "B"}}\n</tool_call>'
    events = feed("hermes", text, list(range(len(text))))
    (call,) = collect(events).tool_calls
    assert joined(events) == {call.id: call.arguments}
    assert call.arguments == '{"city": "A", "city": "B"}'  # as the client has it; the record keeps the ids
    assert json.loads(parse_text(text, "hermes", "none", True, TOOLS).tool_calls[0].arguments) == {"city": "B"}


def test_unknown_tools_never_open_a_call() -> None:
    for name in STREAMED:
        text = CASES[name][0]
        events = feed(name, text, list(range(len(text))), tools={"other": {}})
        assert not [e for e in events if e.kind != "content"] and collect(events).content == text.strip()


def test_the_whole_path_never_streams_pieces() -> None:
    for name in STREAMED:
        parser = make_parser(name, "none", True, TOOLS)
        assert {e.kind for e in parser.feed(CASES[name][0]) + parser.finish()} <= {"content", "tool_call"}


# --- through the gateway and the SDKs ---------------------------------------------------------------

OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]


async def chat_both(client: openai.AsyncOpenAI) -> tuple[list[tuple], list[tuple], int]:
    whole = (await client.chat.completions.create(model="m", messages=MESSAGES, tools=OPENAI_TOOLS)).choices[0].message
    fragments = 0
    async with client.chat.completions.stream(model="m", messages=MESSAGES, tools=OPENAI_TOOLS) as s:
        async for event in s:
            if event.type == "chunk":
                for delta in event.chunk.choices[0].delta.tool_calls or []:
                    assert (delta.id is None) == (delta.function.name is None)  # id and name: first delta only
                    fragments += bool(delta.function.arguments)
        streamed = (await s.get_final_completion()).choices[0].message

    def calls(m: Any) -> list[tuple]:
        return [(m.content or "",)] + [(c.type, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return calls(whole), calls(streamed), fragments


async def responses_both(client: openai.AsyncOpenAI) -> tuple[list[tuple], list[tuple], int]:
    tools = [{"type": "function", "name": n, "parameters": p} for n, p in TOOLS.items()]
    kwargs: dict[str, Any] = {"model": "m", "input": MESSAGES, "tools": tools}
    whole = await client.responses.create(**kwargs)
    fragments, added = 0, {}
    async with client.responses.stream(**kwargs) as s:
        async for event in s:
            if event.type == "response.output_item.added" and event.item.type == "function_call":
                added[event.item.id] = ""
            if event.type == "response.function_call_arguments.delta":
                added[event.item_id] += event.delta
                fragments += 1
        streamed = await s.get_final_response()

    def calls(r: Any) -> list[tuple]:
        return [(r.output_text,)] + [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert list(added.values()) == [o.arguments for o in streamed.output if o.type == "function_call"]
    return calls(whole), calls(streamed), fragments


async def messages_both(client: anthropic.AsyncAnthropic) -> tuple[list[tuple], list[tuple], int]:
    tools = [{"name": n, "input_schema": p or {"type": "object"}} for n, p in TOOLS.items()]
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 300, "messages": MESSAGES, "tools": tools}
    whole = await client.messages.create(**kwargs)
    fragments = 0
    async with client.messages.stream(**kwargs) as s:
        async for event in s:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments += 1
        streamed = await s.get_final_message()

    def calls(m: Any) -> list[tuple]:
        blocks = {"text": lambda b: (b.text,), "thinking": lambda b: (b.thinking,), "tool_use": lambda b: (b.name, b.input)}
        return [(b.type, *blocks[b.type](b)) for b in m.content] + [(m.stop_reason,)]
    return calls(whole), calls(streamed), fragments


@pytest.mark.parametrize("name", sorted(CASES))
async def test_sdk_stream_accumulators_rebuild_the_whole_answers_calls(name: str, qwen3_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    text, _, expected = CASES[name]
    tok = tokenizer(qwen3_model_dir)
    async with fake_engine(tok, [text] * 6) as url, \
            serve(qwen3_model_dir, [url], tmp_path, tool_parser=name, reasoning_parser="none") as served:
        s = await served.session()
        oai = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0)
        for both in (chat_both(oai), responses_both(oai), messages_both(ant)):
            whole, streamed, fragments = await both
            assert streamed == whole
            assert len(whole) >= len(expected) + 1
            # streamed families send the arguments in pieces; the others one delta per call
            assert fragments > len(expected) if name in STREAMED else fragments == len(expected)
        await oai.close()
        await ant.close()
