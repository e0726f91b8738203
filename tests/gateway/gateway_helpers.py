"""Shared helpers for the gateway's application tests: a served gateway over a FakeEngine or the
built-in engine, recording into a real SQLite pool, and ways to read back what got recorded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fakes.engine import FakeEngine, Scripted
from tokenizers import Tokenizer

from stepline.datapool import open_pool
from stepline.datapool.base import Pool
from stepline.gateway.cli import Gateway, running_gateway
from stepline.gateway.config import GatewaySettings

END = "<|im_end|>"


@dataclass
class Served:
    url: str
    gateway: Gateway
    pool: Pool

    async def session(self, task: str = "t", harness: str = "h", **extra: Any) -> dict:
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{self.url}/sessions", json={"task_id": task, "harness": harness, **extra},
                                  headers={"Authorization": "Bearer adm"})
        assert r.status_code == 201, r.text
        return r.json()

    async def flush(self) -> None:
        await self.gateway.recorder.flush()

    def calls(self, session_id: str) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, output ids) of each recorded call, in call-index order, rebuilt from the tree."""
        tree = self.pool.get_tree(session_id)
        nodes = {n.id: n for n in tree.nodes}
        out = []
        for index in sorted(tree.calls):
            end, action = tree.calls[index]
            path = []
            node = end
            while node != -1:
                path.append(nodes[node].tokens)
                node = nodes[node].parent
            prompt = np.concatenate(path[::-1]).tolist() if path else []
            output = np.concatenate([nodes[i].tokens for i in action]).tolist() if action else []
            out.append((prompt, output))
        return out


@asynccontextmanager
async def serve(model_dir: Path, engine_urls: list[str], tmp_path: Path, engine_timeout: float = 60.0,
                **settings: Any) -> AsyncIterator[Served]:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}?synchronous=normal")
    config = GatewaySettings(port=0, admin_token="adm", **settings)
    try:
        async with running_gateway(config, engine_urls, model_dir, pool, engine_timeout=engine_timeout) as gw:
            yield Served(gw.url, gw, pool)
    finally:
        pool.close()


def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def scripted(tok: Tokenizer, text: str, close: bool = True) -> Scripted:
    """The engine answers `text` (its real token ids), closed by <|im_end|> unless `close` is False."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return Scripted(ids + [tok.token_to_id(END)] if close else ids, text=text,
                    finish_reason="stop" if close else "length")


def fake_engine(tok: Tokenizer, texts: list[str], **kwargs: Any) -> FakeEngine:
    return FakeEngine([scripted(tok, t) for t in texts], eos_id=tok.token_to_id(END),
                      decode=lambda ids: tok.decode(ids, skip_special_tokens=False), **kwargs)


class ServedInThread:
    """A FakeEngine + gateway on their own event loop in a thread, for synchronous tests (hypothesis)."""

    def __init__(self, model_dir: Path, tmp_path: Path, **settings: Any) -> None:
        self.model_dir, self.tmp_path, self.settings = model_dir, tmp_path, settings
        self.ready = threading.Event()
        self.served: Served | None = None
        self.engine: FakeEngine | None = None

    def __enter__(self) -> ServedInThread:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()
        if not self.ready.wait(60):
            raise RuntimeError("the gateway did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)
        self.loop.close()

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        tok = tokenizer(self.model_dir)
        self.engine = FakeEngine(eos_id=tok.token_to_id(END), keep_requests=False,
                                 decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
        async with self.engine as url, serve(self.model_dir, [url], self.tmp_path, **self.settings) as served:
            self.served = served
            self.ready.set()
            await self.stop.wait()

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the gateway's loop (e.g. `served.flush()`)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)
