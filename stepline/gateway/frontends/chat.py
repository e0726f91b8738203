"""OpenAI Chat Completions: `POST /v1/chat/completions`.

Supported: system/developer/user/assistant/tool messages with string or text-part content, `tools`,
`tool_choice` (auto, none, required, a named function: checked against `tools`, not enforced by
constrained decoding), parallel tool calls, `n`, `temperature`, `top_p`, `max_tokens` /
`max_completion_tokens`, `stop`, `seed`, `logprobs` / `top_logprobs` (the engine returns only the
sampled token's logprob, so `top_logprobs` lists that one token), `stream` with
`stream_options.include_usage`. Assistant reasoning comes back in `message.reasoning_content`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, NotRequired

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict

from stepline.gateway.engines import Generation, SamplingParams, StreamDelta
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import ApiError, error_body, invalid
from stepline.gateway.frontends.exchange import Choice, Exchange, usage
from stepline.gateway.frontends.prompting import ChatCall
from stepline.gateway.frontends.stages import Stages
from stepline.gateway.parsers.base import Event, ParsedOutput
from stepline.gateway.sessions import Prompt
from stepline.gateway.templating import ChatTemplate, Message


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# Messages validate into plain dicts (TypedDicts: pydantic-core builds them, no Python objects per message),
# so the usual message — a string content, no tool calls — is already in the form the template takes.
@with_config(ConfigDict(extra="ignore", strict=True))
class TextPart(TypedDict):
    type: Literal["text", "input_text", "output_text"]
    text: str


@with_config(ConfigDict(extra="ignore", strict=True))
class FunctionCall(TypedDict):
    name: str
    arguments: NotRequired[str | dict[str, Any]]


@with_config(ConfigDict(extra="ignore", strict=True))
class ToolCallIn(TypedDict):
    id: NotRequired[str | None]
    type: NotRequired[Literal["function"]]
    function: FunctionCall


@with_config(ConfigDict(extra="ignore", strict=True))
class ChatMessage(TypedDict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: NotRequired[str | list[TextPart] | None]
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCallIn] | None]
    tool_call_id: NotRequired[str | None]
    reasoning_content: NotRequired[str | None]


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool = False


class ChatRequest(_Model):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM/SGLang extension, e.g. {"enable_thinking": false}


RESERVED_TEMPLATE_NAMES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def text_of(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


def to_messages(messages: list[ChatMessage]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if type(m.get("content")) is str and m["role"] != "developer" and "tool_calls" not in m and None not in m.values():
            out.append(m)  # type: ignore[arg-type]  # already canonical
            continue
        message: Message = {"role": "system" if m["role"] == "developer" else m["role"], "content": text_of(m.get("content"))}
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c.get("id") or "", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": _args_text(c["function"].get("arguments", "{}"))}}
                for c in m["tool_calls"]]  # type: ignore[union-attr]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if (value := m.get(key)) is not None:
                message[key] = value
        out.append(message)
    return out


def _args_text(arguments: str | dict[str, Any]) -> str:
    # json.dumps spacing, as the template's tojson would write an arguments object
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def check_tool_choice(choice: Any, names: list[str]) -> bool:
    """Validate tool_choice against the offered tools; returns whether tool calls are parsed."""
    if choice in (None, "auto"):
        return True
    if choice == "none":
        return False
    if not names:
        raise invalid("tool_choice needs `tools`", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid(f"tool_choice names an unknown tool {choice.function.name!r}", param="tool_choice")
    return True


def sampling_of(temperature: float | None, top_p: float | None, top_k: int | None, stop: str | list[str] | None,
                seed: int | None) -> SamplingParams:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return SamplingParams(temperature=1.0 if temperature is None else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=-1 if top_k is None else top_k,
                          stop=[s for s in stops if s], seed=seed)


def to_call(req: ChatRequest, max_n: int) -> ChatCall:
    if req.n > max_n:
        raise invalid(f"n must be at most {max_n}", param="n")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    names = [t.function.name for t in req.tools or []]
    enabled = check_tool_choice(req.tool_choice, names)
    options = req.chat_template_kwargs
    if options and RESERVED_TEMPLATE_NAMES & options.keys():
        raise invalid(f"chat_template_kwargs may not set {sorted(RESERVED_TEMPLATE_NAMES & options.keys())}",
                      param="chat_template_kwargs")
    return ChatCall(api="chat.completions", messages=to_messages(req.messages), tools=tools,
                         sampling=sampling_of(req.temperature, req.top_p, req.top_k, req.stop, req.seed),
                         max_tokens=req.max_completion_tokens or req.max_tokens, n=req.n, tools_enabled=enabled,
                         stream=bool(req.stream), template_options=options or None)


def finish_reason(gen: Generation, parsed: ParsedOutput) -> str:
    if parsed.tool_calls and gen.finish_reason == "stop":
        return "tool_calls"
    return "length" if gen.truncated else "stop"


def tool_call_json(call: Any, index: int | None = None) -> dict:
    out: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


class ChatEmitter:
    """Chat Completions answers: `chat.completion` objects and `chat.completion.chunk` events."""

    def __init__(self, model: str, template: ChatTemplate, logprobs: bool, top_logprobs: int, include_usage: bool) -> None:
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.template = template
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self._tool_index: dict[int, int] = {}  # choice -> tool calls it has started
        self._streamed: dict[tuple[int, str], int] = {}  # (choice, call id) -> tool-call index, of calls streamed in pieces

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict | None:
        if not self.logprobs:
            return None
        content = []
        for token_id, lp in zip(ids, lps):
            token = self.template.token_text(token_id)
            entry = {"token": token, "logprob": lp, "bytes": list(token.encode())}
            content.append({**entry, "top_logprobs": [entry] if self.top_logprobs else []})
        return {"content": content}

    def answer(self, choices: list[Choice], prompt: Prompt) -> dict:
        prompt_tokens, completion_tokens = usage(prompt, choices)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [self._choice(c) for c in choices],
            "usage": self._usage(prompt_tokens, completion_tokens, prompt.reused),
        }

    def _choice(self, c: Choice) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.parsed.content or None}
        if not c.parsed.tool_calls and message["content"] is None:
            message["content"] = ""
        if c.parsed.reasoning is not None:
            message["reasoning_content"] = c.parsed.reasoning
        if c.parsed.tool_calls:
            message["tool_calls"] = [tool_call_json(t) for t in c.parsed.tool_calls]
        gen = c.generation
        return {"index": c.index, "message": message, "logprobs": self._logprobs(gen.output_ids, gen.logprobs),
                "finish_reason": finish_reason(gen, c.parsed)}

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, reused: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": reused}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def start(self, prompt: Prompt) -> bytes:
        return b""  # the role goes out with each choice's first chunk

    def events(self, index: int, events: list[Event], delta: StreamDelta) -> bytes:
        out = b""
        if index not in self._tool_index:
            self._tool_index[index] = 0
            out += self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
        pieces: list[dict[str, Any]] = []
        for event in events:
            if event.kind == "content":
                pieces.append({"content": event.text})
            elif event.kind == "reasoning":
                if event.text:
                    pieces.append({"reasoning_content": event.text})
            elif event.tool_call is not None:
                pieces += self._tool_piece(index, event)
        logprobs = self._logprobs(delta.output_ids, delta.logprobs)
        if logprobs is not None and not pieces:
            pieces.append({})
        for k, piece in enumerate(pieces):
            out += self._chunk([{"index": index, "delta": piece, "logprobs": logprobs if k == 0 else None,
                                 "finish_reason": None}])
        return out

    def _tool_piece(self, index: int, event: Event) -> list[dict[str, Any]]:
        """A call's first delta carries its index, id, type and name; later ones argument fragments
        (the client joins them by index). A call that was not streamed in pieces goes out whole."""
        call = event.tool_call
        assert call is not None
        key = (index, call.id)
        if event.kind == "tool_args":
            return [{"tool_calls": [{"index": self._streamed[key], "function": {"arguments": event.text}}]}]
        if event.kind == "tool_call" and key in self._streamed:
            return []  # its fragments are all out
        at = self._tool_index[index]
        self._tool_index[index] += 1
        if event.kind == "tool_open":
            self._streamed[key] = at
        return [{"tool_calls": [tool_call_json(call, at)]}]

    def finish(self, index: int, final: Generation, parsed: ParsedOutput) -> bytes:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                             "finish_reason": finish_reason(final, parsed)}])

    def end(self, choices: list[Choice], prompt: Prompt) -> bytes:
        out = b""
        if self.include_usage:
            prompt_tokens, completion_tokens = usage(prompt, choices)
            out += self._chunk([], self._usage(prompt_tokens, completion_tokens, prompt.reused))
        return out + b"data: [DONE]\n\n"

    def error(self, err: ApiError) -> bytes:
        return b"data: " + orjson.dumps(error_body("openai", err.status, err.message, err.param, err.code)) + b"\n\n"


async def handle(edge: Edge, stages: Stages, request: web.Request) -> web.StreamResponse:
    session = edge.session_for(request)
    raw, req = await edge.parse(ChatRequest, request)
    call = to_call(req, edge.limits.max_n)
    model = stages.prompting
    emitter = ChatEmitter(req.model or model.model_name, model.template, bool(req.logprobs),
                          req.top_logprobs or 0, bool(req.stream_options and req.stream_options.include_usage))
    if call.stream:
        return await stages.stream(request, Exchange(session, call.api, raw), call, emitter)
    answer = await stages.run(Exchange(session, call.api, raw), call, emitter)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")
