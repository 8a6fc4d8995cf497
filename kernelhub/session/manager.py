"""The session manager: the gateway's single owner of every live session.

It enforces ownership (someone else's session is indistinguishable from a missing one),
quotas (sessions, queued cells, the host memory budget), persistence (every event to the
store, every finished execution and every action to the audit log), and, at start-up,
re-adopts sandboxes that outlived a previous gateway process and removes the orphans.
Snapshots, checkpoints, rewind, crash recovery and hibernation come from its
:class:`~kernelhub.session.continuity.Continuity` base; new sessions take sandboxes from
the warm pool (:mod:`kernelhub.session.pool`) when it has one ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import psutil

from kernelhub.config import Limits, Settings
from kernelhub.errors import (
    InvalidRequestError,
    KernelhubError,
    NotFoundError,
    QuotaError,
    SessionClosedError,
    SessionError,
)
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.models import (
    EndedBy,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    NoticeEvent,
)
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec
from kernelhub.session.continuity import Continuity
from kernelhub.session.fanout import SessionFanout
from kernelhub.session.pool import WarmPool
from kernelhub.session.recovery import SessionRecovery, final_out
from kernelhub.session.salvage import CellSalvage, open_spool
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.quota import StorageGuard
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sqlite import (
    AuditEntry,
    Principal,
    SqliteStore,
    StoredExecution,
    StoredSession,
    StoreError,
)
from kernelhub.wire import (
    ExecutionCreate,
    ExecutionInfo,
    LimitsIn,
    SessionCreate,
    SessionInfo,
    SessionState,
)

log = logging.getLogger(__name__)
# A cell's final event and its record (two writes), maybe its last output, and what may
# have waited for them (its row, its running and result events: coalesce_window): a
# commit this small is one cell finishing alone, and its client should not wait for the
# turn to end.
_LONE_FINAL_OPS = 8


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


@dataclass
class LiveSession:
    stored: StoredSession
    limits: Limits
    fanout: SessionFanout
    kernel: KernelSession | None = None
    state: SessionState = SessionState.STARTING
    reason: str | None = None
    clients: dict[str, str] = field(default_factory=dict)  # execution id -> client address
    principals: dict[str, str] = field(default_factory=dict)  # execution id -> principal
    codes: dict[str, str] = field(default_factory=dict)  # running execution id -> code
    last_active: float = field(default_factory=time.monotonic)
    checkpoint_policy: str | float = "off"
    since_checkpoint: list[str] = field(default_factory=list)  # executions after the last one
    # (execution count after which it was taken, directory in the sandbox), oldest first
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    last_checkpoint_at: float = 0.0
    hibernation: str | None = None  # the snapshot a hibernated session wakes from
    standby: asyncio.Task[KernelSession] | None = None  # its empty sandbox, to wake into
    warm: bool = False  # its sandbox came from the warm pool
    wake_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.stored.id


@dataclass
class Observer:
    """Hooks the gateway's metrics attach to (all optional, all synchronous)."""

    on_start: Callable[[float], None] = lambda seconds: None
    on_final: Callable[[ExecutionRecord], None] = lambda record: None


