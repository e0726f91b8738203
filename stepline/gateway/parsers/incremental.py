"""Streaming a tool call as it is written: its name as soon as it is known, then its arguments in
fragments (the deltas OpenAI, Anthropic and the Responses API stream).

A format's scanner reads a call region's text as it grows and says what it can already tell: a call
opened (its name), and the next fragment of its arguments. Every fragment is a piece of the arguments
text the whole parse will give (`json.dumps` of the arguments object, as `make_call` writes it), so the
fragments a client adds up are exactly the arguments of the non-streamed answer. Scanners are
optimistic: the stream stage checks them against the whole parse when the region ends
(`stepline.gateway.parsers.stream`).

- `JsonArgs` re-writes a JSON object as `json.dumps` would, one character at a time (whitespace
  dropped, `", "` and `": "` separators, escapes decoded and re-encoded, each number once it ends).
- `JsonCalls` finds call heads (`{"name": "f", "arguments": ` and the like) by regular expressions and
  streams the arguments object after each through `JsonArgs`: the JSON families.
- `XmlCalls` builds the arguments object from `<parameter=k>v</parameter>`-style tags: the XML families
  (strings stream as they come; a value of another declared type goes out once it is closed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from stepline.gateway.parsers.base import Piece, ToolSpecs, held_marker, is_text_param, typed_value

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of string characters that json.dumps writes as they are
_SPACE = " \t\n\r"


def quoted(text: str) -> str:
    """The inside of `json.dumps(text, ensure_ascii=False)` (escaping is per character, so pieces join)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class JsonArgs:
    """One JSON object, re-written as `json.dumps(orjson.loads(text), ensure_ascii=False)` writes it.
    `feed(text, at)` consumes `text[at:]` up to the end of the object and returns (output, consumed).
    Not a validator: the whole parse decides; on text it cannot re-write it stops (`bad`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.token = ""  # a number or literal being read, or an escape inside a string
        self.high: str | None = None  # a high surrogate waiting for its pair
        self.done = self.bad = False

    def feed(self, text: str, at: int) -> tuple[str, int]:
        out: list[str] = []
        start = at
        while at < len(text) and not (self.done or self.bad):
            if self.in_string:
                if not self.token and (run := _PLAIN.match(text, at)):
                    out.append(self._flush_high() + run.group())
                    at = run.end()
                    continue
                self._string_char(text[at], out)
            else:
                self._char(text[at], out)
            at += 1
        return "".join(out), at - start

    def _char(self, ch: str, out: list[str]) -> None:
        if ch in _SPACE or ch in ",:}]{[\"":
            if self.token:
                out.append(self._scalar())
            if ch in _SPACE:
                return
        if ch in "{[":
            self.depth += 1
            out.append(ch)
        elif ch in "}]":
            self.depth -= 1
            out.append(ch)
            self.done = self.depth == 0
        elif ch == ",":
            out.append(", ")
        elif ch == ":":
            out.append(": ")
        elif ch == '"':
            self.in_string = True
            out.append('"')
        elif self.depth == 0:
            self.bad = True  # the arguments must be an object
        else:
            self.token += ch

    def _scalar(self) -> str:
        token, self.token = self.token, ""
        if token in ("true", "false", "null"):
            return token
        try:
            return json.dumps(orjson.loads(token))
        except (orjson.JSONDecodeError, ValueError):
            self.bad = True
            return ""

    def _string_char(self, ch: str, out: list[str]) -> None:
        if not self.token:
            if ch == "\\":
                self.token = ch
            elif ch == '"':
                out.append(self._flush_high() + '"')
                self.in_string = False
            else:
                out.append(self._flush_high() + quoted(ch))
            return
        self.token += ch
        if self.token[1] != "u":
            decoded = _ESCAPES.get(self.token[1])
            self.token = ""
            if decoded is None:
                self.bad = True
            else:
                out.append(self._flush_high() + quoted(decoded))
        elif len(self.token) == 6:
            self._unicode(out)

    def _unicode(self, out: list[str]) -> None:
        token, self.token = self.token, ""
        try:
            code = int(token[2:], 16)
        except ValueError:
            self.bad = True
            return
        if 0xDC00 <= code <= 0xDFFF and self.high is not None:
            pair = 0x10000 + ((ord(self.high) - 0xD800) << 10) + (code - 0xDC00)
            self.high = None
            out.append(chr(pair))
        elif 0xD800 <= code <= 0xDBFF:
            out.append(self._flush_high())
            self.high = chr(code)
        else:
            out.append(self._flush_high() + quoted(chr(code)))

    def _flush_high(self) -> str:
        high, self.high = self.high, None
        return "" if high is None else high  # a lone surrogate: the whole parse refuses it anyway


# a JSON call object's start, up to its arguments object: {"name": "f", "arguments": (or "parameters")
JSON_HEAD = r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'

NameOf = Callable[[re.Match[str]], tuple[str, str | None]]


def json_name(match: re.Match[str]) -> tuple[str, str | None]:
    """A head's `name` group (a JSON string, or a bare name) and no call id of the format's own."""
    raw = match.group("name")
    if raw.startswith('"'):
        try:
            return str(json.loads(raw)), None
        except json.JSONDecodeError:
            return "", None
    return raw.strip(), None


@dataclass(frozen=True)
class JsonGrammar:
    """Where a JSON family's calls start. Each pattern ends just before the `{` of the arguments:
    `first` at the region's start, `later` after the previous call's arguments (so it covers the
    text between two calls; empty: one call per region)."""

    first: tuple[re.Pattern[str], ...]
    later: tuple[re.Pattern[str], ...] = ()
    name: NameOf = json_name


class JsonCalls:
    """A JSON family's scanner (see the module docstring)."""

    def __init__(self, grammar: JsonGrammar, tools: ToolSpecs) -> None:
        self.grammar, self.tools = grammar, tools
        self.at = 0
        self.index = 0
        self.args: JsonArgs | None = None
        self.stuck = False

    def scan(self, body: str) -> list[Piece]:
        pieces: list[Piece] = []
        while not self.stuck:
            if self.args is None:
                if not self._head(body, pieces):
                    break
                continue
            text, used = self.args.feed(body, self.at)
            self.at += used
            add_text(pieces, self.index, text)
            if self.args.bad:
                self.stuck = True
            if not self.args.done:
                break
            self.args, self.index = None, self.index + 1
        return pieces

    def _head(self, body: str, pieces: list[Piece]) -> bool:
        patterns = self.grammar.first if self.index == 0 else self.grammar.later
        if not patterns:
            self.stuck = True
            return False
        match = next((m for p in patterns if (m := p.match(body, self.at))), None)
        if match is None:
            return False  # not yet (or never: the whole parse decides)
        name, ident = self.grammar.name(match)
        if not name or (self.tools is not None and name not in self.tools):
            self.stuck = True
            return False
        pieces.append(Piece(self.index, name=name, ident=ident))
        self.at, self.args = match.end(), JsonArgs()
        return True


