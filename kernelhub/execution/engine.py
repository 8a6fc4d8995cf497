"""The execution engine: one kernel in one sandbox, cells run one at a time, typed events out.

``KernelSession`` owns its sandbox and its collaborators, each in its own module:

- ``link.KernelLink``: the connection to the kernel (handshake, one pump per channel,
  reconnects, restart) — kernel messages in;
- ``router.MessageRouter``: which cell each message belongs to, through its
  ``OutputCollector`` — events out, through :meth:`KernelSession._emit`;
- ``worker.CellWorker``: the queue and the one worker that runs cells in order;
- ``cell.CellRunner``: one cell from its request to its final event;
- ``timeouts``: the pause-aware cell clock and the escalation of a timeout
  (SIGINT → ``interrupt_grace`` → restart the kernel → ``restart_grace`` → kill);
- ``record``: the final record of a cell (pure).

Here: the public API, and the death watch (kernel gone → the running cell: ``kernel_died``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kernelhub.config import EngineSettings, Limits
from kernelhub.errors import KernelDiedError, SessionClosedError, SessionError
from kernelhub.execution.answers import InputDesk
from kernelhub.execution.cell import CellRunner, Started
from kernelhub.execution.handle import ExecutionHandle
from kernelhub.execution.link import KernelLink
from kernelhub.execution.record import unstarted_record
from kernelhub.execution.router import MessageRouter
from kernelhub.execution.timeouts import Escalation, PauseGate
from kernelhub.execution.worker import CellWorker, Exclusive
from kernelhub.models import (
    EndedBy,
    Event,
    Execution,
    ExecutionStatus,
    FinalEvent,
    NoticeEvent,
    ResourceUsage,
    StatusEvent,
)
from kernelhub.sandbox.base import ExitInfo, Sandbox, SandboxBackend, SandboxSpec

__all__ = ["ExecutionHandle", "KernelSession", "Listener"]

log = logging.getLogger(__name__)

Listener = Callable[[Event], None]
_UNSET: Any = object()
T = TypeVar("T")


class KernelSession:
    """One stateful kernel. Create with :meth:`start`; always :meth:`close`."""

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        limits: Limits,
        engine: EngineSettings,
        first_seq: int = 0,
    ) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.engine = engine
        self.id = sandbox.spec.session_id
        self._seq = first_seq
        self._listeners: list[Listener] = []
        self._gates: list[Callable[[], Awaitable[None] | None]] = []
        self._handles: dict[str, ExecutionHandle] = {}
        self._finished: deque[str] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._worker_task: asyncio.Task[None] | None = None  # the one that runs cells
        self._exit: ExitInfo | None = None
        self._closed = False
        self._gate = PauseGate()
        # Called by the worker after each user cell, before the next: checkpoints.
        self.after_cell: Callable[[ExecutionHandle], Awaitable[None]] | None = None
        self._router = MessageRouter(
            self.id,
            limits,
            emit=self._emit,
            next_seq=self.next_seq,
            on_input=lambda handle, event: self._desk.kernel_asked(handle, event),
        )
        self._link = KernelLink(
            sandbox, engine, on_message=self._router.route,
            on_reset=self._router.connection_reset, alive=lambda: self.alive, room=self._room,
        )  # fmt: skip
        self._worker: CellWorker[Started] = CellWorker(self._run_user_cell)
        escalation = Escalation(
            sandbox, engine, notice=self.notice, restart=self._link.restart, dead=self._dead
        )
        self._desk = InputDesk(
            limits, self._gate, router=lambda: self._router, link=lambda: self._link,
            emit=self._emit, next_seq=self.next_seq, notice=self.notice,
        )  # fmt: skip
        self._cells = CellRunner(
            sandbox, self._link, self._router, self._gate, escalation,
            emit=self._emit, next_seq=self.next_seq, exit_info=lambda: self._exit,
            on_end=self._desk.cancel_deadline,
        )  # fmt: skip

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        backend: SandboxBackend,
        spec: SandboxSpec,
        *,
        engine: EngineSettings | None = None,
        first_seq: int = 0,
    ) -> KernelSession:
        """Create and start a sandbox, wait for its kernel, and return a ready session.
        Sequence numbers continue after ``first_seq`` (a session woken from hibernation)."""
        sandbox = await backend.create(spec)
        session = cls(
            sandbox, limits=spec.limits, engine=engine or EngineSettings(), first_seq=first_seq
        )
        try:
            await sandbox.start()
            await session._link.connect(timeout=session.engine.start_timeout, starting=True)
            await sandbox.started()
        except BaseException:
            await session.close()
            raise
        session._start_tasks()
        return session

    @classmethod
    async def attach(
        cls,
        sandbox: Sandbox,
        *,
        engine: EngineSettings | None = None,
        first_seq: int = 0,
    ) -> KernelSession:
        """Reconnect to a sandbox that is already running (re-adoption after a gateway
        restart): its kernel keeps every variable. Sequence numbers continue after
        ``first_seq``."""
        session = cls(
            sandbox,
            limits=sandbox.spec.limits,
            engine=engine or EngineSettings(),
            first_seq=first_seq,
        )
        try:
            await session._link.connect(timeout=session.engine.start_timeout, starting=False)
        except BaseException:
            await session._link.stop()
            raise
        session._start_tasks()
        return session

    def _start_tasks(self) -> None:
        self._worker_task = asyncio.create_task(
            self._worker.run(), name=f"kernelhub-worker-{self.id}"
        )
        self._tasks = [
            self._worker_task,
            asyncio.create_task(self._watch_death(), name=f"kernelhub-death-{self.id}"),
        ]

    @property
    def queue_length(self) -> int:
        return len(self._worker.queue)

    @property
    def user_cells(self) -> int:
        """User cells running or queued, background calls (the automatic checkpoint) and
        exclusive operations left out: what the storage guard reserves output caps for."""
        running = self.running
        queued = sum(
            isinstance(h, ExecutionHandle) and not h.background for h in self._worker.queue
        )
        return queued + (running is not None and not running.background)

    @property
    def user_busy(self) -> bool:
        """Whether anything but a background call (the automatic checkpoint) runs or
        waits: what makes a session read busy."""
        running = self.running
        if running is not None and not running.background:
            return True
        return any(not h.background for h in self._worker.waiting())

    @property
    def running(self) -> ExecutionHandle | None:
        active = self._router.active
        return active.handle if active is not None else None

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def alive(self) -> bool:
        return self._exit is None and not self._closed

    # -- for the session layer: what it did through this object's privates and its
    # sandbox before (the sandbox contract names the engine as the sandbox's only caller)

    def next_seq(self) -> int:
        """Take the next sequence number, for an event the session layer makes itself."""
        self._seq += 1
        return self._seq

    def advance_seq(self, seq: int) -> None:
        """Continue numbering after ``seq`` (events the session layer stored itself)."""
        self._seq = max(self._seq, seq)

    def publish(self, event: Event) -> None:
        """Hand an event of no running cell to the listeners, in order with the engine's."""
        self._emit(None, event)

    def notice(self, message: str, handle: ExecutionHandle | None = None) -> None:
        """A notice on the event stream: of ``handle``'s cell, or session-wide (a restart,
        a rewind, a recovery) without one."""
        execution_id = handle.id if handle is not None else ""
        event = NoticeEvent(execution_id=execution_id, seq=self.next_seq(), message=message)
        self._emit(handle, event)

    async def wait_exit(self) -> ExitInfo:
        return await self.sandbox.wait_exit()

    def usage(self) -> ResourceUsage:
        return self.sandbox.usage()

    async def write_file(self, path: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        return await self.sandbox.write_file(path, chunks, max_bytes)

    def read_file(self, path: str, max_bytes: int) -> AsyncIterator[bytes]:
        return self.sandbox.read_file(path, max_bytes)

    def pack_snapshot(self, name: str, max_bytes: int) -> AsyncIterator[bytes]:
        return self.sandbox.pack_snapshot(name, max_bytes)

    async def unpack_snapshot(self, name: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        return await self.sandbox.unpack_snapshot(name, chunks, max_bytes)

    @property
    def kernel_info(self) -> dict[str, Any]:
        """The kernel's ``kernel_info_reply`` content, from the last handshake."""
        return self._link.kernel_info

    async def close(self, *, keep_state: bool = False) -> None:
        """Stop the kernel and release the sandbox. Queued cells end as ``cancelled``.
        ``keep_state`` leaves the session's checkpoints for a successor (crash recovery)."""
        if self._closed:
            return
        await self.detach()
        queue = self._worker.queue
        while queue:
            handle = queue.popleft()
            if isinstance(handle, Exclusive):
                handle.result.set_exception(SessionClosedError("session closed"))
                continue
            self._finish_unstarted(
                handle, ExecutionStatus.CANCELLED, EndedBy.CANCEL, "session closed"
            )
        active = self._router.active
        if active is not None and not active.done.done():
            active.done.set_exception(SessionClosedError("session closed"))
        await self.sandbox.remove(keep_state=keep_state)

    async def detach(self) -> None:
        """Stop talking to the kernel but leave its sandbox running (a gateway shutting
        down, to be re-adopted by the next one). The session is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self._link.stop()

    async def __aenter__(self) -> KernelSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` synchronously with every event of every execution, in order
        (including late output of finished cells). It must not block."""
        self._listeners.append(listener)

    def add_gate(self, gate: Callable[[], Awaitable[None] | None]) -> None:
        """Back-pressure from a listener: after each kernel message the kernel's pumps
        call ``gate()``, and if it returns an awaitable they read nothing more until it is
        done (a listener still serializing or storing earlier output). It must not block,
        and what it returns must finish without any further kernel message."""
        self._gates.append(gate)

    def _room(self) -> Awaitable[None] | None:
        for gate in self._gates:
            wait = gate()
            if wait is not None:
                return wait
        return None

    # -- executing --------------------------------------------------------------------

    async def submit(
        self,
        code: str,
        *,
        timeout: float | None = _UNSET,
        execution_id: str | None = None,
        keep_events: bool = True,
    ) -> ExecutionHandle:
        """Queue a cell. ``timeout`` in seconds; ``None`` means no limit; default: the
        session's ``cell_timeout``. Refused while the session is paused. With
        ``keep_events=False`` the handle keeps only the final event (consume the rest
        through a listener). Never suspends: awaited from an eager start (the WebSocket's
        fast path), an idle kernel has the request before this returns."""
        self._check_open()
        if self._gate.paused:
            raise SessionError("the session is paused; resume it before executing")
        handle = ExecutionHandle(
            execution_id or uuid.uuid4().hex,
            code,
            self.limits.cell_timeout if timeout is _UNSET else timeout,
            keep_events=keep_events,
        )
        self._handles[handle.id] = handle

        def queued() -> None:
            status = ExecutionStatus.QUEUED
            self._emit(
                handle, StatusEvent(execution_id=handle.id, seq=self.next_seq(), status=status)
            )

        if self._exit is not None:
            queued()
            self._finish_unstarted(
                handle, ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, self._exit.reason
            )
        elif self._router.active is None and self._worker.idle():
            # Nothing ahead of it: the cell starts now, and its first event is `running`
            # (a `queued` that lasted no time would only be one more event to store and send).
            try:
                started = self._cells.begin(handle)
            except Exception:
                log.exception("execution %s could not start", handle.id)
                self._finish_unstarted(
                    handle,
                    ExecutionStatus.FAILED,
                    EndedBy.KILL,
                    "internal error; see the kernelhub log",
                )
            else:
                self._worker.begun(handle, started)
        else:
            queued()
            self._worker.enqueue(handle)
        return handle

    async def execute(self, code: str, *, timeout: float | None = _UNSET) -> Execution:
        """Run a cell and return it finished."""
        handle = await self.submit(code, timeout=timeout)
        return await handle.wait()

    async def stream(self, code: str, *, timeout: float | None = _UNSET) -> AsyncIterator[Event]:
        """Run a cell and yield its events as they happen, ending with the final one."""
        handle = await self.submit(code, timeout=timeout)
        async for event in handle:
            yield event

    async def interrupt(self) -> bool:
        """KeyboardInterrupt in the running cell. Returns False if none was running."""
        self._check_open()
        active = self._router.active
        if active is None:
            return False
        if self._gate.paused:
            raise SessionError("the session is paused; resume it before interrupting")
        active.handle.interrupt_requested = True
        active.handle.interrupt_sent = True
        await self.sandbox.interrupt()
        return True

    def cancel(self, execution_id: str) -> bool:
        """Cancel a queued cell. Returns False if it already started or finished."""
        handle = self._handles.get(execution_id)
        if handle is None or handle.status != ExecutionStatus.QUEUED:
            return False
        self._finish_unstarted(
            handle, ExecutionStatus.CANCELLED, EndedBy.CANCEL, "cancelled before it ran"
        )
        return True

    def send_input(self, value: str, *, answered_by: str = "user") -> None:
        """Answer the running cell's ``input()`` request, or the host's question on show
        (``"\\x04"`` is EOF)."""
        self._check_open()
        self._desk.answer(value, answered_by)

    def ask(self, prompt: str) -> asyncio.Future[str]:
        """Ask the human at the other end a question for the host (the egress gate), through
        the running cell: an ``input_request`` event like ``confirm()``'s, answered over the
        same channels (:meth:`send_input`), with the same deadline. The future gets the
        answer, ``"\\x04"`` when the deadline passed or the cell ended first. Questions wait
        their turn behind each other and behind the kernel's own. Raises SessionError when
        no user cell is running: nobody is there to ask."""
        self._check_open()
        return self._desk.ask(prompt)

    # -- pause and resume ---------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._gate.paused

    async def pause(self) -> None:
        """Freeze the whole sandbox (no CPU at all); the running cell shows ``paused`` and
        its timeout stops counting. Execute, interrupt and answers are refused until
        :meth:`resume` (nothing is sent that would need the frozen kernel)."""
        self._check_open()
        if self._exit is not None:
            raise SessionError(f"the kernel is dead ({self._exit.reason}); nothing to pause")
        if self._gate.paused:
            raise SessionError("the session is already paused")
        await self.sandbox.pause()
        self._gate.pause()
        self._desk.cancel_deadline()
        if self._router.active is not None:
            handle = self._router.active.handle
            handle.status_before_pause = handle.status
            self._emit(
                handle,
                StatusEvent(
                    execution_id=handle.id, seq=self.next_seq(), status=ExecutionStatus.PAUSED
                ),
            )

    async def resume(self) -> None:
        self._check_open()
        if not self._gate.paused:
            raise SessionError("the session is not paused")
        await self.sandbox.resume()
        paused_for = self._gate.resume()
        if self._router.active is not None:
            handle = self._router.active.handle
            handle.paused_seconds += paused_for
            status = handle.status_before_pause or ExecutionStatus.RUNNING
            self._emit(
                handle, StatusEvent(execution_id=handle.id, seq=self.next_seq(), status=status)
            )
            if status == ExecutionStatus.AWAITING_INPUT:
                self._desk.start_deadline(handle)

    async def call(
        self,
        code: str,
        expressions: dict[str, str],
        *,
        timeout: float | None,
        background: bool = False,
        request: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Run kernelhub's own ``code`` in the kernel, in turn after the cells queued before
        it, silently (no execution count, no history, no events to listeners), and return
        the kernel's answers for ``expressions`` (Jupyter ``user_expressions``). Raises
        ``KernelError`` if the code failed (with the kernel's traceback). From the worker
        itself (an :meth:`exclusive` operation, the ``after_cell`` hook) it runs at once:
        the kernel is already ours, and queueing behind ourselves would never return.
        ``request``: a ``kernelhub_call_request``'s content to send instead of ``code``
        (see ``ops.run``); the answer is then its reply's content."""
        self._check_open()
        handle = ExecutionHandle(
            uuid.uuid4().hex, code, timeout, internal=dict(expressions), background=background
        )
        handle.request = request
        if self._worker_task is not None and asyncio.current_task() is self._worker_task:
            await self._run(handle, None)
            return handle.answers(await handle.wait())
        if self._gate.paused:
            raise SessionError("the session is paused; resume it first")
        self._handles[handle.id] = handle
        if self._exit is not None:
            raise KernelDiedError(self._exit.reason)
        self._worker.enqueue(handle)
        return handle.answers(await handle.wait())

    async def exclusive(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation`` in turn with the cells (after those queued before it, before
        those queued after), with the kernel to itself: rewinds, restores."""
        self._check_open()
        if self._gate.paused:
            raise SessionError("the session is paused; resume it first")
        item = Exclusive(operation, asyncio.get_running_loop().create_future())
        self._worker.enqueue(item)
        return await item.result  # type: ignore[no-any-return]

    async def restart(self) -> None:
        """A fresh kernel process in the same sandbox: variables gone, files kept. Only
        from inside :meth:`exclusive`."""
        await self._link.restart()

    def get(self, execution_id: str) -> ExecutionHandle | None:
        return self._handles.get(execution_id)

    def disown(self, msg_id: str, *, disowned: bool = True) -> None:
        self._router.disown(msg_id, disowned=disowned)  # see MessageRouter.disown

    # -- internals: events ------------------------------------------------------------

    def _retire(self, handle: ExecutionHandle) -> None:
        """Forget all but the newest ``retain_finished`` finished executions, so a long
        session's outputs do not pile up in memory (waiters keep their own reference)."""
        self._finished.append(handle.id)
        while len(self._finished) > self.engine.retain_finished:
            self._handles.pop(self._finished.popleft(), None)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session {self.id} is closed; create a new session")

    def _emit(self, handle: ExecutionHandle | None, event: Event) -> None:
        if handle is not None and handle.internal is not None:
            if handle.record is None:
                handle._emit(event)
                if isinstance(event, FinalEvent):
                    self._handles.pop(handle.id, None)
            return
        if handle is not None and handle.record is None:
            handle._emit(event)
            if isinstance(event, FinalEvent):
                self._retire(handle)
                self._desk.ended(handle)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed")

    def _finish_unstarted(
        self, handle: ExecutionHandle, status: ExecutionStatus, ended_by: EndedBy, reason: str
    ) -> None:
        record = unstarted_record(handle, status, ended_by, reason)
        self._emit(handle, FinalEvent(execution_id=handle.id, seq=self.next_seq(), record=record))

    # -- internals: running cells -----------------------------------------------------

    async def _run_user_cell(self, handle: ExecutionHandle, begun: Started | None) -> None:
        if begun is None and handle.status != ExecutionStatus.QUEUED:
            return  # cancelled while queued
        if begun is None and self._exit is not None:
            self._finish_unstarted(
                handle, ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, self._exit.reason
            )
            return
        try:
            await self._run(handle, begun)
            if self.after_cell is not None and handle.internal is None and self._exit is None:
                await self.after_cell(handle)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("execution %s crashed the worker", handle.id)
            if handle.record is None:
                self._finish_unstarted(
                    handle,
                    ExecutionStatus.FAILED,
                    EndedBy.KILL,
                    "internal error; see the kernelhub log",
                )

    async def _run(self, handle: ExecutionHandle, begun: Started | None) -> None:
        killed = await self._cells.run(handle, begun)
        if killed is not None and self._exit is None:
            self._exit = killed

    def _dead(self) -> bool:
        return self._exit is not None

    async def _watch_death(self) -> None:
        info = await self.sandbox.wait_exit()
        if self._closed:
            return
        self._exit = info
        log.info("kernel of session %s died: %s", self.id, info.reason)
        active = self._router.active
        if active is not None and not active.done.done():
            active.done.set_exception(KernelDiedError(info.reason))
