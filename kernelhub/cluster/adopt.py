"""Adoption (issue #24): this node takes over a session whose node was lost, and lets go
of sessions the store no longer gives it.

A lost node's running session is claimed in the store (``claim_session``: of two nodes
racing, one wins), started here in a fresh sandbox with the limits and tier it was
created with, and restored from its last exported checkpoint (``cluster.export``: a blob
in the shared snapshot storage; the checkpoints in the lost node's state directory died
with it). Its unfinished executions end saying the node was lost; the stream gets a
``recovered`` notice, numbered on from the store's last seq, and the session's info the
same :class:`~kernelhub.wire.RecoveryInfo` crash recovery gives: which checkpoint, which
executions' effects were lost, which variables did not load, and the lost node.

Fencing: a node that was declared lost and comes back must not run its old sessions
twice. At start the manager holds only the rows naming it (the reaper then removes every
other sandbox it made), and each sweep stops the sandboxes of sessions whose row names
another node now.

Hibernated sessions hold no sandbox: a node agent gives them up (no node), so each wakes
wherever its next call is placed (``KERNELHUB_CLUSTER__RELEASE_HIBERNATED``).

A collaborator of :class:`~kernelhub.session.manager.SessionManager`, given what it
needs: the manager's registry of live sessions, ``live`` (a LiveSession for a stored
row), ``bind`` (attach a kernel: listeners, checkpoints, death watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from kernelhub.config import Limits, Settings
from kernelhub.errors import KernelhubError
from kernelhub.execution.engine import KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.sandbox.base import SandboxBackend
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import LiveSession, start_kernel
from kernelhub.session.recorder import Recorder
from kernelhub.session.recovery import SessionRecovery, describe, recovered_notice
from kernelhub.session.state import SessionState, Transition
from kernelhub.store.base import Store
from kernelhub.store.records import AuditEntry, Principal, StoredSession, StoredSnapshot
from kernelhub.wire import RecoveryInfo

log = logging.getLogger(__name__)

CHECKPOINT_KIND = "checkpoint"  # a snapshot row's metadata["kind"] for exported checkpoints


def lost_executions(
    executions: list[tuple[str, ExecutionStatus, int | None]], after: int | None
) -> list[str]:
    """(id, status, execution count) oldest first → those whose effects the restored
    state lacks: ran after the checkpoint (or every one that ran, with none)."""
    lost = []
    for eid, status, count in executions:
        if status in (ExecutionStatus.QUEUED, ExecutionStatus.CANCELLED):
            continue  # never ran: no effects to lose
        if after is None or count is None or count > after:
            lost.append(eid)
    return lost


class Adoption:
    """Claims, restores and fences sessions for one node (see the module)."""

    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: Store,
        recorder: Recorder,
        continuity: Continuity,
        recovery: SessionRecovery,
        sessions: dict[str, LiveSession],
        *,
        live: Callable[[StoredSession, Limits], LiveSession],
        bind: Callable[[LiveSession, KernelSession], None],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.recorder = recorder
        self.continuity = continuity
        self.recovery = recovery
        self.sessions = sessions
        self._live = live
        self._bind = bind
        self.me = store.node or "local"
        # A node agent shares its store with others; one machine alone owns every row.
        self.enabled = settings.cluster.address is not None

    def _lease(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.settings.cluster.lease_ttl)

    def _held_live(self, stored: StoredSession) -> LiveSession:
        live = self._live(stored.model_copy(update={"node": self.me}), Limits(**stored.limits))
        policy = self.settings.gateway.checkpoints
        live.checkpoint_policy = policy if isinstance(policy, str) else float(policy)
        return live

    # -- a lost node's sessions ------------------------------------------------------------

    async def release(self, session_id: str, from_node: str | None) -> bool:
        """A hibernated session of a lost node loses its node: it wakes wherever its next
        call is placed."""
        return await self.store.claim_session(session_id, from_node, None, None)

    async def adopt(self, stored: StoredSession) -> bool:
        """Restore a lost node's running session here; False if another node won it."""
        lost_node = stored.node or "?"
        if not await self.store.claim_session(stored.id, stored.node, self.me, self._lease()):
            return False
        t0 = time.monotonic()
        live = self._held_live(stored)
        self.sessions[stored.id] = live
        last_seq = await self.store.last_seq(stored.id)
        checkpoint = await self.last_checkpoint(stored.owner, stored.id)
        kernel = await self._fresh(live, last_seq, lost_node)
        after: int | None = None
        not_restored: dict[str, str] = {}
        why_empty: str | None = "the session had no exported checkpoint"
        if checkpoint is not None:
            try:
                owner = Principal(name=stored.owner)
                report = await self.continuity.restore_into(owner, live, kernel, checkpoint.id)
                # The kernel's count is the next cell's: the checkpoint is after the one before.
                count = report.execution_count
                after = count - 1 if count else checkpoint.metadata.get("execution_count")
                not_restored, why_empty = report.failed, None
            except KernelhubError as exc:
                log.warning("session %s: its checkpoint would not load: %s", stored.id, exc)
                why_empty = f"its checkpoint {checkpoint.id} would not load: {exc}"
                live.kernel = None
                await kernel.close()
                kernel = await self._fresh(live, last_seq, lost_node)
        # The rows of unfinished ones say nothing of whether they ran (statuses are not
        # written mid-flight): their stored events do.
        ended = {e.id: e.status for e in await self.store.unfinished_executions(stored.id)}
        executions = await self.store.executions_of(stored.id)
        for e in executions:
            if e.id in ended:
                started = await self.store.has_started(e.id)
                ended[e.id] = ExecutionStatus.FAILED if started else ExecutionStatus.CANCELLED
                why = f"node {lost_node} was lost " + (
                    "while this cell ran; its output and effects after the last stored event are gone"
                    if started
                    else "before this cell ran; submit it again"
                )
                await self.recorder.orphaned(
                    live, e, ended[e.id], why, kernel.next_seq, state_lost=True
                )
        lost = lost_executions(
            [
                (e.id, ended.get(e.id, e.status), e.record.execution_count if e.record else None)
                for e in executions
            ],
            after,
        )
        live.move(Transition.STARTED)
        duration = time.monotonic() - t0
        message = describe(
            "", duration, after, lost, not_restored, why_empty,
            cause=f"node {lost_node} was lost", where=f"on node {self.me}, in a fresh sandbox",
        )  # fmt: skip
        self.recovery.remember(
            stored.id,
            RecoveryInfo(
                at=datetime.now(UTC), reason=f"node {lost_node} was lost",
                checkpoint_after_cell=after, lost=lost, not_restored=not_restored,
                duration=duration, message=message, lost_node=lost_node,
            ),
        )  # fmt: skip
        recovered_notice(kernel, message)
        await self.recorder.phase(live, reason=f"recovered: node {lost_node} was lost")
        await self.recorder.audit(
            AuditEntry(
                principal=None, action="session.adopt", session_id=stored.id, duration=duration,
                detail={"lost_node": lost_node, "checkpoint_after_cell": after, "lost": lost},
            )
        )  # fmt: skip
        log.info("adopted session %s of lost node %s in %.2f s", stored.id, lost_node, duration)
        return True

    async def _fresh(self, live: LiveSession, last_seq: int, lost_node: str) -> KernelSession:
        """A sandbox for the adopted session, or the session ends dead saying why."""
        try:
            kernel = await start_kernel(live, self.backend, self.settings.engine, last_seq)
        except KernelhubError as exc:
            live.move(Transition.FAILED)
            live.reason = f"node {lost_node} was lost and a fresh sandbox failed to start: {exc}"
            await self.recorder.phase(live, reason=live.reason)
            raise
        self._bind(live, kernel)
        return kernel

    async def last_checkpoint(self, owner: str, session_id: str) -> StoredSnapshot | None:
        """The session's newest exported checkpoint, if any."""
        found = [
            s
            for s in await self.store.list_snapshots(owner)
            if s.session_id == session_id and s.metadata.get("kind") == CHECKPOINT_KIND
        ]
        return max(found, key=lambda s: s.created_at) if found else None

    # -- sessions that wake anywhere -------------------------------------------------------

    async def claim_released(self, principal: Principal, session_id: str) -> LiveSession | None:
        """A hibernated session that names no node (drained, released, or of a lost node)
        becomes this node's on its first call here (a delete too: its snapshot goes with
        it); it then wakes as any hibernated session."""
        if not self.enabled or session_id in self.sessions:
            return None
        row = await self.store.get_session(session_id)
        if (
            row is None
            or row.node is not None
            or row.state != SessionState.HIBERNATED.value
            or row.hibernation is None
            or (row.owner != principal.name and not principal.admin)
        ):
            return None
        if not await self.store.claim_session(session_id, None, self.me, self._lease()):
            return None
        live = self._held_live(row)
        live.phase, live.hibernation = SessionState.HIBERNATED, row.hibernation
        self.sessions[session_id] = live
        log.info("session %s (hibernated, no node) is now node %s's", session_id, self.me)
        return live

    async def release_hibernated(self) -> int:
        """Give up the node's hibernated sessions (``cluster.release_hibernated``): each
        wakes on its next call wherever placement puts it. Returns how many."""
        if not (self.enabled and self.settings.cluster.release_hibernated):
            return 0
        released = 0
        for live in list(self.sessions.values()):
            if live.phase != SessionState.HIBERNATED or live.wake_lock.locked():
                continue
            if not await self.store.claim_session(live.id, self.me, None, None):
                continue  # not ours any more: the fence lets it go
            if live.phase != SessionState.HIBERNATED or live.wake_lock.locked():
                # A call is waking it here meanwhile: it stays.
                await self.store.claim_session(live.id, None, self.me, self._lease())
                continue
            await self.let_go(live)
            released += 1
        return released

    async def let_go(self, live: LiveSession) -> None:
        """Stop holding a session: its sandbox (and standby) stopped, its state directory
        removed, its subscribers closed. The store's rows stay: they are someone else's."""
        self.sessions.pop(live.id, None)  # first: no new call finds it here
        kernel, live.kernel = live.kernel, None  # and its death watch must not revive it
        if kernel is not None:
            with contextlib.suppress(KernelhubError):
                await kernel.close()
        await self.continuity.standby.drop(live)
        with contextlib.suppress(KernelhubError):
            await self.backend.drop_state(live.id)
        await live.fanout.close()
        self.recovery.forget(live.id)

    async def fence(self) -> list[str]:
        """Let go of every session whose row names another node now (this node was
        declared lost and its sessions moved): they must not run twice."""
        if not self.enabled:
            return []
        ours = {s.id for s in await self.store.sessions_on(self.me)}
        fenced = []
        for sid, live in list(self.sessions.items()):
            if sid in ours or live.phase in (SessionState.DEAD, SessionState.DELETED):
                continue
            row = await self.store.get_session(sid)  # the read above may predate its insert
            if row is None or row.node == self.me or row.state in ("dead", "deleted"):
                continue
            log.warning("session %s now runs on %s: stopping it here (fencing)", sid, row.node)
            await self.let_go(live)
            fenced.append(sid)
        return fenced

    async def drain(self) -> int:
        """One pass of draining this node: hibernate each idle session, up to
        ``cluster.drain_concurrency`` at once, then give it up (no node: its next call
        wakes it wherever placement puts it). Busy ones wait for a later pass. Returns
        how many left."""
        slots = asyncio.Semaphore(self.settings.cluster.drain_concurrency)

        async def move(live: LiveSession) -> bool:
            async with slots:
                if live.phase == SessionState.READY and live.state == SessionState.READY:
                    try:
                        await self.continuity.hibernate(live)
                    except KernelhubError as exc:
                        log.warning("draining: session %s did not hibernate: %s", live.id, exc)
                if live.phase != SessionState.HIBERNATED or not await self.store.claim_session(
                    live.id, self.me, None, None
                ):
                    return False
                await self.let_go(live)
                return True

        return sum(await asyncio.gather(*(move(s) for s in list(self.sessions.values()))))
