"""Crash recovery: a session whose kernel died is never left dead.

Out of memory, a segfault, ``os._exit`` from a cell, any death of the kernel: the session
gets a fresh sandbox at once, restored from its last checkpoint (they live in the
session's state directory, which outlives sandboxes), or empty when it has none or the
checkpoint would not load. Either way the stream gets a notice and the session's info a
:class:`~kernelhub.wire.RecoveryInfo` that say what happened and which executions'
effects were lost. Only a session that keeps dying (``crash_loop_limit`` deaths within
``crash_loop_window`` seconds), or an operator who turned recovery off
(``KERNELHUB_GATEWAY__RECOVER_CRASHED=false``), ends dead.

The manager's watcher calls :meth:`SessionRecovery.revive` when a sandbox exits on its
own; requests that arrive meanwhile wait for it (the manager asks :meth:`will_revive`).
:func:`plan` is the decision, pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from kernelhub.config import Settings
from kernelhub.errors import KernelhubError
from kernelhub.execution import ops
from kernelhub.execution.engine import KernelSession
from kernelhub.models import NoticeEvent
from kernelhub.sandbox.base import SandboxBackend
from kernelhub.session.live import LiveSession, start_kernel
from kernelhub.session.recorder import Recorder
from kernelhub.session.state import SessionState, Transition
from kernelhub.snapshot import calls
from kernelhub.store.base import Store
from kernelhub.store.records import AuditEntry
from kernelhub.wire import RecoveryInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What to do about a kernel that died: restore a checkpoint, restart empty, or give
    the session up (``why`` says why, for its reason)."""

    kind: Literal["checkpoint", "empty", "dead"]
    why: str = ""


def plan(
    *, enabled: bool, checkpoints: int, deaths: list[float], now: float, limit: int, window: float
) -> Plan:
    """``deaths``: monotonic times of this session's kernel deaths, this one included."""
    if not enabled:
        return Plan("dead", "recovery is off (KERNELHUB_GATEWAY__RECOVER_CRASHED)")
    recent = [t for t in deaths if now - t <= window]
    if len(recent) >= limit:
        return Plan(
            "dead",
            f"the kernel died {len(recent)} times within {window:g} s, so it is not revived "
            "again (KERNELHUB_GATEWAY__CRASH_LOOP_LIMIT, KERNELHUB_GATEWAY__CRASH_LOOP_WINDOW)",
        )
    return Plan("checkpoint" if checkpoints else "empty")


def describe(
    reason: str,
    duration: float,
    after: int | None,
    lost: list[str],
    not_restored: dict[str, str],
    why_empty: str | None,
    *,
    cause: str | None = None,
    where: str = "in a fresh sandbox",
) -> str:
    """The notice: what happened (``cause``; by default, the kernel died of ``reason``),
    what came back ``where``, what was lost."""
    cause = cause or f"the kernel died ({reason})"
    if after is not None:
        text = (
            f"{cause}; recovered in {duration:.2f} s {where} "
            f"from the checkpoint after cell {after} (variables and /workspace as they were then)"
        )
        if lost:
            text += f"; the effects of these executions were lost: {', '.join(lost)}"
        if not_restored:
            text += f"; not restored: {not_restored}"
        return text
    text = f"{cause}; restarted empty in {duration:.2f} s {where}"
    text += f" ({why_empty})" if why_empty else ""
    text += ": every variable, import and file of /workspace is gone"
    if lost:
        text += f"; executions since the last checkpoint: {', '.join(lost)}"
    return text


