"""What an output parser produces: the API fields hidden in a model's sampled text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it (re-serialised if it was not text)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class Event:
    """One piece of a parsed stream: reasoning text, answer text, or a whole tool call."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]


class StreamParser(Protocol):
    """Incremental parser: `feed` text deltas as they arrive, then `finish` once. Feeding the whole
    text in one piece gives the same events as any split of it."""

    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def collect(events: list[Event]) -> ParsedOutput:
    """Fold a parser's events into the fields of a non-streamed answer."""
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e.tool_call for e in events if e.kind == "tool_call" and e.tool_call is not None]
    has_reasoning = any(e.kind == "reasoning" for e in events)
    return ParsedOutput(content=content, reasoning=reasoning if has_reasoning else None, tool_calls=calls)
