"""The Store implemented once over SQL: every method is an operation (queries.py,
executions.py) handed to the backend's one primitive, :meth:`SqlStore._submit`, which runs
it in order on the backend's connection; writes first pass through the loop turn's shared
commit (:class:`_Commit`).

Why a shared commit: a commit costs more than the rows in it (a WAL append and, on
PostgreSQL, a round trip and a WAL flush), and with many busy sessions many writes arrive
in the same turn. A 20 000-line cell stays cheap this way. The common small case still
commits inline: SQLite's ``_submit`` runs a small transaction right on the loop when its
thread is idle.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from abc import abstractmethod
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import StoreError
from kernelhub.models import Event, ExecutionRecord, ExecutionStatus
from kernelhub.store import batch_queue as bq
from kernelhub.store import executions as x
from kernelhub.store import nodes as nq
from kernelhub.store import queries as q
from kernelhub.store.base import Store, Then
from kernelhub.store.batch_queue import BatchClaim, HeldItem
from kernelhub.store.queries import Op
from kernelhub.store.quota import StorageLedger
from kernelhub.store.records import (
    AuditEntry,
    EgressGrants,
    Principal,
    StoredBatch,
    StoredBatchItem,
    StoredExecution,
    StoredSession,
    StoredSnapshot,
    TokenInfo,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

INLINE_BYTES = 64 * 1024  # a commit bigger than this goes to the backend's worker
# A cell's final event and its record (two writes), maybe its last output, and what may
# have waited for them (its row, its running and result events: coalesce_window): a
# commit this small is one cell finishing alone, and its client should not wait for the
# turn to end; among many writes (busy sessions) the record rides the shared commit.
LONE_FINAL_WRITES = 8


class _Commit:
    """The writes of one loop turn, committed together in one transaction."""

    __slots__ = ("events", "futures", "handle", "number", "ops", "size", "thens", "timed")

    def __init__(self, number: int) -> None:
        self.number = number
        self.ops: list[Op[Any]] = []
        # Each write's future, and the index of the op whose result it gets (-1: None).
        self.futures: list[tuple[asyncio.Future[Any], int]] = []
        self.thens: list[Then] = []
        # The turn's event rows, all written by one op (executions.append_events): the
        # hot path, without an operation per row.
        self.events: list[tuple[str, int, str, str]] | None = None
        self.size = 0
        # When it runs: the end of this turn, or a timer while every write in it may wait.
        self.handle: asyncio.Handle | None = None
        self.timed = False

    def settle(self, results: list[Any] | None, error: Exception | None) -> None:
        """Resolve every write's future, then call the callbacks, all on the loop."""
        for fut, n in self.futures:
            if fut.done():  # its waiter gave up; the write happened all the same
                continue
            if error is None:
                assert results is not None
                fut.set_result(results[n] if n >= 0 else None)
            else:
                fut.set_exception(error)
                fut.exception()  # told to `then`, or to its awaiter: never "unretrieved"
        for then in self.thens:
            try:
                then(error)
            except Exception:
                log.exception("a store commit callback failed")


