"""What every engine adapter speaks and shares: sampling parameters in, generations (or stream deltas)
out, the exception tree, and the `Transport` that POSTs to one engine over the shared aiohttp session
(bounded retries of transport errors only) and translates aiohttp / HTTP failures into that tree.

Exceptions (what the app turns into HTTP answers; `status` is the code to answer with):

    EngineError            502  the engine answered with an error (message says which)
    ├── EngineRejected     400  the engine refused the request itself (a 4xx: e.g. prompt too long)
    ├── EngineUnavailable  503  unreachable after bounded retries, unhealthy, or overloaded (retry_after)
    └── EngineTimeout      504  no answer within the timeout
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import aiohttp
import orjson

from stepline._retry import RetryPolicy, transport_error

FinishReason = str  # "stop" | "length" | "abort"


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class Generation:
    """One finished generation. Output ids include a matched stop token / EOS (as SGLang returns
    them); the text excludes it."""

    output_ids: list[int]
    logprobs: list[float]  # one per output id: the engine's logprob of the sampled token
    text: str
    finish_reason: FinishReason
    matched_stop: int | str | None  # the stop token id or stop string that ended it, if any
    prompt_tokens: int
    weight_version: int  # the version the engine reports (or the adapter last installed)
    # (first output index, version) of each run of tokens one version sampled, set by the gateway on a generation
    # it resumed across a weight update (stepline/gateway/frontends/resume.py); empty: the version stamped at dispatch
    version_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """Cut short: by the token budget ("length"), or by the engine ("abort": e.g. a weight update ended
        it, stepline/gateway/fleet.py, with partial rollouts off). Both are answered as the API's truncation
        (length, max_tokens, incomplete)."""
        return self.finish_reason in ("length", "abort")


@dataclass
class StreamDelta:
    """One chunk of a stream: only what is new since the previous chunk."""

    output_ids: list[int]
    logprobs: list[float]
    text: str
    final: Generation | None = None  # set on the last chunk


@dataclass
class EngineInfo:
    """What an engine says about itself at start (any field None when it does not say)."""

    model_path: str | None = None  # the model directory (or name) it was started on
    context_length: int | None = None  # prompt + output tokens it accepts
    weight_version: str | None = None  # its own weight version label


@runtime_checkable
class EngineClient(Protocol):
    """An engine adapter. `input_ids` may also be an int32 numpy array: it is serialised directly,
    which saves the hot path a `.tolist()` of the whole prompt."""

    url: str

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> Generation: ...
    def stream(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[StreamDelta]: ...
    async def health(self) -> bool: ...
    async def info(self) -> EngineInfo: ...
    async def update_weights(self, path: str, version: int) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...


class EngineError(Exception):
    """The engine answered with an error."""

    status = 502
    upstream_status: int | None = None  # the engine's own HTTP status, when it answered one

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(f"{message} ({url})" if url else message)
        self.message = message
        self.url = url


class EngineRejected(EngineError):
    """The engine refused the request as invalid (it answered 4xx); never retried."""

    status = 400


class EngineUnavailable(EngineError):
    """The engine cannot be reached or is not serving; the client should retry after `retry_after` s."""

    status = 503

    def __init__(self, message: str, url: str = "", retry_after: float = 1.0) -> None:
        super().__init__(message, url)
        self.retry_after = retry_after


class EngineTimeout(EngineError):
    """The engine did not answer in time."""

    status = 504


# The transport: upstream HTTP for the adapters.

JSON_HEADERS = {"Content-Type": "application/json"}
T = TypeVar("T")


def dumps(body: dict[str, Any]) -> bytes:
    """JSON bytes; numpy arrays (e.g. int32 prompt ids) are written natively, without a .tolist()."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY, default=_tolist)


def _tolist(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and non-contiguous arrays
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__}")


# Connection refused / reset / server gone: safe to retry. Timeouts are not (the engine may still be
# working on it), and neither is any HTTP answer.
is_transport_error = transport_error(resend=True)


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
        self.retry = RetryPolicy(attempts, backoff, max_backoff=1.0)

    async def _send(self, send: Callable[[], Awaitable[T]]) -> T:
        """send() once; on a transport error, up to `attempts - 1` more tries with backoff (the first
        try costs no tenacity setup: tens of µs on the hot path)."""
        return await self.retry.acall(send, retry_on=is_transport_error)

    @contextmanager
    def _translated(self, doing: str, seconds: float | None) -> Iterator[None]:
        """aiohttp's failures as engine errors: a timeout is EngineTimeout, anything else on the
        connection EngineUnavailable."""
        try:
            yield
        except TimeoutError as exc:
            raise EngineTimeout(f"{doing}: no answer within {seconds} s", self.url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"{doing}: engine unreachable ({exc!r})", self.url) from exc

    async def post_json(
        self, path: str, body: dict[str, Any], timeout: float | None = None, expect_json: bool = True
    ) -> Any:
        """POST and return the decoded JSON answer (None when not `expect_json`: some control endpoints,
        e.g. SGLang's /flush_cache, answer plain text); raise an EngineError subclass on any failure."""
        data = dumps(body)
        limit = aiohttp.ClientTimeout(total=timeout) if timeout is not None else self.timeout

        async def send() -> tuple[int, bytes]:
            async with self.http.post(self.url + path, data=data, headers=JSON_HEADERS, timeout=limit) as resp:
                return resp.status, await resp.read()

        with self._translated(f"POST {path}", limit.total):
            status, raw = await self._send(send)
        if not expect_json and status < 400:
            return None
        return _decode(status, raw, self.url)

    async def get_json(self, path: str) -> Any:
        """GET and decode JSON, errors translated (no retries: used once, at first use)."""
        with self._translated(f"GET {path}", self.timeout.total):
            async with self.http.get(self.url + path, timeout=self.timeout) as resp:
                status, raw = resp.status, await resp.read()
        return _decode(status, raw, self.url)

    async def get_ok(self, path: str, timeout: float = 2.0) -> bool:
        """True when GET path answers 2xx within `timeout` (health checks: no retries)."""
        try:
            async with self.http.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def sse(self, path: str, body: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """POST with streaming and yield each `data: {...}` event decoded, until `data: [DONE]` or EOF.

        Connecting is retried on transport errors; once bytes have flowed nothing is retried (the
        engine has sampled tokens the client may already have seen). Closing this generator early
        closes the connection, which makes SGLang / vLLM abort the request. The timeout bounds the
        gap between chunks, not the whole stream."""
        data = dumps(body)

        async def send() -> aiohttp.ClientResponse:
            return await self.http.post(self.url + path, data=data, headers=JSON_HEADERS, timeout=self.stream_timeout)

        seconds = self.stream_timeout.sock_read
        with self._translated(f"POST {path} (stream)", seconds):
            resp = await self._send(send)
        done = False
        try:
            if resp.status >= 400:
                raise error_from_status(resp.status, await resp.read(), self.url)
            with self._translated(f"POST {path} (stream)", seconds):
                async for event in _data_lines(resp):
                    if event == b"[DONE]":
                        break
                    try:
                        yield orjson.loads(event)
                    except orjson.JSONDecodeError as exc:
                        raise EngineError(f"engine sent an invalid stream event: {exc}", self.url) from exc
            done = True
        finally:
            if done:
                resp.release()
            else:
                resp.close()


def _decode(status: int, raw: bytes, url: str) -> Any:
    if status >= 400:
        raise error_from_status(status, raw, url)
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"engine answered invalid JSON: {raw[:200]!r}", url) from exc


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
