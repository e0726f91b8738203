"""Output parsers, pluggable per model family: reasoning and tool calls out of sampled text.

`PARSERS` maps a family name to a factory of incremental parsers; `parser_family(model_type)` picks
the family for a model's `config.json` model_type. To add a family, write a class with `feed` and
`finish` (see `StreamParser`) and add a row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from gateway.parsers.base import Event, ParsedOutput, StreamParser, ToolCall, collect
from gateway.parsers.hermes import HermesStreamParser

__all__ = ["PARSERS", "Event", "ParsedOutput", "ParserFactory", "StreamParser", "ToolCall", "make_parser",
           "parse_text", "parser_family"]

# factory(tools_enabled, tool_names) -> a fresh StreamParser for one answer
ParserFactory = Callable[[bool, Collection[str] | None], StreamParser]

PARSERS: dict[str, ParserFactory] = {
    "qwen3": lambda tools, names: HermesStreamParser(reasoning=True, tools_enabled=tools, tool_names=names),
    "hermes": lambda tools, names: HermesStreamParser(reasoning=True, tools_enabled=tools, tool_names=names),
    "none": lambda tools, names: HermesStreamParser(reasoning=False, tools_enabled=False),
}

_FAMILY_OF_MODEL_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "hermes", "qwen2_moe": "hermes"}


def parser_family(model_type: str) -> str:
    return _FAMILY_OF_MODEL_TYPE.get(model_type, "hermes")


def make_parser(family: str, tools_enabled: bool, tool_names: Collection[str] | None) -> StreamParser:
    return PARSERS[family](tools_enabled, tool_names)


def parse_text(text: str, family: str = "hermes", tools_enabled: bool = True,
               tool_names: Collection[str] | None = None) -> ParsedOutput:
    """Parse a whole answer (one delta of the incremental parser)."""
    parser = make_parser(family, tools_enabled, tool_names)
    return collect(parser.feed(text) + parser.finish())
