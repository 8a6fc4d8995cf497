"""The retention sweep against a real SqliteStore: sessions that ended longer ago than the
retention are purged (dead and deleted alike, live ones never), old audit entries are
trimmed, the owner hears of each purge, and a failed sweep is retried by ``run``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import AuditEntry, StoredSession
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sqlite import SqliteStore
from tests.conftest import eventually


def session(sid: str) -> StoredSession:
    return StoredSession(
        id=sid, owner="alice", backend="docker", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3", audit_code_bytes=64)
    yield s
    await s.close()


async def test_a_sweep_purges_what_ended_before_the_retention(
    store: SqliteStore, tmp_path: Path
) -> None:
    for sid in ("dead", "deleted", "live"):
        await store.insert_session(session(sid))
        await store.append_event(sid, 1, f"{sid}-e", '{"type":"notice","message":"m"}')
    await store.update_session("dead", state="dead", reason="the kernel died")
    await store.update_session("deleted", state="deleted", deleted=True)
    purged: list[str] = []

    async def on_purged(session_id: str) -> None:
        purged.append(session_id)

    settings = StorageSettings(retention=3600, audit_retention=None)
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), settings, on_purged)
    # Within the retention: nothing goes.
    assert await sweeper.sweep() == 0
    assert await store.get_session("dead") is not None
    # An hour and a bit later: both ended sessions go, with their events; the live one stays.
    later = datetime.now(UTC) + timedelta(seconds=3601)
    assert await sweeper.sweep(later) == 2
    assert sorted(purged) == ["dead", "deleted"]
    assert await store.get_session("dead") is None and await store.get_session("deleted") is None
    assert await store.events_since("dead", 0) == []
    assert await store.get_session("live") is not None
    assert [seq for seq, _ in await store.events_since("live", 0)] == [1]
    # Nothing left to do: a second sweep purges nothing.
    assert await sweeper.sweep(later) == 0


async def test_old_audit_entries_are_trimmed_newer_ones_kept(
    store: SqliteStore, tmp_path: Path
) -> None:
    await store.insert_session(session("s1"))
    for i in range(3):
        await store.audit(AuditEntry(principal="alice", action="execution", session_id="s1",
                                     code=f"x = {i}"))  # fmt: skip
    settings = StorageSettings(retention=3600, audit_retention=60)
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), settings)
    assert await sweeper.sweep() == 0
    assert len(await store.audit_log("s1")) == 3
    await sweeper.sweep(datetime.now(UTC) + timedelta(seconds=61))
    assert await store.audit_log("s1") == []
    # Forever (None): nothing is trimmed, however late.
    await store.audit(AuditEntry(principal="alice", action="execution", session_id="s1"))
    forever = RetentionSweeper(store, BlobStore(tmp_path), StorageSettings(audit_retention=None))
    await forever.sweep(datetime.now(UTC) + timedelta(days=3650))
    assert len(await store.audit_log("s1")) == 1


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
