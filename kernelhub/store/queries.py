"""The store's operations as sans-I/O generators, written once for every backend.

An operation is a generator that yields :class:`Query` values and receives each one's rows
back; its return value is the operation's result. It never touches a connection: the
backend's driver runs it (SQLite on the loop or its thread, PostgreSQL on its connection),
inside a transaction the driver owns. So the SQL and the row shapes live here, once, and a
backend is only a way to run statements.

This module holds what an operation needs in general, and the rows of accounts (tokens,
sign-ins), sessions, snapshots and retention; executions.py holds the recorder's rows
(executions, events, audit) and batches.

Statements are written in SQLite's dialect with ``?`` placeholders; a query whose text
must differ on PostgreSQL carries that text in ``postgres``.

Why not SQLAlchemy Core: its async engine reaches SQLite through a thread (aiosqlite), and
the whole point of the SQLite driver is that a small commit runs inline on the loop (a
thread round trip costs about six small WAL commits); the few dialect differences here fit
in one field.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Generator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from kernelhub.errors import StoreConflictError
from kernelhub.store.records import (
    WEB_SESSION_PREFIX,
    EgressGrants,
    Principal,
    StoredSession,
    StoredSnapshot,
    TokenInfo,
    hash_token,
    now_iso,
)

T = TypeVar("T")
Row = tuple[Any, ...]


class Query(NamedTuple):
    sql: str
    params: tuple[Any, ...] = ()
    many: Sequence[tuple[Any, ...]] | None = None  # run once per parameter tuple
    ddl: bool = False  # a schema statement: its types are translated (migrations.ddl)
    postgres: str | None = None  # the text on PostgreSQL, where the dialects differ
    # Receive [(rows changed,)] rather than rows (with ``many``: one per parameter tuple).
    # RETURNING would do, but costs SQLite three times a plain insert (measured: 30 vs 10
    # us an event row), and event rows are the hot path.
    rowcount: bool = False


Op = Generator[Query, list[Row], T]


def time_of(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


# -- accounts ---------------------------------------------------------------------------

_TOKEN_COLUMNS = (
    "tokens.name, tokens.admin, tokens.read_only, tokens.session_id, tokens.expires_at,"
    " tokens.acts_for"
)


def _principal(r: Row) -> Principal:
    """From the columns ``_TOKEN_COLUMNS`` names, in its order."""
    name, admin, read_only, session_id, expires_at, acts_for = r[:6]
    return Principal(
        name=acts_for or name,
        admin=bool(admin),
        read_only=bool(read_only),
        session_id=session_id,
        expires_at=time_of(expires_at),
        token=name if acts_for else None,
    )


def create_token(
    token: str,
    name: str,
    *,
    admin: bool,
    read_only: bool,
    session_id: str | None,
    expires_at: datetime | None,
    acts_for: str | None,
) -> Op[None]:
    inserted = yield Query(
        "INSERT INTO tokens (name, token_hash, admin, created_at, read_only, session_id,"
        " expires_at, acts_for) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        (name, hash_token(token), int(admin), now_iso(), int(read_only), session_id,
         expires_at.isoformat() if expires_at else None, acts_for),
        rowcount=True,
    )  # fmt: skip
    if not inserted[0][0]:
        raise StoreConflictError(f"a token named {name!r} exists; pick another name")


def principal_for(token: str) -> Op[Principal | None]:
    if token.startswith(WEB_SESSION_PREFIX):
        found = yield from web_session(token)
        return found[0] if found else None
    rows = yield Query(
        f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE token_hash = ? AND revoked_at IS NULL",
        (hash_token(token),),
    )
    return _principal(rows[0]) if rows else None


def create_web_session(token: str, ttl: float) -> Op[tuple[str, str, datetime]]:
    principal = yield from principal_for(token)
    assert principal is not None
    expires = datetime.now(UTC) + timedelta(seconds=ttl)
    if principal.expires_at is not None:
        expires = min(expires, principal.expires_at)
    sid = WEB_SESSION_PREFIX + secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(24)
    yield Query(
        "INSERT INTO web_sessions (id_hash, token_hash, csrf, created_at, expires_at)"
        " VALUES (?,?,?,?,?)",
        (hash_token(sid), hash_token(token), csrf, now_iso(), expires.isoformat()),
    )
    return sid, csrf, expires


def web_session(sid: str) -> Op[tuple[Principal, str] | None]:
    rows = yield Query(
        f"SELECT {_TOKEN_COLUMNS}, w.csrf, w.expires_at FROM web_sessions w"
        " JOIN tokens ON tokens.token_hash = w.token_hash"
        " WHERE w.id_hash = ? AND tokens.revoked_at IS NULL",
        (hash_token(sid),),
    )
    if not rows or datetime.fromisoformat(rows[0][7]) <= datetime.now(UTC):
        return None
    return _principal(rows[0]), str(rows[0][6])


def delete_web_session(sid: str) -> Op[None]:
    yield Query(
        "DELETE FROM web_sessions WHERE id_hash = ? OR expires_at <= ?",
        (hash_token(sid), now_iso()),
    )


def list_tokens() -> Op[list[TokenInfo]]:
    rows = yield Query(
        "SELECT name, admin, created_at, revoked_at, read_only, session_id, expires_at,"
        " acts_for FROM tokens ORDER BY id"
    )
    return [
        TokenInfo(
            name=r[0], admin=bool(r[1]), created_at=r[2], revoked_at=r[3],
            read_only=bool(r[4]), session_id=r[5], expires_at=r[6], acts_for=r[7],
        )
        for r in rows
    ]  # fmt: skip


def revoke_token(name: str) -> Op[bool]:
    changed = yield Query(
        "UPDATE tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
        (now_iso(), name),
        rowcount=True,
    )
    return bool(changed[0][0])


# -- sessions ---------------------------------------------------------------------------

# Named, not ``*``: a migration that adds a column changes no reader.
SESSION_COLUMNS = (
    "id, owner, backend, state, created_at, limits, metadata, reason, deleted_at,"
    " stored_bytes, hibernation_snapshot, node, lease_expires_at,"
    " profile, runtime, egress_policy, egress_grants"
)


def session_of(r: Row) -> StoredSession:
    return StoredSession(
        id=r[0],
        owner=r[1],
        backend=r[2],
        state=r[3],
        created_at=datetime.fromisoformat(r[4]),
        limits=json.loads(r[5]),
        metadata=json.loads(r[6]),
        reason=r[7],
        deleted_at=time_of(r[8]),
        stored_bytes=int(r[9] or 0),
        hibernation=r[10],
        node=r[11],
        lease_expires_at=time_of(r[12]),
        profile=r[13],
        runtime=r[14],
        egress_policy=r[15],
        egress_grants=EgressGrants.model_validate_json(r[16]) if r[16] else None,
    )


def insert_session(s: StoredSession) -> Op[None]:
    yield Query(
        "INSERT INTO sessions (id, owner, backend, state, created_at, limits, metadata,"
        " reason, node, lease_expires_at, profile, runtime, egress_policy, egress_grants)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (s.id, s.owner, s.backend, s.state, s.created_at.isoformat(), json.dumps(s.limits),
         json.dumps(s.metadata), s.reason, s.node,
         s.lease_expires_at.isoformat() if s.lease_expires_at else None, s.profile,
         s.runtime, s.egress_policy,
         s.egress_grants.model_dump_json() if s.egress_grants else None),
    )  # fmt: skip


def set_egress_grants(session_id: str, grants: EgressGrants) -> Op[None]:
    yield Query(
        "UPDATE sessions SET egress_grants = ? WHERE id = ?",
        (grants.model_dump_json(), session_id),
    )


def update_session(
    session_id: str,
    *,
    state: str,
    reason: str | None = None,
    deleted: bool = False,
    hibernation: str | None = None,
) -> Op[None]:
    # ended_at starts a dead or deleted session's retention period (retention.py).
    at = now_iso()
    yield Query(
        "UPDATE sessions SET state = ?, reason = COALESCE(?, reason),"
        " deleted_at = CASE WHEN ? = 1 THEN ? ELSE deleted_at END,"
        " ended_at = CASE WHEN ? IN ('dead', 'deleted') THEN COALESCE(ended_at, ?) END,"
        " hibernation_snapshot = ?"
        " WHERE id = ?",
        (state, reason, int(deleted), at, state, at, hibernation, session_id),
    )


def get_session(session_id: str) -> Op[StoredSession | None]:
    rows = yield Query(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,))
    return session_of(rows[0]) if rows else None


def list_sessions(owner: str | None, include_deleted: bool) -> Op[list[StoredSession]]:
    sql = f"SELECT {SESSION_COLUMNS} FROM sessions WHERE 1=1"
    params: tuple[Any, ...] = ()
    if owner is not None:
        sql += " AND owner = ?"
        params = (owner,)
    if not include_deleted:
        sql += " AND deleted_at IS NULL"
    rows = yield Query(sql + " ORDER BY created_at", params)
    return [session_of(r) for r in rows]


def renew_leases(node: str, expires_at: datetime) -> Op[int]:
    """Extend ``node``'s lease on every session it runs; returns how many."""
    changed = yield Query(
        "UPDATE sessions SET lease_expires_at = ? WHERE node = ? AND deleted_at IS NULL"
        " AND state NOT IN ('dead', 'deleted')",
        (expires_at.isoformat(), node),
        rowcount=True,
    )
    return int(changed[0][0])


