"""Output parsers, pluggable per model family: reasoning and tool calls out of sampled text.

Two registries, named as SGLang's and vLLM's `--tool-call-parser` / `--reasoning-parser` values are,
so a serving flag carries over:

- `TOOL_PARSERS`: name -> `ToolFormat` (one small module per family; None: no tool calls).
- `REASONING_PARSERS`: name -> `ReasoningFormat` (None: no reasoning markers).

`make_parser` combines one of each into an incremental `StreamParser` for one answer
(`stepline.gateway.parsers.stream`). `stepline.gateway.profile` picks both for a model directory. To add a family, write
a module with a `ToolFormat` and add a row.
"""

from __future__ import annotations

from stepline.gateway.parsers import deepseek, glm45, harmony, hermes, kimi_k2, llama3, mistral, pythonic, qwen3_coder
from stepline.gateway.parsers.base import Event, ParsedOutput, StreamParser, ToolCall, ToolFormat, ToolSpecs
from stepline.gateway.parsers.stream import ParserSpec, ReasoningFormat, collect

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Event", "ParsedOutput", "ParserSpec", "ReasoningFormat", "StreamParser",
           "ToolCall", "ToolFormat", "UnknownParser", "check_names", "collect", "make_parser", "parse_text", "parser_spec"]

TOOL_PARSERS: dict[str, ToolFormat | None] = {
    "hermes": hermes.FORMAT,
    "qwen25": hermes.FORMAT,
    "qwen": hermes.FORMAT,
    "qwen3_coder": qwen3_coder.FORMAT,
    "llama3": llama3.FORMAT,
    "llama3_json": llama3.FORMAT,
    "mistral": mistral.FORMAT,
    "pythonic": pythonic.FORMAT,
    "llama4_pythonic": pythonic.FORMAT,
    "deepseekv3": deepseek.V3,
    "deepseekv31": deepseek.V31,
    "kimi_k2": kimi_k2.FORMAT,
    "glm": glm45.FORMAT,
    "glm45": glm45.FORMAT,
    "glm47": glm45.FORMAT,
    "gpt-oss": harmony.FORMAT,  # harmony: reasoning and calls are one format (the reasoning parser is not used)
    "openai": harmony.FORMAT,
    "none": None,
}

_THINK = ("<think>", "</think>")
REASONING_PARSERS: dict[str, ReasoningFormat | None] = {
    "qwen3": ReasoningFormat(*_THINK),
    "qwen3-thinking": ReasoningFormat(*_THINK, forced=True),
    "deepseek-r1": ReasoningFormat(*_THINK, forced=True),
    "deepseek-v3": ReasoningFormat(*_THINK),
    "glm45": ReasoningFormat(*_THINK),
    "kimi_k2": ReasoningFormat(*_THINK),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "step3": ReasoningFormat(*_THINK, forced=True),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]"),
    "gpt-oss": ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>"),  # for a non-harmony tool parser
    "openai_gptoss": ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>"),
    "none": None,
}


class UnknownParser(ValueError):
    """A parser name that is not in its registry (the message lists the known ones)."""


def check_names(tool_parser: str, reasoning_parser: str) -> None:
    if tool_parser not in TOOL_PARSERS:
        raise UnknownParser(f"unknown tool parser {tool_parser!r}; known: {', '.join(TOOL_PARSERS)}")
    if reasoning_parser not in REASONING_PARSERS:
        raise UnknownParser(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_PARSERS)}")


def parser_spec(tool_parser: str, reasoning_parser: str, in_reasoning: bool = False) -> ParserSpec:
    """The formats of two registry names (the gateway resolves them once, at start)."""
    check_names(tool_parser, reasoning_parser)
    return ParserSpec(TOOL_PARSERS[tool_parser], REASONING_PARSERS[reasoning_parser], in_reasoning)


def make_parser(tool_parser: str, reasoning_parser: str, tools_enabled: bool, tools: ToolSpecs,
                in_reasoning: bool = False, incremental: bool = False) -> StreamParser:
    """A fresh parser for one answer. `tools`: the offered tools (name -> parameters schema; None: any
    name); `in_reasoning`: the prompt already opened the reasoning block; `incremental`: stream each
    call's name and arguments while it is written (`tool_open` / `tool_args` events)."""
    return parser_spec(tool_parser, reasoning_parser, in_reasoning).new(tools_enabled, tools, incremental)


def parse_text(text: str, tool_parser: str = "hermes", reasoning_parser: str = "qwen3", tools_enabled: bool = True,
               tools: ToolSpecs = None) -> ParsedOutput:
    """Parse a whole answer (one delta of the incremental parser)."""
    parser = make_parser(tool_parser, reasoning_parser, tools_enabled, tools)
    return collect(parser.feed(text) + parser.finish())
