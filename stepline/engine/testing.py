"""Run the engine in a background thread for tests: `with running_engine(model_dir) as url: ...`."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from stepline.engine.limits import HeaderTimeoutH11
from stepline.engine.server import DEFAULT_PREFIX_CACHE_MB, create_app

__all__ = ["running_engine"]


@contextmanager
def running_engine(model_dir: Path | str, *, incremental_streaming: bool = False, max_running: int = 64,
                   context_length: int | None = None, weight_version: str = "0",
                   prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, dtype: str = "float32",
                   startup_timeout: float = 60.0, **limits) -> Iterator[str]:
    """Serve `model_dir` on a free 127.0.0.1 port; yield its base URL ("http://127.0.0.1:PORT").

    The server and its scheduler thread stop when the block exits. `limits`: create_app's
    control_token, max_body_bytes, read_timeout.
    """
    app = create_app(model_dir, incremental_streaming=incremental_streaming, max_running=max_running,
                     context_length=context_length, weight_version=weight_version, prefix_cache_mb=prefix_cache_mb,
                     dtype=dtype, **limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           http=HeaderTimeoutH11.with_timeout(limits.get("read_timeout", 30.0))))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="stepline-engine", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the engine did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
