"""`PoolClient`: the `Pool` interface over the pool service (`stepline pool serve`).

Errors come back as the same exceptions the embedded pool raises (`InvalidRecord`, `UnknownSession`,
`ReadOnlyPool`, `PoolError`). Transport failures and 503s are retried with bounded backoff and then
raised as `PoolUnavailable` — deliberately *not* a `PoolError`, so callers such as the gateway's
recorder keep a batch and retry later instead of dropping it. A 4xx is never retried.

Retries are safe: re-sending an acknowledged call, session, reward or end is a no-op on the server.
`claim_groups` and `release_groups` are retried only when the request never left (connect errors).
`add_calls` splits large lists into requests of `batch_size` calls; each request is atomic.

A token (`token=`, default env STEPLINE_POOL_TOKEN) is sent as Bearer; a 401 raises `PoolUnauthorized`,
not a `PoolError` either: a misconfigured token must not make the recorder drop records as invalid.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import httpx

from stepline._retry import RetryPolicy, Unavailable, transport_error
from stepline.datapool import wire
from stepline.datapool.base import InvalidRecord, PoolCorrupt, PoolError, PoolFull, ReadOnlyPool, UnknownSession
from stepline.datapool.records import CallRecord, EpisodeData, Group, LeafRule, Reward, SessionInfo, SessionTree

ERRORS: dict[str, type[PoolError]] = {
    "InvalidRecord": InvalidRecord, "UnknownSession": UnknownSession, "ReadOnlyPool": ReadOnlyPool,
    "PoolCorrupt": PoolCorrupt, "PoolFull": PoolFull,
}
NOT_RESENT = {"claim_groups", "release_groups"}  # a lost answer must not be replayed


class PoolUnavailable(ConnectionError):
    """The pool service could not be reached or its database failed (after retries)."""


class PoolUnauthorized(PermissionError):
    """The pool service refused this client's token for the method (HTTP 401)."""


class PoolClient:
    def __init__(self, url: str, read_only: bool = False, timeout: float = 60.0, batch_size: int = 512,
                 attempts: int = 5, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.read_only = read_only
        self.batch_size = batch_size
        token = token or os.environ.get("STEPLINE_POOL_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)
        self._retry = RetryPolicy(attempts, backoff=0.1, max_backoff=2.0)

    def _call(self, method: str, **args: Any) -> Any:
        resend = method not in NOT_RESENT  # a connect error is retried either way: the request never left
        try:
            response = self._retry.call(self._post, method, args, retry_on=transport_error(resend))
        except (httpx.TransportError, Unavailable) as exc:
            retried = resend or isinstance(exc, httpx.ConnectError | Unavailable)
            note = "" if retried else f" (not retried: {method})"
            raise PoolUnavailable(f"pool service {self.url}: {exc!r}{note}") from exc
        body = _decode(response)
        if response.status_code == 401:
            raise PoolUnauthorized(f"pool service {self.url}: {method}: {response.text}")
        if response.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise ERRORS.get(err.get("type", ""), PoolError)(err.get("message", response.text))
        return body["result"]

    def _post(self, method: str, args: dict[str, Any]) -> httpx.Response:
        response = self._http.post(f"/v1/{method}", content=wire.packb(args), headers={"content-type": "application/msgpack"})
        if response.status_code == 503:  # the service's database failed for now (locked, I/O, connection lost)
            raise Unavailable(response.text)
        return response

    def _write(self) -> None:
        if self.read_only:
            raise ReadOnlyPool("this pool client was opened read-only")

    # --- writes ---
    def create_session(self, info: SessionInfo) -> None:
        self._write()
        self._call("create_session", info=info)

    def add_calls(self, records: list[CallRecord]) -> None:
        self._write()
        for i in range(0, len(records), self.batch_size):
            self._call("add_calls", records=records[i: i + self.batch_size])

    def add_reward(self, reward: Reward) -> None:
        self._write()
        self._call("add_reward", reward=reward)

    def end_session(self, session_id: str, status: str = "completed") -> None:
        self._write()
        self._call("end_session", session_id=session_id, status=status)

    def abandon_idle(self, idle_seconds: float, keep: Sequence[str] = ()) -> int:
        self._write()
        return int(self._call("abandon_idle", idle_seconds=idle_seconds, keep=list(keep)))

    def renew_leases(self, session_ids: Sequence[str], seconds: float) -> list[str]:
        self._write()
        return [str(s) for s in self._call("renew_leases", session_ids=list(session_ids), seconds=seconds)]

    # --- reads ---
    def get_session(self, session_id: str) -> SessionInfo:
        return wire.decode_session(self._call("get_session", session_id=session_id))

    def list_sessions(self, status: str | None = None) -> list[SessionInfo]:
        return [wire.decode_session(s) for s in self._call("list_sessions", status=status)]

    def get_tree(self, session_id: str) -> SessionTree:
        return wire.decode_tree(self._call("get_tree", session_id=session_id))

    def get_episode(self, session_id: str, leaf_rule: LeafRule = "drop_superseded") -> EpisodeData:
        return wire.decode_episode(self._call("get_episode", session_id=session_id, leaf_rule=leaf_rule))

    def get_calls(self, session_id: str) -> list[CallRecord]:
        return [wire.decode_call(c) for c in self._call("get_calls", session_id=session_id)]

    def stats(self) -> dict[str, int]:
        return dict(self._call("stats"))

    # --- the trainer's side ---
    def claim_groups(self, consumer: str, min_version: int, max_groups: int, group_size: int | None = None,
                     leaf_rule: LeafRule = "drop_superseded") -> list[Group]:
        self._write()
        groups = self._call("claim_groups", consumer=consumer, min_version=min_version, max_groups=max_groups,
                            group_size=group_size, leaf_rule=leaf_rule)
        return [wire.decode_group(g) for g in groups]

    def mark_consumed(self, group_ids: list[str], consumer: str) -> None:
        self._write()
        self._call("mark_consumed", group_ids=group_ids, consumer=consumer)

    def release_groups(self, group_ids: list[str], consumer: str) -> None:
        self._write()
        self._call("release_groups", group_ids=group_ids, consumer=consumer)

    def claimed_groups(self, consumer: str) -> list[str]:
        return [str(g) for g in self._call("claimed_groups", consumer=consumer)]

    def close(self) -> None:
        self._http.close()


def _decode(response: httpx.Response) -> Any:
    try:
        return wire.unpackb(response.content)
    except Exception as exc:  # not our service answering
        raise PoolError(f"unexpected answer from the pool service ({response.status_code}): "
                        f"{response.text[:200]!r}") from exc
