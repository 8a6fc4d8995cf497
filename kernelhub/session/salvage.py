"""The cell that ran while no gateway did: its output and true outcome, from the sandbox.

A gateway killed mid-cell (kill -9, OOM, a host reboot of the gateway alone) leaves the
cell running in its sandbox. ZeroMQ drops what the kernel publishes meanwhile, so the
kernel also spools the current cell's messages to ``iopub.spool`` in the session's
state directory (``kernelhub_kernel.spool``, which documents the format). The gateway
that re-adopts the session reads that file from the host, follows it until the cell's
reply (the cell may still be running), and turns the messages into the execution's
events through the same :class:`~kernelhub.execution.collector.OutputCollector` and the
same caps. The events the previous gateway had already stored are skipped, the rest are
numbered after the session's last ``seq``, and the final record carries the cell's real
status: clients replay the execution as usual, with no gap and no duplicate.

The spool is written by the sandbox, so it is hostile input: opened without following
links or blocking on a FIFO, read up to a bound, each line parsed on its own (a bad line
is skipped), and its messages fed to the collector like any message from the kernel.

:func:`open_spool` is called right after the kernel is re-attached, before the loop runs
again (so the cell's live messages are disowned before the first arrives);
:meth:`CellSalvage.run` then runs in turn with the session's cells (the manager queues it
as an exclusive operation: cells sent meanwhile wait behind it, as behind a running cell).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kernelhub.config import Limits
from kernelhub.execution.collector import OutputCollector
from kernelhub.execution.engine import KernelSession
from kernelhub.models import (
    EndedBy,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    NoticeEvent,
    StatusEvent,
)
from kernelhub.sandbox.state import SPOOL_FILE, spool_bytes, state_dir
from kernelhub.store.records import StoredExecution

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05
_READ_CHUNK = 1 << 20


@dataclass
class SpoolLines:
    """What a spool's complete lines say (pure: :func:`parse`)."""

    cell: str | None = None
    code_sha256: str | None = None
    started: float | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    dropped_bytes: int = 0
    dropped_messages: int = 0
    replied: float | None = None  # when the kernel sent the reply (its clock)
    malformed: int = 0


