"""The dashboard's aiohttp application: a static page and a read-only JSON API.

    GET /health                   200 when serving (the only route open without the token)
    GET /                         the page (static/index.html; static/app.js draws it, no build step)
    GET /vendor/<file>            uPlot's script and stylesheet from the asset cache (stepline.assets)
    GET /api/info                 what is shown: run directory or pool, leaf rule, tokenizer, charts available
    GET /api/run                  the run view: charts, evaluations, phases, pool stats
    GET /api/sessions?…           a page of the episodes table (`SessionQuery`: paging, filters, sort)
    GET /api/sessions/<id>        one episode's tree of steps, decoded (?leaf_rule= overrides the job's)
    GET /api/groups?…             a page of the groups table (`GroupQuery`: one row per task × harness group)
    GET /api/groups/<key>         one group's episodes side by side with the advantages the trainer would compute

Errors are JSON {"error": {"type", "message"}}: 400 for a malformed query, 401 without the access
token, 404 for an unknown session or route, 503 (with Retry-After) while the pool cannot be read.
Only GET routes exist: nothing here writes the run directory or the pool.

The pool is used from one worker thread (the embedded pools hold one connection): a background task
refreshes the episodes index every `poll_s` seconds, which is also what keeps the page live.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast, get_args

from aiohttp import web
from pydantic import ValidationError

from stepline.dashboard.episode import Decoder, episode_view, load_decoder
from stepline.dashboard.groups import MAX_GROUP, GroupQuery, group_rows, group_view, select_groups, trainer_config
from stepline.dashboard.runfiles import RunFiles
from stepline.dashboard.runview import run_view
from stepline.dashboard.sessions import POOL_DOWN, SessionIndex, SessionQuery, facets, select
from stepline.datapool import open_pool
from stepline.datapool.base import UnknownSession
from stepline.datapool.records import LeafRule

__all__ = ["DashboardConfig", "make_app"]

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
VENDOR_FILES = ("uPlot.iife.min.js", "uPlot.min.css")
COOKIE = "stepline_dashboard"
RETRY_AFTER_S = "2"


@dataclass(frozen=True)
class DashboardConfig:
    """What the dashboard shows and how it guards it."""

    run_dir: Path | None = None  # a run directory (its pool.db, metrics, evaluations), or
    pool_url: str | None = None  # a pool alone (sqlite:///…, postgresql://…, http://… of `stepline pool serve`)
    tokenizer: Path | None = None  # a directory with tokenizer.json; default: the run's model
    leaf_rule: str | None = None  # which leaves train; default: the job's trainer.leaf_rule
    token: str | None = None  # access token; None: open (only ever on a loopback bind)
    poll_s: float = 2.0  # seconds between refreshes of the episodes index
    vendor_dir: Path | None = None  # uPlot's files (stepline.assets.uplot_dir); None: charts off


@dataclass
class _State:
    config: DashboardConfig
    run: RunFiles | None
    index: SessionIndex
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="dash"))
    decoder: Decoder | None = None
    decoder_loaded: bool = False
    task: asyncio.Task | None = None
    _verdicts: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})  # (rollouts.json mtime, by session)

    @property
    def leaf_rule(self) -> str:
        return self.config.leaf_rule or (self.run.leaf_rule() if self.run else "drop_superseded")

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """The rollout driver's verdict per session (rollouts.json, read again only when it changed)."""
        mtime = self.run.rollouts_mtime() if self.run else 0.0
        if mtime != self._verdicts[0]:
            rows = self.run.rollouts() if self.run else []
            self._verdicts = (mtime, {r["session_id"]: r for r in rows if isinstance(r, dict) and r.get("session_id")})
        return self._verdicts[1]

    def decode(self) -> Decoder | None:
        if not self.decoder_loaded:
            model = self.config.tokenizer or (self.run.model_dir() if self.run else None)
            self.decoder, self.decoder_loaded = load_decoder(model), model is not None
        return self.decoder

    async def in_pool_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)


STATE = web.AppKey("dashboard", _State)


def error(status: int, kind: str, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status, headers=headers)


