"""Tools for templates that cannot show them (Llama 3 and Gemma 3 as packaged): an explicit opt-in
(`--inject-tools`) that rewrites a conversation before the template renders it.

- The tool list goes into the system message, in the prompt the family documents for its call
  format (Llama 3.1's JSON prompt for llama3; the pythonic prompt of Llama 3.2 / Gemma 3; Hermes'
  `<tools>` block otherwise).
- An assistant turn's tool calls become the call text the model writes (`ToolFormat.render`), so a
  re-rendered history shows the model its own format.
- Tool results become one user turn (`<tool_response>` blocks), merged with a user message that
  follows them, which templates that only know user/assistant (Gemma 3 requires them to alternate) accept.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from stepline.gateway.parsers import TOOL_PARSERS
from stepline.gateway.templating import Message

__all__ = ["injector", "tools_prompt"]

_LLAMA3 = ("Given the following functions, please respond with a JSON for a function call with its proper "
           "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
           "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n")
_PYTHONIC = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
             "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
             "You SHOULD NOT include any other text in the response if you call a function\n")
_HERMES = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
           "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
           "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
           "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def tools_prompt(tool_parser: str, tools: list[dict]) -> str:
    """The system-message text that describes `tools` in `tool_parser`'s documented format."""
    if tool_parser in ("llama3", "llama3_json"):
        return _LLAMA3 + "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
    if tool_parser in ("pythonic", "llama4_pythonic"):
        return _PYTHONIC + json.dumps([t.get("function", t) for t in tools], indent=2, ensure_ascii=False)
    return _HERMES.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def injector(tool_parser: str) -> Callable[[list[Message], list[dict] | None], list[Message]]:
    """inject(messages, tools) -> messages the tools-less template can render. Raises ValueError for a
    parser without a call-text form."""
    fmt = TOOL_PARSERS.get(tool_parser)
    render = fmt.render if fmt is not None else None
    if render is None:
        raise ValueError(f"--inject-tools needs a tool parser that can write calls (llama3, pythonic, hermes, "
                         f"mistral), not {tool_parser!r}")

    def inject(messages: list[Message], tools: list[dict] | None) -> list[Message]:
        out: list[Message] = []
        for m in messages:
            if m.get("role") == "tool" or (m.get("role") == "user" and out and out[-1].get("_tool_results")):
                block = str(m.get("content") or "")
                if m.get("role") == "tool":
                    block = "<tool_response>\n" + block + "\n</tool_response>"
                if out and out[-1].get("_tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
                else:
                    out.append({"role": "user", "content": block, "_tool_results": True})
            elif m.get("role") == "assistant" and m.get("tool_calls"):
                text = "\n".join(t for t in (m.get("content") or "", render(m["tool_calls"])) if t)
                out.append({"role": "assistant", "content": text})
            else:
                out.append(m)
        out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
        if tools:
            prompt = tools_prompt(tool_parser, tools)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": (str(out[0].get("content") or "") + "\n\n" + prompt).lstrip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    return inject
