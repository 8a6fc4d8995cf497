"""The embedded store: SQLite in WAL mode, one connection.

Small operations run on the event loop when the store's thread has nothing in hand; big
ones on that single thread, so the connection is never used by two threads at once (see
``_run``). Event rows are added by :meth:`SqliteStore.append_event_soon` to the loop turn's
shared transaction (see ``_in_tick``): one commit per turn keeps a 20 000-line cell cheap.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, TypeAdapter

from kernelhub.errors import KernelhubError
from kernelhub.models import Event, ExecutionRecord, ExecutionStatus
from kernelhub.store import migrations
from kernelhub.store.quota import StorageLedger

T = TypeVar("T")
log = logging.getLogger(__name__)
_EVENT = TypeAdapter(Event)

SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL UNIQUE,
  token_hash TEXT NOT NULL UNIQUE,
  admin INTEGER NOT NULL DEFAULT 0,
  created_at TEXT NOT NULL,
  revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS sessions (
  id TEXT PRIMARY KEY,
  owner TEXT NOT NULL,
  backend TEXT NOT NULL,
  state TEXT NOT NULL,
  created_at TEXT NOT NULL,
  limits TEXT NOT NULL,
  metadata TEXT NOT NULL,
  reason TEXT,
  deleted_at TEXT
);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner);
CREATE TABLE IF NOT EXISTS executions (
  id TEXT PRIMARY KEY,
  session_id TEXT NOT NULL REFERENCES sessions(id),
  owner TEXT NOT NULL,
  code TEXT NOT NULL,
  status TEXT NOT NULL,
  idempotency_key TEXT,
  created_at TEXT NOT NULL,
  record TEXT,
  UNIQUE (owner, idempotency_key)
);
CREATE INDEX IF NOT EXISTS executions_session ON executions(session_id);
CREATE TABLE IF NOT EXISTS events (
  session_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  execution_id TEXT NOT NULL,
  body TEXT NOT NULL,
  PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_execution ON events(execution_id);
CREATE TABLE IF NOT EXISTS snapshots (
  id TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  owner TEXT NOT NULL,
  created_at TEXT NOT NULL,
  size INTEGER NOT NULL,
  sha256 TEXT NOT NULL,
  mac TEXT NOT NULL,
  metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS snapshots_owner ON snapshots(owner);
CREATE TABLE IF NOT EXISTS batches (
  id TEXT PRIMARY KEY,
  owner TEXT NOT NULL,
  created_at TEXT NOT NULL,
  concurrency INTEGER NOT NULL,
  cancelled_at TEXT
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches(owner, created_at);
CREATE TABLE IF NOT EXISTS batch_items (
  batch_id TEXT NOT NULL REFERENCES batches(id),
  idx INTEGER NOT NULL,
  owner TEXT NOT NULL,
  idempotency_key TEXT,
  status TEXT NOT NULL,
  session_id TEXT,
  execution_id TEXT,
  queued_at TEXT NOT NULL,
  started_at TEXT,
  finished_at TEXT,
  error TEXT,
  dup_batch_id TEXT,
  dup_idx INTEGER,
  PRIMARY KEY (batch_id, idx),
  UNIQUE (owner, idempotency_key)
);
CREATE INDEX IF NOT EXISTS batch_items_status ON batch_items(status);
CREATE TABLE IF NOT EXISTS audit (
  id INTEGER PRIMARY KEY,
  at TEXT NOT NULL,
  principal TEXT,
  action TEXT NOT NULL,
  session_id TEXT,
  execution_id TEXT,
  code TEXT,
  status TEXT,
  duration REAL,
  cpu_seconds REAL,
  peak_memory_bytes INTEGER,
  output_bytes INTEGER,
  client TEXT,
  detail TEXT
);
"""


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def hash_token(token: str) -> str:
    # Tokens are 256-bit random strings, so a plain SHA-256 is enough (no password
    # stretching needed) and lookups stay a single indexed equality.
    return hashlib.sha256(token.encode()).hexdigest()


class Principal(BaseModel):
    """Who a request speaks for, and what its token may do. ``name`` owns the sessions
    (a scoped token stands for the principal it was made for); ``token`` is the token's
    own name when that differs."""

    name: str
    admin: bool = False
    read_only: bool = Field(False, description="may view and export, never act")
    session_id: str | None = Field(None, description="sees this one session only")
    expires_at: datetime | None = None
    token: str | None = Field(None, description="the token's name, if not `name`")

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or datetime.now(UTC))


class TokenInfo(BaseModel):
    name: str
    admin: bool
    created_at: str
    revoked_at: str | None
    read_only: bool = False
    session_id: str | None = None
    expires_at: str | None = None
    acts_for: str | None = None


class StoredSession(BaseModel):
    id: str
    owner: str
    backend: str
    state: str
    created_at: datetime
    limits: dict[str, Any]
    metadata: dict[str, Any]
    reason: str | None
    deleted_at: datetime | None
    stored_bytes: int = 0
    hibernation: str | None = None  # the snapshot a hibernated session wakes from


