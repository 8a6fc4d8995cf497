"""The shared store: PostgreSQL over psycopg 3's asyncio connection (``pip install
'kernelhub[postgres]'``, ``KERNELHUB_STORE__URL=postgresql://...``).

The same operations and migrations as SQLite (queries.py, executions.py, migrations.py),
run on one connection by one worker task, in the order they were called: the
counterpart of SQLite's single store thread. One connection, not a pool: the order of the
calls is the store's contract (base.py), and the loop turn's shared commit already turns
many writers into one transaction. Statements are translated once each (``?`` to ``%s``)
and psycopg prepares the frequent ones on the server by itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, TypeVar

from kernelhub.errors import ConfigError, StoreError
from kernelhub.store import migrations
from kernelhub.store.queries import Op, Query, Row
from kernelhub.store.quota import StorageLedger
from kernelhub.store.sql import SqlStore

T = TypeVar("T")
log = logging.getLogger(__name__)

# pg_advisory_lock key for migrations ("kern"): two gateways starting at once migrate once.
_MIGRATION_LOCK = 0x6B65726E


@functools.lru_cache(maxsize=1024)
def translate(sql: str) -> str:
    """SQLite's placeholders as psycopg's (a literal ``%`` doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


def text_of(query: Query) -> str:
    sql = query.postgres if query.postgres is not None else query.sql
    if query.ddl:
        sql = migrations.ddl(sql, "postgres")
    return translate(sql)


def where(url: str) -> str:
    """The server and database a URL names, without its password (for messages)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(url)
    except Exception:
        return "postgresql://(unparsable URL)"
    host = info.get("host", "localhost")
    port = info.get("port", "5432")
    return f"postgresql://{info.get('user', '')}@{host}:{port}/{info.get('dbname', '')}"


class PostgresStore(SqlStore):
    """All persistence in a PostgreSQL database. Open with :meth:`open`, always :meth:`close`."""

    def __init__(self, url: str, *, audit_code_bytes: int = 4096, node: str | None = None) -> None:
        super().__init__(audit_code_bytes=audit_code_bytes, node=node)
        self.url = url
        self.where = where(url)
        self._conn: Any = None  # psycopg.AsyncConnection
        self._queue: asyncio.Queue[tuple[list[Op[Any]], bool, asyncio.Future[Any]] | None] = (
            asyncio.Queue()
        )
        self._worker: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, url: str, *, audit_code_bytes: int = 4096, node: str | None = None
    ) -> PostgresStore:
        store = cls(url, audit_code_bytes=audit_code_bytes, node=node)
        await store._connect()
        try:
            await store._migrate()
            [rows] = await store._run([_statement(Query(StorageLedger.LOAD))], write=False)
            store.ledger.load(rows)
        except BaseException:
            await store._conn.close()
            raise
        store._worker = asyncio.create_task(store._work(), name="kernelhub-store")
        return store

    async def _connect(self) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise ConfigError(
                "KERNELHUB_STORE__URL names PostgreSQL, but psycopg is not installed; "
                "pip install 'kernelhub[postgres]'"
            ) from exc
        try:
            self._conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot reach the store {self.where}: {exc}; check KERNELHUB_STORE__URL"
            ) from exc

    async def _migrate(self) -> None:
        lock = Query(f"SELECT pg_advisory_lock({_MIGRATION_LOCK})")
        await self._run([_statement(lock)], write=False)
        try:
            [start] = await self._run([migrations.create()], write=True)
            migrations.check(start, self.where, "KERNELHUB_STORE__URL")
            for at in range(start, migrations.LATEST):
                await self._run([migrations.upgrade(at)], write=True)
        finally:
            unlock = Query(f"SELECT pg_advisory_unlock({_MIGRATION_LOCK})")
            await self._run([_statement(unlock)], write=False)

    async def close(self) -> None:
        await self._closing()
        if self._worker is not None:
            self._queue.put_nowait(None)
            await self._worker
            self._worker = None
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    # -- running operations -------------------------------------------------------------

    def _submit(
        self, ops: list[Op[Any]], *, write: bool, big: bool, size: int = 0
    ) -> asyncio.Future[list[Any]]:
        if self._worker is None or self._worker.done():
            for op in ops:
                op.close()
            raise StoreError(f"the store {self.where} is closed (the gateway is stopping)")
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((ops, write, fut))
        return fut

    async def _work(self) -> None:
        while (job := await self._queue.get()) is not None:
            ops, write, fut = job
            try:
                results = await self._run(ops, write=write)
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
            else:
                if not fut.done():
                    fut.set_result(results)

    async def _run(self, ops: list[Op[Any]], *, write: bool) -> list[Any]:
        """``ops`` on the connection (reconnecting once it broke); a write in one
        transaction with the ledger's sums."""
        import psycopg

        try:
            if self._conn.broken:
                log.warning("the store %s: connection lost; reconnecting", self.where)
                await self._connect()
            if not write:
                return [await self._drive(op) for op in ops]
            async with self._conn.transaction():
                results = [await self._drive(op) for op in ops]
                if self.ledger.unwritten:
                    await self._drive(self.ledger.write())
            return results
        except psycopg.Error as exc:
            raise StoreError(f"the store {self.where} failed: {exc}") from exc
        finally:
            for op in ops:
                op.close()

    async def _drive(self, op: Op[T]) -> T:
        async with self._conn.cursor() as cur:
            try:
                query = next(op)
                while True:
                    query = op.send(await _execute(cur, query))
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]

    # -- space --------------------------------------------------------------------------

    async def reclaim(self, pages: int) -> int:
        return 0  # autovacuum returns dead rows' space for reuse; nothing to step through


async def _execute(cur: Any, query: Query) -> list[Row]:
    sql = text_of(query)
    if query.many is not None:
        if query.rowcount and query.many:  # the count of each, in one pipelined round trip
            await cur.executemany(sql, query.many, returning=True)
            counts: list[Row] = [(cur.rowcount,)]
            while cur.nextset():
                counts.append((cur.rowcount,))
            return counts
        if query.many:
            await cur.executemany(sql, query.many)
        return []
    await cur.execute(sql, query.params)
    if query.rowcount:
        return [(cur.rowcount,)]
    if cur.description is None:
        return []
    rows: list[Row] = await cur.fetchall()
    return rows


def _statement(query: Query) -> Op[list[Row]]:
    rows = yield query
    return rows
