"""The gateway <-> client protocol: REST bodies and WebSocket frames. Pydantic only, so the
SDK imports it without the server's dependencies. Documented in ``docs/protocol.md``.

Every WebSocket frame is one JSON object with a ``type``; unknown fields are refused so a
typo is an error, not a silently ignored option. ``PROTOCOL_VERSION`` is sent in ``hello``.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from kernelhub.models import Event, Execution, ExecutionRecord, ExecutionStatus

PROTOCOL_VERSION = 1
MAX_CODE_CHARS = 1_000_000
MAX_METADATA_BYTES = 16_384
MAX_REQUEST_ID_CHARS = 200


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
    output_events: int | None = Field(None, ge=16, description="output events kept per cell")


class SessionCreate(_In):
    limits: LimitsIn = Field(default_factory=LimitsIn)
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    from_snapshot: str | None = Field(
        None, description="restore this snapshot (yours) into the new session's fresh sandbox"
    )
    checkpoints: Literal["off", "every_cell"] | float | None = Field(
        None,
        description="automatic checkpoints after successful cells: off, every_cell, or a "
        "number = at most one every that many seconds; omitted: the operator's default "
        "(KERNELHUB_GATEWAY__CHECKPOINTS, every_cell unless set). Incremental: only what "
        "changed is written, between cells. They make rewind and crash recovery with the "
        "variables possible; off: a kernel that dies comes back empty",
    )
    profile: str | None = Field(
        None,
        max_length=64,
        description="the trust tier to run in (isolation, limits, egress), by name, among "
        "those the operator defines and lets this token use (KERNELHUB_PROFILES__*)",
    )
    egress: str | None = Field(
        None,
        max_length=64,
        description="the egress policy to run under, by name, among those the operator "
        "lets this token use (KERNELHUB_EGRESS__ALLOWED_POLICIES); None: the token's default",
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
    RECOVERING = "recovering"  # its kernel died; coming back from its last checkpoint
    DEAD = "dead"
    DELETED = "deleted"


class RecoveryInfo(BaseModel):
    """The last time the session's kernel died and kernelhub brought it back."""

    at: datetime
    reason: str = Field(description="why the kernel died (out of memory, a signal, ...)")
    checkpoint_after_cell: int | None = Field(
        description="the execution count whose checkpoint was restored; None: the kernel "
        "restarted empty (no checkpoint, or restoring it failed: see message)"
    )
    lost: list[str] = Field(
        description="executions whose effects were lost: those after the checkpoint, the "
        "one that died included"
    )
    not_restored: dict[str, str] = Field(
        default_factory=dict, description="variables of the checkpoint that did not load"
    )
    duration: float = Field(description="seconds from the death to the ready kernel")
    message: str = Field(description="the same, in words (also sent as a notice event)")
    lost_node: str | None = Field(
        None, description="the node whose loss this was (issue #24); None: the kernel died"
    )


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
    stored_bytes: int = Field(0, description="what its events and executions take in the store")
    awaiting_input: str | None = Field(
        None, description="the execution waiting on an input() or confirm() answer, if any"
    )
    recovery: RecoveryInfo | None = Field(
        None, description="set once its kernel died and was brought back: the last time"
    )
    restore: RestoreReport | None = Field(None, description="set when made from a snapshot")
    checkpoint_after_cell: int | None = Field(
        None,
        description="the execution count of its latest checkpoint: what a crash now comes "
        "back to, and the latest state rewind reaches (None: none yet)",
    )


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
    # Where the host's side of the capture went, in seconds: ``call`` (the kernel's capture
    # call, sent to answered), within it ``to_kernel``/``from_kernel`` (the call's way to
    # the kernel's capture and the answer's way back), ``connect`` (until the kernel's
    # stream was open), ``receive`` (the stream into the blob file), ``hash`` (the hash
    # thread's busy time), ``hash_tail`` (what the hash added after the last byte),
    # ``fsync``; after the call ``commit`` (the blob store's);
    # ``mode`` is ``pipe`` or ``socket``.
    host_timings: dict[str, float | str] = {}
    # The kernel's side, in seconds: ``total`` (the capture call inside the kernel) and
    # its phases (``classify``, ``group``, ``pickle_and_write``, ``workspace``, ...).
    kernel_timings: dict[str, float] = {}


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class RestoreReport(BaseModel):
    """What a restore brought back into a new session, and what it could not."""

    snapshot_id: str
    restored: list[str]
    failed: dict[str, str]
    skipped: dict[str, str]
    rebuilt: dict[str, str] = Field(
        default_factory=dict,
        description="objects the pickler could not carry, rebuilt by re-running the cell "
        "that made them (also in restored); how each was rebuilt",
    )
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


