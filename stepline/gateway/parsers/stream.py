"""The incremental machine that runs any family's reasoning markers and tool-call format.

One state machine serves both streamed and whole answers (a whole answer is one delta), so the two can
never disagree. `OutputParser` is a reasoning stage (reasoning → content) feeding a tool stage
(content ⇄ call region). Text that might be the start of a marker, and whitespace that the answer
would drop at a boundary, are held back until the next delta decides. A call region that its format
cannot parse (malformed, an unknown tool, never closed) comes back as text, never as an error.

Streamed (`incremental=True`), a format with a scanner also tells each call while its region is still
being written (`tool_open`, then `tool_args` fragments); when the region ends, the whole parse settles
it: the calls it finds must extend what was streamed (same names, arguments that start with the
fragments sent), and the rest of their arguments follows. A call ends (`tool_call`) before the next
one of its region opens, so clients that take one block at a time (Anthropic, Responses) can. A region that fails after a call was
opened cannot be taken back from the client: its opened calls end with the arguments streamed so far
(as OpenAI's own streams end a call cut by max_tokens), and its remaining text is not shown (the record
keeps the exact ids). A whole answer gives such a region back as text.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepline.gateway.parsers.base import (
    Event,
    ParsedOutput,
    Piece,
    Scanner,
    StreamParser,
    ToolCall,
    ToolFormat,
    ToolSpecs,
    held_marker,
)


@dataclass(frozen=True)
class ReasoningFormat:
    """Markers around a model's reasoning. `forced`: the answer starts inside reasoning (the template's
    generation prompt already opened it, as DeepSeek-R1's and Qwen3-Thinking's do)."""

    open: str
    close: str
    forced: bool = False


@dataclass
class _Opened:
    """A call streamed before its region ended: its head (id, name) and the arguments sent so far."""

    head: ToolCall
    own_id: bool  # the format names its calls (then the whole parse must give the same id)
    sent: str = ""
    closed: bool = False  # ended when the next call of its region opened (its arguments were complete)


class ToolStage:
    """content ⇄ region. `tools_enabled=False` leaves every region as text; `incremental` streams calls
    while their region is written (see the module docstring)."""

    def __init__(self, fmt: ToolFormat | None, tools: ToolSpecs, tools_enabled: bool, incremental: bool = False) -> None:
        self.fmt = fmt if tools_enabled else None
        self.tools = tools
        self.incremental = incremental
        self.scanner: Scanner | None = None
        self.opened: list[_Opened] = []
        self.buf = ""
        self.region: tuple[str, str | None] | None = None  # (open marker, close marker) while inside one
        self.started = False  # has any content been emitted
        self.gap = ""  # whitespace between the text and the open region (given back if it stays text)

    def feed(self, text: str, out: list[Event], final: bool = False) -> None:
        self.buf += text
        while self._step(out, final):
            pass

    def finish(self, out: list[Event]) -> None:
        self.feed("", out, final=True)
        if self.region is not None:
            marker, close = self.region
            calls = self.fmt.parse(self.buf, self.tools) if self.fmt is not None and close is None else None
            self._settle(out, calls, (marker + self.buf).rstrip())
        elif self.buf.strip():
            self._content(out, self.buf.rstrip())
        self.buf, self.region = "", None

    def _step(self, out: list[Event], final: bool) -> bool:
        return self._step_region(out) if self.region is not None else self._step_content(out, final)

    def _step_content(self, out: list[Event], final: bool) -> bool:
        if not self.started:
            self.buf = self.buf.lstrip()
        fmt = self.fmt
        if fmt is not None:
            if not self.started and self.buf[:1] and self.buf[0] in fmt.bare_starts:
                self._enter("", None)
                return True
            found = [(at, m) for m in fmt.opens if (at := self.buf.find(m)) >= 0]
            if found:
                at, marker = min(found)
                before = self.buf[:at]
                self._content(out, before.rstrip())
                self.gap = before[len(before.rstrip()):] if self.started else ""
                self.buf = self.buf[at + len(marker):]
                self._enter(marker, fmt.opens[marker])
                return True
        if not final:
            held = max((held_marker(self.buf, m) for m in fmt.opens), default=0) if fmt is not None else 0
            body = self.buf[: len(self.buf) - held]
            keep = held + len(body) - len(body.rstrip())
            self._content(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_region(self, out: list[Event]) -> bool:
        assert self.region is not None and self.fmt is not None
        marker, close = self.region
        end = self.buf.find(close) if close is not None else -1
        if close is None or end < 0:  # to the end of the answer, or not closed yet
            if self.scanner is not None:
                seen = len(self.buf) - (held_marker(self.buf, close) if close is not None else 0)
                self._pieces(out, self.scanner.scan(self.buf[:seen]))
            return False
        body = self.buf[:end]
        self.buf = self.buf[end + len(close):]
        self._settle(out, self.fmt.parse(body, self.tools), marker + body + close)
        return True

    def _enter(self, marker: str, close: str | None) -> None:
        self.region = (marker, close)
        scanner = self.fmt.scanner if self.fmt is not None and self.incremental else None
        self.scanner = scanner(self.tools) if scanner is not None else None

    def _pieces(self, out: list[Event], pieces: list[Piece]) -> None:
        for piece in pieces:
            if piece.name is not None:
                if self.opened and not self.opened[-1].closed:  # a client takes one call at a time
                    last = self.opened[-1]
                    last.closed = True
                    out.append(Event("tool_call", tool_call=ToolCall(last.head.name, last.sent, last.head.id)))
                head = ToolCall(name=piece.name, arguments="")
                if piece.ident is not None:
                    head.id = piece.ident
                self.opened.append(_Opened(head, piece.ident is not None))
                out.append(Event("tool_open", tool_call=head))
            if piece.text and piece.index < len(self.opened):
                opened = self.opened[piece.index]
                opened.sent += piece.text
                out.append(Event("tool_args", piece.text, opened.head))

    def _settle(self, out: list[Event], calls: list[ToolCall] | None, text: str) -> None:
        """The region's end: its calls (extending those streamed), or its text (see the module docstring)."""
        opened, self.opened, self.scanner, self.region = self.opened, [], None, None
        gap = self._gap()
        if opened and not _extends(calls, opened):
            out.extend(Event("tool_call", tool_call=ToolCall(o.head.name, o.sent, o.head.id)) for o in opened if not o.closed)
            return
        if calls is None:
            self._content(out, gap + text)
            return
        for k, call in enumerate(calls):
            if k < len(opened):
                o = opened[k]
                if o.closed:
                    continue  # already out, with exactly these arguments
                if rest := call.arguments[len(o.sent):]:
                    out.append(Event("tool_args", rest, o.head))
                call.id = o.head.id
            out.append(Event("tool_call", tool_call=call))

    def _gap(self) -> str:
        gap, self.gap = self.gap, ""
        return gap

    def _content(self, out: list[Event], text: str) -> None:
        if text:
            out.append(Event("content", text))
            self.started = True


