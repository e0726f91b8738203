"""Run the engine in a background thread for tests: `with running_engine(model_dir) as url: ...`."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from stepline.engine.limits import HeaderTimeoutH11
from stepline.engine.options import EngineOptions
from stepline.engine.server import create_app

__all__ = ["running_engine"]


@contextmanager
def running_engine(model_dir: Path | str, *, startup_timeout: float = 60.0, **options: Any) -> Iterator[str]:
    """Serve `model_dir` on a free 127.0.0.1 port; yield its base URL ("http://127.0.0.1:PORT").

    The server and its scheduler thread stop when the block exits. `options`: fields of EngineOptions
    (an unknown name or a bad value is a ValueError).
    """
    engine = EngineOptions(**options)
    app = create_app(model_dir, engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           http=HeaderTimeoutH11.with_timeout(engine.read_timeout)))
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
