"""Request bodies stored as deltas of their parent call's body (pure: no I/O).

A harness resends its whole history, so a turn's request body begins with most of its parent call's. The gateway
records only the bytes after their common prefix (`CallRecord.request_prefix`; docs/architecture.md, "Recording a
turn as a delta") and the pool stores them so, noting in each call's `extra` map how long its body is
(`REQUEST_LEN`, to refuse a prefix longer than the parent's) and what a delta's body starts with (`REQUEST_OF`).
`WholeRequests` rebuilds the whole bodies for everything that reads calls (`get_calls`, export).
"""

from __future__ import annotations

from typing import Any

import zstandard

REQUEST_OF = "request_of"  # extra key: [parent call index, bytes of the parent's body this one starts with]
REQUEST_LEN = "request_len"  # extra key: the length of the call's whole body, bytes


def body_len(request: bytes | None, prefix: int) -> int | None:
    """The whole length of a stored body: `prefix` bytes + the content size its zstd frame states (None: no
    body, or a frame that does not say)."""
    if request is None:
        return None
    try:
        size = zstandard.frame_content_size(request)
    except zstandard.ZstdError:
        return None
    return None if size < 0 else prefix + size


class WholeRequests:
    """The whole (zstd) request bodies of one session's calls, fed in insertion order (a delta's parent first)."""

    def __init__(self) -> None:
        self._stored: dict[int, tuple[bytes, list[int] | None]] = {}
        self._raw: dict[int, bytes] = {}  # uncompressed bodies of deltas and of the parents they needed
        self._zstd = zstandard.ZstdCompressor(level=3)

    def whole(self, call_index: int, request: bytes | None, extra: dict[str, Any]) -> bytes | None:
        """The call's body as recorded whole: its stored bytes, or a delta's rebuilt and compressed."""
        if request is None:
            return None
        of = extra.get(REQUEST_OF)
        self._stored[call_index] = (request, of)
        return request if of is None else self._zstd.compress(self._body(call_index))

    def _body(self, call_index: int) -> bytes:
        if call_index not in self._raw:
            request, of = self._stored[call_index]
            body = zstandard.ZstdDecompressor().decompress(request)
            if of is not None:
                parent, prefix = of
                body = self._body(parent)[:prefix] + body
            self._raw[call_index] = body
        return self._raw[call_index]