class StoredExecution(BaseModel):
    id: str
    session_id: str
    owner: str
    code: str
    status: ExecutionStatus
    idempotency_key: str | None
    created_at: datetime
    record: ExecutionRecord | None


class StoredSnapshot(BaseModel):
    id: str
    session_id: str
    owner: str
    created_at: datetime
    size: int
    sha256: str
    mac: str = Field(repr=False)
    metadata: dict[str, Any]


class StoredBatch(BaseModel):
    id: str
    owner: str
    created_at: datetime
    concurrency: int
    cancelled_at: datetime | None = None


class StoredBatchItem(BaseModel):
    """One item of a batch. A duplicate (its idempotency key was used before) never runs:
    ``duplicate_of`` names the item that did, and reads show that item's progress."""

    batch_id: str
    index: int
    owner: str
    idempotency_key: str | None = None
    status: ExecutionStatus = ExecutionStatus.QUEUED
    session_id: str | None = None
    execution_id: str | None = None
    queued_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    duplicate_of: tuple[str, int] | None = None


class AuditEntry(BaseModel):
    principal: str | None
    action: str
    session_id: str | None = None
    execution_id: str | None = None
    code: str | None = None
    status: str | None = None
    duration: float | None = None
    cpu_seconds: float | None = None
    peak_memory_bytes: int | None = None
    output_bytes: int | None = None
    client: str | None = None
    detail: dict[str, Any] | None = None


WEB_SESSION_PREFIX = "khs_"
_TOKEN_COLUMNS = (
    "tokens.name, tokens.admin, tokens.read_only, tokens.session_id, tokens.expires_at,"
    " tokens.acts_for"
)


def _principal(r: sqlite3.Row) -> Principal:
    """From the columns ``_TOKEN_COLUMNS`` names, in its order."""
    name, admin, read_only, session_id, expires_at, acts_for = tuple(r)[:6]
    return Principal(
        name=acts_for or name,
        admin=bool(admin),
        read_only=bool(read_only),
        session_id=session_id,
        expires_at=datetime.fromisoformat(expires_at) if expires_at else None,
        token=name if acts_for else None,
    )


_INLINE_BYTES = 64 * 1024  # larger event batches are written on the store thread
_CHECKPOINT_BYTES = 4 * 2**20  # WAL growth between checkpoints


class StoreError(KernelhubError):
    """The store could not do what was asked (it names the conflict)."""


