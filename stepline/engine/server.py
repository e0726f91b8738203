"""The engine's HTTP front: SGLang's native API subset on FastAPI, over one `Scheduler`.

    POST /generate                 input_ids | text (single or batch), sampling_params, return_logprob,
                                   stream (SSE), rid  ->  {text, output_ids, meta_info} (or a list)
    POST /update_weights_from_disk {model_path, weight_version?}; a failed load keeps the old weights;
                                   a delta folder (stepline.weightdelta) is loaded in place, checksum first
    POST /pause_generation {mode}, /continue_generation, /abort_request {rid | abort_all},
         /flush_cache (empties the prefix cache), /update_weight_version {new_version}
    GET  /health, /health_generate, /model_info (= /get_model_info), /get_server_info, /get_weight_version

Errors: malformed JSON, wrong types and impossible values are 400 with {"error": {"message": ...}}.

Limits (stepline.engine.limits): bodies past max_body_bytes are 413, bodies slower than read_timeout
408; with a control token, every route but /generate, /health* and the info routes needs it (401).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoModelForCausalLM, AutoTokenizer

from stepline.engine.deltas import DeltaRefused, apply_delta, prepare_delta
from stepline.engine.limits import BoundedBody, Control
from stepline.engine.options import EngineOptions
from stepline.engine.protocol import (
    AbortRequest,
    BadRequest,
    GenerateRequest,
    PauseRequest,
    UpdateWeightsRequest,
    UpdateWeightVersionRequest,
    expand,
)
from stepline.engine.scheduler import Scheduler, Sequence
from stepline.weightdelta import Delta, read_manifest

__all__ = ["DTYPES", "create_app", "load_model"]

# Weight (and K/V) dtypes the engine serves in. bfloat16 halves the weights read per decode step and
# runs matmuls on the CPU's bf16 units where it has them (avx512_bf16); its logprobs are those of the
# bf16 model (benchmarks/bench_engine.py reports how far they are from float32's).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path: Path | str, dtype: str = "float32"):
    """The model in `path` for inference on CPU, in `dtype` (a key of DTYPES), eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()


