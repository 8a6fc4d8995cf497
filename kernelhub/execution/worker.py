"""The session's queue and the one worker that empties it: one item at a time, in order.

An item is a cell (an :class:`ExecutionHandle`) or an :class:`Exclusive` operation that
needs the kernel to itself (rewind, restore). A cell submitted while the worker is idle
skips the queue: the session starts it itself (:meth:`CellWorker.take_begun`) so the
kernel gets the request in the same loop turn instead of after everything else that turn
wakes (store commits, fan-out, the client's acknowledgement); the worker then only waits
for it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from kernelhub.execution.handle import ExecutionHandle

T = TypeVar("T")


class Exclusive:
    """A queue item that is not a cell: an operation that needs the kernel to itself."""

    def __init__(
        self, operation: Callable[[], Awaitable[Any]], result: asyncio.Future[Any]
    ) -> None:
        self.operation = operation
        self.result = result


class CellWorker(Generic[T]):
    """Runs ``run_cell(handle, begun)`` for each cell, in order: ``begun`` is what the
    session's own start of an idle-time cell returned (``T``), else None."""

    def __init__(self, run_cell: Callable[[ExecutionHandle, T | None], Awaitable[None]]) -> None:
        self._run_cell = run_cell
        self.queue: deque[ExecutionHandle | Exclusive] = deque()
        self._idle: asyncio.Future[None] | None = None  # set while the worker waits
        self._working = False  # running an item (or its after_cell hook)
        self._begun: tuple[ExecutionHandle, T] | None = None

    def idle(self) -> bool:
        """Nothing running, nothing queued, nothing begun: a new cell may start now."""
        return not self._working and not self.queue and self._begun is None

    def waiting(self) -> list[ExecutionHandle]:
        """The cells begun or queued, not yet running (exclusive operations left out)."""
        begun = [self._begun[0]] if self._begun is not None else []
        return begun + [h for h in self.queue if isinstance(h, ExecutionHandle)]

    def begun(self, handle: ExecutionHandle, started: T) -> None:
        """The session started ``handle`` itself (it was :meth:`idle`); the worker takes
        over waiting for it."""
        self._begun = (handle, started)
        self._wake()

    def enqueue(self, item: ExecutionHandle | Exclusive) -> None:
        self.queue.append(item)
        self._wake()

    def _wake(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def run(self) -> None:
        """The worker task's body, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            if self._begun is None and not self.queue:
                self._idle = loop.create_future()
                try:
                    await self._idle
                finally:
                    self._idle = None
            # One cell per call: no local here outlives its cell, so a finished cell's
            # outputs are not kept alive while the worker waits for the next one.
            self._working = True
            try:
                await self._run_next()
            finally:
                self._working = False

    async def _run_next(self) -> None:
        if self._begun is not None:
            begun, self._begun = self._begun, None
            await self._run_cell(*begun)
            return
        item = self.queue.popleft()
        if isinstance(item, Exclusive):
            try:
                item.result.set_result(await item.operation())
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                item.result.set_exception(exc)
            return
        await self._run_cell(item, None)
