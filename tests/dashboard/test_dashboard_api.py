"""The dashboard's JSON API on a run-like directory (tests/dashboard/conftest.py): the episodes table's
paging and filters, an episode's tree equal to the pool's token for token, the run view's series, the
group view's advantages, the access token, and 4xx (never 500) for bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from stepline.dashboard.app import DashboardConfig, make_app
from stepline.dashboard.groups import group_view, trainer_config
from stepline.datapool import open_pool
from stepline.datapool.steps import select_leaves, superseded_leaves
from stepline.report import wilson


async def settled(client: TestClient, expect: int | None = None) -> dict:
    """The episodes index once it has summarised every session the pool lists (the refresh runs in the
    background, every poll_s)."""
    for _ in range(200):
        body = await (await client.get("/api/sessions?limit=1")).json()
        index = body["index"]
        if index["total"] and index["indexed"] == index["total"] and (expect is None or index["total"] == expect):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"the index never settled: {body['index']}")


@asynccontextmanager
async def dashboard(**config) -> AsyncIterator[TestClient]:
    app = make_app(DashboardConfig(poll_s=0.05, **config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def all_ids(client: TestClient, query: str = "") -> list[str]:
    body = await (await client.get(f"/api/sessions?limit=500&{query}")).json()
    return [r["session_id"] for r in body["rows"]]


async def test_paging_covers_every_session_once(run_fixture):
    async with dashboard(run_dir=run_fixture.root) as client:
        await settled(client)
        seen, offset = [], 0
        while True:
            page = await (await client.get(f"/api/sessions?limit=3&offset={offset}&sort=created&order=asc")).json()
            assert page["total"] == len(run_fixture.sessions) and len(page["rows"]) <= 3
            if not page["rows"]:
                break
            seen += [r["session_id"] for r in page["rows"]]
            offset += 3
        assert sorted(seen) == sorted(run_fixture.sessions) and len(seen) == len(set(seen))
        assert seen[0] == "s-lin-0"  # oldest first in ascending order of creation


async def test_filters_match_what_was_written(run_fixture):
    written = run_fixture.sessions
    async with dashboard(run_dir=run_fixture.root) as client:
        await settled(client)
        assert set(await all_ids(client, "harness=ui")) == {s for s, w in written.items() if w["harness"] == "ui"}
        assert await all_ids(client, "status=failed") == ["s-failed"]
        assert await all_ids(client, "split=eval") == ["eval::s-0"]
        assert await all_ids(client, "forked=true") == ["s-fork"]
        high = {s for s, w in written.items() if w["reward"] is not None and w["reward"] >= 1.0}
        assert set(await all_ids(client, "min_reward=1")) == high
        assert set(await all_ids(client, "q=timed+out")) == {"s-failed"}  # the driver's reason, from rollouts.json
        # s-lin-i samples at versions i .. i+turns-1 (2 turns when i is even, 3 when odd)
        assert set(await all_ids(client, "version=5&split=train")) == {"s-lin-3", "s-lin-4", "s-lin-5"}
        rewards = [r["reward"] for r in (await (await client.get("/api/sessions?sort=reward&order=desc&min_reward=0"))
                                         .json())["rows"]]
        assert rewards == sorted(rewards, reverse=True) and len(rewards) == sum(
            w["reward"] is not None for w in written.values())


async def test_rows_carry_turns_tokens_versions_and_reason(run_fixture):
    pool = open_pool(f"sqlite:///{run_fixture.root / 'pool.db'}", read_only=True)
    try:
        tree = pool.get_tree("s-fork")
    finally:
        pool.close()
    async with dashboard(run_dir=run_fixture.root) as client:
        await settled(client)
        rows = {r["session_id"]: r for r in (await (await client.get("/api/sessions?limit=500")).json())["rows"]}
    fork = rows["s-fork"]
    assert fork["turns"] == 4 and fork["leaves"] == 3 and (fork["min_version"], fork["max_version"]) == (1, 2)
    assert fork["tokens"] == sum(len(n.tokens) for n in tree.nodes)
    assert fork["action_tokens"] == sum(len(n.tokens) for n in tree.nodes if n.kind == "act")
    assert rows["s-failed"]["reason"] == "harness timed out after 30s" and rows["s-failed"]["success"] is False
    assert rows["s-open"]["status"] == "open" and rows["s-open"]["reward"] is None


async def test_episode_tree_equals_the_pool_token_for_token(run_fixture):
    tok = Tokenizer.from_file(str(run_fixture.tokenizer_dir / "tokenizer.json"))
    pool = open_pool(f"sqlite:///{run_fixture.root / 'pool.db'}", read_only=True)
    try:
        tree = pool.get_tree("s-fork")
    finally:
        pool.close()
    async with dashboard(run_dir=run_fixture.root) as client:
        ep = await (await client.get("/api/sessions/s-fork")).json()
    nodes = {n["id"]: n for n in ep["nodes"]}
    assert len(nodes) == len(tree.nodes) and ep["decoded"] and ep["leaf_rule"] == "drop_superseded"
    for node in tree.nodes:
        got = nodes[node.id]
        assert got["ids"] == node.tokens.tolist() and got["kind"] == node.kind and got["parent"] == node.parent
        assert got["text"] == tok.decode(node.tokens.tolist(), skip_special_tokens=False)
        if node.kind == "act":
            assert got["logprobs"] == pytest.approx(node.logprobs.tolist(), abs=0)
            assert got["version"] == node.weight_version
            assert "".join(got["pieces"]) == got["text"] and len(got["pieces"]) == len(got["ids"])
    forks = [n for n in ep["nodes"] if len(n["children"]) > 1]
    assert forks, "the forked session shows a node with two branches"
    leaves = {n["id"]: n["leaf"] for n in ep["nodes"] if "leaf" in n}
    assert {i for i, tag in leaves.items() if tag in ("main", "trains")} == set(select_leaves(tree, "drop_superseded"))
    assert {i for i, tag in leaves.items() if tag == "dead"} == superseded_leaves(tree) != set()
    step = [n for n in ep["nodes"] if n["kind"] == "act" and n["call"] == 0]
    assert step[0]["step_reward"] == 0.5 and ep["outcome"] == 1.0
    async with dashboard(run_dir=run_fixture.root) as client:
        everything = await (await client.get("/api/sessions/s-fork?leaf_rule=all")).json()
    assert all(n["trains"] for n in everything["nodes"] if "leaf" in n)


async def test_a_character_split_over_tokens_decodes_whole(run_fixture):
    async with dashboard(run_dir=run_fixture.root) as client:
        ep = await (await client.get("/api/sessions/s-lin-1")).json()
    for node in (n for n in ep["nodes"] if n["kind"] == "act"):
        assert "é" in node["text"] and "\ufffd" not in "".join(node["pieces"])


async def test_run_view_series(run_fixture):
    async with dashboard(run_dir=run_fixture.root) as client:
        await settled(client)
        run = await (await client.get("/api/run")).json()
    trainer = run["trainer"]
    assert run["updates"] == 3  # the half-written fourth line is left out
    assert trainer["loss"]["x"] == [1, 2, 3]
    assert trainer["loss"]["series"][0]["values"] == pytest.approx([0.1, 0.2, 0.3])
    assert [s["label"] for s in trainer["trained_reward"]["series"]] == ["search", "ui"]
    assert "value loss" not in [s["label"] for s in trainer["loss"]["series"]]  # never logged: no critic
    for key in ("kl", "entropy", "clip", "staleness", "trainer_tps"):
        assert any(v is not None for s in trainer[key]["series"] for v in s["values"])
    after = run["evaluations"][-1]
    assert [e["tag"] for e in run["evaluations"]] == ["before", "after-3"] and after["weight_version"] == 3
    assert after["harnesses"]["ui"]["ci95"] == pytest.approx(list(wilson(6, 8)))
    # every session ended before update 1: one window; training reward per harness = mean over the
    # rewarded train sessions: search s-lin-0 (1), s-lin-2 (0), s-lin-4 (0), s-fork (1) -> 0.5;
    # ui s-lin-1 (0), s-lin-3 (1), s-lin-5 (0) -> 1/3 (s-failed has no reward)
    pool = run["pool"]
    assert pool["reward"]["x"] == [1]
    reward = {s["label"]: s["values"][0] for s in pool["reward"]["series"]}
    assert reward == pytest.approx({"search": 0.5, "ui": 1 / 3})
    # success: rollouts.json's verdicts where given (s-lin-0 true, s-failed false), else reward >= 1
    success = {s["label"]: s["values"][0] for s in pool["success"]["series"]}
    assert success == pytest.approx({"search": 0.5, "ui": 1 / 4})
    assert pool["version"]["series"][0]["values"] == [7]  # s-lin-5: versions 5, 6, 7
    assert run["phases"] == {"model": 0.5, "sft": 12.0} and run["pool_stats"]["sessions"] == len(run_fixture.sessions)


async def test_a_pool_service_url_serves_the_same_table(run_fixture):
    from stepline.datapool.service import make_app as pool_app

    pool = open_pool(f"sqlite:///{run_fixture.root / 'pool.db'}", read_only=True)
    async with TestServer(pool_app(pool), host="127.0.0.1") as service:
        async with dashboard(pool_url=str(service.make_url("")).rstrip("/"),
                             tokenizer=run_fixture.root / "model-sft") as client:
            await settled(client)
            assert sorted(await all_ids(client)) == sorted(run_fixture.sessions)
            ep = await (await client.get("/api/sessions/s-fork")).json()
            assert ep["decoded"] and any(len(n["children"]) > 1 for n in ep["nodes"])
            run = await (await client.get("/api/run")).json()
            assert run["trainer"] == {} and run["evaluations"] == [] and run["pool"]["reward"]["x"]


@pytest.mark.parametrize("query", ["limit=0", "limit=abc", "limit=100000", "offset=-1", "sort=bogus", "order=up",
                                   "status=weird", "min_reward=high", "forked=maybe", "version=-2", "nonsense=1"])
async def test_malformed_queries_are_400_naming_the_parameter(run_fixture, query):
    async with dashboard(run_dir=run_fixture.root) as client:
        response = await client.get(f"/api/sessions?{query}")
        assert response.status == 400
        body = await response.json()
        assert body["error"]["type"] == "InvalidQuery" and query.split("=")[0] in body["error"]["message"]


async def test_unknown_session_route_and_leaf_rule_are_4xx(run_fixture):
    async with dashboard(run_dir=run_fixture.root) as client:
        missing = await client.get("/api/sessions/no-such-session")
        assert missing.status == 404 and (await missing.json())["error"]["type"] == "UnknownSession"
        assert (await client.get("/api/sessions/s-fork?leaf_rule=some")).status == 400
        assert (await client.get("/api/nothing-here")).status == 404
        assert (await client.post("/api/sessions")).status == 405  # read-only: no writing route exists
        assert (await client.get("/vendor/secret.txt")).status == 404
        assert (await client.get("/static/../conftest.py")).status in (403, 404)


async def test_a_run_without_a_pool_yet_is_an_empty_state_then_fills_in(tmp_path, run_fixture):
    import shutil

    root = tmp_path / "run"
    root.mkdir()
    async with dashboard(run_dir=root) as client:
        await asyncio.sleep(0.2)
        body = await (await client.get("/api/sessions")).json()
        assert body["total"] == 0 and body["rows"] == [] and body["index"]["error"]
        run = await client.get("/api/run")
        assert run.status == 200 and (await run.json())["pool"] == {}
        episode = await client.get("/api/sessions/s-fork")
        assert episode.status == 503 and episode.headers["Retry-After"]
        shutil.copy(run_fixture.root / "pool.db", root / "pool.db")  # the job starts writing its pool
        body = await settled(client)
        assert body["index"]["error"] is None and body["total"] == len(run_fixture.sessions)
        assert (await client.get("/api/sessions/s-fork")).status == 200


async def test_the_index_fills_in_within_its_budget(run_fixture):
    from stepline.dashboard.sessions import SessionIndex

    index = SessionIndex(lambda: open_pool(f"sqlite:///{run_fixture.root / 'pool.db'}", read_only=True))
    try:
        index.refresh(budget_s=0.0)  # stops after the first summary: a huge pool never blocks a refresh
        assert len(index.snapshot) == 1 and index.total == len(run_fixture.sessions)
        for _ in range(len(run_fixture.sessions)):
            index.refresh(budget_s=0.0)
        assert len(index.snapshot) == index.total
    finally:
        index.close()


async def test_the_token_guards_every_route(run_fixture):
    async with dashboard(run_dir=run_fixture.root, token="s3cret") as client:
        for path in ("/", "/static/app.js", "/api/info", "/api/run", "/api/sessions", "/api/sessions/s-fork",
                     "/api/groups", "/api/groups/t-fork::search"):
            assert (await client.get(path)).status == 401, path
            assert (await client.get(path, headers={"Authorization": "Bearer wrong"})).status == 401, path
        assert (await client.get("/api/info", headers={"Authorization": "Bearer s3cret"})).status == 200
        page = await client.get("/?token=s3cret")  # the printed URL; the page's own requests then carry the cookie
        assert page.status == 200 and "Stepline" in await page.text()
        assert (await client.get("/api/sessions/s-fork")).status == 200
        assert (await client.get("/api/sessions?token=s3cret&limit=2")).status == 200  # not a query parameter


def test_a_non_loopback_bind_prints_a_token_and_refuses_requests_without_it(run_fixture):
    import re
    import subprocess
    import sys

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "dashboard", str(run_fixture.root), "--host",
                             "0.0.0.0", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("stepline dashboard:"):
                break
        match = re.search(r"http://0\.0\.0\.0:(\d+)/\?token=(\S+)", line)
        assert match, line
        base = f"http://127.0.0.1:{match[1]}"
        assert httpx.get(f"{base}/api/info").status_code == 401
        info = httpx.get(f"{base}/api/info", headers={"Authorization": f"Bearer {match[2]}"})
        assert info.status_code == 200 and info.json()["run_dir"] == str(run_fixture.root)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_page_and_vendored_charts_are_served(tmp_path, run_fixture):
    async def check() -> None:
        vendor = tmp_path / "uplot"
        vendor.mkdir()
        (vendor / "uPlot.iife.min.js").write_text("var uPlot = function () {};")
        async with dashboard(run_dir=run_fixture.root, vendor_dir=vendor) as client:
            page = await (await client.get("/")).text()
            assert "/static/app.js" in page and "/vendor/uPlot.iife.min.js" in page
            assert (await client.get("/static/app.js")).status == 200
            assert await (await client.get("/vendor/uPlot.iife.min.js")).text() == "var uPlot = function () {};"
            assert (await (await client.get("/api/info")).json())["charts"] is True

    asyncio.run(check())


def test_no_cdn_on_the_page():
    static = Path(__file__).resolve().parents[2] / "stepline" / "dashboard" / "static"
    for path in static.iterdir():
        assert not any(cdn in path.read_text() for cdn in ("http://", "https://", "//cdn")), path


def test_sessions_list_nan_reward_filter_is_empty_not_an_error(run_fixture):
    async def check() -> None:
        async with dashboard(run_dir=run_fixture.root) as client:
            await settled(client)
            response = await client.get("/api/sessions?min_reward=nan")
            assert response.status == 200 and (await response.json())["total"] == 0

    asyncio.run(check())


def test_run_and_up_start_it_beside_them(tmp_path, run_fixture):
    import httpx

    from stepline.dashboard.cli import dashboard_beside

    with dashboard_beside(["--pool", f"sqlite:///{run_fixture.root / 'pool.db'}"], 0, tmp_path / "logs") as url:
        assert url is not None and url.startswith("http://127.0.0.1:")
        info = httpx.get(f"{url}api/info", timeout=10).json()  # loopback: no token needed
        assert info["pool"].endswith("pool.db") and info["run_dir"] is None
    try:
        httpx.get(f"{url}health", timeout=2)
        raise AssertionError("the dashboard outlived the command that started it")
    except httpx.TransportError:
        pass
    with dashboard_beside(["--pool", "sqlite:///x.db"], None, tmp_path / "logs") as nothing:
        assert nothing is None  # no --dashboard-port: no dashboard


# --- the group view (conftest.py `group_run`) ---

EPS = 1e-6  # GRPO's eps in the std's denominator


async def get_group(client, key: str) -> dict:
    response = await client.get(f"/api/groups/{key}")
    assert response.status == 200, await response.text()
    return await response.json()


async def test_grpo_advantages_of_a_group_by_hand(group_run):
    async with dashboard(run_dir=group_run) as client:
        await settled(client)
        view = await get_group(client, "g-var")
    assert (view["advantage"], view["task_id"], view["harness"], view["skip"]) == ("grpo", "t-g", "search", None)
    cards = {c["session_id"]: c for c in view["episodes"]}
    assert [c["reward"] for c in view["episodes"]] == [1.0, 0.0, 0.5]  # oldest session first
    # rewards 1, 0, 0.5: mean 0.5; unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5; A = (R - 0.5) / (0.5 + eps)
    expected = {"s-var-0": 0.5 / (0.5 + EPS), "s-var-1": -0.5 / (0.5 + EPS), "s-var-2": 0.0}
    for sid, adv in expected.items():
        assert [s["advantage"] for s in cards[sid]["steps"]] == pytest.approx([adv] * len(cards[sid]["steps"]))
    assert view["outcome_mean"] == pytest.approx(0.5) and view["outcome_std"] == pytest.approx(0.5)
    # one step per turn; the forked session trains two trajectories under drop_superseded (calls 0-1 and
    # 0-3; call 2 was retried by call 3), so call 0 has a row in each, with its dense reward 0.5
    assert len(cards["s-var-1"]["steps"]) == 2 and cards["s-var-1"]["trajectories"] == 1
    fork = cards["s-var-2"]
    assert fork["trajectories"] == 2 and sorted(s["call"] for s in fork["steps"]) == [0, 0, 1, 3]
    assert {s["step_reward"] for s in fork["steps"] if s["call"] == 0} == {0.5}
    assert all(c["left_out"] is None for c in view["episodes"])


async def test_a_group_without_variance_is_shown_as_the_trainer_skips_it(group_run):
    async with dashboard(run_dir=group_run) as client:
        await settled(client)
        view = await get_group(client, "g-same")
    assert view["skip"] == "no_variance"  # the job has dynamic_sampling = true
    assert [s["advantage"] for c in view["episodes"] for s in c["steps"]] == [0.0, 0.0]


async def test_an_open_session_is_left_out_of_its_group(group_run):
    async with dashboard(run_dir=group_run) as client:
        await settled(client)
        view = await get_group(client, "g-open")
    cards = {c["session_id"]: c for c in view["episodes"]}
    assert cards["s-open-1"]["left_out"].startswith("still open") and cards["s-open-1"]["steps"] == []
    # the ended one is a group of one: no baseline, advantage exactly 0
    assert cards["s-open-0"]["left_out"] is None and [s["advantage"] for s in cards["s-open-0"]["steps"]] == [0.0]


def test_rloo_and_a_critic_estimator_on_the_pool_episodes(group_run):
    pool = open_pool(f"sqlite:///{group_run / 'pool.db'}", read_only=True)
    try:
        episodes = [pool.get_episode(s) for s in ("s-var-0", "s-var-1", "s-var-2")]
    finally:
        pool.close()
    cfg, problem = trainer_config({"advantage": "rloo"})
    assert problem is None
    view = group_view("g-var", episodes, cfg)
    # RLOO: R_i - mean of the others: 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0
    firsts = [c["steps"][0]["advantage"] for c in view["episodes"]]
    assert firsts == pytest.approx([0.75, -0.75, 0.0])
    cfg, _ = trainer_config({"advantage": "gae", "critic": True})
    critic = group_view("g-var", episodes, cfg)
    assert "critic" in critic["note"] and all(s["advantage"] is None for c in critic["episodes"] for s in c["steps"])


def test_a_trainer_table_that_does_not_load_falls_back_to_the_defaults():
    cfg, problem = trainer_config({"advantage": "no-such-estimator"})
    assert cfg.advantage == "grpo" and problem and "defaults" in problem


async def test_groups_table_and_its_filters(group_run):
    async with dashboard(run_dir=group_run) as client:
        await settled(client)
        body = await (await client.get("/api/groups?limit=500&sort=created&order=asc")).json()
        rows = {r["group_key"]: r for r in body["rows"]}
        assert list(rows) == ["g-var", "g-same", "g-open", "t-big::terminal"]
        assert rows["g-var"]["episodes"] == 3 and rows["g-var"]["reward_mean"] == pytest.approx(0.5)
        assert (rows["g-open"]["ended"], rows["g-open"]["rewarded"]) == (1, 1)
        varies = await (await client.get("/api/groups?varies=true")).json()
        assert [r["group_key"] for r in varies["rows"]] == ["g-var"]
        ui = await (await client.get("/api/groups?harness=ui&q=SAME")).json()
        assert [r["group_key"] for r in ui["rows"]] == ["g-same"]
        # a default key (task::harness, no explicit group id) opens like any other
        assert (await get_group(client, "t-big::terminal"))["episodes"][0]["session_id"] == "s-big-0"


@pytest.mark.parametrize("query", ["limit=0", "limit=x", "offset=-3", "sort=nope", "varies=perhaps", "split=dev",
                                   "other=1", "limit=2&limit=3"])
async def test_malformed_group_queries_are_400(group_run, query):
    async with dashboard(run_dir=group_run) as client:
        response = await client.get(f"/api/groups?{query}")
        assert response.status == 400
        body = await response.json()
        assert body["error"]["type"] == "InvalidQuery" and query.split("=")[0] in body["error"]["message"]


async def test_an_unknown_or_oversized_group_is_4xx(group_run, monkeypatch):
    import stepline.dashboard.app as app_module

    async with dashboard(run_dir=group_run) as client:
        await settled(client)
        missing = await client.get("/api/groups/no-such-group")
        assert missing.status == 404 and (await missing.json())["error"]["type"] == "UnknownGroup"
        monkeypatch.setattr(app_module, "MAX_GROUP", 2)
        big = await client.get("/api/groups/g-var")
        assert big.status == 400 and "?group=" in (await big.json())["error"]["message"]


async def test_a_bare_pool_uses_the_trainer_defaults(group_run):
    async with dashboard(pool_url=f"sqlite:///{group_run / 'pool.db'}") as client:
        await settled(client)
        view = await get_group(client, "g-var")
    assert view["settings"].startswith("trainer defaults") and view["advantage"] == "grpo"
    assert json.dumps(view)  # plain JSON all the way down


# --- a pool that cannot be read, or is being written: an empty state or a clear status, never a 500 ---

ROUTES = ("/api/info", "/api/run", "/api/sessions", "/api/groups", "/api/sessions/s-fork", "/api/groups/g-var", "/")


def half_created(path: Path) -> None:
    """A database file whose schema is not (all) there yet: one unrelated table."""
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE sessions (x INTEGER)")


@pytest.mark.parametrize("make", [lambda p: p.write_bytes(b""), lambda p: p.write_bytes(b"not a database " * 600),
                                  half_created], ids=["empty", "not-a-database", "half-created"])
async def test_a_pool_that_cannot_be_read_is_an_empty_state(tmp_path, make):
    root = tmp_path / "run"
    root.mkdir()
    make(root / "pool.db")
    async with dashboard(run_dir=root) as client:
        await asyncio.sleep(0.2)  # a few refreshes have tried the pool
        for path in ROUTES:
            response = await client.get(path)
            assert response.status in (200, 404, 503), (path, response.status, await response.text())
            if path.startswith("/api"):
                body = await response.json()
                if response.status == 503:
                    assert response.headers["Retry-After"] and body["error"]["type"] == "PoolUnavailable"
                elif response.status == 404:
                    assert body["error"]["type"] in ("UnknownSession", "UnknownGroup")
        sessions = await (await client.get("/api/sessions")).json()
        assert sessions["rows"] == [] and sessions["index"]["error"]
        assert (await (await client.get("/api/groups")).json())["rows"] == []


async def test_a_pool_being_written_reads_as_it_stands(tmp_path, session_writer):
    """A writer creates sessions, adds their calls and rewards and ends them while requests come in: each
    answer is a 200 (a 404 only for a session listed before its first call reached the read), and the table
    ends whole."""
    import threading

    root = tmp_path / "run"
    root.mkdir()
    done = threading.Event()

    def write() -> None:
        try:
            session_writer(root / "pool.db", 30, pause_s=0.02)
        finally:
            done.set()

    statuses: list[tuple[str, int]] = []
    seen: list[int] = []  # sessions the table held at each request
    async with dashboard(run_dir=root) as client:
        writer = threading.Thread(target=write)
        writer.start()
        while not done.is_set():
            page = await (await client.get("/api/sessions?limit=500")).json()
            seen.append(page["total"])
            for path in ["/api/run", "/api/groups", *(f"/api/sessions/{r['session_id']}" for r in page["rows"][-3:]),
                         *(f"/api/groups/{r['group_key']}" for r in page["rows"][-2:])]:
                statuses.append((path, (await client.get(path)).status))
            await asyncio.sleep(0.01)
        writer.join()
        body = await settled(client, expect=30)
    assert any(0 < n < 30 for n in seen), seen  # requests did come while the pool was half written
    assert all(status in (200, 404) for _, status in statuses), [s for s in statuses if s[1] not in (200, 404)]
    assert sum(status == 200 for _, status in statuses) > 0.9 * len(statuses)
    assert body["index"]["error"] is None and body["total"] == 30
