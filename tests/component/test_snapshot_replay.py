"""Objects the pickler cannot carry, rebuilt after a restore by re-running the cells
that made them, when those cells read only restored state and had no effects outside
the session (``kernelhub_kernel/snapshot/replay.py``, ``kernelhub_kernel/cell_log.py``);
the others named, with why and what to do. Between real kernels."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.component.conftest import SessionFactory
from tests.component.test_snapshot_stream import capture, restore

CELLS = [
    "import sqlite3, re, hashlib, threading",
    # Writes the database: an effect outside the session, so never re-run.
    "setup = sqlite3.connect('data.db')\nsetup.execute('create table t(x)')\n"
    "setup.execute('insert into t values (42)')\nsetup.commit()",
    "conn = sqlite3.connect('data.db')",
    "rows = conn.execute('select x from t').fetchall()",
    "pat = re.compile(r'(\\d+)-(\\d+)')\nm = pat.match('12-34')",
    "gen = (i * i for i in range(4))",
    "advanced = (i for i in range(4))\nfirst = next(advanced)",
    "consumed = (i for i in range(4))",
    "next(consumed)",
    "digest = hashlib.sha256(b'abc')",
    "text = 'a-b'",
    "late = re.match('(.)-(.)', text)",
    "text = 'changed'",
]


async def test_unpicklables_come_back_where_safe_and_the_rest_are_named(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    a = await open_session()
    for cell in CELLS:
        result = await a.execute(cell)
        assert result.error is None, (cell, result.error)
    blob = tmp_path / "a.blob"
    captured = await capture(a, blob)
    rebuildable = {"conn", "m", "gen", "advanced", "digest"}
    for name in rebuildable:
        assert "rebuilt at restore by re-running cell" in captured["skipped"][name], name

    b = await open_session()
    restored = await restore(b, blob)
    assert rebuildable <= set(restored["rebuilt"]), restored
    assert rebuildable <= set(restored["restored"])
    check = await b.execute(
        "print(conn.execute('select x from t').fetchall(), m.groups(), list(gen),"
        " next(advanced), digest.hexdigest())"
    )
    assert check.error is None, check.error
    expected = f"[(42,)] ('12', '34') [0, 1, 4, 9] 1 {hashlib.sha256(b'abc').hexdigest()}\n"
    assert check.stdout == expected
    lost = {**restored["skipped"], **restored["failed"]}
    assert "effects outside the session" in lost["setup"], lost["setup"]
    assert "changed it after it was made" in lost["consumed"], lost["consumed"]
    assert "changed text, which it was made from" in lost["late"], lost["late"]
    for name in ("setup", "consumed", "late"):
        assert "re-run the code that made it" in lost[name]
        assert name not in restored["rebuilt"]


async def test_rebuilt_objects_can_be_rebuilt_again_after_the_next_snapshot(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    a = await open_session()
    await a.execute("import re\nm = re.match('(x)', 'x')")
    await capture(a, tmp_path / "1.blob")
    b = await open_session()
    assert "m" in (await restore(b, tmp_path / "1.blob"))["rebuilt"]
    await capture(b, tmp_path / "2.blob")
    c = await open_session()
    assert "m" in (await restore(c, tmp_path / "2.blob"))["rebuilt"]
    assert (await c.execute("print(m.group(1))")).stdout == "x\n"
