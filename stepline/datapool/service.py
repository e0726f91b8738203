"""The pool service: the `Pool` interface over HTTP with msgpack bodies (aiohttp).

Every method is `POST /v1/<method>` with a msgpack map of its arguments (records encoded by
`stepline.datapool.wire`); the answer is msgpack `{"result": …}` or `{"error": {"type", "message"}}`:

    400 InvalidRecord   the body is not msgpack / not the method's arguments (wrong types, an integer
                        the database cannot hold, a constraint the arguments break)
    401 Unauthorized    no token, or one without the method's right
    403 ReadOnlyPool    404 UnknownSession (or an unknown method)    422 InvalidRecord
    408 Timeout         the body took longer than `read_timeout` to arrive
    500 PoolError       503 Unavailable (the database itself failed: locked, I/O, connection lost; retry)

Rights (`Tokens`): `read` (sessions, trees, episodes, stats), `write` (the gateway: sessions, calls,
rewards, ends; and read), `claim` (the trainer: claim, consume, release groups; and read). A token is
sent as `Authorization: Bearer <token>`; with no tokens configured the service is open (warned).

Pool methods run one at a time on a worker thread (the embedded pools hold one connection); a call
returns only after its transaction committed, so an acknowledged write survives a kill -9.
`GET /health` answers 200 when the service is up.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from stepline.datapool import wire
from stepline.datapool.base import InvalidRecord, Pool, PoolCorrupt, PoolError, PoolFull, ReadOnlyPool, UnknownSession

log = logging.getLogger(__name__)
MAX_BODY = 512 * 2**20  # large add_calls batches are fine; the client splits bigger ones

STATUS = {InvalidRecord: 422, UnknownSession: 404, ReadOnlyPool: 403, PoolCorrupt: 500, PoolFull: 507}
READ_TIMEOUT = 60.0  # seconds a client may take to send one request (headers, then body)

WRITE = {"create_session", "add_calls", "add_reward", "end_session", "abandon_idle", "renew_leases"}
CLAIM = {"claim_groups", "mark_consumed", "release_groups"}
RIGHTS = {"read": frozenset(), "write": frozenset(WRITE), "claim": frozenset(CLAIM),
          "admin": frozenset(WRITE | CLAIM)}  # beyond reading, which every token may


@dataclass(frozen=True)
class Tokens:
    """The service's tokens by right; all None: open to anyone who can reach the port."""

    admin: str | None = None
    read: str | None = None
    write: str | None = None
    claim: str | None = None

    @classmethod
    def from_env(cls) -> Tokens:
        """STEPLINE_POOL_TOKEN (every right), STEPLINE_POOL_{READ,WRITE,CLAIM}_TOKEN."""
        get = os.environ.get
        return cls(get("STEPLINE_POOL_TOKEN"), get("STEPLINE_POOL_READ_TOKEN"), get("STEPLINE_POOL_WRITE_TOKEN"),
                   get("STEPLINE_POOL_CLAIM_TOKEN"))

    @property
    def open(self) -> bool:
        return not any((self.admin, self.read, self.write, self.claim))

    def allows(self, auth: str | None, method: str) -> bool:
        if self.open:
            return True
        given = (auth[7:].strip() if auth and auth[:7].lower() == "bearer " else "").encode()
        for right in ("admin", "read", "write", "claim"):
            token = getattr(self, right)
            if token and hmac.compare_digest(given, token.encode()):
                return method not in WRITE | CLAIM or method in RIGHTS[right]
        return False


def _methods(pool: Pool) -> dict[str, Callable[[dict], Any]]:
    """method name -> function of the decoded arguments; results go through `wire.to_wire`."""
    return {
        "create_session": lambda a: pool.create_session(wire.decode_session(a["info"])),
        "add_calls": lambda a: pool.add_calls([wire.decode_call(r) for r in a["records"]]),
        "add_reward": lambda a: pool.add_reward(wire.decode_reward(a["reward"])),
        "end_session": lambda a: pool.end_session(a["session_id"], a.get("status", "completed")),
        "abandon_idle": lambda a: pool.abandon_idle(a["idle_seconds"], _strings(a.get("keep", []))),
        "renew_leases": lambda a: pool.renew_leases(_strings(a["session_ids"]), float(a["seconds"])),
        "get_session": lambda a: pool.get_session(a["session_id"]),
        "list_sessions": lambda a: pool.list_sessions(a.get("status")),
        "get_tree": lambda a: pool.get_tree(a["session_id"]),
        "get_episode": lambda a: pool.get_episode(a["session_id"], a.get("leaf_rule", "drop_superseded")),
        "get_calls": lambda a: pool.get_calls(a["session_id"]),
        "stats": lambda a: pool.stats(),
        "claim_groups": lambda a: pool.claim_groups(
            a["consumer"], a["min_version"], a["max_groups"], a.get("group_size"),
            a.get("leaf_rule", "drop_superseded")),
        "mark_consumed": lambda a: pool.mark_consumed(list(a["group_ids"]), a["consumer"]),
        "release_groups": lambda a: pool.release_groups(list(a["group_ids"]), a["consumer"]),
        "claimed_groups": lambda a: pool.claimed_groups(a["consumer"]),
    }


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TypeError("expected a list of strings")
    return value


