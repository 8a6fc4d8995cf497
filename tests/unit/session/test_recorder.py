"""The recorder against a real SqliteStore: an execution's row, its events, its final
record and its audit entry land in the store in that order and with who/what/where from
the in-flight record; restarts (no in-flight record) and orphans are recorded from what
the store knows; a store that fails is logged, never reported as a success."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kernelhub.config import Limits
from kernelhub.errors import StoreError
from kernelhub.models import (
    EndedBy,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    NoticeEvent,
    StatusEvent,
    StreamEvent,
)
from kernelhub.session import recorder as recorder_module
from kernelhub.session.live import InFlight, LiveSession
from kernelhub.session.recorder import Observer, Recorder
from kernelhub.session.state import SessionState
from kernelhub.store.records import StoredExecution, StoredSession
from kernelhub.store.sqlite import SqliteStore
from tests.conftest import eventually


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3", audit_code_bytes=64)
    yield s
    await s.close()


class Seen:
    """An observer that remembers what it was told."""

    def __init__(self) -> None:
        self.finals: list[ExecutionRecord] = []
        self.observer = Observer(on_final=self.finals.append)


async def live_session(store: SqliteStore, recorder: Recorder, sid: str = "s1") -> LiveSession:
    stored = StoredSession(
        id=sid, owner="alice", backend="local", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip
    await store.insert_session(stored)
    return LiveSession(stored=stored, limits=Limits(), fanout=recorder.fanout(sid))


def row(eid: str, sid: str = "s1", code: str = "print(1)") -> StoredExecution:
    return StoredExecution(
        id=eid, session_id=sid, owner="alice", code=code, status=ExecutionStatus.QUEUED,
        idempotency_key=None, created_at=datetime.now(UTC), record=None,
    )  # fmt: skip


def final(eid: str, seq: int, reason: str | None = None) -> FinalEvent:
    now = datetime.now(UTC)
    record = ExecutionRecord(
        execution_id=eid, status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY,
        queued_at=now, finished_at=now, reason=reason,
    )  # fmt: skip
    return FinalEvent(execution_id=eid, seq=seq, record=record)


async def test_a_cell_is_stored_row_events_record_and_audit(store: SqliteStore) -> None:
    seen = Seen()
    rec = Recorder(store, seen.observer, coalesce_window=0.0)
    live = await live_session(store, rec)
    told: list[str] = []
    rec.execution(row("e1"))
    rec.when_stored("e1", lambda: told.append("e1"))
    live.inflight["e1"] = InFlight(principal="bob", code="print(1)", client="sdk/1.0")
    rec.event(live, StatusEvent(execution_id="e1", seq=1, status=ExecutionStatus.RUNNING))
    rec.event(live, StreamEvent(execution_id="e1", seq=2, name="stdout", text="1\n"))
    rec.event(live, final("e1", 3))
    # The record is known at once, before the store has it.
    recent = rec.recent("e1")
    assert recent is not None and recent.status is ExecutionStatus.COMPLETED
    await asyncio.wait_for(rec.settled("e1"), 10)

    assert told == ["e1"]
    assert "e1" not in live.inflight
    assert [r.execution_id for r in seen.finals] == ["e1"]
    stored = await store.get_execution("e1")
    assert stored is not None and stored.status is ExecutionStatus.COMPLETED
    assert stored.record is not None and stored.record.execution_id == "e1"
    assert [e.type for e in await store.events_of("e1")] == ["status", "stream", "final"]
    assert await store.has_started("e1")
    (entry,) = await store.audit_log("s1", action="execution")
    assert (entry["principal"], entry["code"], entry["client"], entry["status"]) == (
        "bob", "print(1)", "sdk/1.0", "completed",
    )  # fmt: skip


async def test_when_stored_after_the_commit_runs_at_once(store: SqliteStore) -> None:
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    await live_session(store, rec)
    rec.execution(row("e1"))
    await store.flush()
    await eventually(lambda: rec._storing == {}, 5)
    told: list[int] = []
    rec.when_stored("e1", lambda: told.append(1))
    assert told == [1]
    # A callback that raises does not stop the others.
    rec.execution(row("e2"))

    def fails() -> None:
        raise RuntimeError("a subscriber's trouble")

    rec.when_stored("e2", fails)
    rec.when_stored("e2", lambda: told.append(2))
    await store.flush()
    await eventually(lambda: told == [1, 2], 5)


async def test_a_final_without_in_flight_record_audits_the_stored_code(
    store: SqliteStore,
) -> None:
    """After a restart the code is only in the store: the audit entry takes it from there,
    and the principal is the session's owner."""
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    live = await live_session(store, rec)
    await store.insert_execution(row("e1", code="x = 42"))
    rec.event(live, final("e1", 1, reason="ended by the test"))
    await asyncio.wait_for(rec.settled("e1"), 10)
    (entry,) = await store.audit_log("s1", action="execution")
    assert (entry["principal"], entry["code"], entry["client"]) == ("alice", "x = 42", None)
    assert json.loads(entry["detail"]) == {"reason": "ended by the test", "ended_by": "reply"}


