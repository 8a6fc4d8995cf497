"""The recorder's rows: executions, their events, the audit log, and batches of cells, as
sans-I/O operations (see queries.py for how an operation is run).

Every write that stores bytes of a session charges the :class:`StorageLedger` as it goes;
the driver persists what was charged in the same transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter

from kernelhub import jsonslices
from kernelhub.errors import StoreConflictError
from kernelhub.models import Event, ExecutionRecord, ExecutionStatus
from kernelhub.store.queries import Op, Query, Row, time_of
from kernelhub.store.quota import StorageLedger
from kernelhub.store.records import (
    AuditEntry,
    StoredBatch,
    StoredBatchItem,
    StoredExecution,
    bounded_code,
    now_iso,
)

_EVENT = TypeAdapter(Event)

# -- executions -------------------------------------------------------------------------

_EXECUTION = (
    "SELECT id, session_id, owner, code, status, idempotency_key, created_at, record"
    " FROM executions"
)


def _execution(r: Row) -> StoredExecution:
    return StoredExecution(
        id=r[0],
        session_id=r[1],
        owner=r[2],
        code=r[3],
        status=ExecutionStatus(r[4]),
        idempotency_key=r[5],
        created_at=datetime.fromisoformat(r[6]),
        record=ExecutionRecord.model_validate_json(r[7]) if r[7] else None,
    )


def insert_execution(e: StoredExecution, ledger: StorageLedger) -> Op[StoredExecution]:
    """Insert; if the owner already used the idempotency key, return that execution."""
    inserted = yield Query(
        "INSERT INTO executions (id, session_id, owner, code, status, idempotency_key,"
        " created_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        (e.id, e.session_id, e.owner, e.code, e.status.value, e.idempotency_key,
         e.created_at.isoformat()),
        rowcount=True,
    )  # fmt: skip
    if inserted[0][0]:
        ledger.charge(e.session_id, len(e.code))
        return e
    found = yield from execution_by_key(e.owner, e.idempotency_key or "")
    if found is None:  # the same id twice: a caller's bug, not a retry
        raise StoreConflictError(f"execution {e.id} is stored already")
    return found


def update_execution(
    execution_id: str,
    status: ExecutionStatus,
    record: ExecutionRecord | None,
    ledger: StorageLedger,
) -> Op[None]:
    body = record.model_dump_json() if record else None
    rows = yield Query(
        "UPDATE executions SET status = ?, record = COALESCE(?, record) WHERE id = ?"
        " RETURNING session_id",
        (status.value, body, execution_id),
    )
    for (session_id,) in rows:
        ledger.charge(session_id, len(body or ""))


def finish_execution(
    record: ExecutionRecord, entry: AuditEntry, code_bytes: int, ledger: StorageLedger
) -> Op[None]:
    """The final record and its audit entry (one transaction: the driver's)."""
    body = record.model_dump_json()
    yield Query(
        "UPDATE executions SET status = ?, record = ? WHERE id = ?",
        (record.status.value, body, record.execution_id),
    )
    ledger.charge(entry.session_id or "", len(body))
    yield from audit(entry, code_bytes)


def get_execution(execution_id: str) -> Op[StoredExecution | None]:
    rows = yield Query(_EXECUTION + " WHERE id = ?", (execution_id,))
    return _execution(rows[0]) if rows else None


def execution_by_key(owner: str, key: str) -> Op[StoredExecution | None]:
    rows = yield Query(_EXECUTION + " WHERE owner = ? AND idempotency_key = ?", (owner, key))
    return _execution(rows[0]) if rows else None


def unfinished_executions(session_id: str) -> Op[list[StoredExecution]]:
    rows = yield Query(
        _EXECUTION + " WHERE session_id = ? AND record IS NULL ORDER BY created_at", (session_id,)
    )
    return [_execution(r) for r in rows]


def executions_of(session_id: str) -> Op[list[StoredExecution]]:
    rows = yield Query(
        _EXECUTION + " WHERE session_id = ? ORDER BY created_at, rowid",
        (session_id,),
        # No rowid: ids break the (microsecond) ties of created_at.
        postgres=_EXECUTION + " WHERE session_id = ? ORDER BY created_at, id",
    )
    return [_execution(r) for r in rows]


# -- events -----------------------------------------------------------------------------


def append_events(rows: list[tuple[str, int, str, str]], ledger: StorageLedger) -> Op[None]:
    """Event rows ``(session_id, seq, execution_id, JSON body)``; a row already stored under
    its seq stands (a retried commit may meet the row it wrote before)."""
    inserted = yield Query(
        "INSERT INTO events (session_id, seq, execution_id, body) VALUES (?,?,?,?)"
        " ON CONFLICT DO NOTHING",
        many=rows,
        rowcount=True,
    )
    for (n,), (session_id, _, _, body) in zip(inserted, rows, strict=True):
        if n:
            ledger.charge(session_id, len(body))


def events_since(session_id: str, since: int, limit: int, max_bytes: int) -> Op[list[Row]]:
    rows = yield Query(
        "SELECT seq, body FROM events WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?",
        (session_id, since, limit),
    )
    size = 0
    for n, (_, body) in enumerate(rows):
        size += len(body)
        if size >= max_bytes:
            return rows[: n + 1]
    return rows


def events_of(execution_id: str) -> Op[list[str]]:
    """The events' JSON bodies: :func:`parse_events` makes them events, on the loop."""
    rows = yield Query(
        "SELECT body FROM events WHERE execution_id = ? ORDER BY seq", (execution_id,)
    )
    return [str(r[0]) for r in rows]


def session_events_of(session_id: str) -> Op[list[str]]:
    rows = yield Query(
        "SELECT body FROM events WHERE session_id = ? AND execution_id = '' ORDER BY seq",
        (session_id,),
    )
    return [str(r[0]) for r in rows]


async def parse_events(bodies: list[str]) -> list[Event]:
    """Stored bodies as events. A big one is read a slice at a time (``jsonslices``) and
    then validated as Python: pydantic's ``validate_json`` of 8 MiB held the GIL, so the
    loop, for 15-50 ms even from the store's thread."""
    events = []
    for body in bodies:
        if len(body) < 2 * jsonslices.SLICE:
            events.append(_EVENT.validate_json(body))
        else:
            value = await jsonslices.drive(jsonslices.loads(body.encode()))
            events.append(_EVENT.validate_python(value))
    return events


def has_started(execution_id: str) -> Op[bool]:
    rows = yield Query(
        "SELECT 1 FROM events WHERE execution_id = ? AND body LIKE ? LIMIT 1",
        (execution_id, '%"type":"status","status":"running"%'),
    )
    return bool(rows)


def last_seq(session_id: str) -> Op[int]:
    rows = yield Query("SELECT MAX(seq) FROM events WHERE session_id = ?", (session_id,))
    return int(rows[0][0] or 0)


# -- audit ------------------------------------------------------------------------------

AUDIT_COLUMNS = (
    "id", "at", "principal", "action", "session_id", "execution_id", "code", "status",
    "duration", "cpu_seconds", "peak_memory_bytes", "output_bytes", "client", "detail",
    "code_bytes", "code_sha256",
)  # fmt: skip


_INSERT_AUDIT = f"INSERT INTO audit ({', '.join(AUDIT_COLUMNS[1:])}) VALUES ({','.join('?' * 15)})"


def audit(entry: AuditEntry, code_bytes: int) -> Op[None]:
    # Who, when and what, with the code bounded: its head, full length and hash.
    code, size, sha256 = bounded_code(entry.code, code_bytes)
    yield Query(
        _INSERT_AUDIT,
        (now_iso(), entry.principal, entry.action, entry.session_id, entry.execution_id, code,
         entry.status, entry.duration, entry.cpu_seconds, entry.peak_memory_bytes,
         entry.output_bytes, entry.client,
         json.dumps(entry.detail) if entry.detail is not None else None, size, sha256),
    )  # fmt: skip


def audit_log(
    session_id: str | None,
    principal: str | None,
    action: str | None,
    text: str | None,
    before: int | None,
    limit: int | None,
) -> Op[list[dict[str, Any]]]:
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("session_id", session_id), ("principal", principal),
                          ("action", action)):  # fmt: skip
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    pg_where = list(where)
    if text:
        match = "(instr(lower(code), lower(?)) > 0 OR instr(lower(detail), lower(?)) > 0)"
        where.append(match)
        pg_where.append(match.replace("instr", "strpos"))
        params += [text, text]
    if before is not None:
        where.append("id < ?")
        pg_where.append("id < ?")
        params.append(before)
    order = " ORDER BY id" if limit is None else f" ORDER BY id DESC LIMIT {int(limit)}"

    def sql(conditions: list[str]) -> str:
        head = f"SELECT {', '.join(AUDIT_COLUMNS)} FROM audit"
        return head + (" WHERE " + " AND ".join(conditions) if conditions else "") + order

    rows = yield Query(sql(where), tuple(params), postgres=sql(pg_where))
    return [dict(zip(AUDIT_COLUMNS, row, strict=True)) for row in rows]


