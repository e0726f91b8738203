"""Pool fixtures: every backend test runs against SQLite and PostgreSQL (a fresh schema per test)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from stepline.datapool import open_pool

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


@contextmanager
def backend_url(kind: str, tmp_path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/pool.db"
    elif kind == "service":  # the HTTP service (over SQLite), reached through PoolClient
        from pool_helpers import ServiceThread

        with ServiceThread(f"sqlite:///{tmp_path}/pool.db") as service:
            yield service.url
    else:
        base = pg_base_url()
        schema = f"t_{uuid.uuid4().hex[:12]}"
        yield f"{base}{'&' if '?' in base else '?'}schema={schema}"
        import psycopg

        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)


@pytest.fixture(params=["sqlite", POSTGRES, "service"])
def pool_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A URL for every implementation of the pool interface."""
    with backend_url(request.param, tmp_path) as url:
        yield url


@pytest.fixture(params=["sqlite", POSTGRES])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A URL for every database backend."""
    with backend_url(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def pool(pool_url: str):
    p = open_pool(pool_url)
    yield p
    p.close()
