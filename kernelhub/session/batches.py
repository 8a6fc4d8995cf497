"""Batch runs: many independent items, each in a fresh session of its own, with bounded
concurrency over all batches, worked by every node that shares the store.

Each item runs in a fresh session of its own, deleted whatever happened
(:mod:`kernelhub.session.batch_item`); this module schedules the items, records their
outcomes and answers the requests. It uses only the :class:`SessionManager`'s public
methods, so a batch item is subject to every quota and audit entry an interactive
session is.

Calling contract: the app's lifespan builds one :class:`BatchRunner`, calls :meth:`start`
after the manager's ``start`` (it settles what a previous process left unfinished) and
:meth:`close` before the manager's ``close``. REST handlers call :meth:`submit`,
:meth:`info`, :meth:`list_batches` and :meth:`cancel`; each raises kernelhub errors only.

Scheduling (issue #24): the queue is the store's (:mod:`kernelhub.store.batch_queue`), so
every node sharing a store works every batch, whichever node it was submitted through.
Each node's runner claims items whenever it has a free slot (``KERNELHUB_BATCH__
CONCURRENCY`` here, at most ``PRINCIPAL_CONCURRENCY`` of one principal's), at once when a
batch is submitted or an item ends here and every ``POLL_INTERVAL`` otherwise (for work
submitted elsewhere). The claim is fair between principals (fewest running first, across
the cluster); a batch's own ``concurrency``, like the slots, counts per node. Each started item
is a task owned here (cancelled and awaited by :meth:`close`), and so is each session
deletion, so a second cancellation cannot leave a session behind.

Claims are leases, renewed on every pass while an item runs: the pass also learns which of
this node's items were cancelled through another node (they are interrupted here) and
which claims lapsed (settled elsewhere: stopped here, and their outcome not written). A
lost node's items return to the queue when its leases run out, unless their code had
reached a kernel: those end and never run twice.

Persistence: batches and items (with their inputs, while they wait) are rows in the
store, updated at each transition, and every read comes from there. At start-up and at
shutdown this node's claims lapse at once: items whose code had not reached a kernel wait
again for any node; the others end (at shutdown their sessions are deleted, saying so).

Idempotency keys: an item whose key the principal used before is stored as a duplicate of
the first item and never runs. An item whose code never reached a kernel (cancelled while
queued, its session failed to start, the gateway went away first) gives its key back, so
sending it again runs it; one whose code was submitted keeps it, so it never runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kernelhub.config import Settings
from kernelhub.errors import InvalidRequestError, KernelhubError, NotFoundError, QuotaError
from kernelhub.models import ExecutionStatus
from kernelhub.session.batch_item import BATCH_ID_KEY, BATCH_INDEX_KEY, Item, ItemSessions, Outcome
from kernelhub.session.manager import SessionManager, execution_info
from kernelhub.store import node_name
from kernelhub.store.base import Store
from kernelhub.store.records import Principal, StoredBatch, StoredBatchItem
from kernelhub.wire import (
    BatchCreate,
    BatchInfo,
    BatchItemIn,
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


def principal_cap(concurrency: int, configured: int | None) -> int:
    """The items one principal may run at once on a node: ``configured``, or by default
    half the slots (rounded up), so another principal's batch always finds one free."""
    return configured if configured is not None else math.ceil(concurrency / 2)


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
class _Run:
    """An item this node claimed and runs."""

    batch_id: str
    owner: Principal
    item: Item
    started_at: datetime


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
        self.node = node_name(settings)
        cfg = settings.batch
        self._principal_limit = principal_cap(cfg.concurrency, cfg.principal_concurrency)
        self._runs: dict[tuple[str, int], _Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sessions = ItemSessions(manager, store, settings.engine.interrupt_grace + 2.0)
        self._submit_lock = asyncio.Lock()
        self._queued = 0  # waiting, every node: as of the last claim or submission
        self._item_seconds = _INITIAL_ITEM_SECONDS
        self._closing = False
        self._wake = asyncio.Event()
        self._claims: asyncio.Task[None] | None = None

    @property
    def queue_length(self) -> int:
        """Items waiting for a slot, all batches (as of this node's last look)."""
        return self._queued

    @property
    def running(self) -> int:
        """Items running on this node."""
        return len(self._runs)

    # -- start-up and shutdown ---------------------------------------------------------

    async def start(self) -> None:
        """Settle what a previous process of this node left claimed (see the module) and
        delete those items' sessions (the manager has re-adopted them by now); then start
        claiming."""
        unfinished = await self.store.unfinished_batch_items()
        mine = [i for i in unfinished if i.node == self.node]
        if mine:
            await self.store.release_batch_items(self.node)
            log.info("settled %d batch items a previous process of this node left", len(mine))
        # Every batch session held here is a leftover, but one of an item another node runs.
        elsewhere = {
            (i.batch_id, i.index)
            for i in unfinished
            if i.status == ExecutionStatus.RUNNING and i.node not in (None, self.node)
        }
        everyone = Principal(name="kernelhub", admin=True)
        for info in await self.manager.list_sessions(everyone, everyone=True):
            tag = (info.metadata.get(BATCH_ID_KEY), info.metadata.get(BATCH_INDEX_KEY))
            if tag[0] is not None and tag not in elsewhere:
                with contextlib.suppress(KernelhubError):
                    await self.manager.delete(Principal(name=info.owner), info.id)
        self._queued = await self.store.waiting_batch_items()
        self._claims = asyncio.create_task(self._claim_loop(), name="kernelhub-batch-claims")

    async def close(self) -> None:
        """Stop claiming and stop this node's items: those whose code ran fail (their
        sessions are deleted); the others, and every waiting item, stay queued for any
        node (this one after a restart). Nothing is left unrecorded."""
        self._closing = True
        if self._claims is not None:
            self._claims.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._claims
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(KernelhubError):  # the store went first: leases lapse
            await self.store.release_batch_items(self.node)
        await self._sessions.drain()

    # -- requests ----------------------------------------------------------------------

    async def submit(self, principal: Principal, body: BatchCreate) -> BatchInfo:
        """Queue a batch. Refuses (429) a batch that would push the items waiting, all
        batches and nodes together, beyond ``KERNELHUB_BATCH__MAX_QUEUED_ITEMS``; (507) one
        from a principal over its storage quota."""
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
            self._queued = await self.store.waiting_batch_items()
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
                        body=item.model_dump_json(),
                    )
                    for n, item in enumerate(body.items)
                ],
            )
            self._queued += sum(1 for row in rows if row.duplicate_of is None)
        self._wake.set()
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
                    node=row.node,
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
        """Cancel the items still queued and interrupt the running ones, on whichever node
        they run (another node's see it on their next pass). An item that ignores the
        interrupt is stopped by deleting its session after the engine's
        ``interrupt_grace``. A finished batch is left as it is."""
        await self._own(principal, batch_id)
        statuses = (await self.store.batch_statuses([batch_id]))[batch_id]
        if not all(s.is_final for s in statuses):
            dropped = await self.store.cancel_queued_batch_items(batch_id)
            self._queued = max(0, self._queued - dropped)
            for _ in range(dropped):
                self.observer.on_finished(ExecutionStatus.CANCELLED)
            await self._stop(r for r in self._runs.values() if r.batch_id == batch_id)
        return await self.info(principal, batch_id, results=False)

    # -- running -----------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        """Renew, claim, start; again when woken (a submission, a freed slot, a cancel) or
        after the poll interval (work submitted through other nodes)."""
        cfg = self.settings.batch
        while True:
            self._wake.clear()
            try:
                await self._pass()
            except KernelhubError as exc:  # the store is unreachable: try again later
                log.warning("batch queue: %s", exc)
            except Exception:  # a bug must not stop this node's batches for good
                log.exception("batch queue: a pass failed unexpectedly")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.poll_interval):
                    await self._wake.wait()

    async def _pass(self) -> None:
        cfg = self.settings.batch
        if self._runs:
            until = datetime.now(UTC) + timedelta(seconds=cfg.lease_ttl)
            held = {(h.batch_id, h.index): h for h in await self.store.renew_batch_items(
                self.node, until)}  # fmt: skip
            await self._stop(
                run
                for key, run in self._runs.items()
                if (h := held.get(key)) is None or h.cancelled
            )
        claim = await self.store.claim_batch_items(
            self.node,
            max(0, cfg.concurrency - len(self._runs)),
            cfg.lease_ttl,
            principal_limit=self._principal_limit,
        )
        self._queued = claim.waiting
        for stored in claim.items:
            self._start(stored)

    def _start(self, stored: StoredBatchItem) -> None:
        assert stored.body is not None and stored.started_at is not None
        item = Item(
            index=stored.index,
            body=BatchItemIn.model_validate_json(stored.body),
            queued_at=stored.queued_at,
            status=ExecutionStatus.RUNNING,
        )
        run = _Run(stored.batch_id, Principal(name=stored.owner), item, stored.started_at)
        self._runs[(run.batch_id, item.index)] = run
        task = asyncio.create_task(self._run(run), name=f"batch-{run.batch_id}-{item.index}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, runs: Iterable[_Run]) -> None:
        """Stop each run once (stopping again would push its grace back)."""
        runs = [r for r in runs if not r.item.stop_requested]
        await asyncio.gather(*(self._sessions.stop(r.owner, r.item) for r in runs))

    async def _run(self, run: _Run) -> None:
        """One item, start to end (:class:`ItemSessions` runs it), then its outcome is
        recorded and the next item may start; never raises except to be cancelled."""
        item = run.item
        t0 = time.monotonic()
        self.observer.on_wait((run.started_at - item.queued_at).total_seconds())
        outcome = Outcome()
        try:
            await self._sessions.run(run.batch_id, run.owner, item, outcome)
        finally:
            try:
                # Shutting down before its code ran: it waits again (close releases it).
                if not (self._closing and not item.submitting):
                    await self._finish(run, outcome, datetime.now(UTC))
                    seconds = time.monotonic() - t0
                    self._item_seconds = 0.8 * self._item_seconds + 0.2 * seconds
            finally:
                self._runs.pop((run.batch_id, item.index), None)
                self._wake.set()

    async def _finish(self, run: _Run, outcome: Outcome, now: datetime) -> None:
        item = run.item
        item.status = outcome.status
        item.body = None  # its inputs are no longer needed
        recorded = await self.store.update_batch_item(
            run.batch_id,
            item.index,
            status=outcome.status,
            finished_at=now,
            error=outcome.error,
            release_key=outcome.release_key,
            claimed_by=self.node,
        )
        if recorded:  # else its claim lapsed, and the node that settled it counted it
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
