"""The recorder: what the gateway records of its calls, handed to the pool in FIFO order, batched, from one
worker thread.

Calls are queued without blocking (the answer to the harness never waits on the pool); session
creation, rewards and ends go through the same queue, so they are ordered after every call queued
before them, and their caller waits until the pool has committed them. Consecutive calls are written
with one `pool.add_calls` per batch.

Failure policy:
- the pool refuses a record as invalid (`PoolError`: InvalidRecord, UnknownSession, ReadOnlyPool):
  a batch is retried record by record so only the bad ones are refused; a refused call is counted and
  logged (never silently dropped); a refused session / reward / end raises in its waiting caller. A refused
  delta (a turn recorded as the ids it adds to an earlier call, which the pool lacks) is sent again whole.
- the pool is unavailable for now (`stepline.datapool.base.is_unavailable`: the service unreachable, the database
  locked, a lost connection): the batch stays at the head of the queue and is retried with exponential
  backoff capped at `max_backoff` s. The queue keeps filling meanwhile; `has_capacity()` turns False at
  `max_queue`, and the app answers 503.
- the pool's disk is full (`PoolFull`, an outage too): the calls stay queued (and spilled) as above, but the
  session creations, rewards, ends and reads queued are answered with the error at once instead of waiting
  behind them, so their callers fail fast with a clear error.
- the database is damaged (`PoolCorrupt`): permanent, so the recorder stops as below (the calls spilled).
  `pool_problem` says what is wrong with the pool (None while writes succeed): the app's /health reads it.
- anything else (a bug, a refused token): the recorder stops loudly. The error is logged with its
  traceback, waiting callers get it, `failure` holds it, `has_capacity()` turns False (the app answers
  503) and the queued records stay unwritten (counted at close): an error is never retried as an outage.

With a spill file (stepline.gateway.spill), nothing acknowledged is lost: `record_call` returns a future that
resolves once the call is durable, committed by the pool or fsync'd in the spill file, and the app
answers the harness only then. An outage spills every pending call (and, while it lasts, each new
one as it arrives; a failure that stops the recorder spills them too); they stay queued and are retried; the file is truncated once they are all
in the pool, and read back (replayed first) at the next start. At shutdown a failing pool is not
waited for: the queue is already spilled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import zstandard
from typing_extensions import TypedDict, Unpack

from stepline.datapool.base import Pool, PoolCorrupt, PoolError, PoolFull, is_unavailable
from stepline.datapool.records import CallRecord, Reward, SessionInfo, prefix_check
from stepline.gateway.spill import Spill

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass
class _Item:
    kind: str  # "call" | "session" | "reward" | "end" | "abandon" | "flush" | "read"
    payload: Any
    done: Future[Any] | None = None  # set when the pool has committed it (a call: or when it is spilled)
    compress: bool = False  # a call whose request/response are still raw JSON: zstd them in the worker
    spilled: bool = False  # a call already in the spill file
    delta: Delta | None = None  # send the call as a delta of an earlier call (made in the worker)
    # once `payload` is the delta: the call in whole form (sent if the delta is refused), and whether its bodies are raw
    whole: tuple[CallRecord, bool] | None = None


@dataclass(frozen=True)
class Delta:
    """How a call extends an earlier recorded call of its session (docs/architecture.md, "Recording a turn as a
    delta"): sent as the ids after that call's first `prefix_len` (`CallRecord.parent`), and with its parent's raw
    request body, as the bytes of its own after their common prefix."""

    parent: int  # the earlier call's index
    prefix_len: int  # how many ids of its prompt + output the call's prompt starts with
    parent_request: bytes | None = None  # its raw request body (None: the call's body is sent whole)


class Tuning(TypedDict, total=False):
    """The recorder's knobs (defaults in `TUNING`)."""

    max_queue: int  # records queued before has_capacity() turns False (the app answers 503)
    batch_size: int  # calls per pool.add_calls
    flush_interval: float  # how long a partial batch of calls may wait for company, s
    max_backoff: float  # the longest wait between retries of an unavailable pool, s
    close_timeout: float  # how long aclose gives a failing pool before giving up, s


TUNING: Tuning = {"max_queue": 10_000, "batch_size": 256, "flush_interval": 0.02, "max_backoff": 5.0,
                  "close_timeout": 60.0}


class Recorder:
    def __init__(self, pool: Pool, spill: Spill | None = None, **tuning: Unpack[Tuning]) -> None:
        knobs: Tuning = {**TUNING, **tuning}
        self.pool = pool
        self.spill = spill
        self.max_queue = knobs["max_queue"]
        self.batch_size = knobs["batch_size"]
        self.flush_interval = knobs["flush_interval"]
        self.max_backoff = knobs["max_backoff"]
        self.close_timeout = knobs["close_timeout"]
        # The event loop only ever puts into the inbox (a C-level queue: no Python lock to contend for
        # with the worker); the worker moves items to `_pending` and pops them once written.
        self._inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # None: wake up, we close
        self._pending: deque[_Item] = deque()  # worker only
        self._pending_controls = 0  # non-call items in _pending (worker only)
        self._spilled = 0  # spilled calls in _pending (worker only); 0: the spill file may be truncated
        self._closing = False
        self._deadline = 0.0
        self._thread: threading.Thread | None = None
        self._zstd = zstandard.ZstdCompressor(level=3)  # worker thread only (not thread-safe)
        self.written = 0  # calls committed
        self.dropped = 0  # calls the pool refused as invalid (each logged)
        self.pool_errors = 0  # failed writes (each retried)
        self.failure: BaseException | None = None  # what stopped the worker: not an outage (see above)
        self.replayed = 0  # calls read back from the spill file at start
        self.pool_problem: str | None = None  # what the last pool write failed with; None once one succeeds

    # --- lifecycle ---
    async def start(self) -> None:
        if self._thread is not None:  # already running (start may be called by the app and its runner)
            return
        if self.spill is not None:  # an earlier run's spilled calls go first, before anything new
            for record in self.spill.load():
                self._pending.append(_Item("call", record, spilled=True))
                self._spilled += 1
                self.replayed += 1
            if self.replayed:
                log.warning("replaying %d calls spilled by an earlier run from %s", self.replayed, self.spill.path)
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        """Write everything queued (giving a failing pool up to `close_timeout` s), then stop."""
        if self._thread is None:
            return
        self._deadline = time.monotonic() + self.close_timeout
        self._closing = True
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        if self.depth():
            log.error("recorder closed with %d records the pool never accepted", self.depth())
        if self.spill is not None:
            self.spill.close()

    # --- the app's side ---
    def depth(self) -> int:
        """Records queued and not yet committed."""
        return self._inbox.qsize() + len(self._pending)

    def has_capacity(self) -> bool:
        return self.failure is None and self.depth() < self.max_queue

    def record_call(self, record: CallRecord, compress: bool = False, delta: Delta | None = None) -> Future[None] | None:
        """Queue a call record; never blocks (check `has_capacity()` before dispatching). With a spill
        file, returns a future set once the call is durable (in the pool or the spill file): answer the
        harness after it.

        compress=True: `record.request` / `record.response` are raw JSON bytes, and the worker thread
        zstd-compresses them (as `CallRecord` stores them) off the event loop. delta: the worker sends the (whole)
        record as a delta of an earlier call, and whole if the pool refuses that (its parent lost or refused)."""
        done: Future[None] | None = None if self.spill is None else Future()
        self._inbox.put(_Item("call", record, done, compress=compress, delta=delta))
        return done

    async def create_session(self, info: SessionInfo) -> None:
        await self._submit("session", info)

    async def add_reward(self, reward: Reward) -> None:
        await self._submit("reward", reward)

    async def end_session(self, session_id: str, status: str) -> None:
        await self._submit("end", (session_id, status))

    async def abandon_idle(self, idle_seconds: float, keep: list[str] | None = None) -> None:
        """End as abandoned the pool's open sessions older than idle_seconds but those in `keep` (ordered
        after every record queued before, so none of their calls is still on its way)."""
        await self._submit("abandon", (idle_seconds, keep or []))

    async def flush(self) -> None:
        """Wait until every record queued before this call is in the pool."""
        await self._submit("flush", None)

    async def read(self, fn: Callable[[Pool], R]) -> R:
        """`fn(pool)` on the worker thread, after every record queued before it is written (so it reads
        them); what it raises (a `PoolError`: an unknown session) reaches the caller, an outage is retried."""
        return await self._submit("read", fn)

    async def _submit(self, kind: str, payload: Any) -> Any:
        if self._thread is None:
            raise RuntimeError("Recorder.start() was not called (or it is closed)")
        if self.failure is not None:
            raise RuntimeError(f"the recorder stopped: {self.failure!r}") from self.failure
        done: Future[Any] = Future()
        self._inbox.put(_Item(kind, payload, done))
        return await asyncio.wrap_future(done)

    # --- the worker thread ---
    def _run(self) -> None:
        backoff = 0.0
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            try:
                self._write(batch)
            except Exception as exc:
                self.pool_problem = f"{type(exc).__name__}: {exc}"
                if not is_unavailable(exc):  # a bug or a refusal, not an outage: stop, loudly
                    self._fail(exc)
                    return
                if isinstance(exc, PoolFull):  # no end in sight: the callers waiting behind the calls are told
                    self._fail_controls(exc)
                self.pool_errors += 1  # the pool is down: keep the batch, back off, retry
                backoff = min(self.max_backoff, max(0.05, backoff * 2))
                log.warning("pool write failed (%r); %d records queued, retry in %.2f s", exc, self.depth(), backoff)
                self._spill_pending()
                if self._closing and (self.spill is not None or time.monotonic() > self._deadline):
                    self._give_up(exc)
                    return
                self._wait(backoff)
            else:
                backoff = 0.0
                if self.spill is not None and not self._spilled and self.spill.size():
                    self.spill.clear()  # every spilled call is in the pool

    def _wait(self, seconds: float) -> None:
        """Back off; with a spill file, spill each call arriving meanwhile (its harness is waiting)."""
        if self.spill is None:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if not self._take(self._inbox.get(timeout=remaining)):
                    return  # closing
            except queue.Empty:
                return
            self._spill_pending()

    def _spill_pending(self) -> None:
        """Append every pending call not yet spilled to the spill file (fsync'd); they become durable."""
        if self.spill is None:
            return
        items = [item for item in self._pending if item.kind == "call" and not item.spilled]
        if not items:
            return
        for item in items:
            _compress_item(self._zstd, item)
        try:
            self.spill.append([item.payload for item in items])
        except OSError as exc:  # the disk failed too: the harness gets its answer, and we say so
            log.error("cannot write the spill file %s (%r): %d calls only in memory", self.spill.path, exc, len(items))
            return
        for item in items:
            item.spilled = True
            _resolve(item.done, None)
        self._spilled += len(items)

    def _fail_controls(self, exc: Exception) -> None:
        """Answer every queued session creation, reward, end and read with `exc` (the calls stay queued)."""
        self._drain()
        controls = [item for item in self._pending if item.kind != "call"]
        if not controls:
            return
        self._pending = deque(item for item in self._pending if item.kind == "call")
        self._pending_controls = 0
        for item in controls:
            _resolve(item.done, exc)

    def _take(self, item: _Item | None) -> bool:
        """Move an inbox item to _pending; False for the close sentinel."""
        if item is None:
            return False
        self._pending.append(item)
        if item.kind != "call":
            self._pending_controls += 1
        return True

    def _next_batch(self) -> list[_Item] | None:
        """The items to write next (left pending until written): one control item, or up to
        `batch_size` consecutive calls. None once closing with nothing left."""
        if not self._pending and not self._closing:
            self._take(self._inbox.get())
        while True:  # everything already in the inbox
            try:
                self._take(self._inbox.get_nowait())
            except queue.Empty:
                break
        deadline = time.monotonic() + self.flush_interval
        # a partial batch of calls waits a little for company, unless something waits on it (with a spill
        # file every call's harness does; batches still form from what arrives during a write)
        while (
            self._pending and not self._pending_controls and not self._closing and self.spill is None
            and len(self._pending) < self.batch_size
        ):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self._take(self._inbox.get(timeout=remaining))
            except queue.Empty:
                break
        if not self._pending:
            return None if self._closing else []
        head = self._pending[0]
        if head.kind != "call":
            return [head]
        batch: list[_Item] = []
        for item in self._pending:
            if item.kind != "call" or len(batch) == self.batch_size:
                break
            batch.append(item)
        return batch

    def _pop(self, n: int) -> None:
        """Remove n written (or refused) items from the head of the pending queue."""
        for _ in range(n):
            item = self._pending.popleft()
            if item.kind != "call":
                self._pending_controls -= 1
                continue
            self._spilled -= item.spilled
            _resolve(item.done, None)

    def _write(self, batch: list[_Item]) -> None:
        """Write the batch, popping what the pool committed or refused; transient errors propagate
        with the unwritten items still queued."""
        head = batch[0]
        if head.kind == "call":
            for item in batch:
                _compress_item(self._zstd, item)
            self._write_calls(batch)
            return
        if head.kind == "read":
            self._read(head)
            return
        try:
            if head.kind == "session":
                self.pool.create_session(head.payload)
            elif head.kind == "reward":
                self.pool.add_reward(head.payload)
            elif head.kind == "end":
                self.pool.end_session(*head.payload)
            elif head.kind == "abandon":
                self.pool.abandon_idle(*head.payload)
        except PoolError as exc:  # refused (or the disk is full): the waiting caller gets the error
            if isinstance(exc, PoolCorrupt | PoolFull):
                self.pool_problem = f"{type(exc).__name__}: {exc}"
            self._pop(1)
            _resolve(head.done, exc)
        else:
            self.pool_problem = None
            self._pop(1)
            _resolve(head.done, None)

    def _read(self, head: _Item) -> None:
        try:
            result = head.payload(self.pool)
        except Exception as exc:
            if is_unavailable(exc):
                raise  # an outage: retried like a write
            self._pop(1)
            _resolve(head.done, exc)  # the reader's own failure, handed to it; the recorder goes on
            return
        self._pop(1)
        if head.done is not None and not head.done.done():
            head.done.set_result(result)

    def _write_calls(self, items: list[_Item]) -> None:
        try:
            self.pool.add_calls([item.payload for item in items])
        except PoolError as exc:
            if isinstance(exc, PoolCorrupt) or is_unavailable(exc):
                raise  # not a refusal of these records: an outage, or a damaged pool
            if len(items) == 1:
                self._refuse(items[0], exc)
                return
        else:
            self._pop(len(items))
            self._count_written(len(items))
            return
        # one bad record fails the whole (atomic) batch: write one by one to keep the good ones
        for item in items:
            self._write_calls([item])

    def _refuse(self, item: _Item, exc: PoolError) -> None:
        """A refused delta goes again with its whole prompt (its parent may be what the pool refused, or lost);
        any other refused call is dropped, counted and logged."""
        record = item.payload
        if item.whole is not None:
            log.warning("pool refused call %s/%d as a delta (%s); sending it whole", record.session_id,
                        record.call_index, exc)
            (item.payload, item.compress), item.whole = item.whole, None
            _compress_item(self._zstd, item)
            self._write_calls([item])
            return
        self._pop(1)
        self.dropped += 1
        log.error("pool refused call %s/%d as invalid (%s); not recorded", record.session_id, record.call_index, exc)

    def _count_written(self, n: int) -> None:
        self.written += n
        self.pool_problem = None

    def _fail(self, exc: Exception) -> None:
        self.failure = exc
        self._drain()
        self._spill_pending()  # the acknowledged calls wait in the spill file for a fixed gateway
        calls = sum(1 for item in self._pending if item.kind == "call")
        log.error("recorder stopped: the pool raised %r, which is no outage; %d call records NOT written",
                  exc, calls, exc_info=exc)
        for item in self._pending:
            _resolve(item.done, exc)

    def _drain(self) -> None:
        while True:
            try:
                self._take(self._inbox.get_nowait())
            except queue.Empty:
                break

    def _give_up(self, exc: Exception) -> None:
        self._drain()
        self._spill_pending()
        lost = list(self._pending)
        spilled = sum(1 for item in lost if item.spilled)
        calls = sum(1 for item in lost if item.kind == "call") - spilled
        if spilled:
            log.warning("pool unavailable at shutdown (%r): %d calls kept in the spill file %s, written at the "
                        "next start", exc, spilled, self.spill.path if self.spill else None)
        if calls:
            log.error("pool unavailable at shutdown (%r): %d call records NOT written", exc, calls)
        for item in lost:
            _resolve(item.done, exc)


def _compress_item(zstd: zstandard.ZstdCompressor, item: _Item) -> None:
    """zstd a call's raw request/answer once (a batch retried after an outage is already compressed); a call
    that extends an earlier one becomes its delta (the whole record kept aside)."""
    if item.delta is not None:
        item.whole = (item.payload, item.compress)
        item.payload = _delta_record(zstd, item.payload, item.delta, item.compress)
        item.delta, item.compress = None, False
    if item.compress:
        item.payload.request = _compress(zstd, item.payload.request)
        item.payload.response = _compress(zstd, item.payload.response)
        item.compress = False


def _delta_record(zstd: zstandard.ZstdCompressor, record: CallRecord, delta: Delta, raw: bool) -> CallRecord:
    """`record` as a delta of call `delta.parent`: the ids after its first `prefix_len`, and (raw request
    bodies only) the body's bytes after those it shares with the parent's; raw bodies compressed."""
    request, response, skip = record.request, record.response, 0
    if raw:
        if request is not None and delta.parent_request is not None:
            skip = common_prefix_len(delta.parent_request, request)
            request = request[skip:]
        request, response = _compress(zstd, request), _compress(zstd, response)
    prompt = record.prompt_ids
    return replace(record, prompt_ids=prompt[delta.prefix_len:], parent=delta.parent, prefix_len=delta.prefix_len,
                   prefix_check=prefix_check(prompt[: delta.prefix_len]), request=request, response=response,
                   request_prefix=skip)


def common_prefix_len(a: bytes, b: bytes, chunk: int = 1 << 16) -> int:
    """How many leading bytes `a` and `b` share: whole chunks compared as bytes (memcmp), then the first
    differing chunk byte by byte (numpy)."""
    n, at = min(len(a), len(b)), 0
    while at < n and a[at: min(at + chunk, n)] == b[at: min(at + chunk, n)]:
        at += chunk
    if at >= n:
        return n
    end = min(at + chunk, n)
    differ = np.frombuffer(a, np.uint8, end - at, at) != np.frombuffer(b, np.uint8, end - at, at)
    return at + int(np.argmax(differ))


def _compress(zstd: zstandard.ZstdCompressor, data: bytes | None) -> bytes | None:
    return None if data is None else zstd.compress(data)


def _resolve(done: Future[Any] | None, exc: BaseException | None) -> None:
    if done is None or done.done():  # done: the waiting caller gave up (cancelled)
        return
    if exc is None:
        done.set_result(None)
    else:
        done.set_exception(exc)
