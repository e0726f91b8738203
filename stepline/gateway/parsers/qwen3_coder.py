"""qwen3_coder: XML calls, as Qwen3-Coder (and Qwen3.5) write them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are text; a parameter whose schema declares another type is read as JSON, or as Python's True / False /
None (the template writes scalars through Jinja's `string` filter).
"""

from __future__ import annotations

import re

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, make_call, typed_value
from stepline.gateway.parsers.incremental import XmlCalls, XmlGrammar

_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _strip_newline(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    inner = match.group(2)
    args = {key.strip(): typed_value(_strip_newline(value), name, key.strip(), tools)
            for key, value in _PARAMETER.findall(inner)}
    if _PARAMETER.sub("", inner).strip():
        return None  # text between parameters: not a call this format writes
    call = make_call(name, args, tools)
    return None if call is None else [call]


GRAMMAR = XmlGrammar(head=re.compile(r"\s*<function=(?P<name>[^>\n]+)>"), param=re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>"),
                     value_close="</parameter>", trim_newlines=True, end=re.compile(r"\s*</function>"))
FORMAT = ToolFormat(opens={"<tool_call>": "</tool_call>"}, parse=parse, scanner=lambda tools: XmlCalls(GRAMMAR, tools))
