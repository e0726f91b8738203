"""Fuzz the built-in engine's /generate: mutated and random bodies never get a 5xx or hang.

Bounded by default (STEPLINE_FUZZ_EXAMPLES, 200); the long run (README, Hardening):
`STEPLINE_FUZZ_EXAMPLES=2000 python -m pytest -q tests/engine/test_engine_fuzz.py -s`. The engine's
context is 64 tokens, so any `max_new_tokens` stays cheap; every answer must come within the client's
timeout (a hang fails the example)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepline.engine.testing import running_engine

FUZZ_EXAMPLES = int(os.environ.get("STEPLINE_FUZZ_EXAMPLES", "200"))
STATUSES: Counter = Counter()

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=10)
IDS = st.lists(st.integers(-5, 300) | st.integers(-2**64, 2**64), max_size=12)
SAMPLING = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(-1, 8) | JSON, "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON, "top_k": st.integers(-3, 50) | JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=3) | JSON,
    "stop_token_ids": st.lists(st.integers(-3, 2**40), max_size=3) | JSON, "n": st.integers(-1, 4) | JSON,
    "ignore_eos": st.booleans() | JSON, "sampling_seed": st.integers(-2, 2**65) | JSON,
    "skip_special_tokens": st.booleans() | JSON, "no_stop_trim": st.booleans() | JSON,
})
BODY = st.fixed_dictionaries({}, optional={
    "input_ids": IDS | st.lists(IDS, max_size=3) | JSON, "text": st.text(max_size=20) | st.lists(st.text(max_size=8),
                                                                                                  max_size=3) | JSON,
    "sampling_params": SAMPLING | st.lists(SAMPLING, max_size=3) | JSON, "return_logprob": st.booleans() | JSON,
    "return_text_in_logprobs": st.booleans() | JSON, "logprob_start_len": st.integers(-2, 5) | JSON,
    "stream": st.booleans() | JSON, "rid": st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=3) | JSON,
})


VALID = st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 255), min_size=1, max_size=8)}, optional={
    "sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(0, 6)}, optional={
        "temperature": st.floats(0, 2), "top_k": st.integers(-1, 20), "n": st.integers(1, 3),
        "stop": st.text(max_size=3), "sampling_seed": st.integers(0, 2**63 - 1)}),
    "return_logprob": st.booleans(), "stream": st.booleans()})
# the stdlib encoder: integers beyond 64 bits and NaN / Infinity go out as written
CONTENT = st.one_of(VALID, BODY, JSON).map(lambda body: json.dumps(body).encode()) | st.binary(max_size=40)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    with running_engine(tiny_model_dir, context_length=64) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client
        print(f"\nengine /generate fuzz: {sum(STATUSES.values())} requests, by status {dict(sorted(STATUSES.items()))}")


def _post(client: httpx.Client, content: bytes) -> httpx.Response:
    with client.stream("POST", "/generate", content=content, headers={"content-type": "application/json"}) as r:
        r.read()  # a stream must end too (within the timeout)
    STATUSES[r.status_code] += 1
    return r


@pytest.mark.timeout(300 + FUZZ_EXAMPLES)  # the long run outlasts pytest's 300 s per test
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT)
def test_fuzz_generate_never_5xx(engine: httpx.Client, content: bytes) -> None:
    r = _post(engine, content)
    assert r.status_code < 500, (content[:300], r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json(), r.text
