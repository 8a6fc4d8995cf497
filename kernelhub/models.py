"""What users of kernelhub see: execution events, the final record, user errors as data.

Only pydantic here, so the SDK can import it without Docker or ZeroMQ. A cell failing is
a :class:`CellError` inside an event or record — never an exception.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ExecutionStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    AWAITING_INPUT = "awaiting_input"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    KERNEL_DIED = "kernel_died"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset(
    {
        ExecutionStatus.COMPLETED,
        ExecutionStatus.FAILED,
        ExecutionStatus.INTERRUPTED,
        ExecutionStatus.TIMED_OUT,
        ExecutionStatus.CANCELLED,
        ExecutionStatus.KERNEL_DIED,
    }
)


class EndedBy(StrEnum):
    """Which step ended an execution. The timeout escalation goes interrupt → restart → kill."""

    REPLY = "reply"  # the kernel answered on its own
    INTERRUPT = "interrupt"  # KeyboardInterrupt ended it; variables kept
    RESTART = "restart"  # the kernel was restarted; variables lost, files kept
    KILL = "kill"  # the sandbox was killed; everything lost
    KERNEL_DEATH = "kernel_death"  # the kernel died by itself
    CANCEL = "cancel"  # never started


class CellError(BaseModel):
    """An exception raised by user code: data, never raised by kernelhub."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: str
    traceback: list[str] = Field(default_factory=list)


# A cell's state changes (and its last words: its value or exception), as opposed to its
# output: the gateway lets their frames and store writes wait briefly to leave with what
# follows (``gateway.coalesce_window``); output and a cell's final event never wait.
QUIET_EVENT_TYPES = frozenset({"status", "result", "error"})


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)

    execution_id: str
    seq: int = Field(0, description="per-session, strictly increasing")


class StreamEvent(_Event):
    type: Literal["stream"] = "stream"
    name: Literal["stdout", "stderr"]
    text: str
    late: bool = Field(False, description="printed by a thread after its cell had finished")


class DisplayEvent(_Event):
    """``display_data`` / ``update_display_data``: a full MIME bundle."""

    type: Literal["display"] = "display"
    data: dict[str, Any]
    metadata: dict[str, Any] = Field(default_factory=dict)
    display_id: str | None = None
    update: bool = False
    late: bool = False


class ResultEvent(_Event):
    """The value of the cell's last expression (``execute_result``)."""

    type: Literal["result"] = "result"
    data: dict[str, Any]
    metadata: dict[str, Any] = Field(default_factory=dict)
    execution_count: int | None = None


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    error: CellError


class ClearOutputEvent(_Event):
    type: Literal["clear_output"] = "clear_output"
    wait: bool = False


class InputRequestEvent(_Event):
    type: Literal["input_request"] = "input_request"
    prompt: str
    password: bool = False


class InputReplyEvent(_Event):
    """The answer an input request got, and from whom (a principal, or the deadline)."""

    type: Literal["input_reply"] = "input_reply"
    value: str
    answered_by: str
    password: bool = False


class StatusEvent(_Event):
    type: Literal["status"] = "status"
    status: ExecutionStatus


class TruncatedEvent(_Event):
    """Output was dropped on purpose because the cell hit its output cap.

    Sent once when the cap is first hit and once more, with the totals, when the cell ends.
    """

    type: Literal["truncated"] = "truncated"
    limit_bytes: int
    dropped_bytes: int
    dropped_events: int = Field(0, description="messages dropped whole (over a cap)")
    final: bool = False


class NoticeEvent(_Event):
    """Something kernelhub did or saw that the reader should know (a restart, a dropped
    oversized message, a malformed message from the kernel)."""

    type: Literal["notice"] = "notice"
    message: str


class ExecutionRecord(BaseModel):
    """The one final record of an execution."""

    model_config = ConfigDict(frozen=True)

    execution_id: str
    status: ExecutionStatus
    ended_by: EndedBy
    state_lost: bool = False
    reason: str | None = Field(None, description="why it ended, in words, if not by itself")
    execution_count: int | None = None
    error: CellError | None = None
    queued_at: datetime
    started_at: datetime | None = None
    finished_at: datetime
    duration: float = Field(0.0, description="seconds running; queue wait and pauses excluded")
    paused_seconds: float = Field(0.0, description="seconds the session was paused mid-cell")
    cpu_seconds: float | None = None
    peak_memory_bytes: int | None = None
    output_bytes: int = Field(0, description="bytes of output kept (head and tail)")
    dropped_bytes: int = Field(
        0, description="bytes the kernel sent for the cell that were dropped over its caps"
    )
    dropped_events: int = Field(
        0, description="messages dropped whole over the byte or event cap (Limits.output_events)"
    )


class FinalEvent(_Event):
    type: Literal["final"] = "final"
    record: ExecutionRecord


Event = Annotated[
    StreamEvent
    | DisplayEvent
    | ResultEvent
    | ErrorEvent
    | ClearOutputEvent
    | InputRequestEvent
    | InputReplyEvent
    | StatusEvent
    | TruncatedEvent
    | NoticeEvent
    | FinalEvent,
    Field(discriminator="type"),
]

OutputEvent = StreamEvent | DisplayEvent | ResultEvent | ErrorEvent | ClearOutputEvent


class Execution(BaseModel):
    """A finished execution: its record and everything it produced, in order."""

    model_config = ConfigDict(frozen=True)

    record: ExecutionRecord
    events: list[Event]

    @property
    def status(self) -> ExecutionStatus:
        return self.record.status

    @property
    def error(self) -> CellError | None:
        return self.record.error

    @property
    def stdout(self) -> str:
        return "".join(
            e.text for e in self.events if isinstance(e, StreamEvent) and e.name == "stdout"
        )

    @property
    def stderr(self) -> str:
        return "".join(
            e.text for e in self.events if isinstance(e, StreamEvent) and e.name == "stderr"
        )

    @property
    def result(self) -> dict[str, Any] | None:
        """The MIME bundle of the last expression's value, if the cell had one."""
        for event in self.events:
            if isinstance(event, ResultEvent):
                return event.data
        return None

    @property
    def text(self) -> str | None:
        """``text/plain`` of the cell's value — ``'2'`` for ``1+1``."""
        data = self.result
        value = data.get("text/plain") if data else None
        return value if isinstance(value, str) else None

    def displays(self) -> list[DisplayEvent]:
        return [e for e in self.events if isinstance(e, DisplayEvent)]


class ResourceUsage(BaseModel):
    """A point-in-time reading of a sandbox's accounting."""

    model_config = ConfigDict(frozen=True)

    cpu_seconds: float | None = None
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
