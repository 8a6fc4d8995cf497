"""The kernelhub sessions behind the MCP server: one per MCP connection, or one per
session handle for clients of the stateless protocol, and what a tool call needs around
its cell (live output, input, cancellation, a kernel that died).

A tool call sets :data:`CALL` (its :class:`CallHooks`) for the duration of the call;
:class:`LiveSession` — the :class:`~kernelhub.agents.tools.ToolSession` the runner sees —
reads it to stream the cell's events to the hooks, to answer ``input()`` through the
hooks' ``on_input`` (MCP elicitation), and to interrupt the cell when the call is
cancelled. Cancelling a run only stops watching in the SDK, hence the explicit interrupt.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio

from kernelhub.agents.mcp_live import LiveOutput
from kernelhub.agents.tools import ToolRunner
from kernelhub.client import AsyncHub, AsyncSession, FileInfo
from kernelhub.client.errors import ApiError, NotFoundError, SessionEndedError
from kernelhub.errors import KernelhubError
from kernelhub.models import Event, Execution, ExecutionStatus, InputRequestEvent
from kernelhub.wire import SessionState, SnapshotInfo

__all__ = [
    "CALL",
    "AwaitingInput",
    "CallHooks",
    "Kernel",
    "Kernels",
    "LiveSession",
    "idle_handles",
]

DEFAULT_HANDLE_IDLE_TIMEOUT = 900.0
_INTERRUPT_TIMEOUT = 10.0
_SETTLE_TIMEOUT = 60.0
_UNSETTLED = (SessionState.STARTING, SessionState.BUSY, SessionState.RECOVERING)

InputAnswerer = Callable[[str], Awaitable[str]]


class AwaitingInput(KernelhubError):
    """Not a failure: the cell asks for input and the client cannot be asked (no
    elicitation), so the call returns, the cell keeps waiting, and ``answer_input``
    answers it. In the one tree so that nothing of kernelhub's raises outside it."""

    def __init__(self, execution_id: str, prompt: str, seq: int, output: str) -> None:
        super().__init__(execution_id, prompt)
        self.execution_id = execution_id
        self.prompt = prompt
        self.seq = seq
        self.output = output


@dataclass
class CallHooks:
    """What one tool call wants done with the events of the cells it runs."""

    live: LiveOutput
    on_input: InputAnswerer | None = None
    executions: list[str] = field(default_factory=list)
    finished: Execution | None = None

    def seen(self, event: Event) -> None:
        if event.execution_id not in self.executions:
            self.executions.append(event.execution_id)
        self.live.add(event)
        if isinstance(event, InputRequestEvent) and self.on_input is None:
            raise AwaitingInput(
                event.execution_id, event.prompt, event.seq, "".join(self.live.seen)
            )

    async def interrupt(self, session: AsyncSession) -> None:
        """Interrupt this call's cells; shielded, because it runs as the call is cancelled."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_INTERRUPT_TIMEOUT):
            for execution_id in self.executions:
                with contextlib.suppress(ApiError):
                    await session.interrupt(execution_id)


CALL: ContextVar[CallHooks | None] = ContextVar("kernelhub_mcp_call", default=None)


class LiveSession:
    """An :class:`AsyncSession` as the tool runner sees it, wired to the current call."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> Execution:
        hooks = CALL.get()
        if hooks is None:
            return await self.session.run(code, timeout=timeout, on_event=on_event)

        def seen(event: Event) -> None:
            if on_event is not None:
                on_event(event)
            hooks.seen(event)

        try:
            execution = await self.session.run(
                code, timeout=timeout, on_event=seen, on_input=hooks.on_input
            )
        except anyio.get_cancelled_exc_class():
            await hooks.interrupt(self.session)
            raise
        hooks.finished = execution
        return execution

    async def upload(self, path: str, data: bytes) -> FileInfo:
        return await self.session.upload(path, data)

    async def download(self, path: str) -> bytes:
        return await self.session.download(path)

    async def interrupt(self, execution_id: str) -> None:
        await self.session.interrupt(execution_id)

    async def snapshot(self) -> SnapshotInfo:
        return await self.session.snapshot()


@dataclass
class Kernel:
    """One kernelhub session serving MCP calls; ``handle`` is what stateless clients pass."""

    session: AsyncSession
    runner: ToolRunner
    principal: str = field(repr=False)  # the caller's token, or "" for the server's own
    last_used: float = 0.0
    pending: AwaitingInput | None = None
    busy: int = 0

    @property
    def handle(self) -> str:
        return self.session.id


