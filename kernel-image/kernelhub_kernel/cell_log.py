"""A record of each cell as it ran: its source, whether it succeeded, how long it took,
and whether it had effects outside the session that re-running it would repeat.

Installed at kernel start (``launch``), before the first cell, because what a cell did
can only be seen while it runs. The snapshot helper reads it to decide which objects the
pickler cannot carry may be rebuilt after a restore by re-running the cell that made
them (``kernelhub_kernel.snapshot.replay``). Deliberately small and import-light: it
runs in every kernel, snapshots or not.

Effects outside the session are seen through ``sys.addaudithook`` (an audit hook cannot
be removed, so one is installed per process and does nothing between cells): writing or
creating files, deleting or renaming them, starting processes, opening network
connections, loading native code, starting threads. Files a cell opened for reading or
gave to ``sqlite3.connect`` are stat-ed before and after the cell: one that changed
(SQLite writes through its own C code, which no audit event shows) is an effect too.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_EFFECT_EVENTS = frozenset(
    {
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod",
        "os.chown", "os.link", "os.symlink", "os.utime", "os.system", "os.exec",
        "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
        "subprocess.Popen", "socket.connect", "socket.bind", "socket.sendto",
        "socket.sendmsg", "shutil.copyfile", "shutil.copytree", "shutil.move",
        "shutil.rmtree", "shutil.make_archive", "shutil.unpack_archive", "ctypes.dlopen",
        "_thread.start_new_thread", "webbrowser.open", "urllib.Request", "ftplib.connect",
        "smtplib.connect", "http.client.connect", "os.putenv", "os.unsetenv",
    }
)  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PREFIXES = (sys.prefix, sys.base_prefix, sys.exec_prefix)
MAX_CELLS = 2000
"""Cells kept (the oldest are dropped: a cell that old is not replayed)."""


@dataclass
class Cell:
    index: int
    source: str
    success: bool = False
    duration: float = 0.0
    effects: list[str] = field(default_factory=list)
    watched: dict[str, tuple[int, int] | None] = field(default_factory=dict)


class CellLog:
    """The cells of one kernel, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.cells: list[Cell] = []
        self.dropped = 0
        self._current: Cell | None = None
        self._started = 0.0

    def inherit(self, cells: list[Cell]) -> None:
        """Cells a restore re-ran (they made objects of this kernel), before the others."""
        self.cells[:0] = cells

    def install(self, shell: Any) -> None:
        shell.events.register("pre_run_cell", self._pre_run_cell)
        shell.events.register("post_run_cell", self._post_run_cell)
        sys.addaudithook(self._audit)

    def _pre_run_cell(self, info: Any) -> None:
        raw = getattr(info, "raw_cell", None)
        self._current = Cell(index=self.dropped + len(self.cells), source=str(raw or ""))
        self._started = time.perf_counter()

    def _post_run_cell(self, result: Any) -> None:
        cell, self._current = self._current, None
        if cell is None:
            return
        cell.duration = time.perf_counter() - self._started
        cell.success = bool(getattr(result, "success", False))
        for path, before in cell.watched.items():
            if _stat(path) != before:
                cell.effects.append(f"changed {path}")
        cell.watched = {}
        self.cells.append(cell)
        if len(self.cells) > MAX_CELLS:
            del self.cells[0]
            self.dropped += 1

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        cell = self._current
        if cell is None:
            return
        try:
            if event == "open":
                path, mode, flags = args
                if isinstance(path, int) or path is None:
                    return
                path = os.fsdecode(path)
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & _WRITE_FLAGS
                )
                if writes:
                    cell.effects.append(f"opened {path} for writing")
                elif path not in cell.watched and not path.startswith(_PREFIXES):
                    cell.watched[path] = _stat(path)
            elif event == "sqlite3.connect":
                database = os.fsdecode(args[0]) if args else ":memory:"
                if database != ":memory:" and database not in cell.watched:
                    cell.watched[database] = _stat(database)
            elif event in _EFFECT_EVENTS:
                cell.effects.append(event)
        except Exception:  # an audit hook must never break the audited call
            cell.effects.append(f"{event} (not understood)")


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


_LOG: CellLog | None = None


def install(shell: Any) -> CellLog:
    """Start recording (idempotent); the launcher calls it before the first cell."""
    global _LOG
    if _LOG is None:
        _LOG = CellLog()
        _LOG.install(shell)
    return _LOG


def log() -> CellLog | None:
    """The log, if recording was installed in this kernel."""
    return _LOG
