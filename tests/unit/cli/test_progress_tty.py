"""The build display on a terminal (kernelhub/cli/progress.py): one status line redrawn
in place by its ticker thread, erased when the stage ends; its width from a real pty."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios
import threading
import time
from pathlib import Path

import pytest

from kernelhub.cli.progress import _ERASE_LINE, SPINNER, BuildDisplay, _columns
from tests.conftest import UNIT


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _wait_for(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout * UNIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_a_terminal_gets_a_redrawn_status_line_then_the_stage_result(tmp_path: Path) -> None:
    out = Terminal()
    with BuildDisplay(tmp_path / "build.log", out) as show:
        show("==> [1/2] wheels")
        show("Collecting numpy\x1b[31m red\x1b[0m")
        _wait_for(lambda: "Collecting numpy" in out.getvalue(), 5)
        drawn = out.getvalue()
    assert drawn.startswith(_ERASE_LINE) and "[1/2] wheels" in drawn
    assert drawn.split(_ERASE_LINE)[1][0] in SPINNER and "\x1b[31m" not in drawn
    assert "[1/2] wheels ..." not in drawn  # the non-terminal start line is not printed
    assert out.getvalue().endswith("\n") and f"{_ERASE_LINE}✓ [1/2] wheels  " in out.getvalue()
    assert not any(t.name == "build-display" and t.is_alive() for t in threading.enumerate())


def test_a_failure_on_a_terminal_marks_the_stage_and_names_the_log(tmp_path: Path) -> None:
    out, log = Terminal(), tmp_path / "build.log"
    with pytest.raises(RuntimeError), BuildDisplay(log, out) as show:
        show("==> [2/2] docker build")
        raise RuntimeError("boom")
    text = out.getvalue()
    assert f"{_ERASE_LINE}✗ [2/2] docker build  " in text
    assert text.endswith(f"the full build output is in {log}\n")


def test_verbose_on_a_terminal_prints_lines_and_draws_no_status(tmp_path: Path) -> None:
    out = Terminal()
    with BuildDisplay(tmp_path / "build.log", out, verbose=True) as show:
        show("==> [1/1] base")
        show("I: Retrieving")
    assert _ERASE_LINE not in out.getvalue()
    assert out.getvalue().splitlines()[:2] == ["==> [1/1] base", "I: Retrieving"]


def test_columns_of_a_real_pty_and_of_things_that_are_not_terminals() -> None:
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
            assert _columns(tty) == 132
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            assert _columns(tty) == 80  # a pty whose size nobody set
    finally:
        os.close(leader)
        os.close(follower)
    assert _columns(io.StringIO()) == 80
