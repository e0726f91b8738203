"""The records one model call carries through the call path (docs/architecture.md, "The call path").

    Exchange  built once per request (a Completions batch: one per prompt): session, API, raw body, then the
              prompt and sampling, the weight version stamped at dispatch, and the timings as it goes
    Choice    one of its n answers: the engine's generation, parsed, and the call index it was recorded as
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from stepline.gateway.engines import Generation, SamplingParams
from stepline.gateway.parsers.base import ParsedOutput
from stepline.gateway.sessions import Prompt, Session

__all__ = ["Choice", "Exchange", "now", "usage"]


def now() -> float:
    return time.time()


@dataclass
class Exchange:
    """One model call on its way through the call path. The stages fill it in: the prompt and sampling,
    then the weight version at dispatch, and the timings as it goes."""

    session: Session
    api: str  # chat.completions | completions | responses | messages
    raw: bytes  # the request body as received (recorded with the call)
    prompt: Prompt = field(default_factory=lambda: Prompt(np.zeros(0, dtype=np.int32), 0, 0))
    samplings: list[SamplingParams] = field(default_factory=list)  # one per choice
    version: int = -1  # the weight version that serves it, stamped at dispatch
    timings: dict[str, float] = field(default_factory=lambda: {"received": now()})


@dataclass
class Choice:
    index: int
    generation: Generation
    parsed: ParsedOutput
    call_index: int = -1  # set when it is recorded


def usage(prompt: Prompt, choices: list[Choice]) -> tuple[int, int]:
    """(prompt tokens, completion tokens of all the choices)."""
    return len(prompt.ids), sum(len(c.generation.output_ids) for c in choices)
