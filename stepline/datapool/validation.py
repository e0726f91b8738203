"""Checks that refuse self-contradictory records before anything is written (pure)."""

from __future__ import annotations

import math

import numpy as np

from stepline.datapool.base import InvalidRecord
from stepline.datapool.records import FORK_KEY, PURPOSES, CallRecord, Reward, SessionInfo

INT32_MAX = 2**31 - 1
SESSION_STATUSES = ("open", "completed", "failed", "aborted", "abandoned")
END_STATUSES = ("completed", "failed", "aborted", "abandoned")  # abandoned: ended by the idle reaper


def token_ids(values: object, what: str) -> np.ndarray:
    """An int32 array of token ids, or InvalidRecord naming `what`."""
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise InvalidRecord(f"{what} must be a 1-D array of integer token ids, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > INT32_MAX):
        raise InvalidRecord(f"{what} has ids out of range [0, {INT32_MAX}]: min {arr.min()}, max {arr.max()}")
    return arr.astype(np.int32, copy=False)


def check_call(r: CallRecord) -> CallRecord:
    """The record with normalised arrays (int32 ids, float32 logprobs), or InvalidRecord."""
    where = f"call {r.call_index} of session {r.session_id!r}"
    if not isinstance(r.session_id, str) or not r.session_id:
        raise InvalidRecord(f"{where}: session_id must be a non-empty string")
    if not isinstance(r.call_index, int) or r.call_index < 0:
        raise InvalidRecord(f"{where}: call_index must be an integer >= 0")
    if not isinstance(r.weight_version, int) or r.weight_version < 0:
        raise InvalidRecord(f"{where}: weight_version must be an integer >= 0, got {r.weight_version!r}")
    check_delta(r, where)
    prompt = token_ids(r.prompt_ids, f"{where}: prompt_ids")
    output = token_ids(r.output_ids, f"{where}: output_ids")
    logprobs = np.asarray(r.output_logprobs, dtype=np.float32)
    if logprobs.shape != output.shape:
        raise InvalidRecord(f"{where}: {logprobs.size} logprobs for {output.size} output tokens")
    if logprobs.size and not (np.isfinite(logprobs).all() and float(logprobs.max()) <= 1e-3):
        raise InvalidRecord(f"{where}: logprobs must be finite and <= 0")
    spans = version_spans(r.version_spans, len(output), f"{where}: version_spans")
    return CallRecord(**{**r.__dict__, "prompt_ids": prompt, "output_ids": output, "output_logprobs": logprobs,
                         "version_spans": spans})


def version_spans(spans: object, n_output: int, what: str) -> list[tuple[int, int]]:
    """(first output index, version) pairs: the first at 0, starts increasing and inside the output, versions
    integers >= 0 (empty: the call's one version); or InvalidRecord naming `what`."""
    if not isinstance(spans, (list, tuple)):
        raise InvalidRecord(f"{what} must be a list of [first output index, version] pairs")
    out: list[tuple[int, int]] = []
    for pair in spans:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)):
            raise InvalidRecord(f"{what}: {pair!r} is not a pair of integers >= 0")
        out.append((pair[0], pair[1]))
    starts = [s for s, _ in out]
    if out and (starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= n_output):
        raise InvalidRecord(f"{what}: starts {starts} must begin at 0 and increase inside the {n_output} output tokens")
    return out


def check_delta(r: CallRecord, where: str) -> None:
    """The delta fields alone (whether the pool holds the parent is the pool's check): a full prompt has
    parent -1 and prefix_len 0; a delta names an earlier call and at least one id of it."""
    for name in ("parent", "prefix_len", "prefix_check", "request_prefix"):
        if not isinstance(getattr(r, name), int) or isinstance(getattr(r, name), bool):
            raise InvalidRecord(f"{where}: {name} must be an integer, got {getattr(r, name)!r}")
    if not 0 <= r.prefix_check < 2**32:
        raise InvalidRecord(f"{where}: prefix_check must be a crc32 (0..2^32-1), got {r.prefix_check}")
    if r.request_prefix and (r.parent < 0 or r.request is None or not 0 < r.request_prefix <= INT32_MAX):
        raise InvalidRecord(f"{where}: request_prefix {r.request_prefix} needs a parent call and a request, and "
                            f"lies in 1..{INT32_MAX}")
    if r.parent == -1 and r.prefix_len == 0:
        return
    if not 0 <= r.parent < r.call_index:
        raise InvalidRecord(f"{where}: parent must be an earlier call's index (0..{r.call_index - 1}) or -1, "
                            f"got {r.parent}")
    if not 0 < r.prefix_len <= INT32_MAX:
        raise InvalidRecord(f"{where}: prefix_len must be at least 1 for a delta of call {r.parent}, got {r.prefix_len}")


MAX_REWARD = 1e6  # |value|, |weight| and |value × weight| of one reward at most (pool option max_reward)


def check_reward(r: Reward, bound: float = MAX_REWARD) -> None:
    """A reward the trainer can use: each factor finite, and the weighted value too (1e300 × 1e10 is not), all
    within `bound`."""
    where = f"reward {r.name!r} of {r.session_id!r}"
    for field in ("value", "weight"):
        x = getattr(r, field)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise InvalidRecord(f"{where}: {field} must be a finite number")
        if abs(x) > bound:
            raise InvalidRecord(f"{where}: {field} {x:g} is outside [-{bound:g}, {bound:g}]")
    if not math.isfinite(r.value * r.weight) or abs(r.value * r.weight) > bound:
        raise InvalidRecord(f"{where}: value × weight ({r.value:g} × {r.weight:g}) is outside [-{bound:g}, {bound:g}]")
    if r.step is not None and (not isinstance(r.step, int) or r.step < 0):
        raise InvalidRecord(f"reward {r.name!r} of {r.session_id!r}: step must be a call index >= 0 or None")
    if not r.name:
        raise InvalidRecord(f"reward of {r.session_id!r}: name must be non-empty")


def check_session(info: SessionInfo) -> None:
    for name in ("session_id", "task_id", "harness"):
        if not isinstance(getattr(info, name), str) or not getattr(info, name):
            raise InvalidRecord(f"session {info.session_id!r}: {name} must be a non-empty string")
    if info.status not in SESSION_STATUSES:
        raise InvalidRecord(f"session {info.session_id!r}: status must be one of {SESSION_STATUSES}")
    if info.purpose not in PURPOSES:
        raise InvalidRecord(f"session {info.session_id!r}: purpose must be one of {PURPOSES}, got {info.purpose!r}")
    link = info.metadata.get(FORK_KEY) if isinstance(info.metadata, dict) else None
    if link is not None and not (
        isinstance(link, dict) and set(link) == {"session", "call"} and isinstance(link["session"], str)
        and link["session"] and isinstance(link["call"], int) and not isinstance(link["call"], bool) and link["call"] >= 0
    ):
        raise InvalidRecord(f"session {info.session_id!r}: metadata.{FORK_KEY} must be "
                            '{"session": <session id>, "call": <call index >= 0>}')


def check_end_status(status: str) -> None:
    if status not in END_STATUSES:
        raise InvalidRecord(f"end status must be one of {END_STATUSES}, got {status!r}")
