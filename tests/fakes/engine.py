"""`FakeEngine`: a real HTTP server speaking SGLang's `/generate` (or vLLM's `/v1/completions`) wire
format with outputs chosen by the test. Used by the tests and the gateway's benchmark.

    async with FakeEngine(script=[Scripted([5, 6, 2])], eos_id=2) as url: ...

Each `/generate` takes the next `Scripted` output (or, when the script is empty, `default_tokens`
ids derived from the prompt length and the folder loaded last, so loading other weights changes them,
the last one EOS when `eos_id` is set), then applies the request's
sampling parameters the way an engine does:
cut after the first stop token id / EOS (finish "stop", matched = that id, the id kept in output_ids,
left out of the text), else cut at max_new_tokens (finish "length"). Logprobs default to
-(k + 1) / 100 for the k-th output token, so a test can check which logprob went with which id.
While paused (`/pause_generation`, vLLM's `/pause`), new generations wait for the resume, as in the
engines (with `max_running`, at most that many sequences compute their `latency` at once and the rest queue, as in an
engine's batch); a pause in mode `abort` (the default of both) also ends the streams running then, after the
tokens sent so far, with finish reason "abort". `model_path` and `context_length` are what `/get_model_info`, `/get_server_info` and vLLM's
`/v1/models` (`root`, `max_model_len`) report; with `model_path` set, a weight update checks the folder
against it (`stepline.gateway.engines.checkpoint`) and refuses one that does not fit, keeping the old weights.

Run standalone (for benchmarks and process tests): `python tests/fakes/engine.py --port 30000 --tokens 16`.
"""

from __future__ import annotations

import argparse
import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from stepline.datapool.base import Pool


@dataclass
class Scripted:
    output_ids: list[int]
    logprobs: list[float] | None = None  # default -(k + 1) / 100
    text: str | None = None  # the text without a matched stop token; default decode(output_ids)
    finish_reason: str = "stop"  # used when neither a stop token nor max_new_tokens cut the output


@dataclass
class _Result:
    ids: list[int]
    logprobs: list[float]
    text: str
    finish: dict[str, Any]


def _default_decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


