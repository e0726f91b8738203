"""Helpers for the engine tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import httpx
import orjson


def sse_chunks(client: httpx.Client, body: dict) -> list[dict]:
    """POST a streaming /generate and return its parsed chunks (the [DONE] sentinel checked and dropped)."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
