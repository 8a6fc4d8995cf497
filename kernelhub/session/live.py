"""One live session: what the gateway holds in memory for each session it serves.

Its lifecycle phase (moved only through :func:`kernelhub.session.state.advance`), its
kernel, one :class:`InFlight` record per execution submitted and not finished, its
checkpoints, and its fan-out (the store writer and live subscribers of its events). The
state clients see is :attr:`LiveSession.state`, derived by the state machine and nowhere
else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernelhub.config import EngineSettings, Limits
from kernelhub.execution.engine import KernelSession
from kernelhub.models import Event, ExecutionStatus
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec
from kernelhub.session import state as machine
from kernelhub.session.fanout import SessionFanout
from kernelhub.session.state import Operation, SessionState, Transition, Verdict
from kernelhub.store.records import Principal, StoredExecution, StoredSession
from kernelhub.wire import ExecutionInfo, SessionInfo


@dataclass
class InFlight:
    """An execution submitted and not finished: who asked, what, from where (its audit
    entry is written from this once its final record is stored)."""

    principal: str
    code: str
    client: str | None = None


@dataclass
class LiveSession:
    stored: StoredSession
    limits: Limits
    fanout: SessionFanout
    kernel: KernelSession | None = None
    phase: SessionState = SessionState.STARTING
    reason: str | None = None
    inflight: dict[str, InFlight] = field(default_factory=dict)  # by execution id
    last_active: float = field(default_factory=time.monotonic)
    recover_crashed: bool = False  # KERNELHUB_GATEWAY__RECOVER_CRASHED
    # Whether a death now would be revived (the manager's SessionRecovery.will_revive,
    # which knows the crash-loop limit); unset, recover_crashed alone decides.
    revives: Callable[[LiveSession], bool] | None = None
    checkpoint_policy: str | float = "off"
    since_checkpoint: list[str] = field(default_factory=list)  # executions after the last one
    unchanged_execution: str | None = None  # the last cell covered without a capture
    # (execution count after which it was taken, directory in the sandbox), oldest first
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    last_checkpoint_at: float = 0.0
    # The automatic checkpoint armed after the last cell (``session.checkpoints``): its
    # timer, the execution count it is to be after, and a counter that cancels a queued one.
    checkpoint_due: asyncio.TimerHandle | None = None
    checkpoint_count: int | None = None
    checkpoint_epoch: int = 0
    hibernation: str | None = None  # the snapshot a hibernated session wakes from
    standby: asyncio.Task[KernelSession] | None = None  # hibernated: its sandbox to wake into
    warm: bool = False  # its sandbox came from the warm pool
    hibernating: bool = False  # its sandbox is being removed for hibernation
    wake_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.stored.id

    @property
    def recoverable(self) -> bool:
        """Whether a crash of its kernel brings it back (from its last checkpoint, or
        empty: see ``session.recovery``)."""
        return self.revives(self) if self.revives is not None else self.recover_crashed

    @property
    def state(self) -> SessionState:
        kernel = self.kernel
        return machine.observe(
            self.phase,
            alive=kernel is not None and kernel.alive,
            paused=kernel is not None and kernel.paused,
            # The automatic checkpoint after each cell never makes a session read busy.
            running=kernel is not None and kernel.user_busy,
            recoverable=self.recoverable,
            hibernating=self.hibernating,
        )

    def move(self, transition: Transition) -> SessionState:
        self.phase = machine.advance(self.phase, transition)
        return self.phase

    def allows(self, operation: Operation) -> Verdict:
        """What ``operation`` does now (see :func:`state.check`, which raises refusals)."""
        return machine.check(self.id, self.state, operation, self.reason)

    def ready_kernel(self, operation: Operation = Operation.EXECUTE) -> KernelSession | None:
        """The kernel, if ``operation`` may use it right now (no wake-up, no recovery to
        wait for); None if it must wait; the state machine's refusal otherwise."""
        if self.allows(operation) is Verdict.RUN:
            return self.kernel
        return None

    def finished(self, execution_id: str) -> None:
        """An execution's final event: the session is active, and (with checkpoints) the
        execution's effects are not in a checkpoint yet."""
        self.last_active = time.monotonic()
        if execution_id == self.unchanged_execution:
            return  # covered by the last checkpoint already (Checkpoints._covered)
        if self.checkpoints or self.checkpoint_policy != "off":
            self.since_checkpoint.append(execution_id)

    def idle_for(self, seconds: float) -> bool:
        """Idle (ready, nothing queued) for at least ``seconds``: a hibernation candidate."""
        kernel = self.kernel
        return (
            self.state == SessionState.READY
            and kernel is not None
            and kernel.queue_length == 0
            and time.monotonic() - self.last_active >= seconds
        )

    def info(self, last_seq: int, stored_bytes: int) -> SessionInfo:
        info = session_info(self.stored, self.state, self.reason, last_seq, warm=self.warm)
        info.stored_bytes = stored_bytes  # live, not as stored
        info.checkpoint_after_cell = self.checkpoints[-1][0] if self.checkpoints else None
        running = self.kernel.running if self.kernel else None
        if running is not None and running.status == ExecutionStatus.AWAITING_INPUT:
            info.awaiting_input = running.id  # a human gate: the review page flags it
        return info


