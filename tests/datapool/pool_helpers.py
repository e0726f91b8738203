"""Small builders shared by the pool tests."""

from __future__ import annotations

import numpy as np

from stepline.datapool.records import CallRecord, SessionInfo


def session(sid: str = "s1", task: str = "t1", harness: str = "h", group: str | None = None) -> SessionInfo:
    return SessionInfo(sid, task, harness, group)


def call(session_id: str, index: int, prompt, output, version: int = 0, **kw) -> CallRecord:
    return CallRecord(session_id, index, _ids(prompt), _ids(output),
                      np.full(len(output), -0.25 - index, np.float32), version, **kw)


def _ids(xs) -> np.ndarray:
    """int32 ids; int64 where a test needs an id int32 cannot hold."""
    a = np.array(xs, dtype=np.int64)
    return a.astype(np.int32) if a.size == 0 or a.max() < 2**31 else a


class ServiceThread:
    """The pool service on a free port, on its own event loop thread (for tests)."""

    def __init__(self, db_url: str, tokens=None) -> None:  # tokens: stepline.datapool.service.Tokens
        self.db_url = db_url
        self.tokens = tokens
        self.url = ""

    def __enter__(self) -> ServiceThread:
        import asyncio
        import threading

        from aiohttp import web

        from stepline.datapool import open_pool
        from stepline.datapool.service import make_app

        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start() -> None:
            self.pool = open_pool(self.db_url)  # the service's own (tests reach into its database)
            self.runner = web.AppRunner(make_app(self.pool, self.tokens), access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            started.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.create_task(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(30), "pool service did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
