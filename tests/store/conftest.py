"""Every test here runs once per backend: SQLite in a temporary file, and the run's
private PostgreSQL server (tests/postgres.py) in a fresh schema."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from kernelhub.store.postgres import PostgresStore
from kernelhub.store.sql import SqlStore
from kernelhub.store.sqlite import SqliteStore

Opener = Callable[[], Awaitable[SqlStore]]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens the same database again on each call (a restart)."""
    if request.param == "sqlite":
        path = tmp_path / "kh.sqlite3"
        return lambda: SqliteStore.open(path, audit_code_bytes=64, node="n1")
    url = request.getfixturevalue("postgres_cluster").fresh_url()
    return lambda: PostgresStore.open(url, audit_code_bytes=64, node="n1")


@pytest.fixture
async def store(opener: Opener) -> AsyncIterator[SqlStore]:
    s = await opener()
    yield s
    await s.close()
