"""Turn Jupyter messages for one execute request into kernelhub events. Pure: no I/O.

Every message is hostile input — the kernel holds its own HMAC key, so a valid signature
proves nothing. Anything that is not the shape the protocol promises is skipped and
counted, never trusted and never allowed to raise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kernelhub.models import (
    CellError,
    ClearOutputEvent,
    DisplayEvent,
    ErrorEvent,
    Event,
    InputRequestEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)

# Shown to the user instead of a traceback that would blow the output budget.
_MAX_TRACEBACK_FRAMES = 200


class OutputCollector:
    """Follows one execute request: converts its messages, enforces the output cap, and
    knows when the request is finished (``execute_reply`` on shell *and* ``idle`` on iopub).

    ``feed`` keeps working after the request finished: output printed later by a thread the
    cell started is converted with ``late=True`` and charged to the same cap.
    """

    def __init__(
        self,
        execution_id: str,
        msg_id: str,
        *,
        limit_bytes: int,
        next_seq: Callable[[], int],
    ) -> None:
        self.execution_id = execution_id
        self.msg_id = msg_id
        self.limit_bytes = limit_bytes
        self._next_seq = next_seq
        self.output_bytes = 0
        self.dropped_bytes = 0
        self.malformed = 0
        self.reply_seen = False
        self.idle_seen = False
        self.reply_status: str | None = None
        self.execution_count: int | None = None
        self.error: CellError | None = None
        self.user_expressions: dict[str, Any] = {}
        self._truncation_announced = False

    @property
    def done(self) -> bool:
        return self.reply_seen and self.idle_seen

    def feed(self, msg: Mapping[str, Any]) -> list[Event]:
        """Convert one message (any channel) whose parent is this request."""
        try:
            return self._feed(msg)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.malformed += 1
            return []

    def finish(self) -> list[Event]:
        """Events owed when the execution ends: the truncation totals, if anything was cut."""
        if not self.dropped_bytes:
            return []
        return [self._truncated(final=True)]

    # -- internals -------------------------------------------------------------------

    def _feed(self, msg: Mapping[str, Any]) -> list[Event]:
        header = msg.get("header")
        msg_type = header.get("msg_type") if isinstance(header, Mapping) else msg.get("msg_type")
        content = msg.get("content")
        if not isinstance(msg_type, str) or not isinstance(content, Mapping):
            self.malformed += 1
            return []
        late = self.done
        eid = self.execution_id

        if msg_type == "stream":
            name = content.get("name")
            text = content.get("text")
            if name not in ("stdout", "stderr") or not isinstance(text, str):
                self.malformed += 1
                return []
            kept = self._charge_text(text)
            events: list[Event] = []
            if kept:
                events.append(
                    StreamEvent(
                        execution_id=eid, seq=self._next_seq(), name=name, text=kept, late=late
                    )
                )
            return events + self._announce_if_dropped()

        if msg_type in ("display_data", "update_display_data"):
            data = _mime_bundle(content.get("data"))
            if data is None:
                self.malformed += 1
                return []
            transient = content.get("transient")
            display_id = transient.get("display_id") if isinstance(transient, Mapping) else None
            if self._charge_bundle(data):
                return [
                    DisplayEvent(
                        execution_id=eid,
                        seq=self._next_seq(),
                        data=data,
                        metadata=_dict(content.get("metadata")),
                        display_id=display_id if isinstance(display_id, str) else None,
                        update=msg_type == "update_display_data",
                        late=late,
                    )
                ]
            return self._announce_if_dropped()

        if msg_type == "execute_result":
            data = _mime_bundle(content.get("data"))
            if data is None:
                self.malformed += 1
                return []
            count = _int(content.get("execution_count"))
            if self._charge_bundle(data):
                return [
                    ResultEvent(
                        execution_id=eid,
                        seq=self._next_seq(),
                        data=data,
                        metadata=_dict(content.get("metadata")),
                        execution_count=count,
                    )
                ]
            return self._announce_if_dropped()

        if msg_type == "error":
            error = _cell_error(content)
            if error is None:
                self.malformed += 1
                return []
            self.error = error
            return [ErrorEvent(execution_id=eid, seq=self._next_seq(), error=error)]

        if msg_type == "clear_output":
            return [
                ClearOutputEvent(
                    execution_id=eid, seq=self._next_seq(), wait=bool(content.get("wait"))
                )
            ]

        if msg_type == "execute_input":
            count = _int(content.get("execution_count"))
            if count is not None:
                self.execution_count = count
            return []

        if msg_type == "status":
            if content.get("execution_state") == "idle":
                self.idle_seen = True
            return []

        if msg_type == "execute_reply":
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
            return []

        if msg_type == "input_request":
            prompt = content.get("prompt", "")
            return [
                InputRequestEvent(
                    execution_id=eid,
                    seq=self._next_seq(),
                    prompt=prompt if isinstance(prompt, str) else str(prompt),
                    password=bool(content.get("password")),
                )
            ]

        # comm_*, debug_event, shutdown_reply …: not part of an execution's output.
        return []

    def _charge_text(self, text: str) -> str:
        """Charge ``text`` to the budget; return the part that fits."""
        raw = text.encode("utf-8", "surrogatepass")
        remaining = self.limit_bytes - self.output_bytes
        if len(raw) <= remaining:
            self.output_bytes += len(raw)
            return text
        kept = raw[: max(remaining, 0)].decode("utf-8", "ignore")
        kept_bytes = len(kept.encode("utf-8", "surrogatepass"))
        self.output_bytes += kept_bytes
        self.dropped_bytes += len(raw) - kept_bytes
        return kept

    def _charge_bundle(self, data: Mapping[str, Any]) -> bool:
        """Charge a MIME bundle; bundles are kept whole or dropped whole."""
        size = sum(_size(v) for v in data.values())
        if self.output_bytes + size <= self.limit_bytes:
            self.output_bytes += size
            return True
        self.dropped_bytes += size
        return False

    def _announce_if_dropped(self) -> list[Event]:
        if not self.dropped_bytes or self._truncation_announced:
            return []
        self._truncation_announced = True
        return [self._truncated(final=False)]

    def _truncated(self, *, final: bool) -> TruncatedEvent:
        return TruncatedEvent(
            execution_id=self.execution_id,
            seq=self._next_seq(),
            limit_bytes=self.limit_bytes,
            dropped_bytes=self.dropped_bytes,
            final=final,
        )


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _mime_bundle(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        return None
    return dict(value)


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError):
        return 0


def _cell_error(content: Mapping[str, Any]) -> CellError | None:
    name = content.get("ename")
    value = content.get("evalue", "")
    traceback = content.get("traceback", [])
    if not isinstance(name, str):
        return None
    if not isinstance(traceback, list):
        traceback = []
    return CellError(
        name=name,
        value=value if isinstance(value, str) else str(value),
        traceback=[str(line) for line in traceback[-_MAX_TRACEBACK_FRAMES:]],
    )
