"""Batch runs: many independent items, each in a fresh session of its own, with bounded
concurrency over all batches.

Each item runs in a fresh session of its own, deleted whatever happened
(:mod:`kernelhub.session.batch_item`); this module schedules the items, records their
outcomes and answers the requests. It uses only the :class:`SessionManager`'s public
methods, so a batch item is subject to every quota and audit entry an interactive
session is.

Calling contract: the app's lifespan builds one :class:`BatchRunner`, calls :meth:`start`
after the manager's ``start`` (it settles what a previous process left unfinished) and
:meth:`close` before the manager's ``close``. REST handlers call :meth:`submit`,
:meth:`info`, :meth:`list_batches` and :meth:`cancel`; each raises kernelhub errors only.

Scheduling: a :class:`~kernelhub.session.fair_queue.FairQueue` picks the item that starts
whenever a slot may have freed; principals take turns and none holds every slot, so one
tenant's day-long items cannot starve another's batch. Each started item is a task owned
here (cancelled and awaited by :meth:`close`), and so is each session deletion, so a
second cancellation cannot leave a session behind.

Persistence: batches and items are rows in the store, updated at each transition, and
every read comes from there. Items a previous process left unfinished are marked failed
at start-up, saying to submit them again (their inputs are not stored, and only the client
knows whether the work is still wanted); their sessions are deleted.

Idempotency keys: an item whose key the principal used before is stored as a duplicate of
the first item and never runs. An item whose code never reached a kernel (cancelled while
queued, its session failed to start, the gateway went away first) gives its key back, so
sending it again runs it; one whose code was submitted keeps it, so it never runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from kernelhub.config import Settings
from kernelhub.errors import InvalidRequestError, KernelhubError, NotFoundError, QuotaError
from kernelhub.models import ExecutionStatus
from kernelhub.session.batch_item import BATCH_ID_KEY, BATCH_INDEX_KEY, Item, ItemSessions, Outcome
from kernelhub.session.fair_queue import FairQueue, principal_cap
from kernelhub.session.manager import SessionManager, execution_info
from kernelhub.store.base import Store
from kernelhub.store.records import Principal, StoredBatch, StoredBatchItem
from kernelhub.wire import (
    BatchCreate,
    BatchInfo,
    BatchItemInfo,
    BatchItemRef,
    BatchState,
    ExecutionInfo,
)

log = logging.getLogger(__name__)

_INITIAL_ITEM_SECONDS = 5.0  # the run-time guess behind Retry-After before any item ran


# -- pure --------------------------------------------------------------------------------


def batch_state(statuses: Iterable[ExecutionStatus], cancelled: bool) -> BatchState:
    """A batch's state from its items' statuses and whether it was cancelled."""
    statuses = list(statuses)
    if all(s.is_final for s in statuses):
        return BatchState.CANCELLED if cancelled else BatchState.FINISHED
    if cancelled:
        return BatchState.CANCELLING
    if all(s == ExecutionStatus.QUEUED for s in statuses):
        return BatchState.QUEUED
    return BatchState.RUNNING


def count_statuses(statuses: Iterable[ExecutionStatus]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s.value] = counts.get(s.value, 0) + 1
    return counts


def retry_after(excess: int, concurrency: int, item_seconds: float) -> float:
    """Seconds until ``excess`` queued items have started, at ``concurrency`` items at a
    time taking ``item_seconds`` each; between 1 s and 10 min."""
    return min(600.0, max(1.0, excess / concurrency * item_seconds))


def wait_seconds(item: StoredBatchItem, now: datetime) -> float | None:
    """How long the item waited for a slot (so far, if it still waits)."""
    if item.duplicate_of is not None:
        return None
    end = item.started_at or item.finished_at or now
    return max(0.0, (end - item.queued_at).total_seconds())


# -- the runner --------------------------------------------------------------------------


@dataclass
class BatchObserver:
    """Hooks the gateway's metrics attach to (all optional, all synchronous)."""

    on_wait: Callable[[float], None] = lambda seconds: None  # an item got a slot
    on_finished: Callable[[ExecutionStatus], None] = lambda status: None  # an item ended


