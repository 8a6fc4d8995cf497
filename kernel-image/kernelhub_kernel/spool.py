"""Keep the running cell's messages in the sandbox, so a gateway that crashes mid-cell
loses none of its output.

ZeroMQ's PUB socket drops what it publishes while no gateway is subscribed, and the
ROUTER drops an ``execute_reply`` whose peer is gone. So every message the kernel sends
for the current *user* cell (its iopub output and status, and its shell reply) is also
appended, as one JSON line, to ``iopub.spool`` in the session's state directory
(``KERNELHUB_SNAPSHOTS``, default ``/tmp/.kernelhub``: on the host beside the sandbox,
where a restarted gateway reads it; see ``kernelhub.session.salvage``).

The file holds one cell, the latest: it is emptied when the next user cell starts (its
``execute_input``; silent executes, the host's own calls, never touch it). Lines::

    {"cell": "<request msg_id>", "code_sha256": "...", "t": 1733100000.0}
    {"m": {"header": ..., "parent_header": ..., "metadata": ..., "content": ...}}
    ...
    {"dropped_bytes": 123, "dropped_messages": 4}     (before the reply, if any dropped)
    {"m": {... "execute_reply" ...}, "t": 1733100008.1}

Bounded: once a cell's lines pass ``KERNELHUB_SPOOL_BYTES`` (the host sets it from the
session's output cap; default 24 MiB) only the protocol's bookkeeping (status,
execute_input, the reply) is written, and the rest is counted. A write that fails (the
state directory full) drops that message and is counted the same way. Never raises into
the kernel: losing the spool only loses what it was for.
"""

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

SPOOL_FILE = "iopub.spool"
SPOOL_BYTES_ENV = "KERNELHUB_SPOOL_BYTES"
DEFAULT_SPOOL_BYTES = 24 << 20
_ALWAYS = frozenset({"status", "execute_input", "execute_reply"})


