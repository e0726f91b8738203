"""The engine's scheduler: one thread that owns the model and runs continuous batching.

Each loop iteration: take new sequences and control commands from the inbox; admit waiting
sequences (each prefilled alone, then copied into a free row of the batch's KV store, kv.py); run one
batched decode step for every running sequence; retire the finished ones. Control commands (pause,
weight swap, abort) are functions run on this thread between steps, so no lock guards the model.

Every sequence owns its torch.Generator (seeded from sampling_seed), so its samples do not depend
on which other sequences share its batch.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from stepline.engine.kv import BatchCache, KVShape
from stepline.engine.prefix_cache import PrefixCache
from stepline.engine.protocol import SequenceSpec
from stepline.engine.sampling import sample_batch

__all__ = ["Scheduler", "Sequence"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    """A sequence in flight. Written only by the scheduler thread; `notify()` is thread-safe."""

    spec: SequenceSpec
    notify: Callable[[int], None]  # notify(tokens so far): after each token (streaming), once when finished
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    stop_text_at: int | None = None  # where `text` is cut for a matched stop string
    generator: torch.Generator | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at first admission
    kv_epoch: int = -1  # the scheduler's weight epoch when this sequence's K/V started

    @property
    def kv_ids(self) -> list[int]:
        """The ids whose K/V the sequence's cache row holds: the last sampled token is not fed yet."""
        return self.spec.prompt_ids + self.output_ids[:-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, model, tokenizer, eos_token_ids: list[int], weight_version: str = "0",
                 max_running: int = 64, prefix_cache_bytes: int = 0) -> None:
        self.kv_shape = KVShape.of(model)  # a weight update keeps it (same architecture and dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.weight_version = weight_version
        self.max_running = max_running
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._epoch = 0  # bumped by each weight swap: K/V started under older weights is never cached
        self.paused = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._kv: BatchCache | None = None
        self._admitting: Sequence | None = None  # between the waiting queue and the batch
        self._unnotified: list[Sequence] = []  # finished, their clients not told yet (see _notify_finished)
        self._thread = threading.Thread(target=self._loop, name="stepline-engine-scheduler", daemon=True)
        self._stopping = False

    # ---- thread-safe API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.call(self._shutdown).result(timeout=30)
        self._thread.join(timeout=30)

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(seq)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the scheduler thread between two steps; the future holds its result."""
        future: Future = Future()
        self._inbox.put((fn, future))
        return future

    def abort(self, rid: str | None, message: str = "Aborted by request.") -> int:
        """Abort the sequences of request `rid` (all when None); call on the scheduler thread."""
        victims = [s for s in [*self._waiting, *self._running]
                   if rid is None or s.spec.rid == rid or s.spec.rid.startswith(f"{rid}-")]
        for seq in victims:
            self._finish(seq, {"type": "abort", "message": message})
        self._waiting = deque(s for s in self._waiting if not s.finished)
        self._retire()
        return len(victims)

    def retract(self) -> None:
        """Put running sequences back in the queue; their KV cache is recomputed on admission.

        Their K/V goes to the prefix cache first: resumed under the same weights, admission copies it
        back instead of recomputing; a weight swap in between flushes it.
        """
        for row, seq in enumerate(self._running):
            self._keep(seq, row)
        self._waiting.extendleft(reversed(self._running))
        self._running, self._kv = [], None

    def swap_model(self, model, weight_version: str) -> None:
        """Serve new weights from the next step on; call on the scheduler thread. The prefix cache is
        flushed (its K/V belongs to the old weights) and sequences already running are never cached."""
        self.model, self.weight_version = model.eval(), weight_version
        self._epoch += 1
        self.prefix_cache.clear()

    @property
    def load(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    @property
    def kv_store_bytes(self) -> int:
        """Memory of the running batch's K/V store (0 when idle); safe to read from any thread."""
        kv = self._kv
        return 0 if kv is None else kv.nbytes

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping:
            idle = self.paused or not (self._running or self._waiting)
            self._drain(block=idle)
            if self.paused or self._stopping:
                continue
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._running:
                        self._decode()
            except Exception as exc:  # a failing step must not hang its clients: fail them, keep serving
                log.exception("engine step failed")
                if self._admitting is not None:
                    self._finish(self._admitting, {"type": "abort", "message": f"engine step failed: {exc!r}"})
                self._kv = None  # mid-step state: nothing of it goes to the prefix cache
                self.abort(None, f"engine step failed: {exc!r}")
                self._running = []
            self._admitting = None
            self._notify_finished()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Sequence):
                self._waiting.append(item)
            else:
                fn, future = item
                try:
                    result = fn()
                    self._notify_finished()
                    future.set_result(result)
                except Exception as exc:
                    self._notify_finished()
                    future.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        self.abort(None, "engine shutting down")
        self._stopping = True

    # ---- admission and decoding ------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            seq = self._admitting = self._waiting.popleft()
            first = not seq.output_ids
            if first:
                seq.weight_version = self.weight_version
                seed = seq.spec.seed if seq.spec.seed is not None else random.getrandbits(63)
                try:
                    seq.generator = torch.Generator().manual_seed(seed)
                except (RuntimeError, OverflowError) as exc:  # this request's seed: fail it alone
                    self._finish(seq, {"type": "abort", "message": f"bad sampling seed {seed}: {exc}"})
                    continue
                if seq.spec.params.max_new_tokens == 0:
                    self._finish(seq, {"type": "length", "length": 0})
                    continue
            kv = self._prefill(seq, first)
            if seq.finished:
                continue
            if self._kv is None:
                self._kv = kv
            else:
                self._kv.add(kv)
            self._running.append(seq)

    def _prefill(self, seq: Sequence, first: bool) -> BatchCache:
        """Prefill one sequence alone (no padding inside the forward) and sample its first token.

        The longest prefix found in the prefix cache is copied instead of computed; only the rest
        (at least the last token, whose logits are sampled from) goes through the model.
        A retracted sequence re-reads its own sampled tokens except the last, which decode feeds.
        """
        ids = seq.kv_ids
        cached, prefix = self.prefix_cache.match(ids)
        if first:
            seq.cached_tokens = cached
        seq.kv_epoch = self._epoch
        kv = BatchCache.single(self.kv_shape, prefix, room=len(ids) - cached + 1)
        logits = kv.forward(self.model, torch.tensor([ids[cached:]]))
        # The prompt's K/V is final now: cached at once, the next sample of the same prompt (n > 1) or the
        # next episode with the same system prompt reuses it before this sequence finishes.
        self._keep(seq, 0, kv)
        if first:
            self._sample([seq], logits)
        return kv

    def _decode(self) -> None:
        assert self._kv is not None
        logits = self._kv.forward(self.model, torch.tensor([[s.output_ids[-1]] for s in self._running]))
        self._sample(self._running, logits)
        self._retire()

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample the next token of each sequence from its logits row ([B, V]) and append it."""
        params = [s.spec.params for s in seqs]
        # One uniform draw per sampled sequence from its own generator: batch-mates cannot shift it.
        u = [float(torch.rand((), generator=s.generator)) if p.temperature > 0 else 0.0 for s, p in zip(seqs, params)]
        tokens, logprobs = sample_batch(
            logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]), torch.tensor(u),
        )
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            self._append(seq, token, logprob)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.logprobs.append(logprob)  # before the id: readers take len(output_ids) tokens, lock-free
        seq.output_ids.append(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        elif seq.stream:
            seq.notify(len(seq.output_ids))

    def _stop_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        p = seq.spec.params
        if token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop_strings() if s in text]
            if hits:
                at, matched = min(hits)
                seq.stop_text_at = at + (len(matched) if p.no_stop_trim else 0)
                return {"type": "stop", "matched": matched}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        if not seq.finished:
            seq.finish_reason = reason
            self._unnotified.append(seq)

    def _notify_finished(self) -> None:
        """Tell the clients of finished sequences, once the step or control call that finished them is
        over: by then their K/V is in the prefix cache, so a client's next turn (or a look at
        /model_info) already finds it."""
        done, self._unnotified = self._unnotified, []
        for seq in done:
            seq.notify(len(seq.output_ids))

    def _keep(self, seq: Sequence, row: int, kv: BatchCache | None = None) -> None:
        """Offer the K/V of `seq` (row `row` of kv, default the batch's) to the prefix cache, unless it
        was (partly) computed under older weights."""
        kv = kv if kv is not None else self._kv
        if not self.prefix_cache.enabled or kv is None or seq.kv_epoch != self._epoch:
            return
        ids = seq.kv_ids
        assert kv.lengths[row] == len(ids), f"cache row holds {kv.lengths[row]} slots for {len(ids)} ids"
        self.prefix_cache.insert(ids, kv.row_kv(row))  # copies only what the cache lacks

    def _retire(self) -> None:
        done = [i for i, s in enumerate(self._running) if s.finished]
        if not done:
            return
        for row in done:
            self._keep(self._running[row], row)
        if len(done) == len(self._running) or self._kv is None:
            self._running, self._kv = [], None
            return
        self._running = [self._running[i] for i in self._kv.remove(done)]
