"""The one retry policy of Stepline's HTTP clients (engine transport, gateway sessions, weight sync, pool).

Only transport errors are retried, with bounded exponential backoff; an HTTP answer never is, a 4xx
above all, except the server's own "not now" (502/503/504, raised by the client as `Unavailable`).
Whether a timeout or a dropped connection may be retried depends on whether the request is safe to
send twice, so the caller says so (`resend`): a refused connection never reached the server and is
always retried.

    policy = RetryPolicy(attempts=5, backoff=0.2, max_backoff=5.0)
    answer = policy.call(client.post, "/x", retry_on=transport_error(resend=True))
    answer = await policy.acall(send)                # asyncio; the first try costs no tenacity setup

Imports no other Stepline package, so every package may use it (tests/test_architecture.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

__all__ = ["RetryPolicy", "Unavailable", "is_transport_error", "transport_error"]

T = TypeVar("T")


class Unavailable(Exception):
    """The server answered that it cannot serve now (502/503/504): worth another try."""


def is_transport_error(exc: BaseException, resend: bool = False) -> bool:
    """True for a failure of the connection rather than an answer. Connection refused (the request never
    left) always; a timeout, a reset or a cut-off body only when the request is safe to send twice."""
    if isinstance(exc, Unavailable | httpx.ConnectError | aiohttp.ClientConnectorError):
        return True
    if not resend:
        return False
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts (httpx's are TransportErrors)
        return False  # an engine may still be working on it: never resent through the aiohttp transport
    return isinstance(exc, httpx.TransportError | aiohttp.ClientConnectionError | aiohttp.ClientPayloadError)


def transport_error(resend: bool) -> Callable[[BaseException], bool]:
    """`is_transport_error` with `resend` fixed, as a tenacity predicate."""
    return lambda exc: is_transport_error(exc, resend)


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; waits of `backoff`, 2·`backoff`, 4·`backoff`, ... s, each capped at
    `max_backoff`. The last error is raised as it was."""

    attempts: int = 5
    backoff: float = 0.2
    max_backoff: float = 5.0

    def _tenacity(self, retry_on: Callable[[BaseException], bool]) -> dict[str, Any]:
        # the first try is made before tenacity starts, and the first wait slept: these are the rest
        return {"stop": stop_after_attempt(self.attempts - 1), "reraise": True, "retry": retry_if_exception(retry_on),
                "wait": wait_exponential(multiplier=2 * self.backoff, max=self.max_backoff)}

    def call(self, fn: Callable[..., T], *args: Any, retry_on: Callable[[BaseException], bool] = is_transport_error,
             **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.attempts < 2 or not retry_on(exc):
                raise
        time.sleep(min(self.backoff, self.max_backoff))
        return Retrying(**self._tenacity(retry_on))(fn, *args, **kwargs)

    async def acall(self, send: Callable[[], Awaitable[T]],
                    retry_on: Callable[[BaseException], bool] = is_transport_error) -> T:
        try:
            return await send()
        except Exception as exc:
            if self.attempts < 2 or not retry_on(exc):
                raise
        await asyncio.sleep(min(self.backoff, self.max_backoff))
        async for attempt in AsyncRetrying(**self._tenacity(retry_on)):
            with attempt:
                return await send()
        raise AssertionError("unreachable: tenacity reraises the last error")
