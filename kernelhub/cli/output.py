"""What the CLI prints: tables, JSON, one-line reasons, events, errors in CLI words.

Pure formatting (strings in, strings out) except :class:`Console`, which owns the two
output streams and keeps sandbox output from commanding the terminal
(:mod:`kernelhub.terminal`).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from kernelhub.client.errors import (
    ApiError,
    AuthError,
    ConflictError,
    GatewayUnreachableError,
    NotFoundError,
    ProtocolError,
    RateLimitedError,
    ServerError,
    SessionEndedError,
)
from kernelhub.errors import KernelhubError
from kernelhub.models import (
    DisplayEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    NoticeEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)
from kernelhub.terminal import TerminalFilter
from kernelhub.wire import SessionInfo

#: The width of the reason column in ``sessions ls``; ``sessions show`` has all of it.
REASON_WIDTH = 60
TOKEN_HINT = "make one with `kernelhub token create --name NAME` on the gateway's machine"
#: The gateway and the engine speak to SDK users; on the command line the same advice is a
#: flag. Each pair: the SDK's phrase, the CLI's.
CLI_WORDS = (
    ("pass timeout=", "pass --timeout"),
    ("Hub(token=...)", "--token / KERNELHUB_TOKEN"),
    ("base_url=", "--url / KERNELHUB_URL"),
    ("hub.list_sessions()", "`kernelhub sessions ls`"),
    ("hub.create_session()", "`kernelhub sessions new`"),
)


def in_cli_words(text: str) -> str:
    """A gateway message with its SDK advice turned into flags and commands."""
    for sdk, cli in CLI_WORDS:
        text = text.replace(sdk, cli)
    return text


class Console:
    """stdout and stderr for one command. :meth:`sandbox` text goes through a
    :class:`~kernelhub.terminal.TerminalFilter` when the stream is a terminal, unless
    ``raw``; :meth:`say` is kernelhub's own words and passes as is."""

    def __init__(
        self, out: TextIO | None = None, err: TextIO | None = None, *, raw: bool = False
    ) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._filters: dict[int, TerminalFilter | None] = {
            id(s): None if raw or not _isatty(s) else TerminalFilter() for s in (self.out, self.err)
        }

    def sandbox(self, text: str, *, err: bool = False) -> None:
        """Write output the sandbox produced (untrusted)."""
        stream = self.err if err else self.out
        f = self._filters[id(stream)]
        stream.write(f.feed(text) if f is not None else text)
        stream.flush()

    def clean(self, text: str, *, err: bool = False) -> str:
        """Untrusted text to embed in a line of ours (whole, not a stream chunk)."""
        f = self._filters[id(self.err if err else self.out)]
        return f.feed(text) + f.flush() if f is not None else text

    def say(self, line: str, *, err: bool = False) -> None:
        stream = self.err if err else self.out
        stream.write(line + "\n")
        stream.flush()

    def event(self, event: Event, plots: Path | None = None) -> None:
        """Print one execution event the way a terminal reader wants it."""
        if isinstance(event, StreamEvent):
            self.sandbox(event.text, err=event.name == "stderr")
        elif isinstance(event, ResultEvent):
            text = self.clean(str(event.data.get("text/plain", "")))
            self.say(f"Out[{event.execution_count}]: {text}")
        elif isinstance(event, DisplayEvent):
            png = event.data.get("image/png")
            if png and plots is not None:
                path = plots / f"plot-{event.seq}.png"
                path.write_bytes(base64.b64decode(png))
                self.say(f"[image/png saved to {path}]")
            else:
                self.say(f"[display: {', '.join(event.data)}]")
        elif isinstance(event, ErrorEvent):
            error = event.error
            self.say(self.clean("\n".join(error.traceback) or f"{error.name}: {error.value}"))
        elif isinstance(event, TruncatedEvent):
            self.say(
                f"[output truncated: {event.dropped_bytes} bytes over the "
                f"{event.limit_bytes}-byte cap]"
            )
        elif isinstance(event, NoticeEvent):
            self.say(f"[kernelhub: {self.clean(event.message)}]")
        elif isinstance(event, FinalEvent):
            r = event.record
            extra = f" — {in_cli_words(self.clean(r.reason))}" if r.reason else ""
            cpu = f", cpu {r.cpu_seconds:.2f} s" if r.cpu_seconds is not None else ""
            self.say(f"[{r.status.value} in {r.duration:.3f} s{cpu}{extra}]")


def _isatty(stream: TextIO) -> bool:
    isatty: Callable[[], bool] | None = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# ------------------------------------------------------------------------ formats


