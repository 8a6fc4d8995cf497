"""One cell in the kernel, from its ``execute_request`` to its final event.

:class:`CellRunner` sends the request (synchronously, so the caller decides the loop
turn: see ``worker``), waits for the router to say the request finished, escalates a
timeout, and emits the cell's last events and its final record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from kernelhub.errors import KernelDiedError, SessionClosedError
from kernelhub.execution.handle import ExecutionHandle, now
from kernelhub.execution.link import KernelLink
from kernelhub.execution.ops import REQUEST as CALL_REQUEST
from kernelhub.execution.record import finished_record, reply_outcome
from kernelhub.execution.router import Active, Emit, MessageRouter
from kernelhub.execution.timeouts import Escalation, PauseGate, wait_running
from kernelhub.models import (
    EndedBy,
    ExecutionStatus,
    FinalEvent,
    ResourceUsage,
    StatusEvent,
)
from kernelhub.sandbox.base import ExitInfo, Sandbox


class Started(NamedTuple):
    """A cell the kernel has been sent: what its end is measured against."""

    active: Active
    before: ResourceUsage
    started: float  # time.monotonic()


class CellRunner:
    """Runs cells for one session. ``exit_info()`` is the kernel's death, if it died;
    ``on_end()`` is called as soon as the kernel is done with a cell (the session stops
    its input deadline)."""

    def __init__(
        self,
        sandbox: Sandbox,
        link: KernelLink,
        router: MessageRouter,
        gate: PauseGate,
        escalation: Escalation,
        *,
        emit: Emit,
        next_seq: Callable[[], int],
        exit_info: Callable[[], ExitInfo | None],
        on_end: Callable[[], None],
    ) -> None:
        self.sandbox = sandbox
        self._link = link
        self._router = router
        self._gate = gate
        self._escalation = escalation
        self._emit = emit
        self._next_seq = next_seq
        self._exit_info = exit_info
        self._on_end = on_end

    def begin(self, handle: ExecutionHandle) -> Started:
        """Send the cell to the kernel, then say so (its ``running`` event)."""
        client = self._link.client
        assert client is not None
        self.sandbox.reset_peak()
        before = self.sandbox.usage()
        handle.started_at = now()
        started = time.monotonic()
        if handle.request is not None:
            msg_id = client.send("shell", CALL_REQUEST, handle.request)
        elif handle.internal is not None:
            msg_id = client.execute(
                handle.code, silent=True, store_history=False,
                user_expressions=handle.internal, allow_stdin=False, stop_on_error=False,
            )  # fmt: skip
        else:
            msg_id = client.execute(handle.code, allow_stdin=True, stop_on_error=False)
        active = self._router.begin(handle, msg_id)
        self._emit(
            handle,
            StatusEvent(
                execution_id=handle.id, seq=self._next_seq(), status=ExecutionStatus.RUNNING
            ),
        )
        return Started(active, before, started)

    async def run(self, handle: ExecutionHandle, begun: Started | None = None) -> ExitInfo | None:
        """Run the cell to its final event. Returns why the sandbox is gone if this cell's
        escalation killed it, else None."""
        active, before, started = begun or self.begin(handle)
        collector, done = active.collector, active.done
        ended_by, state_lost, reason = EndedBy.REPLY, False, None
        status: ExecutionStatus | None = None
        killed: ExitInfo | None = None
        try:
            await wait_running(done, handle, self._gate)
        except TimeoutError:
            status = ExecutionStatus.TIMED_OUT
            reason = (
                f"execution timed out after {handle.timeout:g} s; pass timeout= or set "
                "KERNELHUB_LIMITS__CELL_TIMEOUT"
            )
            ended_by, state_lost = await self._escalation.run(done, handle)
            if ended_by == EndedBy.KILL:
                killed = ExitInfo(reason="killed after a cell ignored its timeout")
        except KernelDiedError as exc:
            status, ended_by, state_lost = ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, True
            reason = exc.reason
        except SessionClosedError:
            status, ended_by, state_lost = ExecutionStatus.CANCELLED, EndedBy.KILL, True
            reason = "session closed"
        finally:
            self._router.active = None
        self._on_end()
        duration = time.monotonic() - started - handle.paused_seconds
        after = self.sandbox.usage()
        exit_info = self._exit_info()
        if status is None:
            status, ended_by = reply_outcome(
                collector, interrupt_requested=handle.interrupt_requested
            )
        elif status == ExecutionStatus.KERNEL_DIED and exit_info is not None:
            reason = exit_info.reason
        handle.user_expressions = collector.user_expressions
        handle.reply = collector.call_reply
        handle.unchanged_since = collector.unchanged_since
        for event in collector.finish():
            self._emit(handle, event)
        record = finished_record(
            handle, collector, status=status, ended_by=ended_by, state_lost=state_lost,
            reason=reason, duration=duration, before=before, after=after,
        )  # fmt: skip
        self._emit(handle, FinalEvent(execution_id=handle.id, seq=self._next_seq(), record=record))
        return killed