@dataclass
class FakeEngine:
    script: Iterable[Scripted] = ()
    api: str = "sglang"  # "sglang" (/generate, also the built-in engine's format) | "vllm"
    eos_id: int | None = None
    default_tokens: int = 8
    latency: float = 0.0  # seconds before the answer (or the first stream event)
    max_running: int | None = None  # sequences computing their `latency` at once, the rest queue in order (an
    # engine's batch slots: SGLang's --max-running-requests, vLLM's --max-num-seqs); None: unbounded
    token_delay: float = 0.0  # seconds between stream events
    incremental: bool = False  # SGLang --incremental-streaming-output (default: cumulative events)
    decode: Callable[[list[int]], str] = _default_decode
    fail_next: list[int] = field(default_factory=list)  # HTTP statuses to answer the next calls with
    fail_updates: int = 0  # weight updates to refuse (success: false) before accepting
    update_delay: float = 0.0
    model_name: str = "fake-model"
    model_path: str | None = None  # reported as the served model's folder
    context_length: int | None = None  # reported as the engine's context limit
    keep_requests: bool = True  # keep every request body in `requests` (off for benchmarks)
    worker_extension: bool = True  # vLLM: started with Stepline's worker extension (`stepline_load`)
    # observable state
    weight_version: int = 0
    paused: bool = False
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body) of each call
    events: list[str] = field(default_factory=list)  # "generate", "pause", "update:<v>", "resume", in order
    version_label: str | None = None  # vLLM's own weight version (/update_weight_version)
    in_flight: int = 0
    max_in_flight: int = 0
    aborted: int = 0  # streams a pause in mode abort ended early

    def __post_init__(self) -> None:
        self.queue: deque[Scripted] = deque(self.script)
        self.loaded = self.model_path  # the weights folder serving now
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborts = 0  # pauses in mode abort so far: a stream started before one ends early
        self._runner: web.AppRunner | None = None
        self._batch = asyncio.Semaphore(self.max_running) if self.max_running else None
        self.url = ""

    # --- lifecycle ---
    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        if self.api == "vllm":
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/collective_rpc", self._collective_rpc)
            app.router.add_post("/reset_prefix_cache", self._ok)
            app.router.add_post("/pause", self._pause)
            app.router.add_post("/resume", self._continue)
            app.router.add_post("/update_weight_version", self._update_weight_version)
            app.router.add_get("/weight_info", self._weight_info)
        else:
            app.router.add_get("/get_model_info", self._model_info)
            app.router.add_get("/get_server_info", self._model_info)
            app.router.add_post("/flush_cache", self._ok)
            app.router.add_post("/generate", self._generate)
            app.router.add_post("/update_weights_from_disk", self._update_weights)
            app.router.add_post("/pause_generation", self._pause)
            app.router.add_post("/continue_generation", self._continue)
        # handler_cancellation: like a real engine, a request whose client hung up stops (and is counted out)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def shift(self) -> int:
        """How far the default ids move with the weights loaded: 0 for `model_path`'s own."""
        if self.loaded is None or self.loaded == self.model_path:
            return 0
        return 7 * (zlib.crc32(self.loaded.encode()) % 97 + 1)

    def _refusal(self, path: str) -> str | None:
        """Why the folder cannot be loaded (None: it can, or there is no model_path to check it against)."""
        if self.model_path is None:
            return None
        from stepline.gateway.engines.checkpoint import CheckpointInvalid, check_checkpoint, signature

        try:
            check_checkpoint(path, signature(self.model_path))
        except CheckpointInvalid as exc:
            return exc.message
        return None

    # --- the sampling a real engine would do ---
    def _sample(self, input_ids: list[int], params: dict[str, Any]) -> _Result:
        scripted = self.queue.popleft() if self.queue else None
        if scripted is None:  # n ids derived from the prompt length; the last one is EOS when there is one
            base, n = len(input_ids), self.default_tokens - (self.eos_id is not None)
            tail = [self.eos_id] if self.eos_id is not None else []
            shift = self.shift()
            scripted = Scripted([10 + (base + k + shift) % 1000 for k in range(n)] + tail, finish_reason="length")
        ids = list(scripted.output_ids)
        lps = list(scripted.logprobs) if scripted.logprobs is not None else [-(k + 1) / 100 for k in range(len(ids))]
        stops = set(params.get("stop_token_ids") or [])
        if self.eos_id is not None and not params.get("ignore_eos"):
            stops.add(self.eos_id)
        finish: dict[str, Any] = {"type": scripted.finish_reason, "matched": None}
        shown = ids
        for k, tok in enumerate(ids):
            if tok in stops:
                ids, lps, shown = ids[: k + 1], lps[: k + 1], ids[:k]
                finish = {"type": "stop", "matched": tok}
                break
        limit = int(params.get("max_new_tokens", params.get("max_tokens", 256)) or 0)
        if len(ids) > limit:
            ids, lps, shown = ids[:limit], lps[:limit], shown[:limit]
            finish = {"type": "length", "length": limit}
        cut_by_length = finish["type"] == "length" and len(shown) < len(scripted.output_ids)
        text = scripted.text if scripted.text is not None and not cut_by_length else self.decode(shown)
        return _Result(ids, lps, text, finish)

    def _meta(self, res: _Result, n: int, prompt_len: int, final: bool) -> dict[str, Any]:
        return {
            "finish_reason": res.finish if final else None,
            "prompt_tokens": prompt_len,
            "completion_tokens": n,
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(res.logprobs[:n], res.ids[:n])],
            "weight_version": str(self.weight_version),
        }

    async def _begin(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        body = orjson.loads(await request.read())
        if self.keep_requests:
            self.requests.append((request.path, body))
            self.events.append("generate")
        if self.fail_next:
            status = self.fail_next.pop(0)
            return body, web.json_response({"error": {"message": f"scripted failure {status}"}}, status=status)
        if self.latency:
            if self._batch is None:
                await asyncio.sleep(self.latency)
            else:
                async with self._batch:
                    await asyncio.sleep(self.latency)
        await self._resumed.wait()
        return body, None

    # --- SGLang /generate ---
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body, failure = await self._begin(request)
            if failure is not None:
                return failure
            ids_in = body["input_ids"]
            res = self._sample(ids_in, body.get("sampling_params") or {})
            if not body.get("stream"):
                out = {
                    "text": res.text,
                    "output_ids": res.ids,
                    "meta_info": self._meta(res, len(res.ids), len(ids_in), True),
                }
                return web.Response(body=orjson.dumps(out), content_type="application/json")
            return await self._sglang_stream(request, res, len(ids_in))
        finally:
            self.in_flight -= 1

    async def _sglang_stream(self, request: web.Request, res: _Result, prompt_len: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n_text, epoch = len(res.text), self._aborts
        for n in range(1, len(res.ids) + 1):
            if self._aborts != epoch:  # a pause aborted it: the tokens sent so far, then the end
                cut = self._cut(res, n - 1)
                meta = self._meta(cut, n - 1, prompt_len, True)
                if self.incremental:
                    meta["output_token_logprobs"] = []
                event: dict[str, Any] = {"text": "" if self.incremental else cut.text,
                                         "output_ids": [] if self.incremental else cut.ids, "meta_info": meta}
                await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
                break
            final = n == len(res.ids)
            # the text is revealed in proportion to the tokens (all of it on the last event)
            upto = n_text if final else n_text * n // max(len(res.ids), 1)
            meta = self._meta(res, n, prompt_len, final)
            if self.incremental:
                prev = n_text * (n - 1) // max(len(res.ids), 1)
                event = {
                    "text": res.text[prev:upto],
                    "output_ids": res.ids[n - 1 : n],
                    "meta_info": {**meta, "output_token_logprobs": meta["output_token_logprobs"][n - 1 :]},
                }
            else:
                event = {"text": res.text[:upto], "output_ids": res.ids[:n], "meta_info": meta}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
            if self.token_delay and not final:
                await asyncio.sleep(self.token_delay)
        if not res.ids:
            event = {"text": res.text, "output_ids": [], "meta_info": self._meta(res, 0, prompt_len, True)}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.requests.append((request.path, body))
        if self.update_delay:
            await asyncio.sleep(self.update_delay)
        if self.fail_updates > 0:
            self.fail_updates -= 1
            return web.json_response({"success": False, "message": f"cannot load {body.get('model_path')}"}, status=400)
        refusal = self._refusal(str(body.get("model_path")))
        if refusal is not None:
            return web.json_response({"success": False, "message": refusal}, status=400)
        self.loaded = str(body.get("model_path"))
        self.weight_version = int(body.get("weight_version", self.weight_version + 1))
        self.events.append(f"update:{self.weight_version}")
        return web.json_response({"success": True, "message": "ok"})

    async def _pause(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read() or b"{}")
        if request.query.get("mode", body.get("mode", "abort")) == "abort":
            self._aborts += 1
        self.paused = True
        self._resumed.clear()
        self.events.append("pause")
        return web.json_response({"success": True})

    def _cut(self, res: _Result, n: int) -> _Result:
        """`res` ended by an abort after n tokens."""
        self.aborted += 1
        return _Result(res.ids[:n], res.logprobs[:n], self.decode(res.ids[:n]), {"type": "abort", "message": "paused"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        self.events.append("resume")
        return web.json_response({"success": True})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "context_length": self.context_length,
                                  "weight_version": str(self.weight_version)})

    # --- vLLM /v1/completions ---
    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "root": self.model_path, "max_model_len": self.context_length}
        return web.json_response({"object": "list", "data": [card]})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.requests.append((request.path, body))
        if self.fail_updates > 0:
            self.fail_updates -= 1
            return web.json_response({"error": "reload failed"}, status=500)
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method == "stepline_load" and self.worker_extension:  # Stepline's worker extension: a refusal is an answer, not a failure
            path = kwargs["path"]
            if self._refusal(path) is not None:
                return web.json_response({"results": [{"ok": False, "message": self._refusal(path)}]})
        elif method == "reload_weights":
            path = kwargs.get("weights_path")
            if path is not None and self._refusal(path) is not None:  # vLLM half-loads, then dies
                return web.json_response({"error": f"reload failed: {self._refusal(path)}"}, status=500)
        else:
            return web.json_response({"error": f"Method {method!r} is not implemented."}, status=500)
        self.loaded = path
        self.weight_version += 1  # as vLLM's reload_weights: loaded; its label is set apart
        self.events.append(f"update:{self.weight_version}")
        return web.json_response({"results": [{"ok": True, "loaded": 0} if method == "stepline_load" else None]})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.requests.append((request.path, body))
        self.version_label = str(body["new_version"])
        return web.json_response({"success": True, "new_version": self.version_label})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version_label})

    def _vllm_choice(self, res: _Result, ids: list[int], lps: list[float], text: str, final: bool) -> dict[str, Any]:
        finish = res.finish["type"] if final else None
        return {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "logprobs": {
                "tokens": [f"<{t}>" for t in ids],
                "token_logprobs": lps,
                "top_logprobs": None,
                "text_offset": [],
            },
            "finish_reason": finish,
            "stop_reason": res.finish.get("matched") if final and res.finish.get("matched") != self.eos_id else None,
        }

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._complete(request)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body, failure = await self._begin(request)
        if failure is not None:
            return failure
        prompt = body["prompt"]
        res = self._sample(prompt, body)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(res.ids),
            "total_tokens": len(prompt) + len(res.ids),
        }
        if not body.get("stream"):
            out = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": self.model_name,
                "choices": [self._vllm_choice(res, res.ids, res.logprobs, res.text, True)],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(out), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n_text, n_ids, epoch = len(res.text), max(len(res.ids), 1), self._aborts
        for k in range(len(res.ids)):
            if self._aborts != epoch:  # a pause aborted it: the end, after the tokens sent so far
                choice = self._vllm_choice(self._cut(res, k), [], [], "", True)
                await resp.write(b"data: " + orjson.dumps({"choices": [choice], "usage": None}) + b"\n\n")
                usage = {**usage, "completion_tokens": k, "total_tokens": len(prompt) + k}
                break
            final = k == len(res.ids) - 1
            text = res.text[n_text * k // n_ids : (n_text if final else n_text * (k + 1) // n_ids)]
            choice = self._vllm_choice(res, res.ids[k : k + 1], res.logprobs[k : k + 1], text, final)
            await resp.write(b"data: " + orjson.dumps({"choices": [choice], "usage": None}) + b"\n\n")
            if self.token_delay and not final:
                await asyncio.sleep(self.token_delay)
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def recording_gateway(model_dir: Path, engine_url: str, pool_db: Path, kind: str = "builtin",
                            admin_token: str = "adm") -> AsyncIterator[tuple[str, Pool]]:
    """A real gateway on a free port in front of `engine_url`, recording into an SQLite pool at `pool_db`;
    yields (gateway URL, the pool) and closes both on exit. For tests of the components above the gateway."""
    from stepline.datapool import open_pool
    from stepline.gateway.cli import running_gateway
    from stepline.gateway.config import GatewaySettings

    pool = open_pool(f"sqlite:///{pool_db}")
    try:
        async with running_gateway(GatewaySettings(port=0, admin_token=admin_token), [engine_url], model_dir, pool,
                                   engine_kind=kind) as gw:
            yield gw.url, pool
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a FakeEngine (SGLang /generate wire format).")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per call")
    parser.add_argument("--eos", type=int, default=None, help="EOS id ending each default output")
    parser.add_argument("--api", default="sglang", choices=["sglang", "vllm"])
    parser.add_argument("--latency", type=float, default=0.0, help="seconds each sequence computes")
    parser.add_argument("--max-running", type=int, default=None, help="sequences computing at once (the rest queue)")
    args = parser.parse_args()

    async def serve() -> None:
        engine = FakeEngine(api=args.api, default_tokens=args.tokens, eos_id=args.eos, keep_requests=False,
                            latency=args.latency, max_running=args.max_running)
        url = await engine.start(args.host, args.port)
        print(f"fake engine on {url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
