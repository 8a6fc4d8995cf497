"""Pure helpers of the MCP server: live output coalesced into notifications, and the
question a cell asks (``input()`` / ``confirm()``) turned into an elicitation form and back.

No I/O here; :mod:`kernelhub.agents.mcp_server` drives these with real events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelhub.egress.policy import GATE_SUFFIX, Answer
from kernelhub.models import DisplayEvent, ErrorEvent, Event, ResultEvent, StreamEvent

__all__ = [
    "CONFIRM_SUFFIX",
    "DEFAULT_NOTIFY_INTERVAL",
    "LiveOutput",
    "answer_of",
    "elicitation_for",
]

# At most this often (seconds) a running cell's output goes out as one notification:
# a cell printing in a tight loop must not flood the client with thousands of messages.
DEFAULT_NOTIFY_INTERVAL = 0.1
# The in-sandbox confirm() asks input(f"{question} [y/N] "); kernel-image/kernelhub_kernel.
CONFIRM_SUFFIX = " [y/N] "
_MAX_CHUNK_CHARS = 4000


def _text_of(event: Event) -> str | None:
    match event:
        case StreamEvent():
            return event.text
        case ErrorEvent():
            return f"{event.error.name}: {event.error.value}\n"
        case ResultEvent() | DisplayEvent():
            plain = event.data.get("text/plain")
            return f"{plain}\n" if isinstance(plain, str) else None
    return None


@dataclass
class LiveOutput:
    """The output of one running cell, handed out in coalesced chunks.

    :meth:`add` takes every event; :meth:`take` returns the text gathered since the last
    chunk once ``interval`` seconds have passed since that chunk (else None), so the
    caller may poll it freely and still sends at most ``1 / interval`` chunks a second.
    A chunk longer than the cap keeps its tail: the client sees what the cell is doing
    now. ``seen`` keeps everything, for the result of a call that returns early.
    """

    interval: float = DEFAULT_NOTIFY_INTERVAL
    clock: Callable[[], float] = time.monotonic
    pending: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    chunks: int = 0
    _last: float | None = None

    def add(self, event: Event) -> None:
        text = _text_of(event)
        if text:
            self.pending.append(text)
            self.seen.append(text)

    def due(self) -> bool:
        return bool(self.pending) and (
            self._last is None or self.clock() - self._last >= self.interval
        )

    def take(self, *, force: bool = False) -> str | None:
        if not self.pending or not (force or self.due()):
            return None
        text = "".join(self.pending)
        self.pending.clear()
        self._last = self.clock()
        self.chunks += 1
        if len(text) > _MAX_CHUNK_CHARS:
            text = "… " + text[-_MAX_CHUNK_CHARS:]
        return text


def elicitation_for(prompt: str, password: bool = False) -> tuple[str, dict[str, Any]]:
    """The message and form schema that ask the user what the cell's ``input(prompt)``
    asks; a ``confirm(question)`` becomes a yes/no checkbox, the egress gate's question
    a choice of once / session / deny."""
    if prompt.endswith(GATE_SUFFIX):
        question = prompt.removesuffix(GATE_SUFFIX)
        choices = [a.value for a in Answer]
        schema = {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "title": question, "enum": choices, "default": "deny"}
            },
            "required": ["answer"],
        }
        return f"The Python cell's network request needs a decision: {question}", schema
    if prompt.endswith(CONFIRM_SUFFIX):
        question = prompt.removesuffix(CONFIRM_SUFFIX)
        schema = {
            "type": "object",
            "properties": {"answer": {"type": "boolean", "title": question, "default": False}},
            "required": ["answer"],
        }
        return f"The Python cell asks for confirmation: {question}", schema
    title = "Password" if password else "Answer"
    schema = {
        "type": "object",
        "properties": {"value": {"type": "string", "title": title, "description": prompt}},
        "required": ["value"],
    }
    return f"The Python cell asks for input: {prompt!r}", schema


def answer_of(prompt: str, action: str, content: dict[str, Any] | None) -> str:
    """What goes back to ``input()`` for the user's elicitation answer. Declining or
    cancelling answers the empty string, which ``confirm()`` reads as no."""
    if action != "accept" or not content:
        return ""
    if prompt.endswith(GATE_SUFFIX):
        return str(content.get("answer", "deny"))  # the gate reads anything else as deny
    if prompt.endswith(CONFIRM_SUFFIX):
        return "y" if content.get("answer") is True else "n"
    value = content.get("value")
    return value if isinstance(value, str) else ""
