"""Storage accounting, retention and the bounded audit log against each backend. The
usage oracle is a full scan of the tables (what the ledger exists to avoid), compared
with what the ledger counted as the rows went in."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import AuditEntry
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sql import SqlStore
from tests.store.conftest import Opener
from tests.store.rows import fill, scanned_usage, session


async def test_usage_is_counted_as_rows_are_written_and_survives_a_restart(
    store: SqlStore, opener: Opener
) -> None:
    await store.insert_session(session("a1", "alice"))
    await store.insert_session(session("b1", "bob"))
    await fill(store, "a1", "alice", 5, 10_000)
    await fill(store, "b1", "bob", 2, 100)
    # A replayed event (same seq) is ignored by the store and must not be charged twice.
    await store.append_event("a1", 1, "a1-e0", '{"again":1}')
    alice, bob = store.ledger.usage("alice"), store.ledger.usage("bob")
    assert alice == await scanned_usage(store, "alice") and alice > 50_000
    assert bob == await scanned_usage(store, "bob") and 0 < bob < alice
    await store.close()
    reopened = await opener()
    try:
        assert reopened.ledger.usage("alice") == alice
        assert reopened.ledger.usage("bob") == bob
    finally:
        await reopened.close()


async def test_the_sweeper_purges_ended_sessions_only_after_their_retention(
    store: SqlStore, tmp_path: Path
) -> None:
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), StorageSettings(retention=3600))
    for sid in ("live", "dead", "gone"):
        await store.insert_session(session(sid, "alice"))
        await fill(store, sid, "alice", 1, 10)
    await store.update_session("dead", state="dead", reason="oom")
    await store.update_session("gone", state="deleted", deleted=True)
    assert await sweeper.sweep() == 0  # within their retention: kept
    assert await store.get_session("dead") is not None
    later = datetime.now(UTC) + timedelta(seconds=3601)
    assert await sweeper.sweep(now=later) == 2
    assert await store.get_session("dead") is None and await store.get_session("gone") is None
    assert await store.get_session("live") is not None
    assert store.ledger.usage("alice") == await scanned_usage(store, "alice") > 0


async def test_audit_keeps_bounded_code_with_its_length_and_hash_and_has_a_retention(
    store: SqlStore, tmp_path: Path
) -> None:
    code = "é" * 100 + "print('end')"  # multi-byte: the cut must not split a character
    await store.audit(AuditEntry(principal="alice", action="execution", code=code))
    await store.audit(AuditEntry(principal="alice", action="session.create"))
    rows = await store.audit_log()
    raw = code.encode()
    assert rows[0]["code"] == "é" * 32 and len(rows[0]["code"].encode()) <= 64
    assert rows[0]["code_bytes"] == len(raw)
    assert rows[0]["code_sha256"] == hashlib.sha256(raw).hexdigest()
    assert rows[1]["code"] is None and rows[1]["code_bytes"] is None
    sweeper = RetentionSweeper(store, BlobStore(tmp_path), StorageSettings(audit_retention=60))
    await sweeper.sweep()
    assert len(await store.audit_log()) == 2
    await sweeper.sweep(now=datetime.now(UTC) + timedelta(seconds=61))
    assert await store.audit_log() == []
