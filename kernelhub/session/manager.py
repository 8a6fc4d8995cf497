"""The session manager: the gateway's single owner of every live session.

It keeps the registry of live sessions (:mod:`~kernelhub.session.live`) and enforces
ownership (someone else's session is indistinguishable from a missing one), quotas
(sessions, queued cells, the host memory budget), and, at start-up, reconciles: it
re-adopts sandboxes that outlived a previous gateway process and removes the orphans.
What a session may do in its state is the state machine's (:mod:`~kernelhub.session.state`);
every row about executions, events and actions is the recorder's
(:mod:`~kernelhub.session.recorder`); snapshots, checkpoints, rewind, crash recovery and
hibernation are its collaborator :class:`~kernelhub.session.continuity.Continuity`'s;
new sessions take sandboxes from the warm pool (:mod:`kernelhub.session.pool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime
from functools import partial
from typing import Any

import psutil

from kernelhub import profiles
from kernelhub.cluster.failover import Failover
from kernelhub.config import Limits, Settings
from kernelhub.egress.sessions import EgressSessions
from kernelhub.errors import (
    KernelhubError,
    NotFoundError,
)
from kernelhub.execution.engine import KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec
from kernelhub.session.admission import admit, alive
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import (
    LiveSession,
    SessionTable,
    execution_info,
    held,
    in_flight_bytes,
    session_info,
)
from kernelhub.session.operations import Operations
from kernelhub.session.pool import PoolKind, WarmPools, pool_kinds
from kernelhub.session.recorder import Observer, Recorder
from kernelhub.session.recovery import SessionRecovery, final_out
from kernelhub.session.salvage import CellSalvage, open_spool
from kernelhub.session.state import SessionState, Transition, closed_error
from kernelhub.snapshot.blobs import blob_store
from kernelhub.store.base import Store
from kernelhub.store.quota import StorageGuard
from kernelhub.store.records import AuditEntry, Principal, StoredSession
from kernelhub.store.retention import RetentionSweeper
from kernelhub.wire import (
    LimitsIn,
    SessionCreate,
    SessionInfo,
)

__all__ = ["LiveSession", "Observer", "SessionManager", "execution_info"]
log = logging.getLogger(__name__)


class SessionManager:
    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: Store,
        observer: Observer | None = None,
    ) -> None:
        # The store is the record of finished executions; engines keep none in memory.
        self.settings = settings.model_copy(
            update={"engine": settings.engine.model_copy(update={"retain_finished": 0})}
        )
        self.backend = backend
        self.store = store
        self.observer = observer or Observer()
        self.recorder = Recorder(
            store, self.observer, coalesce_window=settings.gateway.coalesce_window
        )
        self.sessions: dict[str, LiveSession] = SessionTable()
        self.blobs = blob_store(settings)  # ConfigError: no cluster key for the bucket
        self.storage = StorageGuard(
            settings.storage, store.ledger, settings.data_dir,
            in_flight=partial(in_flight_bytes, self.sessions),
        )  # fmt: skip
        self.retention = RetentionSweeper(store, self.blobs, settings.storage, self._purged)
        self._tasks: set[asyncio.Task[None]] = set()
        budget = settings.gateway.memory_budget_bytes
        self.memory_budget = (
            budget if budget is not None else int(psutil.virtual_memory().total * 0.8)
        )
        self.pool = WarmPools(
            backend, self.settings.engine, self._pool_room,
            refill_concurrency=settings.pool.refill_concurrency,
        )  # fmt: skip
        self.pool.add(PoolKind("", settings.pool.size, settings.limits))
        self.continuity = Continuity(
            self.settings, backend, store, self.recorder, self.blobs, self.storage,
            bind=self._bind, spawn=self._spawn,
        )  # fmt: skip
        # A kernel that dies comes back (from its checkpoint, or empty), or ends dead.
        self.recovery = SessionRecovery(
            self.settings, backend, store, self.recorder, bind=self._bind
        )
        self.failover = Failover(
            self.settings, backend, store, self.recorder, self.continuity, self.recovery,
            self.sessions, live=self._live, bind=self._bind, spawn=self._spawn,
        )  # fmt: skip
        self.ops = Operations(
            self.settings, store, self.recorder, self.continuity, self.storage, self.sessions,
            get=self._get, info=self.info,
        )  # fmt: skip
        # What callers do with a session, answered by the collaborators that do it.
        ops, cont, rec = self.ops, self.continuity, self.recorder
        self.submit, self.execution, self.interrupt = ops.submit, ops.execution, ops.interrupt
        self.cancel, self.send_input = ops.cancel, ops.send_input
        self.pause, self.resume = ops.pause, ops.resume
        self.upload, self.download = ops.upload, ops.download
        self.call_in_kernel = ops.call_in_kernel
        self.snapshot, self.rewind, self.restart = ops.snapshot, ops.rewind, ops.restart
        self.hibernate, self.snapshots = cont.hibernate, cont.snapshots
        self.get_snapshot, self.delete_snapshot = cont.get_snapshot, cont.delete_snapshot
        self.when_stored, self.settled = rec.when_stored, rec.settled
        profiles.check_profiles(settings.profiles, settings.egress)
        # The egress proxy reaches Docker sandboxes only (their supervisor forwards it).
        self.egress = (
            EgressSessions(settings.egress, settings.data_dir, store)
            if settings.egress.enabled and backend.name == "docker"
            else None
        )

    # -- start-up and shutdown ---------------------------------------------------------

    async def start(self) -> None:
        """Re-adopt sandboxes a previous process left running; report the rest dead;
        remove orphans."""
        # A node agent (issue #24) holds only the sessions whose row names it.
        mine = self.store.node if self.settings.cluster.address is not None else None
        for stored in await self.store.list_sessions():
            gone = stored.state == SessionState.DELETED or stored.deleted_at is not None
            if gone or (mine is not None and stored.node != mine):
                continue
            limits = Limits(**stored.limits)
            live = self._live(stored, limits)
            self.sessions[stored.id] = live
            if stored.state == SessionState.DEAD:
                # Held without a sandbox, as one that dies while we run: it counts against
                # its owner's sessions until deleted, whichever process saw it die.
                live.phase, live.reason = SessionState.DEAD, stored.reason
                continue
            if stored.state == SessionState.HIBERNATED and stored.hibernation:
                live.phase = SessionState.HIBERNATED
                live.hibernation = stored.hibernation
                continue
            spec = SandboxSpec(session_id=stored.id, owner=stored.owner, limits=limits)
            sandbox = None
            with contextlib.suppress(KernelhubError):
                sandbox = await self.backend.adopt(spec)
            last_seq = await self.store.last_seq(stored.id)
            if sandbox is None:
                await self._mark_dead(live, "the sandbox did not survive the gateway restart")
                await self._finish_orphaned_executions(
                    live, last_seq, "the sandbox was lost when the gateway restarted", None
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
            live.move(Transition.STARTED)
            await self.recorder.phase(live)
            await self._finish_orphaned_executions(live, last_seq, None, spooled)
            await self.recorder.audit(
                AuditEntry(principal=None, action="session.adopt", session_id=stored.id)
            )
            log.info("re-adopted session %s", stored.id)
        await self.backend.reap_orphans()
        if self.settings.pool.profiles:
            kinds = pool_kinds(self.settings, self.backend.name, await self.backend.runtimes())
            for kind in kinds[1:]:
                self.pool.add(kind)
        self.pool.start()  # after the reap, which would take its sandboxes for orphans
        self._spawn(self.continuity.hibernate_idle(self.sessions.values))
        self._spawn(self.retention.run())

    async def _finish_orphaned_executions(
        self, live: LiveSession, last_seq: int, lost: str | None, spooled: CellSalvage | None
    ) -> None:
        """Executions the previous process never finished: say what became of them. The
        one the sandbox spooled is collected from there (``session.salvage``), in turn
        with the session's cells."""
        # The engine's numbering stays ahead of what is written here.
        next_seq = live.kernel.next_seq if live.kernel else itertools.count(last_seq + 1).__next__
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
            await self.recorder.orphaned(
                live, e, status, reason, next_seq, state_lost=lost is not None
            )
        if spooled is not None:
            spooled.release()

    async def close(self) -> None:
        """Detach from every session without stopping its sandbox: a restarted gateway
        re-adopts them. (Use ``stop_all`` to stop sandboxes.)"""
        for task in list(self._tasks):
            task.cancel()
        self.recorder.close()
        await self.pool.close()
        if self.egress is not None:
            await self.egress.close()
        for live in self.sessions.values():
            if live.kernel is not None:
                await live.kernel.detach()
            await live.fanout.close()

    # -- sessions ----------------------------------------------------------------------

    def _live(self, stored: StoredSession, limits: Limits, *, warm: bool = False) -> LiveSession:
        if self.egress is not None:
            self.egress.remember(stored)  # after a restart: its policy, not today's default
        return LiveSession(
            stored=stored,
            limits=limits,
            fanout=self.recorder.fanout(stored.id),
            recover_crashed=self.settings.gateway.recover_crashed,
            revives=self.recovery.will_revive,
            warm=warm,
        )

    def resolve_limits(self, requested: LimitsIn, tier: Limits | None = None) -> Limits:
        """The limits a session gets (see ``profiles.resolve_limits``)."""
        return profiles.resolve_limits(self.settings, requested, tier)

    async def create(
        self, principal: Principal, body: SessionCreate, client: str | None = None
    ) -> SessionInfo:
        tier = profiles.choose_profile(
            self.settings.profiles, principal.token or principal.name, body.profile
        )
        runtime = profiles.runtime_for(tier, self.backend.name, await self.backend.runtimes())
        limits = self.resolve_limits(body.limits, tier.profile.limits if tier else None)
        self.storage.check(principal.name)
        egress_policy = (
            self.egress.choose(
                principal.name, body.egress, fixed=tier.profile.egress if tier else None
            )
            if self.egress
            else None
        )
        admit(
            self.settings.gateway, self.sessions.values(), principal.name, limits,
            body.metadata, self.memory_budget,
        )  # fmt: skip
        t0 = time.monotonic()
        warm = self.pool.take(limits, runtime)
        stored = StoredSession(
            id=warm.id if warm else uuid.uuid4().hex[:16],
            owner=principal.name,
            backend=self.backend.name,
            state=(SessionState.READY if warm else SessionState.STARTING).value,
            created_at=datetime.now(UTC),
            limits=limits.model_dump(),
            metadata=dict(body.metadata),
            reason=None,
            deleted_at=None,
            **profiles.recorded(tier, runtime, egress_policy),
        )
        try:
            await self.store.insert_session(stored)
        except BaseException:
            if warm is not None:
                self.pool.discard(warm)
            raise
        live = self._live(stored, limits, warm=warm is not None)
        policy = self.settings.gateway.checkpoints if body.checkpoints is None else body.checkpoints
        live.checkpoint_policy = policy if isinstance(policy, str) else float(policy)
        self.sessions[stored.id] = live
        if warm is not None:
            self._bind(live, warm)
            self.observer.on_start(time.monotonic() - t0)
        elif self.pool.enabled and self.settings.pool.miss == "starting" and not body.from_snapshot:
            # The pool is empty: answer now, the session starting; its cells wait for it.
            self._spawn(self._start_cold(principal, live, runtime, t0, client))
            return live.info(0, 0)
        elif not await self._start_cold(principal, live, runtime, t0, client, fail=True):
            raise closed_error(stored.id, live.phase, live.reason)  # deleted while starting
        report = None
        if body.from_snapshot is not None and live.kernel is not None:
            try:
                report = await self.continuity.restore_into(
                    principal, live, live.kernel, body.from_snapshot
                )
            except BaseException:
                await self.delete(principal, stored.id, client)
                raise
        await self._started(principal, live, t0, client, warm=warm is not None)
        info = live.info(live.fanout.published_seq, self.store.ledger.session_bytes(stored.id))
        return info.model_copy(update={"restore": report}) if report else info

    async def _start_cold(
        self,
        principal: Principal,
        live: LiveSession,
        runtime: str | None,
        t0: float,
        client: str | None,
        *,
        fail: bool = False,
    ) -> bool:
        """Start a session's own sandbox; True once it is ready. A failure leaves the
        session dead with the reason. With ``fail`` the caller waits for it: a failure is
        raised, and the caller declares the session started (after its restore)."""
        try:
            if not fail:
                await self.pool.burst_answered()
            async with self.pool.session_start():
                await self._make_room(live.limits)
                spec = SandboxSpec(
                    session_id=live.id, owner=principal.name, limits=live.limits, runtime=runtime
                )
                kernel = await KernelSession.start(self.backend, spec, engine=self.settings.engine)
        except KernelhubError as exc:
            await self._mark_dead(live, f"the sandbox failed to start: {exc}")
            await self.recorder.audit(
                AuditEntry(
                    principal=principal.name, action="session.create", session_id=live.id,
                    status="failed", client=client, detail={"error": str(exc)},
                )
            )  # fmt: skip
            if fail:
                raise
            log.warning("session %s failed to start: %s", live.id, exc)
            return False
        if live.phase != SessionState.STARTING:  # deleted while it started
            await kernel.close()
            return False
        self.observer.on_start(time.monotonic() - t0)
        self._bind(live, kernel)
        if not fail:
            await self._started(principal, live, t0, client, warm=False)
        return True

    async def _started(
        self, principal: Principal, live: LiveSession, t0: float, client: str | None, *, warm: bool
    ) -> None:
        live.move(Transition.STARTED)
        if not warm:  # a warm session's row was inserted ready
            await self.recorder.phase(live)
        await self.recorder.audit(
            AuditEntry(
                principal=principal.name, action="session.create", session_id=live.id,
                status="ok", client=client, duration=time.monotonic() - t0,
                detail={"warm": True} if warm else None,
            )
        )  # fmt: skip

    def _alive(self) -> list[LiveSession]:
        return alive(self.sessions.values())

    def load(self) -> tuple[int, int]:
        """Live sessions and the memory committed to them and the pool (for heartbeats)."""
        running = self._alive()
        return len(running), sum(s.limits.memory_bytes for s in running) + self.pool.committed_bytes

    def _pool_room(self, memory_bytes: int) -> bool:
        """Whether one more pooled sandbox fits: never at the expense of a session."""
        sessions, committed = self.load()
        if sessions + self.pool.held >= self.settings.gateway.max_sessions:
            return False
        return committed + memory_bytes <= self.memory_budget

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
        kernel.after_cell = partial(self.failover.after_cell, live, kernel)
        kernel.add_listener(partial(self.recorder.event, live))
        kernel.add_gate(live.fanout.room)
        self._spawn(self._watch(live, kernel))
        if self.egress is not None:
            self._spawn(self.egress.bind(live.id, live.stored.owner, kernel))

    async def _watch(self, live: LiveSession, kernel: KernelSession) -> None:
        info = await kernel.wait_exit()
        # A hibernating session removes its sandbox on purpose: not a death.
        if live.kernel is not kernel or live.phase == SessionState.DELETED:
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
        if live.phase in (SessionState.DEAD, SessionState.DELETED):
            return  # declared already (a recovered kernel that died while restoring)
        starting = live.phase in (SessionState.STARTING, SessionState.RECOVERING)
        live.move(Transition.FAILED if starting else Transition.DIED)
        if self.egress is not None:
            await self.egress.unbind(live.id)
        live.reason = reason
        self.pool.poke()
        await self.recorder.phase(live, reason=reason)

    def _held(self, principal: Principal, session_id: str) -> LiveSession | None:
        return held(self.sessions, principal, session_id)

    async def _get(self, principal: Principal, session_id: str) -> LiveSession:
        """The caller's live session; ``SessionClosedError`` if it has ended."""
        if (live := self._held(principal, session_id)) is not None:
            return live
        if (live := await self.failover.claim_released(principal, session_id)) is not None:
            return live  # hibernated with no node (drained): it wakes here
        stored = await self._gone(principal, session_id)
        raise closed_error(stored.id, SessionState(stored.state), stored.reason)

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
        live = self._held(principal, session_id)
        if live is None:
            stored = await self._gone(principal, session_id)
            if stored.deleted_at is not None:
                raise closed_error(stored.id, SessionState.DELETED, stored.reason)
            return session_info(
                stored,
                SessionState(stored.state),
                stored.reason,
                await self.store.last_seq(session_id),
            )
        last = live.fanout.published_seq or await self.store.last_seq(session_id)
        info = live.info(last, self.store.ledger.session_bytes(session_id))
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
                out.append(session_info(s, SessionState(s.state), s.reason, 0))
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
        live = self._held(principal, session_id) or await self.failover.claim_released(
            principal, session_id
        )
        if live is None:
            # Dead before a restart: nothing left to stop, but the owner may still remove it.
            stored = await self._gone(principal, session_id)
            if stored.deleted_at is not None:
                if not purge:
                    raise closed_error(stored.id, SessionState.DELETED, stored.reason)
                # Deleted earlier and not purged yet: purge it now.
                await self.retention.purge(session_id)
                await self._audit_delete(principal, session_id, client, purge)
                return
            # It died before this process started: only its state directory may be left.
            await self.backend.drop_state(session_id)
        else:
            if live.phase == SessionState.DEAD and live.kernel is None:
                await self.backend.drop_state(session_id)  # dead before this process began
            if live.phase != SessionState.DELETED:  # not already on its way out
                live.move(Transition.DELETE)
            if self.egress is not None:
                await self.egress.unbind(live.id, ended=True)
            if live.kernel is not None:
                await live.kernel.close()
            if live.hibernation is not None:
                await self.continuity.drop_snapshot(live.hibernation)
                await self.continuity.standby.drop(live)
                await self.backend.drop_state(session_id)  # hibernation kept it
            await live.fanout.close()
        await self.recorder.deleted(session_id)
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
        entry = AuditEntry(
            principal=principal.name, action="session.delete", session_id=session_id,
            client=client, detail={"purge": True} if purge else None,
        )  # fmt: skip
        await self.recorder.audit(entry)

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
        entry = AuditEntry(
            principal=principal.name, action="admin.stop_all", client=client,
            detail={"sessions": len(ids)},
        )  # fmt: skip
        await self.recorder.audit(entry)
        return len(ids)

    async def live(self, principal: Principal, session_id: str) -> LiveSession:
        return await self._get(principal, session_id)