def create_app(model_dir: Path | str, options: EngineOptions | None = None) -> FastAPI:
    """The engine as an ASGI app with `options` (stepline.engine.options; None: the defaults); its scheduler
    thread runs while the app's lifespan does."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    o = options or EngineOptions()
    model = load_model(model_dir, o.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scheduler = Scheduler(model, tokenizer, _eos_ids(model, tokenizer), o.weight_version, o.max_running,
                          prefix_cache_bytes=int(o.prefix_cache_mb * 2**20))
    state = _State(scheduler, tokenizer, str(model_dir), o.context_length or model.config.max_position_embeddings,
                   o.incremental_streaming, o.dtype)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="stepline engine", lifespan=lifespan)
    app.state.engine = state
    app.state.control = Control(o.control_token)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # FastAPI's own too (body parse errors)
    app.include_router(router)
    app.add_middleware(BoundedBody, max_bytes=o.max_body_bytes, read_timeout=o.read_timeout)
    return app


class _State:
    def __init__(self, scheduler: Scheduler, tokenizer, model_path: str, context_length: int,
                 incremental: bool, dtype: str) -> None:
        self.scheduler, self.tokenizer, self.model_path, self.dtype = scheduler, tokenizer, model_path, dtype
        self.context_length, self.incremental = context_length, incremental
        self.update_lock = asyncio.Lock()
        # digest table of the weights served (stepline.weightdelta); None: not computed yet (from model_path)
        self.digests: dict[str, bytes] | None = None

    @property
    def vocab_size(self) -> int:
        return self.scheduler.model.config.vocab_size

    def control(self, fn) -> asyncio.Future:
        return asyncio.wrap_future(self.scheduler.call(fn))


router = APIRouter()


def _engine(request: Request) -> _State:
    return request.app.state.engine


def _control(request: Request) -> None:
    request.app.state.control(request)


CONTROL = [Depends(_control)]


@router.post("/generate")
async def generate(req: GenerateRequest, request: Request, st: _State = Depends(_engine)) -> Response:
    # on a worker thread: tokenising a long text must not stall every other request's stream
    specs, is_batch = await run_in_threadpool(expand, req, st.vocab_size, st.context_length, st.tokenizer.encode,
                                              lambda: uuid.uuid4().hex)
    loop, events = asyncio.get_running_loop(), asyncio.Queue[Any]()
    seqs = [Sequence(spec, _notifier(loop, events, spec.index), stream=req.stream) for spec in specs]
    started = time.perf_counter()
    for seq in seqs:
        st.scheduler.submit(seq)
    if req.stream:
        return StreamingResponse(_sse(st, req, seqs, events, started), media_type="text/event-stream")
    try:
        await _until_finished(request, events, len(seqs))
    except asyncio.CancelledError:
        _abort_unfinished(st, seqs)
        raise
    except _ClientGone:
        _abort_unfinished(st, seqs)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    results = [_result(st, req, s, len(s.output_ids), 0, started) for s in seqs]
    return _json(results if is_batch else results[0])

@router.post("/update_weights_from_disk", dependencies=CONTROL)
async def update_weights_from_disk(req: UpdateWeightsRequest, st: _State = Depends(_engine)) -> Response:
    async with st.update_lock:
        old = st.scheduler.model
        try:
            if not Path(req.model_path).is_dir():
                raise BadRequest(f"model_path {req.model_path!r} is not a directory")
            delta = read_manifest(req.model_path)
            if delta is not None:
                return await _update_from_delta(req, delta, st)
            new = await run_in_threadpool(load_model, req.model_path, st.dtype)
            _check_compatible(old, new)
        except Exception as exc:  # the edge: any load failure is the caller's path; old weights stay
            return _json({"success": False, "message": f"Failed to load weights: {exc}"}, 400)
        version = req.weight_version or _bump(st.scheduler.weight_version)

        def swap() -> None:
            if req.abort_all_requests:
                st.scheduler.abort(None, "aborted for a weight update")
            st.scheduler.swap_model(new, version)

        await st.control(swap)
        st.model_path, st.digests = req.model_path, None
    return _json({"success": True, "message": "Succeeded to update model weights.",
                  "num_paused_requests": 0, "weight_version": version})


async def _update_from_delta(req: UpdateWeightsRequest, delta: Delta, st: _State) -> Response:
    """Load a delta in place (stepline.engine.deltas): checked against the full state's checksum before any
    weight is touched; the caller holds the update lock."""
    model = st.scheduler.model
    try:
        tensors, table = await run_in_threadpool(prepare_delta, delta, model, st.digests, st.model_path)
    except DeltaRefused as exc:
        return _json({"success": False, "message": f"Failed to load weights: {exc}"}, 400)
    version = req.weight_version or _bump(st.scheduler.weight_version)

    def swap() -> None:
        if req.abort_all_requests:
            st.scheduler.abort(None, "aborted for a weight update")
        apply_delta(model, tensors)
        st.scheduler.swap_model(model, version)  # the prefix cache holds K/V of the old weights: flushed

    await st.control(swap)
    st.model_path, st.digests = req.model_path, table
    return _json({"success": True, "message": f"Loaded {len(tensors)} changed tensors in place.",
                  "num_paused_requests": 0, "weight_version": version})

@router.post("/update_weight_version", dependencies=CONTROL)
async def update_weight_version(req: UpdateWeightVersionRequest, st: _State = Depends(_engine)) -> Response:
    def set_version() -> None:
        if req.abort_all_requests:
            st.scheduler.abort(None, "aborted for a weight version update")
        st.scheduler.weight_version = req.new_version

    await st.control(set_version)
    return _json({"success": True, "message": "Weight version updated.", "weight_version": req.new_version})

@router.post("/pause_generation", dependencies=CONTROL)
async def pause_generation(req: PauseRequest | None = None, st: _State = Depends(_engine)) -> Response:
    mode = (req or PauseRequest()).mode

    def pause() -> None:
        st.scheduler.paused = True
        if mode == "abort":
            st.scheduler.abort(None, "aborted by pause_generation")
        elif mode == "retract":
            st.scheduler.retract()

    await st.control(pause)
    return _json({"success": True, "message": f"Generation paused ({mode})."})

@router.post("/continue_generation", dependencies=CONTROL)
async def continue_generation(st: _State = Depends(_engine)) -> Response:
    await st.control(lambda: setattr(st.scheduler, "paused", False))
    return _json({"success": True, "message": "Generation continued."})

@router.post("/abort_request", dependencies=CONTROL)
async def abort_request(req: AbortRequest, st: _State = Depends(_engine)) -> Response:
    if not req.abort_all and not req.rid:
        raise BadRequest("give rid or abort_all: true")
    count = await st.control(lambda: st.scheduler.abort(None if req.abort_all else req.rid))
    return _json({"success": True, "aborted": count})

@router.api_route("/flush_cache", methods=["GET", "POST"], dependencies=CONTROL)
async def flush_cache(st: _State = Depends(_engine)) -> Response:
    await st.control(st.scheduler.prefix_cache.clear)  # running sequences keep their own K/V
    return PlainTextResponse("Cache flushed.\n")

@router.get("/health")
@router.get("/health_generate")
async def health() -> Response:
    return Response(status_code=200)

@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(st: _State = Depends(_engine)) -> Response:
    running, waiting = st.scheduler.load
    return _json({"model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
                  "weight_version": st.scheduler.weight_version, "vocab_size": st.vocab_size,
                  "context_length": st.context_length, "paused": st.scheduler.paused,
                  "running_requests": running, "waiting_requests": waiting,
                  "eos_token_ids": sorted(st.scheduler.eos_token_ids),
                  "prefix_cache": st.scheduler.prefix_cache.stats()})


@router.get("/get_server_info")
async def server_info(st: _State = Depends(_engine)) -> Response:
    """The engine's settings and counters (SGLang's route; its fields are the engine's own)."""
    running, waiting = st.scheduler.load
    return _json({"model_path": st.model_path, "dtype": st.dtype,
                  "max_running_requests": st.scheduler.max_running, "context_length": st.context_length,
                  "weight_version": st.scheduler.weight_version, "running_requests": running,
                  "waiting_requests": waiting, "kv_store_bytes": st.scheduler.kv_store_bytes,
                  "prefix_cache": st.scheduler.prefix_cache.stats()})

