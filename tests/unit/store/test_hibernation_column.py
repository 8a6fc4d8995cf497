"""Schema v4: a hibernated session's snapshot has a column of its own."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from kernelhub.store.migrations import SCHEMA
from kernelhub.store.sqlite import SqliteStore


async def test_an_old_hibernation_reason_becomes_the_column_and_the_reason_goes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.executescript(SCHEMA)  # version 1: the reason column encoded it
        for sid, state, reason in (
            ("h1", "hibernated", "hibernation:snap0123456789ab"),
            ("r1", "ready", "hibernation:looks-like-one"),  # not hibernated: left alone
            ("d1", "dead", "out of memory"),
        ):
            db.execute(
                "INSERT INTO sessions VALUES (?,'alice','docker',?,"
                "'2026-01-01T00:00:00+00:00','{}','{}',?,NULL)",
                (sid, state, reason),
            )
    store = await SqliteStore.open(path)
    try:
        h1, r1, d1 = [await store.get_session(sid) for sid in ("h1", "r1", "d1")]
        assert h1 is not None and r1 is not None and d1 is not None
        assert (h1.state, h1.hibernation, h1.reason) == ("hibernated", "snap0123456789ab", None)
        assert (r1.hibernation, r1.reason) == (None, "hibernation:looks-like-one")
        assert (d1.hibernation, d1.reason) == (None, "out of memory")
        # Written with the phase: set while hibernated, cleared by any other state.
        await store.update_session("r1", state="hibernated", hibernation="snapR")
        assert (await store.get_session("r1")).hibernation == "snapR"  # type: ignore[union-attr]
        await store.update_session("h1", state="ready", reason="")
        woke = await store.get_session("h1")
        assert woke is not None and (woke.state, woke.hibernation) == ("ready", None)
    finally:
        await store.close()