def _error(status: int, kind: str, message: str) -> web.Response:
    body = wire.packb({"error": {"type": kind, "message": message}})
    return web.Response(status=status, body=body, content_type="application/msgpack")


# The caller's fault whatever the database says: wrong types or shapes of arguments, an integer the
# database cannot hold (OverflowError), a constraint the arguments break. Never retried.
_CLIENT_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError, sqlite3.InterfaceError,
                  sqlite3.ProgrammingError, sqlite3.IntegrityError, sqlite3.DataError)


def _database_errors() -> tuple[type[BaseException], ...]:
    """The database itself failed (locked, disk I/O, connection lost): 503, worth a retry."""
    errors: list[type[BaseException]] = [sqlite3.OperationalError, sqlite3.DatabaseError]
    try:
        import psycopg

        errors.append(psycopg.OperationalError)
    except ImportError:  # pragma: no cover - psycopg is a dependency
        pass
    return tuple(errors)


def make_app(pool: Pool, tokens: Tokens | None = None) -> web.Application:
    """The aiohttp application serving `pool` (closed with the app); tokens: who may call what."""
    tokens = tokens or Tokens()
    methods = _methods(pool)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool")
    transient = _database_errors()
    problem: dict[str, str | None] = {"pool": None}  # the last operation's damage or full disk, None once one succeeds

    async def rpc(request: web.Request) -> web.Response:
        method = methods.get(request.match_info["method"])
        if method is None:
            return _error(404, "NotFound", f"unknown method {request.match_info['method']!r}")
        if not tokens.allows(request.headers.get("Authorization"), request.match_info["method"]):
            return _error(401, "Unauthorized", f"{request.match_info['method']} needs a pool token with that right")
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                raw = await request.read()
        except TimeoutError:
            return _error(408, "Timeout", f"the request body took longer than {READ_TIMEOUT:g} s")
        try:
            args = wire.unpackb(raw)
            if not isinstance(args, dict):
                raise TypeError("the body must be a msgpack map of arguments")
        except Exception as exc:  # any decoding failure is the caller's fault
            return _error(400, "InvalidRecord", f"bad request body: {exc}")
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, method, args)
        except PoolError as exc:
            if isinstance(exc, PoolCorrupt | PoolFull):
                problem["pool"] = f"{type(exc).__name__}: {exc}"
            return _error(STATUS.get(type(exc), 500), type(exc).__name__, str(exc))
        except _CLIENT_ERRORS as exc:
            return _error(400, "InvalidRecord", f"bad arguments for {request.match_info['method']}: {exc!r}")
        except transient as exc:
            log.warning("database error in %s: %s", request.match_info["method"], exc)
            return _error(503, "Unavailable", f"database error: {exc}")
        problem["pool"] = None
        return web.Response(body=wire.packb({"result": result}), content_type="application/msgpack")

    async def health(request: web.Request) -> web.Response:
        """`ok` until an operation finds the database damaged or full (`degraded`, 503, `pool` says which),
        and again once one succeeds."""
        if problem["pool"] is None:
            return web.json_response({"ok": True})
        return web.json_response({"ok": False, "status": "degraded", "pool": problem["pool"]}, status=503)

    async def close(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(executor, pool.close)
        executor.shutdown(wait=True)

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/{method}", rpc)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


async def serve(db_url: str, host: str = "127.0.0.1", port: int = 0, tokens: Tokens | None = None) -> None:
    """Open the pool and serve it until cancelled; prints the bound address (port 0 picks one).
    tokens: None reads them from the environment (`Tokens.from_env`)."""
    from stepline.datapool import open_pool

    tokens = tokens or Tokens.from_env()
    if tokens.open:
        log.warning("no pool tokens set: anyone who can reach the port may read, write and claim")
    pool = open_pool(db_url)
    runner = web.AppRunner(make_app(pool, tokens), access_log=None, keepalive_timeout=READ_TIMEOUT)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"stepline pool: serving {db_url} on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
