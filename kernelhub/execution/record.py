"""How a cell ended, in words and numbers: the final record of an execution. Pure."""

from __future__ import annotations

from kernelhub.execution.collector import OutputCollector
from kernelhub.execution.handle import ExecutionHandle, now
from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus, ResourceUsage


def reply_outcome(
    collector: OutputCollector, *, interrupt_requested: bool
) -> tuple[ExecutionStatus, EndedBy]:
    """The status of a cell that ended on its own (no timeout, death or close). An
    interrupt the user asked for counts when the cell died of it, or never replied."""
    keyboard = collector.error is not None and collector.error.name == "KeyboardInterrupt"
    if interrupt_requested and (keyboard or not collector.reply_seen):
        return ExecutionStatus.INTERRUPTED, EndedBy.INTERRUPT
    if collector.reply_status == "ok":
        return ExecutionStatus.COMPLETED, EndedBy.REPLY
    return ExecutionStatus.FAILED, EndedBy.REPLY


def finished_record(
    handle: ExecutionHandle,
    collector: OutputCollector,
    *,
    status: ExecutionStatus,
    ended_by: EndedBy,
    state_lost: bool,
    reason: str | None,
    duration: float,
    before: ResourceUsage,
    after: ResourceUsage,
) -> ExecutionRecord:
    """The record of a cell that ran: its outcome, what it cost, what its output was."""
    cpu = (
        after.cpu_seconds - before.cpu_seconds
        if after.cpu_seconds is not None and before.cpu_seconds is not None
        else None
    )
    return ExecutionRecord(
        execution_id=handle.id,
        status=status,
        ended_by=ended_by,
        state_lost=state_lost,
        reason=reason,
        execution_count=collector.execution_count,
        error=collector.error,
        queued_at=handle.queued_at,
        started_at=handle.started_at,
        finished_at=now(),
        duration=duration,
        cpu_seconds=cpu,
        peak_memory_bytes=after.peak_memory_bytes,
        output_bytes=collector.output_bytes,
        dropped_bytes=collector.dropped_bytes,
        dropped_events=collector.dropped_events,
        paused_seconds=handle.paused_seconds,
    )


def unstarted_record(
    handle: ExecutionHandle, status: ExecutionStatus, ended_by: EndedBy, reason: str
) -> ExecutionRecord:
    """The record of a cell that never reached the kernel (cancelled, kernel dead)."""
    return ExecutionRecord(
        execution_id=handle.id,
        status=status,
        ended_by=ended_by,
        reason=reason,
        queued_at=handle.queued_at,
        finished_at=now(),
    )
