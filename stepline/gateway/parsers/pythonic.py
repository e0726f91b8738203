"""pythonic (llama4_pythonic): a Python list of calls with literal keyword arguments, the whole answer
(Llama 3.2/3.3/4 with a pythonic template, Gemma 3), optionally inside Llama 4's markers:

    [get_weather(city="Paris", days=3), get_time(zone="CET")]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>
"""

from __future__ import annotations

import ast
import json
from typing import Any

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, call_arguments, call_name, make_call


def _call(node: ast.expr, tools: ToolSpecs) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)  # dotted names (a module's function) keep their dots
    args: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            args[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return make_call(name, args, tools)


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    text = body.strip()
    if not text.startswith("["):
        text = "[" + text + "]"  # inside <|python_start|>, the brackets are optional
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(node, tools) for node in tree.body.elts]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def render(calls: list[dict]) -> str:
    def literal(value: Any) -> str:  # strings in double quotes (as these models write them), else Python literals
        return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return "[" + ", ".join(f"{call_name(c)}(" + ", ".join(f"{k}={literal(v)}" for k, v in call_arguments(c).items())
                           + ")" for c in calls) + "]"


FORMAT = ToolFormat(opens={"<|python_start|>": "<|python_end|>"}, parse=parse, bare_starts=("[",), render=render)
