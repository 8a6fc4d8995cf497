"""Which cell each kernel message belongs to, and when the running cell is finished.

The kernel's pumps hand every message to :meth:`MessageRouter.route`. A message goes to
the collector of the execute request it names as its parent: the running cell, or one of
the last ``_RECENT_EXECUTIONS`` finished ones (late output of a thread they started);
output of no known cell is charged to a budget of its own (``_route_orphan``).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from kernelhub.config import Limits
from kernelhub.execution.collector import OVERSIZED_KEY, OutputCollector
from kernelhub.execution.handle import ExecutionHandle
from kernelhub.kernel.client import MAX_FRAME_BYTES, MAX_MESSAGE_BYTES
from kernelhub.models import Event, InputRequestEvent, StatusEvent, StreamEvent

log = logging.getLogger(__name__)

_RECENT_EXECUTIONS = 64  # finished cells whose late thread output we still attribute
_REPLY_AFTER_IDLE_GRACE = 0.2

Emit = Callable[[ExecutionHandle | None, Event], None]


class Active(NamedTuple):
    """The cell the kernel is running: ``done`` resolves when its request is finished."""

    collector: OutputCollector
    handle: ExecutionHandle
    done: asyncio.Future[None]


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class MessageRouter:
    """Kernel messages in, events out through ``emit`` (the session's one way out).

    ``on_input`` is called when the running cell asks for input, after its
    ``input_request`` event was emitted.
    """

    def __init__(
        self,
        session_id: str,
        limits: Limits,
        *,
        emit: Emit,
        next_seq: Callable[[], int],
        on_input: Callable[[ExecutionHandle, InputRequestEvent], None],
    ) -> None:
        self.session_id = session_id
        self.limits = limits
        self._emit = emit
        self._next_seq = next_seq
        self._on_input = on_input
        self._collectors: OrderedDict[
            str, tuple[OutputCollector, weakref.ReferenceType[ExecutionHandle]]
        ] = OrderedDict()
        self.active: Active | None = None
        self._between_cells: OutputCollector | None = None  # output of no cell, since the last
        self._disowned: set[str] = set()  # requests someone else collects (see disown)

    def begin(self, handle: ExecutionHandle, msg_id: str) -> Active:
        """The kernel was sent ``msg_id`` for ``handle``: route its messages to a new
        collector, and make it the running cell."""
        collector = OutputCollector(
            handle.id,
            msg_id,
            limit_bytes=self.limits.output_bytes,
            limit_events=self.limits.output_events,
            next_seq=self._next_seq,
        )
        self._collectors[msg_id] = (collector, weakref.ref(handle))
        self._between_cells = None
        while len(self._collectors) > _RECENT_EXECUTIONS:
            self._collectors.popitem(last=False)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.active = Active(collector, handle, done)
        return self.active

    def disown(self, msg_id: str, *, disowned: bool = True) -> None:
        """Leave the messages of request ``msg_id`` to someone else: a cell that ran while
        no gateway did, collected from the sandbox's spool (``session.salvage``), whose
        live messages would otherwise come out a second time as output of no cell."""
        if disowned:
            self._disowned.add(msg_id)
        else:
            self._disowned.discard(msg_id)

    def route(self, msg: dict[str, Any]) -> None:
        parent = msg.get("parent_header")
        parent_id = parent.get("msg_id") if isinstance(parent, dict) else None
        entry = self._collectors.get(parent_id) if isinstance(parent_id, str) else None
        if entry is None and OVERSIZED_KEY in msg and self.active is not None:
            # The kernel's claim of whose it is could not be checked: the running cell pays.
            entry = self._collectors.get(self.active.collector.msg_id)
        if entry is None:
            if OVERSIZED_KEY in msg:
                log.warning("session %s: dropped an oversized kernel message", self.session_id)
                return
            if parent_id in self._disowned:
                return
            self._route_orphan(msg)
            return
        collector, ref = entry
        # Finished executions are only weakly held: their late output goes to listeners.
        handle = ref()
        events = (
            collector.oversized(msg[OVERSIZED_KEY], MAX_MESSAGE_BYTES)
            if OVERSIZED_KEY in msg
            else collector.feed(msg)
        )
        for event in events:
            if isinstance(event, StatusEvent):
                continue
            self._emit(handle, event)
            if isinstance(event, InputRequestEvent) and handle is not None:
                self._on_input(handle, event)
        active = self.active
        if active is None or active.collector is not collector:
            return
        self.maybe_settle(active)

    def connection_reset(self, channel: str) -> None:
        """The kernel's ``channel`` connection was reset: the running cell's output and end
        may be partly lost; tell it, and end it if what is left says it ended."""
        active = self.active
        if active is None:
            return
        for event in active.collector.connection_reset(channel, MAX_FRAME_BYTES):
            self._emit(active.handle, event)
        self.maybe_settle(active)

    def maybe_settle(self, active: Active) -> None:
        collector, handle, done = active
        if done.done():
            return
        if collector.done:
            done.set_result(None)
        elif collector.settling:
            return
        elif (collector.idle_seen and handle.interrupt_sent and not collector.reply_seen) or (
            collector.resets and (collector.idle_seen or collector.reply_seen)
        ):
            # An interrupt that lands in ipykernel's own code around the cell ends it with
            # "idle" but no execute_reply; a reset connection may have lost either. Give
            # the other one in flight a moment, then end.
            collector.settling = True
            asyncio.get_running_loop().call_later(_REPLY_AFTER_IDLE_GRACE, _settle, done)

    def _route_orphan(self, msg: dict[str, Any]) -> None:
        """Output of no known cell (a background process writing between cells): charged
        to a budget of its own, the cell caps again, renewed when the next cell starts."""
        header = msg.get("header")
        if not (isinstance(header, dict) and header.get("msg_type") == "stream"):
            return
        if self._between_cells is None:
            self._between_cells = OutputCollector.between_cells(
                limit_bytes=self.limits.output_bytes,
                limit_events=self.limits.output_events,
                next_seq=self._next_seq,
            )
        for event in self._between_cells.feed(msg):
            if isinstance(event, StreamEvent):
                self._emit(None, event)
