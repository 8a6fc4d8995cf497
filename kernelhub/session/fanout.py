"""Every event of a session goes to the store (durably, in batches) and to each live
subscriber (WebSocket clients), without letting a slow subscriber grow memory.

Each event is serialized to JSON once, here; the store keeps that text and the WebSocket
sends it as is. Events reach subscribers only after the store has committed them: anything
a client has seen survives a gateway crash (``kill -9``), and replay after a reconnect
serves exactly what live clients saw.

A subscriber has a byte budget. If it falls further behind than that, its buffer is dropped
and it is marked ``overflowed``; its reader catches up from the store and re-arms it. Nothing
is lost and memory stays flat whatever the client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import NamedTuple

from kernelhub.models import Event
from kernelhub.store.sqlite import SqliteStore

log = logging.getLogger(__name__)


class Published(NamedTuple):
    seq: int
    execution_id: str
    body: str  # the event as JSON


class Subscriber:
    def __init__(self, budget_bytes: int) -> None:
        self.queue: asyncio.Queue[Published] = asyncio.Queue()
        self.budget = budget_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self.closed = False
        self._wake = asyncio.Event()

    def rearm(self) -> None:
        """Start buffering again after an overflow (the reader catches up from the store)."""
        self.overflowed = False

    def offer(self, item: Published) -> None:
        if self.overflowed:
            return
        size = len(item.body)
        if self.queued_bytes + size > self.budget:
            self.overflowed = True
            # Release what it holds: it will catch up from the store.
            self.queue = asyncio.Queue()
            self.queued_bytes = 0
            self._wake.set()
            return
        self.queued_bytes += size
        self.queue.put_nowait(item)
        self._wake.set()

    async def get(self) -> Published | None:
        """The next event, or None once the subscriber overflowed (or was closed)."""
        while True:
            if self.overflowed:
                return None
            if not self.queue.empty():
                item = self.queue.get_nowait()
                self.queued_bytes -= len(item.body)
                return item
            self._wake.clear()
            await self._wake.wait()


class SessionFanout:
    """Owns one session's writer task. ``publish`` is synchronous (called from the engine's
    listener); ``flush`` waits until everything published so far is in the store."""

    def __init__(
        self,
        session_id: str,
        store: SqliteStore,
        *,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.store = store
        self.subscribers: set[Subscriber] = set()
        self._pending: list[Published] = []
        self._wake = asyncio.Event()
        self._flushed_seq = 0
        self._published_seq = 0
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._on_error = on_error
        self._task = asyncio.create_task(self._writer(), name=f"kernelhub-writer-{session_id}")

    def publish(self, event: Event) -> None:
        item = Published(event.seq, event.execution_id, event.model_dump_json())
        self._pending.append(item)
        self._published_seq = max(self._published_seq, event.seq)
        self._wake.set()

    def subscribe(self, budget_bytes: int) -> Subscriber:
        sub = Subscriber(budget_bytes)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    async def flush(self) -> None:
        target = self._published_seq
        if self._flushed_seq >= target:
            return
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((target, fut))
        self._wake.set()
        await fut

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self.store.append_events(self.session_id, batch)
                except Exception as exc:  # never lose the batch silently: retry, and say so
                    log.exception(
                        "storing %d events of session %s failed", len(batch), self.session_id
                    )
                    if self._on_error:
                        self._on_error(exc)
                    self._pending[:0] = batch
                    await asyncio.sleep(0.5)
                    continue
                self._flushed_seq = max(self._flushed_seq, batch[-1].seq)
                for item in batch:
                    for sub in self.subscribers:
                        sub.offer(item)
            still = []
            for target, fut in self._flush_waiters:
                if self._flushed_seq >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((target, fut))
            self._flush_waiters = still

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), 10)
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        for sub in list(self.subscribers):
            sub.closed = True
            sub.overflowed = True
            sub._wake.set()
