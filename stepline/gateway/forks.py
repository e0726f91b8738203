"""Forks: a new session that starts from an existing session's step with its exact token ids (Tree-GRPO).

    POST /sessions/<id>/fork {"call": k, "metadata": {...}}     (that session's key, or the admin token)
    → a new session of the same task, harness and group; metadata["fork_of"] = {"session": <id>, "call": k}

A harness is a black box that sends its whole history on every call, so a fork cannot hand it a state in
the middle of an episode. The fork *replays* instead: the harness plays the task again from the start in
the new session, and its calls before the branch point are answered with the source's recorded generations
(the exact output ids, decoded as the engine decodes them) instead of by the engine. A deterministic
harness then sends exactly the source's prompts, the replayed ids are remembered like any answer (TITO),
so the fork's prompt at call k is the source's prompt at call k, token for token; from call k on the engine
samples. Replayed calls are not recorded again: the fork's first recorded call is k, and its prompt holds
the shared prefix as context (trained once, in the source; docs/architecture.md §2.2).

Matching is by prompt ids, in call order: a run of recorded calls with one prompt (the n choices of one
request, or a harness's retries) answers a request of n choices with the run's last n. A prompt that is not
the recorded one (a harness that is not deterministic) ends the replay: that call is sampled and recorded,
so the fork branches earlier than asked, which its first recorded call index shows (the trainer takes the
earlier of the two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from stepline.datapool.base import Pool
from stepline.datapool.records import CallRecord
from stepline.gateway.engines import Generation

__all__ = ["ForkLimits", "Replay", "Replayed", "recorded_prefix"]


@dataclass(frozen=True)
class ForkLimits:
    """How many forks one session may make, and one group have open (through this gateway); 429 beyond."""

    per_session: int = 64
    per_group: int = 256
    retry_after: float = 1.0  # Retry-After (s) of the group's 429: forks end, room comes back


@dataclass
class Replayed(Generation):
    """A recorded generation served again to a fork: answered like the engine's, never recorded."""

    call_index: int = -1  # the source's call index: the fork's calls keep the source's numbering


def recorded_prefix(pool: Pool, session_id: str, upto: int) -> list[CallRecord]:
    """The calls a fork of `session_id` at call `upto` replays, in call order: the session's recorded calls
    before `upto`, after (for a session that is itself a fork) those it shares with its own source."""
    info = pool.get_session(session_id)
    own = sorted(pool.get_calls(session_id), key=lambda c: c.call_index)
    link = info.fork_of
    if link is None:
        return [c for c in own if c.call_index < upto]
    branch = min(link.call, own[0].call_index) if own else link.call
    return recorded_prefix(pool, link.session_id, min(branch, upto)) + [c for c in own if c.call_index < upto]


Decode = Callable[[list[int]], str]


def replayed_generation(record: CallRecord, stop_ids: Iterable[int], decode: Decode) -> Replayed:
    """The engine's answer of a recorded call: its ids and logprobs, its text as the engines write it (a
    matched stop token left out of the text, the text cut at a matched stop string)."""
    ids = record.output_ids.tolist()
    matched: int | str | None = None
    text_ids = ids
    if record.finish_reason == "stop" and ids and ids[-1] in set(stop_ids) | set(record.sampling.get("stop_token_ids") or []):
        matched, text_ids = ids[-1], ids[:-1]
    text = decode(text_ids)
    for stop in record.sampling.get("stop") or []:
        if matched is None and stop and stop in text:
            matched, text = stop, text[: text.index(stop)]
    return Replayed(ids, record.output_logprobs.tolist(), text, record.finish_reason, matched, len(record.prompt_ids),
                    record.weight_version, call_index=record.call_index)


class Replay:
    """A fork's way to its branch point: the source's recorded calls, served in order while prompts match."""

    def __init__(self, calls: list[CallRecord], stop_ids: Iterable[int], decode: Decode) -> None:
        self.calls = calls
        self.stop_ids = list(stop_ids)
        self.decode = decode
        self.position = 0  # the next recorded call to serve
        self.diverged = False  # True once a prompt differed from the recorded one

    def serve(self, prompt_ids: np.ndarray, n: int) -> list[Replayed] | None:
        """The recorded answers to this prompt, or None: the replay is over (reached, or diverged)."""
        calls, start = self.calls, self.position
        end = start
        while end < len(calls) and np.array_equal(calls[end].prompt_ids, prompt_ids):
            end += 1
        if end - start < n:
            self.diverged = start < len(calls)
            self.position = len(calls)
            return None
        self.position = end
        return [replayed_generation(c, self.stop_ids, self.decode) for c in calls[end - n : end]]
