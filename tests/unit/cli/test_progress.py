"""The build display: stages and times on screen, every tool line in the log."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kernelhub.cli.progress import BuildDisplay, status_line


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


TOOL_LINES = [f"I: Retrieving package {n}" for n in range(569)]


def test_a_build_folds_tool_output_into_the_log(tmp_path: Path) -> None:
    out, clock, log = io.StringIO(), Clock(), tmp_path / "logs" / "build.log"
    with BuildDisplay(log, out, clock=clock) as show:
        show("==> [1/4] base image (auto)")
        for line in TOOL_LINES:
            show(line)
        clock.now += 42.0
        show("==> [2/4] wheels (pip download on the host)")
        show("$ pip download ...")
        clock.now += 3.5
    screen = out.getvalue().splitlines()
    assert screen == [
        "[1/4] base image (auto) ...",
        "✓ [1/4] base image (auto)  42.0 s",
        "[2/4] wheels (pip download on the host) ...",
        "✓ [2/4] wheels (pip download on the host)  3.5 s",
    ]
    logged = log.read_text().splitlines()
    assert logged[1:570] == TOOL_LINES and logged[-1] == "$ pip download ..."
    assert show.elapsed == pytest.approx(45.5)


def test_a_failed_build_names_its_stage_and_the_log(tmp_path: Path) -> None:
    out, log = io.StringIO(), tmp_path / "build.log"
    with pytest.raises(RuntimeError), BuildDisplay(log, out, clock=Clock()) as show:
        show("==> [3/4] docker build kernelhub/kernel:p1 (network disabled)")
        show("Step 7/12 : RUN pip install")
        raise RuntimeError("docker build failed")
    screen = out.getvalue()
    assert "✗ [3/4] docker build" in screen and f"the full build output is in {log}" in screen
    assert "Step 7/12" not in screen and "Step 7/12" in log.read_text()


def test_verbose_shows_everything(tmp_path: Path) -> None:
    out = io.StringIO()
    with BuildDisplay(tmp_path / "b.log", out, verbose=True, clock=Clock()) as show:
        show("==> [1/4] base")
        show("I: Retrieving libc6")
    assert "I: Retrieving libc6" in out.getvalue()


def test_status_line_fits_the_terminal_and_strips_escapes() -> None:
    line = status_line("[2/4] wheels", 12.34, "\x1b[31mCollecting numpy\x1b[0m" + "x" * 200, 3, 60)
    assert line.startswith("⠸ [2/4] wheels   12.3 s  Collecting numpy")
    assert len(line) <= 60 and "\x1b" not in line
    assert status_line("[1/4] base", 1.0, "", 0, 80) == "⠋ [1/4] base    1.0 s"