@dataclass
class _Batch:
    id: str
    owner: Principal
    items: list[Item]  # the ones that run (duplicates do not)
    cancelled: bool = False


class BatchRunner:
    def __init__(
        self,
        settings: Settings,
        manager: SessionManager,
        store: Store,
        observer: BatchObserver | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.store = store
        self.observer = observer or BatchObserver()
        cfg = settings.batch
        self._queue: FairQueue[Item] = FairQueue(
            cfg.concurrency, principal_cap(cfg.concurrency, cfg.principal_concurrency)
        )
        self._batches: dict[str, _Batch] = {}
        self._runs: set[asyncio.Task[None]] = set()
        self._sessions = ItemSessions(manager, store, settings.engine.interrupt_grace + 2.0)
        self._submit_lock = asyncio.Lock()
        self._queued = 0
        self._item_seconds = _INITIAL_ITEM_SECONDS
        self._closing = False

    @property
    def queue_length(self) -> int:
        """Items waiting for a slot, all batches."""
        return self._queued

    @property
    def running(self) -> int:
        return sum(
            1
            for b in self._batches.values()
            for i in b.items
            if i.status == ExecutionStatus.RUNNING
        )

    # -- start-up and shutdown ---------------------------------------------------------

    async def start(self) -> None:
        """Settle the items a previous process left queued or running, and delete their
        sessions (the manager has re-adopted them by now)."""
        leftovers = await self.store.unfinished_batch_items()
        if not leftovers:
            return
        now = datetime.now(UTC)
        for item in leftovers:
            ran = item.execution_id is not None
            if item.status == ExecutionStatus.QUEUED:
                error = "the gateway restarted before this item started; submit it again"
            elif not ran:
                error = (
                    "the gateway restarted while this item's session was starting; submit it again"
                )
            else:
                error = (
                    "the gateway restarted while this item's code ran; its output may be "
                    "incomplete. It keeps its idempotency key (it may have run): submit it "
                    "again under a new key if running it twice is safe"
                )
            await self.store.update_batch_item(
                item.batch_id,
                item.index,
                status=ExecutionStatus.FAILED,
                finished_at=now,
                error=error,
                release_key=not ran,
            )
            self.observer.on_finished(ExecutionStatus.FAILED)
        left = {(i.batch_id, i.index) for i in leftovers}
        everyone = Principal(name="kernelhub", admin=True)
        for info in await self.manager.list_sessions(everyone, everyone=True):
            tag = (info.metadata.get(BATCH_ID_KEY), info.metadata.get(BATCH_INDEX_KEY))
            if tag in left:
                with contextlib.suppress(KernelhubError):
                    await self.manager.delete(Principal(name=info.owner), info.id)
        log.info("settled %d batch items a previous gateway process left unfinished", len(left))

    async def close(self) -> None:
        """Stop every batch: running items fail (their sessions are deleted), queued ones
        fail saying to submit them again. Nothing is left unrecorded."""
        self._closing = True
        batches = list(self._batches.values())
        runs = list(self._runs)
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        now = datetime.now(UTC)
        for batch in batches:
            for item in batch.items:
                # Still running here: its task was cancelled before its first step.
                if not item.status.is_final:
                    await self._finish(
                        batch,
                        item,
                        Outcome(
                            error="the gateway shut down before this item started; submit it again",
                            release_key=True,
                        ),
                        now,
                    )
        await self._sessions.drain()

    # -- requests ----------------------------------------------------------------------

    async def submit(self, principal: Principal, body: BatchCreate) -> BatchInfo:
        """Queue a batch. Refuses (429) a batch that would push the items waiting, all
        batches together, beyond ``KERNELHUB_BATCH__MAX_QUEUED_ITEMS``; (507) one from a
        principal over its storage quota."""
        cfg = self.settings.batch
        if self._closing:
            raise QuotaError("the gateway is shutting down; retry shortly", retry_after=5)
        self.manager.storage.check(principal.name)  # 507 now, not one failed item at a time
        if len(body.items) > cfg.max_items:
            raise InvalidRequestError(
                f"the batch has {len(body.items)} items; the most is {cfg.max_items} "
                "(KERNELHUB_BATCH__MAX_ITEMS): split it"
            )
        for index, item in enumerate(body.items):
            try:
                self.manager.resolve_limits(item.limits)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"items[{index}]: {exc}") from exc
        concurrency = body.concurrency or cfg.concurrency
        if concurrency > cfg.concurrency:
            raise InvalidRequestError(
                f"concurrency={concurrency} is above the gateway's {cfg.concurrency} "
                "(KERNELHUB_BATCH__CONCURRENCY); ask for less or omit it"
            )
        async with self._submit_lock:  # the capacity check holds until the items are queued
            keys = [i.idempotency_key for i in body.items if i.idempotency_key is not None]
            used = await self.store.used_batch_keys(principal.name, keys)
            new = len(body.items) - len(keys) + len(set(keys) - used)  # duplicates do not run
            if new > cfg.max_queued_items:
                raise InvalidRequestError(
                    f"the batch has {new} items to run; at most {cfg.max_queued_items} may "
                    "wait at once (KERNELHUB_BATCH__MAX_QUEUED_ITEMS): split it"
                )
            excess = self._queued + new - cfg.max_queued_items
            if excess > 0:
                raise QuotaError(
                    f"{self._queued} batch items are waiting to run and this batch adds {new}; "
                    f"at most {cfg.max_queued_items} may wait (KERNELHUB_BATCH__MAX_QUEUED_ITEMS)"
                    "; retry later",
                    retry_after=retry_after(excess, cfg.concurrency, self._item_seconds),
                )
            now = datetime.now(UTC)
            stored = StoredBatch(
                id=uuid.uuid4().hex[:16],
                owner=principal.name,
                created_at=now,
                concurrency=concurrency,
            )
            rows = await self.store.insert_batch(
                stored,
                [
                    StoredBatchItem(
                        batch_id=stored.id,
                        index=n,
                        owner=principal.name,
                        idempotency_key=item.idempotency_key,
                        queued_at=now,
                    )
                    for n, item in enumerate(body.items)
                ],
            )
            batch = _Batch(
                id=stored.id,
                owner=Principal(name=principal.name),
                items=[
                    Item(index=row.index, body=body.items[row.index], queued_at=now)
                    for row in rows
                    if row.duplicate_of is None
                ],
            )
            if batch.items:
                self._queued += len(batch.items)
                self._batches[batch.id] = batch
                self._queue.add(principal.name, batch.id, batch.items, concurrency)
                self._start_due()
        return await self.info(principal, stored.id, results=False)

    async def info(self, principal: Principal, batch_id: str, *, results: bool = True) -> BatchInfo:
        """The batch and its items; with ``results`` each finished item's execution with
        its outputs, as ``GET /v1/executions/{id}`` gives them."""
        stored = await self._own(principal, batch_id)
        rows = await self.store.batch_items(batch_id)
        now = datetime.now(UTC)
        items = []
        for row in rows:
            result = None
            if results and row.execution_id is not None and row.status.is_final:
                result = await self._result(principal, row.execution_id)
            items.append(
                BatchItemInfo(
                    index=row.index,
                    status=row.status,
                    duplicate_of=BatchItemRef(
                        batch_id=row.duplicate_of[0], index=row.duplicate_of[1]
                    )
                    if row.duplicate_of
                    else None,
                    session_id=row.session_id,
                    execution_id=row.execution_id,
                    queued_at=row.queued_at,
                    started_at=row.started_at,
                    finished_at=row.finished_at,
                    wait_seconds=wait_seconds(row, now),
                    error=row.error,
                    result=result,
                )
            )
        return self._summary(stored, [r.status for r in rows], items)

    async def list_batches(self, principal: Principal) -> list[BatchInfo]:
        """The principal's newest batches, without their items."""
        batches = await self.store.list_batches(principal.name)
        statuses = await self.store.batch_statuses([b.id for b in batches])
        return [self._summary(b, statuses.get(b.id, []), None) for b in batches]

    async def cancel(self, principal: Principal, batch_id: str) -> BatchInfo:
        """Cancel the items still queued and interrupt the running ones. An item that
        ignores the interrupt is stopped by deleting its session after the engine's
        ``interrupt_grace``. A finished batch is left as it is."""
        await self._own(principal, batch_id)
        batch = self._batches.get(batch_id)
        if batch is not None and not batch.cancelled:
            batch.cancelled = True
            dropped = self._queue.drop(batch_id)  # before any await: none of them starts
            await self.store.cancel_batch(batch_id)
            now = datetime.now(UTC)
            for item in dropped:
                if item.status == ExecutionStatus.QUEUED:
                    outcome = Outcome(
                        status=ExecutionStatus.CANCELLED,
                        error="the batch was cancelled before this item started",
                        release_key=True,
                    )
                    await self._finish(batch, item, outcome, now)
            await asyncio.gather(
                *(
                    self._sessions.stop(batch.owner, i)
                    for i in batch.items
                    if i.status == ExecutionStatus.RUNNING
                )
            )
            self._forget_if_ended(batch)
        return await self.info(principal, batch_id, results=False)

    # -- running -----------------------------------------------------------------------

    def _start_due(self) -> None:
        """Start every item the queue lets start now (see the module on the turns)."""
        while not self._closing and (due := self._queue.next()) is not None:
            batch_id, item = due
            batch = self._batches[batch_id]
            item.status = ExecutionStatus.RUNNING
            self._queued -= 1
            task = asyncio.create_task(
                self._run(batch, item), name=f"batch-{batch.id}-{item.index}"
            )
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)

    def _forget_if_ended(self, batch: _Batch) -> None:
        if all(i.status.is_final for i in batch.items):
            self._batches.pop(batch.id, None)

    async def _run(self, batch: _Batch, item: Item) -> None:
        """One item, start to end (:class:`ItemSessions` runs it), then its outcome is
        recorded and the next item may start; never raises except to be cancelled."""
        started = datetime.now(UTC)
        t0 = time.monotonic()
        self.observer.on_wait((started - item.queued_at).total_seconds())
        outcome = Outcome()
        try:
            await self._sessions.run(batch.id, batch.owner, item, outcome, started)
        finally:
            try:
                await self._finish(batch, item, outcome, datetime.now(UTC))
                seconds = time.monotonic() - t0
                self._item_seconds = 0.8 * self._item_seconds + 0.2 * seconds
            finally:
                self._queue.done(batch.id)
                self._forget_if_ended(batch)
                self._start_due()

    async def _finish(self, batch: _Batch, item: Item, outcome: Outcome, now: datetime) -> None:
        if item.status == ExecutionStatus.QUEUED:
            self._queued -= 1
        item.status = outcome.status
        item.body = None  # its inputs are no longer needed
        await self.store.update_batch_item(
            batch.id,
            item.index,
            status=outcome.status,
            finished_at=now,
            error=outcome.error,
            release_key=outcome.release_key,
        )
        self.observer.on_finished(outcome.status)

    # -- reading -----------------------------------------------------------------------

    async def _own(self, principal: Principal, batch_id: str) -> StoredBatch:
        stored = await self.store.get_batch(batch_id)
        if stored is None or (stored.owner != principal.name and not principal.admin):
            raise NotFoundError(f"no batch {batch_id!r} (or it is not yours)")
        return stored

    async def _result(self, principal: Principal, execution_id: str) -> ExecutionInfo | None:
        try:
            row, events = await self.manager.execution(principal, execution_id)
        except NotFoundError:
            return None
        return execution_info(row, events)

    def _summary(
        self,
        stored: StoredBatch,
        statuses: list[ExecutionStatus],
        items: list[BatchItemInfo] | None,
    ) -> BatchInfo:
        return BatchInfo(
            id=stored.id,
            owner=stored.owner,
            state=batch_state(statuses, stored.cancelled_at is not None),
            created_at=stored.created_at,
            concurrency=stored.concurrency,
            counts=count_statuses(statuses),
            items=items,
        )
