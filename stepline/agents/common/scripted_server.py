"""A scripted model endpoint on loopback that speaks the real wire formats, for tests and dry runs.

It answers POST /v1/chat/completions (OpenAI) and POST /v1/messages (Anthropic), non-streaming, with
whatever a policy function returns for the request body:

    def policy(body: dict) -> Reply | RawReply: ...
    with ScriptedServer(policy) as server:
        env = {"OPENAI_BASE_URL": server.openai_base_url, "ANTHROPIC_BASE_URL": server.url, ...}

`Reply` is one assistant answer (text and/or tool calls); `RawReply` is any HTTP answer at all
(garbage bodies, 500s) for fault tests. Every request body is kept in `server.requests`, and the
key it came with (OpenAI's Bearer token or Anthropic's x-api-key) at the same index in `server.api_keys`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    content: str | None = None
    tool_calls: list[tuple[str, dict[str, Any] | str]] = field(default_factory=list)  # (name, arguments)


@dataclass
class RawReply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


ServerPolicy = Callable[[dict[str, Any]], "Reply | RawReply"]


def _arguments_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def openai_completion(reply: Reply, model: str, n: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": _arguments_text(args)}}
            for i, (name, args) in enumerate(reply.tool_calls)
        ]
    finish = "tool_calls" if reply.tool_calls else "stop"
    return {
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def anthropic_message(reply: Reply, model: str, n: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    for i, (name, args) in enumerate(reply.tool_calls):
        parsed = json.loads(args) if isinstance(args, str) else args
        content.append({"type": "tool_use", "id": f"toolu_{n}_{i}", "name": name, "input": parsed})
    return {
        "id": f"msg_{n}", "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": "tool_use" if reply.tool_calls else "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


class ScriptedServer:
    """Loopback HTTP server (port 0, own thread) answering with `policy`; use as a context manager."""

    def __init__(self, policy: ServerPolicy):
        self.policy = policy
        self.requests: list[dict[str, Any]] = []
        self.api_keys: list[str | None] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def answer(self, path: str, body: dict[str, Any], api_key: str | None = None) -> RawReply:
        with self._lock:
            self.requests.append(body)
            self.api_keys.append(api_key)
            n = len(self.requests)
        reply = self.policy(body)
        if isinstance(reply, RawReply):
            return reply
        model = str(body.get("model", ""))
        if path.endswith("/chat/completions"):
            return RawReply(body=json.dumps(openai_completion(reply, model, n)).encode())
        return RawReply(body=json.dumps(anthropic_message(reply, model, n)).encode())


def _api_key(headers: Any) -> str | None:
    """The key a client sent: `Authorization: Bearer K` (OpenAI) or `x-api-key: K` (Anthropic)."""
    bearer = headers.get("Authorization", "")
    return bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else headers.get("x-api-key")


def _handler_for(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if not self.path.endswith(("/chat/completions", "/messages")):
                return self._send(RawReply(404, b'{"error": {"message": "not found"}}'))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            except ValueError:
                return self._send(RawReply(400, b'{"error": {"message": "body is not JSON"}}'))
            self._send(server.answer(self.path, body, _api_key(self.headers)))

        def _send(self, reply: RawReply) -> None:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    return Handler
