"""OpenAI Responses: `POST /v1/responses`.

Supported: `input` as text or items (messages with text parts, function_call, function_call_output,
reasoning), `instructions`, function `tools`, `tool_choice` (auto, none, required, a named function),
`temperature`, `top_p`, `max_output_tokens`, `previous_response_id` (responses of the same session,
kept in memory), `stream` (response.created … response.completed events). Reasoning comes back as a
`reasoning` item whose `content` holds the text.

An answer cut by `max_output_tokens` carries `incomplete_details: {"reason": "max_output_tokens"}`; its status
and closing event are OpenAI's (`incomplete`, `response.incomplete`) unless the gateway runs with
`responses_truncated = "completed"` (`completed`, `response.completed`: the OpenAI Agents SDK raises
ModelBehaviorError on the former). Either way the pool records the call's finish_reason `length`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from stepline.gateway.engines import Generation, StreamDelta
from stepline.gateway.frontends.chat import sampling_of
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import ApiError, invalid
from stepline.gateway.frontends.exchange import Choice, Exchange
from stepline.gateway.frontends.prompting import ChatCall
from stepline.gateway.frontends.stages import Stages, assistant_message
from stepline.gateway.parsers.base import Event, ParsedOutput
from stepline.gateway.sessions import Prompt, Session
from stepline.gateway.templating import Message

MAX_KEPT_RESPONSES = 64  # per session, for previous_response_id


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Model):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
    text: str = ""
    refusal: str | None = None


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None


Item = FunctionCallItem | FunctionOutputItem | ReasoningItem | MessageItem


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(_Model):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Model):
    model: str = ""
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    seed: int | None = None  # extension (not in the API): reproducible sampling


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text or p.refusal or "" for p in content)


def to_messages(items: str | list[Item]) -> list[Message]:
    """Input items → chat messages: an assistant text item and the function calls (and reasoning) that
    follow it form one assistant message, as the model produced them in one turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    reasoning: str | None = None  # a reasoning item waiting for the assistant turn it belongs to
    open_turn = False  # the last message is an assistant turn still taking function calls

    def assistant(content: str) -> None:
        nonlocal reasoning
        message: Message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        out.append(message)

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning, open_turn = _text(item.content or []) or _text(item.summary), False
        elif isinstance(item, FunctionCallItem):
            if not open_turn:
                assistant("")
                open_turn = True
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            open_turn = False
        elif item.role == "assistant":
            assistant(_text(item.content))
            open_turn = True
        else:
            out.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
            open_turn = False
    return out


def to_call(req: ResponsesRequest, session: Session) -> ChatCall:
    messages = to_messages(req.input)
    if req.previous_response_id is not None:
        earlier = session.responses.get(req.previous_response_id)
        if earlier is None:
            raise ApiError(404, f"unknown previous_response_id {req.previous_response_id!r} in this session",
                           param="previous_response_id")
        if req.instructions and earlier and earlier[0]["role"] == "system":
            earlier = earlier[1:]  # instructions are not carried over from the earlier response
        messages = earlier + messages
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}] + messages
    if not messages:
        raise invalid("input must not be empty", param="input")
    names = [t.name for t in req.tools or []]
    tools = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
             for t in req.tools or []] or None
    choice = req.tool_choice
    if choice is not None and choice != "auto" and choice != "none" and not names:
        raise invalid("tool_choice needs `tools`", param="tool_choice")
    if isinstance(choice, NamedChoice) and choice.name not in names:
        raise invalid(f"tool_choice names an unknown tool {choice.name!r}", param="tool_choice")
    return ChatCall(api="responses", messages=messages, tools=tools,
                         sampling=sampling_of(req.temperature, req.top_p, None, None, req.seed),
                         max_tokens=req.max_output_tokens, tools_enabled=choice != "none", stream=bool(req.stream))


