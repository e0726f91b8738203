"""gpt-oss (OpenAI's harmony format): the answer is a sequence of messages, each a header and a body,
reasoning and tool calls included, so this one parser does both (tool parser `gpt-oss` / `openai`,
as SGLang and vLLM name it):

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The first header has no `<|start|>assistant` (the generation prompt wrote it). The `analysis` channel is
reasoning; a message addressed `to=functions.NAME` (any channel, the recipient in the header before or
after the channel) is a call whose body is the JSON arguments; `final` and `commentary` without a
recipient (a preamble) are content. A message to another recipient (a built-in tool such as
`browser.search`), a call that does not parse, or an answer with no harmony header stays text. Streamed
calls open at the end of their header and send argument fragments (`stepline.gateway.parsers.incremental`).
"""

from __future__ import annotations

import re

from stepline.gateway.parsers.base import Event, ToolCall, ToolFormat, ToolSpecs, held_marker, make_call
from stepline.gateway.parsers.incremental import JsonArgs

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """The incremental parser of one harmony answer (see the module docstring).
    States: start → header ⇄ body (reasoning | content | call | text), or plain (no harmony header)."""

    def __init__(self, tools: ToolSpecs, tools_enabled: bool, incremental: bool = False) -> None:
        self.tools, self.tools_enabled, self.incremental = tools, tools_enabled, incremental
        self.buf = ""
        self.state = "start"
        self.kind = ""  # the open body's kind
        self.header = ""
        self.call: ToolCall | None = None  # the call being read (its name; id when streamed)
        self.args: JsonArgs | None = None
        self.args_at = 0  # how much of the body the argument stream has read
        self.sent = ""  # argument fragments streamed so far
        self.reasoned = False

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
        if self.state == "header" and self.buf.strip():
            out.append(Event("content", self.buf))  # cut inside a header: what it is, as text
        elif self.state == "body":
            self._end_body(out, self.buf, "")
        elif self.state == "plain" and self.buf:
            out.append(Event("content", self.buf))
        self.buf = ""
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith((CHANNEL, START)):
                self.state = "header"
            elif not final and any(m.startswith(head) for m in (CHANNEL, START)):
                return False
            else:
                self.state = "plain"
            return True
        if self.state == "plain":
            if not final:
                out.extend([Event("content", self.buf)] if self.buf else [])
                self.buf = ""
            return False
        if self.state == "header":
            return self._step_header(out)
        return self._step_body(out)

    def _step_header(self, out: list[Event]) -> bool:
        at = self.buf.find(MESSAGE)
        if at < 0:
            return False
        self.header, self.buf = self.buf[:at], self.buf[at + len(MESSAGE):]
        channel = _CHANNEL.search(self.header)
        recipient = _RECIPIENT.search(self.header)
        self.state, self.call = "body", None
        if recipient is not None:
            name = recipient.group(1).removeprefix("functions.")
            offered = self.tools is None or name in self.tools
            is_function = recipient.group(1).startswith("functions.")
            self.kind = "call" if self.tools_enabled and is_function and offered else "text"
            if self.kind == "call":
                self._open(out, name)
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
            out.append(Event("reasoning", "\n" if self.reasoned else ""))  # one reasoning text, messages on lines
            self.reasoned = True
        else:
            self.kind = "content"
        return True

    def _open(self, out: list[Event], name: str) -> None:
        self.call = ToolCall(name=name, arguments="")
        self.sent, self.args_at = "", 0
        self.args = JsonArgs() if self.incremental else None
        if self.args is not None:
            out.append(Event("tool_open", tool_call=self.call))

    def _step_body(self, out: list[Event]) -> bool:
        found = [(at, m) for m in ENDS if (at := self.buf.find(m)) >= 0]
        if found:
            at, marker = min(found)
            body, self.buf = self.buf[:at], self.buf[at + len(marker):]
            self._end_body(out, body, marker)
            self.state = "header"
            return True
        seen = len(self.buf) - max(held_marker(self.buf, m) for m in ENDS)
        if self.kind in ("reasoning", "content") and seen > 0:
            out.append(Event(self.kind, self.buf[:seen]))  # type: ignore[arg-type]
            self.buf = self.buf[seen:]
        elif self.kind == "call" and self.args is not None:
            self._stream_args(out, self.buf[:seen])
        return False

    def _stream_args(self, out: list[Event], body: str) -> None:
        assert self.args is not None and self.call is not None
        if self.args.bad or self.args.done:
            return
        text, used = self.args.feed(body, self.args_at)
        self.args_at += used
        if text:
            self.sent += text
            out.append(Event("tool_args", text, self.call))

    def _end_body(self, out: list[Event], body: str, marker: str) -> None:
        if self.kind in ("reasoning", "content"):
            if body:
                out.append(Event(self.kind, body))  # type: ignore[arg-type]
            return
        call = make_call(self.call.name, body, self.tools) if self.call is not None else None
        if self.call is not None and self.args is not None:  # opened in the stream: it stays a call
            if call is not None and call.arguments.startswith(self.sent):
                if rest := call.arguments[len(self.sent):]:
                    out.append(Event("tool_args", rest, self.call))
                call.id = self.call.id
            else:
                call = ToolCall(self.call.name, self.sent, self.call.id)  # as the client has it
        if call is not None:
            out.append(Event("tool_call", tool_call=call))
        else:
            out.append(Event("content", self.header + MESSAGE + body + marker))
        self.call, self.args = None, None


FORMAT = ToolFormat(opens={}, parse=lambda body, tools: None, answer_parser=HarmonyParser)
