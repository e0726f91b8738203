"""`stepline engine` as its own process, and the engine on the real Qwen3 tokenizer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from stepline.engine.testing import running_engine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_stepline_engine_command_serves_and_stops(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stepline.cli", "engine", "--model", str(tiny_model_dir),
                             "--port", str(port), "--threads", "1"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "engine exited"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "engine did not start"
                time.sleep(0.1)
        result = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                                                      {"max_new_tokens": 4, "sampling_seed": 0}}, timeout=30).json()
        assert len(result["output_ids"]) == 4
    finally:
        proc.terminate()
        # uvicorn shuts down cleanly on SIGTERM, then re-raises the signal (hence -15, not 1).
        assert proc.wait(timeout=30) in (0, -15)


def test_engine_serves_qwen3_tiny_from_a_chat_prompt(qwen3_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    with running_engine(qwen3_model_dir) as url:
        info = httpx.get(f"{url}/model_info").json()
        by_ids = httpx.post(f"{url}/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params":
                                                      {"max_new_tokens": 6, "sampling_seed": 1}}, timeout=60).json()
        by_text = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params":
                                                       {"max_new_tokens": 6, "sampling_seed": 1}}, timeout=60).json()
    assert info["vocab_size"] >= len(tok) and tok.convert_tokens_to_ids("<|im_end|>") in info["eos_token_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert all(lp <= 0 for lp, _, _ in by_ids["meta_info"]["output_token_logprobs"])