def _extends(calls: list[ToolCall] | None, opened: list[_Opened]) -> bool:
    """Whether the whole parse's calls continue the ones already streamed."""
    return calls is not None and len(calls) >= len(opened) and all(
        c.name == o.head.name and (c.arguments == o.sent if o.closed else c.arguments.startswith(o.sent))
        and (c.id == o.head.id or not o.own_id)
        for c, o in zip(calls, opened))


class OutputParser:
    """A whole answer's parser: reasoning (if the family has markers), then content and tool calls.
    States: start → reasoning? → content (handed to the tool stage)."""

    def __init__(self, reasoning: ReasoningFormat | None, tools: ToolStage, in_reasoning: bool = False) -> None:
        self.fmt = reasoning
        self.tools = tools
        forced = reasoning is not None and (reasoning.forced or in_reasoning)
        self.state = "content" if reasoning is None else ("reasoning" if forced else "start")
        self.buf = ""
        self.started = False  # has any reasoning been emitted
        self.opened = not forced  # forced starts take the model's own opener, if it writes one, as a marker

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
        if self.state == "reasoning":
            self._reasoning(out, self.buf.rstrip("\n"))
            self.buf = ""
        self.tools.finish(out)
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        if self.state == "start":
            assert self.fmt is not None
            stripped = self.buf.lstrip()
            if stripped.startswith(self.fmt.open):
                self.buf = stripped[len(self.fmt.open):]
                self.state = "reasoning"
                self.started = False
                return True
            if not final and self.fmt.open.startswith(stripped):
                return False  # not decided yet ("", "<", "<thi"...)
            self.state = "content"
            return True
        if self.state == "reasoning":
            return self._step_reasoning(out, final)
        self.tools.feed(self.buf, out)
        self.buf = ""
        return False

    def _step_reasoning(self, out: list[Event], final: bool) -> bool:
        assert self.fmt is not None
        if not self.started:
            self.buf = self.buf.lstrip("\n")
        if not self.opened:
            if not final and self.fmt.open.startswith(self.buf):
                return False
            self.opened = True
            if self.buf.startswith(self.fmt.open):  # a forced start where the model still wrote the opener
                self.buf = self.buf[len(self.fmt.open):].lstrip("\n")
        end = self.buf.find(self.fmt.close)
        if end >= 0:
            self._reasoning(out, self.buf[:end].rstrip("\n"))
            self.buf = self.buf[end + len(self.fmt.close):]
            self.state = "content"
            return True
        if not final:
            held = held_marker(self.buf, self.fmt.close)
            body = self.buf[: len(self.buf) - held]
            keep = held + len(body) - len(body.rstrip("\n"))  # newlines before a possible close marker too
            if len(self.buf) > keep:
                self._reasoning(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _reasoning(self, out: list[Event], text: str) -> None:
        if text or not self.started:  # an empty first event still tells that the answer had reasoning
            out.append(Event("reasoning", text))
        self.started = True


@dataclass(frozen=True)
class ParserSpec:
    """One model's formats, resolved once at start; `new` makes the parser of one answer."""

    tools: ToolFormat | None
    reasoning: ReasoningFormat | None
    in_reasoning: bool = False  # the prompt already opened the reasoning block

    def new(self, tools_enabled: bool, tools: ToolSpecs, incremental: bool = False) -> StreamParser:
        """`tools`: the offered tools (name -> parameters schema; None: any name); `incremental`: stream
        each call's name and arguments while it is written (`tool_open` / `tool_args` events)."""
        if self.tools is not None and self.tools.answer_parser is not None:  # a family with its own machine
            return self.tools.answer_parser(tools, tools_enabled, incremental)
        return OutputParser(self.reasoning, ToolStage(self.tools, tools, tools_enabled, incremental), self.in_reasoning)


def collect(events: list[Event]) -> ParsedOutput:
    """Fold a parser's events into the fields of a non-streamed answer."""
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e.tool_call for e in events if e.kind == "tool_call" and e.tool_call is not None]
    has_reasoning = any(e.kind == "reasoning" for e in events)
    return ParsedOutput(content=content, reasoning=reasoning if has_reasoning else None, tool_calls=calls)
