"""/generate: logprob parity with teacher forcing, batching and streaming invariance, stops, n, rid."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import sse_chunks
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.engine.testing import running_engine

PROMPTS = [[11, 12, 13, 14, 15], [200, 7], list(range(30, 70)), [5]]


def generate(client: httpx.Client, ids, **sampling) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 12, **sampling}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(result: dict) -> list[float]:
    return [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_a_teacher_forced_forward(client: httpx.Client, tiny_model_dir: Path,
                                                 temperature: float) -> None:
    prompt = PROMPTS[2]
    result = generate(client, prompt, temperature=temperature, sampling_seed=5, max_new_tokens=24)
    out = result["output_ids"]
    assert len(out) == result["meta_info"]["completion_tokens"] == 24
    assert [tok for _, tok, _ in result["meta_info"]["output_token_logprobs"]] == out
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]  # [24, V]: predicts out
    scaled = logits / temperature if temperature > 0 else logits
    expected = torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(out)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs(result)), expected, atol=1e-4)


def test_batched_and_concurrent_equal_unbatched(client: httpx.Client) -> None:
    params = [dict(temperature=1.0, sampling_seed=100 + i, max_new_tokens=10 + 3 * i) for i in range(len(PROMPTS))]
    alone = [generate(client, ids, **p) for ids, p in zip(PROMPTS, params)]
    batch = client.post("/generate", json={"input_ids": PROMPTS, "return_logprob": True,
                                           "sampling_params": params}).json()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(lambda a: generate(client, *a[:1], **a[1]), zip(PROMPTS, params)))
    for one, batched, conc in zip(alone, batch, concurrent):
        assert batched["output_ids"] == one["output_ids"] == conc["output_ids"]
        assert batched["text"] == one["text"] == conc["text"]
        assert logprobs(batched) == pytest.approx(logprobs(one), abs=1e-4)
        assert logprobs(conc) == pytest.approx(logprobs(one), abs=1e-4)
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [len(p) for p in PROMPTS]


def test_stream_is_cumulative_and_ends_equal_to_unstreamed(client: httpx.Client) -> None:
    body = {"input_ids": PROMPTS[0], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}}
    plain = client.post("/generate", json=body).json()
    chunks = sse_chunks(client, body)
    assert len(chunks) == 8  # one chunk per token
    for k, chunk in enumerate(chunks, start=1):
        assert chunk["output_ids"] == plain["output_ids"][:k]
        assert chunk["meta_info"]["finish_reason"] == (plain["meta_info"]["finish_reason"] if k == 8 else None)
    assert chunks[-1]["text"] == plain["text"]
    assert logprobs(chunks[-1]) == pytest.approx(logprobs(plain), abs=1e-4)


def test_incremental_stream_concatenates_to_unstreamed(tiny_model_dir: Path, client: httpx.Client) -> None:
    body = {"input_ids": PROMPTS[1], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 4}}
    plain = client.post("/generate", json=body).json()
    with running_engine(tiny_model_dir, incremental_streaming=True) as url, httpx.Client(base_url=url) as other:
        chunks = sse_chunks(other, body)
    assert all(len(c["output_ids"]) == 1 for c in chunks)
    assert sum((c["output_ids"] for c in chunks), []) == plain["output_ids"]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert sum((logprobs(c) for c in chunks), []) == pytest.approx(logprobs(plain), abs=1e-4)


def test_stop_token_is_kept_in_ids_and_cut_from_text(client: httpx.Client, tiny_model_dir: Path) -> None:
    free = generate(client, PROMPTS[0], temperature=1.0, sampling_seed=9, max_new_tokens=12)["output_ids"]
    stop = free[4]
    cut = free.index(stop) + 1  # the first occurrence ends the output
    result = generate(client, PROMPTS[0], temperature=1.0, sampling_seed=9, max_new_tokens=12, stop_token_ids=[stop])
    assert result["output_ids"] == free[:cut]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert result["text"] == tok.decode(free[: cut - 1])


def test_eos_stops_the_output_unless_ignored(client: httpx.Client, tiny_model_dir: Path, tmp_path: Path) -> None:
    assert set(client.get("/model_info").json()["eos_token_ids"]) == {0, 2}  # <|endoftext|>, <|im_end|>
    # The random model rarely samples eos, so declare as eos (in generation_config.json) a token
    # that a seeded run samples at step 4, and serve that copy of the model.
    free = generate(client, [1], temperature=1.0, sampling_seed=0, max_new_tokens=12)["output_ids"]
    eos = free[3]
    first = free.index(eos)
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos]}))
    with running_engine(model_dir) as url, httpx.Client(base_url=url, timeout=60) as other:
        stopped = generate(other, [1], temperature=1.0, sampling_seed=0, max_new_tokens=12)
        ignored = generate(other, [1], temperature=1.0, sampling_seed=0, max_new_tokens=12, ignore_eos=True)
    assert stopped["output_ids"] == free[: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert ignored["output_ids"] == free
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_stop_string_cuts_text(client: httpx.Client, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    free = generate(client, PROMPTS[3], temperature=1.0, sampling_seed=21, max_new_tokens=12)
    full = free["text"]
    stop = tok.decode(free["output_ids"][5:6]).strip() or full[-1]
    result = generate(client, PROMPTS[3], temperature=1.0, sampling_seed=21, max_new_tokens=12, stop=[stop, "zzzq"])
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["text"] == full[: full.index(stop)]
    assert free["output_ids"][: len(result["output_ids"])] == result["output_ids"]


def test_n_samples_use_consecutive_seeds(client: httpx.Client) -> None:
    both = generate(client, PROMPTS[0], temperature=1.0, sampling_seed=40, n=2)
    assert isinstance(both, list) and len(both) == 2
    for j, sample in enumerate(both):
        assert sample["output_ids"] == generate(client, PROMPTS[0], temperature=1.0, sampling_seed=40 + j)["output_ids"]
    assert both[0]["output_ids"] != both[1]["output_ids"]


def test_text_prompt_rid_and_zero_new_tokens(client: httpx.Client, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = {"text": "hello agent", "rid": "req-1", "sampling_params": {"max_new_tokens": 0}}
    result = client.post("/generate", json=body).json()
    assert result["output_ids"] == [] and result["text"] == ""
    assert result["meta_info"]["id"] == "req-1"
    assert result["meta_info"]["prompt_tokens"] == len(tok.encode("hello agent"))
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert result["meta_info"]["weight_version"] == "0"


def test_abort_request_by_rid(client: httpx.Client, engine_url: str) -> None:
    box: dict = {}

    def long_request() -> None:
        with httpx.Client(base_url=engine_url, timeout=60) as c:
            params = {"max_new_tokens": 3000, "ignore_eos": True}
            body = {"input_ids": [1, 2], "rid": "long-1", "sampling_params": params}
            box["result"] = c.post("/generate", json=body).json()

    worker = threading.Thread(target=long_request)
    worker.start()
    while client.get("/model_info").json()["running_requests"] == 0:
        threading.Event().wait(0.01)
    assert client.post("/abort_request", json={"rid": "long-1"}).json()["aborted"] == 1
    worker.join(timeout=30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(box["result"]["output_ids"]) < 3000


def test_a_request_whose_client_left_is_aborted(client: httpx.Client, engine_url: str) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine_url}/generate", json=body, timeout=0.5)
    for _ in range(100):  # the engine checks for a gone client every second
        if client.get("/model_info").json()["running_requests"] == 0:
            break
        threading.Event().wait(0.05)
    assert client.get("/model_info").json()["running_requests"] == 0
