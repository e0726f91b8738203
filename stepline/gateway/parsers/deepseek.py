"""deepseekv3 and deepseekv31: DeepSeek's call sections (full-width bars, `▁` for spaces):

    v3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
          ```json
          {"city": "Paris"}
          ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    v3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, make_call
from stepline.gateway.parsers.incremental import JsonCalls, JsonGrammar

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3 = re.compile(r"^\s*function" + SEP + r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)


def _calls(body: str) -> list[str] | None:
    parts = []
    rest = body.strip()
    while rest:
        if not rest.startswith(CALL_BEGIN) or CALL_END not in rest:
            return None
        inner, _, rest = rest[len(CALL_BEGIN):].partition(CALL_END)
        parts.append(inner)
        rest = rest.strip()
    return parts or None


def parse_v3(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    out = []
    found = _calls(body)
    inners: list[str | None] = list(found) if found else [None]
    for inner in inners:
        match = _V3.match(inner) if inner is not None else None
        call = make_call(match.group(1).strip(), match.group(2), tools) if match else None
        if call is None:
            return None
        out.append(call)
    return out


def parse_v31(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    out = []
    for inner in _calls(body) or [""]:
        name, sep, args = inner.partition(SEP)
        call = make_call(name.strip(), args, tools) if sep else None
        if call is None:
            return None
        out.append(call)
    return out


_V3_HEAD = r"\s*" + CALL_BEGIN + r"function" + SEP + r"(?P<name>[^\n]+)\n```(?:json)?\n\s*(?=\{)"
_V31_HEAD = r"\s*" + CALL_BEGIN + r"(?P<name>[^<]+?)" + SEP + r"\s*(?=\{)"
V3_GRAMMAR = JsonGrammar(first=(re.compile(_V3_HEAD),), later=(re.compile(r"\s*```\s*" + CALL_END + _V3_HEAD),))
V31_GRAMMAR = JsonGrammar(first=(re.compile(_V31_HEAD),), later=(re.compile(r"\s*" + CALL_END + _V31_HEAD),))
V3 = ToolFormat(opens={CALLS_BEGIN: CALLS_END}, parse=parse_v3, scanner=lambda tools: JsonCalls(V3_GRAMMAR, tools))
V31 = ToolFormat(opens={CALLS_BEGIN: CALLS_END}, parse=parse_v31, scanner=lambda tools: JsonCalls(V31_GRAMMAR, tools))