class SqliteStore:
    """All persistence. Open with :meth:`open`, always :meth:`close`."""

    def __init__(self, path: Path, *, audit_code_bytes: int = 4096) -> None:
        self.path = path
        self.audit_code_bytes = audit_code_bytes
        self.ledger = StorageLedger()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernelhub-store")
        self._db: sqlite3.Connection | None = None
        self._queued = 0  # operations handed to the store thread and not finished yet
        self._wal_bytes = 0  # appended since the last checkpoint
        self._checkpoint: asyncio.Future[Any] | None = None
        # Writes waiting for this loop turn's shared commit (see _in_tick).
        self._tick_ops: list[Callable[[], object]] = []
        self._tick_then: list[Callable[[Exception | None], None]] = []
        self._tick_bytes = 0
        self._tick_done: asyncio.Future[None] | None = None
        # When it runs: the end of this turn, or a timer while every write in it may wait.
        self._tick_handle: asyncio.Handle | None = None
        self._tick_timed = False

    @classmethod
    async def open(cls, path: Path, *, audit_code_bytes: int = 4096) -> SqliteStore:
        store = cls(path, audit_code_bytes=audit_code_bytes)
        await store._run(store._open)
        return store

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Purged rows' pages go back to the filesystem (see retention.py); on a new file
        # this must come before the first table, an old one is converted by migrate().
        if not db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall():
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed transaction survives a process crash (kill -9);
        # only an OS crash can lose the last few, which is the usual trade.
        db.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (which fsync) run on the store thread, never inside a commit made
        # on the event loop: see _run and append_events.
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("PRAGMA foreign_keys=ON")
        # Builds that default to secure_delete=ON zero every freed page through the WAL: a
        # purge of 200 MB wrote 200 MB more. FAST zeroes what costs no extra I/O; the rest
        # leaves the file when the incremental vacuum truncates or overwrites it.
        db.execute("PRAGMA secure_delete=FAST")
        db.executescript(SCHEMA)
        migrations.migrate(db, self.path)
        self.ledger.load(db)
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            await self._off(self._db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """A small operation (a few rows): run right here on the event loop when the store
        thread has nothing in hand, else queue it behind what it has (order is kept either
        way, and one connection is never used by two threads at once). A thread round
        trip costs about six times a small WAL commit, and most of the gateway's writes
        sit on the path of a cell's events to its clients."""
        self._flush_tick()
        if self._queued == 0 and self._db is not None:
            return fn(*args)
        return await self._off(fn, *args)

    async def on_thread(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` on the store thread, after every write queued before it:
        for maintenance (retention.py) that works on many rows in bounded steps."""

        def call() -> T:
            assert self._db is not None
            return fn(self._db)

        return await self._off(call)

    async def _off(self, fn: Callable[..., T], *args: Any) -> T:
        """On the store thread: operations that may touch many rows or bytes."""
        return await self._submit(fn, *args)

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        self._flush_tick()
        return self._submit_now(fn, *args)

    def _submit_now(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        done = self._pool.submit(fn, *args)
        self._queued += 1
        # Counted down when the thread has really finished, even if the caller was
        # cancelled meanwhile: only then may the loop use the connection again.
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished_one))
        return asyncio.wrap_future(done)

    def _finished_one(self) -> None:
        self._queued -= 1

    def _in_tick(
        self,
        op: Callable[[], object],
        size: int,
        then: Callable[[Exception | None], None] | None = None,
        *,
        wait: float = 0.0,
    ) -> asyncio.Future[None]:
        """Add a write to this loop turn's transaction; the future resolves once it is
        committed, and ``then`` (if given) is called right after the commit, on the loop,
        with None or the error (a callback, not a waiter: no loop turn in between).
        Writes of every session made in the same turn (events, finished executions, new
        rows) share one commit: a commit costs more than the rows in it, and with many
        busy sessions many writes arrive together. Any other store operation commits the
        pending ones first, so order is kept; :meth:`commit_now_if_small` lets a lone
        write someone waits on go before the turn ends.

        A write that may ``wait`` (seconds) lets the commit wait for the writes that
        follow it, up to then: while every write in it may wait, the commit runs on a
        timer (the first one's), and the first write that may not brings it back to the
        end of the turn. :meth:`hurry` does the same for a caller who waits on it."""
        self._tick_ops.append(op)
        self._tick_bytes += size
        if then is not None:
            self._tick_then.append(then)
        loop = asyncio.get_running_loop()
        if self._tick_done is None:
            self._tick_done = loop.create_future()
            if wait > 0:
                self._tick_handle = loop.call_later(wait, self._flush_tick)
                self._tick_timed = True
            else:
                self._tick_handle = loop.call_soon(self._flush_tick)
        elif wait <= 0:
            self.hurry()
        return self._tick_done

    def hurry(self) -> None:
        """Commit the pending writes at the end of this turn, even those that may wait."""
        if self._tick_done is not None and self._tick_timed:
            assert self._tick_handle is not None
            self._tick_handle.cancel()
            self._tick_handle = asyncio.get_running_loop().call_soon(self._flush_tick)
            self._tick_timed = False

    def _flush_tick(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()  # it may be this very call: harmless
            self._tick_handle, self._tick_timed = None, False
        done = self._tick_done
        if done is None:
            return
        ops, thens, size = self._tick_ops, self._tick_then, self._tick_bytes
        self._tick_ops, self._tick_then, self._tick_bytes = [], [], 0
        self._tick_done = None

        def commit() -> None:
            assert self._db is not None
            with self._db:
                self._db.execute("BEGIN")
                for op in ops:
                    op()
                self.ledger.write(self._db)

        def ended(error: Exception | None) -> None:
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
                    if thens:
                        done.exception()  # handed to the callbacks: not "never retrieved"
            for then in thens:
                try:
                    then(error)
                except Exception:
                    log.exception("a store commit callback failed")

        def settle(result: asyncio.Future[None]) -> None:
            if result.cancelled():
                ended(StoreError("the store was closed before the write was committed"))
            else:
                exc = result.exception()
                ended(
                    None
                    if exc is None
                    else exc
                    if isinstance(exc, Exception)
                    else StoreError(str(exc))
                )

        if size <= _INLINE_BYTES and self._queued == 0 and self._db is not None:
            try:
                commit()
            except Exception as exc:
                ended(exc)
            else:
                ended(None)
        else:
            self._submit_now(commit).add_done_callback(settle)
        self._wal_grew(size)

    def _wal_grew(self, size: int) -> None:
        self._wal_bytes += size
        if self._wal_bytes >= _CHECKPOINT_BYTES and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            self._wal_bytes = 0
            self._checkpoint = asyncio.ensure_future(self._off(self._q, "PRAGMA wal_checkpoint"))

    def _q(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        assert self._db is not None
        cur = self._db.execute(sql, tuple(params))
        return cur.fetchall()

    # -- tokens ------------------------------------------------------------------------

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
        """Make a token; returns it in clear text, the only time it is ever shown."""
        token = "kh_" + secrets.token_urlsafe(32)

        def insert() -> None:
            try:
                self._q(
                    "INSERT INTO tokens (name, token_hash, admin, created_at, read_only,"
                    " session_id, expires_at, acts_for) VALUES (?,?,?,?,?,?,?,?)",
                    (name, hash_token(token), int(admin), now_iso(), int(read_only), session_id,
                     expires_at.isoformat() if expires_at else None, acts_for),
                )  # fmt: skip
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"a token named {name!r} exists; pick another name") from exc

        await self._run(insert)
        return token

    async def principal_for(self, token: str) -> Principal | None:
        """The principal of a token (expired ones too: the caller names the expiry), or
        of a sign-in id (``khs_...``, from the review page's cookie) while it lasts."""
        if token.startswith(WEB_SESSION_PREFIX):
            found = await self.web_session(token)
            return found[0] if found else None
        rows = await self._run(
            self._q,
            f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE token_hash = ? AND revoked_at IS NULL",
            (hash_token(token),),
        )
        return _principal(rows[0]) if rows else None

    async def create_web_session(self, token: str, ttl: float) -> tuple[str, str, datetime]:
        """A sign-in for ``token``: its id (the cookie), its CSRF token and its expiry,
        which is never later than the token's own."""
        principal = await self.principal_for(token)
        assert principal is not None
        expires = datetime.now(UTC) + timedelta(seconds=ttl)
        if principal.expires_at is not None:
            expires = min(expires, principal.expires_at)
        sid = WEB_SESSION_PREFIX + secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(24)
        await self._run(
            self._q,
            "INSERT INTO web_sessions (id_hash, token_hash, csrf, created_at, expires_at)"
            " VALUES (?,?,?,?,?)",
            (hash_token(sid), hash_token(token), csrf, now_iso(), expires.isoformat()),
        )
        return sid, csrf, expires

    async def web_session(self, sid: str) -> tuple[Principal, str] | None:
        """The principal and CSRF token of a live sign-in; None once it expired or its
        token was revoked."""
        rows = await self._run(
            self._q,
            f"SELECT {_TOKEN_COLUMNS}, w.csrf, w.expires_at FROM web_sessions w"
            " JOIN tokens ON tokens.token_hash = w.token_hash"
            " WHERE w.id_hash = ? AND tokens.revoked_at IS NULL",
            (hash_token(sid),),
        )
        if not rows or datetime.fromisoformat(rows[0][7]) <= datetime.now(UTC):
            return None
        return _principal(rows[0]), str(rows[0][6])

    async def delete_web_session(self, sid: str) -> None:
        await self._run(
            self._q,
            "DELETE FROM web_sessions WHERE id_hash = ? OR expires_at <= ?",
            (hash_token(sid), now_iso()),
        )

    async def list_tokens(self) -> list[TokenInfo]:
        rows = await self._run(
            self._q,
            "SELECT name, admin, created_at, revoked_at, read_only, session_id, expires_at,"
            " acts_for FROM tokens ORDER BY id",
        )
        return [
            TokenInfo(
                name=r[0], admin=bool(r[1]), created_at=r[2], revoked_at=r[3],
                read_only=bool(r[4]), session_id=r[5], expires_at=r[6], acts_for=r[7],
            )
            for r in rows
        ]  # fmt: skip

    async def revoke_token(self, name: str) -> bool:
        def revoke() -> bool:
            assert self._db is not None
            cur = self._db.execute(
                "UPDATE tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                (now_iso(), name),
            )
            return cur.rowcount > 0

        return await self._run(revoke)

    # -- sessions ----------------------------------------------------------------------

    async def insert_session(self, s: StoredSession) -> None:
        def insert() -> None:
            self._q(
                "INSERT INTO sessions (id, owner, backend, state, created_at, limits, metadata,"
                " reason) VALUES (?,?,?,?,?,?,?,?)",
                (
                    s.id,
                    s.owner,
                    s.backend,
                    s.state,
                    s.created_at.isoformat(),
                    json.dumps(s.limits),
                    json.dumps(s.metadata),
                    s.reason,
                ),
            )
            # Here, not on the loop: the ledger is touched only by whoever holds the connection.
            self.ledger.add_session(s.id, s.owner)

        await self._run(insert)

    async def update_session(
        self,
        session_id: str,
        *,
        state: str,
        reason: str | None = None,
        deleted: bool = False,
        hibernation: str | None = None,
    ) -> None:
        """``hibernation``: the snapshot a hibernated session wakes from (schema v4); any
        other state clears it."""
        # ended_at starts a dead or deleted session's retention period (retention.py).
        at = now_iso()
        await self._run(
            self._q,
            "UPDATE sessions SET state = ?, reason = COALESCE(?, reason),"
            " deleted_at = CASE WHEN ? THEN ? ELSE deleted_at END,"
            " ended_at = CASE WHEN ? IN ('dead', 'deleted') THEN COALESCE(ended_at, ?) END,"
            " hibernation_snapshot = ?"
            " WHERE id = ?",
            (state, reason, int(deleted), at, state, at, hibernation, session_id),
        )

    async def get_session(self, session_id: str) -> StoredSession | None:
        rows = await self._run(self._q, "SELECT * FROM sessions WHERE id = ?", (session_id,))
        return _session(rows[0]) if rows else None

    async def list_sessions(
        self, owner: str | None = None, *, include_deleted: bool = False
    ) -> list[StoredSession]:
        sql = "SELECT * FROM sessions WHERE 1=1"
        params: list[Any] = []
        if owner is not None:
            sql += " AND owner = ?"
            params.append(owner)
        if not include_deleted:
            sql += " AND deleted_at IS NULL"
        rows = await self._off(self._q, sql + " ORDER BY created_at", params)
        return [_session(r) for r in rows]

    # -- executions --------------------------------------------------------------------

    def insert_execution_soon(
        self,
        e: StoredExecution,
        then: Callable[[Exception | None], None] | None = None,
        *,
        wait: float = 0.0,
    ) -> asyncio.Future[None]:
        """Queue the insert now, without waiting: every later call runs after it, so
        readers and updates always find the row. ``then`` and ``wait``: as in
        :meth:`append_event_soon`."""
        return self._in_tick(lambda: self._insert_execution(e), len(e.code), then, wait=wait)

    async def insert_execution(self, e: StoredExecution) -> StoredExecution:
        """Insert; if the owner already used the idempotency key, return that execution."""

        def insert() -> StoredExecution:
            try:
                self._insert_execution(e)
                assert self._db is not None
                self.ledger.write(self._db)
                return e
            except sqlite3.IntegrityError:
                found = self._q(
                    "SELECT * FROM executions WHERE owner = ? AND idempotency_key = ?",
                    (e.owner, e.idempotency_key),
                )
                if not found:
                    raise
                return _execution(found[0])

        return await self._run(insert)

    async def update_execution(
        self, execution_id: str, status: ExecutionStatus, record: ExecutionRecord | None = None
    ) -> None:
        body = record.model_dump_json() if record else None

        def update() -> None:
            assert self._db is not None
            with self._db:
                self._db.execute("BEGIN")
                cur = self._db.execute(
                    "UPDATE executions SET status = ?, record = COALESCE(?, record) WHERE id = ?"
                    " RETURNING session_id",
                    (status.value, body, execution_id),
                )
                for (session_id,) in cur.fetchall():
                    self.ledger.charge(session_id, len(body or ""))
                self.ledger.write(self._db)

        await self._run(update)

    async def finish_execution(self, record: ExecutionRecord, audit: AuditEntry) -> None:
        """The final record and its audit entry, in one transaction."""
        await asyncio.shield(self.finish_execution_soon(record, audit))

    def finish_execution_soon(
        self, record: ExecutionRecord, audit: AuditEntry
    ) -> asyncio.Future[None]:
        """:meth:`finish_execution` in this loop turn's commit, without waiting; the future
        resolves once it is committed."""
        body = record.model_dump_json()
        session_id = audit.session_id or ""

        def finish() -> None:
            assert self._db is not None
            self._db.execute(
                "UPDATE executions SET status = ?, record = ? WHERE id = ?",
                (record.status.value, body, record.execution_id),
            )
            self.ledger.charge(session_id, len(body))
            self._insert_audit(audit)

        return self._in_tick(finish, len(body) + len(audit.code or ""))

    async def get_execution(self, execution_id: str) -> StoredExecution | None:
        rows = await self._run(self._q, "SELECT * FROM executions WHERE id = ?", (execution_id,))
        return _execution(rows[0]) if rows else None

    def _insert_execution(self, e: StoredExecution) -> None:
        self._q(
            "INSERT INTO executions (id, session_id, owner, code, status, idempotency_key,"
            " created_at) VALUES (?,?,?,?,?,?,?)",
            (e.id, e.session_id, e.owner, e.code, e.status.value, e.idempotency_key,
             e.created_at.isoformat()),
        )  # fmt: skip
        self.ledger.charge(e.session_id, len(e.code))

    async def execution_by_key(self, owner: str, key: str) -> StoredExecution | None:
        """The owner's execution made with this idempotency key, if any."""
        rows = await self._run(
            self._q,
            "SELECT * FROM executions WHERE owner = ? AND idempotency_key = ?",
            (owner, key),
        )
        return _execution(rows[0]) if rows else None

    async def unfinished_executions(self, session_id: str) -> list[StoredExecution]:
        rows = await self._off(
            self._q,
            "SELECT * FROM executions WHERE session_id = ? AND record IS NULL ORDER BY created_at",
            (session_id,),
        )
        return [_execution(r) for r in rows]

    async def executions_of(self, session_id: str) -> list[StoredExecution]:
        """Every execution of a session, oldest first (for exports)."""
        rows = await self._off(
            self._q,
            "SELECT * FROM executions WHERE session_id = ? ORDER BY created_at, rowid",
            (session_id,),
        )
        return [_execution(r) for r in rows]

    # -- events ------------------------------------------------------------------------

    def append_event_soon(
        self,
        session_id: str,
        seq: int,
        execution_id: str,
        body: str,
        then: Callable[[Exception | None], None],
        *,
        wait: float = 0.0,
    ) -> asyncio.Future[None]:
        """Add an event row (its JSON ``body``) to this loop turn's commit, or with ``wait``
        to a commit that may wait that long for the writes that follow; ``then(error)``
        runs right after that commit (see ``_in_tick``). Returns the commit's future: see
        :meth:`commit_pending`."""
        row = (session_id, seq, execution_id, body)

        def append() -> None:
            assert self._db is not None
            cur = self._db.execute(
                "INSERT OR IGNORE INTO events (session_id, seq, execution_id, body) VALUES (?,?,?,?)",
                row,
            )
            if cur.rowcount > 0:
                self.ledger.charge(session_id, len(body))

        return self._in_tick(append, len(body), then, wait=wait)

    def commit_now_if_small(self, max_ops: int) -> None:
        """Commit this turn's writes now rather than at the end of the turn, if there are
        at most ``max_ops`` of them. For a write someone is waiting on (a cell's final
        event): alone, it need not wait for the rest of the turn; among many (busy
        sessions), it keeps riding the shared commit."""
        if self._tick_done is not None and len(self._tick_ops) <= max_ops:
            self._flush_tick()

    def commit_pending(self, tick: asyncio.Future[None] | None) -> bool:
        """Whether ``tick`` (a future from :meth:`append_event_soon`) is the pending commit,
        not begun yet: a write added now still lands in it."""
        return tick is not None and tick is self._tick_done

    async def events_since(
        self, session_id: str, since: int, limit: int = 1000, max_bytes: int = 4 * 2**20
    ) -> list[tuple[int, str]]:
        """The next page of a session's events after ``since`` as ``(seq, JSON)``: at most
        ``limit`` events and about ``max_bytes`` (always at least one), so replay memory
        stays bounded and the text goes to clients without a parse/serialize round trip."""

        def page() -> list[tuple[int, str]]:
            assert self._db is not None
            cur = self._db.execute(
                "SELECT seq, body FROM events WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (session_id, since, limit),
            )
            rows: list[tuple[int, str]] = []
            size = 0
            for seq, body in cur:
                rows.append((seq, body))
                size += len(body)
                if size >= max_bytes:
                    break
            cur.close()
            return rows

        return await self._off(page)

    async def events_of(self, execution_id: str) -> list[Event]:
        rows = await self._off(
            self._q, "SELECT body FROM events WHERE execution_id = ? ORDER BY seq", (execution_id,)
        )
        return [_EVENT.validate_json(r[0]) for r in rows]

    async def session_events_of(self, session_id: str) -> list[Event]:
        """The session's events that belong to no execution (notices such as a recovery),
        oldest first (for exports)."""
        rows = await self._off(
            self._q,
            "SELECT body FROM events WHERE session_id = ? AND execution_id = '' ORDER BY seq",
            (session_id,),
        )
        return [_EVENT.validate_json(r[0]) for r in rows]

    async def has_started(self, execution_id: str) -> bool:
        """Whether the execution's events include its ``running`` status."""
        rows = await self._run(
            self._q,
            "SELECT 1 FROM events WHERE execution_id = ? AND body LIKE ? LIMIT 1",
            (execution_id, '%"type":"status","status":"running"%'),
        )
        return bool(rows)

    async def last_seq(self, session_id: str) -> int:
        rows = await self._run(
            self._q, "SELECT MAX(seq) FROM events WHERE session_id = ?", (session_id,)
        )
        return int(rows[0][0] or 0)

    # -- snapshots ---------------------------------------------------------------------

    async def insert_snapshot(self, s: StoredSnapshot) -> None:
        await self._run(
            self._q,
            "INSERT INTO snapshots (id, session_id, owner, created_at, size, sha256, mac, metadata)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                s.id,
                s.session_id,
                s.owner,
                s.created_at.isoformat(),
                s.size,
                s.sha256,
                s.mac,
                json.dumps(s.metadata),
            ),
        )

    async def get_snapshot(self, snapshot_id: str) -> StoredSnapshot | None:
        rows = await self._run(self._q, "SELECT * FROM snapshots WHERE id = ?", (snapshot_id,))
        return _snapshot(rows[0]) if rows else None

    async def list_snapshots(self, owner: str) -> list[StoredSnapshot]:
        rows = await self._run(
            self._q, "SELECT * FROM snapshots WHERE owner = ? ORDER BY created_at", (owner,)
        )
        return [_snapshot(r) for r in rows]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._run(self._q, "DELETE FROM snapshots WHERE id = ?", (snapshot_id,))

    # -- batches -----------------------------------------------------------------------

    async def insert_batch(
        self, batch: StoredBatch, items: Sequence[StoredBatchItem]
    ) -> list[StoredBatchItem]:
        """Insert a batch and its items in one transaction. An item whose idempotency key
        the owner already used (in an earlier batch, or earlier in this one) is stored as a
        duplicate of that item, without the key; the items are returned as stored."""

        def insert() -> list[StoredBatchItem]:
            assert self._db is not None
            stored: list[StoredBatchItem] = []
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute(
                    "INSERT INTO batches (id, owner, created_at, concurrency) VALUES (?,?,?,?)",
                    (batch.id, batch.owner, batch.created_at.isoformat(), batch.concurrency),
                )
                for item in items:
                    if item.idempotency_key is not None:
                        first = self._db.execute(
                            "SELECT batch_id, idx FROM batch_items"
                            " WHERE owner = ? AND idempotency_key = ?",
                            (item.owner, item.idempotency_key),
                        ).fetchone()
                        if first is not None:
                            item = item.model_copy(
                                update={
                                    "idempotency_key": None,
                                    "duplicate_of": (first[0], first[1]),
                                }
                            )
                    dup = item.duplicate_of
                    self._db.execute(
                        "INSERT INTO batch_items (batch_id, idx, owner, idempotency_key, status,"
                        " queued_at, dup_batch_id, dup_idx) VALUES (?,?,?,?,?,?,?,?)",
                        (
                            item.batch_id,
                            item.index,
                            item.owner,
                            item.idempotency_key,
                            item.status.value,
                            item.queued_at.isoformat(),
                            dup[0] if dup else None,
                            dup[1] if dup else None,
                        ),
                    )
                    stored.append(item)
            return stored

        return await self._run(insert)

    async def used_batch_keys(self, owner: str, keys: Sequence[str]) -> set[str]:
        """Which of ``keys`` the owner has already used for batch items."""
        if not keys:
            return set()
        marks = ",".join("?" * len(keys))
        rows = await self._run(
            self._q,
            f"SELECT idempotency_key FROM batch_items WHERE owner = ? AND idempotency_key IN ({marks})",
            (owner, *keys),
        )
        return {r[0] for r in rows}

    async def update_batch_item(
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
    ) -> None:
        """Set the given fields (None leaves one as it is). ``release_key`` frees the item's
        idempotency key, for an item whose code never reached a kernel: sent again, it runs."""
        await self._run(
            self._q,
            "UPDATE batch_items SET status = COALESCE(?, status),"
            " session_id = COALESCE(?, session_id), execution_id = COALESCE(?, execution_id),"
            " started_at = COALESCE(?, started_at), finished_at = COALESCE(?, finished_at),"
            " error = COALESCE(?, error),"
            " idempotency_key = CASE WHEN ? THEN NULL ELSE idempotency_key END"
            " WHERE batch_id = ? AND idx = ?",
            (
                status.value if status else None,
                session_id,
                execution_id,
                started_at.isoformat() if started_at else None,
                finished_at.isoformat() if finished_at else None,
                error,
                int(release_key),
                batch_id,
                index,
            ),
        )

    async def cancel_batch(self, batch_id: str) -> None:
        await self._run(
            self._q,
            "UPDATE batches SET cancelled_at = COALESCE(cancelled_at, ?) WHERE id = ?",
            (now_iso(), batch_id),
        )

    async def get_batch(self, batch_id: str) -> StoredBatch | None:
        rows = await self._run(self._q, "SELECT * FROM batches WHERE id = ?", (batch_id,))
        return _batch(rows[0]) if rows else None

    async def list_batches(self, owner: str, limit: int = 100) -> list[StoredBatch]:
        """The owner's newest batches, newest first."""
        rows = await self._off(
            self._q,
            "SELECT * FROM batches WHERE owner = ? ORDER BY created_at DESC LIMIT ?",
            (owner, limit),
        )
        return [_batch(r) for r in rows]

    # A duplicate shows the progress of the item it repeats (that item's columns).
    _ITEMS = (
        "SELECT i.batch_id, i.idx, i.owner, i.idempotency_key,"
        " COALESCE(o.status, i.status), COALESCE(o.session_id, i.session_id),"
        " COALESCE(o.execution_id, i.execution_id), i.queued_at,"
        " COALESCE(o.started_at, i.started_at), COALESCE(o.finished_at, i.finished_at),"
        " COALESCE(o.error, i.error), i.dup_batch_id, i.dup_idx"
        " FROM batch_items i"
        " LEFT JOIN batch_items o ON o.batch_id = i.dup_batch_id AND o.idx = i.dup_idx"
    )

    async def batch_items(self, batch_id: str) -> list[StoredBatchItem]:
        """The batch's items in order; duplicates resolved to the item they repeat."""
        rows = await self._off(
            self._q, self._ITEMS + " WHERE i.batch_id = ? ORDER BY i.idx", (batch_id,)
        )
        return [_batch_item(r) for r in rows]

    async def batch_statuses(self, batch_ids: Sequence[str]) -> dict[str, list[ExecutionStatus]]:
        """Each batch's item statuses (duplicates resolved), for listings."""
        if not batch_ids:
            return {}
        marks = ",".join("?" * len(batch_ids))
        rows = await self._off(
            self._q,
            "SELECT i.batch_id, COALESCE(o.status, i.status) FROM batch_items i"
            " LEFT JOIN batch_items o ON o.batch_id = i.dup_batch_id AND o.idx = i.dup_idx"
            f" WHERE i.batch_id IN ({marks})",
            tuple(batch_ids),
        )
        out: dict[str, list[ExecutionStatus]] = {b: [] for b in batch_ids}
        for r in rows:
            out[r[0]].append(ExecutionStatus(r[1]))
        return out

    async def unfinished_batch_items(self) -> list[StoredBatchItem]:
        """Items a previous process left queued or running (never duplicates)."""
        rows = await self._off(
            self._q,
            self._ITEMS + " WHERE i.status IN (?, ?) AND i.dup_batch_id IS NULL",
            (ExecutionStatus.QUEUED.value, ExecutionStatus.RUNNING.value),
        )
        return [_batch_item(r) for r in rows]

    # -- audit -------------------------------------------------------------------------

    async def audit(self, entry: AuditEntry) -> None:
        await self._run(self._insert_audit, entry)

    def _insert_audit(self, entry: AuditEntry) -> None:
        # Who, when and what, with the code bounded: its head, full length and hash.
        code, code_bytes, code_sha256 = bounded_code(entry.code, self.audit_code_bytes)
        self._q(
            "INSERT INTO audit (at, principal, action, session_id, execution_id, code, status,"
            " duration, cpu_seconds, peak_memory_bytes, output_bytes, client, detail,"
            " code_bytes, code_sha256) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                now_iso(),
                entry.principal,
                entry.action,
                entry.session_id,
                entry.execution_id,
                code,
                entry.status,
                entry.duration,
                entry.cpu_seconds,
                entry.peak_memory_bytes,
                entry.output_bytes,
                entry.client,
                json.dumps(entry.detail) if entry.detail is not None else None,
                code_bytes,
                code_sha256,
            ),
        )

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
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("session_id", session_id), ("principal", principal),
                              ("action", action)):  # fmt: skip
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        if text:
            where.append("(instr(lower(code), lower(?)) > 0 OR instr(lower(detail), lower(?)) > 0)")
            params += [text, text]
        if before is not None:
            where.append("id < ?")
            params.append(before)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "")
        order = " ORDER BY id" if limit is None else f" ORDER BY id DESC LIMIT {int(limit)}"

        def fetch() -> list[dict[str, Any]]:
            assert self._db is not None
            cur = self._db.execute(sql + order, params)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

        return await self._off(fetch)


def bounded_code(code: str | None, limit: int) -> tuple[str | None, int | None, str | None]:
    """(the first ``limit`` bytes of the code, cut at a character boundary, its length in
    bytes, its SHA-256): what the audit log keeps of a cell."""
    if code is None:
        return None, None, None
    raw = code.encode("utf-8", "surrogatepass")
    head = raw[:limit].decode("utf-8", "ignore") if len(raw) > limit else code
    return head, len(raw), hashlib.sha256(raw).hexdigest()


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _batch(r: sqlite3.Row) -> StoredBatch:
    return StoredBatch(
        id=r[0],
        owner=r[1],
        created_at=datetime.fromisoformat(r[2]),
        concurrency=r[3],
        cancelled_at=_time(r[4]),
    )


def _batch_item(r: sqlite3.Row) -> StoredBatchItem:
    return StoredBatchItem(
        batch_id=r[0],
        index=r[1],
        owner=r[2],
        idempotency_key=r[3],
        status=ExecutionStatus(r[4]),
        session_id=r[5],
        execution_id=r[6],
        queued_at=datetime.fromisoformat(r[7]),
        started_at=_time(r[8]),
        finished_at=_time(r[9]),
        error=r[10],
        duplicate_of=(r[11], r[12]) if r[11] is not None else None,
    )


def _snapshot(r: sqlite3.Row) -> StoredSnapshot:
    return StoredSnapshot(
        id=r[0],
        session_id=r[1],
        owner=r[2],
        created_at=datetime.fromisoformat(r[3]),
        size=r[4],
        sha256=r[5],
        mac=r[6],
        metadata=json.loads(r[7]),
    )


def _session(r: sqlite3.Row) -> StoredSession:
    return StoredSession(
        id=r[0],
        owner=r[1],
        backend=r[2],
        state=r[3],
        created_at=datetime.fromisoformat(r[4]),
        limits=json.loads(r[5]),
        metadata=json.loads(r[6]),
        reason=r[7],
        deleted_at=datetime.fromisoformat(r[8]) if r[8] else None,
        stored_bytes=int(r[10] or 0) if len(r) > 10 else 0,  # ended_at, stored_bytes: v2
        hibernation=r[11] if len(r) > 11 else None,  # v4
    )


def _execution(r: sqlite3.Row) -> StoredExecution:
    return StoredExecution(
        id=r[0],
        session_id=r[1],
        owner=r[2],
        code=r[3],
        status=ExecutionStatus(r[4]),
        idempotency_key=r[5],
        created_at=datetime.fromisoformat(r[6]),
        record=ExecutionRecord.model_validate_json(r[7]) if r[7] else None,
    )
