"""llama3 / llama3_json: Llama 3.1-3.3 JSON calls, the whole answer, with or without `<|python_tag|>`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "f", "parameters": {}}

Several calls are separated by `;` (or whitespace). Anything else after the tag (code for the
built-in code interpreter) stays text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, call_arguments, call_name, json_calls
from stepline.gateway.parsers.incremental import JSON_HEAD, JsonCalls, JsonGrammar

_DECODER = json.JSONDecoder()


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    objects: list[Any] = []
    at, text = 0, body.strip()
    while at < len(text):
        try:
            obj, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        objects.append(obj)
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return json_calls(objects, tools)


def render(calls: list[dict]) -> str:
    return "; ".join(json.dumps({"name": call_name(c), "parameters": call_arguments(c)}, ensure_ascii=False)
                     for c in calls)


GRAMMAR = JsonGrammar(first=(re.compile(r"\s*" + JSON_HEAD),), later=(re.compile(r"\s*\}[\s;]*" + JSON_HEAD),))
FORMAT = ToolFormat(opens={"<|python_tag|>": None}, parse=parse, bare_starts=("{",), render=render,
                    scanner=lambda tools: JsonCalls(GRAMMAR, tools))
