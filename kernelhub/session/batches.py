"""Batch runs: many independent items, each in a fresh session of its own, with bounded
concurrency over all batches.

For each item the runner creates a session (with the item's limits), uploads the item's
files into /workspace, runs the code, records the result and deletes the session — always,
whatever happened. It uses only the :class:`SessionManager`'s public methods, so a batch
item is subject to every quota and audit entry an interactive session is.

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
import base64
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kernelhub.config import Settings
from kernelhub.errors import InvalidRequestError, KernelhubError, NotFoundError, QuotaError
from kernelhub.models import ExecutionStatus
from kernelhub.session.fair_queue import FairQueue, principal_cap
from kernelhub.session.manager import SessionManager, execution_info
from kernelhub.store.base import Store
from kernelhub.store.records import Principal, StoredBatch, StoredBatchItem
from kernelhub.wire import (
    BatchCreate,
    BatchInfo,
    BatchItemIn,
    BatchItemInfo,
    BatchItemRef,
    BatchState,
    ExecutionCreate,
    ExecutionInfo,
    SessionCreate,
    SessionInfo,
)

log = logging.getLogger(__name__)

# Session metadata that ties a session to the batch item it runs (found again at start-up).
BATCH_ID_KEY = "kernelhub.batch_id"
BATCH_INDEX_KEY = "kernelhub.batch_index"
_CAPACITY_TIMEOUT = 120.0  # seconds an item waits for session quota before it fails
_CAPACITY_POLL_INTERVAL = 2.0
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
class _Item:
    index: int
    body: BatchItemIn | None  # dropped once the item has ended
    queued_at: datetime
    status: ExecutionStatus = ExecutionStatus.QUEUED
    execution_id: str | None = None
    submitting: bool = False  # its code went to the manager: it may run from here on
    scope: asyncio.Timeout | None = None  # rescheduled to stop the item
    stop_requested: bool = False


@dataclass
class _Batch:
    id: str
    owner: Principal
    items: list[_Item]  # the ones that run (duplicates do not)
    cancelled: bool = False


@dataclass
class _Outcome:
    status: ExecutionStatus = ExecutionStatus.FAILED
    error: str | None = None
    release_key: bool = False


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
        self._queue: FairQueue[_Item] = FairQueue(
            cfg.concurrency, principal_cap(cfg.concurrency, cfg.principal_concurrency)
        )
        self._batches: dict[str, _Batch] = {}
        self._runs: set[asyncio.Task[None]] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
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
                        _Outcome(
                            error="the gateway shut down before this item started; submit it again",
                            release_key=True,
                        ),
                        now,
                    )
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

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
                    _Item(index=row.index, body=body.items[row.index], queued_at=now)
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
                    outcome = _Outcome(
                        status=ExecutionStatus.CANCELLED,
                        error="the batch was cancelled before this item started",
                        release_key=True,
                    )
                    await self._finish(batch, item, outcome, now)
            await asyncio.gather(
                *(self._stop(batch, i) for i in batch.items if i.status == ExecutionStatus.RUNNING)
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

    async def _run(self, batch: _Batch, item: _Item) -> None:
        """One item, start to end; never raises except to be cancelled."""
        started = datetime.now(UTC)
        t0 = time.monotonic()
        self.observer.on_wait((started - item.queued_at).total_seconds())
        outcome = _Outcome()
        session_id: str | None = None
        body = item.body
        assert body is not None
        try:
            await self.store.update_batch_item(
                batch.id, item.index, status=ExecutionStatus.RUNNING, started_at=started
            )
            async with asyncio.timeout(None) as scope:
                item.scope = scope
                if item.stop_requested:  # cancelled between getting its slot and now
                    raise TimeoutError
                session_id = await self._create(batch, item)
                await self.store.update_batch_item(batch.id, item.index, session_id=session_id)
                for path, content in body.files.items():
                    data = base64.b64decode(content)
                    await self.manager.upload(batch.owner, session_id, path, _once(data))
                # Without wait: the handle keeps only the final event; outputs are in the store.
                request = ExecutionCreate(code=body.code, timeout=body.timeout)
                item.submitting = True
                row, handle, _ = await self.manager.submit(batch.owner, session_id, request)
                item.execution_id = row.id
                await self.store.update_batch_item(batch.id, item.index, execution_id=row.id)
                if handle is None:  # not without an idempotency key; never expected
                    raise KernelhubError(f"execution {row.id} has no handle to wait on")
                done = await handle.wait()
                await self.manager.settled(row.id)  # its record is durable before ours
            outcome.status = done.record.status
            if item.stop_requested and outcome.status != ExecutionStatus.COMPLETED:
                outcome.error = "the batch was cancelled while this item ran; it was interrupted"
        except TimeoutError as exc:  # the scope expired: a cancel asked this item to stop
            if not item.stop_requested:  # a timeout from deeper down: a plain failure
                log.warning("batch %s item %d: %r", batch.id, item.index, exc)
                outcome.release_key = not item.submitting
                outcome.error = f"kernelhub could not run this item: timed out ({exc})"
                return
            outcome.status = ExecutionStatus.CANCELLED
            outcome.release_key = not item.submitting
            if not item.submitting:
                outcome.error = "the batch was cancelled before this item's code ran"
            elif item.execution_id is None:
                outcome.error = "the batch was cancelled as this item's code was being queued; its session was deleted"
            else:
                outcome.error = (
                    "the batch was cancelled and this item did not stop on the interrupt "
                    f"within {self._grace():g} s; its session was deleted"
                )
        except asyncio.CancelledError:  # the gateway is shutting down
            outcome.release_key = not item.submitting
            outcome.error = (
                "the gateway shut down while this item's code ran; its session was deleted"
                if item.submitting
                else "the gateway shut down while this item's session was starting; submit it again"
            )
            raise
        except KernelhubError as exc:
            outcome.release_key = not item.submitting
            outcome.error = f"kernelhub could not run this item: {exc}"
        except Exception:
            log.exception("batch %s item %d failed unexpectedly", batch.id, item.index)
            outcome.release_key = not item.submitting
            outcome.error = "internal error; the gateway logged the details"
        finally:
            item.scope = None
            try:
                if session_id is not None:
                    await self._delete(batch.owner, session_id)
                await self._finish(batch, item, outcome, datetime.now(UTC))
                seconds = time.monotonic() - t0
                self._item_seconds = 0.8 * self._item_seconds + 0.2 * seconds
            finally:
                self._queue.done(batch.id)
                self._forget_if_ended(batch)
                self._start_due()

    async def _create(self, batch: _Batch, item: _Item) -> str:
        """A fresh session for the item, waiting for session quota up to a bound. Shielded:
        a session that comes up after the item was stopped is deleted when it does."""
        assert item.body is not None
        body = SessionCreate(
            limits=item.body.limits,
            metadata={BATCH_ID_KEY: batch.id, BATCH_INDEX_KEY: item.index},
        )
        deadline = time.monotonic() + _CAPACITY_TIMEOUT
        while True:
            creating = asyncio.ensure_future(self.manager.create(batch.owner, body))
            try:
                info = await asyncio.shield(creating)
            except asyncio.CancelledError:
                self._track(self._delete_when_up(batch.owner, creating))
                raise
            except QuotaError as exc:
                if time.monotonic() + exc.retry_after > deadline:
                    raise QuotaError(
                        f"{exc} (waited {_CAPACITY_TIMEOUT:g} s for room)",
                        retry_after=exc.retry_after,
                    ) from exc
                await asyncio.sleep(min(exc.retry_after, _CAPACITY_POLL_INTERVAL))
                continue
            return info.id

    async def _stop(self, batch: _Batch, item: _Item) -> None:
        """Interrupt a running item; give it the grace to stop, then its session goes."""
        item.stop_requested = True
        scope = item.scope
        if scope is None:
            return  # about to start: it sees stop_requested
        loop = asyncio.get_running_loop()
        if item.execution_id is None:
            _reschedule(scope, loop.time())
            return
        try:
            await self.manager.interrupt(batch.owner, item.execution_id)
        except KernelhubError:
            with contextlib.suppress(KernelhubError):  # queued, not yet started
                await self.manager.cancel(batch.owner, item.execution_id)
        if item.scope is not None:
            _reschedule(item.scope, loop.time() + self._grace())

    def _grace(self) -> float:
        return self.settings.engine.interrupt_grace + 2.0

    async def _finish(self, batch: _Batch, item: _Item, outcome: _Outcome, now: datetime) -> None:
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

    # -- session clean-up: tasks owned here, so a second cancellation cannot skip them ---

    def _track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _delete(self, owner: Principal, session_id: str) -> None:
        await asyncio.shield(self._track(self._delete_now(owner, session_id)))

    async def _delete_now(self, owner: Principal, session_id: str) -> None:
        try:
            await self.manager.delete(owner, session_id)
        except KernelhubError as exc:
            log.warning("could not delete batch session %s: %s", session_id, exc)

    async def _delete_when_up(
        self, owner: Principal, creating: asyncio.Future[SessionInfo]
    ) -> None:
        try:
            info = await creating
        except BaseException:  # it never came up: nothing to delete
            return
        await self._delete_now(owner, info.id)

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


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _reschedule(scope: asyncio.Timeout, when: float) -> None:
    with contextlib.suppress(RuntimeError):  # it has just expired or exited
        scope.reschedule(when)
