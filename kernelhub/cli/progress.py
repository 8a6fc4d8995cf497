"""The quiet display of a long build: stages, a spinner with elapsed time, and the tools'
own output (debootstrap, pip, docker build: hundreds of lines) folded into a log file.

:class:`BuildDisplay` is the ``progress`` callback the image builders take: every line
goes to the log; lines starting ``==> `` begin a stage. On a terminal one status line is
redrawn in place; elsewhere (CI logs) each stage prints one line when it starts and one
when it ends. :func:`status_line` is the pure part.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TextIO

from kernelhub.terminal import strip_controls

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
#: How often the status line is redrawn on a terminal.
REDRAW_INTERVAL = 0.1
STAGE_PREFIX = "==> "
_ERASE_LINE = "\r\x1b[2K"


def status_line(stage: str, elapsed: float, last: str, frame: int, width: int) -> str:
    """``⠹ [2/4] wheels  12.3 s  Collecting numpy`` cut to ``width`` columns."""
    head = f"{SPINNER[frame % len(SPINNER)]} {stage}  {elapsed:5.1f} s"
    room = width - len(head) - 2
    tail = strip_controls(last, colours=False).replace("\t", " ").strip()
    if room < 8 or not tail:
        return head[:width]
    return f"{head}  {tail[:room]}"


class BuildDisplay:
    """Use as ``with BuildDisplay(log_path) as show: build_image(..., progress=show)``."""

    def __init__(
        self,
        log_path: Path,
        out: TextIO | None = None,
        *,
        verbose: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_path = log_path
        self.out = out or sys.stderr
        self.verbose = verbose
        self._clock = clock
        self._tty = bool(getattr(self.out, "isatty", lambda: False)()) and not verbose
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._stage_started = self._started = clock()
        self._last = ""
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._log: TextIO | None = None

    def __enter__(self) -> BuildDisplay:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w", encoding="utf-8", errors="replace")
        if self._tty:
            self._ticker = threading.Thread(target=self._tick, name="build-display", daemon=True)
            self._ticker.start()
        return self

    def __call__(self, line: str) -> None:
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()
        with self._lock:
            if line.startswith(STAGE_PREFIX):
                self._end_stage("done")
                self._stage = line[len(STAGE_PREFIX) :].strip()
                self._stage_started = self._clock()
                self._last = ""
                if not self._tty and not self.verbose:
                    self._write(f"{self._stage} ...\n")
            else:
                self._last = line
            if self.verbose:
                self._write(line + "\n")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._end_stage("done" if exc_type is None else "FAILED")
        if self._log is not None:
            self._log.close()
        if exc_type is not None:
            self._write(f"the full build output is in {self.log_path}\n")

    @property
    def elapsed(self) -> float:
        return self._clock() - self._started

    def _end_stage(self, outcome: str) -> None:
        if self._stage is None:
            return
        took = self._clock() - self._stage_started
        mark = "✓" if outcome == "done" else "✗"
        erase = _ERASE_LINE if self._tty else ""
        self._write(f"{erase}{mark} {self._stage}  {took:.1f} s\n")
        self._stage = None

    def _tick(self) -> None:
        frame = 0
        while not self._stop.wait(REDRAW_INTERVAL):
            frame += 1
            with self._lock:
                if self._stage is None:
                    continue
                width = _columns(self.out)
                line = status_line(
                    self._stage, self._clock() - self._stage_started, self._last, frame, width
                )
                self._write(_ERASE_LINE + line)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def _columns(out: TextIO) -> int:
    try:
        columns = os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns or 80  # a pty whose size nobody set says 0
