"""The cell log (``kernelhub_kernel/cell_log.py``) installed on IPython's real event
manager, with Python's real audit hook: what running code in a "cell" records."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from IPython.core.events import EventManager, available_events

from tests.unit.kernel_image.loader import load

cell_log = load("cell_log")


class Shell:
    """What ``install`` needs of IPython's shell: its event manager."""

    def __init__(self) -> None:
        self.events = EventManager(self, available_events)  # type: ignore[arg-type]

    def cell(self, source: str, body: Any) -> Any:
        self.events.trigger("pre_run_cell", types.SimpleNamespace(raw_cell=source))
        ok = True
        try:
            body()
        except Exception:
            ok = False
        self.events.trigger("post_run_cell", types.SimpleNamespace(success=ok))


@pytest.fixture(scope="module")
def shell_and_log() -> tuple[Shell, Any]:
    # An audit hook cannot be removed: one log for this module, idle between cells.
    shell = Shell()
    log = cell_log.CellLog()
    log.install(shell)
    return shell, log


def last(log: Any) -> Any:
    return log.cells[-1]


def test_writing_a_file_is_an_effect_reading_one_is_not(
    shell_and_log: tuple[Shell, Any], tmp_path: Path
) -> None:
    shell, log = shell_and_log
    target = tmp_path / "out.txt"
    shell.cell("write", lambda: target.write_text("x"))
    assert f"opened {target} for writing" in last(log).effects
    shell.cell("read", lambda: target.read_text())
    assert last(log).effects == [] and last(log).success


def test_a_failing_cell_is_recorded_as_failed_with_its_source(
    shell_and_log: tuple[Shell, Any],
) -> None:
    shell, log = shell_and_log
    shell.cell("1 / 0", lambda: 1 / 0)
    assert (last(log).source, last(log).success) == ("1 / 0", False)
    assert last(log).duration >= 0


def test_deleting_spawning_and_sqlite_writes_are_effects(
    shell_and_log: tuple[Shell, Any], tmp_path: Path
) -> None:
    shell, log = shell_and_log
    victim = tmp_path / "victim"
    victim.write_text("")
    shell.cell("rm", lambda: os.remove(victim))
    assert "os.remove" in last(log).effects
    shell.cell("spawn", lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
    assert "subprocess.Popen" in last(log).effects

    db = tmp_path / "notes.db"

    def write_db() -> None:
        with sqlite3.connect(db) as conn:
            conn.execute("create table t (x)")
        conn.close()

    shell.cell("sqlite", write_db)
    assert f"changed {db}" in last(log).effects

    def read_db() -> None:
        conn = sqlite3.connect(db)
        conn.execute("select * from t").fetchall()
        conn.close()

    shell.cell("sqlite read", read_db)
    assert f"changed {db}" not in last(log).effects


def test_nothing_is_recorded_between_cells(
    shell_and_log: tuple[Shell, Any], tmp_path: Path
) -> None:
    shell, log = shell_and_log
    shell.cell("noop", lambda: None)
    between = tmp_path / "between"
    between.write_text("kernel's own work")
    assert log._current is None
    shell.cell("noop again", lambda: None)
    assert not any(str(between) in e for c in log.cells[-2:] for e in c.effects)


def test_an_event_it_cannot_read_is_named_not_raised() -> None:
    log = cell_log.CellLog()
    log._pre_run_cell(types.SimpleNamespace(raw_cell="odd"))
    log._audit("open", ("too", "few"))
    log._audit("open", (3, "w", 0))  # an fd: no path to name
    log._audit("open", (b"/tmp/bytes-path", "w", 0))
    log._post_run_cell(types.SimpleNamespace(success=True))
    assert log.cells[-1].effects == ["open (not understood)", "opened /tmp/bytes-path for writing"]


def test_old_cells_are_dropped_past_the_cap_and_indices_keep_counting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cell_log, "MAX_CELLS", 3)
    log = cell_log.CellLog()
    for i in range(5):
        log._pre_run_cell(types.SimpleNamespace(raw_cell=f"c{i}"))
        log._post_run_cell(types.SimpleNamespace(success=True))
    assert [c.source for c in log.cells] == ["c2", "c3", "c4"]
    assert [c.index for c in log.cells] == [2, 3, 4] and log.dropped == 2
    log._post_run_cell(types.SimpleNamespace(success=True))  # no cell running: ignored
    assert len(log.cells) == 3
    inherited = [cell_log.Cell(index=-1, source="made it")]
    log.inherit(inherited)
    assert log.cells[0].source == "made it"


def test_install_is_once_per_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cell_log, "_LOG", None)
    installed: list[Any] = []
    monkeypatch.setattr(cell_log.CellLog, "install", lambda self, shell: installed.append(shell))
    assert cell_log.log() is None
    first = cell_log.install("shell")
    assert cell_log.install("shell") is first and cell_log.log() is first
    assert installed == ["shell"]
