"""What the gateway asks its engines at start: which model they serve and how long a context they take.

    await check_engines(clients, model_dir, context_length) -> int | None

The gateway renders prompts with `model_dir`'s tokenizer and cuts them at its context length; an
engine that serves another model would sample from other ids, and one with a shorter limit answers
its own 400 instead of the gateway's `context_length_exceeded`. So, per engine that answers:
- the model it reports serving, when that folder is readable here, must hold the same tensors (names
  and shapes, `stepline.gateway.engines.checkpoint`) as `model_dir`, or `EngineMismatch` stops the start;
- the context length the gateway enforces is the smallest of its own setting (else the model's
  `max_position_embeddings`) and the engines' limits.
An engine that cannot be asked (down, or an API without the field) is logged and left unchecked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from stepline.gateway.engines.base import EngineClient, EngineError
from stepline.gateway.engines.checkpoint import CheckpointInvalid, check_checkpoint, signature

log = logging.getLogger(__name__)

__all__ = ["EngineMismatch", "check_engines"]


class EngineMismatch(EngineError):
    """An engine serves a model whose tensors differ from the gateway's model directory."""


def model_context_length(model_dir: Path) -> int | None:
    """The model's `max_position_embeddings` from config.json (None when it does not say)."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


async def check_engines(clients: list[EngineClient], model_dir: Path, context_length: int | None) -> int | None:
    """Check every engine that answers against `model_dir`; return the context length to enforce
    (`context_length` unless an engine takes less; None: the model's own, nothing said otherwise)."""
    engine_limits: list[tuple[str, int]] = []
    for client in clients:
        try:
            info = await client.info()
        except EngineError as exc:
            log.warning("engine %s did not say which model it serves (%s); not checked", client.url, exc.message)
            continue
        if info.model_path and info.model_path != str(model_dir):
            _check_same_model(client.url, Path(info.model_path), model_dir)
        if info.context_length:
            engine_limits.append((client.url, info.context_length))
    limit = context_length
    for url, engine_limit in engine_limits:
        current = limit or model_context_length(model_dir)
        if current is None or engine_limit < current:
            log.warning("engine %s takes %d tokens of context, less than %s: the gateway enforces %d",
                        url, engine_limit, current, engine_limit)
            limit = engine_limit
    return limit


def _check_same_model(url: str, served: Path, model_dir: Path) -> None:
    if not served.is_dir():
        log.info("engine %s serves %s, not readable here: its tensors are not compared with %s", url, served, model_dir)
        return
    try:
        check_checkpoint(served, signature(model_dir))
    except CheckpointInvalid as exc:
        raise EngineMismatch(f"engine serves a model that is not --model {model_dir}: {exc.message}", url) from exc
