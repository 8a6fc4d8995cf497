"""Exported checkpoints (issue #24): what another node restores a session from when this
node is lost.

A session's checkpoints live in its state directory on this node's disk (crash recovery
restores from them in a fresh sandbox on the same machine); they die with the machine.
So on a node agent, after a cell completes, a full capture of the session is also sent to
the shared snapshot storage (the :class:`~kernelhub.snapshot.blobs.BlobStore`, a bucket
once ``KERNELHUB_OBJECTS__*`` names one), at most every
``KERNELHUB_CLUSTER__CHECKPOINT_EXPORT_INTERVAL`` seconds, one at a time per session. It
is queued like a cell (the kernel captures between cells, never during one) and is not on
the finished cell's path: its client has its result already. The previous export is
dropped once the new one is stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kernelhub.cluster.adopt import CHECKPOINT_KIND
from kernelhub.config import Settings
from kernelhub.errors import KernelhubError
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import LiveSession
from kernelhub.store.base import Store
from kernelhub.store.records import Principal

log = logging.getLogger(__name__)


class CheckpointExport:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        continuity: Continuity,
        *,
        enabled: bool,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.continuity = continuity
        interval = settings.cluster.checkpoint_export_interval
        self.interval = interval if enabled else None
        self._spawn = spawn
        self._busy: set[str] = set()  # an exporter task runs for it
        self._dirty: set[str] = set()  # a cell completed since its last export began
        self._last: dict[str, float] = {}

    async def after_cell(
        self, live: LiveSession, kernel: KernelSession, handle: ExecutionHandle
    ) -> None:
        """The engine's hook after each cell: the session's checkpoint, then an export,
        now or (within the interval of the last one) once the interval is up; one at a
        time per session, the state after the latest cell."""
        await self.continuity.checkpoint(live, kernel, handle)
        record = handle.record
        if (
            self.interval is None
            or record is None
            or record.status != ExecutionStatus.COMPLETED
            or live.checkpoint_policy == "off"
        ):
            return
        self._dirty.add(live.id)
        if live.id not in self._busy:
            self._busy.add(live.id)
            self._spawn(self._exporter(live, kernel, self.interval))

    async def _exporter(self, live: LiveSession, kernel: KernelSession, interval: float) -> None:
        try:
            while live.id in self._dirty and live.kernel is kernel and kernel.alive:
                wait = self._last.get(live.id, -interval) + interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # the kernel may be gone by now (hibernated, closed)
                self._dirty.discard(live.id)
                self._last[live.id] = time.monotonic()
                await self._export(live, kernel)
        finally:
            self._busy.discard(live.id)
            if live.kernel is not kernel:  # hibernated, moved, deleted: nothing to keep
                self._last.pop(live.id, None)
                self._dirty.discard(live.id)

    async def _export(self, live: LiveSession, kernel: KernelSession) -> None:
        owner = Principal(name=live.stored.owner)
        try:
            info = await self.continuity.capture(
                owner, live, kernel, None, kind=CHECKPOINT_KIND,
                timeout=self.settings.gateway.snapshot_timeout,  # a full capture, as a snapshot
            )  # fmt: skip
            for s in await self.store.list_snapshots(live.stored.owner):
                if (
                    s.session_id == live.id
                    and s.metadata.get("kind") == CHECKPOINT_KIND
                    and s.id != info.id
                ):
                    await self.continuity.drop_snapshot(s.id)
            log.debug("session %s: checkpoint %s exported", live.id, info.id)
        except KernelhubError as exc:
            log.warning("exporting a checkpoint of session %s failed: %s", live.id, exc)
