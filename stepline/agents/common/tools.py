"""Tools a harness offers the model: one definition, rendered for either API.

A tool function takes its JSON arguments as keyword arguments and returns the text sent back to the
model. Bad arguments or invalid actions raise `ToolError`; the harness turns that into an
"error: …" tool result (the episode goes on — the agent may recover).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ToolError(Exception):
    """An invalid tool call; the message is what the agent sees."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str  # keep short: it costs context on every call
    parameters: dict[str, str] = field(default_factory=dict)  # argument name -> JSON type ("string", "integer")
    fn: Callable[..., str] | None = None  # bound per episode; None in a schema-only definition

    def json_schema(self) -> dict[str, Any]:
        props = {name: {"type": kind} for name, kind in self.parameters.items()}
        return {"type": "object", "properties": props, "required": list(self.parameters)}


def openai_schema(tool: Tool) -> dict[str, Any]:
    """The tool as an OpenAI chat.completions `tools` entry."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.json_schema()},
    }


def anthropic_schema(tool: Tool) -> dict[str, Any]:
    """The tool as an Anthropic Messages `tools` entry."""
    return {"name": tool.name, "description": tool.description, "input_schema": tool.json_schema()}


def call_tool(tools: dict[str, Tool], name: str, arguments: Any) -> tuple[str, bool]:
    """Run one tool call; returns (result text, failed). Never raises for the agent's mistakes."""
    tool = tools.get(name)
    if tool is None or tool.fn is None:
        return f"error: unknown tool {name!r}", True
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object", True
    missing = [key for key in tool.parameters if key not in arguments]
    extra = [key for key in arguments if key not in tool.parameters]
    if missing or extra:
        return f"error: {name} takes ({', '.join(tool.parameters)})", True
    try:
        return tool.fn(**arguments), False
    except ToolError as exc:
        return f"error: {exc}", True
