"""The dashboard's pure parts with numbers worked out by hand: windows of the pool's charts, token texts,
the table's paging and sorting, evaluation intervals, and the access-token rule of the command."""

from __future__ import annotations

import json

import pytest

from stepline.dashboard.cli import access_token, dashboard_url, is_loopback
from stepline.dashboard.episode import token_texts
from stepline.dashboard.runfiles import evaluations, read_jsonl
from stepline.dashboard.runview import pool_charts, trainer_charts, windows
from stepline.dashboard.sessions import SessionQuery, SessionRow, select


def row(sid: str, harness: str, created: float, ended: float | None, reward: float | None, tokens: int = 10,
        version: int | None = 0, split: str = "train", success: bool | None = None) -> SessionRow:
    return SessionRow(sid, harness, "t", f"t::{harness}", "completed" if ended else "open", split, created, ended,
                      reward, 1, tokens, tokens, version, version, 1, success)


def test_pool_windows_by_update_by_hand():
    metrics = [{"update": 1, "time": 100.0}, {"update": 2, "time": 110.0}]
    rows = (row("a", "h", 90.0, 95.0, 1.0, tokens=30, version=0), row("b", "h", 91.0, 100.0, 0.0, tokens=10, version=0),
            row("c", "h", 101.0, 105.0, 1.0, tokens=20, version=1), row("d", "g", 102.0, 120.0, 0.5, version=2),
            row("e", "h", 103.0, 104.0, 1.0, tokens=40, version=1, split="eval"), row("f", "h", 118.0, None, None))
    edges, label = windows(metrics, rows)
    assert edges == [100.0, 110.0] and label == "update"
    charts = pool_charts(rows, edges, label)
    # window 1 = (start 90, 100]: a, b; window 2 = (100, 110]: c and eval e; window 3 = after update 2: d
    assert charts["reward"]["x"] == [1, 2, 3]
    reward = {s["label"]: s["values"] for s in charts["reward"]["series"]}
    assert reward == {"g": [None, None, 0.5], "h": [0.5, 1.0, None]}  # e is an evaluation: not training reward
    # success without verdicts: reward >= 1 -> h: a only of (a, b); c
    assert {s["label"]: s["values"] for s in charts["success"]["series"]}["h"] == [0.5, 1.0, None]
    # episodes/s: 2 train episodes in 10 s; 1 in 10 s; window 3 runs from 110 to the last end (120): 1 in 10 s
    assert charts["episodes_per_s"]["series"][0]["values"] == pytest.approx([0.2, 0.1, 0.1])
    # engine tokens/s counts eval sessions too: (30 + 10) / 10; (20 + 40) / 10; 10 / 10
    assert charts["engine_tps"]["series"][0]["values"] == pytest.approx([4.0, 6.0, 1.0])
    assert charts["version"]["series"][0]["values"] == [0, 1, 2]


def test_without_metrics_windows_are_equal_slices_of_time():
    rows = (row("a", "h", 0.0, 30.0, 1.0), row("b", "h", 0.0, 60.0, 0.0))
    edges, label = windows([], rows)
    assert label == "window" and len(edges) == 30 and edges[0] == pytest.approx(2.0) and edges[-1] == pytest.approx(60.0)
    charts = pool_charts(rows, edges, label)
    assert charts["reward"]["x"] == [15, 30]  # 30 s ends window 15 = (28, 30]; 60 s ends the last


def test_a_driver_verdict_overrides_reward_as_success():
    rows = (row("a", "h", 0.0, 1.0, 1.0, success=False), row("b", "h", 0.0, 1.0, 0.2, success=True))
    charts = pool_charts(rows, [], "window")
    assert charts["success"]["series"][0]["values"] == [0.5]


def test_trainer_charts_leave_out_series_never_logged():
    metrics = [{"update": 1, "policy_loss": 0.5, "entropy_mean": float("nan")}, {"update": 2, "policy_loss": 0.25}]
    charts = trainer_charts(metrics)
    assert set(charts) == {"loss"}  # entropy only ever NaN (JSON null), no KL, no clip fraction: no chart
    assert charts["loss"]["series"] == [{"label": "policy loss", "values": [0.5, 0.25]}]


def test_token_texts_put_a_split_character_on_its_first_token():
    # a byte-level decoder: token 1 = b"a", tokens 2 and 3 = the two bytes of "é"
    table = {1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b"\xff"}
    decode = lambda ids: b"".join(table[i] for i in ids).decode("utf-8", "replace")  # noqa: E731
    assert token_texts([1, 2, 3, 1], decode) == ["a", "é", "", "a"]
    assert token_texts([4, 1], decode) == ["\ufffd", "a"]  # a byte no character completes stays itself
    assert token_texts([4, 2, 3], decode) == ["\ufffd", "é", ""]
    assert "".join(token_texts([2, 3, 2, 3], decode)) == decode([2, 3, 2, 3])


def test_select_sorts_then_pages():
    rows = tuple(row(f"s{i}", "h", float(i), float(i) + 1, reward=float(i % 4)) for i in range(10))
    page = select(rows, SessionQuery(sort="reward", order="desc", offset=2, limit=3))
    # rewards 0,1,2,3,0,1,2,3,0,1 -> descending 3,3,2,2,1,1,1,0,0,0 (ties in creation order): skip two, take three
    assert page["total"] == 10 and [r["reward"] for r in page["rows"]] == [2.0, 2.0, 1.0]
    assert [r["session_id"] for r in page["rows"]] == ["s2", "s6", "s1"]
    unrewarded = rows + (row("x", "h", 20.0, None, None),)
    assert select(unrewarded, SessionQuery(sort="reward", order="asc", limit=1))["rows"][0]["session_id"] == "x"


def test_evaluations_in_order_with_wilson_intervals(tmp_path):
    for tag, rate in (("after-10", 0.5), ("before", 0.0), ("after-2", 0.25)):
        (tmp_path / f"{tag}.json").write_text(json.dumps({"harnesses": {"h": {"episodes": 4, "success_rate": rate}}}))
    (tmp_path / "after-11.json").write_text('{"harn')  # being written
    evals = evaluations(tmp_path)
    assert [e["tag"] for e in evals] == ["before", "after-2", "after-10"]
    # 0 of 4: upper = (3.8416/4) / (1 + 3.8416/4) = 0.96040 / 1.96040 = 0.489900
    assert evals[0]["harnesses"]["h"]["ci95"] == pytest.approx([0.0, 0.489900], abs=1e-6)


def test_read_jsonl_skips_a_line_being_written(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"update": 1}\n{"update": 2}\n{"upd')
    assert read_jsonl(path) == [{"update": 1}, {"update": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_token_is_required_off_loopback_only():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")
    assert access_token("127.0.0.1", None) is None and access_token("127.0.0.1", "t") == "t"
    made = access_token("0.0.0.0", None)
    assert made and len(made) >= 20 and made != access_token("0.0.0.0", None)
    assert dashboard_url("::", 8400, "abc") == "http://[::]:8400/?token=abc"
