"""Rows for the store tests, and an oracle that reads the tables past the store."""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import UTC, datetime

from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus, StreamEvent
from kernelhub.store.postgres import PostgresStore, translate
from kernelhub.store.queries import Op, Query
from kernelhub.store.records import AuditEntry, StoredExecution, StoredSession
from kernelhub.store.sql import SqlStore
from kernelhub.store.sqlite import SqliteStore

NOW = datetime.now(UTC)


def session(sid: str, owner: str = "alice") -> StoredSession:
    return StoredSession(
        id=sid, owner=owner, backend="docker", state="ready", created_at=NOW, limits={"a": 1},
        metadata={"m": "x"}, reason=None, deleted_at=None,
    )  # fmt: skip


def execution(
    eid: str, sid: str = "s1", key: str | None = None, owner: str = "alice"
) -> StoredExecution:
    return StoredExecution(
        id=eid, session_id=sid, owner=owner, code=f"print({eid!r})",
        status=ExecutionStatus.QUEUED, idempotency_key=key, created_at=datetime.now(UTC),
        record=None,
    )  # fmt: skip


def record(eid: str) -> ExecutionRecord:
    return ExecutionRecord(
        execution_id=eid, status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY,
        queued_at=NOW, finished_at=NOW,
    )  # fmt: skip


def stream(seq: int, eid: str = "e1", text: str = "x") -> str:
    return StreamEvent(execution_id=eid, seq=seq, name="stdout", text=text).model_dump_json()


async def fill(store: SqlStore, sid: str, owner: str, cells: int, body_bytes: int) -> None:
    """``cells`` executions with one event of about ``body_bytes`` each, and a record."""
    for i in range(cells):
        eid = f"{sid}-e{i}"
        await store.insert_execution(execution(eid, sid, owner=owner))
        await store.append_event(sid, i + 1, eid, stream(i + 1, eid, "x" * body_bytes))
        await store.finish_execution(
            record(eid), AuditEntry(principal=owner, action="execution", session_id=sid, code="x")
        )


def statement(sql: str, *params: object) -> Op[list[tuple[object, ...]]]:
    return (yield Query(sql, params))


async def scan(store: SqlStore, sql: str, *params: object) -> list[tuple[object, ...]]:
    """What is really in the tables, read past the store's methods (in order with them)."""
    return await store._read(statement(sql, *params))


def committed(store: SqlStore, sql: str, *params: object) -> list[tuple[object, ...]]:
    """What another connection finds, as another process would after a crash (asking
    forces no commit of ours)."""
    if isinstance(store, SqliteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as db:
            return db.execute(sql, params).fetchall()
    assert isinstance(store, PostgresStore)
    import psycopg

    with psycopg.connect(store.url) as conn:
        return conn.execute(translate(sql), params).fetchall()


async def scanned_usage(store: SqlStore, owner: str) -> int:
    rows = await scan(
        store,
        "SELECT (SELECT COALESCE(SUM(length(e.body)), 0) FROM events e JOIN sessions s"
        " ON s.id = e.session_id WHERE s.owner = ?) + (SELECT COALESCE(SUM(length(code)"
        " + COALESCE(length(record), 0)), 0) FROM executions WHERE owner = ?)",
        owner,
        owner,
    )
    return int(str(rows[0][0]))
