"""What the gateway learns about a model's family at start, from its directory, by probing the chat
template (never by model name alone), printed at start and overridable by flags:

- tool parser: the first registered format that parses back a tool call the template rendered
  (falls back on `config.json`'s model_type for templates that cannot render tool calls);
- reasoning parser: the template's reasoning markers (else markers that are the tokenizer's added
  tokens); `reasoning_forced` when its generation prompt already opens the reasoning block;
- end-of-turn token: `stepline.gateway.templating.end_of_turn` (the template's own marker);
- tools support: whether a tool offered to the template shows up in its rendering;
- append-only: whether turn N's rendering (plus the answer and end-of-turn) is a prefix of turn N+1's,
  which token-exact reuse needs; where not, the gateway follows the template (strict mode, forks);
- drops_reasoning: whether earlier turns' reasoning vanishes from later renderings (kept anyway by
  default: the model's own tokens stay the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepline.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, check_names, collect, make_parser
from stepline.gateway.templating import ChatTemplate, Message, TemplateError

__all__ = ["ModelProfile", "detect"]

_PROBE_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
_PROBE_TOOL = {"type": "function", "function": {
    "name": "stepline_probe", "description": "Probe tool.", "parameters": _PROBE_PARAMETERS}}
_PROBE_CALL = {"id": "call_probe", "type": "function",
               "function": {"name": "stepline_probe", "arguments": '{"q": "probe"}'}}
# formats tried on the template's own rendering of a call, most specific first
_CANDIDATES = ("gpt-oss", "qwen3_coder", "glm45", "kimi_k2", "deepseekv31", "deepseekv3", "hermes", "mistral", "llama3",
               "pythonic")
_BY_MODEL_TYPE = {"llama": "llama3", "llama4": "pythonic", "gemma": "pythonic", "gemma2": "pythonic",
                  "gemma3": "pythonic", "gemma3_text": "pythonic", "mistral": "mistral", "mixtral": "mistral",
                  "deepseek_v3": "deepseekv3", "kimi_k2": "kimi_k2", "glm4_moe": "glm45", "gpt_oss": "gpt-oss"}
_REASONING_MARKERS = (("<|channel|>", "gpt-oss"), ("◁think▷", "kimi"), ("[THINK]", "mistral"), ("<think>", "qwen3"), ("</think>", "qwen3"))


@dataclass(frozen=True)
class ModelProfile:
    tool_parser: str
    reasoning_parser: str
    reasoning_forced: bool  # the generation prompt opens the reasoning block (the answer starts inside it)
    eot_token: str
    tools_supported: bool  # the template shows offered tools to the model
    append_only: bool
    drops_reasoning: bool

    def describe(self) -> str:
        tools = "in the template" if self.tools_supported else "NOT shown by the template (requests with tools get 400 " \
                                                               "unless --inject-tools)"
        lines = [f"tool parser {self.tool_parser}, reasoning parser {self.reasoning_parser}"
                 + (" (prompt opens reasoning)" if self.reasoning_forced else ""),
                 f"end-of-turn {self.eot_token!r}, tools {tools}"]
        if not self.append_only:
            lines.append("the template is not append-only (turn N's rendering is not a prefix of turn N+1's): "
                         "every turn is rendered with the template (strict mode), forking where history changes")
        if self.drops_reasoning:
            lines.append("the template drops earlier turns' reasoning; the model's own tokens stay the context "
                         "(--strict-template follows the template instead)")
        return "; ".join(lines)


def _render(template: ChatTemplate, messages: list[Message], tools: list[dict] | None, gen: bool) -> str | None:
    try:
        return template.render(messages, tools, add_generation_prompt=gen)
    except TemplateError:
        return None


def _tools_supported(template: ChatTemplate) -> bool:
    text = _render(template, [{"role": "user", "content": "hi"}], [_PROBE_TOOL], True)
    return text is not None and "stepline_probe" in text


def _tool_parser(template: ChatTemplate) -> str | None:
    """The format whose parser reads the template's own rendering of a probe call back."""
    user = [{"role": "user", "content": "hi"}]
    prefix = _render(template, user, [_PROBE_TOOL], True)
    full = _render(template, user + [{"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}],
                   [_PROBE_TOOL], False)
    if prefix is None or full is None:
        return None
    body = full[len(prefix):] if full.startswith(prefix) else full[full.rfind("hi") + 2:]
    body = body.split(template.eos_token)[0]
    for name in _CANDIDATES:
        parser = make_parser(name, "qwen3", True, {"stepline_probe": _PROBE_PARAMETERS})
        calls = collect(parser.feed(body) + parser.finish()).tool_calls
        if [(c.name, c.arguments) for c in calls] == [("stepline_probe", '{"q": "probe"}')]:
            return name
    return None


def _reasoning(template: ChatTemplate) -> tuple[str, bool]:
    """Markers the template writes; else reasoning markers that are the tokenizer's own added tokens."""
    added = {t.content for t in template.tokenizer.get_added_tokens_decoder().values()}
    name = next((n for marker, n in _REASONING_MARKERS if marker in template.source), None)
    if name is None:
        name = next((n for n, fmt in REASONING_PARSERS.items() if fmt is not None and {fmt.open, fmt.close} <= added),
                    "none")
    fmt = REASONING_PARSERS[name]
    user = [{"role": "user", "content": "hi"}]
    prompt = _render(template, user, None, True) or ""
    return name, fmt is not None and prompt.rstrip().endswith(fmt.open)


def _append_only(template: ChatTemplate) -> bool:
    first: list[Message] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    second = first + [{"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    t1, t2 = _render(template, first, None, True), _render(template, second, None, True)
    return t1 is not None and t2 is not None and t2.startswith(t1 + "A1" + template.eos_token)


def _drops_reasoning(template: ChatTemplate) -> bool:
    messages: list[Message] = [{"role": "user", "content": "U1"},
                               {"role": "assistant", "content": "A1", "reasoning_content": "R1-stepline"},
                               {"role": "user", "content": "U2"}]
    text = _render(template, messages, None, True)
    return text is not None and "<think>" in template.source and "R1-stepline" not in text


def detect(template: ChatTemplate, tool_parser: str | None = None, reasoning_parser: str | None = None) -> ModelProfile:
    """The model's profile; explicit parser names win over detection (unknown names: UnknownParser)."""
    reasoning, forced = _reasoning(template)
    tools = tool_parser or _tool_parser(template) or _BY_MODEL_TYPE.get(template.model_type, "hermes")
    reasoning = reasoning_parser or reasoning
    check_names(tools, reasoning)
    assert tools in TOOL_PARSERS
    return ModelProfile(tool_parser=tools, reasoning_parser=reasoning, reasoning_forced=forced,
                        eot_token=template.eos_token, tools_supported=_tools_supported(template),
                        append_only=_append_only(template), drops_reasoning=_drops_reasoning(template))
