"""What every engine adapter speaks: sampling parameters in, generations (or stream deltas) out.

Exceptions (what the app turns into HTTP answers; `status` is the code to answer with):

    EngineError            502  the engine answered with an error (message says which)
    ├── EngineRejected     400  the engine refused the request itself (a 4xx: e.g. prompt too long)
    ├── EngineUnavailable  503  unreachable after bounded retries, unhealthy, or overloaded (retry_after)
    └── EngineTimeout      504  no answer within the timeout
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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

    @property
    def truncated(self) -> bool:
        """Cut short: by the token budget ("length"), or by the engine ("abort": e.g. a weight update ended
        it, gateway/weights.py). Both are answered as the API's truncation (length, max_tokens, incomplete)."""
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
