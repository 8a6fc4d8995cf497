"""A cell's timeout: a clock that stops while the sandbox is frozen, and the escalation.

Timeouts escalate: SIGINT → ``interrupt_grace`` → restart the kernel (variables lost,
files kept) → ``restart_grace`` → kill the sandbox. :class:`Escalation` returns which
step ended the cell and whether state was lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kernelhub.config import EngineSettings
from kernelhub.errors import KernelhubError
from kernelhub.execution.handle import ExecutionHandle
from kernelhub.models import EndedBy
from kernelhub.sandbox.base import Sandbox

log = logging.getLogger(__name__)


class PauseGate:
    """Whether the sandbox is frozen, and futures that resolve at the next transition."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.paused = False
        self._since: float | None = None
        # Resolved when the session is paused / resumed; replaced at each transition.
        self.pause_signal: asyncio.Future[None] = loop.create_future()
        self.resume_signal: asyncio.Future[None] = loop.create_future()

    def pause(self) -> None:
        self.paused = True
        self._since = time.monotonic()
        self.resume_signal = asyncio.get_running_loop().create_future()
        self.pause_signal.set_result(None)

    def resume(self) -> float:
        """Unfreeze; returns the seconds the sandbox was frozen."""
        paused_for = time.monotonic() - (self._since or time.monotonic())
        self.paused = False
        self._since = None
        self.pause_signal = asyncio.get_running_loop().create_future()
        self.resume_signal.set_result(None)
        return paused_for


async def wait_running(
    done: asyncio.Future[None], handle: ExecutionHandle, gate: PauseGate
) -> None:
    """Wait for the cell; TimeoutError once it has *run* for its timeout. Paused time
    does not count, and a frozen sandbox is never interrupted. (Plain futures only:
    this runs for every cell, and tasks would cost more than the cell itself.)"""
    started = time.monotonic()
    while True:
        if gate.paused:
            await asyncio.wait({done, gate.resume_signal}, return_when=asyncio.FIRST_COMPLETED)
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
            {done, gate.pause_signal}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
        )
        if done.done():
            return done.result()
        if not finished and not gate.paused:
            raise TimeoutError


class Escalation:
    """Ends a cell that ran out of time. ``notice`` tells the cell's watchers what is
    about to happen; ``restart`` restarts the kernel; ``dead()`` says whether the kernel
    already died (then there is nothing left to escalate)."""

    def __init__(
        self,
        sandbox: Sandbox,
        engine: EngineSettings,
        *,
        notice: Callable[[str, ExecutionHandle], None],
        restart: Callable[[], Awaitable[None]],
        dead: Callable[[], bool],
    ) -> None:
        self.sandbox = sandbox
        self.engine = engine
        self._notice = notice
        self._restart = restart
        self._dead = dead

    async def run(
        self, done: asyncio.Future[None], handle: ExecutionHandle
    ) -> tuple[EndedBy, bool]:
        """Interrupt → restart the kernel → kill the sandbox, each step given its grace.
        Returns ``(ended_by, state_lost)``; after ``EndedBy.KILL`` the sandbox is gone."""
        try:
            handle.interrupt_sent = True
            await self.sandbox.interrupt()
            await asyncio.wait_for(asyncio.shield(done), self.engine.interrupt_grace)
            return EndedBy.INTERRUPT, False
        except TimeoutError:
            pass
        except KernelhubError:
            if self._dead():
                return EndedBy.KERNEL_DEATH, True
        self._notice(
            "cell ignored the interrupt; restarting the kernel (variables are lost, files are kept)",
            handle,
        )
        try:
            await asyncio.wait_for(self._restart(), self.engine.restart_grace)
            return EndedBy.RESTART, True
        except (TimeoutError, KernelhubError) as exc:
            log.warning("kernel restart failed (%s); killing the sandbox", exc)
        self._notice("kernel restart failed; the sandbox was killed", handle)
        await self.sandbox.kill()
        return EndedBy.KILL, True


class AnswerDeadline:
    """How long a cell's ``input()`` waits for a human before the deadline answers for them
    (``limits.input_timeout``; ``None`` waits for ever). One timer per kernel: a new
    request, a pause or an answer replaces or cancels the previous one."""

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None

    def start(
        self,
        timeout: float | None,
        expired: Callable[[ExecutionHandle, float], None],
        handle: ExecutionHandle,
    ) -> None:
        self.cancel()
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(
                timeout, self._fire, expired, handle, timeout
            )

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(
        self,
        expired: Callable[[ExecutionHandle, float], None],
        handle: ExecutionHandle,
        timeout: float,
    ) -> None:
        self._timer = None
        expired(handle, timeout)
