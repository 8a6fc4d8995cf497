"""Storage accounting and the checks that refuse new work when there is no room.

:class:`StorageLedger` counts the bytes each principal has in the store (event bodies,
executions' code and final records) as the rows are written, never by scanning: the
store charges it inside each write and persists the per-session sums
(``sessions.stored_bytes``) in the same transaction. :class:`StorageGuard` is what the
session manager asks before it takes a new cell or session: the principal's quota, and
the data directory's free disk space (a cached ``statvfs``).

The quota counts what is stored *and* what the principal's unfinished cells may still
store (each its output cap, ``in_flight``): checking stored bytes alone, 64 cells queued
while under the quota would each write their cap after it was used up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kernelhub.config import StorageSettings
from kernelhub.errors import StorageFullError
from kernelhub.store.queries import Op, Query


class StorageLedger:
    """Bytes stored per session and per principal.

    Called by the store only, on whichever thread holds its connection at the time (the
    store never lets two use it at once), so the counters need no lock; :meth:`usage` is
    a plain read from the event loop."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._session_bytes: dict[str, int] = {}
        self._principal_bytes: dict[str, int] = {}
        self._unwritten: dict[str, int] = {}  # charged, not yet in sessions.stored_bytes

    def load(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """From the rows of ``LOAD``."""
        for session_id, owner, stored in rows:
            self.add_session(session_id, owner, stored)

    LOAD = "SELECT id, owner, stored_bytes FROM sessions"

    def add_session(self, session_id: str, owner: str, stored: int = 0) -> None:
        self._owner[session_id] = owner
        self._session_bytes[session_id] = stored
        self._principal_bytes[owner] = self._principal_bytes.get(owner, 0) + stored

    def charge(self, session_id: str, size: int) -> None:
        owner = self._owner.get(session_id)
        if owner is None or size <= 0:
            return
        self._session_bytes[session_id] += size
        self._principal_bytes[owner] += size
        self._unwritten[session_id] = self._unwritten.get(session_id, 0) + size

    @property
    def unwritten(self) -> bool:
        """Whether :meth:`write` has anything to do."""
        return bool(self._unwritten)

    def write(self) -> Op[None]:
        """Persist what was charged since the last call (the driver runs this at the end
        of every write transaction, so the sums commit with the rows they count)."""
        if not self._unwritten:
            return
        rows = [(size, sid) for sid, size in self._unwritten.items()]
        self._unwritten.clear()
        yield Query("UPDATE sessions SET stored_bytes = stored_bytes + ? WHERE id = ?", many=rows)

    def forget(self, session_id: str) -> int:
        """A purged session: its bytes no longer count. Returns them."""
        owner = self._owner.pop(session_id, None)
        size = self._session_bytes.pop(session_id, 0)
        self._unwritten.pop(session_id, None)
        if owner is not None:
            self._principal_bytes[owner] -= size
        return size

    def usage(self, principal: str) -> int:
        return self._principal_bytes.get(principal, 0)

    def session_bytes(self, session_id: str) -> int:
        return self._session_bytes.get(session_id, 0)


def disk_floor(settings: StorageSettings, total_bytes: int) -> int:
    """The free space below which new work is refused: the larger of the two floors."""
    return max(settings.min_free_bytes, int(settings.min_free_fraction * total_bytes))


def _statvfs(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class StorageGuard:
    """The admission check for new cells and sessions (see the module docstring)."""

    def __init__(
        self,
        settings: StorageSettings,
        ledger: StorageLedger,
        data_dir: Path,
        *,
        statvfs: Callable[[Path], tuple[int, int]] = _statvfs,
        clock: Callable[[], float] = time.monotonic,
        in_flight: Callable[[str], int] = lambda principal: 0,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.data_dir = data_dir
        self.in_flight = in_flight  # bytes a principal's running and queued cells may store
        self._statvfs = statvfs
        self._clock = clock
        self._disk: tuple[float, int, int] | None = None  # (read at, free, total)

    def quota(self, principal: str) -> int | None:
        if principal in self.settings.quotas:
            return self.settings.quotas[principal]
        return self.settings.quota_bytes

    def free_space(self) -> tuple[int, int]:
        """(free, total) bytes of the data directory's filesystem, at most
        ``disk_check_interval`` old: a statvfs per cell would be cheap, but not free."""
        now = self._clock()
        if self._disk is None or now - self._disk[0] >= self.settings.disk_check_interval:
            free, total = self._statvfs(self.data_dir)
            self._disk = (now, free, total)
        return self._disk[1], self._disk[2]

    def check(self, principal: str) -> None:
        """Raise :class:`StorageFullError` if ``principal`` may not store more now."""
        quota = self.quota(principal)
        used = self.ledger.usage(principal)
        if quota is not None and used >= quota:
            raise StorageFullError(
                f"storage quota used up: {principal!r} stores {used} bytes of events and "
                f"execution records, the quota is {quota} bytes; delete sessions with "
                "?purge=true to free space, or raise KERNELHUB_STORAGE__QUOTA_BYTES "
                "(per principal: KERNELHUB_STORAGE__QUOTAS)"
            )
        pending = self.in_flight(principal) if quota is not None else 0
        if quota is not None and used + pending >= quota:
            raise StorageFullError(
                f"storage quota reserved: {principal!r} stores {used} bytes and its running "
                f"and queued cells may store {pending} more (their output caps), the quota "
                f"is {quota} bytes; wait for those cells to finish, delete sessions with "
                "?purge=true, or raise KERNELHUB_STORAGE__QUOTA_BYTES (per principal: "
                "KERNELHUB_STORAGE__QUOTAS)",
                retry_after=2,
            )
        self.check_disk()

    def check_disk(self) -> None:
        """Raise :class:`StorageFullError` if the data directory's disk is below its floor
        (for work that writes there without counting against a quota: snapshots)."""
        if self.settings.min_free_bytes == 0 and self.settings.min_free_fraction == 0:
            return
        free, total = self.free_space()
        floor = disk_floor(self.settings, total)
        if free < floor:
            raise StorageFullError(
                f"the gateway's data directory {self.data_dir} has {free} bytes free, below "
                f"its floor of {floor} bytes; free disk space, or lower "
                "KERNELHUB_STORAGE__MIN_FREE_BYTES / KERNELHUB_STORAGE__MIN_FREE_FRACTION",
                retry_after=self.settings.disk_check_interval + 60,
            )