def parse(data: bytes, into: SpoolLines | None = None) -> tuple[SpoolLines, int]:
    """Parse the complete lines of ``data`` (a spool read from its start, or from where
    the last parse stopped) into ``into``; returns it and the bytes consumed (a partial
    last line is left for the next read)."""
    out = into if into is not None else SpoolLines()
    end = data.rfind(b"\n") + 1
    for raw in data[:end].splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            out.malformed += 1
            continue
        if not isinstance(line, dict):
            out.malformed += 1
        elif isinstance(line.get("m"), dict):
            out.messages.append(line["m"])
            header = line["m"].get("header")
            if isinstance(header, dict) and header.get("msg_type") == "execute_reply":
                out.replied = _number(line.get("t"))
        elif isinstance(line.get("cell"), str) and out.cell is None:
            out.cell = line["cell"]
            out.code_sha256 = str(line.get("code_sha256"))
            out.started = _number(line.get("t"))
        elif "dropped_bytes" in line:
            out.dropped_bytes = max(0, int(_number(line.get("dropped_bytes")) or 0))
            out.dropped_messages = max(0, int(_number(line.get("dropped_messages")) or 0))
        else:
            out.malformed += 1
    return out, end


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def code_digest(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()


def read_from(path: Path, offset: int, max_bytes: int) -> bytes | None:
    """Bytes of the spool from ``offset``, at most ``max_bytes``; None if there is no
    regular file there (missing, a link, a FIFO: the sandbox may have put anything)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        left = max_bytes
        while left > 0:
            chunk = os.pread(fd, min(left, _READ_CHUNK), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


class CellSalvage:
    """The spooled cell of one re-adopted session (see the module)."""

    def __init__(self, kernel: KernelSession, path: Path, lines: SpoolLines, offset: int) -> None:
        self.kernel = kernel
        self.path = path
        self.lines = lines
        self.offset = offset
        self.limit = spool_bytes(kernel.limits.output_bytes) + 2**20

    def matches(self, row: StoredExecution) -> bool:
        return self.lines.code_sha256 == code_digest(row.code)

    def release(self) -> None:
        """Not this cell after all: its late messages go back to the engine."""
        if self.lines.cell is not None:
            self.kernel.disown(self.lines.cell, disowned=False)

    async def run(self, row: StoredExecution, stored: list[Event]) -> ExecutionRecord:
        """Follow the spool until the cell's reply (or its kernel's death), emit the events
        the store does not have yet, then its final record; returns the record."""
        limits = self.kernel.limits
        collector = OutputCollector(
            row.id,
            self.lines.cell or "",
            limit_bytes=limits.output_bytes,
            limit_events=limits.output_events,
            next_seq=lambda: 0,  # renumbered when announced
        )
        known = sum(not isinstance(e, (StatusEvent, NoticeEvent, FinalEvent)) for e in stored)
        fed = 0
        produced = 0
        notice = (
            "the gateway restarted while this cell ran; what it printed meanwhile was kept "
            "in the sandbox and is collected now"
        )
        self._announce(NoticeEvent(execution_id=row.id, seq=0, message=notice))
        deadline = _deadline(limits, self.lines.started)
        while True:
            for msg in self.lines.messages[fed:]:
                for event in collector.feed(msg):
                    if isinstance(event, StatusEvent):
                        continue
                    produced += 1
                    if produced > known:
                        self._announce(event)
            fed = len(self.lines.messages)
            if collector.done or not self.kernel.alive or self.offset >= self.limit:
                break
            if deadline is not None and time.time() > deadline:
                with contextlib.suppress(Exception):
                    await self.kernel.sandbox.interrupt()
                deadline = None
            await asyncio.sleep(POLL_INTERVAL)
            self._read_more()
        for event in collector.finish():
            produced += 1
            if produced > known:
                self._announce(event)
        record = self._record(row, collector)
        self._announce(FinalEvent(execution_id=row.id, seq=0, record=record))
        self.release()
        return record

    def _announce(self, event: Event) -> None:
        """Hand an event we made to the listeners, numbered after the session's last."""
        self.kernel.publish(event.model_copy(update={"seq": self.kernel.next_seq()}))

    def _read_more(self) -> None:
        data = read_from(self.path, self.offset, self.limit - self.offset)
        if data:
            _, used = parse(data, self.lines)
            self.offset += used

    def _record(self, row: StoredExecution, collector: OutputCollector) -> ExecutionRecord:
        lines = self.lines
        started = _when(lines.started)
        finished = _when(lines.replied) or datetime.now(UTC)
        reason = None
        if not collector.done:
            status, ended_by = ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH
            reason = (
                "the kernel died while the gateway was restarting"
                if not self.kernel.alive
                else "the cell's spool ended before its reply"
            )
        elif collector.error is not None and collector.error.name == "KeyboardInterrupt":
            status, ended_by = ExecutionStatus.INTERRUPTED, EndedBy.INTERRUPT
        elif collector.reply_status == "ok":
            status, ended_by = ExecutionStatus.COMPLETED, EndedBy.REPLY
        else:
            status, ended_by = ExecutionStatus.FAILED, EndedBy.REPLY
        if lines.dropped_messages:
            reason = (
                f"{lines.dropped_messages} messages ({lines.dropped_bytes} bytes) the cell sent "
                "while the gateway was restarting were past the sandbox's spool "
                "(KERNELHUB_LIMITS__OUTPUT_BYTES) and were lost"
            )
        return ExecutionRecord(
            execution_id=row.id,
            status=status,
            ended_by=ended_by,
            state_lost=status == ExecutionStatus.KERNEL_DIED,
            reason=reason,
            execution_count=collector.execution_count,
            error=collector.error,
            queued_at=row.created_at,
            started_at=started,
            finished_at=finished,
            duration=max((lines.replied or 0) - (lines.started or 0), 0.0)
            if lines.replied and lines.started
            else 0.0,
            output_bytes=collector.output_bytes,
            dropped_bytes=collector.dropped_bytes + lines.dropped_bytes,
            dropped_events=collector.dropped_events + lines.dropped_messages,
        )


def open_spool(kernel: KernelSession) -> CellSalvage | None:
    """The re-attached kernel's spooled cell, its live messages disowned at once (call
    before the loop runs the kernel's pumps); None if it has no spool."""
    path = state_dir(kernel.sandbox.session_dir.root.parent, kernel.id) / SPOOL_FILE
    limit = spool_bytes(kernel.limits.output_bytes) + 2**20
    data = read_from(path, 0, limit)
    if not data:
        return None
    lines, used = parse(data)
    if lines.cell is None:
        return None
    kernel.disown(lines.cell)
    return CellSalvage(kernel, path, lines, used)


def _when(t: float | None) -> datetime | None:
    return datetime.fromtimestamp(t, UTC) if t is not None else None


def _deadline(limits: Limits, started: float | None) -> float | None:
    if limits.cell_timeout is None:
        return None
    return (started or time.time()) + limits.cell_timeout
