"""vLLM adapter: token-id prompts on the OpenAI `/v1/completions` endpoint.

Request `{"model", "prompt": [ids], "max_tokens", ..., "logprobs": 1, "return_token_ids": true}`;
the choice carries `token_ids` (the sampled ids, a stop token / EOS included), `logprobs.token_logprobs`,
`finish_reason` and `stop_reason` (the matched stop string or id; null for EOS). Streams are incremental.

Logprobs: vLLM V1 returns the raw model's logprobs unless the server runs with
`--logprobs-mode processed_logprobs` (after temperature / top-p), which is what an RL ratio needs.

Weight updates need the server's development endpoints (`VLLM_SERVER_DEV_MODE=1`; checked on vLLM 0.32) and
Stepline's worker extension (`--worker-extension-cls stepline.engine.vllm_worker.SteplineWorker`, which
`stepline run`/`up` pass):
1. the pushed folder is checked first (`stepline.gateway.engines.checkpoint`: every tensor's name, shape and
   dtype from the safetensors headers against the served model's; a delta folder, stepline.weightdelta, holds
   some of them), because the load is in place: a broken checkpoint would leave vLLM half-loaded;
2. `POST /pause?mode=abort` (SGLang's default mode too; the gateway has drained its own calls already);
3. `POST /collective_rpc {"method": "stepline_load", "kwargs": {"path": DIR}}`: the extension copies the
   folder's tensors into the running model, a tied LM head included, and checks a delta's checksum first
   (a refusal is a 400: the trainer then pushes the full weights);
4. `POST /reset_prefix_cache`, `POST /update_weight_version {"new_version": "<version>"}`;
5. `POST /resume` (the weight gate calls it whether the update worked or not).
A vLLM started without the extension gets vLLM's own `reload_weights(weights_path=DIR)` for full folders of
untied models, and a refusal for the rest: vLLM 0.32's reload keeps the LM head it started with, so a tied
model would serve a mix of two policies.
Without dev mode `/collective_rpc` is a 404, answered with an error that says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from stepline.gateway.engines.base import (
    EngineError,
    EngineInfo,
    EngineRejected,
    Generation,
    SamplingParams,
    StreamDelta,
    Transport,
)
from stepline.gateway.engines.checkpoint import CheckpointInvalid, Signature, check_checkpoint, signature
from stepline.weightdelta import read_manifest

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
WORKER_EXTENSION = "stepline.engine.vllm_worker.SteplineWorker"  # what --worker-extension-cls names


class VLLMEngine:
    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession,
        timeout: float = 600.0,
        model: str | None = None,
        model_dir: Path | str | None = None,
        pause_mode: str = "abort",
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        self.url = url.rstrip("/")
        self.kind = "vllm"
        self.transport = Transport(http, self.url, timeout)
        self.model = model  # the served model name; asked from /v1/models on first use when None
        self.model_dir = Path(model_dir) if model_dir is not None else None  # the served model's tensors
        self.pause_mode = pause_mode
        self.version = 0
        self._expected: Signature | None = None
        self._tied = False  # the served model ties its LM head to the embedding
        self._extension: bool | None = None  # vLLM runs Stepline's worker extension (None: not asked yet)

    async def _model_card(self) -> dict[str, Any]:
        data = await self.transport.get_json("/v1/models")
        try:
            return dict(data["data"][0])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"/v1/models lists no model: {data!r:.200}", self.url) from exc

    async def _model_name(self) -> str:
        if self.model is None:
            self.model = str((await self._model_card())["id"])
        return self.model

    async def _request(self, input_ids: list[int], sampling: SamplingParams, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": await self._model_name(),
            "prompt": input_ids,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": stream,
        }
        if sampling.stop:
            body["stop"] = sampling.stop
        if sampling.stop_token_ids:
            body["stop_token_ids"] = sampling.stop_token_ids
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        out = await self.transport.post_json("/v1/completions", await self._request(input_ids, sampling, False))
        try:
            choice = out["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(
                f"malformed /v1/completions answer (return_token_ids needs vLLM >= 0.10.2): {exc!r}", self.url
            ) from exc
        prompt_tokens = int((out.get("usage") or {}).get("prompt_tokens", len(input_ids)))
        return self._generation(ids, logprobs, choice.get("text", ""), choice, prompt_tokens)

    def _generation(
        self, ids: list[int], logprobs: list[float], text: str, choice: dict, prompt_tokens: int
    ) -> Generation:
        if len(logprobs) != len(ids):
            raise EngineError(f"{len(ids)} output ids but {len(logprobs)} logprobs", self.url)
        reason = str(choice.get("finish_reason") or "abort")
        matched = choice.get("stop_reason")
        if reason == "stop" and matched is None and ids:
            matched = ids[-1]  # stopped on EOS: vLLM leaves stop_reason empty
        return Generation(ids, logprobs, text, reason, matched, prompt_tokens, self.version)

    async def stream(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        finished: dict[str, Any] | None = None
        events = self.transport.sse("/v1/completions", await self._request(input_ids, sampling, True))
        try:
            async for event in events:
                for choice in event.get("choices") or []:
                    new_ids = [int(t) for t in choice.get("token_ids") or []]
                    new_lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                    new_text = choice.get("text", "")
                    ids += new_ids
                    logprobs += new_lps
                    text += new_text
                    if choice.get("finish_reason") is not None:
                        finished = choice
                    if new_ids or new_text:
                        yield StreamDelta(new_ids, new_lps, new_text)
                usage = event.get("usage")
                if finished is not None and usage:
                    break
        finally:
            await events.aclose()
        if finished is None:
            raise EngineError("engine stream ended without a finish reason", self.url)
        final = self._generation(ids, logprobs, text, finished, len(input_ids))
        yield StreamDelta([], [], "", final=final)

    async def health(self) -> bool:
        return await self.transport.get_ok("/health")

    async def info(self) -> EngineInfo:
        """/v1/models: `root` (the model path) and `max_model_len`; /weight_info (dev mode) the version."""
        card = await self._model_card()
        version = await self._optional_get("/weight_info")
        return EngineInfo(
            model_path=str(card.get("root") or card.get("id") or "") or None,
            context_length=int(card["max_model_len"]) if card.get("max_model_len") else None,
            weight_version=str(version["weight_version"]) if isinstance(version, dict) else None,
        )

    async def pause(self) -> None:
        """vLLM's `/pause` (new requests wait in vLLM until `/resume`); a vLLM without it (404) is fine:
        the gateway has already drained its own in-flight calls."""
        await self._optional_post(f"/pause?mode={self.pause_mode}", {})

    async def resume(self) -> None:
        await self._optional_post("/resume", {})

    async def update_weights(self, path: str, version: int) -> None:
        """Check the folder, load it in place through the worker extension, then set vLLM's version."""
        expected = await self._expected_signature()
        try:
            delta = await asyncio.to_thread(read_manifest, path)
        except ValueError as exc:
            raise CheckpointInvalid(str(exc), self.url) from None
        await asyncio.to_thread(check_checkpoint, path, expected, delta is not None)
        if not await self._extension_load(path):
            if delta is not None or self._tied:
                raise EngineRejected(
                    f"vLLM runs without Stepline's worker extension (--worker-extension-cls {WORKER_EXTENSION}): "
                    "it cannot load a delta, nor a model with tied word embeddings, in place", self.url)
            await self._rpc("reload_weights", {"weights_path": str(path)})
        self.version = version
        await self._optional_post("/reset_prefix_cache", {})  # cached KV was computed with the old weights
        await self._optional_post("/update_weight_version", {"new_version": str(version)})

    async def _extension_load(self, path: str) -> bool:
        """`stepline_load` on every worker; False when vLLM has no such method (started without the extension)."""
        if self._extension is False:
            return False
        try:
            answer = await self._rpc("stepline_load", {"path": str(path)})
        except EngineError as exc:
            if "not implemented" not in str(exc):
                raise
            self._extension = False
            return False
        self._extension = True
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineError(f"stepline_load answered {answer!r:.200}", self.url)
        refused = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if refused:
            message = refused[0].get("message") if isinstance(refused[0], dict) else refused[0]
            raise EngineRejected(f"weights refused: {message}", self.url)
        return True

    async def _rpc(self, method: str, kwargs: dict[str, str]) -> Any:
        timeout = max(self.transport.timeout.total or 0, 600.0)
        body = {"method": method, "kwargs": kwargs, "timeout": timeout}
        try:
            return await self.transport.post_json("/collective_rpc", body, timeout=timeout)
        except EngineRejected as exc:
            if exc.upstream_status == 404:
                raise EngineError(
                    "vLLM has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1, "
                    "or restart it on the new checkpoint",
                    self.url,
                ) from exc
            raise

    async def _expected_signature(self) -> Signature:
        """The served model's tensors: from `model_dir` (the gateway's --model), else from the folder
        vLLM reports serving, read once."""
        if self._expected is None:
            folder = self.model_dir
            if folder is None:
                root = (await self._model_card()).get("root")
                folder = Path(root) if root and Path(root).is_dir() else None
            if folder is None:
                raise CheckpointInvalid(
                    "cannot check the checkpoint: the served model's folder is unknown (give model_dir)", self.url
                )
            self._expected = await asyncio.to_thread(signature, folder)
            self._tied = _ties_embeddings(folder)
        return self._expected

    async def _optional_post(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self.transport.post_json(path, body, timeout=60.0, expect_json=False)
        except EngineRejected as exc:
            if exc.upstream_status != 404:
                raise
            log.debug("%s has no %s", self.url, path)

    async def _optional_get(self, path: str) -> Any:
        try:
            return await self.transport.get_json(path)
        except EngineRejected as exc:
            if exc.upstream_status != 404:
                raise
            return None


def _ties_embeddings(folder: Path) -> bool:
    """config.json's tie_word_embeddings (the default differs by architecture: unsaid counts as untied)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))