def _items(parsed: ParsedOutput, ids: dict[str, str]) -> list[dict]:
    items: list[dict] = []
    if parsed.reasoning:
        items.append(_reasoning_item(ids["reasoning"], parsed.reasoning))
    if parsed.content or not parsed.tool_calls:
        items.append(_message_item(ids["message"], parsed.content, "completed"))
    for call in parsed.tool_calls:
        items.append(_call_item(call.id, call.name, call.arguments, "completed"))
    return items


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesEmitter:
    def __init__(self, req: ResponsesRequest, model: str, session: Session, call: ChatCall,
                 truncated: str = "incomplete") -> None:
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.req, self.model, self.session, self.call = req, model, session, call
        self.truncated_status = truncated  # status of an answer cut by max_output_tokens (responses_truncated)
        self.ids = {"reasoning": "rs_" + uuid.uuid4().hex[:24], "message": "msg_" + uuid.uuid4().hex[:24]}
        self.seq = 0
        self.index = -1  # output index of the open item
        self.open_kind: str | None = None
        self.text = ""

    def _base(self, status: str, output: list[dict], usage: dict | None, incomplete: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": self.req.instructions,
                "max_output_tokens": self.req.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "previous_response_id": self.req.previous_response_id,
                "temperature": self.call.sampling.temperature, "top_p": self.call.sampling.top_p,
                "tool_choice": self.req.tool_choice if isinstance(self.req.tool_choice, str) or self.req.tool_choice is None
                else self.req.tool_choice.model_dump(),
                "tools": [t.model_dump() for t in self.req.tools or []], "text": {"format": {"type": "text"}},
                "usage": usage, "metadata": {}}

    def answer(self, choices: list[Choice], prompt: Prompt) -> dict:
        choice = choices[0]
        gen = choice.generation
        usage = {"input_tokens": len(prompt.ids), "input_tokens_details": {"cached_tokens": prompt.reused},
                 "output_tokens": len(gen.output_ids), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(prompt.ids) + len(gen.output_ids)}
        incomplete = {"reason": "max_output_tokens"} if gen.truncated else None
        status = self.truncated_status if incomplete else "completed"
        answer = self._base(status, _items(choice.parsed, self.ids), usage, incomplete)
        self._keep(assistant_message(choice.parsed))
        return answer

    def _keep(self, message: Message) -> None:
        kept = self.session.responses
        kept[self.id] = [*self.call.messages, message]
        while len(kept) > MAX_KEPT_RESPONSES:
            kept.pop(next(iter(kept)))

    def _event(self, kind: str, body: dict) -> bytes:
        self.seq += 1
        data = orjson.dumps({"type": kind, "sequence_number": self.seq - 1, **body})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self, prompt: Prompt) -> bytes:
        shell = self._base("in_progress", [], None)
        return self._event("response.created", {"response": shell}) + self._event("response.in_progress", {"response": shell})

    def _open(self, kind: str, item: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        self.text = ""
        out += self._event("response.output_item.added", {"output_index": self.index, "item": item})
        if kind == "message":
            out += self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": self.index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        return out

    def _close(self) -> bytes:
        kind, self.open_kind = self.open_kind, None
        if kind == "reasoning":
            item_id = self.ids["reasoning"]
            return (self._event("response.reasoning_text.done", {"item_id": item_id, "output_index": self.index,
                                                                   "content_index": 0, "text": self.text})
                    + self._event("response.output_item.done", {"output_index": self.index,
                                                                "item": _reasoning_item(item_id, self.text)}))
        if kind == "message":
            item_id = self.ids["message"]
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            return (self._event("response.output_text.done", {"item_id": item_id, "output_index": self.index,
                                                                "content_index": 0, "text": self.text, "logprobs": []})
                    + self._event("response.content_part.done", {"item_id": item_id, "output_index": self.index,
                                                                  "content_index": 0, "part": part})
                    + self._event("response.output_item.done", {"output_index": self.index,
                                                                "item": _message_item(item_id, self.text, "completed")}))
        return b""

    def events(self, index: int, events: list[Event], delta: StreamDelta) -> bytes:
        out = b""
        for event in events:
            if event.kind in ("tool_open", "tool_args", "tool_call") and event.tool_call is not None:
                out += self._tool(event)
            elif event.kind == "reasoning" and not event.text:
                continue  # an empty reasoning block gets no item/block, as in the whole answer
            elif event.kind == "reasoning":
                if self.open_kind != "reasoning":
                    out += self._open("reasoning", {"type": "reasoning", "id": self.ids["reasoning"], "summary": []})
                if event.text:
                    self.text += event.text
                    out += self._event("response.reasoning_text.delta", {"item_id": self.ids["reasoning"],
                                                                         "output_index": self.index,
                                                                         "content_index": 0, "delta": event.text})
            else:
                if self.open_kind != "message":
                    out += self._open("message", _message_item(self.ids["message"], None, "in_progress"))
                self.text += event.text
                out += self._event("response.output_text.delta", {"item_id": self.ids["message"],
                                                                  "output_index": self.index, "content_index": 0,
                                                                  "delta": event.text, "logprobs": []})
        return out

    def _tool(self, event: Event) -> bytes:
        """A function_call item: added with empty arguments, then function_call_arguments.delta fragments,
        then .done with the whole arguments."""
        c = event.tool_call
        assert c is not None
        item_id = _call_item(c.id, c.name, "", "")["id"]
        out = b""
        if self.open_kind != "call:" + c.id:
            out += self._open("call:" + c.id, _call_item(c.id, c.name, "", "in_progress"))
        if event.kind == "tool_call" and self.text != c.arguments:  # a call not streamed: all its arguments at once
            out += self._event("response.function_call_arguments.delta",
                               {"item_id": item_id, "output_index": self.index, "delta": c.arguments})
        elif event.kind == "tool_args":
            self.text += event.text
            out += self._event("response.function_call_arguments.delta",
                               {"item_id": item_id, "output_index": self.index, "delta": event.text})
        if event.kind == "tool_call":
            out += self._event("response.function_call_arguments.done",
                               {"item_id": item_id, "output_index": self.index, "arguments": c.arguments, "name": c.name})
            out += self._event("response.output_item.done",
                               {"output_index": self.index, "item": _call_item(c.id, c.name, c.arguments, "completed")})
            self.open_kind = None
        return out

    def finish(self, index: int, final: Generation, parsed: ParsedOutput) -> bytes:
        out = self._close()
        if not parsed.content and not parsed.tool_calls:  # as the whole answer: one (empty) message
            out += self._open("message", _message_item(self.ids["message"], None, "in_progress")) + self._close()
        return out

    def end(self, choices: list[Choice], prompt: Prompt) -> bytes:
        answer = self.answer(choices, prompt)
        kind = "response.completed" if answer["status"] == "completed" else "response.incomplete"
        return self._event(kind, {"response": answer})

    def error(self, err: ApiError) -> bytes:
        return self._event("error", {"code": err.code or str(err.status), "message": err.message, "param": err.param})


async def handle(edge: Edge, stages: Stages, request: web.Request) -> web.StreamResponse:
    session = edge.session_for(request)
    raw, req = await edge.parse(ResponsesRequest, request)
    call = to_call(req, session)
    prompting = stages.prompting
    emitter = ResponsesEmitter(req, req.model or prompting.model_name, session, call, prompting.responses_truncated)
    if call.stream:
        return await stages.stream(request, Exchange(session, call.api, raw), call, emitter)
    answer = await stages.run(Exchange(session, call.api, raw), call, emitter)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")

