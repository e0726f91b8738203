"""Pool fixtures: every backend test runs against SQLite and PostgreSQL (a fresh schema per test)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from datapool import open_pool

PG_ENV = "STEPLINE_PG_URL"


def pg_base_url() -> str:
    """The PostgreSQL server for tests, or skip (fail under STEPLINE_REQUIRE_PG=1) with how to enable."""
    url = os.environ.get(PG_ENV)
    required = os.environ.get("STEPLINE_REQUIRE_PG") == "1"
    if not url:
        if required:
            pytest.fail(f"STEPLINE_REQUIRE_PG=1 but {PG_ENV} is not set")
        pytest.skip(f"PostgreSQL tests need a server: set {PG_ENV}=postgresql://postgres@127.0.0.1:5432/test")
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.Error as exc:
        if required:
            pytest.fail(f"PostgreSQL at {PG_ENV}={url} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_ENV}={url} is unreachable ({exc}); start it or unset {PG_ENV}")
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def pool_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/pool.db"
        return
    base = pg_base_url()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield f"{base}{'&' if '?' in base else '?'}schema={schema}"
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def pool(pool_url: str):
    p = open_pool(pool_url)
    yield p
    p.close()
