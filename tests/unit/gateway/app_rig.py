"""The real app on a seeded store, for the unit tier's route tests: a SqliteStore in a
temporary data directory, filled by the test module before the gateway starts, then
create_app with the local backend (which starts nothing unless asked) under TestClient."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kernelhub.config import Settings, load_settings
from kernelhub.gateway.app import create_app
from kernelhub.store.records import StoredSession
from kernelhub.store.sqlite import SqliteStore

Gateway = tuple[TestClient, dict[str, str]]  # the client, and the seeded tokens by role
Seed = Callable[[SqliteStore], Awaitable[dict[str, str]]]


def row(sid: str, owner: str, metadata: dict[str, Any] | None = None) -> StoredSession:
    """A session row as the manager inserts one; tests then move it to the state they need."""
    return StoredSession(
        id=sid, owner=owner, backend="local", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata=metadata or {}, reason=None, deleted_at=None,
    )  # fmt: skip


async def _seeded(settings: Settings, seed: Seed) -> dict[str, str]:
    store = await SqliteStore.open(settings.data_dir / "kernelhub.sqlite3")
    try:
        return await seed(store)
    finally:
        await store.close()


def serve(
    tmp_path_factory: pytest.TempPathFactory,
    seed: Seed,
    configure: Callable[[Settings], None] | None = None,
) -> Iterator[Gateway]:
    """Body of a module-scoped fixture: ``yield from serve(tmp_path_factory, seed)``."""
    data = tmp_path_factory.mktemp("gw") / "data"
    data.mkdir()
    settings = load_settings(backend="local", data_dir=data, run_dir=data.parent / "run")
    if configure is not None:
        configure(settings)
    tokens = asyncio.run(_seeded(settings, seed))
    with TestClient(create_app(settings)) as client:
        yield client, tokens
