"""A cell run in this interpreter, returned as the Execution a kernel would give: for
tests of agent code whose answers must come from code that really ran."""

from __future__ import annotations

import contextlib
import io
from datetime import UTC, datetime

from kernelhub.models import (
    CellError,
    EndedBy,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    StreamEvent,
)

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def run_here(code: str, execution_id: str = "e1") -> Execution:
    """exec() ``code`` with its stdout captured; an exception is the cell's error."""
    buffer = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(buffer):
            exec(code, {})
    except Exception as exc:  # the cell's own failure, reported like a kernel would
        error = CellError(name=type(exc).__name__, value=str(exc), traceback=[])
    events: list[Event] = []
    if buffer.getvalue():
        events.append(StreamEvent(execution_id=execution_id, name="stdout", text=buffer.getvalue()))
    record = ExecutionRecord(
        execution_id=execution_id,
        status=ExecutionStatus.FAILED if error else ExecutionStatus.COMPLETED,
        ended_by=EndedBy.REPLY,
        error=error,
        queued_at=NOW,
        finished_at=NOW,
    )
    return Execution(record=record, events=events)
