"""Engine adapters (SGLang / built-in `/generate`, vLLM `/v1/completions`); the router over them is in
`stepline.gateway.fleet`.

Exception tree: see `stepline.gateway.engines.base`.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp

from stepline.gateway.engines.base import (
    EngineClient,
    EngineError,
    EngineInfo,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    Generation,
    SamplingParams,
    StreamDelta,
)
from stepline.gateway.engines.sglang import SGLangEngine
from stepline.gateway.engines.vllm import VLLMEngine

ENGINE_KINDS = ("builtin", "sglang", "vllm")


def make_engine(
    url: str, kind: str, http: aiohttp.ClientSession, timeout: float = 600.0, model_dir: Path | None = None
) -> EngineClient:
    """An adapter for the engine at `url`. kind: builtin | sglang (both `/generate`) | vllm.
    `model_dir` is the served model's folder: vLLM checks pushed checkpoints against its tensors."""
    if kind in ("builtin", "sglang"):
        return SGLangEngine(url, http, timeout, kind=kind)
    if kind == "vllm":
        return VLLMEngine(url, http, timeout, model_dir=model_dir)
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ENGINE_KINDS",
    "EngineClient",
    "EngineError",
    "EngineInfo",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnavailable",
    "Generation",
    "SGLangEngine",
    "SamplingParams",
    "StreamDelta",
    "VLLMEngine",
    "make_engine",
]
