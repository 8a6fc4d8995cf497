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
import json
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from pydantic import BaseModel

from kernelhub import gcpause, jsonslices
from kernelhub.models import QUIET_EVENT_TYPES, Event
from kernelhub.store.base import Store

log = logging.getLogger(__name__)

# What a session's fan-out may hold before it asks the kernel's pumps to wait (``room``):
# bodies not yet committed by the store, and big events waiting to be serialized behind
# the one being serialized now. Without it, a kernel printing faster than the store
# commits or jsonslices writes had all of its output held here (50 MiB relayed: ~48 MiB
# of gateway RSS, most of it parsed stream text waiting in ``_to_encode``).
BACKLOG_BYTES = 2 * 1024 * 1024
BACKLOG_BIG_EVENTS = 1


class Published(NamedTuple):
    seq: int
    execution_id: str
    body: str  # the event as JSON
    kind: str  # the event's type: "stream", "result", "final", ...
    prev: int = 0  # the seq published just before (0: none, or unknown): see kernelhub.replay


def big_event(event: Event) -> bool:
    """Whether ``event`` holds strings of a few slices, or many values (``jsonslices``):
    counted on the model, without serializing it, and cheaply (the common event is small)."""
    budget = [2 * jsonslices.SLICE, 2000]  # characters, then values looked at

    def over(value: object) -> bool:
        budget[1] -= 1
        if budget[1] < 0:
            return True  # many values: written a group at a time too (model_dump_json of
            # 8 MiB of records or numbers held the loop for 70-150 ms)
        if isinstance(value, str):
            budget[0] -= len(value)
            return budget[0] < 0
        if isinstance(value, dict):
            return any(over(k) or over(v) for k, v in value.items())
        if isinstance(value, list | tuple):
            return any(over(v) for v in value)
        if isinstance(value, BaseModel):
            return any(over(v) for v in value.__dict__.values())
        return False

    return over(event)


_RAW_FIELDS = ("data", "metadata")  # JSON as the kernel sent it (parsed by json)


def plain(event: Event) -> dict[str, object]:
    """``event.model_dump(mode="json")``, but the kernel's own JSON (display data and
    metadata) as it is: pydantic would copy every value of it in one call (~50 ms for
    8 MiB of numbers); jsonslices writes it a group at a time."""
    fields = type(event).model_fields
    raw = [name for name in _RAW_FIELDS if name in fields]
    if not raw:
        return event.model_dump(mode="json")
    dumped = event.model_dump(mode="json", exclude=set(raw))
    return {name: getattr(event, name) if name in raw else dumped[name] for name in fields}


