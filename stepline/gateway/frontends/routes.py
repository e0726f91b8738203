"""The app's middleware and the wrapper of its model routes.

    error_boundary(count, flavour, label)   every failure becomes an answer in the caller's API format
    model_route(handler, ledger, sessions)  a non-stream answer leaves only once its calls are durable, and the
                                            sessions it calls stay busy (never reaped) until it returns
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stepline.gateway.frontends.edge import CALLING
from stepline.gateway.frontends.errors import ApiError, Flavour, error_response
from stepline.gateway.frontends.ledger import UNSYNCED, Ledger
from stepline.gateway.sessions import Session, SessionStore

__all__ = ["Handler", "error_boundary", "model_route"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_boundary(count: Callable[[str, int], None], flavour: Callable[[str], Flavour],
                   label: Callable[[str], str]) -> Any:
    """The app's middleware: every failure becomes an answer in the caller's API format (`flavour` of
    the path), counted (`count(label of the path, status)`: the app's metrics); nothing escapes as a bare 500."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            count(label(request.path), err.status)
            return error_response(flavour(request.path), err)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            if exc.status < 400:
                raise
            count(label(request.path), exc.status)
            message = "the request body is too large" if exc.status == 413 else exc.reason
            return error_response(flavour(request.path), ApiError(exc.status, message))
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            count(label(request.path), 500)
            return error_response(flavour(request.path), ApiError(500, "internal gateway error (logged)"))

    return errors


def model_route(handler: Handler, ledger: Ledger, sessions: SessionStore) -> Handler:
    """A model API's route: a non-stream answer leaves only once its calls are durable."""

    async def route(request: web.Request) -> web.StreamResponse:
        calling: list[Session] = []
        unsynced_token, calling_token = UNSYNCED.set([]), CALLING.set(calling)
        try:
            response = await handler(request)
            await ledger.durable()
            return response
        finally:
            for session in calling:
                sessions.release(session)
            CALLING.reset(calling_token)
            UNSYNCED.reset(unsynced_token)

    return route
