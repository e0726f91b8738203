"""The wire format of SGLang's native API subset that the engine speaks (requests and results).

Requests are pydantic models (strict: a string where a number belongs is an error, not a guess);
`expand` turns one /generate request into its sequences after the checks a schema cannot do (token
ids inside the vocabulary, prompt plus new tokens inside the context). Every failure is a
`BadRequest`, which the server answers with 400 and the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "AbortRequest", "BadRequest", "GenerateRequest", "PauseRequest", "SamplingParams", "SequenceSpec",
    "UpdateWeightVersionRequest", "UpdateWeightsRequest", "expand",
]


class BadRequest(ValueError):
    """A request the engine refuses; the message says which field and why (HTTP 400)."""


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits; a sample's seed is sampling_seed + j, wrapped
MAX_SEQUENCES = 1024  # prompts x n of one request: each is a sequence the scheduler holds


def _unicode(value: str) -> str:
    """Text must be valid Unicode: JSON's \\ud800 escapes decode to lone surrogates, which neither the
    tokenizer nor the JSON encoder of the answer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParams(_Strict):
    max_new_tokens: int = Field(128, ge=0, description="Tokens to generate at most (SGLang's default 128).")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: no limit.")
    stop: Text | list[Text] | None = Field(None, description="Stop strings; the text is cut before the match.")
    stop_token_ids: list[int] | None = Field(None, description="Extra stop tokens; kept in output_ids.")
    n: int = Field(1, ge=1, le=64, description="Samples per prompt.")
    ignore_eos: bool = False
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes this request's sampling reproducible.")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="Keep the matched stop token/string in `text`.")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateRequest(_Strict):
    input_ids: list[int] | list[list[int]] | None = None
    text: Text | list[Text] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1  # accepted for compatibility; prompt logprobs are not returned
    stream: bool = False
    rid: Text | list[Text] | None = None


class UpdateWeightsRequest(_Strict):
    model_path: Text
    load_format: Text | None = None
    weight_version: Text | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightVersionRequest(_Strict):
    new_version: Text
    abort_all_requests: bool = False


class PauseRequest(_Strict):
    # SGLang's modes: abort in-flight requests (default), keep them frozen with their KV cache
    # (in_place), or put them back in the queue and recompute their KV cache on continue (retract).
    mode: Literal["abort", "in_place", "retract"] = "abort"


class AbortRequest(_Strict):
    rid: Text = ""
    abort_all: bool = False


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate: a prompt and its sampling, at `index` in a batched response."""

    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None  # this sample's seed: sampling_seed + sample number


def expand(req: GenerateRequest, vocab_size: int, context_len: int, encode, new_rid) -> tuple[list[SequenceSpec], bool]:
    """Check a /generate request and list its sequences (prompt i, sample j at index i*n + j).

    encode: text -> ids; new_rid: () -> a fresh request id. Returns (sequences, is_batch).
    """
    prompts, is_batch = _prompts(req, encode)
    params = _per_prompt(req.sampling_params, len(prompts), "sampling_params")
    rids = _per_prompt(req.rid, len(prompts), "rid") if req.rid is not None else [new_rid() for _ in prompts]
    if sum(p.n for p in params) > MAX_SEQUENCES:
        raise BadRequest(f"prompts x sampling_params.n must be at most {MAX_SEQUENCES}")
    specs: list[SequenceSpec] = []
    for i, (ids, p, rid) in enumerate(zip(prompts, params, rids)):
        _check_ids(ids, i if is_batch else None, vocab_size)
        if len(ids) + p.max_new_tokens > context_len:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                             f"context length {context_len}")
        if any(t < 0 or t >= vocab_size for t in p.stop_token_ids or []):
            raise BadRequest(f"sampling_params.stop_token_ids must lie in [0, {vocab_size})")
        if any(s == "" for s in p.stop_strings()):
            raise BadRequest("sampling_params.stop must not contain an empty string")
        for j in range(p.n):
            seed = None if p.sampling_seed is None else (p.sampling_seed + j) % (MAX_SEED + 1)
            sample_rid = rid if p.n == 1 else f"{rid}-{j}"
            specs.append(SequenceSpec(len(specs), sample_rid, ids, p, seed))
    return specs, is_batch or len(specs) > 1


def _prompts(req: GenerateRequest, encode) -> tuple[list[list[int]], bool]:
    if (req.input_ids is None) == (req.text is None):
        raise BadRequest("give exactly one of input_ids or text")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts:
            raise BadRequest("text is an empty list")
        return [encode(t) for t in texts], isinstance(req.text, list)
    ids: Any = req.input_ids
    if not ids:
        raise BadRequest("input_ids is empty")
    return (ids, True) if isinstance(ids[0], list) else ([ids], False)


def _per_prompt(value, count: int, name: str) -> list:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
    return value


def _check_ids(ids: list[int], index: int | None, vocab_size: int) -> None:
    where = "input_ids" if index is None else f"input_ids[{index}]"
    if not ids:
        raise BadRequest(f"{where} is empty")
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