def expired_leases(now: datetime) -> Op[list[StoredSession]]:
    """Running sessions whose node's lease ran out: the ones another node may take."""
    rows = yield Query(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE lease_expires_at IS NOT NULL"
        " AND lease_expires_at <= ? AND deleted_at IS NULL AND state NOT IN ('dead', 'deleted')"
        " ORDER BY lease_expires_at",
        (now.isoformat(),),
    )
    return [session_of(r) for r in rows]


# -- snapshots --------------------------------------------------------------------------


def _snapshot(r: Row) -> StoredSnapshot:
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


_SNAPSHOT = "SELECT id, session_id, owner, created_at, size, sha256, mac, metadata FROM snapshots"


def insert_snapshot(s: StoredSnapshot) -> Op[None]:
    yield Query(
        "INSERT INTO snapshots (id, session_id, owner, created_at, size, sha256, mac, metadata)"
        " VALUES (?,?,?,?,?,?,?,?)",
        (s.id, s.session_id, s.owner, s.created_at.isoformat(), s.size, s.sha256, s.mac,
         json.dumps(s.metadata)),
    )  # fmt: skip


def get_snapshot(snapshot_id: str) -> Op[StoredSnapshot | None]:
    rows = yield Query(_SNAPSHOT + " WHERE id = ?", (snapshot_id,))
    return _snapshot(rows[0]) if rows else None