# -- batches ---------------------------------------------------------------------------

MAX_BATCH_ITEMS = 10_000  # the wire's hard ceiling; the operator's is KERNELHUB_BATCH__MAX_ITEMS
MAX_PATH_CHARS = 1024


class BatchItemIn(_In):
    """One unit of a batch: ``code`` run in a fresh session of its own, with ``files`` in
    its /workspace first. Nothing carries over between items."""

    code: str = Field(max_length=MAX_CODE_CHARS, description="the cell to run")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="files written to /workspace before the code runs: path relative to "
        "/workspace -> content, base64 (standard alphabet, padded). The request body's size "
        "limit (KERNELHUB_GATEWAY__MAX_BODY_BYTES) caps them all together",
    )
    limits: LimitsIn = Field(
        default_factory=LimitsIn, description="the item's session limits, as in SessionCreate"
    )
    timeout: float | None = Field(
        None, gt=0, description="seconds the code may run; omit for the session's cell_timeout"
    )
    idempotency_key: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="unique per logical item and principal (shared by all your batches, "
        "separate from execution keys): an item whose key was used before never runs; it "
        "shows the result of the item that first used it",
    )

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        for path, content in files.items():
            parts = path.split("/")
            if (
                not path
                or len(path) > MAX_PATH_CHARS
                or path.startswith("/")
                or any(part in ("", ".", "..") for part in parts)
                or "\x00" in path
            ):
                raise ValueError(
                    f"file path {path[:100]!r} must be relative to /workspace, without empty, "
                    "'.' or '..' segments (e.g. 'data/input.csv')"
                )
            try:
                base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(
                    f"the content of file {path!r} is not valid base64: {exc}"
                ) from exc
        return files


class BatchCreate(_In):
    items: list[BatchItemIn] = Field(
        min_length=1,
        max_length=MAX_BATCH_ITEMS,
        description="the items, run in this order as slots free up; at most "
        "KERNELHUB_BATCH__MAX_ITEMS",
    )
    concurrency: int | None = Field(
        None,
        ge=1,
        description="items of this batch running at once on each node; at most (and by "
        "default) the node's KERNELHUB_BATCH__CONCURRENCY, which bounds all batches together",
    )


class BatchState(StrEnum):
    QUEUED = "queued"  # no item has started yet
    RUNNING = "running"
    CANCELLING = "cancelling"  # cancelled; running items are being interrupted
    FINISHED = "finished"  # every item has a final status
    CANCELLED = "cancelled"  # cancelled, and every item has a final status


class BatchItemRef(BaseModel):
    batch_id: str
    index: int


class BatchItemInfo(BaseModel):
    index: int = Field(description="position in the request's items, from 0")
    status: ExecutionStatus = Field(
        description="queued (waiting for a slot); running (its session starting, files "
        "uploading or code running); then final: the execution's status, failed with "
        "`error` when kernelhub could not run it, cancelled when the batch was cancelled "
        "before it started"
    )
    duplicate_of: BatchItemRef | None = Field(
        None,
        description="the item that first used this item's idempotency key; this one did "
        "not run, and shows that item's progress and result",
    )
    session_id: str | None = Field(None, description="the fresh session it ran in (deleted after)")
    node: str | None = Field(
        None, description="the node that claimed it (KERNELHUB_STORE__NODE): runs or ran it"
    )
    execution_id: str | None = None
    queued_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    wait_seconds: float | None = Field(
        None, description="seconds it waited for a slot (so far, while queued)"
    )
    error: str | None = Field(
        None,
        description="why kernelhub did not run it or stopped it, in words; an exception "
        "raised by the code is in result.record.error",
    )
    result: ExecutionInfo | None = Field(
        None,
        description="the finished execution, as GET /v1/executions/{id} answers it "
        "(omitted with results=false)",
    )

    @property
    def execution(self) -> Execution | None:
        """The finished execution (stdout, result, error ...), or None if it did not run."""
        r = self.result
        if r is None or r.record is None or r.events is None:
            return None
        return Execution(record=r.record, events=r.events)