def idle_handles(last_used: dict[str, float], now: float, idle_timeout: float | None) -> list[str]:
    """The handles unused for ``idle_timeout`` seconds (None: never expire)."""
    if idle_timeout is None:
        return []
    return sorted(h for h, used in last_used.items() if now - used >= idle_timeout)


async def _delete(session: AsyncSession) -> None:
    with contextlib.suppress(NotFoundError, SessionEndedError):
        await session.delete()


class Kernels:
    """Creates the kernels, keeps the handle ones, expires idle handles.

    Connection kernels are owned by their MCP connection (deleted at its teardown);
    handle kernels live here until ``idle_timeout`` seconds without a call, or
    :meth:`close`.
    """

    def __init__(
        self,
        hub: AsyncHub,
        *,
        runner_options: dict[str, Any],
        session_options: dict[str, Any] | None = None,
        idle_timeout: float | None = DEFAULT_HANDLE_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hub = hub
        self.runner_options = runner_options
        self.session_options = session_options or {}
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.handles: dict[tuple[str, str], Kernel] = {}
        self.hubs: dict[str, AsyncHub] = {}
        self.expired: set[tuple[str, str]] = set()

    def _hub(self, principal: str) -> AsyncHub:
        """The server's hub, or one of the caller's own token (HTTP with token auth), so
        the caller's sessions are the caller's, not the server's."""
        if not principal:
            return self.hub
        if principal not in self.hubs:
            self.hubs[principal] = AsyncHub(self.hub.base_url, principal)
        return self.hubs[principal]

    async def create(self, principal: str) -> Kernel:
        session = await self._hub(principal).create_session(**self.session_options)
        runner = ToolRunner(LiveSession(session), **self.runner_options)
        return Kernel(session, runner, principal, self.clock())

    def keep(self, kernel: Kernel) -> None:
        self.handles[(kernel.principal, kernel.handle)] = kernel

    def get(self, principal: str, handle: str) -> Kernel | None:
        kernel = self.handles.get((principal, handle))
        if kernel is not None:
            kernel.last_used = self.clock()
        return kernel

    def of(self, principal: str) -> list[Kernel]:
        return [k for (p, _), k in self.handles.items() if p == principal]

    async def forget(self, kernel: Kernel) -> None:
        self.handles.pop((kernel.principal, kernel.handle), None)
        await _delete(kernel.session)

    async def expire(self) -> list[str]:
        """Delete the handle kernels idle for too long; returns their handles."""
        idle = idle_handles(
            {f"{p}\0{h}": k.last_used for (p, h), k in self.handles.items() if not k.busy},
            self.clock(),
            self.idle_timeout,
        )
        gone = []
        for key in idle:
            principal, handle = key.split("\0", 1)
            kernel = self.handles.pop((principal, handle), None)
            if kernel is not None:
                self.expired.add((principal, handle))
                gone.append(handle)
                await _delete(kernel.session)
        return gone

    async def reap(self) -> None:
        """Expire idle handles until cancelled (the server's lifetime)."""
        if self.idle_timeout is None:
            return
        while True:
            await anyio.sleep(min(self.idle_timeout / 4, 30.0))
            await self.expire()

    async def close(self) -> None:
        for kernel in list(self.handles.values()):
            await _delete(kernel.session)
        self.handles.clear()
        for hub in self.hubs.values():
            await hub.close()
        self.hubs.clear()


async def settle(kernel: Kernel) -> str:
    """After a cell whose kernel died: wait until kernelhub has recovered the session (a
    checkpointed session comes back) or given it up, and say which, for the model."""
    deadline = anyio.current_time() + _SETTLE_TIMEOUT
    info = kernel.session.last_info
    state = info.state
    while anyio.current_time() < deadline:
        try:
            info = await kernel.session.info()
            state = info.state
        except (NotFoundError, SessionEndedError):
            state = SessionState.DEAD
        if state not in _UNSETTLED:
            break
        await anyio.sleep(0.2)
    if state in (SessionState.READY, SessionState.HIBERNATED):
        # What came back and what was lost, as the session's info says it.
        what = f" ({info.recovery.message})" if info.recovery is not None else ""
        return (
            f"[kernel] the kernel died and kernelhub recovered the session{what}; variables "
            "are as of its last checkpoint (if it has none, they are gone: re-run imports); "
            "the next call works as usual"
        )
    return (
        "[kernel] the kernel died; the next call runs in a fresh session (variables and "
        "imports are gone; re-run what you need)"
    )


def died(hooks: CallHooks) -> bool:
    return hooks.finished is not None and hooks.finished.record.status == (
        ExecutionStatus.KERNEL_DIED
    )
