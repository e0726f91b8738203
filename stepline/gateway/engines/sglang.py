"""SGLang `/generate` adapter (also the built-in engine, which speaks the same subset).

Wire format: request `{"input_ids", "sampling_params", "return_logprob": true, "stream", "rid"}`;
answer `{"text", "output_ids", "meta_info": {"finish_reason": {"type", "matched"}, "prompt_tokens",
"completion_tokens", "output_token_logprobs": [[logprob, id, text|null], ...], "weight_version"}}`.
Streams are SSE `data: {...}` events, cumulative by default (each event repeats everything so far);
with `--incremental-streaming-output` they carry only the new part. Both are accepted.

Weight updates (SGLang's documented endpoints): `/pause_generation {}` (its default mode, `abort`; the
gateway has drained its own calls first), `/update_weights_from_disk {"model_path", "weight_version"}`
(SGLang answers `{"success", "message"}`, 400 on failure, and keeps the old weights), `/flush_cache`,
`/continue_generation {}`. A delta folder (stepline.weightdelta) goes only to the built-in engine, which loads it
in place; SGLang's loader takes whole checkpoints, so the adapter refuses one for SGLang (400: the trainer then
pushes the full weights). At start the gateway reads `/get_model_info` (`model_path`,
`weight_version`) and `/get_server_info` (`context_length`).
"""

from __future__ import annotations

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
from stepline.weightdelta import MANIFEST


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        # keep special tokens in the text so the gateway's parsers see e.g. <tool_call>
        "skip_special_tokens": False,
    }
    if sampling.stop:
        body["stop"] = sampling.stop
    if sampling.stop_token_ids:
        body["stop_token_ids"] = sampling.stop_token_ids
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    return body


def _finish(meta: dict[str, Any]) -> tuple[str, int | str | None]:
    reason = meta.get("finish_reason")
    if reason is None:
        return "abort", None
    if isinstance(reason, str):  # some versions send the bare type
        return reason, None
    return str(reason.get("type", "abort")), reason.get("matched")


def _version(meta: dict[str, Any], fallback: int) -> int:
    # SGLang reports weight_version as a string ("default" until the first update)
    try:
        return int(meta.get("weight_version", fallback))
    except (TypeError, ValueError):
        return fallback


class SGLangEngine:
    """An SGLang server (kind "sglang") or Stepline's built-in engine (kind "builtin")."""

    def __init__(self, url: str, http: aiohttp.ClientSession, timeout: float = 600.0, kind: str = "sglang") -> None:
        self.url = url.rstrip("/")
        self.kind = kind
        self.transport = Transport(http, self.url, timeout)
        self.version = 0  # last version installed through this adapter (fallback when not reported)

    def _request(self, input_ids: list[int], sampling: SamplingParams, rid: str | None, stream: bool) -> dict:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_body(sampling),
            "return_logprob": True,
            "stream": stream,
        }
        if rid is not None:
            body["rid"] = rid
        return body

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        out = await self.transport.post_json("/generate", self._request(input_ids, sampling, rid, stream=False))
        if isinstance(out, list):  # a batch answer: we sent one prompt
            out = out[0]
        return self._generation(out, len(input_ids))

    def _generation(self, out: dict[str, Any], prompt_len: int) -> Generation:
        try:
            meta = out["meta_info"]
            ids = [int(t) for t in out["output_ids"]]
            logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(f"malformed /generate answer: {exc!r}", self.url) from exc
        if len(logprobs) != len(ids):
            raise EngineError(f"{len(ids)} output ids but {len(logprobs)} logprobs", self.url)
        reason, matched = _finish(meta)
        return Generation(
            output_ids=ids,
            logprobs=logprobs,
            text=out.get("text", ""),
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
            weight_version=_version(meta, self.version),
        )

    async def stream(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        cumulative: bool | None = None  # decided on the second event
        events = self.transport.sse("/generate", self._request(input_ids, sampling, rid, stream=True))
        try:
            async for event in events:
                meta = event.get("meta_info", {})
                raw_ids, raw_lps, new_text = (
                    event.get("output_ids", []),
                    meta.get("output_token_logprobs") or [],
                    event.get("text", ""),
                )
                if cumulative is None and ids:
                    # cumulative events repeat every id so far: their length equals completion_tokens
                    total = meta.get("completion_tokens")
                    cumulative = len(raw_ids) == total if total is not None else raw_ids[: len(ids)] == ids
                if cumulative or not ids:  # convert only the new part: cumulative events grow each time
                    raw_ids, raw_lps, new_text = raw_ids[len(ids) :], raw_lps[len(logprobs) :], new_text[len(text) :]
                new_ids = [int(t) for t in raw_ids]
                new_lps = [float(e[0]) for e in raw_lps]
                ids += new_ids
                logprobs += new_lps
                text += new_text
                final = None
                if meta.get("finish_reason") is not None:
                    final = self._generation(
                        {
                            "output_ids": ids,
                            "text": text,
                            "meta_info": {**meta, "output_token_logprobs": [[lp] for lp in logprobs]},
                        },
                        len(input_ids),
                    )
                if new_ids or final is not None:
                    yield StreamDelta(output_ids=new_ids, logprobs=new_lps, text=new_text, final=final)
                if final is not None:
                    return
        finally:
            await events.aclose()
        raise EngineError("engine stream ended without a finish reason", self.url)

    async def health(self) -> bool:
        return await self.transport.get_ok("/health")

    async def info(self) -> EngineInfo:
        model = await self._optional_get("/get_model_info") or {}
        server = await self._optional_get("/get_server_info") or {}
        context = server.get("context_length") or model.get("context_length")
        version = model.get("weight_version", server.get("weight_version"))
        return EngineInfo(
            model_path=str(model.get("model_path") or server.get("model_path") or "") or None,
            context_length=int(context) if isinstance(context, int) and context > 0 else None,
            weight_version=None if version is None else str(version),
        )

    async def _optional_get(self, path: str) -> dict[str, Any] | None:
        try:
            answer = await self.transport.get_json(path)
        except EngineRejected as exc:
            if exc.upstream_status != 404:
                raise
            return None
        return answer if isinstance(answer, dict) else None

    async def pause(self) -> None:
        """Ask the engine to pause (SGLang >= 0.5); engines without the endpoint (404) are fine: the
        gateway has already drained its own in-flight calls."""
        await self._optional("/pause_generation", {})

    async def resume(self) -> None:
        await self._optional("/continue_generation", {})

    async def _optional(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self.transport.post_json(path, body, timeout=30.0, expect_json=False)
        except EngineRejected as exc:
            if exc.upstream_status != 404:
                raise

    async def update_weights(self, path: str, version: int) -> None:
        if self.kind == "sglang" and Path(path, MANIFEST).is_file():
            raise EngineRejected(f"{path} is a delta (only changed tensors); SGLang loads whole checkpoints", self.url)
        answer = await self.transport.post_json(
            "/update_weights_from_disk",
            {"model_path": path, "weight_version": str(version)},
            timeout=max(self.transport.timeout.total or 0, 600.0),
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"weight update failed: {answer.get('message', '')}", self.url)
        self.version = version
        await self._optional("/flush_cache", {})  # SGLang flushes after a load too; this covers older ones