@router.get("/get_weight_version")
async def get_weight_version(st: _State = Depends(_engine)) -> Response:
    return _json({"weight_version": st.scheduler.weight_version})


class _ClientGone(Exception):
    """The client closed the connection before its result was ready (its sequences are aborted)."""


async def _until_finished(request: Request, events: asyncio.Queue, count: int) -> None:
    """Wait for `count` finish notifications (one per sequence), checking every second that the
    client is still there, so an abandoned request stops holding a batch slot."""
    while count:
        try:
            await asyncio.wait_for(events.get(), timeout=1.0)
            count -= 1
        except TimeoutError:
            if await request.is_disconnected():
                raise _ClientGone from None


async def _sse(st: _State, req: GenerateRequest, seqs: list[Sequence], events: asyncio.Queue, started: float):
    """SSE chunks: cumulative (SGLang's default) or, behind the server flag, only what is new."""
    sent = [0] * len(seqs)
    done = 0
    try:
        while done < len(seqs):
            index, n = await events.get()
            seq = seqs[index]
            if sent[index] < 0:
                continue  # already finished; a stale notification
            finished = seq.finished and n == len(seq.output_ids)
            chunk = _result(st, req, seq, n, sent[index] if st.incremental else 0, started,
                            final=finished, index=index)
            sent[index] = -1 if finished else n
            done += finished
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        _abort_unfinished(st, seqs)


def _result(st: _State, req: GenerateRequest, seq: Sequence, n: int, start: int, started: float,
            final: bool = True, index: int | None = None) -> dict[str, Any]:
    """One sequence's result over its output tokens [start, n) (start > 0 only for incremental chunks)."""
    reason = seq.finish_reason if final else None
    p = seq.spec.params
    ids = seq.output_ids[:n]
    text_ids = ids[:-1] if reason and isinstance(reason.get("matched"), int) and not p.no_stop_trim else ids
    text = st.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
    if reason and seq.stop_text_at is not None:
        text = text[: seq.stop_text_at]
    if start:
        # Incremental chunks: the text since the previous chunk. Decoding the prefix again keeps
        # multi-byte characters split across tokens intact.
        text = text[len(st.tokenizer.decode(ids[:start], skip_special_tokens=p.skip_special_tokens)):]
    meta: dict[str, Any] = {
        "id": seq.spec.rid, "finish_reason": reason, "prompt_tokens": len(seq.spec.prompt_ids),
        "completion_tokens": n, "cached_tokens": seq.cached_tokens, "weight_version": seq.weight_version,
        "e2e_latency": time.perf_counter() - started,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, st.tokenizer.decode([tok]) if req.return_text_in_logprobs else None]
            for lp, tok in zip(seq.logprobs[start:n], ids[start:])
        ]
    out = {"text": text, "output_ids": ids[start:], "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def _notifier(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    def notify(tokens: int) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(events.put_nowait, (index, tokens))

    return notify


def _abort_unfinished(st: _State, seqs: list[Sequence]) -> None:
    rids = {s.spec.rid for s in seqs if not s.finished}
    if rids:
        st.scheduler.call(lambda: [st.scheduler.abort(rid, "client disconnected") for rid in rids])


def _check_compatible(old, new) -> None:
    old_shapes = {k: tuple(v.shape) for k, v in old.state_dict().items()}
    new_shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
    if old_shapes != new_shapes:
        diff = sorted(set(old_shapes.items()) ^ set(new_shapes.items()))[:3]
        raise BadRequest(f"weights do not match the served architecture (e.g. {diff})")


def _bump(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else version + "+1"


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return sorted({i for i in itertools.chain(ids, [model.config.eos_token_id, tokenizer.eos_token_id])
                   if i is not None})


def _json(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        return _json({"error": {"message": "the request body is not valid JSON", "type": "BadRequest"}}, 400)
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors[:5])
    return _json({"error": {"message": f"invalid request: {problems}", "type": "BadRequest"}}, 400)


async def _bad_request(request: Request, exc: BadRequest) -> Response:
    return _json({"error": {"message": str(exc), "type": "BadRequest"}}, 400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    kind = "Unauthorized" if exc.status_code == 401 else "BadRequest"
    return _json({"error": {"message": str(exc.detail), "type": kind}}, exc.status_code)

