"""The retention sweeper's own duties against a real SqliteStore: the owner hears of each
purge, an audit kept forever stays, a failed sweep is retried by ``run``."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import AuditEntry, StoredSnapshot
from kernelhub.store.retention import PRUNE_AFTER, RetentionSweeper
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


async def test_local_blob_files_whose_snapshots_are_gone_are_pruned(
    store: SqliteStore, tmp_path: Path
) -> None:
    """A snapshot deleted by another node (its row and object gone) leaves this node's
    copy behind; the sweep removes it once it is old enough that no capture or upload can
    still be writing it. A file with a row stays, whatever its age."""
    await store.insert_session(session("s1", "alice"))
    await store.insert_snapshot(
        StoredSnapshot(
            id="kept", session_id="s1", owner="alice", created_at=datetime.now(UTC),
            size=1, sha256="0", mac="0", metadata={"kind": "snapshot"},
        )
    )  # fmt: skip
    blobs = BlobStore(tmp_path)
    blobs.prepare("x")  # makes the directory
    old = time.time() - PRUNE_AFTER - 60
    for name, mtime in (("kept.blob", old), ("gone.blob", old), ("fresh.blob", None),
                        (".gone.1234.part", old)):  # fmt: skip
        (blobs.root / name).write_bytes(b"x")
        if mtime is not None:
            os.utime(blobs.root / name, (mtime, mtime))
    sweeper = RetentionSweeper(store, blobs, StorageSettings())
    await sweeper.sweep()
    assert sorted(p.name for p in blobs.root.iterdir()) == ["fresh.blob", "kept.blob"]
    # Not every sweep: the next one within the hour looks at no file.
    (blobs.root / "gone.blob").write_bytes(b"x")
    os.utime(blobs.root / "gone.blob", (old, old))
    await sweeper.sweep()
    assert (blobs.root / "gone.blob").exists()
