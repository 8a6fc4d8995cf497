"""Continuity: what lets a session's state outlive its kernel.

Snapshots (captured inside the sandbox, stored as opaque blobs bound to their owner),
checkpoints after cells and rewind to one of them, recovery of a crashed kernel from
its last checkpoint, and hibernation (snapshot, remove the sandbox, wake on next use).

A collaborator of :class:`~kernelhub.session.manager.SessionManager`, not part of it:
the manager resolves the caller's session (ownership, the state machine, waking) and
hands over the :class:`LiveSession` and its kernel; continuity is given, when it is
made, only what it needs besides: the settings, the sandbox backend, the snapshot rows
and blobs, the recorder, and ``bind`` (attach a new kernel to a session: listeners,
checkpoint hook, death watch) and ``spawn`` (a task the manager owns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from datetime import UTC, datetime
from typing import Any

from kernelhub.config import Settings
from kernelhub.errors import KernelError, KernelhubError, NotFoundError, SessionError
from kernelhub.execution import ops
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.sandbox.base import SandboxBackend
from kernelhub.session.checkpoints import Checkpoints, next_count_after, unreferenced
from kernelhub.session.live import LiveSession
from kernelhub.session.recorder import Recorder
from kernelhub.session.standby import Standby, info_modules, kept_capture, top_modules
from kernelhub.session.state import SessionState, Transition
from kernelhub.snapshot import calls, transfer
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.base import Store
from kernelhub.store.quota import StorageGuard
from kernelhub.store.records import AuditEntry, Principal, StoredSnapshot
from kernelhub.wire import RestoreReport, RewindReport, SnapshotInfo

log = logging.getLogger(__name__)


class Continuity:
    """Snapshots, checkpoints, rewind, crash recovery and hibernation (see the module)."""

    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: Store,
        recorder: Recorder,
        blobs: BlobStore,
        storage: StorageGuard,
        *,
        bind: Callable[[LiveSession, KernelSession], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.snapshots_store = store  # snapshot rows only; the recorder writes the rest
        self.recorder = recorder
        self.blobs = blobs
        self.storage = storage
        self._bind = bind
        self._spawn = spawn
        self.standby = Standby(settings, backend, store)
        self.checkpoints = Checkpoints(settings, spawn)

    # -- checkpoints and rewind -----------------------------------------------------------

    async def checkpoint(
        self, live: LiveSession, kernel: KernelSession, handle: ExecutionHandle
    ) -> None:
        """The engine's ``after_cell`` hook: arms the session's automatic checkpoint
        (``session.checkpoints``), taken once the session has been idle a moment."""
        self.checkpoints.cell_ended(live, kernel, handle)

    async def restart(
        self, principal: Principal, live: LiveSession, kernel: KernelSession, client: str | None
    ) -> None:
        """A fresh kernel in the same sandbox: variables gone, files kept. It waits its
        turn behind the cells queued before it (interrupt a stuck one first)."""
        t0 = time.monotonic()
        self.checkpoints.cancel(live)  # it would capture the empty kernel
        await kernel.exclusive(kernel.restart)
        kernel.notice("the kernel was restarted: variables are gone, files are kept")
        await self.recorder.audit(
            AuditEntry(
                principal=principal.token or principal.name,
                action="session.restart",
                session_id=live.id,
                client=client,
                duration=time.monotonic() - t0,
            )
        )

    async def rewind(
        self,
        principal: Principal,
        live: LiveSession,
        kernel: KernelSession,
        before_cell: int,
        client: str | None,
    ) -> RewindReport:
        """Back to the state before cell ``before_cell``: a fresh kernel in the same sandbox,
        restored from the checkpoint taken after the cell before it."""
        t0 = time.monotonic()

        async def rewind_now() -> RewindReport:
            usable = [(n, d) for n, d in live.checkpoints if n < before_cell]
            if not usable and before_cell > 1:
                raise SessionError(no_checkpoint_before(before_cell, live.checkpoint_policy))
            self.checkpoints.cancel(live)  # armed for a cell of the future undone here
            await kernel.restart()
            restored: list[str] = []
            failed: dict[str, str] = {}
            after = None
            if usable:
                after, directory = usable[-1]
                count = next_count_after(live.checkpoints, after, directory)
                result = await ops.run(
                    kernel,
                    calls.restore(directory, count),
                    timeout=self.settings.gateway.snapshot_timeout,
                )
                restored = list(result.get("restored", []))
                failed = {str(k): str(v) for k, v in dict(result.get("failed", {})).items()}
            # Checkpoints of the abandoned future go; later ones build on the restored one.
            kept = [c for c in live.checkpoints if c[0] < before_cell]
            dropped = [c for c in live.checkpoints if c[0] >= before_cell]
            for d in unreferenced(dropped, kept):  # a kept alias may share a directory
                await ops.run(kernel, calls.remove(d), timeout=60)
            live.checkpoints = kept
            return RewindReport(
                before_cell=before_cell,
                checkpoint_after_cell=after,
                restored=restored,
                failed=failed,
                duration=time.monotonic() - t0,
            )

        report = await kernel.exclusive(rewind_now)
        kernel.notice(rewound(before_cell, report.checkpoint_after_cell))
        await self.recorder.audit(
            AuditEntry(
                principal=principal.name,
                action="session.rewind",
                session_id=live.id,
                client=client,
                duration=report.duration,
                detail={"before_cell": before_cell, "failed": report.failed},
            )
        )
        return report

    # -- hibernation -------------------------------------------------------------------

    async def hibernate_idle(self, sessions: Callable[[], Iterable[LiveSession]]) -> None:
        """Every few seconds: snapshot and remove the sandbox of each session idle for
        ``hibernate_after`` seconds. It wakes, transparently, on its next use.

        Up to ``hibernate_concurrency`` sessions at once, each within its own
        ``hibernate_timeout``: one at a time, a session whose objects stalled pickling held
        up the hibernation of every other one for as long as it stalled. A session whose
        hibernation failed waits twice as long idle before each next try, so a few that
        always stall cannot keep every slot busy."""
        gateway = self.settings.gateway
        after = gateway.hibernate_after
        if after is None:
            return
        slots = asyncio.Semaphore(gateway.hibernate_concurrency)
        going: set[str] = set()  # sessions with a hibernation waiting or under way
        failures: dict[str, int] = {}  # session id -> tries failed in a row
        async with asyncio.TaskGroup() as group:
            while True:
                await asyncio.sleep(min(after / 2, 5.0))
                current = list(sessions())
                for sid in failures.keys() - {live.id for live in current}:
                    del failures[sid]
                for live in current:
                    wait = idle_wait(after, failures.get(live.id, 0))
                    if live.id not in going and live.idle_for(wait):
                        going.add(live.id)
                        turn = self._hibernate_in_turn(live, after, slots, going, failures)
                        group.create_task(turn)

    async def _hibernate_in_turn(
        self,
        live: LiveSession,
        after: float,
        slots: asyncio.Semaphore,
        going: set[str],
        failures: dict[str, int],
    ) -> None:
        """One idle session's hibernation, once a slot is free; never raises (a task of
        the hibernation loop's group) except to be cancelled."""
        try:
            async with slots:
                # It may have been used while it waited for the slot.
                if live.idle_for(idle_wait(after, failures.get(live.id, 0))):
                    await self.hibernate(live)
                    failures.pop(live.id, None)
        except Exception as exc:
            failures[live.id] = failures.get(live.id, 0) + 1
            if isinstance(exc, KernelhubError):
                log.warning(
                    "could not hibernate session %s: %s; next try after %g s idle",
                    live.id,
                    exc,
                    idle_wait(after, failures[live.id]),
                )
            else:
                log.exception("hibernating session %s failed unexpectedly", live.id)
        finally:
            going.discard(live.id)

    async def hibernate(self, live: LiveSession) -> None:
        """Snapshot the session within ``hibernate_timeout`` (or ``snapshot_timeout``, the
        bound of every capture, if lower) and remove its sandbox. A snapshot past the
        deadline is interrupted (the engine's escalation for a call that runs too long) and
        the session stays awake; so does a session used while it was captured. The loop
        tries again once it has been idle long enough (see :meth:`_hibernate_idle`)."""
        gateway = self.settings.gateway
        timeout, knob = hibernate_deadline(gateway.hibernate_timeout, gateway.snapshot_timeout)
        async with live.wake_lock:
            kernel = live.kernel
            if live.state != SessionState.READY or kernel is None:
                return  # in use, paused, dying, or gone meanwhile
            owner = Principal(name=live.stored.owner)
            t0 = time.monotonic()
            # From the last checkpoint: a 100 MiB namespace checkpointed in a 128 MiB state
            # directory has no room for a second full copy (ENOSPC), and it is faster.
            base = live.checkpoints[-1][1] if live.checkpoints else None
            kept = f"hib-{uuid.uuid4().hex[:12]}"
            try:
                info = await self.capture(
                    owner,
                    live,
                    kernel,
                    None,
                    kind="hibernation",
                    timeout=timeout,
                    base=base,
                    keep_as=kept,
                )
            except KernelhubError as exc:
                live.last_active = time.monotonic()  # idle again from now before a next try
                if time.monotonic() - t0 < timeout:
                    raise
                raise KernelError(
                    f"its hibernation snapshot ran past the {timeout:g} s deadline ({knob}) "
                    f"and was stopped; the session stays awake ({exc})"
                ) from exc
            if kernel.running is not None or kernel.queue_length or live.last_active > t0:
                # Used meanwhile (a cell was queued behind the capture): closing now would
                # cut that cell short and wake to the state from before it.
                await self.drop_snapshot(info.id)
                self._spawn(self._remove_capture(kernel, kept))
                log.info("session %s was used while hibernating; it stays awake", live.id)
                return
            # Listed as hibernated only once the sandbox is really gone; a request that
            # arrives meanwhile waits (the state machine: ready, with no kernel yet), then
            # finds it hibernated and wakes it, after this lock. The state directory stays
            # unless told otherwise: the wake restores from the capture kept there (the blob
            # is for when it is gone), and rewind from its checkpoints.
            live.kernel, live.hibernating = None, True
            try:
                await kernel.close(keep_state=gateway.hibernate_keep_state)
            finally:
                live.hibernating = False
                live.hibernation = info.id
                live.move(Transition.HIBERNATE)
            if gateway.hibernate_standby:
                modules = list(info_modules(await self.snapshots_store.get_snapshot(info.id)))
                live.standby = asyncio.ensure_future(self.standby.start(live, modules))
            await self.recorder.phase(live)
            await self.recorder.audit(
                AuditEntry(
                    principal=None,
                    action="session.hibernate",
                    session_id=live.id,
                    detail={"snapshot": info.id},
                )
            )
            log.info("session %s hibernated (snapshot %s)", live.id, info.id)

    async def drop_snapshot(self, snapshot_id: str) -> None:
        await self.snapshots_store.delete_snapshot(snapshot_id)
        await self.blobs.delete(snapshot_id)  # in the bucket too, with object storage

    async def wake(self, live: LiveSession, first_seq: int) -> None:
        """Bring a hibernated session back (its caller holds ``live.wake_lock``): a new
        sandbox, the hibernation snapshot restored into it, then dropped."""
        assert live.hibernation is not None
        t0 = time.monotonic()
        owner = Principal(name=live.stored.owner)
        saved = list(live.checkpoints)  # still in the state directory, for rewind
        standby = await self.standby.take(live)
        kernel = standby or await self.standby.start_kernel(live, first_seq=first_seq)
        kernel.advance_seq(first_seq)  # a standby numbered from when it was started
        started = time.monotonic() - t0
        self._bind(live, kernel)
        try:
            snap = await self.get_snapshot(owner, live.hibernation)
            kept = kept_capture(kernel, snap.metadata.get("capture_dir"))
            if kept is not None:
                report = await self._restore_kept(live, kernel, snap, kept)
                live.checkpoints = [*saved, (report.execution_count or 0, kept)]
            else:
                report = await self.restore_into(owner, live, kernel, live.hibernation)
        except BaseException:
            # Unbound first: the watch on this kernel then takes its exit for what it is
            # (a wake given up, the session still hibernated), not for a death to revive.
            live.kernel = None
            await kernel.close()
            raise
        snapshot, live.hibernation = live.hibernation, None
        live.move(Transition.WOKE)
        await self.recorder.phase(live, reason="")
        await self.drop_snapshot(snapshot)
        log.info(
            "session %s woke in %.2f s: sandbox %s in %.2f s, restored from %s",
            live.id,
            time.monotonic() - t0,
            "on standby" if standby else "started",
            started,
            "the kept capture" if live.checkpoints else "the blob",
        )
        message = (
            f"woke from hibernation in {time.monotonic() - t0:.2f} s: "
            f"{len(report.restored)} variables restored"
            + (f", not restored: {report.failed}" if report.failed else "")
        )
        kernel.notice(message)

    # -- snapshots ---------------------------------------------------------------------

    async def snapshot(
        self, principal: Principal, live: LiveSession, kernel: KernelSession, client: str | None
    ) -> SnapshotInfo:
        """Capture the namespace and /workspace inside the sandbox, move the result out as
        an opaque blob, bind it to its owner with a MAC. The host never opens it."""
        timeout = self.settings.gateway.snapshot_timeout
        return await self.capture(principal, live, kernel, client, kind="snapshot", timeout=timeout)

    async def capture(
        self,
        principal: Principal,
        live: LiveSession,
        kernel: KernelSession,
        client: str | None,
        *,
        kind: str,
        timeout: float,
        base: str | None = None,
        keep_as: str | None = None,
    ) -> SnapshotInfo:
        """``kind`` "checkpoint" (a node's export of the session's state) runs as a
        background call: it never makes the session read busy.
        ``base``: a checkpoint to capture incrementally from (its unchanged groups are
        hard-linked, so the state directory need not hold the namespace twice).
        ``keep_as``: the capture's directory, left in the state directory (hibernation
        wakes from it without moving the blob back in)."""
        quiet = kind == "checkpoint"
        session_id = live.id
        name = keep_as or f"snap-{uuid.uuid4().hex[:12]}"
        t0 = time.monotonic()
        if keep_as is not None:
            # Kept in the state directory (incremental from ``base``): the wake restores
            # from it. The blob below is the fallback for when the state directory is gone.
            try:
                await ops.run(kernel, calls.capture(name, base), timeout=timeout, background=quiet)
            except KernelhubError:  # a capture cut short may have left part of its files
                self._spawn(self._remove_capture(kernel, name))
                raise
        snapshot_id = uuid.uuid4().hex[:16]
        limit = self.settings.gateway.max_snapshot_bytes
        # Streamed from the kernel's pickler to the blob file, nothing staged in the
        # sandbox; the socket, the hash and the disk are on worker threads.
        target = self.blobs.prepare(snapshot_id)
        spans: dict[str, object] = {}
        called_at = time.time()
        try:
            (size, sha256), result = await transfer.alongside(
                transfer.pull(kernel.sandbox.session_dir, name, target, limit, timeout, spans),
                ops.run(kernel, calls.capture_stream(name), timeout=timeout, background=quiet),
            )
            answered_at = time.time()
            spans.update(calls.call_spans(result, called_at, answered_at))
            # In the bucket before its row; a hibernation wakes from the kept capture.
            await self.blobs.commit(snapshot_id, cache=kind == "snapshot")
            spans["commit"] = round(time.time() - answered_at, 6)
        except BaseException:
            self.blobs.remove(snapshot_id)
            if keep_as is not None:
                self._spawn(self._remove_capture(kernel, name))
            raise
        metadata = {
            "kind": kind,
            "duration": time.monotonic() - t0,
            "execution_count": result.get("execution_count"),
            "saved": list(result.get("saved", [])),
            "skipped": {str(k): str(v) for k, v in dict(result.get("skipped", {})).items()},
            "kernel": {
                "size_bytes": result.get("size_bytes"),
                "duration": result.get("duration"),
                "timings": result.get("timings"),
            },
            "host": spans,
        }
        if keep_as is not None:
            metadata["capture_dir"] = keep_as
            metadata["modules"] = top_modules(result.get("imports"))
        stored = StoredSnapshot(
            id=snapshot_id,
            session_id=session_id,
            owner=live.stored.owner,
            created_at=datetime.now(UTC),
            size=size,
            sha256=sha256,
            mac=self.blobs.mac(snapshot_id, live.stored.owner, sha256),
            metadata=metadata,
        )
        await self.snapshots_store.insert_snapshot(stored)
        await self.recorder.audit(
            AuditEntry(
                principal=principal.name,
                action="snapshot.create",
                session_id=session_id,
                client=client,
                duration=metadata["duration"],
                detail={"snapshot": snapshot_id, "bytes": size, "skipped": metadata["skipped"]},
            )
        )
        return _snapshot_info(stored)

    async def _remove_capture(self, kernel: KernelSession, name: str) -> None:
        """Remove a capture's files in the sandbox when the kernel gets to it. Not awaited
        by the capture: a cell queued meanwhile may run for hours, and a hibernation slot
        must not wait for it."""
        with contextlib.suppress(KernelhubError):
            await ops.run(kernel, calls.remove(name), timeout=60)

    async def snapshots(self, principal: Principal) -> list[SnapshotInfo]:
        mine = await self.snapshots_store.list_snapshots(principal.name)
        return [_snapshot_info(s) for s in mine if s.metadata.get("kind") == "snapshot"]

    async def get_snapshot(self, principal: Principal, snapshot_id: str) -> StoredSnapshot:
        snap = await self.snapshots_store.get_snapshot(snapshot_id)
        if snap is None or snap.owner != principal.name:
            raise NotFoundError(f"no snapshot {snapshot_id!r} (or it is not yours)")
        return snap

    async def delete_snapshot(self, principal: Principal, snapshot_id: str) -> None:
        snap = await self.get_snapshot(principal, snapshot_id)
        await self.drop_snapshot(snap.id)

    async def restore_into(
        self, principal: Principal, live: LiveSession, kernel: KernelSession, snapshot_id: str
    ) -> RestoreReport:
        """Only the owner restores; the blob's MAC is checked before any sandbox sees it,
        and it is only ever loaded inside this brand-new sandbox."""
        snap = await self.get_snapshot(principal, snapshot_id)
        t0, timeout = time.monotonic(), self.settings.gateway.snapshot_timeout
        # Downloaded first (and checked) if another node made it.
        limit = self.settings.gateway.max_snapshot_bytes
        source = await self.blobs.fetch(snap.id, snap.owner, snap.sha256, snap.mac, limit)
        name = f"restore-{uuid.uuid4().hex[:12]}"
        # Hashed once, as it streams; the kernel loads nothing unless the MAC matched.
        accept = transfer.mac_check(
            snap.sha256, lambda sha: self.blobs.mac(snap.id, snap.owner, sha), snap.mac
        )
        _, result = await transfer.alongside(
            transfer.push(
                kernel.sandbox.session_dir,
                name,
                source,
                accept,
                timeout,
                transfer.algorithm_of(snap.sha256),
            ),
            ops.run(kernel, calls.restore_stream(name), timeout=timeout),
        )
        return await self._restore_report(live, snap, result, time.monotonic() - t0)

    async def _restore_kept(
        self, live: LiveSession, kernel: KernelSession, snap: StoredSnapshot, directory: str
    ) -> RestoreReport:
        """Wake from the hibernation capture still in the state directory: no blob to
        move in."""
        t0 = time.monotonic()
        result = await ops.run(
            kernel, calls.restore(directory), timeout=self.settings.gateway.snapshot_timeout
        )
        return await self._restore_report(live, snap, result, time.monotonic() - t0)

    async def _restore_report(
        self, live: LiveSession, snap: StoredSnapshot, result: dict[str, Any], duration: float
    ) -> RestoreReport:
        report = RestoreReport(
            snapshot_id=snap.id,
            restored=list(result.get("restored", [])),
            failed={str(k): str(v) for k, v in dict(result.get("failed", {})).items()},
            skipped={str(k): str(v) for k, v in dict(result.get("skipped", {})).items()},
            rebuilt={str(k): str(v) for k, v in dict(result.get("rebuilt", {})).items()},
            execution_count=result.get("execution_count"),
            duration=duration,
        )
        await self.recorder.audit(
            AuditEntry(
                principal=snap.owner,
                action="snapshot.restore",
                session_id=live.id,
                duration=report.duration,
                detail={"snapshot": snap.id, "failed": report.failed},
            )
        )
        return report


