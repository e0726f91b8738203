"""Parser for Qwen / Hermes-style outputs: `<think>…</think>` reasoning, then text and
`<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks.

One incremental state machine serves both streamed and whole answers (a whole answer is one delta),
so the two can never disagree. Text that might be the start of a marker, and whitespace that the
answer would drop at a boundary, are held back until the next delta decides. A tool-call block whose
JSON is malformed, names no known tool, or never closes comes back as text, never as an error.
"""

from __future__ import annotations

import json
from collections.abc import Collection

import orjson

from gateway.parsers.base import Event, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _held_marker(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker` (to hold back)."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def parse_tool_call(block: str, tool_names: Collection[str] | None) -> ToolCall | None:
    """The tool call in one `<tool_call>` block, or None when it is malformed."""
    try:
        data = orjson.loads(block.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    if tool_names is not None and data["name"] not in tool_names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    # json.dumps spacing is what the chat template's `tojson` writes, i.e. what the model was trained on
    return ToolCall(name=data["name"], arguments=json.dumps(args, ensure_ascii=False))


class HermesStreamParser:
    """States: start → reasoning? → content ⇄ tool. `tools_enabled=False` leaves tool blocks as text;
    `tool_names` (if given) limits calls to the tools the request offered."""

    def __init__(self, *, reasoning: bool = True, tools_enabled: bool = True,
                 tool_names: Collection[str] | None = None, in_reasoning: bool = False) -> None:
        self.reasoning = reasoning
        self.tools_enabled = tools_enabled
        self.tool_names = tool_names
        self.state = "reasoning" if in_reasoning else ("start" if reasoning else "content")
        self.buf = ""
        self.started = False  # has any text of the current reasoning/content run been emitted
        self.content_started = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self.state == "tool":
            self._content(out, CALL_OPEN + self.buf)
        elif self.state == "reasoning":
            self._reasoning(out, self.buf.rstrip("\n"))
        elif self.buf.strip():
            self._content(out, self.buf.rstrip())
        self.buf = ""
        return out

    # one transition; returns True when it consumed something and should run again
    def _step(self, out: list[Event], final: bool) -> bool:
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buf = stripped[len(THINK_OPEN):]
                self.state = "reasoning"
                return True
            if not final and THINK_OPEN.startswith(stripped):
                return False  # not decided yet ("", "<", "<thi"...)
            self.state = "content"
            return True
        if self.state == "reasoning":
            return self._step_reasoning(out, final)
        if self.state == "content":
            return self._step_content(out, final)
        return self._step_tool(out)

    def _step_reasoning(self, out: list[Event], final: bool) -> bool:
        if not self.started:
            self.buf = self.buf.lstrip("\n")
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            self._reasoning(out, self.buf[:end].rstrip("\n"))
            self.buf = self.buf[end + len(THINK_CLOSE):]
            self.state, self.started = "content", self.content_started
            return True
        if not final:
            held = _held_marker(self.buf, THINK_CLOSE)
            body = self.buf[: len(self.buf) - held]
            keep = held + len(body) - len(body.rstrip("\n"))  # newlines before a possible </think> too
            if len(self.buf) > keep:
                self._reasoning(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_content(self, out: list[Event], final: bool) -> bool:
        if not self.content_started:
            self.buf = self.buf.lstrip()
        start = self.buf.find(CALL_OPEN) if self.tools_enabled else -1
        if start >= 0:
            self._content(out, self.buf[:start].rstrip())
            self.buf = self.buf[start + len(CALL_OPEN):]
            self.state = "tool"
            return True
        if not final:
            held = _held_marker(self.buf, CALL_OPEN) if self.tools_enabled else 0
            body = self.buf[: len(self.buf) - held]
            keep = held + len(body) - len(body.rstrip())
            self._content(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_tool(self, out: list[Event]) -> bool:
        end = self.buf.find(CALL_CLOSE)
        if end < 0:
            return False
        block = self.buf[:end]
        self.buf = self.buf[end + len(CALL_CLOSE):]
        self.state = "content"
        call = parse_tool_call(block, self.tool_names)
        if call is None:
            self._content(out, CALL_OPEN + block + CALL_CLOSE)
        else:
            out.append(Event("tool_call", tool_call=call))
        return True

    def _reasoning(self, out: list[Event], text: str) -> None:
        if text or not self.started:  # an empty first event still tells that the answer had reasoning
            out.append(Event("reasoning", text))
        self.started = True

    def _content(self, out: list[Event], text: str) -> None:
        if text:
            out.append(Event("content", text))
            self.content_started = True
