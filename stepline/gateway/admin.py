"""Admin endpoints: `POST /admin/update_weights` and `GET /admin/weights`, behind the admin token.

With no admin token configured the endpoints are open (a local, single-user setup); `stepline
gateway` warns about it at start. The key is read as on every route (`stepline.gateway.sessions.bearer_key`), and
errors are answered in the OpenAI format by the app's error boundary, as on the session routes.
"""

from __future__ import annotations

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepline.gateway.engines import EngineError, EngineRejected
from stepline.gateway.fleet import UpdateRefused, WeightGate
from stepline.gateway.frontends.errors import ApiError, from_validation
from stepline.gateway.sessions import admin_allowed, bearer_key


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1, description="checkpoint directory every engine can read")
    version: int = Field(ge=0, description="the new weight version; must be newer than the serving one")


def admin_routes(gate: WeightGate, admin_token: str | None) -> list[web.RouteDef]:
    """The routes; their errors are `ApiError`s, answered by the app's error boundary (stepline.gateway.frontends.routes)."""

    def check(request: web.Request) -> None:
        if not admin_allowed(bearer_key(request.headers), admin_token):
            raise ApiError(401, "admin endpoints need the admin token (Authorization: Bearer <token>)")

    async def update_weights(request: web.Request) -> web.Response:
        check(request)
        try:
            body = UpdateWeightsRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            raise from_validation(exc) from None
        try:
            version = await gate.update_weights(body.path, body.version)
        except UpdateRefused as exc:
            raise ApiError(409, str(exc), code="update_refused") from None
        except EngineRejected as exc:  # the engines refused this path: no such folder, or not this model's
            raise ApiError(400, f"path {body.path!r} was refused, version {gate.version} keeps serving: {exc}",
                           param="path", code="invalid_checkpoint") from None
        except EngineError as exc:
            raise ApiError(502, f"weight update failed, version {gate.version} keeps serving: {exc}",
                           code="engine_error") from None
        return web.Response(body=orjson.dumps({"weight_version": version}), content_type="application/json")

    async def weights(request: web.Request) -> web.Response:
        check(request)
        state = {
            "weight_version": gate.version,
            "path": gate.path,
            "updating": gate.updating,
            "in_flight": gate.in_flight,
            "last_error": gate.last_error,
        }
        return web.Response(body=orjson.dumps(state), content_type="application/json")

    return [web.post("/admin/update_weights", update_weights), web.get("/admin/weights", weights)]
