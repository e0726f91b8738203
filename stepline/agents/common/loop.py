"""The OpenAI function-calling episode loop, shared by the OpenAI-speaking harnesses.

Each turn the whole history goes to the policy; the assistant answer is echoed back verbatim (tool
call arguments as the exact string received, so a token-exact gateway can reuse its ids), then one
role "tool" message per tool call. The episode ends at a final message (no tool calls), at a stop
tool (e.g. `answer`), at `max_turns`, or at an endpoint failure (recorded in `Episode.error`).

A policy is any callable `messages -> Turn`: `OpenAIPolicy` asks the endpoint through the real SDK;
a scripted expert returns turns built with `tool_turn` / `final_turn`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepline.agents.common.episode import Episode, ToolCall
from stepline.agents.common.tools import Tool, call_tool, openai_schema

if TYPE_CHECKING:
    import ssl

    import openai


class EndpointError(Exception):
    """The model endpoint failed: down, an HTTP error after retries, or an answer that is not a chat completion."""


@dataclass(frozen=True)
class RawCall:
    id: str
    name: str
    arguments: str  # the JSON text exactly as the model produced it


@dataclass
class Turn:
    """One assistant answer."""

    content: str | None = None
    tool_calls: list[RawCall] = field(default_factory=list)


Policy = Callable[[list[dict[str, Any]]], Turn]


def tool_turn(name: str, turn: int, **arguments: Any) -> Turn:
    """A scripted assistant turn that calls one tool (ids are deterministic: call_<turn>)."""
    return Turn(None, [RawCall(f"call_{turn}", name, json.dumps(arguments))])


def final_turn(text: str) -> Turn:
    return Turn(text, [])


def said(text: str, turn: Turn) -> Turn:
    """A scripted turn with a sentence before its tool calls (an expert saying what it read or acts on)."""
    return Turn(text, turn.tool_calls)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi, or SSL_CERT_FILE/SSL_CERT_DIR), built once per process:
    building it is most of what an SDK client costs (~15 ms), and a harness worker's children inherit
    the one it built before forking (stepline/agents/common/serve.py). Pass it as the SDK's http_client verify."""
    import httpx

    return httpx.create_ssl_context()


class OpenAIPolicy:
    """Asks an OpenAI-compatible endpoint (OPENAI_BASE_URL / OPENAI_API_KEY) for each turn."""

    def __init__(self, tools: list[Tool], *, max_tokens: int = 128, client: openai.OpenAI | None = None):
        self.client = client
        self.model = os.environ.get("OPENAI_MODEL", "policy")
        self.tools = [openai_schema(tool) for tool in tools]
        self.max_tokens = max_tokens  # a tool call here is ~30 tokens; a small cap keeps a rambling policy cheap

    def _client(self) -> openai.OpenAI:
        import openai  # here, so expert runs and verifiers start without the SDK

        if self.client is None:
            if not os.environ.get("OPENAI_BASE_URL"):
                raise EndpointError("OPENAI_BASE_URL is not set")
            # Retries cover 429/503 with Retry-After (the gateway during a weight update), never other 4xx.
            self.client = openai.OpenAI(
                api_key=os.environ.get("OPENAI_API_KEY") or "none",
                max_retries=int(os.environ.get("AGENT_MAX_RETRIES", "5")),
                timeout=float(os.environ.get("AGENT_REQUEST_TIMEOUT_S", "300")),
                http_client=openai.DefaultHttpxClient(verify=tls_context()),
            )
        return self.client

    def __call__(self, messages: list[dict[str, Any]]) -> Turn:
        import openai

        client = self._client()
        try:
            response = client.chat.completions.create(
                model=self.model, messages=messages, tools=self.tools, max_tokens=self.max_tokens  # type: ignore[arg-type]
            )
        except openai.OpenAIError as exc:
            raise EndpointError(f"{type(exc).__name__}: {exc}") from exc
        try:
            message = response.choices[0].message
            calls = [RawCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or [] if c.type == "function"]
            return Turn(message.content, calls)
        except (AttributeError, IndexError, TypeError) as exc:
            raise EndpointError(f"malformed chat completion: {str(response)[:200]!r}") from exc


def assistant_message(turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    return message


def parse_arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None  # call_tool answers "arguments must be a JSON object"


def run_episode(
    policy: Policy, episode: Episode, *, system: str, user: str, tools: list[Tool], max_turns: int,
    stop_tools: frozenset[str] = frozenset(),
) -> Episode:
    """Play one episode; fills `episode.messages/calls/turns/final/finish/error` and returns it."""
    by_name = {tool.name: tool for tool in tools}
    episode.tools = [openai_schema(tool) for tool in tools]
    episode.messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for turn_index in range(max_turns):
        try:
            turn = policy(episode.messages)
        except EndpointError as exc:
            episode.error, episode.finish = str(exc), "error"
            return episode
        episode.turns = turn_index + 1
        episode.messages.append(assistant_message(turn))
        if not turn.tool_calls:
            episode.final, episode.finish = turn.content or "", "final_message"
            return episode
        if _run_calls(turn, turn_index, episode, by_name, stop_tools):
            return episode
    episode.finish = "max_turns"
    return episode


def _run_calls(turn: Turn, turn_index: int, episode: Episode, tools: dict[str, Tool], stop_tools: frozenset[str]) -> bool:
    """Execute a turn's tool calls in order; True when a stop tool succeeded (the episode ends)."""
    for raw in turn.tool_calls:
        arguments = parse_arguments(raw.arguments)
        result, failed = call_tool(tools, raw.name, arguments)
        episode.messages.append({"role": "tool", "tool_call_id": raw.id, "content": result})
        recorded = arguments if isinstance(arguments, dict) else {}
        episode.calls.append(ToolCall(turn=turn_index, name=raw.name, arguments=recorded, result=result, error=failed))
        if raw.name in stop_tools and not failed:
            # The final answer is the stop tool's (first) argument, e.g. answer(text).
            episode.final, episode.finish = str(next(iter(recorded.values()), "")), "answer"
            return True
    return False