class BatchInfo(BaseModel):
    id: str
    owner: str
    state: BatchState
    created_at: datetime
    concurrency: int = Field(description="items of this batch that may run at once on each node")
    counts: dict[str, int] = Field(description="items by status")
    items: list[BatchItemInfo] | None = Field(None, description="omitted in listings")


class BatchList(BaseModel):
    batches: list[BatchInfo] = Field(description="your newest batches first (at most 100)")


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
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class InterruptFrame(_In):
    type: Literal["interrupt"]
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class InputReplyFrame(_In):
    type: Literal["input_reply"]
    execution_id: str
    value: str = Field(max_length=MAX_CODE_CHARS)
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class PauseFrame(_In):
    type: Literal["pause"]
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class ResumeFrame(_In):
    type: Literal["resume"]
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class SnapshotFrame(_In):
    """Take a snapshot; answered by ``SnapshotCreatedFrame``."""

    type: Literal["snapshot"]
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class RewindFrame(_In):
    """Undo cell ``before_cell`` and all after it; answered by ``RewoundFrame``."""

    type: Literal["rewind"]
    before_cell: int = Field(ge=1)
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class PingFrame(_In):
    type: Literal["ping"]
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


def request_id_of(text: str) -> str | None:
    """The ``request_id`` of a client frame that failed validation, read leniently so the
    ``error`` frame can still name the request it answers: None unless the text is a JSON
    object whose ``request_id`` is a string of at most 200 characters."""
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID_CHARS else None


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


def frames_json_schema() -> dict[str, Any]:
    """Every WebSocket frame as one JSON Schema (2020-12), from the models above: what a
    client may send (``ClientFrame``, as the gateway validates it) and what it receives
    (``ServerFrame``, as the gateway writes it). Served at ``/v1/ws-schema.json`` and
    committed as ``docs/ws-frames.schema.json`` (``scripts/ws_schema`` writes it)."""
    schemas, defs = TypeAdapter.json_schemas(
        [
            ("client", "validation", TypeAdapter(ClientFrame)),
            ("server", "serialization", TypeAdapter(ServerFrame)),
        ],
        ref_template="#/$defs/{model}",
    )
    definitions = dict(defs.get("$defs", {}))
    client = schemas[("client", "validation")]
    server = schemas[("server", "serialization")]
    for ref in server["discriminator"]["mapping"].values():
        # Serialization mode calls a defaulted field optional; every server frame has its type.
        frame = definitions[ref.rsplit("/", 1)[1]]
        frame["required"] = ["type", *[f for f in frame.get("required", []) if f != "type"]]
    definitions["ClientFrame"] = {
        "description": "a frame the client sends: one JSON text message",
        **client,
    }
    definitions["ServerFrame"] = {
        "description": "a frame the gateway sends: one JSON text message",
        **server,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"kernelhub WebSocket frames, protocol {PROTOCOL_VERSION}",
        "description": "The frames of GET /v1/sessions/{session_id}/stream (docs/protocol.md). "
        "Generated from kernelhub/wire.py by scripts/ws_schema; do not edit by hand.",
        "x-protocol": PROTOCOL_VERSION,
        "x-close-codes": {name: code for name, code in vars(CloseCode).items() if name.isupper()},
        "oneOf": [{"$ref": "#/$defs/ClientFrame"}, {"$ref": "#/$defs/ServerFrame"}],
        "$defs": dict(sorted(definitions.items())),
    }


def frames_json_schema_text() -> str:
    """:func:`frames_json_schema` as the committed file holds it (stable, diffable)."""
    return json.dumps(frames_json_schema(), indent=2, ensure_ascii=False) + "\n"
