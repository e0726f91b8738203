"""Admin endpoints: `POST /admin/update_weights` and `GET /admin/weights`, behind the admin token.

With no admin token configured the endpoints are open (a local, single-user setup); `stepline
gateway` warns about it at start.
"""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.engines import EngineError
from gateway.fleet import UpdateRefused, WeightGate


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1, description="checkpoint directory every engine can read")
    version: int = Field(ge=0, description="the new weight version; must be newer than the serving one")


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return request.headers.get("x-api-key")


def is_admin(request: web.Request, admin_token: str | None) -> bool:
    if admin_token is None:
        return True
    token = bearer_token(request)
    return token is not None and hmac.compare_digest(token.encode(), admin_token.encode())


def admin_routes(gate: WeightGate, admin_token: str | None) -> list[web.RouteDef]:
    async def update_weights(request: web.Request) -> web.Response:
        if not is_admin(request, admin_token):
            return _error(
                401, "admin endpoints need the admin token (Authorization: Bearer <token>)", "authentication_error"
            )
        try:
            body = UpdateWeightsRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
            return _error(400, f"invalid update_weights request: {problems}", "invalid_request_error")
        try:
            version = await gate.update_weights(body.path, body.version)
        except UpdateRefused as exc:
            return _error(409, str(exc), "conflict")
        except EngineError as exc:
            return _error(502, f"weight update failed, version {gate.version} keeps serving: {exc}", "engine_error")
        return web.Response(body=orjson.dumps({"weight_version": version}), content_type="application/json")

    async def weights(request: web.Request) -> web.Response:
        if not is_admin(request, admin_token):
            return _error(
                401, "admin endpoints need the admin token (Authorization: Bearer <token>)", "authentication_error"
            )
        state = {
            "weight_version": gate.version,
            "path": gate.path,
            "updating": gate.updating,
            "in_flight": gate.in_flight,
            "last_error": gate.last_error,
        }
        return web.Response(body=orjson.dumps(state), content_type="application/json")

    return [web.post("/admin/update_weights", update_weights), web.get("/admin/weights", weights)]
