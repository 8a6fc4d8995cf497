"""The gateway <-> client protocol: REST bodies and WebSocket frames. Pydantic only, so the
SDK imports it without the server's dependencies. Documented in ``docs/protocol.md``.

Every WebSocket frame is one JSON object with a ``type``; unknown fields are refused so a
typo is an error, not a silently ignored option. ``PROTOCOL_VERSION`` is sent in ``hello``.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kernelhub.models import Event, ExecutionRecord, ExecutionStatus

PROTOCOL_VERSION = 1
MAX_CODE_CHARS = 1_000_000
MAX_METADATA_BYTES = 16_384


class _In(BaseModel):
    """Anything a client sends: strict about unknown fields."""

    model_config = ConfigDict(extra="forbid")


# -- REST ------------------------------------------------------------------------------


class LimitsIn(_In):
    """Per-session limits a client may ask for; each is capped by the operator's maximum."""

    memory_bytes: int | None = Field(None, ge=32 * 2**20)
    cpus: float | None = Field(None, gt=0, le=64)
    pids: int | None = Field(None, ge=16, le=32768)
    disk_bytes: int | None = Field(None, ge=2**20, description="size of /workspace")
    cell_timeout: float | None = Field(None, gt=0, description="seconds; omit for the default")
    output_bytes: int | None = Field(None, ge=1024)


class SessionCreate(_In):
    limits: LimitsIn = Field(default_factory=LimitsIn)
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    from_snapshot: str | None = Field(
        None, description="restore this snapshot (yours) into the new session's fresh sandbox"
    )
    checkpoints: Literal["off", "every_cell"] | float = Field(
        "off",
        description="automatic checkpoints after successful cells: off, every_cell, or a "
        "number = at most one every that many seconds. Incremental: only what changed is "
        "written. They make rewind possible",
    )


class RewindRequest(_In):
    before_cell: int = Field(
        ge=1, description="execution count of the cell to undo (and all after)"
    )


class RewindReport(BaseModel):
    before_cell: int
    checkpoint_after_cell: int | None = Field(description="None: rewound to an empty kernel")
    restored: list[str]
    failed: dict[str, str]
    duration: float


class SessionState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    PAUSED = "paused"
    HIBERNATED = "hibernated"  # checkpointed, sandbox removed; wakes on next use
    DEAD = "dead"
    DELETED = "deleted"


class SessionInfo(BaseModel):
    id: str
    owner: str
    state: SessionState
    backend: str
    created_at: datetime
    limits: dict[str, Any]
    metadata: dict[str, Any]
    last_seq: int = 0
    reason: str | None = None
    warm: bool = Field(False, description="its sandbox came ready from the warm pool")
    restore: RestoreReport | None = Field(None, description="set when made from a snapshot")


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class SnapshotInfo(BaseModel):
    """A stored snapshot. ``saved``/``skipped`` name every variable: what came along, and
    what could not, with the reason."""

    id: str
    session_id: str
    created_at: datetime
    size_bytes: int
    duration: float
    execution_count: int | None = None
    saved: list[str]
    skipped: dict[str, str]


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class RestoreReport(BaseModel):
    """What a restore brought back into a new session, and what it could not."""

    snapshot_id: str
    restored: list[str]
    failed: dict[str, str]
    skipped: dict[str, str]
    execution_count: int | None = None
    duration: float


class ExecutionCreate(_In):
    code: str = Field(max_length=MAX_CODE_CHARS)
    timeout: float | None = Field(None, gt=0, description="seconds; omit for the session's")
    wait: bool = False
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class ExecutionInfo(BaseModel):
    id: str
    session_id: str
    status: ExecutionStatus
    code: str
    created_at: datetime
    record: ExecutionRecord | None = None
    events: list[Event] | None = Field(None, description="outputs in order (when finished)")


class InputReply(_In):
    value: str = Field(max_length=MAX_CODE_CHARS)


class FileInfo(BaseModel):
    path: str
    size: int


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: what went wrong and what to do."""

    error: str = Field(description="machine-readable kind, e.g. not_found")
    message: str
    detail: Any = None


# -- WebSocket: client -> server -------------------------------------------------------


class ExecuteFrame(_In):
    type: Literal["execute"]
    code: str = Field(max_length=MAX_CODE_CHARS)
    timeout: float | None = Field(None, gt=0)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    request_id: str | None = Field(None, max_length=200)


class InterruptFrame(_In):
    type: Literal["interrupt"]
    request_id: str | None = Field(None, max_length=200)


class InputReplyFrame(_In):
    type: Literal["input_reply"]
    execution_id: str
    value: str = Field(max_length=MAX_CODE_CHARS)
    request_id: str | None = Field(None, max_length=200)


class PauseFrame(_In):
    type: Literal["pause"]
    request_id: str | None = Field(None, max_length=200)


class ResumeFrame(_In):
    type: Literal["resume"]
    request_id: str | None = Field(None, max_length=200)


class SnapshotFrame(_In):
    """Take a snapshot; answered by ``SnapshotCreatedFrame``."""

    type: Literal["snapshot"]
    request_id: str | None = Field(None, max_length=200)


class RewindFrame(_In):
    """Undo cell ``before_cell`` and all after it; answered by ``RewoundFrame``."""

    type: Literal["rewind"]
    before_cell: int = Field(ge=1)
    request_id: str | None = Field(None, max_length=200)


class PingFrame(_In):
    type: Literal["ping"]
    request_id: str | None = Field(None, max_length=200)


ClientFrame = Annotated[
    ExecuteFrame
    | InterruptFrame
    | InputReplyFrame
    | PauseFrame
    | ResumeFrame
    | SnapshotFrame
    | RewindFrame
    | PingFrame,
    Field(discriminator="type"),
]


# -- WebSocket: server -> client -------------------------------------------------------


class HelloFrame(BaseModel):
    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    session_id: str
    last_seq: int = Field(description="the newest sequence number the session has")


class EventFrame(BaseModel):
    """One execution event; ``event.seq`` is per session and strictly increasing."""

    type: Literal["event"] = "event"
    event: Event


class AcceptedFrame(BaseModel):
    type: Literal["accepted"] = "accepted"
    request_id: str | None = None
    execution_id: str


class SnapshotCreatedFrame(BaseModel):
    type: Literal["snapshot_created"] = "snapshot_created"
    request_id: str | None = None
    snapshot: SnapshotInfo


class RewoundFrame(BaseModel):
    type: Literal["rewound"] = "rewound"
    request_id: str | None = None
    report: RewindReport


class PongFrame(BaseModel):
    type: Literal["pong"] = "pong"
    request_id: str | None = None


class ErrorFrame(BaseModel):
    """A request on the socket failed; the socket stays open."""

    type: Literal["error"] = "error"
    request_id: str | None = None
    error: str
    message: str


ServerFrame = Annotated[
    HelloFrame
    | EventFrame
    | AcceptedFrame
    | SnapshotCreatedFrame
    | RewoundFrame
    | PongFrame
    | ErrorFrame,
    Field(discriminator="type"),
]


class CloseCode:
    """WebSocket close codes the gateway uses (4000-4999 are application codes)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    POLICY = 1008  # a malformed connection request (e.g. a bad ``since``)
    UNAUTHORIZED = 4401
    NOT_FOUND = 4404  # no such session, or not yours
    TOO_SLOW = 4408  # the client fell too far behind; reconnect with since=<last seq>
    SESSION_ENDED = 4410


SessionInfo.model_rebuild()