class Subscriber:
    """One reader's buffer. Its reader may also set ``direct``: a function that takes an
    event and delivers it at once, or returns False if it cannot right now. While nothing
    is buffered, an offered event goes there first (no buffer, no wake-up of the reader);
    otherwise, or if it says False, the event is buffered, so order is kept. ``batch_end``,
    if set, is called once the events of a store commit have all been offered: what
    ``direct`` delivered can leave together, now."""

    def __init__(self, budget_bytes: int) -> None:
        self.queue: asyncio.Queue[Published] = asyncio.Queue()
        self.budget = budget_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self.closed = False
        self.direct: Callable[[Published], bool] | None = None
        self.batch_end: Callable[[], None] | None = None
        self._wake = asyncio.Event()

    def rearm(self) -> None:
        """Start buffering again after an overflow (the reader catches up from the store)."""
        self.overflowed = False

    def offer(self, item: Published) -> None:
        if self.overflowed:
            return
        if self.direct is not None and self.queue.empty() and self.direct(item):
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
    """Sends each published event to the store and, once committed, to every subscriber.
    ``publish`` is synchronous (called from the engine's listener); ``flush`` waits until
    everything published so far is in the store.

    Rows join the store's per-turn commit and reach subscribers from the commit's callback:
    no writer task, so an event is one loop turn from publish to its clients' queues. Rows
    are committed in order: while a commit of this session's runs on the store thread (a
    big batch), or failed and waits to be retried, later events are held back.

    ``room`` is the back-pressure the kernel's pumps obey (``KernelSession.add_gate``):
    past ``BACKLOG_BYTES`` of bodies not yet committed, or ``BACKLOG_BIG_EVENTS`` big
    events waiting to be serialized, it returns a future that is done once the backlog
    is below both again.
    """

    def __init__(
        self,
        session_id: str,
        store: Store,
        *,
        on_error: Callable[[Exception], None] | None = None,
        retry_after: float = 0.5,
        quiet_wait: float = 0.0,
    ) -> None:
        self.session_id = session_id
        self.store = store
        self.subscribers: set[Subscriber] = set()
        self._flushed_seq = 0
        self._published_seq = 0
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._on_error = on_error
        self._retry_after = retry_after
        self._quiet_wait = quiet_wait  # how long a quiet event's commit may wait for more
        self._commit: int | None = None  # the commit our newest rows are in
        self._inflight = 0  # rows handed to the store, not committed (or failed) yet
        self._held: list[Published] = []  # waiting for the rows ahead of them
        self._failed: list[Published] = []  # of the commit that just failed, in order
        self._retry: asyncio.TimerHandle | None = None
        self._to_encode: deque[tuple[Event, int]] = deque()  # big events, in order
        self._encoding: asyncio.Task[None] | None = None  # slicing them, one at a time
        self._backlog_bytes = 0  # bodies enqueued and not committed yet (held, failed too)
        self._room: asyncio.Future[None] | None = None  # a pump waits on it
        self._closed = False

    def publish(self, event: Event) -> None:
        prev, self._published_seq = self._published_seq, max(self._published_seq, event.seq)
        if self._encoding is None and not big_event(event):
            self._enqueue(
                Published(event.seq, event.execution_id, event.model_dump_json(), event.type, prev)
            )
            return
        # Serialized a slice at a time (one 8 MiB event was a 15-50 ms stall of the loop
        # in model_dump_json); what is published meanwhile waits behind it, in order.
        self._to_encode.append((event, prev))
        if self._encoding is None:
            # No full collection of the values being written meanwhile (``gcpause``);
            # released once the task is done, however it ends (even cancelled unstarted).
            gcpause.hold()
            self._encoding = asyncio.get_running_loop().create_task(self._encode_big())
            self._encoding.add_done_callback(lambda _: gcpause.release())

    async def _encode_big(self) -> None:
        try:
            while self._to_encode:
                event, prev = self._to_encode.popleft()
                self._check_room()
                gcpause.keep_bounded()  # a long run of big events: one collection per interval
                try:
                    body = await jsonslices.drive(
                        jsonslices.dumps(plain(event), event.model_dump_json)
                    )
                except Exception:  # never lose an event to the slicing: the whole way
                    log.exception("session %s: slicing event %d failed", self.session_id, event.seq)
                    body = json.dumps(event.model_dump(mode="json"), default=str)
                self._enqueue(Published(event.seq, event.execution_id, body, event.type, prev))
                del event  # its values are freed here, before the collector is back on
        finally:
            self._encoding = None

    def backed_up(self) -> bool:
        return self._backlog_bytes > BACKLOG_BYTES or len(self._to_encode) >= BACKLOG_BIG_EVENTS

    def room(self) -> asyncio.Future[None] | None:
        """None if the kernel may send more now; else a future done once it may."""
        if self._closed or not self.backed_up():
            return None
        if self._room is None or self._room.done():
            self._room = asyncio.get_running_loop().create_future()
        return self._room

    def _check_room(self) -> None:
        if self._room is not None and not self.backed_up():
            if not self._room.done():
                self._room.set_result(None)
            self._room = None

    def _enqueue(self, item: Published) -> None:
        self._backlog_bytes += len(item.body)
        if self._held or (self._inflight and self.store.pending_commit != self._commit):
            self._held.append(item)
        else:
            self._write(item)

    @property
    def published_seq(self) -> int:
        """The newest event seq this process published (0 before any): a session's
        ``last_seq``. Not the kernel's counter, which kernelhub's own silent calls (and
        checkpoints) also advance without any event a client could be shown."""
        return self._published_seq

    def joins_this_commit(self) -> bool:
        """Whether everything published so far is stored or in this loop turn's commit
        (nothing held back): a write the caller adds now is committed with, or after, it."""
        return (
            self._encoding is None
            and not self._held
            and (not self._inflight or self.store.pending_commit == self._commit)
        )

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
        self.store.flush()  # someone waits: quiet events need not wait for company
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((target, fut))
        await fut

    def _write(self, item: Published) -> None:
        self._inflight += 1
        self.store.append_event(
            self.session_id, item.seq, item.execution_id, item.body, partial(self._stored, item),
            wait=self._quiet_wait if item.kind in QUIET_EVENT_TYPES else 0.0,
        )  # fmt: skip
        self._commit = self.store.pending_commit

    def _stored(self, item: Published, error: Exception | None) -> None:
        self._inflight -= 1
        if error is None:
            self._backlog_bytes -= len(item.body)
            self._flushed_seq = max(self._flushed_seq, item.seq)
            for sub in self.subscribers:
                sub.offer(item)
        else:
            self._failed.append(item)
        if self._inflight:
            return
        if self._failed:
            # Never lose a row silently: say so, and write it again (in order) shortly.
            log.error(
                "storing %d events of session %s failed: %s; retrying",
                len(self._failed),
                self.session_id,
                error,
            )
            if self._on_error and error is not None:
                self._on_error(error)
            self._held[:0] = self._failed
            self._failed = []
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(self._retry_after, self._release)
        else:
            self._release()
        self._settle_flush_waiters()
        self._check_room()
        for sub in self.subscribers:
            if sub.batch_end is not None:
                try:
                    sub.batch_end()
                except Exception:  # a socket's trouble; the store and the rest go on
                    log.exception("session %s: a subscriber's batch end failed", self.session_id)

    def _release(self) -> None:
        """Hand the held rows to the store (they share one commit)."""
        self._retry = None
        held, self._held = self._held, []
        for item in held:
            self._write(item)

    def _settle_flush_waiters(self) -> None:
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
        if self._retry is not None:
            self._retry.cancel()
        if self._encoding is not None:
            self._encoding.cancel()
        self._closed = True  # a closed fan-out holds no one back
        if self._room is not None and not self._room.done():
            self._room.set_result(None)
        for sub in list(self.subscribers):
            sub.closed = True
            sub.overflowed = True
            sub._wake.set()
