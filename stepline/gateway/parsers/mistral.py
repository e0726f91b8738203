"""mistral: `[TOOL_CALLS]` then the calls, to the end of the answer. Both of Mistral's tokenizer
generations:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v3: a JSON list)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}        (v11+; [CALL_ID]id optional)
"""

from __future__ import annotations

import json
import re

from stepline.gateway.parsers.base import (
    ToolCall,
    ToolFormat,
    ToolSpecs,
    call_arguments,
    call_name,
    json_calls,
    load_json,
    make_call,
)
from stepline.gateway.parsers.incremental import JSON_HEAD, JsonCalls, JsonGrammar

OPEN = "[TOOL_CALLS]"


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    if body.lstrip().startswith(("[", "{")):
        data = load_json(body)
        return json_calls(data if isinstance(data, list) else [data], tools)
    calls = []
    for part in body.split(OPEN):
        name, sep, args = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        call = make_call(name, args, tools) if sep else None
        if call is None:
            return None
        calls.append(call)
    return calls


def render(calls: list[dict]) -> str:
    return OPEN + json.dumps([{"name": call_name(c), "arguments": call_arguments(c)} for c in calls], ensure_ascii=False)


_V11_HEAD = r"(?P<name>[^\[\]{}\s]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*(?=\{)"
GRAMMAR = JsonGrammar(first=(re.compile(r"\s*\[?\s*" + JSON_HEAD), re.compile(r"\s*" + _V11_HEAD)),
                      later=(re.compile(r"\s*\}\s*,\s*" + JSON_HEAD), re.compile(re.escape(OPEN) + r"\s*" + _V11_HEAD)))
FORMAT = ToolFormat(opens={OPEN: None}, parse=parse, render=render, scanner=lambda tools: JsonCalls(GRAMMAR, tools))