def add_text(pieces: list[Piece], index: int, text: str) -> None:
    """Append an arguments fragment, joined to the previous piece of the same call."""
    if not text:
        return
    if pieces and pieces[-1].index == index:
        pieces[-1].text += text
    else:
        pieces.append(Piece(index, text))


@dataclass(frozen=True)
class XmlGrammar:
    """An XML family's tags: `head` (group `name`), `param` (group `key`, ends where the value starts),
    the value's closing tag, whether one newline is trimmed at each end of a value, and `end` (after
    the last value, closes the call; None: the region's end does)."""

    head: re.Pattern[str]
    param: re.Pattern[str]
    value_close: str
    trim_newlines: bool
    end: re.Pattern[str] | None = None


class XmlCalls:
    """An XML family's scanner: one call per region (see the module docstring)."""

    def __init__(self, grammar: XmlGrammar, tools: ToolSpecs) -> None:
        self.grammar, self.tools = grammar, tools
        self.at = 0
        self.name: str | None = None
        self.key: str | None = None  # the parameter whose value is being read
        self.keys = 0
        self.value_started = False
        self.stuck = False

    def scan(self, body: str) -> list[Piece]:
        pieces: list[Piece] = []
        while not self.stuck and self._step(body, pieces):
            pass
        return pieces

    def _step(self, body: str, pieces: list[Piece]) -> bool:
        g = self.grammar
        if self.name is None:
            match = g.head.match(body, self.at)
            if match is None:
                return False
            name = match.group("name").strip()
            if self.tools is not None and name not in self.tools:
                self.stuck = True
                return False
            self.name, self.at = name, match.end()
            pieces.append(Piece(0, name=name))
            return True
        if self.key is None:
            return self._next_tag(body, pieces)
        return self._value(body, pieces)

    def _next_tag(self, body: str, pieces: list[Piece]) -> bool:
        g = self.grammar
        if g.end is not None and (end := g.end.match(body, self.at)):
            add_text(pieces, 0, "}" if self.keys else "{}")
            self.at, self.stuck = end.end(), True  # one call per region
            return False
        match = g.param.match(body, self.at)
        if match is None:
            return False
        self.key, self.at, self.value_started = match.group("key").strip(), match.end(), False
        add_text(pieces, 0, ("{" if not self.keys else ", ") + json.dumps(self.key, ensure_ascii=False) + ": ")
        self.keys += 1
        return True

    def _value(self, body: str, pieces: list[Piece]) -> bool:
        assert self.key is not None and self.name is not None
        g = self.grammar
        close = body.find(g.value_close, self.at)
        text = is_text_param(self.name, self.key, self.tools)
        if close < 0:
            if text:  # stream what is surely part of the value
                end = len(body) - held_marker(body[self.at:], g.value_close)
                if g.trim_newlines and end > self.at and body[end - 1] == "\n":
                    end -= 1  # maybe the newline before the closing tag, which the value drops
                self._stream(body[self.at:end], pieces)
                self.at = max(self.at, end)
            return False
        raw = body[self.at:close]
        if text and not self.value_started:  # the whole value at once
            value = raw.removeprefix("\n").removesuffix("\n") if g.trim_newlines else raw
            add_text(pieces, 0, json.dumps(value, ensure_ascii=False))
        elif text:  # the rest: its leading newline is gone already, the trailing one was held back
            self._stream(raw[:-1] if g.trim_newlines and raw.endswith("\n") else raw, pieces)
            add_text(pieces, 0, '"')
        else:
            value = raw.removeprefix("\n").removesuffix("\n") if g.trim_newlines else raw
            add_text(pieces, 0, json.dumps(typed_value(value, self.name, self.key, self.tools), ensure_ascii=False))
        self.at, self.key = close + len(g.value_close), None
        return True

    def _stream(self, raw: str, pieces: list[Piece]) -> None:
        if not self.value_started:
            if not raw:
                return
            if self.grammar.trim_newlines and raw.startswith("\n"):
                raw = raw[1:]
            self.value_started = True
            add_text(pieces, 0, '"')
        add_text(pieces, 0, quoted(raw))