class SqlStore(Store):
    """The shared implementation; a backend provides ``_submit`` and ``close``."""

    def __init__(self, *, audit_code_bytes: int = 4096, node: str | None = None) -> None:
        self.audit_code_bytes = audit_code_bytes
        self.node = node
        self.ledger = StorageLedger()
        self._commit: _Commit | None = None
        self._commits = 0
        self._closed = False

    @abstractmethod
    def _submit(
        self, ops: list[Op[Any]], *, write: bool, big: bool, size: int = 0
    ) -> asyncio.Future[list[Any]]:
        """Run ``ops`` after everything submitted before them; resolves to their results.
        ``write``: in one transaction with the ledger's sums, ``size`` bytes about.
        ``big``: they may move many rows or bytes (keep them off the loop). The future may
        be done on return (the inline case)."""

    # -- commits ------------------------------------------------------------------------

    def _write(
        self, op: Op[Any] | None, size: int, then: Then | None = None, *, wait: float = 0.0
    ) -> asyncio.Future[Any]:
        """Add a write to this turn's commit (see the contract in base.py); ``op`` None: a
        write whose rows another op of the commit already carries (resolves to None)."""
        if self._closed:
            raise StoreError("the store is closed (the gateway is stopping)")
        loop = asyncio.get_running_loop()
        c = self._commit
        if c is None:
            self._commits += 1
            c = self._commit = _Commit(self._commits)
            if wait > 0:
                c.handle, c.timed = loop.call_later(wait, self._flush), True
            else:
                c.handle = loop.call_soon(self._flush)
        elif wait <= 0:
            self._hurry(c)
        fut = loop.create_future()
        if op is None:
            c.futures.append((fut, -1))
        else:
            c.futures.append((fut, len(c.ops)))
            c.ops.append(op)
        c.size += size
        if then is not None:
            c.thens.append(then)
        return fut

    def flush(self) -> asyncio.Future[None]:
        c = self._commit
        if c is None:
            return _resolved(None)
        self._hurry(c)
        return self._write(None, 0)

    def _hurry(self, c: _Commit) -> None:
        """Commit at the end of this turn, even if every write so far may wait."""
        if c.timed:
            assert c.handle is not None
            c.handle.cancel()
            c.handle, c.timed = asyncio.get_running_loop().call_soon(self._flush), False

    @property
    def pending_commit(self) -> int | None:
        return self._commit.number if self._commit is not None else None

    def _flush(self) -> None:
        """Commit this turn's writes now (any other call does this before its own work, so
        order is kept)."""
        c, self._commit = self._commit, None
        if c is None:
            return
        if c.handle is not None:
            c.handle.cancel()  # it may be this very call: harmless
        try:
            done = self._submit(c.ops, write=True, big=c.size > INLINE_BYTES, size=c.size)
        except Exception as exc:
            c.settle(None, exc)
            return
        if done.done():
            _settle_from(c, done)
        else:
            done.add_done_callback(lambda fut: _settle_from(c, fut))

    async def _read(self, op: Op[T], *, big: bool = False) -> T:
        if self._closed:
            raise StoreError("the store is closed (the gateway is stopping)")
        self._flush()
        return (await self._submit([op], write=False, big=big))[0]  # type: ignore[no-any-return]

    def _now(self, op: Op[T], size: int = 0) -> asyncio.Future[T]:
        """A write in its own transaction, committed now (after the pending shared commit),
        inline when the store is idle: a write that is not on the events' hot path, so it
        need not wait for the turn to end; and one that may fail on its own (a taken name)
        never fails another's."""
        if self._closed:
            raise StoreError("the store is closed (the gateway is stopping)")
        self._flush()
        return _first(self._submit([op], write=True, big=size > INLINE_BYTES, size=size))

    async def _alone(self, op: Op[T]) -> T:
        return await self._now(op)

    async def _closing(self) -> None:
        """For ``close``: refuse new work, and commit what was handed over."""
        if self._closed:
            return
        c = self._commit
        fut = self.flush() if c is not None else None
        self._closed = True
        self._flush()
        if fut is not None:
            await asyncio.gather(fut, return_exceptions=True)

    # -- accounts -----------------------------------------------------------------------

    async def create_token(
        self,
        name: str,
        *,
        admin: bool = False,
        read_only: bool = False,
        session_id: str | None = None,
        expires_at: datetime | None = None,
        acts_for: str | None = None,
    ) -> str:
        token = "kh_" + secrets.token_urlsafe(32)
        await self._alone(
            q.create_token(token, name, admin=admin, read_only=read_only, session_id=session_id,
                           expires_at=expires_at, acts_for=acts_for)
        )  # fmt: skip
        return token

    async def principal_for(self, token: str) -> Principal | None:
        return await self._read(q.principal_for(token))

    async def create_web_session(self, token: str, ttl: float) -> tuple[str, str, datetime]:
        return await self._alone(q.create_web_session(token, ttl))

    async def web_session(self, sid: str) -> tuple[Principal, str] | None:
        return await self._read(q.web_session(sid))

    async def delete_web_session(self, sid: str) -> None:
        await self._now(q.delete_web_session(sid), 0)

    async def list_tokens(self) -> list[TokenInfo]:
        return await self._read(q.list_tokens())

    async def revoke_token(self, name: str) -> bool:
        return bool(await self._now(q.revoke_token(name), 0))

    # -- sessions -----------------------------------------------------------------------

    def insert_session(self, s: StoredSession) -> asyncio.Future[None]:
        if s.node is None and self.node is not None:
            s = s.model_copy(update={"node": self.node})

        def insert() -> Op[None]:
            yield from q.insert_session(s)
            # Here, not at call time: the ledger is touched only by whoever runs the op.
            self.ledger.add_session(s.id, s.owner)

        return self._now(insert(), 0)

    def update_session(
        self,
        session_id: str,
        *,
        state: str,
        reason: str | None = None,
        deleted: bool = False,
        hibernation: str | None = None,
    ) -> asyncio.Future[None]:
        op = q.update_session(
            session_id, state=state, reason=reason, deleted=deleted, hibernation=hibernation
        )
        return self._now(op)

    def set_egress_grants(self, session_id: str, grants: EgressGrants) -> asyncio.Future[None]:
        return self._now(q.set_egress_grants(session_id, grants))

    async def get_session(self, session_id: str) -> StoredSession | None:
        return await self._read(q.get_session(session_id))

    async def list_sessions(
        self, owner: str | None = None, *, include_deleted: bool = False
    ) -> list[StoredSession]:
        return await self._read(q.list_sessions(owner, include_deleted), big=True)

    def renew_leases(self, node: str, expires_at: datetime) -> asyncio.Future[int]:
        return self._now(q.renew_leases(node, expires_at), 0)

    async def expired_leases(self, now: datetime) -> list[StoredSession]:
        return await self._read(q.expired_leases(now), big=True)

    # -- nodes ----------------------------------------------------------------------------

    def upsert_node(self, node: NodeInfo) -> asyncio.Future[None]:
        return self._now(nq.upsert_node(node))

    async def list_nodes(self) -> list[NodeInfo]:
        return await self._read(nq.list_nodes())

    async def get_node(self, node_id: str) -> NodeInfo | None:
        return await self._read(nq.get_node(node_id))

    def set_draining(self, node_id: str, draining: bool) -> asyncio.Future[bool]:
        return self._now(nq.set_draining(node_id, draining))

    def delete_node(self, node_id: str) -> asyncio.Future[bool]:
        return self._now(nq.delete_node(node_id))

    async def sessions_on(self, node_id: str) -> list[StoredSession]:
        return await self._read(nq.sessions_on(node_id), big=True)

    def claim_session(
        self,
        session_id: str,
        from_node: str | None,
        to_node: str | None,
        expires_at: datetime | None,
    ) -> asyncio.Future[bool]:
        return self._now(nq.claim_session(session_id, from_node, to_node, expires_at))

    # -- executions ---------------------------------------------------------------------

    def insert_execution(
        self, e: StoredExecution, then: Then | None = None, *, wait: float = 0.0
    ) -> asyncio.Future[StoredExecution]:
        op = x.insert_execution(e, self.ledger)
        if then is None and wait <= 0:  # awaited (an idempotency key to check): now
            return self._now(op, len(e.code))
        return self._write(op, len(e.code), then, wait=wait)

    def update_execution(
        self, execution_id: str, status: ExecutionStatus, record: ExecutionRecord | None = None
    ) -> asyncio.Future[None]:
        return self._now(x.update_execution(execution_id, status, record, self.ledger), 0)

    def finish_execution(self, record: ExecutionRecord, audit: AuditEntry) -> asyncio.Future[None]:
        size = len(audit.code or "") + 1024
        done = self._write(x.finish_execution(record, audit, self.audit_code_bytes, self.ledger),
                           size)  # fmt: skip
        c = self._commit
        if c is not None and len(c.futures) <= LONE_FINAL_WRITES:
            self._flush()
        return done

    async def get_execution(self, execution_id: str) -> StoredExecution | None:
        return await self._read(x.get_execution(execution_id))

    async def execution_by_key(self, owner: str, key: str) -> StoredExecution | None:
        return await self._read(x.execution_by_key(owner, key))

    async def unfinished_executions(self, session_id: str) -> list[StoredExecution]:
        return await self._read(x.unfinished_executions(session_id), big=True)

    async def executions_of(self, session_id: str) -> list[StoredExecution]:
        return await self._read(x.executions_of(session_id), big=True)

    # -- events -------------------------------------------------------------------------

    def append_event(
        self,
        session_id: str,
        seq: int,
        execution_id: str,
        body: str,
        then: Then | None = None,
        *,
        wait: float = 0.0,
    ) -> asyncio.Future[None]:
        c = self._commit
        if c is None or c.events is None:
            rows: list[tuple[str, int, str, str]] = []
            done = self._write(x.append_events(rows, self.ledger), len(body), then, wait=wait)
            assert self._commit is not None
            self._commit.events = rows
        else:
            done = self._write(None, len(body), then, wait=wait)
            rows = c.events
        rows.append((session_id, seq, execution_id, body))
        return done

    async def events_since(
        self, session_id: str, since: int, limit: int = 1000, max_bytes: int = 4 * 2**20
    ) -> list[tuple[int, str]]:
        rows = await self._read(x.events_since(session_id, since, limit, max_bytes), big=True)
        return [(int(r[0]), str(r[1])) for r in rows]

    async def events_of(self, execution_id: str) -> list[Event]:
        return await x.parse_events(await self._read(x.events_of(execution_id), big=True))

    async def session_events_of(self, session_id: str) -> list[Event]:
        return await x.parse_events(await self._read(x.session_events_of(session_id), big=True))

    async def has_started(self, execution_id: str) -> bool:
        return await self._read(x.has_started(execution_id))

    async def last_seq(self, session_id: str) -> int:
        return await self._read(x.last_seq(session_id))

    # -- snapshots ----------------------------------------------------------------------

    def insert_snapshot(self, s: StoredSnapshot) -> asyncio.Future[None]:
        return self._now(q.insert_snapshot(s), 0)

    async def get_snapshot(self, snapshot_id: str) -> StoredSnapshot | None:
        return await self._read(q.get_snapshot(snapshot_id))

    async def list_snapshots(self, owner: str) -> list[StoredSnapshot]:
        return await self._read(q.list_snapshots(owner))

    def delete_snapshot(self, snapshot_id: str) -> asyncio.Future[None]:
        return self._now(q.delete_snapshot(snapshot_id), 0)

    # -- batches ------------------------------------------------------------------------

    def insert_batch(
        self, batch: StoredBatch, items: Sequence[StoredBatchItem]
    ) -> asyncio.Future[list[StoredBatchItem]]:
        size = sum(256 + len(i.body or "") for i in items)
        return self._now(x.insert_batch(batch, items), size)

    async def used_batch_keys(self, owner: str, keys: Sequence[str]) -> set[str]:
        return await self._read(x.used_batch_keys(owner, keys))

    def update_batch_item(
        self,
        batch_id: str,
        index: int,
        *,
        status: ExecutionStatus | None = None,
        session_id: str | None = None,
        execution_id: str | None = None,
        started_at: datetime | None = None,
        finished_at: datetime | None = None,
        error: str | None = None,
        release_key: bool = False,
        submitted_at: datetime | None = None,
        claimed_by: str | None = None,
    ) -> asyncio.Future[bool]:
        op = x.update_batch_item(
            batch_id, index, status=status, session_id=session_id, execution_id=execution_id,
            started_at=started_at, finished_at=finished_at, error=error, release_key=release_key,
            submitted_at=submitted_at, claimed_by=claimed_by,
        )  # fmt: skip
        return self._now(op, 0)

    def claim_batch_items(
        self,
        node: str,
        limit: int,
        lease: float,
        *,
        principal_limit: int | None = None,
        now: datetime | None = None,
    ) -> asyncio.Future[BatchClaim]:
        now = now or datetime.now(UTC)
        until = now + timedelta(seconds=lease)
        return self._now(bq.claim_batch_items(node, limit, until, now, principal_limit))

    def renew_batch_items(self, node: str, expires_at: datetime) -> asyncio.Future[list[HeldItem]]:
        return self._now(bq.renew_batch_items(node, expires_at))

    def release_batch_items(self, node: str) -> asyncio.Future[int]:
        return self._now(bq.release_batch_items(node, datetime.now(UTC)))

    def cancel_queued_batch_items(self, batch_id: str) -> asyncio.Future[int]:
        return self._now(bq.cancel_queued_batch_items(batch_id, datetime.now(UTC)))

    async def waiting_batch_items(self) -> int:
        return await self._read(bq.count_waiting())

    def cancel_batch(self, batch_id: str) -> asyncio.Future[None]:
        return self._now(x.cancel_batch(batch_id), 0)

    async def get_batch(self, batch_id: str) -> StoredBatch | None:
        return await self._read(x.get_batch(batch_id))

    async def list_batches(self, owner: str, limit: int = 100) -> list[StoredBatch]:
        return await self._read(x.list_batches(owner, limit), big=True)

    async def batch_items(self, batch_id: str) -> list[StoredBatchItem]:
        return await self._read(x.batch_items(batch_id), big=True)

    async def batch_statuses(self, batch_ids: Sequence[str]) -> dict[str, list[ExecutionStatus]]:
        return await self._read(x.batch_statuses(batch_ids), big=True)

    async def unfinished_batch_items(self) -> list[StoredBatchItem]:
        return await self._read(x.unfinished_batch_items(), big=True)

    # -- audit --------------------------------------------------------------------------

    def audit(self, entry: AuditEntry) -> asyncio.Future[None]:
        return self._now(x.audit(entry, self.audit_code_bytes), len(entry.code or ""))

    async def audit_log(
        self,
        session_id: str | None = None,
        *,
        principal: str | None = None,
        action: str | None = None,
        text: str | None = None,
        before: int | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        op = x.audit_log(session_id, principal, action, text, before, limit)
        return await self._read(op, big=True)

    # -- retention ----------------------------------------------------------------------

    async def ended_before(self, cutoff: datetime) -> list[str]:
        return await self._read(q.ended_before(cutoff.isoformat()), big=True)

    async def _big_write(self, op: Op[T]) -> T:
        """A bounded step of maintenance: its own transaction, off the loop."""
        self._flush()
        return (await self._submit([op], write=True, big=True))[0]  # type: ignore[no-any-return]

    async def purge_step(self, table: str, session_id: str, rows: int) -> int:
        return await self._big_write(q.purge_step(table, session_id, rows))

    async def drop_session(self, session_id: str) -> list[str]:
        def drop() -> Op[list[str]]:
            snapshots = yield from q.drop_session(session_id)
            self.ledger.forget(session_id)
            return snapshots

        return await self._big_write(drop())

    async def trim_audit(self, before: datetime, rows: int) -> int:
        return await self._big_write(q.trim_audit(before.isoformat(), rows))


def _first(done: asyncio.Future[list[Any]]) -> asyncio.Future[Any]:
    """The first result of ``done``, as a future that is done at once if ``done`` is (the
    inline case: a caller's await then yields no loop turn)."""
    if done.done():
        if done.cancelled() or done.exception() is not None:
            return done
        return _resolved(done.result()[0])
    first: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def copy(fut: asyncio.Future[list[Any]]) -> None:
        if first.done():
            return
        if fut.cancelled():
            first.set_exception(StoreError("the store was closed before the write was committed"))
        elif (exc := fut.exception()) is not None:
            first.set_exception(exc)
        else:
            first.set_result(fut.result()[0])

    done.add_done_callback(copy)
    return first


def _resolved(value: T) -> asyncio.Future[T]:
    fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def _settle_from(c: _Commit, done: asyncio.Future[list[Any]]) -> None:
    if done.cancelled():
        c.settle(None, StoreError("the store was closed before the write was committed"))
        return
    exc = done.exception()
    if exc is None:
        c.settle(done.result(), None)
    else:
        c.settle(None, exc if isinstance(exc, Exception) else StoreError(str(exc)))