class Spool:
    """The current cell's messages, appended to ``path`` (see the module)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._cell: str | None = None
        self._busy: dict[str, Any] = {}  # parent msg_id -> its `busy`, until we know the cell
        self._written = 0
        self._dropped_bytes = 0
        self._dropped_messages = 0

    def record(self, msg: Mapping[str, Any]) -> None:
        try:
            with self._lock:
                self._record(msg, None)
        except Exception:  # never into the kernel's send path
            self._dropped_messages += 1

    def record_packed(self, msg: Mapping[str, Any], frames: list[Any]) -> None:
        """Like ``record``, reusing the message as the Session already packed it.

        ``frames`` ends with the four packed parts (header, parent header, metadata,
        content), each a JSON object: the line is those bytes put together, so a spooled
        message costs no second encoding (``json.dumps`` with a ``default`` for the
        header's datetime was most of the spool's share of a cell's CPU).
        """
        try:
            parts = frames[-4:]
            packed = len(parts) == 4 and all(isinstance(p, bytes) and p[:1] == b"{" for p in parts)
            with self._lock:
                self._record(msg, parts if packed else None)
        except Exception:  # never into the kernel's send path
            self._dropped_messages += 1

    def _record(self, msg: Mapping[str, Any], packed: list[bytes] | None) -> None:
        header = msg.get("header") or {}
        parent = msg.get("parent_header") or {}
        msg_type = header.get("msg_type")
        parent_id = parent.get("msg_id")
        if not isinstance(parent_id, str):
            return
        if msg_type == "status" and parent_id != self._cell:
            # The `busy` of a request comes before we know whether it is a user cell.
            if (msg.get("content") or {}).get("execution_state") == "busy":
                self._busy = {parent_id: (msg, packed)}
            return
        if msg_type == "execute_input":
            self._start(parent_id, msg)
        if parent_id != self._cell:
            return
        if msg_type not in _ALWAYS and self._written >= self.max_bytes:
            # Full: counted without being encoded (a flood must not pay for it twice).
            if packed is not None:
                self._dropped_bytes += sum(len(p) for p in packed)
            else:
                content = msg.get("content") or {}
                self._dropped_bytes += len(str(content.get("text", ""))) or 256
            self._dropped_messages += 1
            return
        stamp: float | None = None
        if msg_type == "execute_reply":
            if self._dropped_bytes or self._dropped_messages:
                self._write(
                    {
                        "dropped_bytes": self._dropped_bytes,
                        "dropped_messages": self._dropped_messages,
                    },
                    force=True,
                )
            stamp = time.time()
        self._write_message(msg, packed, stamp, force=msg_type in _ALWAYS)

    def _start(self, cell: str, execute_input: Mapping[str, Any]) -> None:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
        os.ftruncate(self._fd, 0)
        self._cell = cell
        self._written = 0
        self._dropped_bytes = self._dropped_messages = 0
        code = str((execute_input.get("content") or {}).get("code", ""))
        digest = hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()
        # Put together by hand: json.dumps with options builds an encoder per call, which
        # was most of the spool's CPU per cell. The msg_id alone goes through the default
        # (cached) encoder; the rest is ASCII made here.
        line = f'{{"cell":{json.dumps(cell)},"code_sha256":"{digest}","t":{time.time()!r}}}\n'
        self._write_data(line.encode(), force=True)
        busy = self._busy.pop(cell, None)
        if busy is not None:
            self._write_message(*busy, None, force=True)

    def _write_message(
        self,
        msg: Mapping[str, Any],
        packed: list[bytes] | None,
        stamp: float | None,
        *,
        force: bool,
    ) -> None:
        if packed is None:
            line: dict[str, Any] = {"m": _plain(msg)}
            if stamp is not None:
                line["t"] = stamp
            self._write(line, force=force)
            return
        header, parent, metadata, content = packed
        tail = b"}}\n" if stamp is None else b'},"t":%r}\n' % stamp
        data = b"".join(
            (
                b'{"m":{"header":', header, b',"parent_header":', parent,
                b',"metadata":', metadata, b',"content":', content, tail,
            )
        )  # fmt: skip
        self._write_data(data, force=force)

    def _write(self, line: dict[str, Any], *, force: bool) -> None:
        data = (json.dumps(line, default=str, ensure_ascii=False) + "\n").encode(
            "utf-8", "surrogatepass"
        )
        self._write_data(data, force=force)

    def _write_data(self, data: bytes, *, force: bool) -> None:
        if self._fd is None or (not force and self._written + len(data) > self.max_bytes):
            self._dropped_bytes += len(data)
            self._dropped_messages += 1
            return
        try:
            os.write(self._fd, data)
        except OSError:
            self._dropped_bytes += len(data)
            self._dropped_messages += 1
            return
        self._written += len(data)


def _plain(msg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: msg.get(k) for k in ("header", "parent_header", "metadata", "content")}


def spool_from(environ: Mapping[str, str]) -> Spool | None:
    """The spool for this kernel, or None where there is no state directory to keep it."""
    directory = environ.get("KERNELHUB_SNAPSHOTS", "/tmp/.kernelhub")
    if not os.path.isdir(directory):
        return None
    try:
        max_bytes = int(environ.get(SPOOL_BYTES_ENV, DEFAULT_SPOOL_BYTES))
    except ValueError:
        max_bytes = DEFAULT_SPOOL_BYTES
    return Spool(os.path.join(directory, SPOOL_FILE), max(max_bytes, 0))


def install(session_class: Any, spool: Spool) -> None:
    """Record every message ``session_class`` packs to send (iopub and shell alike).

    ``Session.send`` packs each message it sends with ``serialize`` (nothing else calls
    it), so recording there sees what ``send`` saw, already encoded, just before it goes
    out; install after ``bounds.bound_messages`` to record the bounded frames.
    """
    serialize = session_class.serialize

    def serialize_and_spool(self: Any, msg: Any, ident: Any = None) -> Any:
        frames = serialize(self, msg, ident)
        if isinstance(msg, dict):
            with contextlib.suppress(Exception):
                spool.record_packed(msg, frames)
        return frames

    session_class.serialize = serialize_and_spool
