"""The rollout driver's client for the gateway's session endpoints (HTTP only; the trainer never
imports the gateway). Formats: POST /sessions, /sessions/<id>/reward, /sessions/<id>/end.

Exceptions:

    GatewayError        the gateway refused (4xx) or stayed unreachable/overloaded after bounded retries
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

__all__ = ["GatewayClient", "GatewayError", "SessionHandle"]


class GatewayError(Exception):
    """A session request failed for good."""


@dataclass(frozen=True)
class SessionHandle:
    session_id: str
    api_key: str
    openai_base_url: str
    anthropic_base_url: str

    def env(self) -> dict[str, str]:
        """The endpoint as agents read it from their environment."""
        return {
            "OPENAI_BASE_URL": self.openai_base_url, "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url, "ANTHROPIC_API_KEY": self.api_key,
            "STEPLINE_SESSION_ID": self.session_id,
        }


class _Retryable(Exception):
    """A transport error or 429/502/503/504: worth another try."""


class GatewayClient:
    """Opens, rewards and ends sessions. Use as `async with GatewayClient(url, token) as gw:`."""

    def __init__(self, url: str, admin_token: str | None = None, timeout: float = 60.0, attempts: int = 5):
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._attempts = attempts

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def open_session(self, task_id: str, harness: str, group_id: str | None, metadata: dict[str, Any]) -> SessionHandle:
        body = {"task_id": task_id, "harness": harness, "group_id": group_id, "metadata": metadata}
        data = await self._post("/sessions", body)
        try:
            return SessionHandle(data["session_id"], data["api_key"], data["openai_base_url"], data["anthropic_base_url"])
        except (KeyError, TypeError) as exc:
            raise GatewayError(f"POST /sessions answered without {exc}: {str(data)[:200]}") from exc

    async def post_reward(self, session_id: str, value: float) -> None:
        await self._post(f"/sessions/{session_id}/reward", {"value": value, "step": None, "name": "outcome", "weight": 1.0})

    async def end_session(self, session_id: str, status: str) -> None:
        await self._post(f"/sessions/{session_id}/end", {"status": status})

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts), wait=wait_exponential(0.2, max=5.0),
            retry=retry_if_exception(lambda e: isinstance(e, _Retryable)), reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post_once(path, body)
        except _Retryable as exc:
            raise GatewayError(f"POST {path}: {exc}") from exc
        raise AssertionError("unreachable")

    async def _post_once(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self._http.post(path, json=body)
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in (429, 502, 503, 504):
            raise _Retryable(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise GatewayError(f"POST {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else None
