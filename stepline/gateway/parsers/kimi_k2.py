"""kimi_k2: Kimi K2's call section; each call's id is `functions.<name>:<index>`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, make_call
from stepline.gateway.parsers.incremental import JsonCalls, JsonGrammar

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
                   re.DOTALL)


def name_of(ident: str) -> str:
    return ident.split(":")[0].removeprefix("functions.")


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    calls, at = [], 0
    while at < len(body) and body[at:].strip():
        match = _CALL.match(body, at)
        if match is None:
            return None
        ident, args = match.group(1), match.group(2)
        name = name_of(ident)
        call = make_call(name, args, tools)
        if call is None:
            return None
        call.id = ident  # Kimi's own id, which its template writes back
        calls.append(call)
        at = match.end()
    return calls or None


def _head_name(match: re.Match[str]) -> tuple[str, str | None]:
    ident = match.group("ident")
    return name_of(ident), ident


_HEAD = r"\s*<\|tool_call_begin\|>\s*(?P<ident>[^<]+?)\s*<\|tool_call_argument_begin\|>\s*(?=\{)"
GRAMMAR = JsonGrammar(first=(re.compile(_HEAD),), later=(re.compile(r"\s*<\|tool_call_end\|>" + _HEAD),), name=_head_name)
FORMAT = ToolFormat(opens={SECTION_BEGIN: SECTION_END}, parse=parse, scanner=lambda tools: JsonCalls(GRAMMAR, tools))
