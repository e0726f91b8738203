"""Admin HTTP endpoints over real loopback HTTP: auth, validation, success and failure answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fakes.engine import FakeEngine

from stepline.gateway.admin import admin_routes
from stepline.gateway.engines import make_engine
from stepline.gateway.fleet import EngineRouter, WeightGate
from stepline.gateway.frontends.routes import error_boundary

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def setup() -> AsyncIterator[tuple[TestClient, FakeEngine, WeightGate]]:
    fake = FakeEngine()
    async with fake as url, aiohttp.ClientSession() as http:
        gate = WeightGate(EngineRouter([make_engine(url, "sglang", http, 5)]))
        boundary = error_boundary(lambda api, status: None, lambda path: "openai", lambda path: "other")
        app = web.Application(middlewares=[boundary])  # the app's: admin errors answer as every route's
        app.add_routes(admin_routes(gate, TOKEN))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield client, fake, gate


async def test_update_weights_with_the_admin_token(setup) -> None:
    client, fake, gate = setup
    resp = await client.post("/admin/update_weights", json={"path": "/ckpt/1", "version": 1}, headers=AUTH)
    assert (resp.status, await resp.json()) == (200, {"weight_version": 1})
    assert fake.weight_version == 1 and gate.version == 1
    resp = await client.get("/admin/weights", headers={"x-api-key": TOKEN})
    assert (await resp.json())["weight_version"] == 1


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": "Bearer "}, {"x-api-key": ""}])
async def test_without_the_token_401(setup, headers) -> None:
    client, fake, gate = setup
    resp = await client.post("/admin/update_weights", json={"path": "/ckpt/1", "version": 1}, headers=headers)
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    assert gate.version == 0 and fake.requests == []


@pytest.mark.parametrize(
    "body,where",
    [
        (b"{not json", "body"),
        (b'{"path": "/x"}', "version"),
        (b'{"path": "/x", "version": "2"}', "version"),
        (b'{"path": "", "version": 2}', "path"),
        (b'{"path": "/x", "version": -1}', "version"),
        (b'{"path": "/x", "version": 2, "extra": 1}', "extra"),
        (b"[]", "body"),
    ],
)
async def test_bad_bodies_400_naming_the_field(setup, body, where) -> None:
    client, fake, gate = setup
    resp = await client.post("/admin/update_weights", data=body, headers=AUTH)
    assert resp.status == 400
    assert where in (await resp.json())["error"]["message"]
    assert gate.version == 0


async def test_not_newer_version_409_and_a_refused_path_400_naming_it(setup) -> None:
    client, fake, gate = setup
    resp = await client.post("/admin/update_weights", json={"path": "/x", "version": 0}, headers=AUTH)
    assert resp.status == 409
    assert (await resp.json())["error"] == {  # the OpenAI format every other route answers in
        "message": "version 0 is not newer than the serving version 0", "type": "conflict_error", "param": None,
        "code": "update_refused"}
    fake.fail_updates = 1  # the engine answers 400 {"success": false}, as the built-in engine does for a bad folder
    resp = await client.post("/admin/update_weights", json={"path": "/bad", "version": 1}, headers=AUTH)
    assert resp.status == 400  # an admin's mistake, not an engine failure (it was 502)
    error = (await resp.json())["error"]
    assert "version 0 keeps serving" in error["message"] and "cannot load /bad" in error["message"]
    assert (error["param"], error["code"]) == ("path", "invalid_checkpoint")
    assert gate.version == 0
