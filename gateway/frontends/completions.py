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

from gateway.engines import Generation, SamplingParams
from gateway.frontends.chat import StreamOptions, sampling_of
from gateway.frontends.errors import ApiError, error_body, invalid
from gateway.frontends.pipeline import SSE_HEADERS, Core, Exchange, choice_seed, now
from gateway.sessions import Prompt, Session


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
    def __init__(self, core: Core, session: Session, req: CompletionRequest, raw: bytes) -> None:
        self.core, self.session, self.req, self.raw = core, session, req, raw
        self.id = "cmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = req.model or core.settings.model_name

    def prompt(self, source: str | list[int]) -> Prompt:
        if isinstance(source, str):
            return self.session.texts.prompt_for(source)
        return Prompt(np.asarray(source, dtype=np.int32), 0, 0)

    def samplings(self, prompt: Prompt) -> list[SamplingParams]:
        base = replace(sampling_of(self.req.temperature, self.req.top_p, self.req.top_k, self.req.stop, self.req.seed),
                       **self.session.sampling)
        base.max_new_tokens = self.core.max_new_tokens(len(prompt.ids), self.req.max_tokens)
        return [base if base.seed is None else SamplingParams(**{**base.__dict__, "seed": choice_seed(base.seed, i)})
                for i in range(self.req.n)]

    def logprobs(self, ids: list[int], lps: list[float]) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens = [self.core.template.token_text(i) for i in ids]
        top = [{t: lp} if self.req.logprobs else {} for t, lp in zip(tokens, lps)]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": []}

    def choice(self, index: int, gen: Generation, text: str | None = None) -> dict:
        return {"index": index, "text": gen.text if text is None else text,
                "logprobs": self.logprobs(gen.output_ids, gen.logprobs),
                "finish_reason": "length" if gen.truncated else "stop"}

    def answer(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    def exchange(self) -> Exchange:
        return Exchange(self.session, "completions", self.raw)

    def commit(self, ex: Exchange, choice: int, gen: Generation, answer: dict, is_text: bool) -> None:
        self.core.record(ex, choice, gen, answer)
        if is_text:
            self.session.texts.remember(ex.prompt, np.asarray(gen.output_ids, dtype=np.int32), gen.text)


async def handle(core: Core, request: web.Request) -> web.StreamResponse:
    session = core.session_for(request)
    raw, req = await core.parse(CompletionRequest, request)
    if req.echo or req.suffix:
        raise invalid("echo and suffix are not supported", param="echo" if req.echo else "suffix")
    if req.n > core.settings.max_n:
        raise invalid(f"n must be at most {core.settings.max_n}", param="n")
    sources = _prompts(req, core.template.tokenizer.get_vocab_size())
    if len(sources) > core.settings.max_prompts:
        raise invalid(f"a prompt batch holds at most {core.settings.max_prompts} prompts", param="prompt")
    if len(sources) * req.n > core.settings.max_engine_requests:
        raise invalid(f"prompts x n must be at most {core.settings.max_engine_requests}", param="n")
    job = Completions(core, session, req, raw)
    if req.stream:
        if len(sources) != 1:
            raise invalid("streaming takes one prompt", param="prompt")
        return await _stream(job, request, sources[0])
    exchanges = [job.exchange() for _ in sources]  # one per prompt
    prompts = await core.offload(len(raw), lambda: [job.prompt(s) for s in sources])
    for ex, prompt in zip(exchanges, prompts):
        ex.prompt, ex.samplings = prompt, job.samplings(prompt)
    results = await asyncio.gather(*(core.generate(ex) for ex in exchanges))
    choices, flat = [], []
    for i, gens in enumerate(results):
        for j, gen in enumerate(gens):
            choices.append(job.choice(i * req.n + j, gen))
            flat.append((i, j, gen))
    answer = job.answer(choices, sum(len(p.ids) for p in prompts), sum(len(g.output_ids) for *_, g in flat))
    for i, j, gen in flat:
        job.commit(exchanges[i], j, gen, answer, isinstance(sources[i], str))
    for ex, gens in zip(exchanges, results):  # each prompt's own tokens and timings
        core.observe(ex, False, gens)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def _stream(job: Completions, request: web.Request, source: str | list[int]) -> web.StreamResponse:
    core = job.core
    ex = job.exchange()
    timings = ex.timings
    ex.prompt = prompt = await core.offload(len(job.raw), job.prompt, source)
    ex.samplings = samplings = job.samplings(prompt)
    upstream = await core.open_stream(ex)
    include_usage = bool(job.req.stream_options and job.req.stream_options.include_usage)
    response = web.StreamResponse(headers=SSE_HEADERS)
    finals: list[Generation | None] = [None] * len(samplings)

    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def chunk(index: int, text: str, lp: dict | None, finish: str | None) -> bytes:
        body = {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]}
        return event({**body, "usage": None} if include_usage else body)

    try:
        await response.prepare(request)
        async for index, delta in upstream:
            timings.setdefault("first_token", now())
            out = chunk(index, delta.text, job.logprobs(delta.output_ids, delta.logprobs), None)
            if delta.final is not None:
                finals[index] = delta.final
                out += chunk(index, "", None, "length" if delta.final.truncated else "stop")
            await response.write(out)
        if any(f is None for f in finals):
            raise ApiError(502, "engine: the stream ended without a final chunk", code="engine_error")
        gens: list[Generation] = finals  # type: ignore[assignment]
        completion = sum(len(g.output_ids) for g in gens)
        timings["done"] = now()
        # recorded before the last event: the harness holds a whole answer only once its record is durable
        answer = job.answer([job.choice(i, g) for i, g in enumerate(gens)], len(prompt.ids), completion)
        for i, gen in enumerate(gens):
            job.commit(ex, i, gen, answer, isinstance(source, str))
        await core.durable()
        if include_usage:
            await response.write(event({"id": job.id, "object": "text_completion", "created": job.created,
                                        "model": job.model, "choices": [], "usage": {
                                            "prompt_tokens": len(prompt.ids), "completion_tokens": completion,
                                            "total_tokens": len(prompt.ids) + completion}}))
        await response.write(b"data: [DONE]\n\n")
    except ApiError as err:
        try:
            await response.write(b"data: " + orjson.dumps(error_body("openai", err.status, err.message)) + b"\n\n")
        except ConnectionError:
            pass
        return response
    except ConnectionError:
        return response
    finally:
        await upstream.aclose()
    core.observe(ex, True, gens)
    return response
