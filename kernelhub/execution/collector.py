"""Turn Jupyter messages for one execute request into kernelhub events. Pure: no I/O.

Every message is hostile input — the kernel holds its own HMAC key, so a valid signature
proves nothing. Anything that is not the shape the protocol promises is skipped and
counted, never trusted and never allowed to raise.

Everything the kernel sends for a cell is charged to its output cap: stream text by its
UTF-8 size, every other message (display data *and* metadata, errors, prompts,
``clear_output``, comm traffic) by the serialized size of its content. Past the cap a
cell keeps the **head** of its output as it streams, holds the last ``tail_bytes`` of
stream text in a bounded ring, and when it ends emits ``[... N bytes dropped ...]``
followed by that tail: agents read the last lines. A cap on events per cell bounds the
rows stored for a cell that sends many tiny messages (100k ``clear_output`` calls).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from kernelhub.models import (
    CellError,
    ClearOutputEvent,
    DisplayEvent,
    ErrorEvent,
    Event,
    InputRequestEvent,
    NoticeEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)

# An error is data the agent must see whole enough to act on, but one exception may
# carry 20 MB of text: its value and traceback are cut to these, head and tail kept.
ERROR_VALUE_BYTES = 16 * 1024
ERROR_TRACEBACK_BYTES = 48 * 1024
_MAX_TRACEBACK_FRAMES = 200
PROMPT_BYTES = 4096
# The host's receive path sets this on a message it refused whole (over the message
# size limit): its size, the message itself is gone.
OVERSIZED_KEY = "kernelhub_oversized_bytes"
# Set by the host's receive path: the message's size on the wire (content, metadata,
# buffers), so charging it costs nothing. Without it the content is measured here.
WIRE_BYTES_KEY = "kernelhub_wire_bytes"
# What a stream message carries besides its text (JSON keys, metadata frame) at most.
_STREAM_ENVELOPE_BYTES = 4096
# Set by the in-sandbox kernel on a message it cut to its size limit
# (``kernelhub_kernel.bounds.bound_messages``).
SANDBOX_CUT_KEY = "kernelhub_truncated"
# Not output: the protocol's own bookkeeping for the request.
UNCHANGED_KEY = "kernelhub_unchanged_since"
# kernelhub's own call's reply (``execution.ops``): an execute_reply, as far as we care.
CALL_REPLY = "kernelhub_call_reply"
_UNCHARGED = frozenset({"status", "execute_input", "execute_reply", CALL_REPLY})


def default_tail_bytes(limit_bytes: int) -> int:
    """The tail a cell keeps past its cap: an eighth of it, at most 256 KiB."""
    return min(limit_bytes // 8, 256 * 1024)


def marker(dropped: int) -> str:
    return f"\n[... {dropped} bytes dropped ...]\n"


class OutputCollector:
    """Follows one execute request: converts its messages, enforces the output caps, and
    knows when the request is finished (``execute_reply`` on shell *and* ``idle`` on iopub).

    ``feed`` keeps working after the request finished: output printed later by a thread the
    cell started is converted with ``late=True`` and charged to the same caps (head only:
    nobody is left to flush a tail).
    """

    def __init__(
        self,
        execution_id: str,
        msg_id: str,
        *,
        limit_bytes: int,
        next_seq: Callable[[], int],
        limit_events: int = 10_000,
        tail_bytes: int | None = None,
    ) -> None:
        self.execution_id = execution_id
        self.msg_id = msg_id
        self.limit_bytes = limit_bytes
        self.limit_events = limit_events
        self.tail_bytes = default_tail_bytes(limit_bytes) if tail_bytes is None else tail_bytes
        self._next_seq = next_seq
        self.output_bytes = 0
        self.dropped_bytes = 0
        self.dropped_events = 0
        self.output_events = 0
        self.malformed = 0
        self.reply_seen = False
        self.idle_seen = False
        self.reply_status: str | None = None
        # The reply's ``kernelhub_unchanged_since`` (the kernel's last capture, when the
        # cell changed nothing it keeps): the checkpoint after the cell is skipped.
        self.unchanged_since: str | None = None
        self.execution_count: int | None = None
        self.error: CellError | None = None
        self.user_expressions: dict[str, Any] = {}
        self.call_reply: dict[str, Any] = {}  # a kernelhub_call_reply's content
        self._truncation_announced = False
        self._finished = False
        self.resets = 0  # kernel connections dropped during the cell (see connection_reset)
        self.settling = False  # the engine will end the cell after a grace
        # Stream text past the head, newest last; its size and the bytes it let go.
        self._tail: deque[tuple[Literal["stdout", "stderr"], str]] = deque()
        self._tail_size = 0
        self._gap = 0

    @classmethod
    def between_cells(
        cls, *, limit_bytes: int, limit_events: int, next_seq: Callable[[], int]
    ) -> OutputCollector:
        """A collector for output that belongs to no cell: already finished (its events
        are ``late``, the head is all it keeps) and owned by no execution."""
        collector = cls(
            "", "", limit_bytes=limit_bytes, limit_events=limit_events, next_seq=next_seq
        )
        collector.reply_seen = collector.idle_seen = collector._finished = True
        return collector

    @property
    def done(self) -> bool:
        return self.reply_seen and self.idle_seen

    def feed(self, msg: Mapping[str, Any]) -> list[Event]:
        """Convert one message (any channel) whose parent is this request."""
        try:
            return self._feed(msg)
        except (TypeError, ValueError, AttributeError, KeyError, RecursionError):
            self.malformed += 1
            return []

    def oversized(self, size: int, max_bytes: int) -> list[Event]:
        """A message the host refused whole because it was over ``max_bytes``."""
        self._drop(size)
        note = NoticeEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            message=f"the kernel sent a message of {size} bytes, over the {max_bytes}-byte "
            "message limit; it was dropped",
        )
        return [note, *self._announce_if_dropped()]

    def connection_reset(self, channel: str, max_frame_bytes: int) -> list[Event]:
        """The host dropped the kernel's ``channel`` connection: libzmq does that to a peer
        that sends a frame over ``max_frame_bytes``. What was in flight is lost, and the
        cell may never see its ``idle`` or its reply: the engine ends it on either one."""
        self.resets += 1
        self.dropped_events += 1
        note = NoticeEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            message=f"the kernel's {channel} connection was reset: it sent a frame over the "
            f"{max_frame_bytes}-byte message limit (or the kernel went away); that output "
            "was dropped and the connection re-established",
        )
        return [note, *self._announce_if_dropped(force=True)]

    def finish(self) -> list[Event]:
        """Events owed when the execution ends: the kept tail of the streams behind a
        marker, and the truncation totals, if anything was cut."""
        self._finished = True
        events: list[Event] = []
        if self._tail:
            if self._gap:
                events.append(self._stream(self._tail[0][0], marker(self._gap)))
            merged: list[tuple[Literal["stdout", "stderr"], list[str]]] = []
            for name, text in self._tail:
                if merged and merged[-1][0] == name:
                    merged[-1][1].append(text)
                else:
                    merged.append((name, [text]))
            for name, texts in merged:
                events.append(self._stream(name, "".join(texts)))
            self.output_bytes += self._tail_size
            self._tail.clear()
            self._tail_size = 0
        if self.dropped_bytes or self.dropped_events:
            events.append(self._truncated(final=True))
        return events

    # -- internals -------------------------------------------------------------------

    def _feed(self, msg: Mapping[str, Any]) -> list[Event]:
        header = msg.get("header")
        msg_type = header.get("msg_type") if isinstance(header, Mapping) else msg.get("msg_type")
        content = msg.get("content")
        if not isinstance(msg_type, str) or not isinstance(content, Mapping):
            self.malformed += 1
            return []
        if msg_type in _UNCHARGED:
            self._bookkeeping(msg_type, content)
            if msg_type == "execute_reply":
                metadata = msg.get("metadata")
                name = metadata.get(UNCHANGED_KEY) if isinstance(metadata, Mapping) else None
                self.unchanged_since = name if isinstance(name, str) else None
            return []
        if msg_type == "stream":
            name = content.get("name")
            text = content.get("text")
            if name not in ("stdout", "stderr") or not isinstance(text, str):
                self.malformed += 1
                return []
            wire = msg.get(WIRE_BYTES_KEY)
            if isinstance(wire, int) and wire > len(text) * 4 + _STREAM_ENVELOPE_BYTES:
                # A stream message is its text; whatever else a hostile kernel packed in
                # (metadata, buffers) is discarded, and counted.
                self.dropped_bytes += wire - len(text.encode("utf-8", "surrogatepass"))
            return self._feed_stream(name, text)

        size = _wire_size(msg, content)
        self.dropped_bytes += _cut_in_sandbox(content, size)
        eid = self.execution_id
        late = self.done
        if msg_type in ("display_data", "update_display_data", "execute_result"):
            data = _mime_bundle(content.get("data"))
            if data is None:
                self.malformed += 1
                return []
            if not self._admit(size):
                return self._placeholder(msg_type, size)
            metadata = _dict(content.get("metadata"))
            if msg_type == "execute_result":
                count = _int(content.get("execution_count"))
                return [
                    ResultEvent(
                        execution_id=eid, seq=self._next_seq(), data=data,
                        metadata=metadata, execution_count=count,
                    )
                ]  # fmt: skip
            transient = content.get("transient")
            display_id = transient.get("display_id") if isinstance(transient, Mapping) else None
            return [
                DisplayEvent(
                    execution_id=eid,
                    seq=self._next_seq(),
                    data=data,
                    metadata=metadata,
                    display_id=display_id if isinstance(display_id, str) else None,
                    update=msg_type == "update_display_data",
                    late=late,
                )
            ]

        if msg_type == "error":
            error = _cell_error(content)
            if error is None:
                self.malformed += 1
                return []
            # The record keeps the last error (bounded) even when its event is dropped.
            self.error = error
            if not self._admit(_error_size(error)):
                self._drop(size)
                return self._announce_if_dropped()
            self.dropped_bytes += max(_sent_error_size(content) - _error_size(error), 0)
            return [ErrorEvent(execution_id=eid, seq=self._next_seq(), error=error)]

        if msg_type == "clear_output":
            if not self._admit(size):
                self._drop(size)
                return self._announce_if_dropped()
            return [
                ClearOutputEvent(
                    execution_id=eid, seq=self._next_seq(), wait=bool(content.get("wait"))
                )
            ]

        if msg_type == "input_request":
            # Never dropped: the kernel blocks until it is answered, so these cannot flood,
            # and the cell would hang without one. The prompt is cut, and charged.
            asked = content.get("prompt", "")
            asked = asked if isinstance(asked, str) else str(asked)
            prompt = _cut(asked, PROMPT_BYTES)
            charge = len(prompt.encode("utf-8", "surrogatepass"))
            self.output_bytes += charge
            self.output_events += 1
            if prompt is not asked:
                self.dropped_bytes += max(size - charge, 0)
            return [
                InputRequestEvent(
                    execution_id=eid, seq=self._next_seq(), prompt=prompt,
                    password=bool(content.get("password")),
                ),
                *self._announce_if_dropped(),
            ]  # fmt: skip

        # comm_*, debug_event …: not part of an execution's events, but the kernel sent
        # them for this cell, so they count against its budget.
        if self.output_bytes + size <= self.limit_bytes:
            self.output_bytes += size
            return []
        self._drop(size)
        return self._announce_if_dropped()

    def _bookkeeping(self, msg_type: str, content: Mapping[str, Any]) -> None:
        if msg_type == "execute_input":
            count = _int(content.get("execution_count"))
            if count is not None:
                self.execution_count = count
        elif msg_type == "status":
            if content.get("execution_state") == "idle":
                self.idle_seen = True
        else:  # execute_reply, kernelhub_call_reply
            self.reply_seen = True
            status = content.get("status")
            self.reply_status = status if isinstance(status, str) else "error"
            count = _int(content.get("execution_count"))
            if count is not None:
                self.execution_count = count
            if self.reply_status == "error" and self.error is None:
                # Some kernels only report the error in the reply; keep it as data.
                self.error = _cell_error(content)
            expressions = content.get("user_expressions")
            if isinstance(expressions, Mapping):
                self.user_expressions = dict(expressions)
            if msg_type == CALL_REPLY:
                self.call_reply = dict(content)

    def _head_limit(self) -> int:
        # While the cell runs, the tail's share is held back for the end of the output.
        return self.limit_bytes if self._finished else self.limit_bytes - self.tail_bytes

    def _admit(self, size: int) -> bool:
        """Whether a non-stream event of ``size`` bytes fits; charged if it does."""
        if self.output_events < self.limit_events and self.output_bytes + size <= (
            self._head_limit()
        ):
            self.output_bytes += size
            self.output_events += 1
            return True
        return False

    def _drop(self, size: int) -> None:
        self.dropped_bytes += size
        self.dropped_events += 1

    def _placeholder(self, msg_type: str, size: int) -> list[Event]:
        """A dropped display leaves a small visible mark in its place, while the event
        cap allows; past it, only the counts."""
        self._drop(size)
        events = self._announce_if_dropped()
        if self.output_events >= self.limit_events or msg_type == "execute_result":
            return events
        self.output_events += 1
        text = (
            f"[display of {size} bytes dropped: over the cell's {self.limit_bytes}-byte output cap]"
        )
        placeholder = DisplayEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            data={"text/plain": text},
            update=msg_type == "update_display_data",
            late=self.done,
        )
        return [placeholder, *events]

    def _feed_stream(self, name: Literal["stdout", "stderr"], text: str) -> list[Event]:
        if self._tail:  # past the head: everything goes to the tail, in order
            self._to_tail(name, text)
            return self._announce_if_dropped()
        raw = text.encode("utf-8", "surrogatepass")
        remaining = self._head_limit() - self.output_bytes
        if self.output_events >= self.limit_events:
            remaining = 0
        if len(raw) <= remaining:
            self.output_bytes += len(raw)
            self.output_events += 1
            return [self._stream(name, text)]
        kept = raw[: max(remaining, 0)].decode("utf-8", "ignore")
        kept_bytes = len(kept.encode("utf-8", "surrogatepass"))
        rest = raw[kept_bytes:].decode("utf-8", "surrogatepass")
        events: list[Event] = []
        if kept:
            self.output_bytes += kept_bytes
            self.output_events += 1
            events.append(self._stream(name, kept))
        if self._finished or self.tail_bytes <= 0:
            self.dropped_bytes += len(raw) - kept_bytes
        else:
            self._to_tail(name, rest)
        return events + self._announce_if_dropped()

    def _to_tail(self, name: Literal["stdout", "stderr"], text: str) -> None:
        if self._finished:  # late output past the cap: nobody will flush a tail
            self.dropped_bytes += len(text.encode("utf-8", "surrogatepass"))
            return
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) >= self.tail_bytes:
            # Alone bigger than the tail: only its own end survives.
            kept = raw[len(raw) - self.tail_bytes :].decode("utf-8", "ignore")
            size = len(kept.encode("utf-8", "surrogatepass"))
            self._let_go(self._tail_size + len(raw) - size)
            self._tail.clear()
            self._tail_size = 0
            text = kept
        else:
            size = len(raw)
        self._tail.append((name, text))
        self._tail_size += size
        while self._tail_size > self.tail_bytes:
            excess = self._tail_size - self.tail_bytes
            first_name, first = self._tail[0]
            first_raw = first.encode("utf-8", "surrogatepass")
            if len(first_raw) <= excess:
                self._tail.popleft()
                self._tail_size -= len(first_raw)
                self._let_go(len(first_raw))
                continue
            rest = first_raw[excess:].decode("utf-8", "ignore")
            rest_size = len(rest.encode("utf-8", "surrogatepass"))
            self._tail[0] = (first_name, rest)
            self._tail_size -= len(first_raw) - rest_size
            self._let_go(len(first_raw) - rest_size)

    def _let_go(self, size: int) -> None:
        self._gap += size
        self.dropped_bytes += size

    def _stream(self, name: Literal["stdout", "stderr"], text: str) -> StreamEvent:
        return StreamEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            name=name,
            text=text,
            late=self.done,
        )

    def _announce_if_dropped(self, *, force: bool = False) -> list[Event]:
        if self._truncation_announced or not (self.dropped_bytes or self._tail or force):
            return []
        self._truncation_announced = True
        return [self._truncated(final=False)]

    def _truncated(self, *, final: bool) -> TruncatedEvent:
        return TruncatedEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            limit_bytes=self.limit_bytes,
            dropped_bytes=self.dropped_bytes,
            dropped_events=self.dropped_events,
            final=final,
        )


def _wire_size(msg: Mapping[str, Any], content: Mapping[str, Any]) -> int:
    size = msg.get(WIRE_BYTES_KEY)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    try:
        return len(json.dumps(content, default=str))
    except (TypeError, ValueError, RecursionError):
        return 0


def _cut_in_sandbox(content: Mapping[str, Any], size: int) -> int:
    """What the in-sandbox kernel says it cut from this message before sending it (a
    claim: a kernel that lies only changes its own cell's count)."""
    note = content.get(SANDBOX_CUT_KEY)
    original = note.get("original_bytes") if isinstance(note, Mapping) else None
    if isinstance(original, int) and not isinstance(original, bool) and original > size:
        return original - size
    return 0


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _mime_bundle(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        return None
    return dict(value)


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes: its head and tail around a marker."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    half = max(limit // 2 - 32, 0)
    dropped = len(raw) - 2 * half
    head = raw[:half].decode("utf-8", "ignore")
    tail = raw[len(raw) - half :].decode("utf-8", "ignore")
    return head + marker(dropped) + tail


def _error_size(error: CellError) -> int:
    # Counted as the kernel sent it (coloured): the plain twin is derived, not dropped.
    return (
        len(error.name.encode("utf-8", "surrogatepass"))
        + len(error.value.encode("utf-8", "surrogatepass"))
        + sum(
            len(line.encode("utf-8", "surrogatepass"))
            for line in (error.traceback_ansi or error.traceback)
        )
    )


def _sent_error_size(content: Mapping[str, Any]) -> int:
    """The size of what the kernel sent for an error, as :func:`_error_size` counts it."""
    total = 0
    for part in (content.get("ename"), content.get("evalue")):
        if isinstance(part, str):
            total += len(part.encode("utf-8", "surrogatepass"))
    traceback = content.get("traceback")
    if isinstance(traceback, list):
        total += sum(len(str(line).encode("utf-8", "surrogatepass")) for line in traceback)
    return total


def _bounded_traceback(lines: list[Any]) -> list[str]:
    """The last frames, newest kept first, within ``ERROR_TRACEBACK_BYTES`` in all."""
    kept: list[str] = []
    budget = ERROR_TRACEBACK_BYTES
    frames = lines[-_MAX_TRACEBACK_FRAMES:]
    for line in reversed(frames):
        if budget <= 0:
            break
        text = _cut(str(line), min(budget, ERROR_VALUE_BYTES))
        budget -= len(text.encode("utf-8", "surrogatepass"))
        kept.append(text)
    omitted = len(lines) - len(kept)
    if omitted:
        kept.append(f"[... {omitted} traceback frames dropped ...]")
    kept.reverse()
    return kept


def _cell_error(content: Mapping[str, Any]) -> CellError | None:
    name = content.get("ename")
    value = content.get("evalue", "")
    traceback = content.get("traceback", [])
    if not isinstance(name, str):
        return None
    if not isinstance(traceback, list):
        traceback = []
    return CellError(
        name=_cut(name, 256),
        value=_cut(value if isinstance(value, str) else str(value), ERROR_VALUE_BYTES),
        traceback=_bounded_traceback(traceback),
    )
