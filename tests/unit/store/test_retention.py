"""The retention sweeper's own duties against a real SqliteStore: the owner hears of each
purge, an audit kept forever stays, a failed sweep is retried by ``run``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import AuditEntry
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sqlite import SqliteStore
from tests.conftest import eventually
from tests.unit.store.test_storage import session


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3")
    yield s
    await s.close()


async def test_the_owner_hears_of_each_purge_and_audit_kept_forever_stays(
    store: SqliteStore, tmp_path: Path
) -> None:
    """(What is purged when, on every backend: tests/store/test_retention.py.)"""
    for sid in ("dead", "live"):
        await store.insert_session(session(sid, "alice"))
    await store.update_session("dead", state="dead", reason="the kernel died")
    await store.audit(AuditEntry(principal="alice", action="execution", session_id="live"))
    purged: list[str] = []

    async def on_purged(session_id: str) -> None:
        purged.append(session_id)

    settings = StorageSettings(retention=60, audit_retention=None)
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), settings, on_purged)
    assert await sweeper.sweep(datetime.now(UTC) + timedelta(days=3650)) == 1
    assert purged == ["dead"]
    assert len(await store.audit_log("live")) == 1
    # On request, at once: the owner hears of it too.
    await sweeper.purge("live")
    assert purged == ["dead", "live"] and await store.get_session("live") is None


async def test_a_failed_sweep_is_logged_and_tried_again(
    store: SqliteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store is closed under the sweeper: each pass fails, says so, and the loop goes on
    (the next pass comes after sweep_interval)."""
    settings = StorageSettings(sweep_interval=0.01)
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), settings)
    await store.close()
    with caplog.at_level(logging.ERROR, logger="kernelhub.store.retention"):
        task = asyncio.create_task(sweeper.run())
        try:
            await eventually(
                lambda: sum("retention sweep failed" in r.message for r in caplog.records) >= 2,
                5,
            )
        finally:
            task.cancel()
    # Only its cancellation ends the loop: no failure did.
    with pytest.raises(asyncio.CancelledError):
        await task
