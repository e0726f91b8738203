"""The rollout driver's client for the gateway's session endpoints (HTTP only; the trainer never
imports the gateway). Formats: POST /sessions, GET /sessions/<id>, POST /sessions/<id>/reward, /end and
/fork (a new session that replays the source's calls before `call`, stepline/gateway/forks.py).

Exceptions:

    GatewayError        the gateway refused (4xx) or stayed unreachable/overloaded after bounded retries

Transport errors and the gateway's 502/503/504 are retried (stepline._retry); a 4xx never is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from stepline._retry import RetryPolicy, Unavailable, transport_error
from stepline.datapool.records import Purpose

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


class GatewayClient:
    """Opens, rewards and ends sessions. Use as `async with GatewayClient(url, token) as gw:`."""

    def __init__(self, url: str, admin_token: str | None = None, timeout: float = 60.0, attempts: int = 5):
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._retry = RetryPolicy(attempts, backoff=0.2, max_backoff=5.0)

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def open_session(self, task_id: str, harness: str, group_id: str | None, metadata: dict[str, Any],
                           purpose: Purpose = "train", sampling: dict[str, float] | None = None) -> SessionHandle:
        """`sampling` (temperature, top_p, top_k): what the gateway uses for every call of the session, whatever
        the harness asks."""
        body: dict[str, Any] = {"task_id": task_id, "harness": harness, "group_id": group_id, "metadata": metadata,
                                "purpose": purpose}
        if sampling:
            body["sampling"] = sampling
        return _handle("/sessions", await self._post("/sessions", body))

    async def fork_session(self, session_id: str, call: int, metadata: dict[str, Any] | None = None) -> SessionHandle:
        """A fork of the session at `call` (same task, harness and group; its calls before `call` replay)."""
        path = f"/sessions/{session_id}/fork"
        return _handle(path, await self._post(path, {"call": call, "metadata": metadata or {}}))

    async def session_calls(self, session_id: str) -> int:
        """How many calls the session has made (a fork's replayed ones included)."""
        path = f"/sessions/{session_id}"
        try:
            data = await self._retry.acall(lambda: self._send("GET", path, None), retry_on=transport_error(resend=True))
        except (httpx.TransportError, Unavailable) as exc:
            raise GatewayError(f"GET {path}: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("calls"), int):
            raise GatewayError(f"GET {path} answered without a call count: {str(data)[:200]}")
        return data["calls"]

    async def post_reward(self, session_id: str, value: float, step: int | None = None) -> None:
        """The session's outcome, or with `step` the reward of its call of that index (a dense step reward)."""
        body = {"value": value, "step": step, "name": "outcome" if step is None else "step", "weight": 1.0}
        await self._post(f"/sessions/{session_id}/reward", body)

    async def post_demonstration(self, session_id: str, conversation: dict[str, Any]) -> None:
        """Record an expert's conversation (`messages`, `tools`) as the calls of an expert session."""
        await self._post(f"/sessions/{session_id}/demonstration", conversation)

    async def end_session(self, session_id: str, status: str) -> None:
        await self._post(f"/sessions/{session_id}/end", {"status": status})

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:  # sessions, rewards and ends are safe to send twice (the gateway's reaper ends a lost session)
            return await self._retry.acall(lambda: self._post_once(path, body), retry_on=transport_error(resend=True))
        except httpx.TransportError as exc:
            raise GatewayError(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        except Unavailable as exc:
            raise GatewayError(f"POST {path}: {exc}") from exc

    async def _post_once(self, path: str, body: dict[str, Any]) -> Any:
        return await self._send("POST", path, body)

    async def _send(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        response = await self._http.request(method, path, json=body)
        if response.status_code in (502, 503, 504):
            raise Unavailable(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise GatewayError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else None


def _handle(path: str, data: Any) -> SessionHandle:
    try:
        return SessionHandle(data["session_id"], data["api_key"], data["openai_base_url"], data["anthropic_base_url"])
    except (KeyError, TypeError) as exc:
        raise GatewayError(f"POST {path} answered without {exc}: {str(data)[:200]}") from exc
