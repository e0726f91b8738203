"""glm45 / glm: GLM-4.5/4.6/4.7 calls, one per block:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are text; an argument whose schema declares another type is read as JSON.
"""

from __future__ import annotations

import re

from stepline.gateway.parsers.base import ToolCall, ToolFormat, ToolSpecs, make_call, typed_value
from stepline.gateway.parsers.incremental import XmlCalls, XmlGrammar

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse(body: str, tools: ToolSpecs) -> list[ToolCall] | None:
    head, _, _ = body.partition("<arg_key>")
    name = head.strip()
    if not name or "\n" in name or "<" in name:
        return None
    if _ARG.sub("", body[len(head):]).strip():
        return None
    args = {k.strip(): typed_value(v, name, k.strip(), tools) for k, v in _ARG.findall(body)}
    call = make_call(name, args, tools)
    return None if call is None else [call]


GRAMMAR = XmlGrammar(head=re.compile(r"\s*(?P<name>[^<\n]+?)\s*(?=<arg_key>)"),
                     param=re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>", re.DOTALL),
                     value_close="</arg_value>", trim_newlines=False)
FORMAT = ToolFormat(opens={"<tool_call>": "</tool_call>"}, parse=parse, scanner=lambda tools: XmlCalls(GRAMMAR, tools))
