"""hermes / qwen25 / qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
(Qwen2.5, Qwen3, Hermes, SmolLM2 with a ChatML tools template)."""

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
)
from stepline.gateway.parsers.incremental import JSON_HEAD, JsonCalls, JsonGrammar


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    return json_calls([load_json(body)], tools)


def render(calls: list[dict]) -> str:
    return "\n".join('<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>'
                     % (json.dumps(call_name(c)), json.dumps(call_arguments(c), ensure_ascii=False)) for c in calls)


GRAMMAR = JsonGrammar(first=(re.compile(r"\s*" + JSON_HEAD),))  # one call per block
FORMAT = ToolFormat(opens={"<tool_call>": "</tool_call>"}, parse=parse, render=render,
                    scanner=lambda tools: JsonCalls(GRAMMAR, tools))