def _token_middleware(token: str | None) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every route needs the token when one is set: as Bearer, as the cookie the page got, or as
    ?token= (the printed URL), which then sets the cookie so the page's own requests carry it."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if token is None or request.path == "/health":
            return await handler(request)
        auth = request.headers.get("Authorization", "")
        given = [auth[7:].strip() if auth[:7].lower() == "bearer " else "", request.cookies.get(COOKIE, ""),
                 request.query.get("token", "")]
        if not any(g and hmac.compare_digest(g.encode(), token.encode()) for g in given):
            return error(401, "Unauthorized", "this dashboard needs its access token: open the URL it printed "
                         "(…/?token=…) or send Authorization: Bearer <token>")
        response = await handler(request)
        if request.query.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    return check


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """aiohttp's own 404/405 as the API's JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, exc.reason.replace(" ", ""), exc.text or exc.reason)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def index_page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def vendor(request: web.Request) -> web.StreamResponse:
    name, folder = request.match_info["name"], request.app[STATE].config.vendor_dir
    if name not in VENDOR_FILES or folder is None or not (folder / name).is_file():
        return error(404, "NotFound", f"{name} is not available (python -m stepline.assets uplot fetches uPlot)")
    return web.FileResponse(folder / name)


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = state.config.tokenizer or (state.run.model_dir() if state.run else None)
    return web.json_response({
        "run_dir": str(state.run.root) if state.run else None,
        "pool": state.config.pool_url or (state.run.pool_url if state.run else None),
        "leaf_rule": state.leaf_rule, "tokenizer": str(model) if model else None,
        "charts": state.config.vendor_dir is not None, "poll_s": state.config.poll_s,
    })


def _indexing(state: _State) -> dict[str, Any]:
    return {"indexed": len(state.index.snapshot), "total": state.index.total, "error": state.index.error}


async def run(request: web.Request) -> web.Response:
    state = request.app[STATE]
    run_files = state.run

    def build() -> dict[str, Any]:
        metrics = run_files.metrics() if run_files else []
        evaluations = run_files.evaluations() if run_files else []
        view = run_view(metrics, state.index.snapshot, evaluations)
        return {**view, "phases": run_files.phases() if run_files else {}, "pool_stats": state.index.stats}

    return web.json_response({**await asyncio.to_thread(build), "index": _indexing(state)})


Query = TypeVar("Query", SessionQuery, GroupQuery)


class BadQuery(ValueError):
    """A query string that no model would take (a parameter given twice)."""


def _query(request: web.Request, model: type[Query]) -> Query:
    """The query string as `model`; a parameter given twice is refused rather than one copy silently kept."""
    keys = [k for k, _ in request.query.items() if k != "token"]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise BadQuery(f"{', '.join(twice)}: given more than once")
    return model.model_validate({k: request.query[k] for k in keys})


def _invalid(exc: ValidationError | BadQuery) -> web.Response:
    if isinstance(exc, BadQuery):
        return error(400, "InvalidQuery", str(exc))
    where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
    return error(400, "InvalidQuery", where)


async def sessions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        query = _query(request, SessionQuery)
    except (ValidationError, BadQuery) as exc:
        return _invalid(exc)
    rows = state.index.snapshot
    return web.json_response({**select(rows, query), "facets": facets(rows), "index": _indexing(state)})


async def groups(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        query = _query(request, GroupQuery)
    except (ValidationError, BadQuery) as exc:
        return _invalid(exc)
    rows = state.index.snapshot
    return web.json_response({**select_groups(group_rows(rows), query), "facets": facets(rows),
                              "index": _indexing(state)})


async def group(request: web.Request) -> web.Response:
    """The group's sessions are those of the episodes table with its key (the index: a session the
    pool holds but the index has not summarised yet appears on the next poll)."""
    state = request.app[STATE]
    key = request.match_info["group_key"]
    members = [r.session_id for r in state.index.snapshot if r.group_key == key]
    if not members:
        indexed = _indexing(state)
        return error(404, "UnknownGroup", f"no group {key!r} among the {indexed['indexed']} sessions indexed "
                                          f"(of {indexed['total']} in the pool)")
    if len(members) > MAX_GROUP:
        return error(400, "GroupTooLarge", f"group {key!r} has {len(members)} sessions; the group view shows at most "
                                           f"{MAX_GROUP} (the episodes table pages through them: ?group=)")
    job = state.run.job() if state.run else {}

    def build() -> dict[str, Any]:
        cfg, problem = trainer_config(job.get("trainer") or {})
        cfg = cfg.model_copy(update={"leaf_rule": state.leaf_rule})
        with state.index.lock:
            episodes = [state.index.pool().get_episode(s, cast(LeafRule, state.leaf_rule)) for s in members]
        view = group_view(key, episodes, cfg)
        view["settings"] = problem or ("the job's [trainer] table" if state.run else "trainer defaults (no run directory)")
        return view

    try:
        return web.json_response(await state.in_pool_thread(build))
    except UnknownSession as exc:  # removed between the index's listing and now
        return error(404, "UnknownSession", f"a session of group {key!r} is no longer in the pool: {exc}")
    except POOL_DOWN as exc:
        return error(503, "PoolUnavailable", f"the pool cannot be read now: {exc}", **{"Retry-After": RETRY_AFTER_S})


async def episode(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session_id = request.match_info["session_id"]
    rule = request.query.get("leaf_rule", state.leaf_rule)
    if rule not in get_args(LeafRule):
        return error(400, "InvalidQuery", f"leaf_rule: expected one of {list(get_args(LeafRule))}, got {rule!r}")

    def build() -> dict[str, Any]:
        with state.index.lock:
            ep = state.index.pool().get_episode(session_id, cast(LeafRule, rule))
        return episode_view(ep, cast(LeafRule, rule), state.decode())

    try:
        return web.json_response(await state.in_pool_thread(build))
    except UnknownSession:
        return error(404, "UnknownSession", f"no session {session_id!r} in the pool")
    except POOL_DOWN as exc:
        return error(503, "PoolUnavailable", f"the pool cannot be read now: {exc}", **{"Retry-After": RETRY_AFTER_S})


async def _refresh_forever(app: web.Application) -> None:
    state = app[STATE]
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await state.in_pool_thread(lambda: state.index.refresh(state.verdicts()))
        # a big pool's refresh takes a while (10k sessions: ~0.5 s to list them): wait at least three
        # times as long as it took, so the dashboard never keeps more than a quarter of a core busy
        await asyncio.sleep(max(state.config.poll_s, 3 * (loop.time() - started)))


async def _start(app: web.Application) -> None:
    app[STATE].task = asyncio.create_task(_refresh_forever(app))


async def _stop(app: web.Application) -> None:
    state = app[STATE]
    if state.task is not None:
        state.task.cancel()
        await asyncio.gather(state.task, return_exceptions=True)
    await state.in_pool_thread(state.index.close)
    state.executor.shutdown(wait=True)


def make_app(config: DashboardConfig) -> web.Application:
    """The application for `config` (exactly one of run_dir and pool_url, or a run_dir and a pool_url
    that overrides its pool.db)."""
    if config.run_dir is None and config.pool_url is None:
        raise ValueError("the dashboard needs a run directory or a pool URL")
    run_files = RunFiles(config.run_dir) if config.run_dir is not None else None
    pool_url = config.pool_url or (run_files.pool_url if run_files else "")
    index = SessionIndex(lambda: open_pool(pool_url, read_only=True))
    app = web.Application(middlewares=[_json_errors, _token_middleware(config.token)])
    app[STATE] = _State(config, run_files, index)
    app.router.add_get("/health", health)
    app.router.add_get("/", index_page)
    app.router.add_static("/static/", STATIC, show_index=False)
    app.router.add_get("/vendor/{name}", vendor)
    app.router.add_get("/api/info", info)
    app.router.add_get("/api/run", run)
    app.router.add_get("/api/sessions", sessions)
    app.router.add_get("/api/sessions/{session_id:.+}", episode)
    app.router.add_get("/api/groups", groups)
    app.router.add_get("/api/groups/{group_key:.+}", group)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app
