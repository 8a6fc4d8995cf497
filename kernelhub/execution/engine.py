"""The execution engine: one kernel in one sandbox, cells run one at a time, typed events out.

``KernelSession`` owns its sandbox, its kernel client, and three tasks: the channel pump
(kernel messages → events), the worker (runs queued cells in order), and the death watch
(the sandbox reports the kernel gone → the running cell ends as ``kernel_died``).

Timeouts escalate: SIGINT → ``interrupt_grace`` → restart the kernel (variables lost,
files kept) → ``restart_grace`` → kill the sandbox. The final record says which step ended
the cell and whether state was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

import zmq

from kernelhub.config import EngineSettings, Limits
from kernelhub.errors import (
    KernelDiedError,
    KernelError,
    KernelhubError,
    SandboxStartError,
    SessionClosedError,
    SessionError,
)
from kernelhub.execution.collector import OVERSIZED_KEY, OutputCollector
from kernelhub.kernel.client import (
    MAX_FRAME_BYTES,
    MAX_MESSAGE_BYTES,
    Receiver,
    SandboxKernelClient,
    connect_client,
    disconnect_client,
    receiver_for,
    watch_disconnects,
)
from kernelhub.kernel.connection import PORTS, SOCKET_PREFIX
from kernelhub.models import (
    EndedBy,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    InputRequestEvent,
    NoticeEvent,
    ResourceUsage,
    StatusEvent,
    StreamEvent,
)
from kernelhub.sandbox.base import ExitInfo, Sandbox, SandboxBackend, SandboxSpec

log = logging.getLogger(__name__)

Listener = Callable[[Event], None]
_UNSET: Any = object()
_POLL_INTERVAL = 0.005
_RECENT_EXECUTIONS = 64  # finished cells whose late thread output we still attribute


_REPLY_AFTER_IDLE_GRACE = 0.2
# Longest the channel pump keeps the loop while messages keep arriving.
_PUMP_SLICE = 0.002
T = TypeVar("T")


class _Started(NamedTuple):
    """A cell the kernel has been sent: what its end is measured against."""

    collector: OutputCollector
    done: asyncio.Future[None]
    before: ResourceUsage
    started: float  # time.monotonic()


class _Exclusive:
    """A queue item that is not a cell: an operation that needs the kernel to itself."""

    def __init__(
        self, operation: Callable[[], Awaitable[Any]], result: asyncio.Future[Any]
    ) -> None:
        self.operation = operation
        self.result = result


def _answers(handle: ExecutionHandle, result: Execution) -> dict[str, Any]:
    if result.record.status != ExecutionStatus.COMPLETED:
        detail = result.record.error or result.record.reason
        raise KernelError(
            f"kernelhub's call in the kernel ended {result.record.status.value}: {detail}"
        )
    return handle.user_expressions


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _now() -> datetime:
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
    ) -> None:
        self.keep_events = keep_events
        # kernelhub's own code (snapshots): run silently, outside history, its events
        # never reach listeners; ``internal`` holds the user_expressions to evaluate.
        self.internal = internal
        self.user_expressions: dict[str, Any] = {}
        self.id = execution_id
        self.code = code
        self.timeout = timeout
        self.status = ExecutionStatus.QUEUED
        self.queued_at = _now()
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
        self._client: SandboxKernelClient | None = None
        self._seq = first_seq
        self._listeners: list[Listener] = []
        # The worker's queue. A cell submitted while the worker is idle skips it: submit
        # starts the cell itself (``_begun``) so the kernel gets the request in the same
        # loop turn instead of after everything else that turn wakes (store commits,
        # fan-out, the client's acknowledgement); the worker then only waits for it.
        self._queue: deque[ExecutionHandle | _Exclusive] = deque()
        self._idle: asyncio.Future[None] | None = None  # set while the worker waits
        self._working = False  # the worker is running an item (or its after_cell hook)
        self._begun: tuple[ExecutionHandle, _Started] | None = None
        self._handles: dict[str, ExecutionHandle] = {}
        self._finished: deque[str] = deque()
        self._collectors: OrderedDict[
            str, tuple[OutputCollector, weakref.ReferenceType[ExecutionHandle]]
        ] = OrderedDict()
        self._active: tuple[OutputCollector, ExecutionHandle, asyncio.Future[None]] | None = None
        self._between_cells: OutputCollector | None = None  # output of no cell, since the last
        self._disowned: set[str] = set()  # requests someone else collects (see disown)
        self._pumps: list[asyncio.Task[None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._exit: ExitInfo | None = None
        self._closed = False
        self._paused = False
        self._paused_since: float | None = None
        # Called by the worker after each user cell, before the next: checkpoints.
        self.after_cell: Callable[[ExecutionHandle], Awaitable[None]] | None = None
        loop = asyncio.get_running_loop()
        # Resolved when the session is paused / resumed; replaced at each transition.
        self._pause_signal: asyncio.Future[None] = loop.create_future()
        self._resume_signal: asyncio.Future[None] = loop.create_future()
        self._input_deadline: asyncio.TimerHandle | None = None
        self.kernel_info: dict[str, Any] = {}

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
            await session._connect(timeout=session.engine.start_timeout, starting=True)
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
            await session._connect(timeout=session.engine.start_timeout, starting=False)
        except BaseException:
            await session._stop_pumps()
            raise
        session._start_tasks()
        return session

    def _start_tasks(self) -> None:
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"kernelhub-worker-{self.id}"),
            asyncio.create_task(self._watch_death(), name=f"kernelhub-death-{self.id}"),
        ]

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> ExecutionHandle | None:
        return self._active[1] if self._active is not None else None

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def alive(self) -> bool:
        return self._exit is None and not self._closed

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit

    async def close(self, *, keep_state: bool = False) -> None:
        """Stop the kernel and release the sandbox. Queued cells end as ``cancelled``.
        ``keep_state`` leaves the session's checkpoints for a successor (crash recovery)."""
        if self._closed:
            return
        await self.detach()
        while self._queue:
            handle = self._queue.popleft()
            if isinstance(handle, _Exclusive):
                handle.result.set_exception(SessionClosedError("session closed"))
                continue
            self._finish_unstarted(
                handle, ExecutionStatus.CANCELLED, EndedBy.CANCEL, "session closed"
            )
        if self._active is not None:
            _, handle, done = self._active
            if not done.done():
                done.set_exception(SessionClosedError("session closed"))
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
        await self._stop_pumps()

    async def __aenter__(self) -> KernelSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` synchronously with every event of every execution, in order
        (including late output of finished cells). It must not block."""
        self._listeners.append(listener)

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
        through a listener)."""
        return self.submit_nowait(
            code, timeout=timeout, execution_id=execution_id, keep_events=keep_events
        )

    def submit_nowait(
        self,
        code: str,
        *,
        timeout: float | None = _UNSET,
        execution_id: str | None = None,
        keep_events: bool = True,
    ) -> ExecutionHandle:
        """:meth:`submit`, which never has to wait: for callers that are not coroutines."""
        self._check_open()
        if self._paused:
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
                handle, StatusEvent(execution_id=handle.id, seq=self._next_seq(), status=status)
            )

        if self._exit is not None:
            queued()
            self._finish_unstarted(
                handle, ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, self._exit.reason
            )
        elif self._begun is None and self._active is None and self._worker_waiting():
            # Nothing ahead of it: the cell starts now, and its first event is `running`
            # (a `queued` that lasted no time would only be one more event to store and send).
            try:
                self._begun = (handle, self._begin(handle))
            except Exception:
                log.exception("execution %s could not start", handle.id)
                self._finish_unstarted(
                    handle,
                    ExecutionStatus.FAILED,
                    EndedBy.KILL,
                    "internal error; see the kernelhub log",
                )
            else:
                self._wake_worker()
        else:
            queued()
            self._enqueue(handle)
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
        if self._active is None:
            return False
        if self._paused:
            raise SessionError("the session is paused; resume it before interrupting")
        self._active[1].interrupt_requested = True
        self._active[1].interrupt_sent = True
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
        """Answer the running cell's ``input()`` request (``"\x04"`` is EOF)."""
        self._check_open()
        if self._paused:
            raise SessionError("the session is paused; resume it before answering")
        if self._active is None or self._active[1].status != ExecutionStatus.AWAITING_INPUT:
            raise SessionError("no cell is waiting for input")
        assert self._client is not None
        handle = self._active[1]
        self._cancel_input_deadline()
        self._client.input(value)
        password = handle.awaiting_password
        self._emit(
            handle,
            InputReplyEvent(
                execution_id=handle.id,
                seq=self._next_seq(),
                value="" if password else value,
                answered_by=answered_by,
                password=password,
            ),
        )
        self._emit(
            handle,
            StatusEvent(
                execution_id=handle.id, seq=self._next_seq(), status=ExecutionStatus.RUNNING
            ),
        )

    # -- pause and resume ---------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self) -> None:
        """Freeze the whole sandbox (no CPU at all); the running cell shows ``paused`` and
        its timeout stops counting. Execute, interrupt and answers are refused until
        :meth:`resume` (nothing is sent that would need the frozen kernel)."""
        self._check_open()
        if self._exit is not None:
            raise SessionError(f"the kernel is dead ({self._exit.reason}); nothing to pause")
        if self._paused:
            raise SessionError("the session is already paused")
        await self.sandbox.pause()
        self._paused = True
        self._paused_since = time.monotonic()
        self._resume_signal = asyncio.get_running_loop().create_future()
        self._pause_signal.set_result(None)
        self._cancel_input_deadline()
        if self._active is not None:
            handle = self._active[1]
            handle.status_before_pause = handle.status
            self._emit(
                handle,
                StatusEvent(
                    execution_id=handle.id, seq=self._next_seq(), status=ExecutionStatus.PAUSED
                ),
            )

    async def resume(self) -> None:
        self._check_open()
        if not self._paused:
            raise SessionError("the session is not paused")
        await self.sandbox.resume()
        paused_for = time.monotonic() - (self._paused_since or time.monotonic())
        self._paused = False
        self._paused_since = None
        self._pause_signal = asyncio.get_running_loop().create_future()
        self._resume_signal.set_result(None)
        if self._active is not None:
            handle = self._active[1]
            handle.paused_seconds += paused_for
            status = handle.status_before_pause or ExecutionStatus.RUNNING
            self._emit(
                handle, StatusEvent(execution_id=handle.id, seq=self._next_seq(), status=status)
            )
            if status == ExecutionStatus.AWAITING_INPUT:
                self._start_input_deadline(handle)

    # -- input deadline -----------------------------------------------------------------

    def _start_input_deadline(self, handle: ExecutionHandle) -> None:
        self._cancel_input_deadline()
        timeout = self.limits.input_timeout
        if timeout is not None:
            self._input_deadline = asyncio.get_running_loop().call_later(
                timeout, self._answer_for_the_human, handle, timeout
            )

    def _cancel_input_deadline(self) -> None:
        if self._input_deadline is not None:
            self._input_deadline.cancel()
            self._input_deadline = None

    def _answer_for_the_human(self, handle: ExecutionHandle, timeout: float) -> None:
        self._input_deadline = None
        if self._active is None or self._active[1] is not handle or self._paused:
            return
        self._emit(
            handle,
            NoticeEvent(
                execution_id=handle.id,
                seq=self._next_seq(),
                message=f"no answer within {timeout:g} s; answering for the human (input() raises EOFError, confirm() returns False)",
            ),
        )
        with contextlib.suppress(KernelhubError):
            self.send_input("\x04", answered_by="deadline")

    async def call(
        self, code: str, expressions: dict[str, str], *, timeout: float | None
    ) -> dict[str, Any]:
        """Run kernelhub's own ``code`` in the kernel, in turn after the cells queued before
        it, silently (no execution count, no history, no events to listeners), and return
        the kernel's answers for ``expressions`` (Jupyter ``user_expressions``). Raises
        ``KernelError`` if the code failed (with the kernel's traceback)."""
        self._check_open()
        if self._paused:
            raise SessionError("the session is paused; resume it first")
        handle = ExecutionHandle(uuid.uuid4().hex, code, timeout, internal=dict(expressions))
        self._handles[handle.id] = handle
        if self._exit is not None:
            raise KernelDiedError(self._exit.reason)
        self._enqueue(handle)
        return _answers(handle, await handle.wait())

    async def call_now(
        self, code: str, expressions: dict[str, str], *, timeout: float | None
    ) -> dict[str, Any]:
        """Like :meth:`call`, but at once: only from inside :meth:`exclusive` or the
        ``after_cell`` hook, where the worker is already ours."""
        handle = ExecutionHandle(uuid.uuid4().hex, code, timeout, internal=dict(expressions))
        await self._run(handle)
        return _answers(handle, await handle.wait())

    async def exclusive(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation`` in turn with the cells (after those queued before it, before
        those queued after), with the kernel to itself: rewinds, restores."""
        self._check_open()
        if self._paused:
            raise SessionError("the session is paused; resume it first")
        item = _Exclusive(operation, asyncio.get_running_loop().create_future())
        self._enqueue(item)
        return await item.result  # type: ignore[no-any-return]

    async def restart(self) -> None:
        """A fresh kernel process in the same sandbox: variables gone, files kept. Only
        from inside :meth:`exclusive`."""
        await self._restart()

    def get(self, execution_id: str) -> ExecutionHandle | None:
        return self._handles.get(execution_id)

    def disown(self, msg_id: str, *, disowned: bool = True) -> None:
        """Leave the messages of request ``msg_id`` to someone else: a cell that ran while
        no gateway did, collected from the sandbox's spool (``session.salvage``), whose
        live messages would otherwise come out a second time as output of no cell."""
        if disowned:
            self._disowned.add(msg_id)
        else:
            self._disowned.discard(msg_id)

    def notice(self, message: str, execution_id: str = "") -> int:
        """Tell every listener something kernelhub did or found (a recovery, output
        collected after a gateway restart): a notice numbered in turn; returns its seq."""
        seq = self._next_seq()
        self._emit(None, NoticeEvent(execution_id=execution_id, seq=seq, message=message))
        return seq

    def announce(self, event: Event) -> Event:
        """Give every listener an event kernelhub made itself (an execution's output and
        final record collected after a gateway restart), renumbered in turn."""
        event = event.model_copy(update={"seq": self._next_seq()})
        self._emit(None, event)
        return event

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

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

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
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed")

    def _finish_unstarted(
        self, handle: ExecutionHandle, status: ExecutionStatus, ended_by: EndedBy, reason: str
    ) -> None:
        now = _now()
        record = ExecutionRecord(
            execution_id=handle.id,
            status=status,
            ended_by=ended_by,
            reason=reason,
            queued_at=handle.queued_at,
            finished_at=now,
        )
        self._emit(handle, FinalEvent(execution_id=handle.id, seq=self._next_seq(), record=record))

    # -- internals: the kernel connection ---------------------------------------------

    async def _connect(self, *, timeout: float, starting: bool) -> None:
        """Wait for the kernel's sockets, check them, connect, and handshake.

        Our sockets never reconnect on their own (see ``kernel.client``), so a connection
        made to a socket file the kernel has not started listening on yet is dropped and
        retried here, re-checking the files each time.
        """
        deadline = time.monotonic() + timeout
        sdir = self.sandbox.session_dir
        while True:
            while not sdir.sockets_present():
                await self._check_not_dead(starting)
                if time.monotonic() > deadline:
                    raise SandboxStartError(
                        f"kernel did not open its sockets within {timeout:g} s; "
                        "raise KERNELHUB_ENGINE__START_TIMEOUT if the machine is slow",
                        log_tail=await self.sandbox.log_tail(),
                    )
                await asyncio.sleep(_POLL_INTERVAL)
            client = connect_client(sdir)
            try:
                ready = await self._handshake(
                    client, min(deadline, time.monotonic() + 2.0), starting
                )
            except BaseException:
                disconnect_client(client)
                raise
            if ready:
                break
            disconnect_client(client)
            if time.monotonic() > deadline:
                raise SandboxStartError(
                    f"kernel did not answer kernel_info within {timeout:g} s",
                    log_tail=await self.sandbox.log_tail(),
                )
        self._client = client
        self._pumps = []
        for name in ("iopub", "shell", "stdin"):
            receiver = receiver_for(client, name)
            self._pumps.append(asyncio.create_task(self._pump(receiver), name=f"kernelhub-{name}"))
            reset = functools.partial(self._connection_reset, receiver, name)
            self._pumps.append(
                asyncio.create_task(
                    watch_disconnects(receiver.socket, reset), name=f"kernelhub-{name}-watch"
                )
            )

    async def _check_not_dead(self, starting: bool) -> None:
        wait = asyncio.ensure_future(self.sandbox.wait_exit())
        await asyncio.sleep(0)
        if not wait.done():
            wait.cancel()
            return
        info = wait.result()
        if starting:
            raise SandboxStartError(
                f"kernel exited while starting: {info.reason}",
                log_tail=await self.sandbox.log_tail(),
            )
        raise KernelDiedError(info.reason)

    async def _handshake(self, client: SandboxKernelClient, until: float, starting: bool) -> bool:
        """kernel_info until both shell answers and iopub carries the request's status
        (so the iopub subscription is live before the first cell: no lost output).
        False if the kernel did not answer by ``until``."""
        # Re-adopting, the kernel may be in the middle of a cell, and its shell answers
        # nothing until the cell ends; the control channel answers kernel_info at once.
        channel = client.shell_channel if starting else client.control_channel
        while time.monotonic() < until:
            await self._check_not_dead(starting)
            request = client.session.msg("kernel_info_request")
            channel.send(request)
            msg_id = request["header"]["msg_id"]
            reply = await self._read_reply(channel, msg_id, min(1.0, until - time.monotonic()))
            if reply is None:
                continue
            if await self._read_reply(client.iopub_channel, msg_id, 0.5) is None:
                continue
            self.kernel_info = dict(reply.get("content") or {})
            return True
        return False

    @staticmethod
    async def _read_reply(channel: Any, msg_id: str, timeout: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                msg = await channel.get_msg(timeout=left)
            except Exception:  # queue.Empty, or a message that fails to verify
                continue
            if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
                return dict(msg)
        return None

    async def _pump(self, receiver: Receiver) -> None:
        # A flood of ready messages never suspends ``recv`` (zmq answers at once), so the
        # pump gives the loop a turn every few ms: other sessions' cells and clients wait
        # no longer than that for it.
        turn = time.monotonic()
        while True:
            try:
                msg = await receiver.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # socket closed: we are reconnecting or shutting down
            except Exception as exc:
                # Bad signature, bad JSON, a replayed message: hostile or broken, never fatal.
                log.debug("dropped an invalid kernel message: %s", exc)
                continue
            self._route(msg)
            if time.monotonic() - turn > _PUMP_SLICE:
                await asyncio.sleep(0)
                turn = time.monotonic()

    def _connection_reset(self, receiver: Receiver, channel: str) -> None:
        """A kernel socket dropped its connection: most likely the kernel sent a frame over
        the size limit (libzmq then drops the peer for good). Reconnect to the same checked
        socket and tell the running cell, whose output and end may be partly lost."""
        if self._closed or self._exit is not None:
            return
        try:
            receiver.reset()
        except zmq.ZMQError as exc:
            log.warning("cannot reconnect the kernel's %s socket: %s", channel, exc)
        log.warning("session %s: the kernel's %s connection was reset", self.id, channel)
        active = self._active
        if active is None:
            return
        collector, handle, done = active
        for event in collector.connection_reset(channel, MAX_FRAME_BYTES):
            self._emit(handle, event)
        self._maybe_settle(collector, handle, done)

    def _route(self, msg: dict[str, Any]) -> None:
        parent = msg.get("parent_header")
        parent_id = parent.get("msg_id") if isinstance(parent, dict) else None
        entry = self._collectors.get(parent_id) if isinstance(parent_id, str) else None
        if entry is None and OVERSIZED_KEY in msg and self._active is not None:
            # The kernel's claim of whose it is could not be checked: the running cell pays.
            entry = self._collectors.get(self._active[0].msg_id)
        if entry is None:
            if OVERSIZED_KEY in msg:
                log.warning("session %s: dropped an oversized kernel message", self.id)
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
                handle.awaiting_password = event.password
                self._start_input_deadline(handle)
                self._emit(
                    handle,
                    StatusEvent(
                        execution_id=handle.id,
                        seq=self._next_seq(),
                        status=ExecutionStatus.AWAITING_INPUT,
                    ),
                )
        active = self._active
        if active is None or active[0] is not collector:
            return
        self._maybe_settle(collector, active[1], active[2])

    def _maybe_settle(
        self, collector: OutputCollector, handle: ExecutionHandle, done: asyncio.Future[None]
    ) -> None:
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

    async def _stop_pumps(self) -> None:
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(BaseException):
                await task
        self._pumps = []
        if self._client is not None:
            disconnect_client(self._client)
            self._client = None

    # -- internals: running cells -----------------------------------------------------

    def _worker_waiting(self) -> bool:
        return not self._working and not self._queue

    def _wake_worker(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _enqueue(self, item: ExecutionHandle | _Exclusive) -> None:
        self._queue.append(item)
        self._wake_worker()

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._begun is None and not self._queue:
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
            await self._run_user_cell(*begun)
            return
        handle = self._queue.popleft()
        if isinstance(handle, _Exclusive):
            try:
                handle.result.set_result(await handle.operation())
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                handle.result.set_exception(exc)
            return
        if handle.status != ExecutionStatus.QUEUED:
            return  # cancelled while queued
        if self._exit is not None:
            self._finish_unstarted(
                handle, ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, self._exit.reason
            )
            return
        await self._run_user_cell(handle, None)

    async def _run_user_cell(self, handle: ExecutionHandle, begun: _Started | None) -> None:
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

    def _begin(self, handle: ExecutionHandle) -> _Started:
        """Send the cell to the kernel (synchronously: see ``_begun``), then say so."""
        assert self._client is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sandbox.reset_peak()
        before = self.sandbox.usage()
        handle.started_at = _now()
        started = time.monotonic()
        if handle.internal is not None:
            msg_id = self._client.execute(
                handle.code, silent=True, store_history=False,
                user_expressions=handle.internal, allow_stdin=False, stop_on_error=False,
            )  # fmt: skip
        else:
            msg_id = self._client.execute(handle.code, allow_stdin=True, stop_on_error=False)
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
        self._active = (collector, handle, done)
        self._emit(
            handle,
            StatusEvent(
                execution_id=handle.id, seq=self._next_seq(), status=ExecutionStatus.RUNNING
            ),
        )
        return _Started(collector, done, before, started)

    async def _run(self, handle: ExecutionHandle, begun: _Started | None = None) -> None:
        collector, done, before, started = begun or self._begin(handle)
        ended_by, state_lost, reason = EndedBy.REPLY, False, None
        status: ExecutionStatus | None = None
        try:
            await self._wait_running(done, handle)
        except TimeoutError:
            status = ExecutionStatus.TIMED_OUT
            reason = (
                f"execution timed out after {handle.timeout:g} s; pass timeout= or set "
                "KERNELHUB_LIMITS__CELL_TIMEOUT"
            )
            ended_by, state_lost = await self._escalate(done, handle)
        except KernelDiedError as exc:
            status, ended_by, state_lost, reason = (
                ExecutionStatus.KERNEL_DIED,
                EndedBy.KERNEL_DEATH,
                True,
                exc.reason,
            )
        except SessionClosedError:
            status, ended_by, state_lost, reason = (
                ExecutionStatus.CANCELLED,
                EndedBy.KILL,
                True,
                "session closed",
            )
        finally:
            self._active = None
        self._cancel_input_deadline()
        duration = time.monotonic() - started - handle.paused_seconds
        after = self.sandbox.usage()

        if status is None:
            keyboard = collector.error is not None and collector.error.name == "KeyboardInterrupt"
            if handle.interrupt_requested and (keyboard or not collector.reply_seen):
                status, ended_by = ExecutionStatus.INTERRUPTED, EndedBy.INTERRUPT
            elif collector.reply_status == "ok":
                status = ExecutionStatus.COMPLETED
            else:
                status = ExecutionStatus.FAILED
        elif status == ExecutionStatus.KERNEL_DIED and self._exit is not None:
            reason = self._exit.reason
        handle.user_expressions = collector.user_expressions
        for event in collector.finish():
            self._emit(handle, event)
        cpu = (
            after.cpu_seconds - before.cpu_seconds
            if after.cpu_seconds is not None and before.cpu_seconds is not None
            else None
        )
        record = ExecutionRecord(
            execution_id=handle.id,
            status=status,
            ended_by=ended_by,
            state_lost=state_lost,
            reason=reason,
            execution_count=collector.execution_count,
            error=collector.error,
            queued_at=handle.queued_at,
            started_at=handle.started_at,
            finished_at=_now(),
            duration=duration,
            cpu_seconds=cpu,
            peak_memory_bytes=after.peak_memory_bytes,
            output_bytes=collector.output_bytes,
            dropped_bytes=collector.dropped_bytes,
            dropped_events=collector.dropped_events,
            paused_seconds=handle.paused_seconds,
        )
        self._emit(handle, FinalEvent(execution_id=handle.id, seq=self._next_seq(), record=record))

    async def _wait_running(self, done: asyncio.Future[None], handle: ExecutionHandle) -> None:
        """Wait for the cell; TimeoutError once it has *run* for its timeout. Paused time
        does not count, and a frozen sandbox is never interrupted. (Plain futures only:
        this runs for every cell, and tasks would cost more than the cell itself.)"""
        started = time.monotonic()
        while True:
            if self._paused:
                await asyncio.wait({done, self._resume_signal}, return_when=asyncio.FIRST_COMPLETED)
                if done.done():
                    return done.result()
                continue
            if handle.timeout is None:
                remaining = None
            else:
                ran = time.monotonic() - started - handle.paused_seconds
                remaining = handle.timeout - ran
                if remaining <= 0:
                    raise TimeoutError
            finished, _ = await asyncio.wait(
                {done, self._pause_signal}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if done.done():
                return done.result()
            if not finished and not self._paused:
                raise TimeoutError

    async def _escalate(
        self, done: asyncio.Future[None], handle: ExecutionHandle
    ) -> tuple[EndedBy, bool]:
        """Interrupt → restart the kernel → kill the sandbox, each step given its grace."""
        try:
            handle.interrupt_sent = True
            await self.sandbox.interrupt()
            await asyncio.wait_for(asyncio.shield(done), self.engine.interrupt_grace)
            return EndedBy.INTERRUPT, False
        except TimeoutError:
            pass
        except KernelhubError:
            if self._exit is not None:
                return EndedBy.KERNEL_DEATH, True
        self._emit(
            handle,
            NoticeEvent(
                execution_id=handle.id,
                seq=self._next_seq(),
                message="cell ignored the interrupt; restarting the kernel (variables are lost, files are kept)",
            ),
        )
        try:
            await asyncio.wait_for(self._restart(), self.engine.restart_grace)
            return EndedBy.RESTART, True
        except (TimeoutError, KernelhubError) as exc:
            log.warning("kernel restart failed (%s); killing the sandbox", exc)
        self._emit(
            handle,
            NoticeEvent(
                execution_id=handle.id,
                seq=self._next_seq(),
                message="kernel restart failed; the sandbox was killed",
            ),
        )
        await self.sandbox.kill()
        if self._exit is None:
            self._exit = ExitInfo(reason="killed after a cell ignored its timeout")
        return EndedBy.KILL, True

    async def _restart(self) -> None:
        before = self._socket_inodes()
        await self._stop_pumps()
        await self.sandbox.restart_kernel()
        deadline = time.monotonic() + self.engine.restart_grace
        # The new kernel re-binds every socket (new inodes); connecting earlier would
        # reach the dead kernel's files.
        while True:
            now = self._socket_inodes()
            if len(now) == len(PORTS) and not (set(now.values()) & set(before.values())):
                break
            if time.monotonic() > deadline:
                raise KernelError("restarted kernel did not bind its sockets")
            await self._check_not_dead(False)
            await asyncio.sleep(_POLL_INTERVAL)
        await self._connect(timeout=max(deadline - time.monotonic(), 1.0), starting=False)

    def _socket_inodes(self) -> dict[int, tuple[int, int]]:
        """Identity of each socket file; inode numbers alone are reused after unlink."""
        ipc = self.sandbox.session_dir.ipc_dir
        inodes = {}
        for port in PORTS.values():
            try:
                st = os.lstat(ipc / f"{SOCKET_PREFIX}-{port}")
                inodes[port] = (st.st_ino, st.st_ctime_ns)
            except OSError:
                pass
        return inodes

    async def _watch_death(self) -> None:
        info = await self.sandbox.wait_exit()
        if self._closed:
            return
        self._exit = info
        log.info("kernel of session %s died: %s", self.id, info.reason)
        if self._active is not None and not self._active[2].done():
            self._active[2].set_exception(KernelDiedError(info.reason))