# -- batches ----------------------------------------------------------------------------


def _batch(r: Row) -> StoredBatch:
    return StoredBatch(
        id=r[0],
        owner=r[1],
        created_at=datetime.fromisoformat(r[2]),
        concurrency=r[3],
        cancelled_at=time_of(r[4]),
    )


def _batch_item(r: Row) -> StoredBatchItem:
    return StoredBatchItem(
        batch_id=r[0],
        index=r[1],
        owner=r[2],
        idempotency_key=r[3],
        status=ExecutionStatus(r[4]),
        session_id=r[5],
        execution_id=r[6],
        queued_at=datetime.fromisoformat(r[7]),
        started_at=time_of(r[8]),
        finished_at=time_of(r[9]),
        error=r[10],
        duplicate_of=(r[11], r[12]) if r[11] is not None else None,
        node=r[13],
    )


def insert_batch(batch: StoredBatch, items: Sequence[StoredBatchItem]) -> Op[list[StoredBatchItem]]:
    """A batch and its items. An item whose idempotency key the owner already used (in an
    earlier batch, or earlier in this one) is stored as a duplicate of that item, without
    the key; the items are returned as stored."""
    yield Query(
        "INSERT INTO batches (id, owner, created_at, concurrency) VALUES (?,?,?,?)",
        (batch.id, batch.owner, batch.created_at.isoformat(), batch.concurrency),
    )
    stored: list[StoredBatchItem] = []
    for item in items:
        if item.idempotency_key is not None:
            first = yield Query(
                "SELECT batch_id, idx FROM batch_items WHERE owner = ? AND idempotency_key = ?",
                (item.owner, item.idempotency_key),
            )
            if first:
                item = item.model_copy(
                    update={"idempotency_key": None, "duplicate_of": (first[0][0], first[0][1])}
                )
        dup = item.duplicate_of
        yield Query(
            "INSERT INTO batch_items (batch_id, idx, owner, idempotency_key, status, queued_at,"
            " dup_batch_id, dup_idx, body) VALUES (?,?,?,?,?,?,?,?,?)",
            (item.batch_id, item.index, item.owner, item.idempotency_key, item.status.value,
             item.queued_at.isoformat(), dup[0] if dup else None, dup[1] if dup else None,
             None if dup else item.body),
        )  # fmt: skip
        item = item.model_copy(update={"body": None})
        stored.append(item)
    return stored