def list_snapshots(owner: str) -> Op[list[StoredSnapshot]]:
    rows = yield Query(_SNAPSHOT + " WHERE owner = ? ORDER BY created_at", (owner,))
    return [_snapshot(r) for r in rows]


def delete_snapshot(snapshot_id: str) -> Op[None]:
    yield Query("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))


# -- retention: bounded steps, oldest first ---------------------------------------------

PURGE_STEPS = {
    # events has no rowid on SQLite: stepped through its primary key.
    "events": "DELETE FROM events WHERE session_id = ? AND seq IN"
    " (SELECT seq FROM events WHERE session_id = ? ORDER BY seq LIMIT ?)",
    "executions": "DELETE FROM executions WHERE id IN"
    " (SELECT id FROM executions WHERE session_id = ? LIMIT ?)",
}


def purge_step(table: str, session_id: str, rows: int) -> Op[int]:
    """Delete up to ``rows`` of the session's rows of ``table``; returns how many went."""
    sql = PURGE_STEPS[table]
    params = (session_id,) * sql.count("session_id = ?") + (rows,)
    deleted = yield Query(sql, params, rowcount=True)
    return int(deleted[0][0])


def trim_audit(before: str, rows: int) -> Op[int]:
    deleted = yield Query(
        "DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE at < ? ORDER BY at LIMIT ?)",
        (before, rows),
        rowcount=True,
    )
    return int(deleted[0][0])


def drop_session(session_id: str) -> Op[list[str]]:
    """The last step of a purge, once its events and executions are gone: the session's
    internal snapshots and its row. Returns the snapshot ids whose blobs to remove."""
    rows = yield Query(
        "DELETE FROM snapshots WHERE session_id = ?"
        " AND COALESCE(json_extract(metadata, '$.kind'), 'snapshot') != 'snapshot' RETURNING id",
        (session_id,),
        postgres="DELETE FROM snapshots WHERE session_id = ?"
        " AND COALESCE(metadata::json->>'kind', 'snapshot') != 'snapshot' RETURNING id",
    )
    yield Query("DELETE FROM sessions WHERE id = ?", (session_id,))
    return [r[0] for r in rows]


def ended_before(cutoff: str) -> Op[list[str]]:
    rows = yield Query(
        "SELECT id FROM sessions WHERE ended_at IS NOT NULL AND ended_at <= ? ORDER BY ended_at",
        (cutoff,),
    )
    return [r[0] for r in rows]
