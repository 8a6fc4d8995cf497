"""What the store keeps, as the rest of kernelhub sees it: one pydantic model per row kind,
and the few pure helpers that shape values before they are stored (token hashes, the
bounded code of an audit entry). Shared by every backend (see base.py)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from kernelhub.models import ExecutionRecord, ExecutionStatus

WEB_SESSION_PREFIX = "khs_"  # a sign-in id (the review page's cookie), not a token


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


class EgressGrants(BaseModel):
    """A session's "for this session" answers to its egress gate, as ``[host, port]``."""

    granted: list[tuple[str, int]] = Field(default_factory=list)
    denied: list[tuple[str, int]] = Field(default_factory=list)


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
    # Issue #24's shared store: which node runs the session, and until when that node's
    # claim holds (renewed by its heartbeat; an expired lease lets another node take it).
    node: str | None = None
    lease_expires_at: datetime | None = None
    # Issue #25: the trust tier a restarted gateway keeps. ``egress_grants`` is None on a
    # row made before these were recorded (its owner's default policy applies then).
    profile: str | None = None
    runtime: str | None = None
    egress_policy: str | None = None
    egress_grants: EgressGrants | None = None


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
    node: str | None = None  # the node that claimed it (runs or ran it)
    # Its input (BatchItemIn JSON), written with the item for any node to run; reads
    # leave it out (a claim returns it).
    body: str | None = None


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


def bounded_code(code: str | None, limit: int) -> tuple[str | None, int | None, str | None]:
    """(the first ``limit`` bytes of the code, cut at a character boundary, its length in
    bytes, its SHA-256): what the audit log keeps of a cell."""
    if code is None:
        return None, None, None
    raw = code.encode("utf-8", "surrogatepass")
    head = raw[:limit].decode("utf-8", "ignore") if len(raw) > limit else code
    return head, len(raw), hashlib.sha256(raw).hexdigest()
