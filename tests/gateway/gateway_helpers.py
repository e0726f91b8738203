"""Shared helpers for the gateway's application tests: a served gateway over a FakeEngine or the
built-in engine, recording into a real SQLite pool, and ways to read back what got recorded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tokenizers import Tokenizer

from datapool import open_pool
from datapool.base import Pool
from gateway.cli import Gateway, running_gateway
from gateway.config import GatewaySettings
from gateway.testing import FakeEngine, Scripted

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
async def serve(model_dir: Path, engine_urls: list[str], tmp_path: Path, **settings: Any) -> AsyncIterator[Served]:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    config = GatewaySettings(port=0, admin_token="adm", **settings)
    try:
        async with running_gateway(config, engine_urls, model_dir, pool) as gw:
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
