"""The embedded store: SQLite in WAL mode, one connection, one file in the data directory.

Small operations run right on the event loop when the store's thread has nothing in
hand; big ones on that single thread, so the connection is never used by two threads at
once and order is kept either way (see ``_submit``). A thread round trip costs about six
times a small WAL commit, and most of the gateway's writes sit on the path of a cell's
events to its clients: so the loop turn's shared commit (sql.py) usually runs inline.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from kernelhub.errors import StoreError
from kernelhub.store import migrations
from kernelhub.store.queries import Op, Row
from kernelhub.store.quota import StorageLedger
from kernelhub.store.sql import SqlStore

T = TypeVar("T")
log = logging.getLogger(__name__)

_CHECKPOINT_BYTES = 4 * 2**20  # WAL growth between checkpoints
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum value
# The vacuum writes what it moves to the WAL: checkpointing every few steps bounds the
# WAL (measured on a 200 MB purge: 160 MB of WAL without, 16 MB with every 4 steps).
CHECKPOINT_STEPS = 4


def drive(db: sqlite3.Connection, op: Op[T]) -> T:
    """Run an operation's statements on ``db``; its result. (The hot path of every
    commit: no helper calls per statement.)"""
    try:
        query = next(op)
        while True:
            many = query.many
            if many is None:
                cur = db.execute(query.sql, query.params)
                query = op.send([(cur.rowcount,)] if query.rowcount else cur.fetchall())
            elif query.rowcount:  # the count of each: one statement each (compiled once)
                query = op.send([(db.execute(query.sql, p).rowcount,) for p in many])
            else:
                db.executemany(query.sql, many)
                query = op.send([])
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def transact(db: sqlite3.Connection, ops: list[Op[Any]], ledger: StorageLedger) -> list[Any]:
    """``ops`` and the ledger's sums in one transaction; their results."""
    db.execute("BEGIN")
    try:
        results = [drive(db, op) for op in ops]
        if ledger.unwritten:
            drive(db, ledger.write())
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return results


def _read(db: sqlite3.Connection, ops: list[Op[Any]], _: object) -> list[Any]:
    return [drive(db, op) for op in ops]


class SqliteStore(SqlStore):
    """All persistence in one SQLite file. Open with :meth:`open`, always :meth:`close`."""

    def __init__(
        self, path: Path, *, audit_code_bytes: int = 4096, node: str | None = None
    ) -> None:
        super().__init__(audit_code_bytes=audit_code_bytes, node=node)
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernelhub-store")
        self._db: sqlite3.Connection | None = None
        self._queued = 0  # operations handed to the store thread and not finished yet
        self._wal_bytes = 0  # appended since the last checkpoint
        self._checkpoint: asyncio.Future[Any] | None = None
        self._reclaims = 0

    @classmethod
    async def open(
        cls, path: Path, *, audit_code_bytes: int = 4096, node: str | None = None
    ) -> SqliteStore:
        store = cls(path, audit_code_bytes=audit_code_bytes, node=node)
        await store._thread(store._open)
        return store

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Purged rows' pages go back to the filesystem (see retention.py); on a new file
        # this must come before the first table, an old one is converted below.
        if not db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall():
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed transaction survives a process crash (kill -9);
        # only an OS crash can lose the last few, which is the usual trade.
        db.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (which fsync) run on the store thread, never inside a commit made
        # on the event loop: see _submit.
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("PRAGMA foreign_keys=ON")
        # Builds that default to secure_delete=ON zero every freed page through the WAL: a
        # purge of 200 MB wrote 200 MB more. FAST zeroes what costs no extra I/O; the rest
        # leaves the file when the incremental vacuum truncates or overwrites it.
        db.execute("PRAGMA secure_delete=FAST")
        start = drive(db, migrations.create())
        migrations.check(start, str(self.path), "KERNELHUB_DATA_DIR")
        for at in range(start, migrations.LATEST):
            transact(db, [migrations.upgrade(at)], self.ledger)
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != AUTO_VACUUM_INCREMENTAL:
            self._convert_to_incremental_vacuum(db)
        self.ledger.load(db.execute(StorageLedger.LOAD).fetchall())
        self._db = db

    def _convert_to_incremental_vacuum(self, db: sqlite3.Connection) -> None:
        # A database made before version 2: auto_vacuum takes effect only through a full
        # VACUUM, done once here (at start-up, before the gateway serves anything).
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        try:
            db.execute("VACUUM")
        except sqlite3.OperationalError as exc:
            # VACUUM needs room for a copy of the file; without it purges still delete
            # rows (their pages are reused, not returned), and the next start tries again.
            log.warning(
                "could not convert %s to incremental vacuum (%s); free disk space and "
                "restart to return purged space to the filesystem",
                self.path,
                exc,
            )

    async def close(self) -> None:
        await self._closing()
        if self._db is not None:
            await self._thread(self._db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    # -- running operations -------------------------------------------------------------

    def _submit(
        self, ops: list[Op[Any]], *, write: bool, big: bool, size: int = 0
    ) -> asyncio.Future[list[Any]]:
        db = self._db
        if db is None:
            for op in ops:
                op.close()
            raise StoreError(f"the store {self.path} is closed (the gateway is stopping)")
        fn = partial(self._guarded, transact if write else _read, db, ops)
        if write:
            self._wal_grew(size)
        if not big and self._queued == 0:
            fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)
            return fut
        return self._thread(fn)

    def _guarded(
        self,
        run: Callable[[sqlite3.Connection, list[Op[Any]], StorageLedger], list[Any]],
        db: sqlite3.Connection,
        ops: list[Op[Any]],
    ) -> list[Any]:
        try:
            return run(db, ops, self.ledger)
        except sqlite3.Error as exc:
            raise StoreError(f"the store {self.path} failed: {exc}") from exc

    def _thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        done = self._pool.submit(fn)
        self._queued += 1
        # Counted down when the thread has really finished, even if the caller was
        # cancelled meanwhile: only then may the loop use the connection again.
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished_one))
        return asyncio.wrap_future(done)

    def _finished_one(self) -> None:
        self._queued -= 1

    def _wal_grew(self, size: int) -> None:
        self._wal_bytes += size
        if self._wal_bytes >= _CHECKPOINT_BYTES and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            self._wal_bytes = 0
            self._checkpoint = self._thread(partial(self._pragma, "wal_checkpoint"))

    def _pragma(self, pragma: str) -> list[Row]:
        assert self._db is not None
        return self._db.execute(f"PRAGMA {pragma}").fetchall()

    # -- space --------------------------------------------------------------------------

    async def reclaim(self, pages: int) -> int:
        self._flush()

        def step() -> int:
            assert self._db is not None
            # executescript steps the pragma to its end; execute() would free one page.
            self._db.executescript(f"PRAGMA incremental_vacuum({int(pages)})")
            left = int(self._db.execute("PRAGMA freelist_count").fetchone()[0])
            self._reclaims += 1
            if left == 0 or self._reclaims % CHECKPOINT_STEPS == 0:
                # In WAL mode the main file shrinks only when the WAL is checkpointed into it.
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            return left

        return await self._thread(step)
