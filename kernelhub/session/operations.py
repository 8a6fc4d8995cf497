"""What callers do with a session they hold: submit cells and act on running ones,
pause and resume, files, kernelhub's own calls, and the entry points of continuity.

Each operation asks the state machine first (:meth:`LiveSession.allows`) and acts on its
verdict in one place, :meth:`Operations.kernel_for`: the kernel at once, after a wait
(starting, recovering), after a wake-up (hibernated), or the refusal naming both states.
The manager owns the registry these sessions come from (``get``) and exposes these
methods as its own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from kernelhub.config import Settings
from kernelhub.errors import (
    InvalidRequestError,
    NotFoundError,
    QuotaError,
    SessionError,
    SessionStateError,
)
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.models import Event, ExecutionStatus
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import InFlight, LiveSession, held
from kernelhub.session.recorder import Recorder
from kernelhub.session.state import Operation, SessionState, Verdict
from kernelhub.store.base import Store
from kernelhub.store.quota import StorageGuard
from kernelhub.store.records import AuditEntry, Principal, StoredExecution
from kernelhub.wire import ExecutionCreate, RewindReport, SessionInfo, SnapshotInfo


class Operations:
    """See the module. ``get`` resolves the caller's session (``SessionClosedError`` or
    ``NotFoundError`` when it has none by that id); ``info`` answers with its state."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        recorder: Recorder,
        continuity: Continuity,
        storage: StorageGuard,
        sessions: dict[str, LiveSession],
        *,
        get: Callable[[Principal, str], Awaitable[LiveSession]],
        info: Callable[[Principal, str], Awaitable[SessionInfo]],
    ) -> None:
        self.settings = settings
        self.store = store  # reads only: the recorder writes
        self.recorder = recorder
        self.continuity = continuity
        self.storage = storage
        self.sessions = sessions
        self._get = get
        self._info = info

    # -- executions --------------------------------------------------------------------

    async def submit(
        self,
        principal: Principal,
        session_id: str,
        body: ExecutionCreate,
        client: str | None = None,
    ) -> tuple[StoredExecution, ExecutionHandle | None, bool]:
        """Queue a cell. Returns (row, handle, created). With a known idempotency key the
        first execution is returned (``created`` False) and nothing runs.

        The fast case never suspends: an awake kernel and no idempotency key, the cell
        goes to the kernel in the caller's loop turn (its row joins the pending commit).
        A caller that cannot wait (the WebSocket's receive callback) starts this with
        :func:`kernelhub.eager.start` and has it done at once; with a key, the one store
        round trip that inserts the row (or finds the first use of the key) comes first."""
        live = held(self.sessions, principal, session_id) or await self._get(principal, session_id)
        live.last_active = time.monotonic()
        kernel = live.ready_kernel(Operation.EXECUTE)
        key = body.idempotency_key
        if key is not None and kernel is None:
            # It has to wait or wake first: ask the store before, the key may be used.
            existing = await self.store.execution_by_key(principal.name, key)
            if existing is not None:
                return self._reused(live, existing, key)
        if kernel is None:
            kernel = await self.kernel_for(live, Operation.EXECUTE)
        row = self._new_execution(principal, live, kernel, body)
        if key is None:
            handle = await self._start(live, kernel, row, body, client)
            self.recorder.execution(row)  # the kernel first, the bookkeeping after
            return row, handle, True
        stored = await self.recorder.keyed_execution(row)
        if stored.id != row.id:  # used before (maybe before a restart), or a concurrent retry
            return self._reused(live, stored, key)
        kernel = live.ready_kernel(Operation.EXECUTE) or await self.kernel_for(
            live, Operation.EXECUTE
        )
        return row, await self._start(live, kernel, row, body, client), True

    def _reused(
        self, live: LiveSession, existing: StoredExecution, key: str
    ) -> tuple[StoredExecution, ExecutionHandle | None, bool]:
        if existing.session_id != live.id:
            raise InvalidRequestError(f"idempotency_key {key!r} was used for another session")
        return existing, live.kernel.get(existing.id) if live.kernel else None, False

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
            id=os.urandom(16).hex(),  # uuid4().hex without building a UUID
            session_id=live.id,
            owner=principal.name,
            code=body.code,
            status=ExecutionStatus.QUEUED,
            idempotency_key=body.idempotency_key,
            created_at=datetime.now(UTC),
            record=None,
        )

    @staticmethod
    async def _start(
        live: LiveSession,
        kernel: KernelSession,
        row: StoredExecution,
        body: ExecutionCreate,
        client: str | None,
    ) -> ExecutionHandle:
        kwargs = {} if body.timeout is None else {"timeout": body.timeout}
        # The kernel first (an idle kernel gets the cell right here), the bookkeeping after.
        handle = await kernel.submit(
            body.code, execution_id=row.id, keep_events=body.wait, **kwargs
        )
        live.inflight[row.id] = InFlight(principal=row.owner, code=body.code, client=client)
        return handle

    async def kernel_for(self, live: LiveSession, operation: Operation) -> KernelSession:
        """The session's kernel for ``operation``, as the state machine says: at once,
        after a wait (starting, or recovering from a crash: requests wait rather than
        fail), or after waking it from hibernation; its refusal otherwise."""
        live.last_active = time.monotonic()
        patience = self.settings.engine.start_timeout + 60
        deadline = time.monotonic() + patience
        while True:
            verdict = live.allows(operation)
            kernel = live.kernel
            if verdict is Verdict.RUN and kernel is not None:
                return kernel
            if verdict is Verdict.WAKE:
                async with live.wake_lock:
                    if live.phase == SessionState.HIBERNATED:
                        await self.continuity.wake(live, await self.store.last_seq(live.id))
                continue
            if time.monotonic() > deadline:
                state = live.state.value
                raise SessionStateError(
                    f"session {live.id} is still {state} after {patience:g} s: cannot "
                    f"{operation.value}; retry later, or create a new session",
                    state=state,
                    operation=operation.value,
                )
            # Liveness is the engine's, recovery the watcher's: a bounded poll.
            await asyncio.sleep(0.05)

    def kernel_now(self, live: LiveSession, operation: Operation) -> KernelSession:
        """The kernel for an operation that does not wait (interrupt, cancel, input)."""
        kernel = live.ready_kernel(operation)
        if kernel is None:
            state = live.state.value
            raise SessionStateError(
                f"session {live.id} is {state}: cannot {operation.value} now; retry shortly",
                state=state,
                operation=operation.value,
            )
        return kernel

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
        recent = self.recorder.recent(execution_id)
        if row.record is None and recent is not None:
            row = row.model_copy(update={"status": recent.status, "record": recent})
        if row.record is not None and events:
            if live is not None:
                await live.fanout.flush()
            return row, await self.store.events_of(execution_id)
        return row, None

    async def _audit(
        self, principal: Principal, action: str, session_id: str, **fields: Any
    ) -> None:
        await self.recorder.audit(
            AuditEntry(principal=principal.name, action=action, session_id=session_id, **fields)
        )

    async def interrupt(self, principal: Principal, execution_id: str) -> StoredExecution:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        kernel = self.kernel_now(live, Operation.INTERRUPT)
        running = kernel.running
        if running is None or running.id != execution_id:
            raise SessionError(
                f"execution {execution_id} is {row.status.value}, not running; only a running execution can be interrupted"
            )
        await kernel.interrupt()
        await self._audit(principal, "execution.interrupt", live.id, execution_id=execution_id)
        return row

    async def cancel(self, principal: Principal, execution_id: str) -> StoredExecution:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        if not self.kernel_now(live, Operation.CANCEL).cancel(execution_id):
            raise SessionError(
                f"execution {execution_id} is {row.status.value}; only a queued execution can be cancelled"
            )
        await self._audit(principal, "execution.cancel", live.id, execution_id=execution_id)
        return (await self.execution(principal, execution_id))[0]

    async def send_input(self, principal: Principal, execution_id: str, value: str) -> None:
        row, _ = await self.execution(principal, execution_id)
        live = await self._get(principal, row.session_id)
        kernel = self.kernel_now(live, Operation.INPUT)
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
        live = await self._get(principal, session_id)
        kernel = await self.kernel_for(live, Operation.PAUSE if pause else Operation.RESUME)
        await (kernel.pause() if pause else kernel.resume())
        action = "session.pause" if pause else "session.resume"
        await self._audit(principal, action, session_id, client=client)
        return await self._info(principal, session_id)

    # -- continuity (see Continuity) ------------------------------------------------------

    async def snapshot(
        self, principal: Principal, session_id: str, client: str | None = None
    ) -> SnapshotInfo:
        live = await self._get(principal, session_id)
        self.storage.check_disk()  # a low disk refuses snapshots; hibernation frees memory
        kernel = await self.kernel_for(live, Operation.SNAPSHOT)
        return await self.continuity.snapshot(principal, live, kernel, client)

    async def rewind(
        self, principal: Principal, session_id: str, before_cell: int, client: str | None = None
    ) -> RewindReport:
        live = await self._get(principal, session_id)
        kernel = await self.kernel_for(live, Operation.REWIND)
        return await self.continuity.rewind(principal, live, kernel, before_cell, client)

    async def restart(
        self, principal: Principal, session_id: str, client: str | None = None
    ) -> None:
        live = await self._get(principal, session_id)
        kernel = await self.kernel_for(live, Operation.RESTART)
        await self.continuity.restart(principal, live, kernel, client)

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
        kernel = await self.kernel_for(live, Operation.FILES)
        size = await kernel.write_file(path, chunks, self.settings.gateway.max_file_bytes)
        detail = {"path": path, "bytes": size}
        await self._audit(principal, "file.upload", session_id, client=client, detail=detail)
        return size

    async def download(
        self, principal: Principal, session_id: str, path: str, client: str | None = None
    ) -> AsyncIterator[bytes]:
        """The file's chunks; errors (missing, symlink, too large) raise before the first."""
        live = await self._get(principal, session_id)
        kernel = await self.kernel_for(live, Operation.FILES)
        chunks = kernel.read_file(path, self.settings.gateway.max_file_bytes)
        first = await anext(chunks, b"")
        detail = {"path": path}
        await self._audit(principal, "file.download", session_id, client=client, detail=detail)

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
        kernel = await self.kernel_for(live, Operation.CALL)
        return await kernel.call(code, expressions, timeout=timeout)
