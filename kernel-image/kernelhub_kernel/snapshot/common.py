"""The snapshot format's constants, and what capture and restore share: the errors
they raise inside the kernel, a phase clock, a GC pause, and the writing of a snapshot
directory's files."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

FORMAT = "kernelhub-snapshot/1"
WORKSPACE_ENV = "KERNELHUB_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"
MANIFEST = "manifest.json"
IMPORTS = "imports.json"
"""Streamed only, first: the modules to import, so a restore imports them while it receives."""
GROUPS_DIR = "groups"
WORKSPACE_TAR = "workspace.tar"

SMALL_GROUP_BYTES = 1 << 20
"""Groups smaller than this are re-pickled at every capture and compared by digest."""
MAX_REACH_OBJECTS = 2_000_000
"""Per variable, how many objects the sharing analysis visits before giving up (noted)."""
SCAN_LIMIT_BYTES = 64 << 20
"""In-band pickles larger than this are not opcode-scanned for ``__main__`` references."""
_PARALLEL_HASH_BYTES = 8 << 20
_COPY_CHUNK = 1 << 20

_MISSING = object()


class _Refused(Exception):
    """An object that must not or cannot travel; ``reason`` names it for the user."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NeedsDill(Exception):
    """The C pickler met code defined in a cell: the group goes through dill instead."""


class _MemberFailed(Exception):
    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.index = index
        self.cause = cause


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, _Refused):
        return exc.reason
    if isinstance(exc, RecursionError):
        return "cannot be pickled: nested too deeply (RecursionError)"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"cannot be pickled: {type(exc).__name__}: {message}"[:500]


def _session_key(shell: Any) -> bytes:
    try:
        key = shell.kernel.session.key
    except AttributeError:
        return b""
    return bytes(key) if isinstance(key, (bytes, bytearray)) else b""


class _Clock:
    """Seconds spent in each phase, reported as ``timings`` (for the host's logs)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC passes while pickling or unpickling: millions of new containers
    would trigger many, for nothing (nothing becomes garbage meanwhile)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _prepare_dir(path: str) -> None:
    os.makedirs(os.path.join(path, GROUPS_DIR), mode=0o700, exist_ok=True)
    leftovers = [n for n in os.listdir(path) if n != GROUPS_DIR]
    leftovers += os.listdir(os.path.join(path, GROUPS_DIR))
    if leftovers:
        raise FileExistsError(
            f"snapshot directory {path} is not empty ({len(leftovers)} entries);"
            " pass a new directory for each snapshot"
        )


def _write_parts(path: str, parts: list[memoryview]) -> None:
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