def hibernate_deadline(hibernate_timeout: float, snapshot_timeout: float) -> tuple[float, str]:
    """Seconds a hibernation's capture may take, and the variable that sets them: the
    lower of its own bound and the one on every capture."""
    if hibernate_timeout <= snapshot_timeout:
        return hibernate_timeout, "KERNELHUB_GATEWAY__HIBERNATE_TIMEOUT"
    return snapshot_timeout, "KERNELHUB_GATEWAY__SNAPSHOT_TIMEOUT"


def no_checkpoint_before(before_cell: int, policy: str | float) -> str:
    """Why a rewind to before ``before_cell`` cannot be done."""
    if policy == "off":
        return (
            f"no checkpoint before cell {before_cell}; create the session with "
            '"checkpoints": "every_cell" to be able to rewind'
        )
    return (
        f"no checkpoint before cell {before_cell}: the cells before it ran back to back "
        "(a checkpoint is taken once the session has been idle "
        "KERNELHUB_GATEWAY__CHECKPOINT_GRACE seconds after a cell); rewind to before "
        "cell 1 for an empty kernel"
    )


def rewound(before_cell: int, after: int | None) -> str:
    """The notice of a rewind that restored the checkpoint after cell ``after``."""
    text = (
        f"rewound to the state before cell {before_cell}; the effects of cells "
        f"{before_cell} and later are undone (files written since are kept)"
    )
    if after is not None and after < before_cell - 1:
        first, last = after + 1, before_cell - 1
        cells = f"cell {first}" if first == last else f"cells {first}-{last}"
        text = (
            f"rewound to the state after cell {after}, the last checkpoint before cell "
            f"{before_cell}: {cells} ran back to back with cell {before_cell} and had no "
            f"checkpoint of their own, so their effects are undone too, with those of "
            f"cells {before_cell} and later (files written since are kept)"
        )
    return text


def idle_wait(after: float, failures: int) -> float:
    """Seconds a session must be idle before a hibernation try: ``after``, doubled for
    each try that failed in a row (at most 64 times ``after``)."""
    return after * (1 << min(failures, 6))


def _snapshot_info(s: StoredSnapshot) -> SnapshotInfo:
    m = s.metadata
    return SnapshotInfo(
        id=s.id,
        session_id=s.session_id,
        created_at=s.created_at,
        size_bytes=s.size,
        duration=float(m.get("duration", 0.0)),
        execution_count=m.get("execution_count"),
        saved=list(m.get("saved", [])),
        skipped=dict(m.get("skipped", {})),
        host_timings=dict(m.get("host", {})),
        kernel_timings=calls.kernel_timings(m.get("kernel")),
    )
