"""Schema v6 (#25): a session's tier, runtime and egress policy have columns of their own;
rows made before it read back as "not recorded", which is what keeps the owner's default."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from kernelhub.store import migrations
from kernelhub.store.migrations import SCHEMA
from kernelhub.store.records import EgressGrants
from kernelhub.store.sqlite import SqliteStore
from tests.store.rows import session


async def test_an_old_database_gains_the_columns_and_its_rows_record_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.executescript(SCHEMA)
        db.execute(
            "INSERT INTO sessions VALUES ('o1','alice','docker','ready',"
            "'2026-01-01T00:00:00+00:00','{}','{}',NULL,NULL)"
        )
    store = await SqliteStore.open(path)
    try:
        old = await store.get_session("o1")
        assert old is not None and old.egress_grants is None and old.runtime is None
        new = session("n1").model_copy(
            update={"profile": "tight", "runtime": "runc", "egress_grants": EgressGrants()}
        )
        await store.insert_session(new)
        got = await store.get_session("n1")
        assert got is not None and (got.profile, got.runtime) == ("tight", "runc")
        assert got.egress_policy is None and got.egress_grants == EgressGrants()
    finally:
        await store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(migrations.LATEST,)]
        columns = {r[1] for r in db.execute("PRAGMA table_info(sessions)")}
        assert {"profile", "runtime", "egress_policy", "egress_grants"} <= columns
