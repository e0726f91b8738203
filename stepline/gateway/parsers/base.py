"""What an output parser produces (the API fields hidden in a model's sampled text), and the pieces
every family's tool-call format is made of.

A family's tool-call format is a `ToolFormat`: which markers open a call region (and which marker
closes each; None: the region runs to the end of the answer), which characters open one when they
begin the answer (Llama's bare `{...}`, pythonic `[f(a=1)]`), and a pure `parse(body, tools)` that
turns one region into tool calls or None (then the region stays text). `stepline.gateway.parsers.stream` runs
any format incrementally; a format with a `scanner` (`stepline.gateway.parsers.incremental`) also streams each
call's name and arguments while the region is still being written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

# the tools a request offered: name -> its JSON-schema `parameters` ({} when none); None: any name
ToolSpecs = Mapping[str, Mapping[str, Any]] | None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object (json.dumps spacing, as a template's tojson writes it)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class Event:
    """One piece of a parsed stream: reasoning text, answer text, or a tool call. A call comes whole
    (`tool_call`), or, streamed, as `tool_open` (its id and name; arguments "") and `tool_args` (the
    next fragment of its arguments in `text`; `tool_call` names the opened call) before that same
    `tool_call` (same id), whose arguments are then exactly the fragments joined."""

    kind: Literal["reasoning", "content", "tool_open", "tool_args", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


@dataclass
class Piece:
    """What a scanner can already tell about a region being written: a call opened (`name` set), or
    the next fragment of its arguments (`text`)."""

    index: int  # the call's place in its region
    text: str = ""
    name: str | None = None
    ident: str | None = None  # the format's own call id (Kimi's `functions.f:0`), else a new one


class Scanner(Protocol):
    """Reads one call region as it grows: `scan(body)` gets the region's text so far (each time a
    longer string with the same start) and returns what it tells beyond the previous scans."""

    def scan(self, body: str) -> list[Piece]: ...


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]


class StreamParser(Protocol):
    """Incremental parser: `feed` text deltas as they arrive, then `finish` once. Any split of a text
    folds (`collect`) into the same answer as the whole text in one piece (a streaming parser's extra
    `tool_open`/`tool_args` events add up to its calls)."""

    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (see the module docstring)."""

    opens: Mapping[str, str | None]  # open marker -> close marker (None: to the end of the answer)
    parse: Callable[[str, ToolSpecs], list[ToolCall] | None]  # one region's body -> calls, None: not calls
    bare_starts: tuple[str, ...] = ()  # characters that open a region (to the end) when they begin the answer
    render: Callable[[list[dict]], str] | None = None  # OpenAI tool_calls -> the text the model writes
    scanner: Callable[[ToolSpecs], Scanner] | None = None  # streams calls as written (None: each call whole)
    # a format that owns the whole answer, reasoning included (harmony): (tools, tools_enabled, incremental) -> parser
    answer_parser: Callable[[ToolSpecs, bool, bool], StreamParser] | None = None


def held_marker(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker` (to hold back)."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def make_call(name: Any, arguments: Any, tools: ToolSpecs) -> ToolCall | None:
    """A ToolCall when `name` is an offered tool and `arguments` an object (or its JSON text); else None."""
    if not isinstance(name, str) or (tools is not None and name not in tools):
        return None
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def load_json(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return orjson.loads(text.strip())
    except orjson.JSONDecodeError:
        return None


def is_text_param(name: str, param: str, tools: ToolSpecs) -> bool:
    """Whether an XML-style argument's value stays text: its schema declares a string, or no type."""
    schema = (tools or {}).get(name, {}).get("properties", {}).get(param, {})
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


# Python's spelling of JSON's scalars: Qwen3-Coder's template writes a value that is not a mapping, a list or a
# string through Jinja's `string` filter, so a boolean argument reads `True` in the model's own calls
_PYTHON_SCALARS = {"True": True, "False": False, "None": None}


def typed_value(raw: str, name: str, param: str, tools: ToolSpecs) -> Any:
    """An XML-style argument's value typed by the tool's schema: strings stay text, other declared types
    (number, boolean, object, array) are read as JSON, or as Python's True / False / None (kept as text when
    neither fits)."""
    if is_text_param(name, param, tools):
        return raw
    value = load_json(raw)
    if value is None and raw.strip() != "null":
        return _PYTHON_SCALARS.get(raw.strip(), raw)
    return value


def json_calls(objects: list[Any], tools: ToolSpecs) -> list[ToolCall] | None:
    """`{"name": ..., "arguments"|"parameters": {...}}` objects -> calls; None if any is not one."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict):
            return None
        call = make_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def call_arguments(call: dict) -> dict:
    """The arguments object of an OpenAI-style tool call (its `arguments` may be JSON text)."""
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = load_json(args)
    return args if isinstance(args, dict) else {}


def call_name(call: dict) -> str:
    return str(call.get("function", call).get("name", ""))
