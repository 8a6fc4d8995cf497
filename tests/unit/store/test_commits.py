"""The store's shared commits against a real SQLite file: a write that may wait rides
with what follows, and its callback runs only once the row is on disk (another
connection, as after a crash, sees it)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kernelhub.models import ExecutionStatus, StatusEvent, StreamEvent
from kernelhub.session.fanout import SessionFanout
from kernelhub.store.records import StoredExecution, StoredSession
from kernelhub.store.sqlite import SqliteStore

SID = "s1"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3")
    await s.insert_session(
        StoredSession(
            id=SID,
            owner="alice",
            backend="docker",
            state="ready",
            created_at=datetime.now(UTC),
            limits={},
            metadata={},
            reason=None,
            deleted_at=None,
        )
    )
    yield s
    await s.close()


def on_disk(store: SqliteStore, execution_id: str) -> bool:
    """What a second process would find (no commit of ours is forced by asking)."""
    with contextlib.closing(sqlite3.connect(store.path)) as other:
        return bool(
            other.execute("SELECT 1 FROM executions WHERE id = ?", (execution_id,)).fetchall()
        )


async def test_a_new_execution_waits_with_its_running_and_is_on_disk_before_anyone_hears(
    store: SqliteStore,
) -> None:
    fanout = SessionFanout(SID, store, quiet_wait=0.3)
    sub = fanout.subscribe(1 << 20)
    seen: list[object] = []
    sub.direct = lambda item: seen.append(item.seq) is None
    row = StoredExecution(
        id="e1", session_id=SID, owner="alice", code="print(1)", status=ExecutionStatus.QUEUED,
        idempotency_key=None, created_at=datetime.now(UTC), record=None,
    )  # fmt: skip

    fanout.publish(StatusEvent(execution_id="e1", seq=1, status=ExecutionStatus.RUNNING))
    store.insert_execution(row, lambda error: seen.append(on_disk(store, "e1")), wait=0.3)
    await asyncio.sleep(0.05)
    assert seen == [] and not on_disk(store, "e1")  # both wait for company

    fanout.publish(StreamEvent(execution_id="e1", seq=2, name="stdout", text="1\n"))
    await asyncio.sleep(0.01)  # output does not wait, and takes them along
    assert seen == [1, True, 2]
    await fanout.close()
