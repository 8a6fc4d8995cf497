"""The Store interface: everything kernelhub keeps across restarts, behind one seam.

Backends: :class:`~kernelhub.store.sqlite.SqliteStore` (embedded, the default: one file in
the data directory) and :class:`~kernelhub.store.postgres.PostgresStore` (a shared server,
``KERNELHUB_STORE__URL=postgresql://...``). Both run the same operations
(queries.py, executions.py) and the same migrations (migrations.py); they differ only in how a
statement reaches the database. :func:`kernelhub.store.open_store` picks one from Settings.

The calling contract
--------------------
- **Who calls.** The session manager and its collaborators (recorder, continuity,
  batches, retention), the gateway's auth and routes, and the CLI. Only from the event
  loop the store was opened on; the store is not thread-safe and needs no locking by its
  callers.
- **Lifetime.** ``await Backend.open(...)`` creates or migrates the schema (refusing a
  database newer than this code with :class:`~kernelhub.errors.ConfigError`), then the
  store serves until ``await close()``, which commits every write handed to it first.
  After close every call raises :class:`~kernelhub.errors.StoreError`.
- **Order.** Every call is ordered after every call made before it, write or read, even
  when the caller does not await it: a write is queued when the method is *called*, and
  a read sees every write called before it.
- **Writes** return an :class:`asyncio.Future`, queued at call time, that resolves once
  the write is committed (durable against a process crash); awaiting is optional, and
  cancelling one's own await does not cancel the write. The hot path's writes (event
  rows, new executions, final records) of one loop turn, of every session, share one
  commit (a commit costs more than the rows in it); every other write commits at once,
  after that pending commit. Either way the common small case commits inline, on the
  loop, with no thread or task hop, and a future that is already done: awaiting it
  yields no loop turn. A hot-path write given ``wait`` (seconds) may hold its commit that
  long for the writes that follow it (quiet events); one given ``then`` has it called, on
  the loop, right after its commit, with None or the error: before any waiter of the
  future wakes, and before the next commit. :meth:`flush` ends all waiting. If a shared
  commit fails, every write in it fails with the same error (callers retry; the fanout
  does).
- **Errors.** Database failures raise :class:`~kernelhub.errors.StoreError` (the store is
  closed or its server unreachable: 503); a unique name already taken raises
  :class:`~kernelhub.errors.StoreConflictError` (409), in its own transaction, so it never
  fails the writes of others.
- **Usage accounting.** ``ledger`` counts stored bytes per principal as rows are written
  (quota.py); read it any time from the loop.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from kernelhub.cluster.models import NodeInfo
from kernelhub.models import Event, ExecutionRecord, ExecutionStatus
from kernelhub.store.batch_queue import BatchClaim, HeldItem
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

Then = Callable[[Exception | None], None]


class Store(ABC):
    """All persistence (see the module docstring for the contract)."""

    ledger: StorageLedger
    # Issue #24: the node this process runs sessions on; written on each session it creates.
    node: str | None = None

    @abstractmethod
    async def close(self) -> None:
        """Commit what is queued, then release the connection. Idempotent."""

    # -- commits ------------------------------------------------------------------------

    @abstractmethod
    def flush(self) -> asyncio.Future[None]:
        """Commit the queued writes at the end of this turn, even those that may wait:
        for a caller about to wait on one of them."""

    @property
    @abstractmethod
    def pending_commit(self) -> int | None:
        """The number of the commit that a write queued now joins, while it has not begun;
        None when no commit is pending. Equal numbers: the same commit."""

    # -- accounts -----------------------------------------------------------------------

    @abstractmethod
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
        """Make a token; returns it in clear text, the only time it is ever shown. A taken
        name raises StoreConflictError."""

    @abstractmethod
    async def principal_for(self, token: str) -> Principal | None:
        """The principal of a token (expired ones too: the caller names the expiry), or of
        a sign-in id (``khs_...``, the review page's cookie) while it lasts."""

    @abstractmethod
    async def create_web_session(self, token: str, ttl: float) -> tuple[str, str, datetime]:
        """A sign-in for ``token``: its id (the cookie), its CSRF token and its expiry,
        never later than the token's own."""

    @abstractmethod
    async def web_session(self, sid: str) -> tuple[Principal, str] | None:
        """The principal and CSRF token of a live sign-in; None once it expired or its token
        was revoked."""

    @abstractmethod
    async def delete_web_session(self, sid: str) -> None: ...

    @abstractmethod
    async def list_tokens(self) -> list[TokenInfo]: ...

    @abstractmethod
    async def revoke_token(self, name: str) -> bool:
        """Whether a live token of that name was revoked."""

    # -- sessions -----------------------------------------------------------------------

    @abstractmethod
    def insert_session(self, s: StoredSession) -> asyncio.Future[None]:
        """A new session's row (its ``node`` defaults to the store's)."""

    @abstractmethod
    def update_session(
        self,
        session_id: str,
        *,
        state: str,
        reason: str | None = None,
        deleted: bool = False,
        hibernation: str | None = None,
    ) -> asyncio.Future[None]:
        """A new state; dead and deleted start the session's retention period.
        ``hibernation``: the snapshot a hibernated session wakes from; any other state
        clears it."""

    @abstractmethod
    def set_egress_grants(self, session_id: str, grants: EgressGrants) -> asyncio.Future[None]:
        """The session's "for this session" egress answers (issue #25), all of them."""

    @abstractmethod
    async def get_session(self, session_id: str) -> StoredSession | None: ...

    @abstractmethod
    async def list_sessions(
        self, owner: str | None = None, *, include_deleted: bool = False
    ) -> list[StoredSession]:
        """Oldest first; every owner's with ``owner`` None."""

    @abstractmethod
    def renew_leases(self, node: str, expires_at: datetime) -> asyncio.Future[int]:
        """Extend ``node``'s lease on the live sessions it runs; resolves to how many."""

    @abstractmethod
    async def expired_leases(self, now: datetime) -> list[StoredSession]:
        """Live sessions whose node's lease ran out before ``now``: another node may
        restore them (issue #24)."""

    # -- nodes (issue #24) ---------------------------------------------------------------

    @abstractmethod
    def upsert_node(self, node: NodeInfo) -> asyncio.Future[None]:
        """A node agent's heartbeat: its row, created or refreshed (never its ``draining``)."""

    @abstractmethod
    async def list_nodes(self) -> list[NodeInfo]:
        """Every node agent that ever beat, alive or not (``NodeInfo.alive``)."""

    @abstractmethod
    async def get_node(self, node_id: str) -> NodeInfo | None: ...

    @abstractmethod
    def set_draining(self, node_id: str, draining: bool) -> asyncio.Future[bool]:
        """Mark a node as taking no new sessions; False if there is no such node."""

    @abstractmethod
    def delete_node(self, node_id: str) -> asyncio.Future[bool]: ...

    @abstractmethod
    async def sessions_on(self, node_id: str) -> list[StoredSession]:
        """The live sessions whose row names ``node_id``."""

    @abstractmethod
    def claim_session(
        self,
        session_id: str,
        from_node: str | None,
        to_node: str | None,
        expires_at: datetime | None,
    ) -> asyncio.Future[bool]:
        """Move the session to ``to_node`` if its row still names ``from_node``: True for
        the one caller that won."""

    # -- executions ---------------------------------------------------------------------

    @abstractmethod
    def insert_execution(
        self, e: StoredExecution, then: Then | None = None, *, wait: float = 0.0
    ) -> asyncio.Future[StoredExecution]:
        """Queue the row; resolves to it, or to the execution the owner made earlier with
        the same idempotency key (then nothing was inserted)."""

    @abstractmethod
    def update_execution(
        self, execution_id: str, status: ExecutionStatus, record: ExecutionRecord | None = None
    ) -> asyncio.Future[None]: ...

    @abstractmethod
    def finish_execution(self, record: ExecutionRecord, audit: AuditEntry) -> asyncio.Future[None]:
        """The final record and its audit entry, in one commit. Someone waits on a cell's
        end: unless many writes are queued (busy sessions, where sharing the commit wins),
        it commits now rather than at the end of the turn."""

    @abstractmethod
    async def get_execution(self, execution_id: str) -> StoredExecution | None: ...

    @abstractmethod
    async def execution_by_key(self, owner: str, key: str) -> StoredExecution | None:
        """The owner's execution made with this idempotency key, if any."""

    @abstractmethod
    async def unfinished_executions(self, session_id: str) -> list[StoredExecution]:
        """Those without a final record, oldest first (a restart adopts or ends them)."""

    @abstractmethod
    async def executions_of(self, session_id: str) -> list[StoredExecution]:
        """Every execution of a session, oldest first (for exports)."""

    # -- events -------------------------------------------------------------------------

    @abstractmethod
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
        """An event row (its JSON ``body``); a row already stored under that seq stands."""

    @abstractmethod
    async def events_since(
        self, session_id: str, since: int, limit: int = 1000, max_bytes: int = 4 * 2**20
    ) -> list[tuple[int, str]]:
        """The next page of a session's events after ``since`` as ``(seq, JSON)``: at most
        ``limit`` events and about ``max_bytes`` (always at least one), so replay memory
        stays bounded and the text goes to clients without a parse/serialize round trip."""

    @abstractmethod
    async def events_of(self, execution_id: str) -> list[Event]: ...

    @abstractmethod
    async def session_events_of(self, session_id: str) -> list[Event]:
        """The session's events that belong to no execution (notices such as a recovery),
        oldest first (for exports)."""

    @abstractmethod
    async def has_started(self, execution_id: str) -> bool:
        """Whether the execution's events include its ``running`` status."""

    @abstractmethod
    async def last_seq(self, session_id: str) -> int: ...

    # -- snapshots ----------------------------------------------------------------------

    @abstractmethod
    def insert_snapshot(self, s: StoredSnapshot) -> asyncio.Future[None]: ...

    @abstractmethod
    async def get_snapshot(self, snapshot_id: str) -> StoredSnapshot | None: ...

    @abstractmethod
    async def list_snapshots(self, owner: str) -> list[StoredSnapshot]: ...

    @abstractmethod
    def delete_snapshot(self, snapshot_id: str) -> asyncio.Future[None]: ...

    # -- batches ------------------------------------------------------------------------

    @abstractmethod
    def insert_batch(
        self, batch: StoredBatch, items: Sequence[StoredBatchItem]
    ) -> asyncio.Future[list[StoredBatchItem]]:
        """A batch and its items, in one commit. An item whose idempotency key the owner
        already used is stored as a duplicate of the item that used it, without the key;
        resolves to the items as stored."""

    @abstractmethod
    async def used_batch_keys(self, owner: str, keys: Sequence[str]) -> set[str]: ...

    @abstractmethod
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
        """Set the given fields (None leaves one as it is). ``release_key`` frees the item's
        idempotency key, for an item whose code never reached a kernel: sent again, it runs.
        ``submitted_at``: its code goes to a kernel now (from here on it never runs again).
        With ``claimed_by`` the write applies only while that node's claim on the item
        stands. Resolves to whether the row changed."""

    # The batch queue, shared by every node (batch_queue.py has the rules).

    @abstractmethod
    def claim_batch_items(
        self,
        node: str,
        limit: int,
        lease: float,
        *,
        principal_limit: int | None = None,
        now: datetime | None = None,
    ) -> asyncio.Future[BatchClaim]:
        """Claim up to ``limit`` runnable items for ``node`` for ``lease`` seconds, fair
        between principals, at most ``principal_limit`` of one principal's on this node;
        first settling the claims whose lease ran out by ``now``. Two nodes never claim
        the same item; an item whose code reached a kernel is never claimed again."""

    @abstractmethod
    def renew_batch_items(self, node: str, expires_at: datetime) -> asyncio.Future[list[HeldItem]]:
        """Extend ``node``'s claims; the items it still holds, and whether each one's batch
        was cancelled."""

    @abstractmethod
    def release_batch_items(self, node: str) -> asyncio.Future[int]:
        """Every claim of ``node`` lapses now (the node starts or stops): items whose code
        never ran go back to the queue, the others end. Returns how many."""

    @abstractmethod
    def cancel_queued_batch_items(self, batch_id: str) -> asyncio.Future[int]:
        """Cancel the batch and its waiting items (their keys freed); how many there were."""

    @abstractmethod
    async def waiting_batch_items(self) -> int:
        """Items waiting for a node, all batches."""

    @abstractmethod
    def cancel_batch(self, batch_id: str) -> asyncio.Future[None]: ...

    @abstractmethod
    async def get_batch(self, batch_id: str) -> StoredBatch | None: ...

    @abstractmethod
    async def list_batches(self, owner: str, limit: int = 100) -> list[StoredBatch]:
        """The owner's newest batches, newest first."""

    @abstractmethod
    async def batch_items(self, batch_id: str) -> list[StoredBatchItem]:
        """In order; duplicates resolved to the item they repeat."""

    @abstractmethod
    async def batch_statuses(self, batch_ids: Sequence[str]) -> dict[str, list[ExecutionStatus]]:
        """Each batch's item statuses (duplicates resolved), for listings."""

    @abstractmethod
    async def unfinished_batch_items(self) -> list[StoredBatchItem]:
        """Items a previous process left queued or running (never duplicates)."""

    # -- audit --------------------------------------------------------------------------

    @abstractmethod
    def audit(self, entry: AuditEntry) -> asyncio.Future[None]:
        """Who, when and what; the code bounded to its head, full length and hash."""

    @abstractmethod
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
        """Audit rows, oldest first; with ``limit``, the newest ``limit`` rows with ids
        below ``before`` (a page), newest first. ``text`` matches code and detail."""

    # -- retention (retention.py): bounded steps ----------------------------------------

    @abstractmethod
    async def ended_before(self, cutoff: datetime) -> list[str]:
        """Sessions that ended (died or were deleted) at or before ``cutoff``."""

    @abstractmethod
    async def purge_step(self, table: str, session_id: str, rows: int) -> int:
        """Delete up to ``rows`` of the session's ``events`` or ``executions``; how many went."""

    @abstractmethod
    async def drop_session(self, session_id: str) -> list[str]:
        """The end of a purge: the session's internal snapshots and its row (its bytes
        leave the ledger). Returns the snapshot ids whose blobs to remove."""

    @abstractmethod
    async def trim_audit(self, before: datetime, rows: int) -> int:
        """Delete up to ``rows`` audit entries older than ``before``; how many went."""

    @abstractmethod
    async def reclaim(self, pages: int) -> int:
        """Give up to ``pages`` of freed space back to the filesystem; returns how many are
        left to give (0: done, or the database does this itself)."""
