"""The one retry policy of the HTTP clients (stepline._retry): transport errors only, bounded, never an answer."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stepline._retry import RetryPolicy, Unavailable, is_transport_error


def _client(answer: list) -> tuple[httpx.Client, list[int]]:
    """A client whose every request takes the next item of `answer`: an exception to raise or a status."""
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(1)
        item = answer[min(len(seen), len(answer)) - 1]
        if isinstance(item, type) and issubclass(item, Exception):
            raise item("boom", request=request)
        return httpx.Response(item)

    return httpx.Client(base_url="http://x", transport=httpx.MockTransport(handler)), seen


def _unavailable_on_503(client: httpx.Client) -> httpx.Response:
    response = client.post("/")
    if response.status_code == 503:
        raise Unavailable("HTTP 503")
    return response


def test_a_refused_connection_is_retried_until_it_answers() -> None:
    client, seen = _client([httpx.ConnectError, httpx.ConnectError, 200])
    assert RetryPolicy(attempts=5, backoff=0).call(client.post, "/").status_code == 200
    assert len(seen) == 3


def test_retries_are_bounded_and_the_last_error_is_raised() -> None:
    client, seen = _client([httpx.ConnectError])
    with pytest.raises(httpx.ConnectError):
        RetryPolicy(attempts=4, backoff=0).call(client.post, "/")
    assert len(seen) == 4


@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 429, 500])
def test_an_answer_is_never_retried(status: int) -> None:
    client, seen = _client([status, 200])
    assert RetryPolicy(attempts=5, backoff=0).call(_unavailable_on_503, client).status_code == status
    assert len(seen) == 1


def test_unavailable_is_retried() -> None:
    client, seen = _client([503, 503, 200])
    assert RetryPolicy(attempts=5, backoff=0).call(_unavailable_on_503, client).status_code == 200
    assert len(seen) == 3


def test_a_timeout_is_resent_only_when_the_request_may_be_sent_twice() -> None:
    client, seen = _client([httpx.ReadTimeout, 200])
    with pytest.raises(httpx.ReadTimeout):
        RetryPolicy(attempts=5, backoff=0).call(client.post, "/", retry_on=is_transport_error)
    assert len(seen) == 1
    client, seen = _client([httpx.ReadTimeout, 200])
    policy = RetryPolicy(attempts=5, backoff=0)
    assert policy.call(client.post, "/", retry_on=lambda e: is_transport_error(e, resend=True)).status_code == 200
    assert len(seen) == 2


def test_a_bug_is_not_retried() -> None:
    tries = []

    def broken() -> None:
        tries.append(1)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        RetryPolicy(attempts=5, backoff=0).call(broken)
    assert len(tries) == 1


def test_the_waits_double_and_stop_at_the_cap(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)
    client, seen = _client([httpx.ConnectError])
    with pytest.raises(httpx.ConnectError):
        RetryPolicy(attempts=6, backoff=0.5, max_backoff=3.0).call(client.post, "/")
    # 6 tries, 5 waits: 0.5, 1, 2, then 4 and 8 capped at 3
    assert slept == pytest.approx([0.5, 1.0, 2.0, 3.0, 3.0]) and len(seen) == 6


def test_the_async_form_retries_the_same_way() -> None:
    tries = []

    async def send() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise Unavailable("not yet")
        return "ok"

    assert asyncio.run(RetryPolicy(attempts=3, backoff=0).acall(send)) == "ok"
    assert len(tries) == 3
    tries.clear()
    with pytest.raises(Unavailable):
        asyncio.run(RetryPolicy(attempts=2, backoff=0).acall(send))
    assert len(tries) == 2
