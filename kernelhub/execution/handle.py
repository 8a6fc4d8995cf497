"""A submitted cell as the engine's callers hold it: its events, its status, its end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from kernelhub.errors import KernelError
from kernelhub.models import (
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    StatusEvent,
)


def now() -> datetime:
    return datetime.now(UTC)


class ExecutionHandle:
    """A submitted cell. Iterate it for its events (from the first, then live); ``wait()``
    for the finished :class:`Execution`. Consumers may stop iterating at any time: the cell
    keeps running and its events keep being recorded."""

    def __init__(
        self,
        execution_id: str,
        code: str,
        timeout: float | None,
        *,
        keep_events: bool = True,
        internal: dict[str, str] | None = None,
        background: bool = False,
    ) -> None:
        self.keep_events = keep_events
        # An internal call the session does on its own (the checkpoint after a cell): it
        # never makes the session read busy.
        self.background = background
        # kernelhub's own code (snapshots): run silently, outside history, its events
        # never reach listeners; ``internal`` holds the user_expressions to evaluate.
        self.internal = internal
        self.user_expressions: dict[str, Any] = {}
        # Sent as a ``kernelhub_call_request`` instead of ``code`` (``ops``), its reply here.
        self.request: dict[str, Any] | None = None
        self.reply: dict[str, Any] = {}
        self.unchanged_since: str | None = None  # see ExecutionCollector.unchanged_since
        self.id = execution_id
        self.code = code
        self.timeout = timeout
        self.status = ExecutionStatus.QUEUED
        self.queued_at = now()
        self.started_at: datetime | None = None
        self.events: list[Event] = []
        self.record: ExecutionRecord | None = None
        self.interrupt_requested = False  # by the user
        self.interrupt_sent = False  # by anyone: the user or the timeout escalation
        self.awaiting_password = False
        self.paused_seconds = 0.0
        self.status_before_pause: ExecutionStatus | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def _emit(self, event: Event) -> None:
        # Without keep_events (the gateway streams and stores events itself) only the
        # final event is kept, so a running cell's output is not held twice in memory.
        if self.keep_events or isinstance(event, FinalEvent):
            self.events.append(event)
        if isinstance(event, StatusEvent):
            self.status = event.status
        elif isinstance(event, FinalEvent):
            self.record = event.record
            self.status = event.record.status
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _changed(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    async def __aiter__(self) -> AsyncIterator[Event]:
        i = 0
        while True:
            while i < len(self.events):
                event = self.events[i]
                i += 1
                yield event
                if isinstance(event, FinalEvent):
                    return
            await self._changed()

    async def wait(self) -> Execution:
        while self.record is None:
            await self._changed()
        return Execution(record=self.record, events=list(self.events))

    def answers(self, result: Execution) -> dict[str, Any]:
        """The kernel's answers to an internal call's expressions; ``KernelError`` if the
        call did not complete."""
        if result.record.status != ExecutionStatus.COMPLETED:
            detail = result.record.error or result.record.reason
            raise KernelError(
                f"kernelhub's call in the kernel ended {result.record.status.value}: {detail}"
            )
        return self.reply if self.request is not None else self.user_expressions