def to_json(value: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> str:
    """``--json``: a model or a list of models, as the gateway's own JSON shape."""
    if isinstance(value, BaseModel):
        data: Any = value.model_dump(mode="json")
    elif isinstance(value, dict):
        data = value
    else:
        data = [item.model_dump(mode="json") for item in value]
    return json.dumps(data, indent=2, ensure_ascii=False)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the last one is not padded."""
    cells = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        padded = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        lines.append("  ".join([*padded, row[-1]]).rstrip())
    return "\n".join(lines)


def one_line(text: str | None, width: int = REASON_WIDTH) -> str:
    """A reason for a table cell: its first line (for a traceback, the exception line,
    which is the one that says what happened), cut to ``width`` with an ellipsis."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]
    if len(lines) > 1 and len(line) < width:
        line += " …"
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


def _when(at: datetime) -> str:
    return f"{at:%Y-%m-%d %H:%M:%S}"


def sessions_table(sessions: Sequence[SessionInfo]) -> str:
    """``kernelhub sessions ls``."""
    if not sessions:
        return "no sessions"
    return table(
        ("ID", "STATE", "BACKEND", "CREATED", "REASON"),
        (
            (s.id, s.state.value, s.backend, _when(s.created_at), one_line(s.reason))
            for s in sessions
        ),
    )


def session_detail(info: SessionInfo) -> str:
    """``kernelhub sessions show ID``: every field, the reason in full."""
    limits = ", ".join(f"{k}={v}" for k, v in sorted(info.limits.items()) if v is not None)
    meta = ", ".join(f"{k}={v}" for k, v in sorted(info.metadata.items()))
    rows = [
        ("id", info.id),
        ("state", info.state.value),
        ("backend", info.backend),
        ("owner", info.owner),
        ("created", _when(info.created_at)),
        ("events", str(info.last_seq)),
        ("warm start", "yes" if info.warm else "no"),
        ("limits", limits or "-"),
        ("metadata", meta or "-"),
    ]
    if info.restore is not None:
        rows.append(("restored from", info.restore.snapshot_id))
    text = "\n".join(f"{key + ':':<15}{value}" for key, value in rows)
    if info.reason:
        text += "\nreason:\n" + "\n".join("  " + line for line in info.reason.splitlines())
    return text


def nodes_table(nodes: Sequence[Any], now: datetime) -> str:
    """``kernelhub node ls``: each node's last heartbeat and what it reported."""
    if not nodes:
        return "no nodes (none has beaten into this store)"
    return table(
        ("ID", "STATE", "HEARTBEAT", "SESSIONS", "FREE MEMORY", "LOAD", "ADDRESS"),
        (
            (
                n.id,
                ("lost" if not n.alive(now) else "up") + (", draining" if n.draining else ""),
                f"{(now - n.heartbeat_at).total_seconds():.1f} s ago",
                str(n.sessions),
                f"{n.memory_free_bytes / 2**30:.1f} GiB",
                f"{n.cpu_load:.2f}",
                n.address,
            )
            for n in nodes
        ),
    )


def tokens_table(tokens: Sequence[Any]) -> str:
    """``kernelhub token list`` (names and roles, never secrets)."""
    if not tokens:
        return "no tokens"
    return table(
        ("NAME", "ROLE", "STATE", "CREATED", "SCOPE"),
        (
            (
                t.name,
                "admin" if t.admin else "user",
                f"revoked {t.revoked_at}" if t.revoked_at else "active",
                str(t.created_at),
                _scope(t),
            )
            for t in tokens
        ),
    )


def _scope(t: Any) -> str:
    parts = (
        "read-only" if getattr(t, "read_only", False) else "",
        f"session={t.session_id}" if getattr(t, "session_id", None) else "",
        f"expires={t.expires_at}" if getattr(t, "expires_at", None) else "",
        f"for={t.acts_for}" if getattr(t, "acts_for", None) else "",
    )
    return ",".join(p for p in parts if p) or "-"


# ------------------------------------------------------------------------- errors


def describe_error(exc: KernelhubError, url: str) -> str:
    """A failed gateway call in the CLI's words: the flag, variable or command that fixes
    it (the SDK's own messages name its arguments instead)."""
    if isinstance(exc, GatewayUnreachableError):
        cause = exc.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        return (
            f"cannot reach a gateway at {url} ({why}); start one with `kernelhub serve`, "
            "or point --url / KERNELHUB_URL at yours"
        )
    if not isinstance(exc, ApiError):
        if isinstance(exc, ProtocolError):
            return f"{exc}; is the gateway the same kernelhub version (`kernelhub --version`)?"
        return str(exc)
    message = in_cli_words(exc.message)
    said = f"{message} (HTTP {exc.status} {exc.error})" if exc.status else message
    if isinstance(exc, AuthError):
        if exc.admin_required:
            return f"{said}; this needs an admin token: pass --token or set KERNELHUB_TOKEN"
        return f"{said}; pass a valid --token or set KERNELHUB_TOKEN ({TOKEN_HINT})"
    if isinstance(exc, SessionEndedError):
        return f"{said}; start another with `kernelhub sessions new`"
    if isinstance(exc, NotFoundError):
        return f"{said}; `kernelhub sessions ls` lists yours"
    if isinstance(exc, ConflictError):
        return f"{said}; `kernelhub sessions show ID` shows its state"
    if isinstance(exc, RateLimitedError):
        after = f" in {exc.retry_after:g} s" if exc.retry_after is not None else " later"
        return f"{said}; try again{after}"
    if isinstance(exc, ServerError):
        return f"{said}; the gateway failed, its log (the `kernelhub serve` output) says why"
    return said
