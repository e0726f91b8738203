"""Long texts tokenized in worker processes, so that tokenizing them never holds the gateway's event loop.

    TokenizerPool(tokenizer_path, workers, min_chars)
        wants(text)                 `text` has at least `min_chars` characters and this is not the event loop's thread
        encode(text) -> int32 ids   from a worker process (blocking the calling worker thread only)
        close()
    python -m stepline.gateway.tokenizing TOKENIZER_JSON   one worker: length-prefixed texts in, packed int32 ids out

Why processes and not the worker thread alone (measured, docs/results.md): the `tokenizers` binding's
`encode` holds the GIL for its whole run (about 2.5 s for 170k tokens on a loaded 2-core machine: every
other thread, the event loop included, waits that long); `encode_batch` releases it while it tokenizes, but
building the Python list of ids (`Encoding.ids`) holds it again, tens of ms for a 128k-token prompt. A worker
process has its own GIL and hands back the ids as packed int32 bytes, which the gateway takes without
building a Python int per token (the pipes are read and written with the GIL released).

The workers are plain child processes on pipes (`subprocess`, not `multiprocessing`: its spawn would import the
embedding program's main module again, and fork is unsafe in a process running threads), started on the first
long text, at most `workers`, each loading the tokenizer once; a worker ends when its pipe closes, so it never
outlives the gateway.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import IO

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


def encode_here(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """int32 ids of `text`, in this process; `encode_batch` lets other threads run while it tokenizes."""
    if len(text) < 4096:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    [encoding] = tokenizer.encode_batch([text], add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.int32)


_HEADER = struct.Struct("<q")  # a payload's length in bytes; negative: an error message of -length bytes


class TokenizerError(RuntimeError):
    """A tokenizer worker failed (its message) or died."""


class _Worker:
    def __init__(self, tokenizer_path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stepline.gateway.tokenizing", tokenizer_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def encode(self, text: str) -> np.ndarray:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = text.encode("utf-8", "surrogatepass")
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()
        size = _HEADER.unpack(_read(self.proc.stdout, _HEADER.size))[0]
        if size < 0:
            raise TokenizerError(_read(self.proc.stdout, -size).decode())
        return np.frombuffer(_read(self.proc.stdout, size), dtype=np.int32)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the worker's loop ends
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _read(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise TokenizerError("a tokenizer worker died")
    return data


class TokenizerPool:
    def __init__(self, tokenizer_path: str, workers: int, min_chars: int) -> None:
        self.min_chars = min_chars
        self._path = tokenizer_path
        self._idle: queue.Queue[_Worker | None] = queue.Queue()  # a slot per worker: None until first used
        for _ in range(workers):
            self._idle.put(None)
        self._closed = False

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
        """int32 ids of a long text, from a worker process (blocks the calling thread, not the others; waits for
        a free worker when all are busy)."""
        worker = self._idle.get()
        try:
            worker = worker or _Worker(self._path)
            return worker.encode(text)
        except TokenizerError:
            if worker is not None and worker.proc.poll() is not None:
                worker = None  # dead: the next text starts a new one
            raise
        except BaseException:  # interrupted mid-exchange: the pipe's state is unknown
            if worker is not None:
                worker.close()
            worker = None
            raise
        finally:
            self._give_back(worker)

    def _give_back(self, worker: _Worker | None) -> None:
        if self._closed and worker is not None:
            worker.close()
            worker = None
        self._idle.put(worker)

    def close(self) -> None:
        """End the idle workers now, and the busy ones as they finish."""
        self._closed = True
        idle = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for worker in idle:
            if worker is not None:
                worker.close()
            self._idle.put(None)


def _serve(tokenizer_path: str) -> None:
    """A worker's loop: a length-prefixed UTF-8 text in, its int32 ids out, until stdin closes."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(_HEADER.size):
        text = stdin.read(_HEADER.unpack(header)[0]).decode("utf-8", "surrogatepass")
        try:
            [encoding] = tokenizer.encode_batch([text], add_special_tokens=False)
            out = np.asarray(encoding.ids, dtype=np.int32).tobytes()
            del encoding
        except Exception as exc:  # noqa: BLE001 - handed to the gateway, which raises it
            message = f"{type(exc).__name__}: {exc}".encode()
            stdout.write(_HEADER.pack(-len(message)) + message)
        else:
            stdout.write(_HEADER.pack(len(out)) + out)
        stdout.flush()
        trim_heap()  # a long text's encoding takes hundreds of bytes a token: give them back


if __name__ == "__main__":
    _serve(sys.argv[1])
