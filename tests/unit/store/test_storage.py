"""What is SQLite's own (a purge gives the file's space back; a database from before
schema versions is migrated) and the pure parts of storage: the guard, the dialects.
tests/store/ runs the rest of the store's tests against every backend."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kernelhub.config import StorageSettings
from kernelhub.errors import ConfigError, StorageFullError
from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store import migrations
from kernelhub.store.migrations import SCHEMA
from kernelhub.store.quota import StorageGuard, StorageLedger
from kernelhub.store.records import AuditEntry, StoredExecution, StoredSession, StoredSnapshot
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sqlite import SqliteStore


def session(sid: str, owner: str) -> StoredSession:
    return StoredSession(
        id=sid, owner=owner, backend="docker", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3", audit_code_bytes=64)
    yield s
    await s.close()


def scanned_usage(path: Path, owner: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        events = db.execute(
            "SELECT COALESCE(SUM(length(e.body)), 0) FROM events e"
            " JOIN sessions s ON s.id = e.session_id WHERE s.owner = ?",
            (owner,),
        ).fetchone()[0]
        execs = db.execute(
            "SELECT COALESCE(SUM(length(code) + COALESCE(length(record), 0)), 0)"
            " FROM executions WHERE owner = ?",
            (owner,),
        ).fetchone()[0]
        return int(events + execs)


def checkpoint(path: Path) -> None:
    """Another connection checkpoints the WAL into the file (the file's size is then real)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


async def fill(store: SqliteStore, sid: str, owner: str, cells: int, body_bytes: int) -> None:
    """``cells`` executions with one event of about ``body_bytes`` each, and a record."""
    now = datetime.now(UTC)
    for i in range(cells):
        eid = f"{sid}-e{i}"
        await store.insert_execution(
            StoredExecution(
                id=eid, session_id=sid, owner=owner, code=f"print({i})" * 10,
                status=ExecutionStatus.QUEUED, idempotency_key=None, created_at=now, record=None,
            )
        )  # fmt: skip
        body = '{"type":"stream","text":"' + ("x" * body_bytes) + '"}'
        await store.append_event(sid, i + 1, eid, body, lambda error: None)
        record = ExecutionRecord(
            execution_id=eid, status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY,
            queued_at=now, finished_at=now,
        )  # fmt: skip
        await store.finish_execution(
            record, AuditEntry(principal=owner, action="execution", session_id=sid, code="x")
        )


async def test_purge_deletes_a_sessions_rows_and_the_file_shrinks(
    store: SqliteStore, tmp_path: Path
) -> None:
    blobs = BlobStore(tmp_path)
    await store.insert_session(session("a1", "alice"))
    await store.insert_session(session("a2", "alice"))
    await fill(store, "a1", "alice", 40, 100_000)  # ~4 MB, purged
    await fill(store, "a2", "alice", 2, 1_000)  # kept
    for snap_id, kind in (("hib1", "hibernation"), ("user1", "snapshot")):
        blobs.path(snap_id).parent.mkdir(parents=True, exist_ok=True)
        blobs.path(snap_id).write_bytes(b"blob")
        await store.insert_snapshot(
            StoredSnapshot(
                id=snap_id, session_id="a1", owner="alice", created_at=datetime.now(UTC),
                size=4, sha256="0", mac="0", metadata={"kind": kind},
            )
        )  # fmt: skip
    checkpoint(store.path)
    before = store.path.stat().st_size
    kept = store.ledger.usage("alice") - store.ledger.session_bytes("a1")
    await store.update_session("a1", state="deleted", deleted=True)
    # Small vacuum steps: the space comes back over many of them.
    await RetentionSweeper(store, blobs, StorageSettings(), vacuum_pages=64).purge("a1")
    after = store.path.stat().st_size
    assert after < before - 3_000_000, (before, after)
    assert await store.events_of("a1-e0") == [] and await store.get_session("a1") is None
    assert await store.get_execution("a1-e0") is None
    assert await store.get_execution("a2-e0") is not None
    assert store.ledger.usage("alice") == kept == scanned_usage(store.path, "alice")
    # The internal snapshot went with its session; the one the user took is theirs to delete.
    assert not blobs.path("hib1").exists() and blobs.path("user1").exists()
    assert [s.id for s in await store.list_snapshots("alice")] == ["user1"]


async def test_a_database_from_before_versioning_is_migrated_once(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)  # the version-1 schema, no auto_vacuum, no schema_version
        db.execute(
            "INSERT INTO sessions VALUES ('s1','alice','docker','dead','2026-01-01T00:00:00+00:00',"
            "'{}','{}','oom',NULL)"
        )
        db.execute("INSERT INTO events VALUES ('s1', 1, 'e1', ?)", ("y" * 5000,))
        assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    store = await SqliteStore.open(path)
    try:
        assert store.ledger.usage("alice") == 5000
        with contextlib.closing(sqlite3.connect(store.path)) as db:
            stored = (
                db.execute("SELECT version FROM schema_version").fetchall(),
                db.execute("PRAGMA auto_vacuum").fetchone()[0],
                db.execute("SELECT ended_at FROM sessions").fetchone()[0],
            )
        assert stored[0] == [(migrations.LATEST,)] and stored[1] == 2 and stored[2] is not None
    finally:
        await store.close()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("UPDATE schema_version SET version = ?", (migrations.LATEST + 1,))
    with pytest.raises(ConfigError, match="newer than this kernelhub"):
        await SqliteStore.open(path)


def test_the_guard_names_usage_quota_and_knob_and_honours_overrides(tmp_path: Path) -> None:
    ledger = StorageLedger()
    ledger.add_session("a1", "alice", 2000)
    ledger.add_session("b1", "bob", 2000)
    settings = StorageSettings(quota_bytes=1000, quotas={"bob": None}, min_free_bytes=0)
    guard = StorageGuard(settings, ledger, tmp_path)
    with pytest.raises(StorageFullError) as caught:
        guard.check("alice")
    message = str(caught.value)
    assert "2000" in message and "1000" in message and "KERNELHUB_STORAGE__QUOTA_BYTES" in message
    guard.check("bob")  # no quota for bob
    guard.check("carol")  # nothing stored yet
    ledger.forget("a1")
    guard.check("alice")


def test_the_guard_counts_what_unfinished_cells_may_still_store(tmp_path: Path) -> None:
    ledger = StorageLedger()
    ledger.add_session("a1", "alice", 400)
    in_flight = {"alice": 0}
    settings = StorageSettings(quota_bytes=1000, quotas={"bob": None}, min_free_bytes=0)
    guard = StorageGuard(settings, ledger, tmp_path, in_flight=in_flight.__getitem__)
    guard.check("alice")  # 400 stored, nothing in flight
    in_flight["alice"] = 599
    guard.check("alice")  # 999: still room
    in_flight["alice"] = 600
    with pytest.raises(StorageFullError) as caught:
        guard.check("alice")
    message = str(caught.value)
    assert "400" in message and "600" in message and "1000" in message
    assert "reserved" in message and "KERNELHUB_STORAGE__QUOTA_BYTES" in message
    assert caught.value.retry_after == 2  # a cell finishing soon frees it
    guard.check("bob")  # no quota: never asked


def test_the_disk_floor_reads_statvfs_at_most_once_per_interval(tmp_path: Path) -> None:
    clock = [0.0]
    disk = {"free": 10 * 2**30, "reads": 0}

    def statvfs(path: Path) -> tuple[int, int]:
        disk["reads"] += 1
        return disk["free"], 100 * 2**30

    settings = StorageSettings(min_free_bytes=2**30, min_free_fraction=0.05)
    guard = StorageGuard(
        settings, StorageLedger(), tmp_path, statvfs=statvfs, clock=lambda: clock[0]
    )
    guard.check("alice")
    disk["free"] = 4 * 2**30  # below 5% of 100 GiB, above 1 GiB: the larger floor applies
    guard.check("alice")  # the cached reading is still fresh
    assert disk["reads"] == 1
    clock[0] += settings.disk_check_interval
    with pytest.raises(StorageFullError, match="KERNELHUB_STORAGE__MIN_FREE_BYTES") as caught:
        guard.check("alice")
    assert str(4 * 2**30) in str(caught.value) and str(5 * 2**30) in str(caught.value)
    assert disk["reads"] == 2
