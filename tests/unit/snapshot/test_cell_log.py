"""The cell log (``kernel-image/kernelhub_kernel/cell_log.py``), fed IPython's cell events
and audit events by hand: which cells had effects outside the session."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

PATH = Path(__file__).resolve().parents[3] / "kernel-image" / "kernelhub_kernel" / "cell_log.py"


def load() -> types.ModuleType:
    name = "kernelhub_kernel_cell_log_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


cell_log = load()


def run(log: Any, source: str, events: list[tuple[str, tuple[Any, ...]]], ok: bool = True) -> Any:
    log._pre_run_cell(types.SimpleNamespace(raw_cell=source))
    for event, args in events:
        log._audit(event, args)
    log._post_run_cell(types.SimpleNamespace(success=ok))
    return log.cells[-1]


@pytest.mark.parametrize(
    ("events", "effect"),
    [
        ([("open", ("/w/out.csv", "w", 0))], "opened /w/out.csv for writing"),
        ([("open", ("/w/log", None, os.O_WRONLY | os.O_APPEND))], "opened /w/log for writing"),
        ([("subprocess.Popen", ("ls", ["ls"], None, None))], "subprocess.Popen"),
        ([("socket.connect", (None, ("127.0.0.1", 80)))], "socket.connect"),
        ([("os.remove", ("/w/x", -1))], "os.remove"),
        ([("_thread.start_new_thread", (print, (), {}))], "_thread.start_new_thread"),
    ],
)
def test_effects_outside_the_session_are_recorded(
    events: list[tuple[str, tuple[Any, ...]]], effect: str
) -> None:
    log = cell_log.CellLog()
    assert run(log, "x = 1", events).effects == [effect]


def test_reading_is_no_effect_but_a_file_that_changed_is(tmp_path: Path) -> None:
    log = cell_log.CellLog()
    data = tmp_path / "data.csv"
    data.write_text("a\n")
    assert run(log, "x = open('data.csv').read()", [("open", (str(data), "r", 0))]).effects == []
    db = tmp_path / "notes.db"
    log._pre_run_cell(types.SimpleNamespace(raw_cell="conn.execute('insert ...')"))
    log._audit("sqlite3.connect", (str(db),))
    db.write_bytes(b"SQLite format 3\0")  # what SQLite's own C code would do
    log._post_run_cell(types.SimpleNamespace(success=True))
    assert log.cells[-1].effects == [f"changed {db}"]


def test_cells_are_numbered_and_between_cells_nothing_is_recorded() -> None:
    log = cell_log.CellLog()
    log._audit("os.remove", ("/w/x", -1))  # the kernel's own work, between cells
    first = run(log, "a = 1", [])
    second = run(log, "b = 2", [], ok=False)
    assert (first.index, first.effects, first.success) == (0, [], True)
    assert (second.index, second.success) == (1, False)
