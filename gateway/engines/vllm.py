"""vLLM adapter: token-id prompts on the OpenAI `/v1/completions` endpoint.

Request `{"model", "prompt": [ids], "max_tokens", ..., "logprobs": 1, "return_token_ids": true}`;
the choice carries `token_ids` (the sampled ids, a stop token / EOS included), `logprobs.token_logprobs`,
`finish_reason` and `stop_reason` (the matched stop string or id; null for EOS). Streams are incremental.

Logprobs: vLLM V1 returns the raw model's logprobs unless the server runs with
`--logprobs-mode processed_logprobs` (after temperature / top-p), which is what an RL ratio needs.

Weight updates: vLLM has no stable public HTTP endpoint for this. With `VLLM_SERVER_DEV_MODE=1` the
server exposes `POST /collective_rpc` (a method called on every worker) and `POST /reset_prefix_cache`.
The default method, `reload_weights`, re-reads the checkpoint directory the server was started with, so
the trainer writes the new weights there (`path` must be that directory); a worker extension
(`--worker-extension-cls`) with a method taking the path (set `update_method`) loads from anywhere.
Without dev mode, restart the server on the new checkpoint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.engines._http import Transport
from gateway.engines.base import EngineError, EngineRejected, Generation, SamplingParams, StreamDelta


class VLLMEngine:
    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession,
        timeout: float = 600.0,
        model: str | None = None,
        update_method: str = "reload_weights",
    ) -> None:
        self.url = url.rstrip("/")
        self.kind = "vllm"
        self.transport = Transport(http, self.url, timeout)
        self.model = model  # the served model name; asked from /v1/models on first use when None
        self.update_method = update_method
        self.version = 0

    async def _model_name(self) -> str:
        if self.model is None:
            data = await self.transport.get_json("/v1/models")
            try:
                self.model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"/v1/models lists no model: {data!r:.200}", self.url) from exc
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

    async def pause(self) -> None:
        """Nothing to do: the gateway drains its own in-flight calls before updating."""

    async def resume(self) -> None:
        """Nothing to do (see pause)."""

    async def update_weights(self, path: str, version: int) -> None:
        args = [] if self.update_method == "reload_weights" else [path]
        timeout = max(self.transport.timeout.total or 0, 600.0)
        try:
            await self.transport.post_json(
                "/collective_rpc", {"method": self.update_method, "args": args}, timeout=timeout
            )
        except EngineRejected as exc:
            if exc.upstream_status == 404:
                raise EngineError(
                    "vLLM has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1, "
                    "or restart it on the new checkpoint",
                    self.url,
                ) from exc
            raise
        try:  # cached KV was computed with the old weights
            await self.transport.post_json("/reset_prefix_cache", {}, timeout=timeout)
        except EngineRejected as exc:
            if exc.upstream_status != 404:
                raise
        self.version = version
