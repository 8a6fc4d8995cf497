"""Retention: ended sessions and old audit entries really leave the store, and the space
goes back to the filesystem.

A session that was deleted or died keeps its events, executions and internal snapshots
(hibernation, checkpoints) for ``KERNELHUB_STORAGE__RETENTION`` seconds after it ended,
then :class:`RetentionSweeper` purges them; ``DELETE /v1/sessions/{id}?purge=true`` (or a
retention of 0) purges at once. Snapshots a user took (``POST .../snapshots``) are the
user's own objects and stay until ``DELETE /v1/snapshots/{id}``.

Every step is bounded (a few hundred rows, a few MiB of pages) and runs off the loop (the
store's thread or connection), so neither the event loop nor the store's other callers
wait long behind a purge of a session that stored gigabytes. Freed space is returned by
the store's ``reclaim`` (SQLite: ``PRAGMA incremental_vacuum`` and WAL checkpoints, see
sqlite.py; PostgreSQL's autovacuum needs no help).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.base import Store

log = logging.getLogger(__name__)

# A delete step's rows adapt to how long the last step took: event rows range from a few
# bytes to MiBs, and a step should hold the store thread for about STEP_TIME seconds.
STEP_TIME = 0.02
VACUUM_PAGES = 1024  # pages returned per step (4 MiB at the default 4 KiB page size)
# Local blob files with no row left (a snapshot another node deleted) go this long after
# they were last written, checked this often: a row lookup per file, so not every sweep.
PRUNE_AFTER = 3600.0


class RetentionSweeper:
    """Purges sessions (on request, and when their retention is over) and old audit
    entries. Owned by the session manager: it awaits :meth:`purge`, and runs :meth:`run`
    as a task it cancels on close. ``on_purged(session_id)`` lets the owner drop what it
    still holds for a purged session (a dead one stays in its table until then)."""

    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        settings: StorageSettings,
        on_purged: Callable[[str], Awaitable[None]] | None = None,
        *,
        vacuum_pages: int = VACUUM_PAGES,
    ) -> None:
        self.store = store
        self.vacuum_pages = vacuum_pages
        self.blobs = blobs
        self.settings = settings
        self.on_purged = on_purged
        self._pruned_at: float | None = None
        self._lock = asyncio.Lock()  # one purge or sweep at a time: they share the vacuum

    async def purge(self, session_id: str) -> None:
        """Delete everything the store holds for the session, then return the space."""
        async with self._lock:
            await self._purge(session_id)
            await self._vacuum()

    async def _purge(self, session_id: str) -> None:
        rows = 16
        for table in ("events", "executions"):
            while True:
                t0 = time.monotonic()
                if not await self.store.purge_step(table, session_id, rows):
                    break
                took = time.monotonic() - t0
                if took > 2 * STEP_TIME:
                    rows = max(1, rows // 2)
                elif took < STEP_TIME / 2:
                    rows = min(4096, rows * 2)
        for snapshot_id in await self.store.drop_session(session_id):
            await self.blobs.delete(snapshot_id)
        if self.on_purged is not None:
            await self.on_purged(session_id)
        log.info("purged session %s from the store", session_id)

    async def _vacuum(self) -> None:
        before: int | None = None
        while True:
            left = await self.store.reclaim(self.vacuum_pages)
            # Until nothing is left, or a step freed nothing (auto_vacuum off): never spin.
            if left == 0 or (before is not None and left >= before):
                break
            before = left

    async def sweep(self, now: datetime | None = None) -> int:
        """One pass: purge sessions whose retention is over, trim the audit log. Returns
        the number of sessions purged."""
        now = now or datetime.now(UTC)
        async with self._lock:
            ended = await self.store.ended_before(now - timedelta(seconds=self.settings.retention))
            for session_id in ended:
                await self._purge(session_id)
            trimmed = 0
            if self.settings.audit_retention is not None:
                before = now - timedelta(seconds=self.settings.audit_retention)
                # Audit rows are small (their code is bounded): bigger steps.
                while n := await self.store.trim_audit(before, 4096):
                    trimmed += n
            if ended or trimmed:
                await self._vacuum()
            await self._prune_blobs()
        return len(ended)

    async def _prune_blobs(self) -> None:
        if self._pruned_at is not None and time.monotonic() - self._pruned_at < PRUNE_AFTER:
            return
        self._pruned_at = time.monotonic()

        async def has_row(snapshot_id: str) -> bool:
            return await self.store.get_snapshot(snapshot_id) is not None

        if pruned := await self.blobs.prune(has_row, PRUNE_AFTER):
            log.info("removed %d local snapshot files whose snapshots are gone", pruned)

    async def run(self) -> None:
        """Sweep every ``sweep_interval`` seconds until cancelled; a failed sweep is logged
        and tried again next time."""
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("the retention sweep failed; retrying in %.0f s",
                              self.settings.sweep_interval)  # fmt: skip
            await asyncio.sleep(self.settings.sweep_interval)