def used_batch_keys(owner: str, keys: Sequence[str]) -> Op[set[str]]:
    if not keys:
        return set()
    rows = yield Query(
        "SELECT idempotency_key FROM batch_items WHERE owner = ? AND idempotency_key IN"
        f" ({','.join('?' * len(keys))})",
        (owner, *keys),
    )
    return {r[0] for r in rows}


def update_batch_item(
    batch_id: str,
    index: int,
    *,
    status: ExecutionStatus | None,
    session_id: str | None,
    execution_id: str | None,
    started_at: datetime | None,
    finished_at: datetime | None,
    error: str | None,
    release_key: bool,
    submitted_at: datetime | None = None,
    claimed_by: str | None = None,
) -> Op[bool]:
    """Returns whether the row changed: with ``claimed_by``, only while that node's claim
    on the item stands (a lapsed claim was settled by another node: batch_queue.py)."""
    final = int(status is not None and status.is_final)  # its input is no longer needed
    changed = yield Query(
        "UPDATE batch_items SET status = COALESCE(?, status),"
        " session_id = COALESCE(?, session_id), execution_id = COALESCE(?, execution_id),"
        " started_at = COALESCE(?, started_at), finished_at = COALESCE(?, finished_at),"
        " submitted_at = COALESCE(?, submitted_at), error = COALESCE(?, error),"
        " idempotency_key = CASE WHEN ? = 1 THEN NULL ELSE idempotency_key END,"
        " body = CASE WHEN ? = 1 THEN NULL ELSE body END"
        " WHERE batch_id = ? AND idx = ? AND (CAST(? AS TEXT) IS NULL OR node = ?)",
        (status.value if status else None, session_id, execution_id,
         started_at.isoformat() if started_at else None,
         finished_at.isoformat() if finished_at else None,
         submitted_at.isoformat() if submitted_at else None, error, int(release_key), final,
         batch_id, index, claimed_by, claimed_by),
        rowcount=True,
    )  # fmt: skip
    return bool(changed[0][0])


