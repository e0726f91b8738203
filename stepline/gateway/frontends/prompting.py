"""The served model's side of a call: its name, chat template, parsers, context budget and how a Responses
answer cut by its token limit ends (GatewaySettings.responses_truncated).

    ChatCall                         a chat-style request, in the form the template and the engine take
    Prompting(settings, template, profile)
        max_new_tokens(prompt_len, requested)   the budget, cut to the room left in the context
        parser(call, incremental)               reasoning and tool calls out of the text (stepline.gateway.parsers)
    build_prompt(prompting, session, call) -> (Prompt, one SamplingParams per choice)

The prompt comes from the session's token memory (TITO: turn N+1 reuses turn N's exact ids and renders only
the new messages; stepline.gateway.sessions).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from stepline.gateway.config import GatewaySettings
from stepline.gateway.engines import SamplingParams
from stepline.gateway.frontends.errors import invalid
from stepline.gateway.parsers import parser_spec
from stepline.gateway.parsers.base import StreamParser
from stepline.gateway.profile import ModelProfile
from stepline.gateway.sessions import Prompt, Session
from stepline.gateway.templating import ChatTemplate, Message, TemplateError

__all__ = ["ChatCall", "Prompting", "build_prompt", "choice_seed"]


@dataclass
class ChatCall:
    """A chat-style request, in the form the template and the engine take."""

    api: str  # chat.completions | responses | messages
    messages: list[Message]
    tools: list[dict] | None  # OpenAI function-tool dicts, as chat templates expect them
    sampling: SamplingParams
    max_tokens: int | None  # None: the gateway's default (always cut to the room left in the context)
    n: int = 1
    tools_enabled: bool = True  # False for tool_choice "none": tool-call text stays text
    stream: bool = False
    template_options: dict[str, Any] | None = None  # chat_template_kwargs (e.g. {"enable_thinking": false})


class Prompting:
    def __init__(self, settings: GatewaySettings, template: ChatTemplate, profile: ModelProfile) -> None:
        self.model_name = settings.model_name
        self.responses_truncated = settings.responses_truncated  # how a Responses answer cut by length ends
        self.template = template
        self.profile = profile
        self.context_length = settings.context_length or template.context_length
        self.default_max_tokens = settings.default_max_tokens
        self._parsers = parser_spec(profile.tool_parser, profile.reasoning_parser, profile.reasoning_forced)

    def max_new_tokens(self, prompt_len: int, requested: int | None) -> int:
        """New-token budget: the request's (or the default), cut to what the context has room for."""
        room = self.context_length - prompt_len
        if room <= 0:
            raise invalid(f"the prompt has {prompt_len} tokens; this model's context length is "
                          f"{self.context_length}", param="messages", code="context_length_exceeded")
        return min(requested or self.default_max_tokens, room)

    def parser(self, call: ChatCall, incremental: bool = False) -> StreamParser:
        """A parser of one choice's text: tool calls only where the call offers tools and allows them."""
        specs = {t["function"]["name"]: t["function"].get("parameters") or {} for t in call.tools or []}
        return self._parsers.new(call.tools_enabled and bool(specs), specs, incremental)

    def check_tools(self, tools: list[dict] | None) -> None:
        """400 when the request offers tools that the template would silently drop."""
        if tools and not self.profile.tools_supported and self.template.inject is None:
            raise invalid("this model's chat template cannot show tools to the model, so they would be silently "
                          "dropped; start the gateway with --inject-tools to render them into the system message "
                          f"in the {self.profile.tool_parser} tool-call format", param="tools",
                          code="tools_unsupported")

    def tool_history_hint(self, messages: list[Message]) -> str:
        """What to add to a template's error when the conversation holds tool calls or results that a
        template without tools support cannot take (Gemma 3: roles must alternate)."""
        if self.profile.tools_supported or self.template.inject is not None:
            return ""
        if not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            return ""
        return ("; this chat template has no tools support, so it cannot take tool calls or results: start the "
                "gateway with --inject-tools to send them to the model as text in the "
                f"{self.profile.tool_parser} tool-call format")


def build_prompt(prompting: Prompting, session: Session, call: ChatCall) -> tuple[Prompt, list[SamplingParams]]:
    """The call's prompt from the session's token memory, and the sampling of each of its n choices."""
    prompting.check_tools(call.tools)
    try:
        prompt = session.tokens.prompt_for(call.messages, call.tools, call.template_options)
    except TemplateError as exc:
        raise invalid(str(exc) + prompting.tool_history_hint(call.messages), param="messages") from None
    budget = prompting.max_new_tokens(len(prompt.ids), call.max_tokens)
    base = replace(call.sampling, **session.sampling, max_new_tokens=budget,
                   stop_token_ids=sorted({*call.sampling.stop_token_ids, *prompting.template.stop_token_ids}))
    # n choices of one seeded call must differ from each other and still be reproducible
    samplings = [base if base.seed is None else replace(base, seed=choice_seed(base.seed, i)) for i in range(call.n)]
    return prompt, samplings


def choice_seed(seed: int, index: int) -> int:
    """The engine seed of choice `index` of a call seeded `seed` (any int64): inside [0, 2^63), which
    every engine accepts, so a seed near the top of the range cannot fail (or abort) the call."""
    return (seed + index) % 2**63
