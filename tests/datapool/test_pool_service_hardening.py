"""The pool service's edge: tokens with read / write / claim rights,
and a client's mistakes answered 4xx (never retried) apart from storage failures (503, retried)."""

from __future__ import annotations

import httpx
import msgpack
import pytest
from pool_helpers import ServiceThread, session

from stepline.datapool.client import PoolClient, PoolUnauthorized
from stepline.datapool.service import Tokens


def _post(url: str, method: str, args: dict, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/v1/{method}", content=msgpack.packb(args), headers=headers)


@pytest.mark.parametrize(("args", "why"), [
    ({"session_id": 2**64 - 1}, "an integer SQLite cannot hold: was a bare 500"),
    ({"session_id": [1, 2]}, "a wrong argument type: was 503 'database error; retry'"),
    ({"session_id": {"a": 1}}, "a map where a string belongs"),
])
def test_a_clients_mistake_is_400_not_500_or_503(tmp_path, args: dict, why: str) -> None:
    with ServiceThread(f"sqlite:///{tmp_path}/p.db") as service:
        r = _post(service.url, "get_session", args)
        assert r.status_code == 400, (why, r.content)
        assert msgpack.unpackb(r.content)["error"]["type"] == "InvalidRecord"
        r = _post(service.url, "end_session", {**args, "status": "completed"})
        assert r.status_code == 400, (why, r.content)


def test_tokens_separate_read_write_and_claim(tmp_path) -> None:
    # anyone local could read every session, forge rewards, end sessions, claim groups
    tokens = Tokens(read="r", write="w", claim="c")
    with ServiceThread(f"sqlite:///{tmp_path}/p.db", tokens) as service:
        url = service.url
        assert httpx.get(f"{url}/health").status_code == 200  # open, and says nothing about sessions
        info = {"info": {"session_id": "s", "task_id": "t", "harness": "h", "group_id": None, "metadata": {},
                         "status": "open", "created_at": 0.0, "ended_at": None}}
        for method, args in [("get_session", {"session_id": "s"}), ("stats", {}), ("create_session", info),
                             ("claim_groups", {"consumer": "x", "min_version": 0, "max_groups": 1})]:
            assert _post(url, method, args).status_code == 401, method
            assert _post(url, method, args, "bogus").status_code == 401, method
        assert _post(url, "create_session", info, "r").status_code == 401  # read may not write
        assert _post(url, "end_session", {"session_id": "s"}, "c").status_code == 401  # claim may not write
        claim = {"consumer": "x", "min_version": 0, "max_groups": 1}
        assert _post(url, "claim_groups", claim, "w").status_code == 401  # the gateway may not claim
        writer = PoolClient(url, token="w")
        writer.create_session(session("s"))
        assert writer.get_session("s").session_id == "s"  # every right includes reading
        reader = PoolClient(url, token="r")
        assert reader.stats() is not None
        assert PoolClient(url, token="c").claim_groups("x", 0, 1) == []
        with pytest.raises(PoolUnauthorized):  # not a PoolError: the recorder never drops it as invalid
            PoolClient(url).end_session("s")
        for client in (writer, reader):
            client.close()
