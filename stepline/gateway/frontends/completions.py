"""OpenAI Completions: `POST /v1/completions`, prompt as text, token ids, or a batch of either.

A text prompt that begins with an earlier call's prompt + answer text reuses that call's ids
(`TextMemory`); token-id prompts go to the engine as given. No chat template, no parsing.
`logprobs: k` returns the sampled token's logprob (`top_logprobs` lists only that token).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, cast

import numpy as np
import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from stepline.gateway.engines import Generation, SamplingParams, StreamDelta
from stepline.gateway.frontends.chat import StreamOptions, sampling_of
from stepline.gateway.frontends.edge import Edge
from stepline.gateway.frontends.errors import ApiError, error_body, invalid
from stepline.gateway.frontends.exchange import Choice, Exchange, usage
from stepline.gateway.frontends.prompting import Prompting, choice_seed
from stepline.gateway.frontends.stages import PlainText, Stages
from stepline.gateway.parsers.base import Event, ParsedOutput
from stepline.gateway.sessions import Prompt, Session


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = ""
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def _prompts(req: CompletionRequest, vocab: int) -> list[str | list[int]]:
    p = req.prompt
    batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(cast(list[str | list[int]], p))
    if not batch or any(len(x) == 0 for x in batch):
        raise invalid("prompt must not be empty", param="prompt")
    for ids in batch:
        if not isinstance(ids, str) and any(i < 0 or i >= vocab for i in ids):
            raise invalid(f"prompt token ids must lie in [0, {vocab})", param="prompt")
    return batch


class Completions:
    def __init__(self, prompting: Prompting, session: Session, req: CompletionRequest, raw: bytes) -> None:
        self.prompting, self.session, self.req, self.raw = prompting, session, req, raw
        self.id = "cmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = req.model or prompting.model_name

    def prompt(self, source: str | list[int]) -> Prompt:
        if isinstance(source, str):
            return self.session.texts.prompt_for(source)
        return Prompt(np.asarray(source, dtype=np.int32), 0, 0)

    def samplings(self, prompt: Prompt) -> list[SamplingParams]:
        base = replace(sampling_of(self.req.temperature, self.req.top_p, self.req.top_k, self.req.stop, self.req.seed),
                       **self.session.sampling)
        base.max_new_tokens = self.prompting.max_new_tokens(len(prompt.ids), self.req.max_tokens)
        return [base if base.seed is None else SamplingParams(**{**base.__dict__, "seed": choice_seed(base.seed, i)})
                for i in range(self.req.n)]

    def logprobs(self, ids: list[int], lps: list[float]) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens = [self.prompting.template.token_text(i) for i in ids]
        top = [{t: lp} if self.req.logprobs else {} for t, lp in zip(tokens, lps)]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": []}

    def choice(self, index: int, gen: Generation) -> dict:
        return {"index": index, "text": gen.text, "logprobs": self.logprobs(gen.output_ids, gen.logprobs),
                "finish_reason": finish_reason(gen)}

    def answer(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    def exchange(self) -> Exchange:
        return Exchange(self.session, "completions", self.raw)


def finish_reason(gen: Generation) -> str:
    return "length" if gen.truncated else "stop"


def remember_text(ex: Exchange, choice: Choice) -> None:
    """Completions' memory of turns: a text prompt + its answer text (`TextMemory`); an id prompt has no text."""
    if ex.prompt.text:
        gen = choice.generation
        ex.session.texts.remember(ex.prompt, np.asarray(gen.output_ids, dtype=np.int32), gen.text)


def _plain(gen: Generation) -> ParsedOutput:
    return ParsedOutput(content=gen.text, reasoning=None, tool_calls=[])  # as `PlainText` parses it


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class TextEmitter:
    """A Completions stream, as the stages' `Emitter`: a `text_completion` chunk per engine delta (its
    text and logprobs as sent: nothing is parsed), one with each choice's finish reason, the usage event."""

    def __init__(self, job: Completions, include_usage: bool) -> None:
        self.job = job
        self.include_usage = include_usage

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> bytes:
        job = self.job
        body = {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        return _event({**body, "usage": None} if self.include_usage else body)

    def answer(self, choices: list[Choice], prompt: Prompt) -> dict:
        return self.job.answer([self.job.choice(c.index, c.generation) for c in choices],
                               *usage(prompt, choices))

    def start(self, prompt: Prompt) -> bytes:
        return b""

    def events(self, index: int, events: list[Event], delta: StreamDelta) -> bytes:
        return self._chunk(index, delta.text, self.job.logprobs(delta.output_ids, delta.logprobs), None)

    def finish(self, index: int, final: Generation, parsed: ParsedOutput) -> bytes:
        return self._chunk(index, "", None, finish_reason(final))

    def end(self, choices: list[Choice], prompt: Prompt) -> bytes:
        tail = _event(self.job.answer([], *usage(prompt, choices))) if self.include_usage else b""
        return tail + b"data: [DONE]\n\n"

    def error(self, err: ApiError) -> bytes:
        return _event(error_body("openai", err.status, err.message, err.param, err.code))


async def handle(edge: Edge, stages: Stages, request: web.Request) -> web.StreamResponse:
    session = edge.session_for(request)
    raw, req = await edge.parse(CompletionRequest, request)
    if req.echo or req.suffix:
        raise invalid("echo and suffix are not supported", param="echo" if req.echo else "suffix")
    limits = edge.limits
    if req.n > limits.max_n:
        raise invalid(f"n must be at most {limits.max_n}", param="n")
    sources = _prompts(req, stages.prompting.template.tokenizer.get_vocab_size())
    if len(sources) > limits.max_prompts:
        raise invalid(f"a prompt batch holds at most {limits.max_prompts} prompts", param="prompt")
    if len(sources) * req.n > limits.max_engine_requests:
        raise invalid(f"prompts x n must be at most {limits.max_engine_requests}", param="n")
    job = Completions(stages.prompting, session, req, raw)
    if req.stream:
        if len(sources) != 1:
            raise invalid("streaming takes one prompt", param="prompt")
        return await _stream(stages, job, request, sources[0])
    exchanges = [job.exchange() for _ in sources]  # one per prompt
    prompts = await stages.offload(len(raw), lambda: [job.prompt(s) for s in sources])
    for ex, prompt in zip(exchanges, prompts):
        ex.prompt, ex.samplings = prompt, job.samplings(prompt)
    results = await asyncio.gather(*(stages.dispatch.generate(ex) for ex in exchanges))
    choices = [job.choice(i * req.n + j, gen) for i, gens in enumerate(results) for j, gen in enumerate(gens)]
    completion = sum(len(gen.output_ids) for gens in results for gen in gens)
    answer = job.answer(choices, sum(len(p.ids) for p in prompts), completion)
    for ex, gens in zip(exchanges, results):  # each prompt's records, and its own tokens and timings
        stages.ledger.commit(ex, [Choice(j, gen, _plain(gen)) for j, gen in enumerate(gens)], answer, remember_text)
        stages.ledger.observe(ex, False, gens)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def _stream(stages: Stages, job: Completions, request: web.Request, source: str | list[int]) -> web.StreamResponse:
    ex = job.exchange()
    ex.prompt = await stages.offload(len(job.raw), job.prompt, source)
    ex.samplings = job.samplings(ex.prompt)
    emitter = TextEmitter(job, bool(job.req.stream_options and job.req.stream_options.include_usage))
    parsers = [PlainText() for _ in ex.samplings]
    return await stages.stream_exchange(request, ex, emitter, parsers, remember_text)