def held(
    sessions: dict[str, LiveSession], principal: Principal, session_id: str
) -> LiveSession | None:
    """The caller's live session, if this process holds it (an admin's: anyone's)."""
    live = sessions.get(session_id)
    if live is not None and (live.stored.owner == principal.name or principal.admin):
        return live
    return None


def session_info(
    s: StoredSession, state: SessionState, reason: str | None, last_seq: int, *, warm: bool = False
) -> SessionInfo:
    """A session as clients get it."""
    limits = dict(s.limits)
    limits["disk_bytes"] = limits.pop("workspace_bytes", None)
    return SessionInfo(
        id=s.id,
        owner=s.owner,
        state=state,
        backend=s.backend,
        created_at=s.created_at,
        limits=limits,
        metadata=s.metadata,
        last_seq=last_seq,
        reason=reason,
        warm=warm,
        stored_bytes=s.stored_bytes,
    )


class SessionTable(dict[str, LiveSession]):
    """The live sessions by id (a plain dict to every reader), also indexed by owner:
    the storage guard sums one owner's reservations on every cell submitted, and a scan
    of every session made that O(sessions) per cell (3% of the gateway's loop at 50
    sessions). Written only through ``table[id] = live``, ``del`` and ``pop``; an owner
    never changes."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: dict[str, dict[str, LiveSession]] = {}

    def __setitem__(self, session_id: str, live: LiveSession) -> None:
        old = self.get(session_id)
        if old is not None:
            self._unindex(session_id, old)
        super().__setitem__(session_id, live)
        self.by_owner.setdefault(live.stored.owner, {})[session_id] = live

    def __delitem__(self, session_id: str) -> None:
        live = self[session_id]
        super().__delitem__(session_id)
        self._unindex(session_id, live)

    def pop(self, session_id: str, *default: Any) -> Any:
        live = self.get(session_id)
        if live is None:
            return super().pop(session_id, *default)
        del self[session_id]
        return live

    def _unindex(self, session_id: str, live: LiveSession) -> None:
        mine = self.by_owner.get(live.stored.owner)
        if mine is not None:
            mine.pop(session_id, None)
            if not mine:
                del self.by_owner[live.stored.owner]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("SessionTable is written through [id] = live, del and pop only")

    update = setdefault = popitem = clear = __ior__ = _refuse


def in_flight_bytes(sessions: Mapping[str, LiveSession], owner: str) -> int:
    """What ``owner``'s running and queued cells may still store: each its output cap (the
    storage quota reserves it, so queued cells cannot overshoot the quota)."""
    if isinstance(sessions, SessionTable):
        sessions = sessions.by_owner.get(owner, {})
    total = 0
    for live in sessions.values():
        kernel = live.kernel
        if kernel is not None and live.stored.owner == owner:
            # A checkpoint after a cell stores no output: counted, it kept the next
            # cell of a principal near its quota waiting on a 507 for its duration.
            total += kernel.user_cells * live.limits.output_bytes
    return total


async def start_kernel(
    live: LiveSession, backend: SandboxBackend, engine: EngineSettings, first_seq: int
) -> KernelSession:
    """A fresh sandbox and kernel for an existing session (recovery, the hibernation
    standby), numbered on from ``first_seq``, in its tier's runtime: the one it was
    created with, after a gateway restart too."""
    spec = SandboxSpec(
        session_id=live.id, owner=live.stored.owner, limits=live.limits, runtime=live.stored.runtime
    )
    return await KernelSession.start(backend, spec, engine=engine, first_seq=first_seq)


def execution_info(row: StoredExecution, events: list[Event] | None) -> ExecutionInfo:
    """An execution as clients get it (REST, batch results)."""
    return ExecutionInfo(
        id=row.id,
        session_id=row.session_id,
        status=row.status,
        code=row.code,
        created_at=row.created_at,
        record=row.record,
        events=events,
    )
