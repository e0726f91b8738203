"""The tokenizer processes: the same ids as the gateway's own tokenizer, never used from the event loop's thread,
and gone with the pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from gateway_helpers import tokenizer

from stepline.gateway.tokenizing import TokenizerPool, encode_here


def test_a_worker_process_gives_the_ids_the_tokenizer_gives_here(qwen3_model_dir: Path) -> None:
    tok = tokenizer(qwen3_model_dir)
    text = "<|im_start|>user\nHéllo, wörld: 12345 \U0001f600 " * 400 + "<|im_end|>\n"
    pool = TokenizerPool(str(qwen3_model_dir / "tokenizer.json"), 1, 1000)
    try:
        assert pool.wants(text) and not pool.wants("short")
        ids = pool.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == tok.encode(text, add_special_tokens=False).ids
        assert pool.encode("again " * 300).tolist() == encode_here(tok, "again " * 300).tolist()  # the same worker
        [worker] = [w for w in list(pool._idle.queue) if w is not None]
    finally:
        pool.close()
    assert worker.proc.wait(10) == 0  # ended with the pool


async def test_the_event_loops_thread_never_waits_on_the_pool(qwen3_model_dir: Path) -> None:
    pool = TokenizerPool(str(qwen3_model_dir / "tokenizer.json"), 1, 10)
    try:
        assert not pool.wants("a long enough text")  # on the loop: tokenized here, never queued behind others
        assert await asyncio.to_thread(pool.wants, "a long enough text")
    finally:
        pool.close()
