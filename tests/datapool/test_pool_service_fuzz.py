"""Fuzz the pool service's routes: mutated and random msgpack bodies to every method never
get a 5xx (a 503 would tell the client to retry its own mistake) or hang.

Bounded by default (STEPLINE_FUZZ_EXAMPLES, 200); the long run (README, Hardening):
`STEPLINE_FUZZ_EXAMPLES=2000 python -m pytest -q tests/datapool/test_pool_service_fuzz.py -s`."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_helpers import ServiceThread

from stepline.datapool import wire
from stepline.datapool.records import CallRecord, SessionInfo

FUZZ_EXAMPLES = int(os.environ.get("STEPLINE_FUZZ_EXAMPLES", "200"))
STATUSES: Counter = Counter()

SCALAR = (st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=10)
          | st.binary(max_size=10))
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
SESSION_ID = st.sampled_from(["s", "nobody", ""]) | VALUE
INFO = {"session_id": SESSION_ID, "task_id": st.text(max_size=4) | VALUE, "harness": st.text(max_size=4) | VALUE,
        "group_id": st.none() | VALUE, "metadata": st.just({}) | VALUE,
        "status": st.sampled_from(["open", "completed", "abandoned", "x"]) | VALUE,
        "created_at": st.floats() | VALUE, "ended_at": st.none() | VALUE}
CALL = {"session_id": SESSION_ID, "call_index": st.integers(-2, 5) | VALUE,
        "prompt_ids": st.lists(st.integers(-5, 2**40), max_size=6) | VALUE,
        "output_ids": st.lists(st.integers(-5, 300), max_size=4) | VALUE,
        "output_logprobs": st.lists(st.floats(), max_size=4) | VALUE, "weight_version": st.integers(-2, 3) | VALUE,
        "finish_reason": st.text(max_size=5) | VALUE, "api": st.text(max_size=5) | VALUE}


def fields(spec: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=spec)


GROUPS = st.lists(st.text(max_size=6), max_size=3) | VALUE
ARGS = {
    "create_session": fields({"info": fields(INFO) | VALUE}),
    "add_calls": fields({"records": st.lists(fields(CALL) | VALUE, max_size=3) | VALUE}),
    "add_reward": fields({"reward": fields({"session_id": SESSION_ID, "value": st.floats() | VALUE,
                                            "step": st.none() | st.integers(-2, 3) | VALUE}) | VALUE}),
    "end_session": fields({"session_id": SESSION_ID, "status": st.sampled_from(["completed", "failed", "x"]) | VALUE}),
    "abandon_idle": fields({"idle_seconds": st.floats() | VALUE, "keep": GROUPS}),
    "get_session": fields({"session_id": SESSION_ID}),
    "list_sessions": fields({"status": st.none() | st.sampled_from(["open", "x"]) | VALUE}),
    "get_tree": fields({"session_id": SESSION_ID}),
    "get_episode": fields({"session_id": SESSION_ID, "leaf_rule": st.sampled_from(["all", "main", "x"]) | VALUE}),
    "get_calls": fields({"session_id": SESSION_ID}),
    "stats": fields({}),
    "claim_groups": fields({"consumer": st.text(max_size=4) | VALUE, "min_version": st.integers(-2, 3) | VALUE,
                            "max_groups": st.integers(-2, 5) | VALUE, "group_size": st.none() | VALUE,
                            "leaf_rule": st.sampled_from(["all", "x"]) | VALUE}),
    "mark_consumed": fields({"group_ids": GROUPS, "consumer": st.text(max_size=4) | VALUE}),
    "release_groups": fields({"group_ids": GROUPS, "consumer": st.text(max_size=4) | VALUE}),
    "claimed_groups": fields({"consumer": st.text(max_size=4) | VALUE}),
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from stepline.datapool import open_pool

    db = tmp_path_factory.mktemp("fuzzpool") / "p.db"
    pool = open_pool(f"sqlite:///{db}")  # one real session with a call, so that reads find something
    pool.create_session(SessionInfo("s", "t", "h"))
    pool.add_calls([CallRecord("s", 0, np.arange(3, dtype=np.int32), np.array([4], dtype=np.int32),
                               np.array([-0.5], dtype=np.float32), 0)])
    pool.close()
    with ServiceThread(f"sqlite:///{db}") as svc, httpx.Client(base_url=svc.url, timeout=30) as client:
        yield client
    print(f"\npool service fuzz: {sum(STATUSES.values())} requests, by status {dict(sorted(STATUSES.items()))}")


@pytest.mark.timeout(300 + FUZZ_EXAMPLES)  # the long run outlasts pytest's 300 s per test
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(sorted(ARGS)), data=st.data())
def test_fuzz_pool_routes_never_5xx(service: httpx.Client, method: str, data: st.DataObject) -> None:
    content = data.draw(st.one_of(ARGS[method], ARGS[method], VALUE).map(_pack) | st.binary(max_size=30))
    r = service.post(f"/v1/{method}", content=content, headers={"content-type": "application/msgpack"})
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (method, content[:300], r.content[:300])
    if r.status_code >= 400:
        assert "error" in wire.unpackb(r.content), r.content


def _pack(args: Any) -> bytes:
    """msgpack of the arguments; integers beyond 64 bits (msgpack cannot hold them) become their text."""
    try:
        return msgpack.packb(args, use_bin_type=True)
    except OverflowError:
        return msgpack.packb(_clip(args), use_bin_type=True)


def _clip(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -2**63 <= value < 2**64:
        return str(value)
    if isinstance(value, list):
        return [_clip(v) for v in value]
    if isinstance(value, dict):
        return {k: _clip(v) for k, v in value.items()}
    return value
