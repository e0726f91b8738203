"""The tiny local models: loadable with the stock HF classes, tool-aware chat templates, deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.models import SPECIAL_TOKENS, ModelShape, build_model, make_model_command

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"sky": "sunny"}'},
]


def test_tiny_loads_with_stock_classes(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 2000 <= len(tok) <= 4200
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    # Every special token is one id, and text round-trips through encode/decode.
    for token in SPECIAL_TOKENS:
        assert len(tok.encode(token)) == 1, token
    text = 'Run `ls -la` then {"name": "search", "arguments": {"q": "café"}}'
    assert tok.decode(tok.encode(text)) == text
    logits = model(torch.tensor([tok.encode(text)])).logits
    assert logits.shape[-1] == model.config.vocab_size >= len(tok)


def test_tiny_chat_template_renders_tools_like_qwen25(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n'
                         "<|im_start|>assistant\n")
    # Tool markers are kept by skip_special_tokens (the gateway parses them); ChatML markers are dropped.
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_qwen3_tiny_uses_real_tokenizer(qwen3_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(tok) > 150_000 and model.config.vocab_size >= len(tok)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    small = ModelShape(hidden_size=32, num_layers=1)
    a = build_model(tmp_path / "a", seed=3, shape=small)
    b = build_model(tmp_path / "b", seed=3, shape=small)
    c = build_model(tmp_path / "c", seed=4, shape=small)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_cli_builds_and_rejects_bad_sizes(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(make_model_command, [str(tmp_path / "m"), "--hidden-size", "32", "--num-layers", "1"])
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["hidden_size"] == 32
    bad = runner.invoke(make_model_command, [str(tmp_path / "n"), "--hidden-size", "30"])
    assert bad.exit_code == 2 and "num_heads" in bad.output
    with pytest.raises(ValueError, match="unknown model kind"):
        build_model(tmp_path / "x", kind="gpt5")  # type: ignore[arg-type]


def test_make_model_vllm_compatible_shape(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(make_model_command, [str(tmp_path / "v"), "--vllm-compatible", "--num-layers", "1"])
    assert ok.exit_code == 0, ok.output
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    # head_dim 128 / 2 = 64 (vLLM's CPU attention lists 32, 64, 80, ...; not the default's 16), LM head untied
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (128, 2, 1)
    assert config["tie_word_embeddings"] is False
    bad = runner.invoke(make_model_command, [str(tmp_path / "w"), "--vllm-compatible", "--num-heads", "8"])
    assert bad.exit_code != 0 and "hidden_size / num_heads in [32, 64" in bad.output  # 128 / 8 = 16