def cancel_batch(batch_id: str) -> Op[None]:
    yield Query(
        "UPDATE batches SET cancelled_at = COALESCE(cancelled_at, ?) WHERE id = ?",
        (now_iso(), batch_id),
    )


_BATCH = "SELECT id, owner, created_at, concurrency, cancelled_at FROM batches"


def get_batch(batch_id: str) -> Op[StoredBatch | None]:
    rows = yield Query(_BATCH + " WHERE id = ?", (batch_id,))
    return _batch(rows[0]) if rows else None


def list_batches(owner: str, limit: int) -> Op[list[StoredBatch]]:
    rows = yield Query(_BATCH + " WHERE owner = ? ORDER BY created_at DESC LIMIT ?", (owner, limit))
    return [_batch(r) for r in rows]


# A duplicate shows the progress of the item it repeats (that item's columns).
_ITEMS = (
    "SELECT i.batch_id, i.idx, i.owner, i.idempotency_key,"
    " COALESCE(o.status, i.status), COALESCE(o.session_id, i.session_id),"
    " COALESCE(o.execution_id, i.execution_id), i.queued_at,"
    " COALESCE(o.started_at, i.started_at), COALESCE(o.finished_at, i.finished_at),"
    " COALESCE(o.error, i.error), i.dup_batch_id, i.dup_idx, COALESCE(o.node, i.node)"
    " FROM batch_items i"
    " LEFT JOIN batch_items o ON o.batch_id = i.dup_batch_id AND o.idx = i.dup_idx"
)


def batch_items(batch_id: str) -> Op[list[StoredBatchItem]]:
    rows = yield Query(_ITEMS + " WHERE i.batch_id = ? ORDER BY i.idx", (batch_id,))
    return [_batch_item(r) for r in rows]


def batch_statuses(batch_ids: Sequence[str]) -> Op[dict[str, list[ExecutionStatus]]]:
    out: dict[str, list[ExecutionStatus]] = {b: [] for b in batch_ids}
    if not batch_ids:
        return out
    rows = yield Query(
        "SELECT i.batch_id, COALESCE(o.status, i.status) FROM batch_items i"
        " LEFT JOIN batch_items o ON o.batch_id = i.dup_batch_id AND o.idx = i.dup_idx"
        f" WHERE i.batch_id IN ({','.join('?' * len(batch_ids))})",
        tuple(batch_ids),
    )
    for r in rows:
        out[r[0]].append(ExecutionStatus(r[1]))
    return out


def unfinished_batch_items() -> Op[list[StoredBatchItem]]:
    rows = yield Query(
        _ITEMS + " WHERE i.status IN (?, ?) AND i.dup_batch_id IS NULL",
        (ExecutionStatus.QUEUED.value, ExecutionStatus.RUNNING.value),
    )
    return [_batch_item(r) for r in rows]
