"""How the CLI prints each kind of execution event (kernelhub/cli/output.py
``Console.event``), on a pseudo-terminal where sandbox text is filtered and on plain
streams where it passes as is."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

from kernelhub.cli.output import Console
from kernelhub.models import (
    CellError,
    DisplayEvent,
    ErrorEvent,
    NoticeEvent,
    ResultEvent,
    TruncatedEvent,
)

PNG = b"\x89PNG\r\n\x1a\n not really"


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(out, io.StringIO()), out


def test_results_displays_errors_truncation_and_notices(tmp_path: Path) -> None:
    console, out = _console()
    console.event(ResultEvent(execution_id="e", data={"text/plain": "42"}, execution_count=3))
    console.event(DisplayEvent(execution_id="e", data={"text/html": "<b>", "text/plain": "b"}))
    png = DisplayEvent(execution_id="e", seq=9, data={"image/png": base64.b64encode(PNG).decode()})
    console.event(png)  # no plots directory: named, not saved
    console.event(png, plots=tmp_path)
    console.event(ErrorEvent(execution_id="e", error=CellError(name="E", value="v", traceback=[])))
    trace = CellError(name="E", value="v", traceback=["Traceback:", "E: v"])
    console.event(ErrorEvent(execution_id="e", error=trace))
    console.event(
        TruncatedEvent(execution_id="e", limit_bytes=1000, dropped_bytes=23, dropped_events=1)
    )
    console.event(NoticeEvent(execution_id="e", message="the session was paused"))
    saved = tmp_path / "plot-9.png"
    assert out.getvalue().splitlines() == [
        "Out[3]: 42",
        "[display: text/html, text/plain]",
        "[display: image/png]",
        f"[image/png saved to {saved}]",
        "E: v",
        "Traceback:",
        "E: v",
        "[output truncated: 23 bytes over the 1000-byte cap]",
        "[kernelhub: the session was paused]",
    ]
    assert saved.read_bytes() == PNG


def test_on_a_terminal_the_sandboxs_escapes_are_defused_in_our_lines() -> None:
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            console = Console(tty, tty)
            hostile = "\x1b]0;pwned\x07\x1b[2J42"
            cleaned = console.clean(hostile)
            plain = Console(io.StringIO(), io.StringIO()).clean(hostile)
    finally:
        os.close(leader)
        os.close(follower)
    assert "\x1b]0;" not in cleaned and "\x1b[2J" not in cleaned and "42" in cleaned
    assert plain == hostile  # not a terminal: nothing to protect, kept as is