async def test_an_answer_to_input_is_audited_with_who_answered(store: SqliteStore) -> None:
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    live = await live_session(store, rec)
    rec.execution(row("e1"))
    event = InputReplyEvent(execution_id="e1", seq=1, value="yes", answered_by="carol")
    rec.event(live, event)
    await live.fanout.flush()

    async def audited() -> list[dict[str, Any]]:
        return await store.audit_log("s1", action="execution.input")

    deadline = asyncio.get_running_loop().time() + 5
    while not (entries := await audited()):
        assert asyncio.get_running_loop().time() < deadline, "no audit entry"
        await asyncio.sleep(0.01)
    (entry,) = entries
    assert entry["principal"] == "carol"
    assert json.loads(entry["detail"]) == {"value": "yes", "password": False}


async def test_an_orphan_is_ended_with_a_notice_and_its_record(store: SqliteStore) -> None:
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    live = await live_session(store, rec)
    orphan = row("e1")
    await store.insert_execution(orphan)
    seqs = iter(range(10, 20))
    await rec.orphaned(
        live, orphan, ExecutionStatus.FAILED, "the gateway restarted", lambda: next(seqs),
        state_lost=True,
    )  # fmt: skip
    await live.fanout.flush()
    stored = await store.get_execution("e1")
    assert stored is not None and stored.status is ExecutionStatus.FAILED
    assert stored.record is not None
    assert (stored.record.state_lost, stored.record.ended_by) == (True, EndedBy.KILL)
    assert stored.record.reason == "the gateway restarted"
    events = await store.events_of("e1")
    assert [(e.type, e.seq) for e in events] == [("notice", 10), ("final", 11)]
    assert isinstance(events[0], NoticeEvent) and events[0].message == "the gateway restarted"
    assert await store.unfinished_executions("s1") == []


async def test_phases_and_hibernation_reach_the_session_row(store: SqliteStore) -> None:
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    live = await live_session(store, rec)
    live.phase, live.hibernation = SessionState.HIBERNATED, "snap-1"
    await rec.phase(live, reason="idle")
    got = await store.get_session("s1")
    assert got is not None
    assert (got.state, got.reason, got.hibernation) == ("hibernated", "idle", "snap-1")
    live.phase, live.hibernation = SessionState.READY, None
    await rec.phase(live)
    got = await store.get_session("s1")
    assert got is not None and (got.state, got.hibernation) == ("ready", None)
    await rec.deleted("s1")
    assert await store.list_sessions("alice") == []
    (gone,) = await store.list_sessions("alice", include_deleted=True)
    assert gone.state == "deleted" and gone.deleted_at is not None


async def test_events_after_the_store_closed_are_refused(store: SqliteStore) -> None:
    """A gateway stopping: an event that arrives after the store closed is refused loudly
    (the caller sees it), not recorded as a success."""
    seen = Seen()
    rec = Recorder(store, seen.observer, coalesce_window=0.0)
    live = await live_session(store, rec)
    await store.insert_execution(row("e1"))
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        rec.event(live, final("e1", 1))
    assert seen.finals == []
    rec.close()


async def test_recent_records_are_bounded(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recorder_module, "_RECENT_RECORDS", 2)
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    live = await live_session(store, rec)
    for i in range(3):
        await store.insert_execution(row(f"e{i}"))
        rec.event(live, final(f"e{i}", i + 1))
        await asyncio.wait_for(rec.settled(f"e{i}"), 10)
    assert rec.recent("e0") is None
    assert [rec.recent(f"e{i}") is not None for i in (1, 2)] == [True, True]


async def test_settled_on_an_unknown_execution_returns(store: SqliteStore) -> None:
    rec = Recorder(store, Observer(), coalesce_window=0.0)
    await asyncio.wait_for(rec.settled("nobody"), 1)
