"""The dashboard in a real headless browser: Debian's chromium driven by Playwright, on the run directory
of the shortened main job (tests/e2e/conftest.py `main_job_run`, the run test_main_job.py checks).

`stepline dashboard RUN` runs as a process, as a person starts it; the browser opens the run view (its
charts must hold data points), clicks an episode in the table (its steps must show the pool's tokens,
decoded, and the pool's token count), opens a forked session (two branches) and a group (its episodes
with their advantages). The tiny policy ends every episode after one call, so the forked session is made
here the way a harness's retry records one: a copy of the run whose pool holds one more session, two calls
on the same prompt with the two samples the engine gave two sessions of one group.

Screenshots go to the test's temporary folder; with STEPLINE_SCREENSHOTS=docs/img they are also written
there (the README's pictures): `STEPLINE_SCREENSHOTS=docs/img pytest tests/e2e/test_dashboard_browser.py`.
Skips, saying why, only where chromium or playwright is missing (scripts/setup.sh installs both).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from stepline.datapool import open_pool
from stepline.datapool.records import CallRecord, Reward, SessionInfo

CHROMIUM = Path("/usr/bin/chromium")
# as root, without a sandbox; no background traffic (the machine's network is closed: it would be refused)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
FORK = "s-retried"
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing: Debian's chromium package (scripts/setup.sh installs it as root)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield chromium
        chromium.close()


def one_call(pool, session_id: str) -> tuple[list[int], list[int], list[float], int]:
    """(prompt, sampled ids, their logprobs, weight version) of a session's first call."""
    step = pool.get_episode(session_id, "all").trajectories[0]
    first = step.steps[0]
    tokens = step.tokens.tolist()
    return (tokens[:first.action_start], tokens[first.action_start:first.action_end],
            first.behaviour_logprobs.tolist(), first.weight_version)


def add_retried_session(pool_path: Path) -> tuple[str, str]:
    """Adds FORK: the first call of two sessions of one training group (same prompt, different samples),
    as calls 0 and 1 of one session. Returns the two sessions it took them from."""
    import numpy as np

    pool = open_pool(f"sqlite:///{pool_path}")
    try:
        by_group: dict[str, list[str]] = {}
        for info in pool.list_sessions():
            if info.purpose != "eval":
                by_group.setdefault(info.group_key, []).append(info.session_id)
        for a, b in (members[:2] for members in by_group.values() if len(members) >= 2):
            (prompt, out_a, lp_a, v_a), (prompt_b, out_b, lp_b, v_b) = one_call(pool, a), one_call(pool, b)
            if prompt == prompt_b and out_a != out_b:
                break
        else:
            raise AssertionError("no training group with two different samples on one prompt")
        info = pool.get_session(a)
        pool.create_session(SessionInfo(FORK, info.task_id, info.harness, metadata={"note": "retried call"}))
        ids = np.array(prompt, np.int32)
        pool.add_calls([CallRecord(FORK, 0, ids, np.array(out_a, np.int32), np.array(lp_a, np.float32), v_a),
                        CallRecord(FORK, 1, ids, np.array(out_b, np.int32), np.array(lp_b, np.float32), v_b)])
        pool.add_reward(Reward(FORK, 0.0))
        pool.end_session(FORK)
    finally:
        pool.close()
    return a, b


