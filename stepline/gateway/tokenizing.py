"""Long texts tokenized in worker processes, so that tokenizing them never holds the gateway's event loop.

    TokenizerPool(tokenizer_path, workers, min_chars)
        wants(text)                 `text` has at least `min_chars` characters and this is not the event loop's thread
        encode(text) -> int32 ids   from a worker process (blocking the calling worker thread only)
        close()

Why processes and not the worker thread alone (measured, docs/results.md): the `tokenizers` binding's
`encode` holds the GIL for its whole run (about 2.5 s for 170k tokens on a loaded 2-core machine: every
other thread, the event loop included, waits that long); `encode_batch` releases it while it tokenizes, but
building the Python list of ids (`Encoding.ids`) holds it again, tens of ms for a 128k-token prompt. A worker
process has its own GIL and hands back the ids as packed int32 bytes, which the gateway takes without
building a Python int per token. The processes are started (spawned, never forked: the gateway runs
threads) on the first long text, at most `workers`, each loading the tokenizer once.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tokenizers import Tokenizer

__all__ = ["TokenizerPool", "encode_here", "trim_heap"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free memory back to the system (glibc keeps what a large request freed; elsewhere a no-op).
    A foreign call: the GIL is released while it runs."""
    if _TRIM is not None:
        _TRIM(0)

_tokenizer: Tokenizer | None = None  # a worker process's own tokenizer


def _load(path: str) -> None:
    global _tokenizer
    _tokenizer = Tokenizer.from_file(path)


def _encode(text: str) -> bytes:
    assert _tokenizer is not None
    [encoding] = _tokenizer.encode_batch([text], add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int32).tobytes()
    del encoding
    trim_heap()  # a long text's encoding takes hundreds of bytes a token: give them back
    return ids


def encode_here(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """int32 ids of `text`, in this process; `encode_batch` lets other threads run while it tokenizes."""
    if len(text) < 4096:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    [encoding] = tokenizer.encode_batch([text], add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.int32)


class TokenizerPool:
    def __init__(self, tokenizer_path: str, workers: int, min_chars: int) -> None:
        self.min_chars = min_chars
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(workers, context, initializer=_load, initargs=(tokenizer_path,))

    def wants(self, text: str) -> bool:
        """A long text, off the event loop's thread (which must never wait on a busy pool)."""
        if len(text) < self.min_chars:
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return True
        return False

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of a long text, from a worker process (blocks the calling thread, not the others)."""
        return np.frombuffer(self._pool.submit(_encode, text).result(), dtype=np.int32)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
