"""What the benchmarks that start services share: a free loopback port, and waiting for a service to answer."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_up(
    http: aiohttp.ClientSession, url: str, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Wait for `url`/health; stop with the process's exit code and its log's end if it exits or never answers."""
    for _ in range(1200):
        if proc is not None and proc.poll() is not None:
            break
        try:
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    exited = f" (exited with code {proc.returncode})" if proc is not None and proc.poll() is not None else ""
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise SystemExit(f"{url} did not come up{exited}\n{tail}")
