"""Anthropic Messages: `POST /v1/messages` (the Anthropic SDK appends /v1/messages to its base URL).

Supported: `system` (text or text blocks), user/assistant messages with text, tool_use, tool_result
and thinking blocks, `tools` (custom tools with `input_schema`), `tool_choice` (auto, any, tool, none),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens`, `stream` (message_start …
message_stop events). Reasoning comes back as a `thinking` block (with an empty signature).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from stepline.gateway.engines import Generation, StreamDelta
from stepline.gateway.frontends.chat import sampling_of
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import ApiError, error_body, invalid
from stepline.gateway.frontends.exchange import Choice, Exchange
from stepline.gateway.frontends.prompting import ChatCall
from stepline.gateway.frontends.stages import Stages
from stepline.gateway.parsers.base import Event, ParsedOutput, ToolCall, load_json
from stepline.gateway.sessions import Prompt
from stepline.gateway.templating import ChatTemplate, Message, TemplateError


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Model):
    model: str = ""
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None
    seed: int | None = None  # extension (not in the API): reproducible sampling


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_messages(req: MessagesRequest) -> list[Message]:
    out: list[Message] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content))
        else:
            out.extend(_user(m.content))
    return out


def _assistant(blocks: list[Block]) -> Message:
    message: Message = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _user(blocks: list[Block]) -> list[Message]:
    out: list[Message] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        elif isinstance(b, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b.text
            else:
                out.append({"role": "user", "content": b.text})
        else:
            raise invalid(f"a user message cannot hold a {b.type} block", param="messages")
    return out


def to_call(req: MessagesRequest) -> ChatCall:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []] or None
    names = [t.name for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not names:
        raise invalid("tool_choice needs `tools`", param="tool_choice")
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise invalid(f"tool_choice names an unknown tool {choice.name!r}", param="tool_choice")
    return ChatCall(api="messages", messages=to_messages(req), tools=tools,
                         sampling=sampling_of(req.temperature, req.top_p, req.top_k, req.stop_sequences, req.seed),
                         max_tokens=req.max_tokens, tools_enabled=not (choice and choice.type == "none"),
                         stream=bool(req.stream))


def stop_reason(gen: Generation, parsed: ParsedOutput) -> tuple[str, str | None]:
    if gen.truncated:
        return "max_tokens", None
    if parsed.tool_calls:
        return "tool_use", None
    if isinstance(gen.matched_stop, str):
        return "stop_sequence", gen.matched_stop
    return "end_turn", None


def _tool_block(call: ToolCall) -> dict:
    args = load_json(call.arguments)  # not an object only for a call a stream had to end as it stood
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": args if isinstance(args, dict) else {}}


def _sse(kind: str, body: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **body}) + b"\n\n"


class MessagesEmitter:
    def __init__(self, model: str) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.block = -1  # index of the open content block
        self.open_kind: str | None = None

    def answer(self, choices: list[Choice], prompt: Prompt) -> dict:
        choice = choices[0]
        parsed = choice.parsed
        content: list[dict] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content or not parsed.tool_calls:
            content.append({"type": "text", "text": parsed.content})
        content += [_tool_block(c) for c in parsed.tool_calls]
        reason, sequence = stop_reason(choice.generation, parsed)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(prompt.ids), "output_tokens": len(choice.generation.output_ids),
                          "cache_read_input_tokens": prompt.reused}}

    def start(self, prompt: Prompt) -> bytes:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt.ids), "output_tokens": 0}}
        return _sse("message_start", {"message": message})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        out = b""
        if self.open_kind == "reasoning":
            out += _sse("content_block_delta", {"index": self.block, "delta": {"type": "signature_delta", "signature": ""}})
        self.open_kind = None
        return out + _sse("content_block_stop", {"index": self.block})

    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.block += 1
        self.open_kind = kind
        return out + _sse("content_block_start", {"index": self.block, "content_block": block})

    def events(self, index: int, events: list[Event], delta: StreamDelta) -> bytes:
        out = b""
        for event in events:
            if event.kind in ("tool_open", "tool_args", "tool_call") and event.tool_call is not None:
                out += self._tool(event)
            elif event.kind == "reasoning" and not event.text:
                continue  # an empty reasoning block gets no item/block, as in the whole answer
            elif event.kind == "reasoning":
                if self.open_kind != "reasoning":
                    out += self._open("reasoning", {"type": "thinking", "thinking": "", "signature": ""})
                if event.text:
                    out += _sse("content_block_delta", {"index": self.block,
                                                        "delta": {"type": "thinking_delta", "thinking": event.text}})
            else:
                if self.open_kind != "content":
                    out += self._open("content", {"type": "text", "text": ""})
                out += _sse("content_block_delta", {"index": self.block, "delta": {"type": "text_delta", "text": event.text}})
        return out

    def _tool(self, event: Event) -> bytes:
        """A tool_use block: opened with an empty input, its arguments as input_json_delta fragments."""
        call = event.tool_call
        assert call is not None
        streamed = self.open_kind == "tool:" + call.id
        if event.kind == "tool_args":
            return _sse("content_block_delta", {"index": self.block,
                                                "delta": {"type": "input_json_delta", "partial_json": event.text}})
        if event.kind == "tool_call" and streamed:
            return self._close()
        out = self._open("tool:" + call.id, {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        if event.kind == "tool_call":
            out += _sse("content_block_delta", {"index": self.block, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}) + self._close()
        return out

    def finish(self, index: int, final: Generation, parsed: ParsedOutput) -> bytes:
        out = self._close()
        if not parsed.content and not parsed.tool_calls:  # as the whole answer: an (empty) text block
            out += self._open("content", {"type": "text", "text": ""}) + self._close()
        reason, sequence = stop_reason(final, parsed)
        return out + _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": {"output_tokens": len(final.output_ids)}})

    def end(self, choices: list[Choice], prompt: Prompt) -> bytes:
        return _sse("message_stop", {})

    def error(self, err: ApiError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(error_body("anthropic", err.status, err.message)) + b"\n\n"


async def handle(edge: Edge, stages: Stages, request: web.Request) -> web.StreamResponse:
    session = edge.session_for(request)
    raw, req = await edge.parse(MessagesRequest, request)
    call = to_call(req)
    emitter = MessagesEmitter(req.model or stages.prompting.model_name)
    if call.stream:
        return await stages.stream(request, Exchange(session, call.api, raw), call, emitter)
    answer = await stages.run(Exchange(session, call.api, raw), call, emitter)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)  # not part of a count request


async def count_tokens(edge: Edge, template: ChatTemplate, request: web.Request) -> web.Response:
    """`POST /v1/messages/count_tokens`: the prompt's length as the template renders it (no call, no record)."""
    edge.session_for(request)  # attribution only: counting touches no session state
    raw, req = await edge.parse(CountTokensRequest, request)
    call = to_call(req)

    def count() -> int:
        try:
            text = template.render(call.messages, call.tools, add_generation_prompt=True)
        except TemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        return len(template.encode_ids(text))

    return web.Response(body=orjson.dumps({"input_tokens": await edge.offload(len(raw), count)}),
                        content_type="application/json")