@pytest.fixture(scope="module")
def served(main_job_run: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """`stepline dashboard` on a copy of the run with FORK added: (its URL, the copy, the group FORK's calls
    come from)."""
    from stepline.assets import AssetUnavailable, uplot_dir

    try:
        uplot_dir()
    except AssetUnavailable as exc:
        pytest.skip(f"uPlot unavailable ({exc}): the charts cannot be drawn")
    run = tmp_path_factory.mktemp("browser") / "run"
    shutil.copytree(main_job_run[0], run, ignore=shutil.ignore_patterns("weights", "checkpoints", "tb"))
    donor, _ = add_retried_session(run / "pool.db")
    pool = open_pool(f"sqlite:///{run / 'pool.db'}", read_only=True)
    try:
        group = pool.get_session(donor).group_key
    finally:
        pool.close()
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "dashboard", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("stepline dashboard:"):
                break
        match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert match, line
        url = match[1]
        for _ in range(300):  # the episodes index fills in within a few polls
            index = httpx.get(f"{url}api/sessions?limit=1", timeout=10).json()["index"]
            if index["total"] and index["indexed"] == index["total"]:
                break
            time.sleep(0.1)
        yield url, run, group
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def page(browser, served) -> Iterator:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    page.close()
    assert not errors, errors  # the page's script never threw


def screenshot(page, tmp_path: Path, name: str, full_page: bool = False) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=full_page)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("STEPLINE_SCREENSHOTS"):
        target = Path(os.environ["STEPLINE_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / name)


def test_run_view_charts_have_data_points(page, served, tmp_path):
    url, _, _ = served
    page.goto(url + "#/run")
    page.wait_for_selector("#chart-pool-reward .uplot canvas", timeout=WAIT_MS)
    page.wait_for_selector("#chart-trainer-loss .uplot canvas", timeout=WAIT_MS)
    for chart in ("pool-reward", "pool-success", "pool-engine_tps", "trainer-loss", "trainer-entropy", "eval"):
        card = page.locator(f"#chart-{chart}")
        assert int(card.get_attribute("data-points") or 0) > 0, chart
    # what uPlot itself holds: x values and, in some series, a finite y value
    drawn = page.evaluate("""() => Object.fromEntries(Object.entries(plots).map(([k, p]) =>
        [k, [p.data[0].length, p.data.slice(1).some((s) => s.some((v) => v !== null && isFinite(v)))]]))""")
    for key in ("pool-reward", "trainer-loss", "eval"):
        assert drawn[key][0] > 0 and drawn[key][1], (key, drawn[key])
    assert drawn["trainer-loss"][0] == 2  # two RL updates
    screenshot(page, tmp_path, "dashboard-run.png", full_page=True)


def test_an_episode_from_the_table_shows_the_pools_steps_decoded(page, served, main_job_run):
    url, run, _ = served
    pool = open_pool(f"sqlite:///{run / 'pool.db'}", read_only=True)
    try:
        train = [s for s in pool.list_sessions() if s.purpose != "eval" and s.session_id != FORK]
        session = max(train, key=lambda s: sum(len(n.tokens) for n in pool.get_tree(s.session_id).nodes))
        tree = pool.get_tree(session.session_id)
    finally:
        pool.close()
    tok = Tokenizer.from_file(str(run / "model-sft" / "tokenizer.json"))
    page.goto(url + "#/episodes?limit=100")
    page.click(f'#episodes-table tr.row[data-session="{session.session_id}"]', timeout=WAIT_MS)
    page.wait_for_selector("#tree .node", timeout=WAIT_MS)
    assert f"{sum(len(n.tokens) for n in tree.nodes)} unique tokens" in page.inner_text("#view")
    shown = page.evaluate("""() => [...document.querySelectorAll('#tree li.node')].map((li) => ({
        id: +li.dataset.node, toks: li.querySelectorAll('.tok').length,
        text: li.querySelector('pre').textContent }))""")
    assert sorted(s["id"] for s in shown) == sorted(n.id for n in tree.nodes)
    nodes = {n.id: n for n in tree.nodes}
    for s in shown:
        node = nodes[s["id"]]
        assert s["text"] == tok.decode(node.tokens.tolist(), skip_special_tokens=False), s["id"]
        assert s["toks"] == (len(node.tokens) if node.kind == "act" else 0), s["id"]  # one span per sampled token


def test_a_forked_session_shows_two_branches(page, served, tmp_path):
    url, _, _ = served
    page.goto(url + "#/episodes?forked=true")
    page.click(f'#episodes-table tr.row[data-session="{FORK}"]', timeout=WAIT_MS)
    page.wait_for_selector("#tree .fork", timeout=WAIT_MS)
    assert page.inner_text("#tree .fork") == "fork: 2 branches"
    branches = page.locator("#tree ul.branch")
    assert branches.count() == 2
    for i in range(2):  # each branch: the sampled action, one leaf tag
        assert branches.nth(i).locator("li.node.act .tok").count() > 0
        assert branches.nth(i).locator(".leaf").count() == 1
    page.hover("#tree ul.branch li.node.act .tok >> nth=0")
    assert "logprob" in page.inner_text("#tip")
    screenshot(page, tmp_path, "dashboard-episode.png", full_page=True)


def test_a_group_shows_its_episodes_with_advantages(page, served, tmp_path):
    url, _, group = served
    page.goto(url + "#/groups?split=train&limit=100")
    page.click(f'#groups-table tr.row[data-group="{group}"]', timeout=WAIT_MS)
    page.wait_for_selector("#group-cards .group-card", timeout=4 * WAIT_MS)  # the first group imports torch
    cards = page.locator("#group-cards .group-card")
    assert cards.count() == 2  # the job's rollout.group_size
    for i in range(2):
        assert re.search(r"A (=|∈) ", cards.nth(i).inner_text()), cards.nth(i).inner_text()
    screenshot(page, tmp_path, "dashboard-group.png")