class SessionManager(Continuity):
    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: SqliteStore,
        observer: Observer | None = None,
    ) -> None:
        # The store is the record of finished executions; engines keep none in memory.
        self.settings = settings.model_copy(
            update={"engine": settings.engine.model_copy(update={"retain_finished": 0})}
        )
        self.backend = backend
        self.store = store
        self.observer = observer or Observer()
        self.sessions: dict[str, LiveSession] = {}
        self._recent_records: OrderedDict[str, ExecutionRecord] = OrderedDict()
        self._settled: dict[str, asyncio.Future[None]] = {}
        # New rows not committed yet, with what to do once they are (see when_stored).
        self._storing: dict[str, list[Callable[[], None]]] = {}
        self.blobs = BlobStore(settings.data_dir)
        self.storage = StorageGuard(settings.storage, store.ledger, settings.data_dir)
        self.retention = RetentionSweeper(store, self.blobs, settings.storage, self._purged)
        self._tasks: set[asyncio.Task[None]] = set()
        budget = settings.gateway.memory_budget_bytes
        self.memory_budget = (
            budget if budget is not None else int(psutil.virtual_memory().total * 0.8)
        )
        self.pool = WarmPool(
            backend, settings.pool, settings.limits, self.settings.engine, room=self._pool_room
        )
        self.recovery = SessionRecovery(self.settings, backend, store, self._bind)

    # -- start-up and shutdown ---------------------------------------------------------

    async def start(self) -> None:
        """Re-adopt sandboxes a previous process left running; report the rest dead;
        remove orphans."""
        for stored in await self.store.list_sessions():
            if stored.state in (SessionState.DEAD, SessionState.DELETED):
                continue
            limits = Limits(**stored.limits)
            live = LiveSession(stored=stored, limits=limits, fanout=self._fanout(stored.id))
            self.sessions[stored.id] = live
            if stored.state == SessionState.HIBERNATED and (stored.reason or "").startswith(
                "hibernation:"
            ):
                live.state = SessionState.HIBERNATED
                live.hibernation = (stored.reason or "").split(":", 1)[1]
                continue
            spec = SandboxSpec(session_id=stored.id, owner=stored.owner, limits=limits)
            sandbox = None
            with contextlib.suppress(KernelhubError):
                sandbox = await self.backend.adopt(spec)
            last_seq = await self.store.last_seq(stored.id)
            if sandbox is None:
                await self._mark_dead(live, "the sandbox did not survive the gateway restart")
                await self._finish_orphaned_executions(
                    live, last_seq, "the sandbox was lost when the gateway restarted"
                )
                continue
            try:
                kernel = await KernelSession.attach(
                    sandbox, engine=self.settings.engine, first_seq=last_seq
                )
            except KernelhubError as exc:
                await sandbox.remove()
                await self._mark_dead(
                    live, f"could not reconnect after the gateway restarted: {exc}"
                )
                continue
            spooled = open_spool(kernel)  # before the loop runs the kernel's pumps
            self._bind(live, kernel)
            live.state = SessionState.READY
            await self.store.update_session(stored.id, state=live.state.value)
            await self._finish_orphaned_executions(live, last_seq, None, spooled)
            await self.store.audit(
                AuditEntry(principal=None, action="session.adopt", session_id=stored.id)
            )
            log.info("re-adopted session %s", stored.id)
        await self.backend.reap_orphans()
        self.pool.start()  # after the reap, which would take its sandboxes for orphans
        self._spawn(self._hibernate_idle())
        self._spawn(self.retention.run())

    async def _finish_orphaned_executions(
        self,
        live: LiveSession,
        last_seq: int,
        lost: str | None,
        spooled: CellSalvage | None = None,
    ) -> None:
        """Executions the previous process never finished: say what became of them. The
        one the sandbox spooled is collected from there (``session.salvage``), in turn
        with the session's cells."""
        for e in await self.store.unfinished_executions(live.id):
            # The stored events say whether it had started (statuses are not written to
            # the row mid-flight: that would cost a transaction per cell).
            started = await self.store.has_started(e.id)
            if started and spooled is not None and live.kernel is not None and spooled.matches(e):
                salvage, spooled = spooled, None
                stored = await self.store.events_of(e.id)
                self._spawn(live.kernel.exclusive(partial(salvage.run, e, stored)))
                continue
            if not started:
                status, reason = (
                    ExecutionStatus.CANCELLED,
                    "the gateway restarted before this cell ran; submit it again",
                )
            else:
                status = ExecutionStatus.KERNEL_DIED if lost else ExecutionStatus.FAILED
                reason = lost or (
                    f"the gateway restarted while this cell ran; output after event {last_seq} "
                    "was not captured and the cell may still finish in the kernel"
                )
            now = datetime.now(UTC)
            seq = (live.kernel.last_seq if live.kernel else last_seq) + 1
            if live.kernel is not None:
                live.kernel._seq = seq  # the engine's counter stays ahead of what we write
            record = ExecutionRecord(
                execution_id=e.id,
                status=status,
                ended_by=EndedBy.KILL,
                state_lost=lost is not None,
                reason=reason,
                queued_at=e.created_at,
                finished_at=now,
            )
            live.fanout.publish(NoticeEvent(execution_id=e.id, seq=seq, message=reason))
            live.fanout.publish(FinalEvent(execution_id=e.id, seq=seq + 1, record=record))
            if live.kernel is not None:
                live.kernel._seq = seq + 1
            await self.store.update_execution(e.id, status, record)
        if spooled is not None:
            spooled.release()

    async def close(self) -> None:
        """Detach from every session without stopping its sandbox: a restarted gateway
        re-adopts them. (Use ``stop_all`` to stop sandboxes.)"""
        for task in list(self._tasks):
            task.cancel()
        await self.pool.close()
        for live in self.sessions.values():
            if live.kernel is not None:
                await live.kernel.detach()
            await live.fanout.close()

    # -- sessions ----------------------------------------------------------------------

    def _fanout(self, session_id: str) -> SessionFanout:
        return SessionFanout(
            session_id, self.store, quiet_wait=self.settings.gateway.coalesce_window
        )

    def resolve_limits(self, requested: LimitsIn) -> Limits:
        """The limits a session gets: the defaults, with what was asked for within the
        operator's maximum (``InvalidRequestError`` names the one above it)."""
        base = self.settings.limits
        cap = self.settings.gateway.max_limits
        values = base.model_dump()
        asked = {
            "memory_bytes": requested.memory_bytes,
            "cpus": requested.cpus,
            "pids": requested.pids,
            "workspace_bytes": requested.disk_bytes,
            "cell_timeout": requested.cell_timeout,
            "output_bytes": requested.output_bytes,
            "output_events": requested.output_events,
        }
        for name, value in asked.items():
            if value is None:
                continue
            most = getattr(cap, name)
            if most is not None and value > most:
                wire_name = "disk_bytes" if name == "workspace_bytes" else name
                raise InvalidRequestError(
                    f"limits.{wire_name}={value} is above the maximum {most}; ask for less"
                )
            values[name] = value
        return Limits(**values)

    async def create(
        self, principal: Principal, body: SessionCreate, client: str | None = None
    ) -> SessionInfo:
        limits = self.resolve_limits(body.limits)
        self.storage.check(principal.name)
        alive = self._alive()
        g = self.settings.gateway
        if len(alive) >= g.max_sessions:
            raise QuotaError(
                f"the gateway runs its maximum of {g.max_sessions} sessions; retry later",
                retry_after=10,
            )
        # Dead sessions hold no sandbox any more, but they count until deleted: a
        # principal cannot pile them up by crashing kernels.
        mine = [
            s
            for s in self.sessions.values()
            if s.stored.owner == principal.name and s.state != SessionState.DELETED
        ]
        if len(mine) >= g.max_sessions_per_principal:
            dead = sum(s.state == SessionState.DEAD for s in mine)
            raise QuotaError(
                f"you have {len(mine)} sessions ({dead} of them dead), the most allowed per "
                "token (KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL); delete one first "
                "(DELETE /v1/sessions/{id}, `kernelhub sessions rm`)",
                retry_after=10,
            )
        # Pooled sandboxes give way to sessions: they are not counted here, and a cold
        # start that needs their memory stops one (below).
        committed = sum(s.limits.memory_bytes for s in alive)
        if committed + limits.memory_bytes > self.memory_budget:
            raise QuotaError(
                "the host's memory budget is committed to other sessions; retry later or ask for less memory",
                retry_after=10,
            )
        if len(str(body.metadata)) > 16_384:
            raise InvalidRequestError("metadata is larger than 16 KiB; store less")
        t0 = time.monotonic()
        warm = self.pool.take(limits)
        stored = StoredSession(
            id=warm.sandbox.spec.session_id if warm else uuid.uuid4().hex[:16],
            owner=principal.name,
            backend=self.backend.name,
            state=(SessionState.READY if warm else SessionState.STARTING).value,
            created_at=datetime.now(UTC),
            limits=limits.model_dump(),
            metadata=dict(body.metadata),
            reason=None,
            deleted_at=None,
        )
        try:
            await self.store.insert_session(stored)
        except BaseException:
            if warm is not None:
                self.pool.discard(warm)
            raise
        live = LiveSession(
            stored=stored, limits=limits, fanout=self._fanout(stored.id), warm=warm is not None
        )
        policy = self.settings.gateway.checkpoints if body.checkpoints is None else body.checkpoints
        live.checkpoint_policy = policy if isinstance(policy, str) else float(policy)
        self.sessions[stored.id] = live
        try:
            if warm is not None:
                kernel = warm
            else:
                await self._make_room(limits)
                kernel = await KernelSession.start(
                    self.backend,
                    SandboxSpec(session_id=stored.id, owner=principal.name, limits=limits),
                    engine=self.settings.engine,
                )
        except KernelhubError as exc:
            await self._mark_dead(live, f"the sandbox failed to start: {exc}")
            await self.store.audit(
                AuditEntry(
                    principal=principal.name,
                    action="session.create",
                    session_id=stored.id,
                    status="failed",
                    client=client,
                    detail={"error": str(exc)},
                )
            )
            raise
        self.observer.on_start(time.monotonic() - t0)
        self._bind(live, kernel)
        report = None
        if body.from_snapshot is not None:
            try:
                report = await self._restore_into(principal, live, kernel, body.from_snapshot)
            except BaseException:
                await self.delete(principal, stored.id, client)
                raise
        live.state = SessionState.READY
        if warm is None:
            await self.store.update_session(stored.id, state=live.state.value)
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="session.create",
                session_id=stored.id,
                status="ok",
                client=client,
                duration=time.monotonic() - t0,
                detail={"warm": True} if warm else None,
            )
        )
        info = await self.info(principal, stored.id)
        return info.model_copy(update={"restore": report}) if report else info

    def _alive(self) -> list[LiveSession]:
        return [
            s
            for s in self.sessions.values()
            if s.state not in (SessionState.DEAD, SessionState.DELETED)
        ]

    def _pool_room(self) -> bool:
        """Whether one more pooled sandbox fits: never at the expense of a session."""
        alive = self._alive()
        if len(alive) + self.pool.held >= self.settings.gateway.max_sessions:
            return False
        committed = sum(s.limits.memory_bytes for s in alive) + self.pool.committed_bytes
        return committed + self.pool.limits.memory_bytes <= self.memory_budget

    async def _make_room(self, limits: Limits) -> None:
        """Stop pooled sandboxes whose memory a cold-started session needs."""
        committed = sum(s.limits.memory_bytes for s in self._alive())
        while committed + self.pool.committed_bytes + limits.memory_bytes > self.memory_budget:
            if not await self.pool.evict():
                break

    def _spawn(self, coro: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _bind(self, live: LiveSession, kernel: KernelSession) -> None:
        live.kernel = kernel
        live.checkpoints = []  # they live in the sandbox: a new sandbox has none
        kernel.after_cell = lambda handle: self._checkpoint(live, kernel, handle)
        kernel.add_listener(lambda event: self._on_event(live, event))
        self._spawn(self._watch(live, kernel))

    def _on_event(self, live: LiveSession, event: Event) -> None:
        live.fanout.publish(event)
        if isinstance(event, FinalEvent):
            live.last_active = time.monotonic()
            if live.checkpoints or live.checkpoint_policy != "off":
                live.since_checkpoint.append(event.execution_id)
            self._settled[event.execution_id] = asyncio.get_running_loop().create_future()
            self._recent_records[event.execution_id] = event.record
            while len(self._recent_records) > 1024:
                self._recent_records.popitem(last=False)
            self._finish(live, event.record)
            self.store.commit_now_if_small(_LONE_FINAL_OPS)
        elif isinstance(event, InputReplyEvent):
            # Who answered (a principal, or the deadline), when, and what.
            entry = AuditEntry(
                principal=event.answered_by,
                action="execution.input",
                session_id=live.id,
                execution_id=event.execution_id,
                detail={"value": event.value, "password": event.password},
            )
            self._spawn(self.store.audit(entry))

    def _finish(self, live: LiveSession, record: ExecutionRecord) -> None:
        """Store the final record and its audit entry, never before the final event.
        Usually the final event has just joined this loop turn's commit, and the record
        joins it too: one commit, no task. Otherwise (its rows held back behind a slow or
        failed commit, or the code known only to the store after a restart) a task waits
        for the event to be stored first."""
        code = live.codes.pop(record.execution_id, None)
        if code is None or not live.fanout.joins_this_commit():
            self._spawn(self._finished(live, record, code))
            return
        done = self.store.finish_execution_soon(record, self._audit_final(live, record, code))
        done.add_done_callback(
            lambda fut: self._settle(
                record, StoreError("the store closed") if fut.cancelled() else fut.exception()
            )
        )

    async def _finished(self, live: LiveSession, record: ExecutionRecord, code: str | None) -> None:
        error: BaseException | None = StoreError("stopped before the record was stored")
        try:
            await live.fanout.flush()
            if code is None:  # adopted after a restart: the code is only in the store
                stored = await self.store.get_execution(record.execution_id)
                code = stored.code if stored else None
            await self.store.finish_execution(record, self._audit_final(live, record, code))
            error = None
        except Exception as exc:
            error = exc
        finally:
            self._settle(record, error)

    def _settle(self, record: ExecutionRecord, error: BaseException | None) -> None:
        if error is None:
            self.observer.on_final(record)
        else:
            log.error("storing execution %s failed: %s", record.execution_id, error)
        settled = self._settled.pop(record.execution_id, None)
        if settled is not None and not settled.done():
            settled.set_result(None)

    async def settled(self, execution_id: str) -> None:
        """Wait until a finished execution's events and record are committed to the store
        (so an answer given now survives a crash of the gateway)."""
        fut = self._settled.get(execution_id)
        if fut is not None:
            await asyncio.shield(fut)

    def _audit_final(
        self, live: LiveSession, record: ExecutionRecord, code: str | None
    ) -> AuditEntry:
        return AuditEntry(
            principal=live.principals.pop(record.execution_id, live.stored.owner),
            action="execution",
            session_id=live.id,
            execution_id=record.execution_id,
            code=code,
            status=record.status.value,
            duration=record.duration,
            cpu_seconds=record.cpu_seconds,
            peak_memory_bytes=record.peak_memory_bytes,
            output_bytes=record.output_bytes,
            client=live.clients.pop(record.execution_id, None),
            detail={"reason": record.reason, "ended_by": record.ended_by.value}
            if record.reason
            else None,
        )

    async def _watch(self, live: LiveSession, kernel: KernelSession) -> None:
        info = await kernel.sandbox.wait_exit()
        # A hibernating session removes its sandbox on purpose: not a death.
        if live.kernel is not kernel or live.state == SessionState.DELETED:
            return
        reason = info.reason
        try:
            given_up = await self.recovery.revive(live, kernel, reason)
        except KernelhubError as exc:
            given_up = f"recovery failed: {exc}"
        if given_up is None:
            return
        log.warning("session %s ends dead: %s", live.id, given_up)
        await self._mark_dead(live, f"{reason}; {given_up}")
        # Dead for good: its container, socket directory and state tmpfs go now, not when
        # someone deletes the session (what recovery needed is no longer needed).
        if live.kernel is not None:
            await final_out(live.kernel)
            try:
                await live.kernel.close()
            except KernelhubError as exc:
                log.warning("releasing dead session %s failed: %s", live.id, exc)

    async def _mark_dead(self, live: LiveSession, reason: str) -> None:
        live.state = SessionState.DEAD
        live.reason = reason
        self.pool.poke()
        await self.store.update_session(live.id, state=SessionState.DEAD.value, reason=reason)

    def _held(self, principal: Principal, session_id: str) -> LiveSession | None:
        live = self.sessions.get(session_id)
        if live is not None and (live.stored.owner == principal.name or principal.admin):
            return live
        return None

    async def _get(self, principal: Principal, session_id: str) -> LiveSession:
        """The caller's live session; ``SessionClosedError`` if it has ended."""
        if (live := self._held(principal, session_id)) is not None:
            return live
        stored = await self._gone(principal, session_id)
        raise _ended(stored.id, SessionState(stored.state), stored.reason)

    async def _gone(self, principal: Principal, session_id: str) -> StoredSession:
        """The stored row of the caller's session that this process no longer holds (it
        was deleted, or died before a restart). Anyone else's is ``NotFoundError``, the
        same as an id that never existed, so ids cannot be probed."""
        stored = None if session_id in self.sessions else await self.store.get_session(session_id)
        if stored is None or (stored.owner != principal.name and not principal.admin):
            raise NotFoundError(f"no session {session_id!r} (or it is not yours)")
        return stored

    async def info(self, principal: Principal, session_id: str) -> SessionInfo:
        """A dead session still answers (its reason is the point); a deleted one is gone."""
        if self._held(principal, session_id) is None:
            stored = await self._gone(principal, session_id)
            if stored.deleted_at is not None:
                raise _ended(stored.id, SessionState.DELETED, stored.reason)
            return _info(
                stored,
                SessionState(stored.state),
                stored.reason,
                await self.store.last_seq(session_id),
            )
        live = await self._get(principal, session_id)
        state = live.state
        if state == SessionState.READY and live.kernel and not live.kernel.alive:
            # Died a moment ago; the watcher is about to recover it or declare it dead.
            state = SessionState.STARTING if self._recoverable(live) else SessionState.DEAD
        elif state == SessionState.READY and live.kernel and live.kernel.paused:
            state = SessionState.PAUSED
        elif state == SessionState.READY and live.kernel and live.kernel.running is not None:
            state = SessionState.BUSY
        last = live.kernel.last_seq if live.kernel else await self.store.last_seq(session_id)
        info = _info(live.stored, state, live.reason, last, warm=live.warm)
        info.stored_bytes = self.store.ledger.session_bytes(session_id)  # live, not as stored
        running = live.kernel.running if live.kernel else None
        if running is not None and running.status == ExecutionStatus.AWAITING_INPUT:
            info.awaiting_input = running.id  # a human gate: the review page flags it
        info.recovery = self.recovery.last(session_id)
        return info

    async def list_sessions(
        self, principal: Principal, *, everyone: bool = False
    ) -> list[SessionInfo]:
        stored = await self.store.list_sessions(None if everyone else principal.name)
        out = []
        for s in stored:
            live = self.sessions.get(s.id)
            if live is not None:
                out.append(await self.info(Principal(name=s.owner, admin=True), s.id))
            else:
                out.append(_info(s, SessionState(s.state), s.reason, 0))
        return out

    async def delete(
        self,
        principal: Principal,
        session_id: str,
        client: str | None = None,
        *,
        purge: bool = False,
    ) -> None:
        """End the session. Its events and executions stay for the retention period
        (KERNELHUB_STORAGE__RETENTION), unless ``purge``: then they go now, and a session
        that ended earlier (deleted, or dead before a restart) can be purged this way too."""
        purge = purge or self.settings.storage.retention == 0
        live = self._held(principal, session_id)
        if live is None:
            # Dead before a restart: nothing left to stop, but the owner may still remove it.
            stored = await self._gone(principal, session_id)
            if stored.deleted_at is not None:
                if not purge:
                    raise _ended(stored.id, SessionState.DELETED, stored.reason)
                # Deleted earlier and not purged yet: purge it now.
                await self.retention.purge(session_id)
                await self._audit_delete(principal, session_id, client, purge)
                return
            # It died before this process started: only its state directory may be left.
            await self.backend.drop_state(session_id)
        else:
            live.state = SessionState.DELETED
            if live.kernel is not None:
                await live.kernel.close()
            if live.hibernation is not None:
                await self.store.delete_snapshot(live.hibernation)
                self.blobs.remove(live.hibernation)
                await self.drop_standby(live)
                await self.backend.drop_state(session_id)  # hibernation kept it
            await live.fanout.close()
        await self.store.update_session(session_id, state=SessionState.DELETED.value, deleted=True)
        if live is not None:
            del self.sessions[session_id]
            self.recovery.forget(session_id)
            self.pool.poke()
        if purge:
            await self.retention.purge(session_id)
        await self._audit_delete(principal, session_id, client, purge)

    async def _audit_delete(
        self, principal: Principal, session_id: str, client: str | None, purge: bool
    ) -> None:
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="session.delete",
                session_id=session_id,
                client=client,
                detail={"purge": True} if purge else None,
            )
        )

    async def _purged(self, session_id: str) -> None:
        """The sweeper purged a session: a dead one may still be in the table."""
        live = self.sessions.pop(session_id, None)
        if live is not None:
            if live.kernel is not None:
                with contextlib.suppress(KernelhubError):
                    await live.kernel.close()
            await live.fanout.close()

    async def stop_all(self, principal: Principal, client: str | None = None) -> int:
        """The emergency stop: every sandbox, now."""
        ids = list(self.sessions)
        for sid in ids:
            with contextlib.suppress(KernelhubError):
                await self.delete(principal, sid, client)
        # Pooled sandboxes ran nobody's code, but an emergency stop means nothing running.
        await self.pool.drain()
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="admin.stop_all",
                client=client,
                detail={"sessions": len(ids)},
            )
        )
        return len(ids)

    # -- executions --------------------------------------------------------------------

    async def submit(
        self,
        principal: Principal,
        session_id: str,
        body: ExecutionCreate,
        client: str | None = None,
    ) -> tuple[StoredExecution, ExecutionHandle | None, bool]:
        """Queue a cell. Returns (row, handle, created). With a known idempotency key the
        first execution is returned (``created`` False) and nothing runs."""
        live = await self._get(principal, session_id)
        if body.idempotency_key is not None:
            # Ask the store first: the key may have been used before a restart.
            existing = await self.store.execution_by_key(principal.name, body.idempotency_key)
            if existing is not None:
                if existing.session_id != session_id:
                    raise InvalidRequestError(
                        f"idempotency_key {body.idempotency_key!r} was used for another session"
                    )
                return existing, live.kernel.get(existing.id) if live.kernel else None, False
        kernel = await self._awake(live)
        row = self._new_execution(principal, live, kernel, body)
        if body.idempotency_key is not None:
            stored = await self.store.insert_execution(row)
            if stored.id != row.id:  # a concurrent retry with the same key won the race
                return stored, kernel.get(stored.id), False
        return row, self._start(live, kernel, row, body, client), True

    def submit_now(
        self,
        principal: Principal,
        session_id: str,
        body: ExecutionCreate,
        client: str | None = None,
    ) -> tuple[StoredExecution, ExecutionHandle] | None:
        """:meth:`submit` for a caller that cannot wait (the WebSocket's receive path), when
        there is nothing to wait for: no idempotency key to look up, the kernel awake.
        None when :meth:`submit` is needed; its errors otherwise, nothing queued."""
        live = self._held(principal, session_id)
        kernel = self._ready_kernel(live) if live is not None else None
        if body.idempotency_key is not None or live is None or kernel is None:
            return None
        live.last_active = time.monotonic()
        row = self._new_execution(principal, live, kernel, body)
        return row, self._start(live, kernel, row, body, client)

    def _new_execution(
        self, principal: Principal, live: LiveSession, kernel: KernelSession, body: ExecutionCreate
    ) -> StoredExecution:
        self.storage.check(live.stored.owner)  # the owner's store holds what it outputs
        if kernel.queue_length >= self.settings.gateway.max_queued_per_session:
            raise QuotaError(
                f"session {live.id} already has {kernel.queue_length} cells queued; wait for some to finish",
                retry_after=2,
            )
        return StoredExecution(
            id=uuid.uuid4().hex,
            session_id=live.id,
            owner=principal.name,
            code=body.code,
            status=ExecutionStatus.QUEUED,
            idempotency_key=body.idempotency_key,
            created_at=datetime.now(UTC),
            record=None,
        )

    def _start(
        self,
        live: LiveSession,
        kernel: KernelSession,
        row: StoredExecution,
        body: ExecutionCreate,
        client: str | None,
    ) -> ExecutionHandle:
        live.principals[row.id] = row.owner
        live.codes[row.id] = body.code
        if client:
            live.clients[row.id] = client
        kwargs = {} if body.timeout is None else {"timeout": body.timeout}
        # The kernel first (an idle kernel gets the cell right here), the bookkeeping after.
        handle = kernel.submit_nowait(
            body.code, execution_id=row.id, keep_events=body.wait, **kwargs
        )
        if body.idempotency_key is None:
            # Nothing to check against: record it without waiting. It joins the pending
            # commit, ahead of every later store call; like the cell's `running`, it may
            # wait there briefly for the cell's next event (see coalesce_window).
            self._storing[row.id] = []
            self._spawn(
                self.store.insert_execution_soon(
                    row,
                    partial(self._stored, row.id),
                    wait=self.settings.gateway.coalesce_window,
                )
            )
        return handle

    def when_stored(self, execution_id: str, then: Callable[[], None]) -> None:
        """Call ``then`` once the execution's row is committed (at once if it is), from
        the commit's callbacks, before the events committed after the row are handed to
        subscribers: tell no one about an execution that a crash could still lose."""
        waiting = self._storing.get(execution_id)
        if waiting is None:
            then()
        else:
            waiting.append(then)

    def _stored(self, execution_id: str, error: Exception | None) -> None:
        if error is not None:
            log.error("storing execution %s failed: %s", execution_id, error)
        for then in self._storing.pop(execution_id, []):
            try:
                then()
            except Exception:
                log.exception("a callback on execution %s failed", execution_id)

    async def _awake(self, live: LiveSession) -> KernelSession:
        """The session's kernel, woken from hibernation first if need be, or after a
        crash the recovered one (requests wait for the recovery rather than fail)."""
        live.last_active = time.monotonic()
        if (kernel := self._ready_kernel(live)) is not None:
            return kernel
        if live.kernel is None and live.wake_lock.locked():
            async with live.wake_lock:  # a hibernation in progress: let it finish
                pass
        deadline = time.monotonic() + self.settings.engine.start_timeout + 60
        while (  # noqa: ASYNC110 - liveness is the engine's, recovery the watcher's; bounded poll
            live.state in (SessionState.READY, SessionState.STARTING)
            and (live.kernel is None or not live.kernel.alive)
            and (live.state == SessionState.STARTING or self._recoverable(live))
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        if live.state != SessionState.HIBERNATED:
            return self._kernel(live)
        async with live.wake_lock:
            if live.state == SessionState.HIBERNATED:
                await self._wake(live)
        return self._kernel(live)

    @staticmethod
    def _ready_kernel(live: LiveSession) -> KernelSession | None:
        """The session's kernel if it takes cells right now (no wake-up, no recovery to
        wait for), else None."""
        kernel = live.kernel
        if (
            live.state in (SessionState.READY, SessionState.BUSY, SessionState.PAUSED)
            and kernel is not None
            and kernel.alive
        ):
            return kernel
        return None

    def _kernel(self, live: LiveSession) -> KernelSession:
        if live.state == SessionState.HIBERNATED:
            raise SessionError(f"session {live.id} is hibernated: nothing is running in it")
        if live.state in (SessionState.DEAD, SessionState.DELETED):
            raise _ended(live.id, live.state, live.reason)
        if live.kernel is None or not live.kernel.alive:
            # Died a moment ago: the watcher is about to recover it or declare it dead.
            raise SessionError(
                f"session {live.id} has no running kernel right now ({live.reason or 'kernel gone'}); "
                "retry shortly, or create a new session"
            )
        return live.kernel

    async def execution(
        self, principal: Principal, execution_id: str, *, events: bool = True
    ) -> tuple[StoredExecution, list[Event] | None]:
        row = await self.store.get_execution(execution_id)
        if row is None or (row.owner != principal.name and not principal.admin):
            raise NotFoundError(f"no execution {execution_id!r} (or it is not yours)")
        live = self.sessions.get(row.session_id)
        handle = live.kernel.get(execution_id) if live and live.kernel else None
        if handle is not None:
            row = row.model_copy(
                update={"status": handle.status, "record": handle.record or row.record}
            )
            return row, list(handle.events) if handle.record else None
        # Finished a moment ago: its row may not be updated yet, its record is known.
        recent = self._recent_records.get(execution_id)
        if row.record is None and recent is not None:
            row = row.model_copy(update={"status": recent.status, "record": recent})
        if row.record is not None and events:
            if live is not None:
                await live.fanout.flush()
            return row, await self.store.events_of(execution_id)
        return row, None

    async def interrupt(self, principal: Principal, execution_id: str) -> StoredExecution:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        kernel = self._kernel(live)
        running = kernel.running
        if running is None or running.id != execution_id:
            raise SessionError(
                f"execution {execution_id} is {row.status.value}, not running; only a running execution can be interrupted"
            )
        await kernel.interrupt()
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="execution.interrupt",
                session_id=live.id,
                execution_id=execution_id,
            )
        )
        return row

    async def cancel(self, principal: Principal, execution_id: str) -> StoredExecution:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        if not self._kernel(live).cancel(execution_id):
            raise SessionError(
                f"execution {execution_id} is {row.status.value}; only a queued execution can be cancelled"
            )
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="execution.cancel",
                session_id=live.id,
                execution_id=execution_id,
            )
        )
        return (await self.execution(principal, execution_id))[0]

    async def send_input(self, principal: Principal, execution_id: str, value: str) -> None:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        kernel = self._kernel(live)
        running = kernel.running
        if (
            running is None
            or running.id != execution_id
            or running.status != ExecutionStatus.AWAITING_INPUT
        ):
            raise SessionError(f"execution {execution_id} is not waiting for input")
        # A scoped token answers in its own name: the audit says who was at the page.
        kernel.send_input(
            value, answered_by=principal.token or principal.name
        )  # audited from its event

    # -- pause and resume --------------------------------------------------------------

    async def pause(
        self, principal: Principal, session_id: str, client: str | None = None
    ) -> SessionInfo:
        return await self._freeze(principal, session_id, client, pause=True)

    async def resume(
        self, principal: Principal, session_id: str, client: str | None = None
    ) -> SessionInfo:
        return await self._freeze(principal, session_id, client, pause=False)

    async def _freeze(
        self, principal: Principal, session_id: str, client: str | None, *, pause: bool
    ) -> SessionInfo:
        kernel = await self._awake(await self._get(principal, session_id))
        await (kernel.pause() if pause else kernel.resume())
        action = "session.pause" if pause else "session.resume"
        entry = AuditEntry(
            principal=principal.name, action=action, session_id=session_id, client=client
        )
        await self.store.audit(entry)
        return await self.info(principal, session_id)

    # -- files -------------------------------------------------------------------------

    async def upload(
        self,
        principal: Principal,
        session_id: str,
        path: str,
        chunks: AsyncIterator[bytes],
        client: str | None = None,
    ) -> int:
        live = await self._get(principal, session_id)
        kernel = await self._awake(live)
        size = await kernel.sandbox.write_file(path, chunks, self.settings.gateway.max_file_bytes)
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="file.upload",
                session_id=session_id,
                client=client,
                detail={"path": path, "bytes": size},
            )
        )
        return size

    async def download(
        self, principal: Principal, session_id: str, path: str, client: str | None = None
    ) -> AsyncIterator[bytes]:
        """The file's chunks; errors (missing, symlink, too large) raise before the first."""
        live = await self._get(principal, session_id)
        kernel = await self._awake(live)
        chunks = kernel.sandbox.read_file(path, self.settings.gateway.max_file_bytes)
        first = await anext(chunks, b"")
        await self.store.audit(
            AuditEntry(
                principal=principal.name,
                action="file.download",
                session_id=session_id,
                client=client,
                detail={"path": path},
            )
        )

        async def stream() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk

        return stream()

    async def call_in_kernel(
        self,
        principal: Principal,
        session_id: str,
        code: str,
        expressions: dict[str, str],
        *,
        timeout: float | None,
    ) -> dict[str, Any]:
        """kernelhub's own ``code`` in the caller's session, in turn with its cells and
        outside its history (the E2B drop-in's directory listing); the kernel's answers to
        ``expressions``."""
        live = await self._get(principal, session_id)
        kernel = await self._awake(live)
        return await kernel.call(code, expressions, timeout=timeout)

    async def live(self, principal: Principal, session_id: str) -> LiveSession:
        return await self._get(principal, session_id)


def _info(
    s: StoredSession, state: SessionState, reason: str | None, last_seq: int, *, warm: bool = False
) -> SessionInfo:
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


def _ended(session_id: str, state: SessionState, reason: str | None) -> SessionClosedError:
    if state == SessionState.DELETED:
        return SessionClosedError(f"session {session_id} was deleted; create a new session")
    why = reason.splitlines()[0] if reason else "its kernel is gone"
    return SessionClosedError(f"session {session_id} has ended ({why}); create a new session")