class SessionRecovery:
    """Brings sessions whose kernel died back (see the module). One per manager."""

    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: Store,
        recorder: Recorder,
        *,
        bind: Callable[[LiveSession, KernelSession], None],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store  # read only: the recorder writes
        self.recorder = recorder
        self._bind = bind
        self._deaths: dict[str, list[float]] = {}
        self._last: dict[str, RecoveryInfo] = {}
        self._reviving: set[str] = set()  # a kernel started by a revival may die too

    def last(self, session_id: str) -> RecoveryInfo | None:
        return self._last.get(session_id)

    def remember(self, session_id: str, info: RecoveryInfo) -> None:
        """A recovery made elsewhere (a lost node's session adopted here), for its info."""
        self._last[session_id] = info

    def forget(self, session_id: str) -> None:
        self._deaths.pop(session_id, None)
        self._last.pop(session_id, None)

    def will_revive(self, live: LiveSession) -> bool:
        """Whether a death now would be recovered (requests wait for it, info says
        ``starting``), rather than end the session."""
        g = self.settings.gateway
        return (
            plan(
                enabled=g.recover_crashed,
                checkpoints=len(live.checkpoints),
                deaths=[*self._deaths.get(live.id, []), time.monotonic()],
                now=time.monotonic(),
                limit=g.crash_loop_limit,
                window=g.crash_loop_window,
            ).kind
            != "dead"
        )

    async def revive(self, live: LiveSession, dead: KernelSession, reason: str) -> str | None:
        """Bring the session back after its kernel died of ``reason``. None when it is
        back (ready, a notice sent), or already being brought back; else why it was not,
        for its dead reason."""
        if live.id in self._reviving:
            return None  # the revival under way sees this death as its own failure
        self._reviving.add(live.id)
        try:
            given_up = await self._revive(live, dead, reason)
        except BaseException:
            given_up = "recovery failed"
            raise
        finally:
            self._reviving.discard(live.id)
            if given_up is not None and live.phase == SessionState.RECOVERING:
                # Given up midway: the checkpoints go with the session (it ends dead).
                with contextlib.suppress(KernelhubError):
                    await self.backend.drop_state(live.id)
        return given_up

    async def _revive(self, live: LiveSession, dead: KernelSession, reason: str) -> str | None:
        g = self.settings.gateway
        now = time.monotonic()
        deaths = [t for t in self._deaths.get(live.id, []) if now - t <= g.crash_loop_window]
        deaths.append(now)
        self._deaths[live.id] = deaths
        decided = plan(
            enabled=g.recover_crashed,
            checkpoints=len(live.checkpoints),
            deaths=deaths,
            now=now,
            limit=g.crash_loop_limit,
            window=g.crash_loop_window,
        )
        if decided.kind == "dead":
            return decided.why
        await final_out(dead)
        live.move(Transition.CRASHED)
        saved = list(live.checkpoints)
        lost = list(live.since_checkpoint)
        await dead.close(keep_state=True)
        why_empty: str | None = "the session had no checkpoint" if not saved else None
        after: int | None = None
        not_restored: dict[str, str] = {}
        try:
            kernel = await self._start(live, dead.last_seq)
        except KernelhubError as exc:
            return f"a fresh sandbox failed to start: {exc}"
        if saved:
            try:
                not_restored = await self._restore(kernel, saved[-1][1])
                after = saved[-1][0]
                live.checkpoints = saved
            except KernelhubError as exc:
                # A checkpoint that kills or breaks the new kernel: start over, empty.
                log.warning("session %s: restoring its checkpoint failed: %s", live.id, exc)
                why_empty = f"restoring the checkpoint after cell {saved[-1][0]} failed: {exc}"
                live.kernel = None
                await kernel.close(keep_state=True)
                try:
                    kernel = await self._start(live, kernel.last_seq)
                except KernelhubError as exc2:
                    return f"a fresh sandbox failed to start: {exc2}"
        live.since_checkpoint = []
        live.move(Transition.RECOVERED)
        duration = time.monotonic() - now
        message = describe(reason, duration, after, lost, not_restored, why_empty)
        self._last[live.id] = RecoveryInfo(
            at=datetime.now(UTC),
            reason=reason,
            checkpoint_after_cell=after,
            lost=lost,
            not_restored=not_restored,
            duration=duration,
            message=message,
        )
        recovered_notice(kernel, message)
        await self.recorder.phase(live, reason=f"recovered: {reason}")
        await self.recorder.audit(
            AuditEntry(
                principal=None,
                action="session.recover",
                session_id=live.id,
                duration=duration,
                detail={"reason": reason, "checkpoint_after_cell": after, "lost": lost},
            )
        )
        return None

    async def _start(self, live: LiveSession, first_seq: int) -> KernelSession:
        kernel = await start_kernel(live, self.backend, self.settings.engine, first_seq)
        self._bind(live, kernel)
        return kernel

    async def _restore(self, kernel: KernelSession, directory: str) -> dict[str, str]:
        result = await ops.run(
            kernel, calls.restore(directory), timeout=self.settings.gateway.snapshot_timeout
        )
        return {str(k): str(v) for k, v in dict(result.get("failed", {})).items()}


async def final_out(dead: KernelSession) -> None:
    """Let the dead kernel's running cell end (its ``kernel_died`` final record is emitted
    from the engine's own task) before the kernel is closed; at most 3 s."""
    for _ in range(300):
        if dead.running is None:
            break
        await asyncio.sleep(0.01)


def recovered_notice(kernel: KernelSession, message: str) -> None:
    """The stream's word that the session came back in a fresh sandbox."""
    kernel.publish(
        NoticeEvent(execution_id="", seq=kernel.next_seq(), message=message, kind="recovered")
    )
