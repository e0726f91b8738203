"""Upstream HTTP for the adapters: one shared aiohttp session, bounded retries of transport errors
only, and translation of aiohttp / HTTP failures into the engine exception tree."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from gateway.engines.base import EngineError, EngineRejected, EngineTimeout, EngineUnavailable

JSON_HEADERS = {"Content-Type": "application/json"}


def dumps(body: dict[str, Any]) -> bytes:
    """JSON bytes; numpy arrays (e.g. int32 prompt ids) are written natively, without a .tolist()."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY, default=_tolist)


def _tolist(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and non-contiguous arrays
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def is_transport_error(exc: BaseException) -> bool:
    """Connection refused / reset / server gone: safe to retry. Timeouts are not (the engine may
    still be working on it), and neither is any HTTP answer."""
    if isinstance(exc, asyncio.TimeoutError):
        return False
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def error_from_status(status: int, body: bytes, url: str, retry_after: float = 1.0) -> EngineError:
    message = _error_message(body) or f"HTTP {status}"
    error: EngineError
    if status in (429, 503):
        error = EngineUnavailable(f"engine busy or not ready: {message}", url, retry_after)
    elif 400 <= status < 500:
        error = EngineRejected(message, url)
    else:
        error = EngineError(f"engine error {status}: {message}", url)
    error.upstream_status = status
    return error


def _error_message(body: bytes) -> str:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:500]
    return str(data)[:500]


class Transport:
    """POSTs JSON to one engine. `attempts` bounds tries on transport errors (backoff doubles from
    `backoff` s, capped at 1 s); after that the engine counts as unavailable."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, timeout: float, attempts: int = 3, backoff: float = 0.05
    ) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        # a stream may run long: bound the gap between chunks instead of the total
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self.attempts = attempts
        self.backoff = backoff

    def _retrying(self, attempts: int | None = None) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(attempts or self.attempts),
            wait=wait_exponential(multiplier=self.backoff, max=1.0),
            retry=retry_if_exception(is_transport_error),
            reraise=True,
        )

    async def post_json(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """POST and return the decoded JSON answer; raise an EngineError subclass on any failure."""
        data = dumps(body)
        limit = aiohttp.ClientTimeout(total=timeout) if timeout is not None else self.timeout
        try:
            try:  # the first try outside tenacity: its per-call setup costs ~tens of µs on the hot path
                status, raw = await self._post(path, data, limit)
            except Exception as exc:
                if not is_transport_error(exc) or self.attempts < 2:
                    raise
                await asyncio.sleep(self.backoff)
                async for attempt in self._retrying(self.attempts - 1):
                    with attempt:
                        status, raw = await self._post(path, data, limit)
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"no answer from the engine within {limit.total} s", self.url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc!r}", self.url) from exc
        if status >= 400:
            raise error_from_status(status, raw, self.url)
        try:
            return orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"engine answered invalid JSON: {raw[:200]!r}", self.url) from exc

    async def _post(self, path: str, data: bytes, limit: aiohttp.ClientTimeout) -> tuple[int, bytes]:
        async with self.http.post(self.url + path, data=data, headers=JSON_HEADERS, timeout=limit) as resp:
            return resp.status, await resp.read()

    async def get_json(self, path: str) -> Any:
        """GET and decode JSON, errors translated (no retries: used once, at first use)."""
        try:
            async with self.http.get(self.url + path, timeout=self.timeout) as resp:
                raw, status = await resp.read(), resp.status
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"no answer from the engine within {self.timeout.total} s", self.url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc!r}", self.url) from exc
        if status >= 400:
            raise error_from_status(status, raw, self.url)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"engine answered invalid JSON: {raw[:200]!r}", self.url) from exc

    async def get_ok(self, path: str, timeout: float = 2.0) -> bool:
        """True when GET path answers 2xx within `timeout` (health checks: no retries)."""
        try:
            async with self.http.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status < 300
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def sse(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """POST with streaming and yield each `data: {...}` event decoded, until `data: [DONE]` or EOF.

        Connecting is retried on transport errors; once bytes have flowed nothing is retried (the
        engine has sampled tokens the client may already have seen). Closing this generator early
        closes the connection, which makes SGLang / vLLM abort the request."""
        data = dumps(body)
        url = self.url + path
        try:
            try:  # first try outside tenacity (hot path), as in post_json
                resp = await self.http.post(url, data=data, headers=JSON_HEADERS, timeout=self.stream_timeout)
            except Exception as exc:
                if not is_transport_error(exc) or self.attempts < 2:
                    raise
                await asyncio.sleep(self.backoff)
                async for attempt in self._retrying(self.attempts - 1):
                    with attempt:
                        resp = await self.http.post(url, data=data, headers=JSON_HEADERS, timeout=self.stream_timeout)
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"engine did not start the stream within {self.timeout.total} s", self.url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc!r}", self.url) from exc
        done = False
        try:
            if resp.status >= 400:
                raise error_from_status(resp.status, await resp.read(), self.url)
            async for event in _data_lines(resp):
                if event == b"[DONE]":
                    break
                yield orjson.loads(event)
            done = True
        except asyncio.TimeoutError as exc:
            raise EngineTimeout(f"engine stream stalled for {self.timeout.total} s", self.url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"engine stream broke: {exc!r}", self.url) from exc
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"engine sent an invalid stream event: {exc}", self.url) from exc
        finally:
            if done:
                resp.release()
            else:
                resp.close()


async def _data_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payloads of `data:` lines. Reads raw chunks rather than readline(): a cumulative SGLang
    event (all logprobs so far) can exceed aiohttp's per-line buffer limit."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.startswith(b"data:"):
        yield buf[5:].strip()
