"""Bounded work per connection and per request for the engine's HTTP front (uvicorn + FastAPI).

    BoundedBody(app, max_bytes, read_timeout)   ASGI middleware: the whole body is read first, within
                                                max_bytes (413) and read_timeout seconds (408)
    HeaderTimeoutH11                            uvicorn's h11 protocol, closing a connection that has
                                                not sent a request's headers within header_timeout s
    Control(token)                              FastAPI dependency: the control endpoints need the
                                                engine's token (Bearer), compared in constant time

Neither uvicorn nor Starlette bounds a request's body or the time a client takes to send it: a slow
or huge request would otherwise hold a connection (and the event loop, while it is parsed) for as
long as the client likes.
"""

from __future__ import annotations

import asyncio
import hmac

import orjson
from fastapi import HTTPException, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from stepline.engine.options import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT

__all__ = ["BoundedBody", "Control", "HeaderTimeoutH11"]


class _TooLarge(Exception):
    pass


class BoundedBody:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.read_timeout):
                body = await self._read(receive)
        except _TooLarge:
            await _answer(send, 413, f"the request body is larger than {self.max_bytes} bytes")
            return
        except TimeoutError:
            await _answer(send, 408, f"the request body took longer than {self.read_timeout:g} s to arrive")
            return
        if body is None:  # the client left while sending
            return
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive_again():
            # later receives reach the connection: they report a disconnect (is_disconnected works)
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_again, send)

    async def _read(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _answer(send, status: int, message: str) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "BadRequest"}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class HeaderTimeoutH11(H11Protocol):
    """Closes a connection whose next request's headers have not arrived within `header_timeout` s
    of the connection opening or of the previous response (uvicorn's keep-alive timer stops at the
    first byte of a request, so a client sending headers a byte at a time would hold it forever)."""

    header_timeout = DEFAULT_READ_TIMEOUT

    @classmethod
    def with_timeout(cls, seconds: float) -> type[HeaderTimeoutH11]:
        """The protocol class to hand uvicorn (`http=`) for a header timeout of `seconds`."""
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        cycle = self.cycle
        self.loop.call_later(self.header_timeout, self._header_deadline, cycle)

    def _header_deadline(self, cycle_then) -> None:
        waiting = self.cycle is cycle_then and (cycle_then is None or cycle_then.response_complete)
        if waiting and not self.transport.is_closing():
            self.transport.close()  # no new request started: its headers never completed


class Control:
    """Dependency of the control endpoints (pause, update weights, abort, ...): with a token set,
    a request without `Authorization: Bearer <token>` is 401. None: open (a warning at startup)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def __call__(self, request: Request) -> None:
        if self.token is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise HTTPException(401, "this endpoint needs the engine's token (Authorization: Bearer <token>)")
