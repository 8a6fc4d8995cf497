"""One batch item, start to end, in a fresh session of its own: the session is created
with the item's limits (waiting a bounded time for session quota), the item's files go
into /workspace, its code runs, and the session is deleted — always, whatever happened.
What happened is an :class:`Outcome` (data, with the sentence a client reads), never an
exception.

Calling contract: the :class:`~kernelhub.session.batches.BatchRunner` schedules items and
records their outcomes; it calls :meth:`ItemSessions.run` once per started item, in a task
of its own, :meth:`ItemSessions.stop` to cancel a running one, and
:meth:`ItemSessions.drain` at shutdown. Session deletions are tasks owned here, so a
second cancellation cannot leave a session behind. Only the :class:`SessionManager`'s
public methods are used, so an item is subject to every quota and audit entry an
interactive session is.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kernelhub.errors import KernelhubError, QuotaError
from kernelhub.models import ExecutionStatus
from kernelhub.session.manager import SessionManager
from kernelhub.store.base import Store
from kernelhub.store.records import Principal
from kernelhub.wire import BatchItemIn, ExecutionCreate, SessionCreate, SessionInfo

log = logging.getLogger(__name__)

# Session metadata that ties a session to the batch item it runs (found again at start-up).
BATCH_ID_KEY = "kernelhub.batch_id"
BATCH_INDEX_KEY = "kernelhub.batch_index"
_CAPACITY_TIMEOUT = 120.0  # seconds an item waits for session quota before it fails
_CAPACITY_POLL_INTERVAL = 2.0


@dataclass
class Item:
    index: int
    body: BatchItemIn | None  # dropped once the item has ended
    queued_at: datetime
    status: ExecutionStatus = ExecutionStatus.QUEUED
    execution_id: str | None = None
    submitting: bool = False  # its code went to the manager: it may run from here on
    scope: asyncio.Timeout | None = None  # rescheduled to stop the item
    stop_requested: bool = False


@dataclass
class Outcome:
    status: ExecutionStatus = ExecutionStatus.FAILED
    error: str | None = None
    release_key: bool = False  # the item's code never ran: its idempotency key is free


class ItemSessions:
    """The sessions batch items run in. ``grace`` is how long a stopped item has to
    honour its interrupt before its session is deleted under it."""

    def __init__(self, manager: SessionManager, store: Store, grace: float) -> None:
        self.manager = manager
        self.store = store
        self.grace = grace
        self._cleanups: set[asyncio.Task[None]] = set()

    async def run(self, batch_id: str, owner: Principal, item: Item, outcome: Outcome) -> None:
        """Run ``item`` (claimed: its row says running) and fill in ``outcome`` as it goes;
        raises only ``CancelledError`` (the gateway shutting down), with ``outcome`` saying
        so."""
        session_id: str | None = None
        body = item.body
        assert body is not None
        try:
            async with asyncio.timeout(None) as scope:
                item.scope = scope
                if item.stop_requested:  # cancelled between getting its slot and now
                    raise TimeoutError
                session_id = await self._create(batch_id, owner, item)
                await self.store.update_batch_item(batch_id, item.index, session_id=session_id)
                for path, content in body.files.items():
                    data = base64.b64decode(content)
                    await self.manager.upload(owner, session_id, path, _once(data))
                # Without wait: the handle keeps only the final event; outputs are in the store.
                request = ExecutionCreate(code=body.code, timeout=body.timeout)
                # Recorded first: should this node be lost from here on, the item is
                # never claimed again (its code may have run).
                await self.store.update_batch_item(
                    batch_id, item.index, submitted_at=datetime.now(UTC)
                )
                item.submitting = True
                row, handle, _ = await self.manager.submit(owner, session_id, request)
                item.execution_id = row.id
                await self.store.update_batch_item(batch_id, item.index, execution_id=row.id)
                if handle is None:  # not without an idempotency key; never expected
                    raise KernelhubError(f"execution {row.id} has no handle to wait on")
                done = await handle.wait()
                await self.manager.settled(row.id)  # its record is durable before ours
            outcome.status = done.record.status
            if item.stop_requested and outcome.status != ExecutionStatus.COMPLETED:
                outcome.error = "the batch was cancelled while this item ran; it was interrupted"
        except TimeoutError as exc:  # the scope expired: a cancel asked this item to stop
            outcome.release_key = not item.submitting
            if not item.stop_requested:  # a timeout from deeper down: a plain failure
                log.warning("batch %s item %d: %r", batch_id, item.index, exc)
                outcome.error = f"kernelhub could not run this item: timed out ({exc})"
                return
            outcome.status = ExecutionStatus.CANCELLED
            if not item.submitting:
                outcome.error = "the batch was cancelled before this item's code ran"
            elif item.execution_id is None:
                outcome.error = "the batch was cancelled as this item's code was being queued; its session was deleted"
            else:
                outcome.error = (
                    "the batch was cancelled and this item did not stop on the interrupt "
                    f"within {self.grace:g} s; its session was deleted"
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
            log.exception("batch %s item %d failed unexpectedly", batch_id, item.index)
            outcome.release_key = not item.submitting
            outcome.error = "internal error; the gateway logged the details"
        finally:
            item.scope = None
            if session_id is not None:
                await self._delete(owner, session_id)

    async def _create(self, batch_id: str, owner: Principal, item: Item) -> str:
        """A fresh session for the item, waiting for session quota up to a bound. Shielded:
        a session that comes up after the item was stopped is deleted when it does."""
        assert item.body is not None
        body = SessionCreate(
            limits=item.body.limits,
            metadata={BATCH_ID_KEY: batch_id, BATCH_INDEX_KEY: item.index},
        )
        deadline = time.monotonic() + _CAPACITY_TIMEOUT
        while True:
            creating = asyncio.ensure_future(self.manager.create(owner, body))
            try:
                info = await asyncio.shield(creating)
            except asyncio.CancelledError:
                self._track(self._delete_when_up(owner, creating))
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

    async def stop(self, owner: Principal, item: Item) -> None:
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
            await self.manager.interrupt(owner, item.execution_id)
        except KernelhubError:
            with contextlib.suppress(KernelhubError):  # queued, not yet started
                await self.manager.cancel(owner, item.execution_id)
        if item.scope is not None:
            _reschedule(item.scope, loop.time() + self.grace)

    async def drain(self) -> None:
        """Wait for every session deletion started so far (shutdown)."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

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


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _reschedule(scope: asyncio.Timeout, when: float) -> None:
    with contextlib.suppress(RuntimeError):  # it has just expired or exited
        scope.reschedule(when)
