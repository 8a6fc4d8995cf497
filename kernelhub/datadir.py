"""The data directory's owner: one gateway at a time, and the identity its sandboxes carry.

``DataDirLock.acquire`` takes an exclusive ``flock`` on ``<data_dir>/gateway.lock`` and
writes its pid there; a second ``kernelhub serve`` (or ``reap``) on the same directory
refuses before it opens the store, adopts, reaps or starts anything, naming the holder.
The kernel releases the lock when the process dies, however it dies: no stale lock files.

The lock also hands out the gateway's identity, a random id made once and kept in
``<data_dir>/gateway-id``. Every sandbox and directory the gateway creates is labelled with
it, and the reaper removes only what carries it: gateways with different data directories
never take each other's sandboxes for orphans, even under the same instance name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
from pathlib import Path

from kernelhub.errors import DataDirLockedError

LOCK_FILE = "gateway.lock"
ID_FILE = "gateway-id"
_ID = re.compile(r"^[0-9a-f]{16}$")


class DataDirLock:
    """Held for the life of the gateway process; ``release`` on clean shutdown."""

    def __init__(self, data_dir: Path, fd: int, gateway_id: str) -> None:
        self.data_dir = data_dir
        self.gateway_id = gateway_id
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLockedError(
                f"the data directory {data_dir} is in use by another kernelhub gateway "
                f"(pid {holder}); stop that one first, or give this one its own directory "
                "with KERNELHUB_DATA_DIR"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            gateway_id = _gateway_id(data_dir / ID_FILE)
        except BaseException:
            os.close(fd)
            raise
        return cls(data_dir, fd, gateway_id)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _gateway_id(path: Path) -> str:
    """Read the id, or make it (under the lock, so no two processes both make one)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if _ID.match(text):
        return text
    new = secrets.token_hex(8)
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new
