"""The recorder: the only writer of executions, events, audit rows and session phases.

Events go to the store through each session's :class:`SessionFanout` (which the
recorder makes), executions are inserted as they are submitted and finished from their
final event, and every action is audited from here. Nothing else in the session layer
writes those rows, so the order of writes (an execution's row before its events, its
final event before its record) is kept in one place.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from kernelhub.errors import StoreError
from kernelhub.models import (
    EndedBy,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    NoticeEvent,
)
from kernelhub.session.fanout import SessionFanout
from kernelhub.session.live import InFlight, LiveSession
from kernelhub.store.base import Store
from kernelhub.store.records import AuditEntry, StoredExecution

log = logging.getLogger(__name__)
_RECENT_RECORDS = 1024


@dataclass
class Observer:
    """Hooks the gateway's metrics attach to (all optional, all synchronous)."""

    on_start: Callable[[float], None] = lambda seconds: None
    on_final: Callable[[ExecutionRecord], None] = lambda record: None


class Recorder:
    """See the module. ``coalesce_window``: how long a quiet write may wait for company
    (KERNELHUB_GATEWAY__COALESCE_WINDOW)."""

    def __init__(self, store: Store, observer: Observer, *, coalesce_window: float) -> None:
        self.store = store
        self.observer = observer
        self.window = coalesce_window
        self._recent: OrderedDict[str, ExecutionRecord] = OrderedDict()
        self._settled: dict[str, asyncio.Future[None]] = {}
        # New rows not committed yet, with what to do once they are (see when_stored).
        self._storing: dict[str, list[Callable[[], None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def fanout(self, session_id: str) -> SessionFanout:
        return SessionFanout(session_id, self.store, quiet_wait=self.window)

    # -- sessions ----------------------------------------------------------------------

    async def phase(self, live: LiveSession, reason: str | None = None) -> None:
        """Store the session's phase (and its hibernation snapshot, in its own column)."""
        await self.store.update_session(
            live.id, state=live.phase.value, reason=reason, hibernation=live.hibernation
        )

    async def deleted(self, session_id: str) -> None:
        await self.store.update_session(session_id, state="deleted", deleted=True)

    # -- executions --------------------------------------------------------------------

    def execution(self, row: StoredExecution) -> None:
        """Record a new execution without waiting. It joins the pending commit, ahead of
        every later store call; like the cell's `running`, it may wait there briefly for
        the cell's next event (see coalesce_window)."""
        self._storing[row.id] = []
        self._spawn(
            self.store.insert_execution(row, partial(self._stored, row.id), wait=self.window)
        )

    async def keyed_execution(self, row: StoredExecution) -> StoredExecution:
        """Record an execution with an idempotency key, committed before it runs: the row
        itself, or the owner's execution that used the key first."""
        return await self.store.insert_execution(row)

    def when_stored(self, execution_id: str, then: Callable[[], None]) -> None:
        """Call ``then`` once the execution's row is committed (at once if it is), from
        the commit's callbacks, before the events committed after the row are handed to
        subscribers: tell no one about an execution that a crash could still lose."""
        waiting = self._storing.get(execution_id)
        if waiting is None:
            then()
        else:
            waiting.append(then)

    def _stored(self, execution_id: str, error: Exception | None) -> None:
        if error is not None:
            log.error("storing execution %s failed: %s", execution_id, error)
        for then in self._storing.pop(execution_id, []):
            try:
                then()
            except Exception:
                log.exception("a callback on execution %s failed", execution_id)

    def recent(self, execution_id: str) -> ExecutionRecord | None:
        """The record of an execution that finished a moment ago (its row may lag)."""
        return self._recent.get(execution_id)

    async def settled(self, execution_id: str) -> None:
        """Wait until a finished execution's events and record are committed to the store
        (so an answer given now survives a crash of the gateway)."""
        fut = self._settled.get(execution_id)
        if fut is not None:
            await asyncio.shield(fut)

    # -- events ------------------------------------------------------------------------

    def event(self, live: LiveSession, event: Event) -> None:
        """Every event of the session's kernel, in order (the engine's listener)."""
        live.fanout.publish(event)
        if isinstance(event, FinalEvent):
            live.finished(event.execution_id)
            self._settled[event.execution_id] = asyncio.get_running_loop().create_future()
            self._recent[event.execution_id] = event.record
            while len(self._recent) > _RECENT_RECORDS:
                self._recent.popitem(last=False)
            self._finish(live, event.record)
        elif isinstance(event, InputReplyEvent):
            # Who answered (a principal, or the deadline), when, and what.
            entry = AuditEntry(
                principal=event.answered_by,
                action="execution.input",
                session_id=live.id,
                execution_id=event.execution_id,
                detail={"value": event.value, "password": event.password},
            )
            self._spawn(self.store.audit(entry))

    async def orphaned(
        self,
        live: LiveSession,
        row: StoredExecution,
        status: ExecutionStatus,
        reason: str,
        next_seq: Callable[[], int],
        *,
        state_lost: bool,
    ) -> None:
        """End an execution a previous gateway process never finished, saying why."""
        record = ExecutionRecord(
            execution_id=row.id,
            status=status,
            ended_by=EndedBy.KILL,
            state_lost=state_lost,
            reason=reason,
            queued_at=row.created_at,
            finished_at=datetime.now(UTC),
        )
        live.fanout.publish(NoticeEvent(execution_id=row.id, seq=next_seq(), message=reason))
        live.fanout.publish(FinalEvent(execution_id=row.id, seq=next_seq(), record=record))
        await self.store.update_execution(row.id, status, record)

    def _finish(self, live: LiveSession, record: ExecutionRecord) -> None:
        """Store the final record and its audit entry, never before the final event.
        Usually the final event has just joined this loop turn's commit, and the record
        joins it too: one commit, no task. Otherwise (its rows held back behind a slow or
        failed commit, or the code known only to the store after a restart) a task waits
        for the event to be stored first."""
        flight = live.inflight.pop(record.execution_id, None)
        if flight is None or not live.fanout.joins_this_commit():
            self._spawn(self._finished(live, record, flight))
            return
        entry = self._audit_final(live, record, flight.principal, flight.code, flight.client)
        done = self.store.finish_execution(record, entry)
        done.add_done_callback(
            lambda fut: self._settle(
                record, StoreError("the store closed") if fut.cancelled() else fut.exception()
            )
        )

    async def _finished(
        self, live: LiveSession, record: ExecutionRecord, flight: InFlight | None
    ) -> None:
        error: BaseException | None = StoreError("stopped before the record was stored")
        try:
            await live.fanout.flush()
            if flight is None:  # adopted after a restart: the code is only in the store
                stored = await self.store.get_execution(record.execution_id)
                code = stored.code if stored else None
                entry = self._audit_final(live, record, live.stored.owner, code, None)
            else:
                entry = self._audit_final(
                    live, record, flight.principal, flight.code, flight.client
                )
            await asyncio.shield(self.store.finish_execution(record, entry))
            error = None
        except Exception as exc:
            error = exc
        finally:
            self._settle(record, error)

    def _settle(self, record: ExecutionRecord, error: BaseException | None) -> None:
        if error is None:
            self.observer.on_final(record)
        else:
            log.error("storing execution %s failed: %s", record.execution_id, error)
        settled = self._settled.pop(record.execution_id, None)
        if settled is not None and not settled.done():
            settled.set_result(None)

    @staticmethod
    def _audit_final(
        live: LiveSession,
        record: ExecutionRecord,
        principal: str,
        code: str | None,
        client: str | None,
    ) -> AuditEntry:
        return AuditEntry(
            principal=principal,
            action="execution",
            session_id=live.id,
            execution_id=record.execution_id,
            code=code,
            status=record.status.value,
            duration=record.duration,
            cpu_seconds=record.cpu_seconds,
            peak_memory_bytes=record.peak_memory_bytes,
            output_bytes=record.output_bytes,
            client=client,
            detail={"reason": record.reason, "ended_by": record.ended_by.value}
            if record.reason
            else None,
        )

    # -- audit -------------------------------------------------------------------------

    async def audit(self, entry: AuditEntry) -> None:
        await self.store.audit(entry)

    def _spawn(self, coro: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
