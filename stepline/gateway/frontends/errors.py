"""Errors of the gateway's front ends, each answered in its API's own format.

    ApiError           a 4xx/5xx answer: status, message, OpenAI type/param/code, optional Retry-After

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
"""

from __future__ import annotations

from typing import Literal

import orjson
from aiohttp import web
from pydantic import ValidationError

Flavour = Literal["openai", "anthropic"]

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 502: "api_error", 503: "service_unavailable", 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_validation(exc: ValidationError) -> ApiError:
    """A 400 naming the first offending field (pydantic's location, dotted)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return invalid(f"the body is not valid JSON: {first['msg']}")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return invalid("the body must be a JSON object")
    loc = ".".join(str(part) for part in first["loc"])
    return invalid(f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None)


def error_body(flavour: Flavour, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if flavour == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(flavour: Flavour, err: ApiError) -> web.Response:
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if err.retry_after is not None else None
    body = orjson.dumps(error_body(flavour, err.status, err.message, err.param, err.code))
    return web.Response(status=err.status, body=body, content_type="application/json", headers=headers)
