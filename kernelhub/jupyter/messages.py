"""The Jupyter side of a session, pure: kernel ids, message dicts, the WebSocket framings,
and kernelhub's execution events turned into the messages a Jupyter client expects.

No I/O here. The gateway's ``/api/kernels/{id}/channels`` endpoint
(:mod:`kernelhub.gateway.jupyter_channels`) feeds it events and client frames; tests feed
it data. The wire formats are Jupyter's own: the JSON framing (a message dict with a
``channel`` key) and the ``v1.kernel.websocket.jupyter.org`` binary framing of
jupyter_server's ``services/kernels/connection/base.py``.
"""

from __future__ import annotations

import json
import platform
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kernelhub import __version__
from kernelhub.errors import FrameError

PROTOCOL_VERSION = "5.3"
V1_SUBPROTOCOL = "v1.kernel.websocket.jupyter.org"
KERNEL_NAME = "python3"
CHANNELS = ("shell", "iopub", "stdin", "control")
# Kernel ids are UUIDs, since Jupyter Server's routes only match UUID-shaped ids; each is
# derived from the session id so it is stable across gateway restarts and for all callers.
_KERNEL_ID_NAMESPACE = uuid.UUID("6f1c0c62-8e51-4f4e-9a0e-6b9f3f0f6a21")
# What kernelhub's final status means as an execute_reply status.
_REPLY_STATUS = {"completed": "ok", "cancelled": "aborted"}

Message = dict[str, Any]


def kernel_id(session_id: str) -> str:
    return str(uuid.uuid5(_KERNEL_ID_NAMESPACE, session_id))


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def jupyter_time(when: datetime) -> str:
    """The timestamp format Jupyter Server's gateway client parses (``%Y-%m-%dT%H:%M:%S.%fZ``)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def header(msg_type: str, session: str, *, msg_id: str | None = None) -> dict[str, Any]:
    return {
        "msg_id": msg_id or uuid.uuid4().hex,
        "msg_type": msg_type,
        "username": "kernelhub",
        "session": session,
        "date": now_iso(),
        "version": PROTOCOL_VERSION,
    }


def message(
    channel: str,
    msg_type: str,
    content: dict[str, Any],
    parent: dict[str, Any],
    session: str,
    *,
    metadata: dict[str, Any] | None = None,
) -> Message:
    return {
        "channel": channel,
        "header": header(msg_type, session),
        "parent_header": parent,
        "metadata": metadata or {},
        "content": content,
        "buffers": [],
    }


def status(state: str, parent: dict[str, Any], session: str) -> Message:
    return message("iopub", "status", {"execution_state": state}, parent, session)


def kernel_info_content() -> dict[str, Any]:
    return {
        "status": "ok",
        "protocol_version": PROTOCOL_VERSION,
        "implementation": "kernelhub",
        "implementation_version": __version__,
        "language_info": {
            "name": "python",
            "version": platform.python_version(),
            "mimetype": "text/x-python",
            "file_extension": ".py",
            "pygments_lexer": "ipython3",
            "codemirror_mode": {"name": "ipython", "version": 3},
            "nbconvert_exporter": "python",
        },
        "banner": f"kernelhub {__version__}: a sandboxed IPython kernel",
        "help_links": [],
    }


def is_complete_content(code: str) -> dict[str, Any]:
    """Answered here, without the kernel: compiling is enough (and never runs anything)."""
    import codeop

    try:
        compiled = codeop.compile_command(code, "<cell>", "exec")
    except (SyntaxError, OverflowError, ValueError):
        return {"status": "invalid"}
    if compiled is None:
        return {"status": "incomplete", "indent": "    " if code.rstrip().endswith(":") else ""}
    return {"status": "complete"}


# -- framings -------------------------------------------------------------------------


def to_json_frame(msg: Message) -> str:
    return json.dumps(msg, default=str)


def to_v1_frame(msg: Message) -> bytes:
    """``serialize_msg_to_ws_v1``: offsets, then the channel and the four JSON parts
    (and any binary buffers)."""
    parts = [
        json.dumps(msg[key], default=str).encode()
        for key in ("header", "parent_header", "metadata", "content")
    ]
    parts += [bytes(b) for b in msg.get("buffers") or [] if isinstance(b, bytes | bytearray)]
    channel = str(msg["channel"]).encode()
    offsets = [8 * (1 + 1 + len(parts) + 1)]
    offsets.append(offsets[-1] + len(channel))
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    head = len(offsets).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
    return head + channel + b"".join(parts)


def from_v1_frame(data: bytes) -> Message:
    """``deserialize_msg_from_ws_v1``, then the JSON parts decoded."""
    if len(data) < 8:
        raise FrameError("binary frame shorter than its offset count")
    count = int.from_bytes(data[:8], "little")
    if not 6 <= count <= 1024 or len(data) < 8 * (count + 1):
        raise FrameError(f"binary frame with {count} offsets")
    offsets = [int.from_bytes(data[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
    if offsets != sorted(offsets) or offsets[-1] > len(data):
        raise FrameError("binary frame offsets out of order or past its end")
    offsets.append(len(data))
    chunks = [data[offsets[i] : offsets[i + 1]] for i in range(count)]
    channel, parts, buffers = chunks[0].decode(), chunks[1:5], chunks[5:]
    try:
        decoded = [json.loads(p) if p else {} for p in parts]
    except ValueError as exc:
        raise FrameError(f"binary frame part is not JSON: {exc}") from exc
    head, parent, metadata, content = decoded
    return _checked(
        {
            "channel": channel,
            "header": head,
            "parent_header": parent,
            "metadata": metadata,
            "content": content,
            "buffers": [b for b in buffers if b],
        }
    )


def from_json_frame(text: str) -> Message:
    try:
        msg = json.loads(text)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise FrameError("frame is not a JSON object")
    msg.setdefault("parent_header", {})
    msg.setdefault("metadata", {})
    msg.setdefault("buffers", [])
    return _checked(msg)


def _checked(msg: Message) -> Message:
    if msg.get("channel") not in CHANNELS:
        raise FrameError(f"channel {msg.get('channel')!r} is not one of {', '.join(CHANNELS)}")
    head = msg.get("header")
    if not isinstance(head, dict) or not isinstance(head.get("msg_type"), str):
        raise FrameError("message has no header.msg_type")
    if not isinstance(msg.get("content"), dict):
        raise FrameError("message content is not an object")
    return msg


# -- kernelhub events -> Jupyter messages ----------------------------------------------


@dataclass
class Origin:
    """The Jupyter request an execution answers: its header is every reply's parent."""

    parent: dict[str, Any]
    allow_stdin: bool = True
    silent: bool = False


@dataclass
class Translator:
    """Turns one session's events (the dicts the fan-out publishes) into Jupyter
    messages, for one channels connection.

    Executions this connection sent (:meth:`sent`) answer their own request headers;
    anyone else's (the agent's REST or WebSocket cells) get a synthetic
    ``execute_request`` parent whose msg_id is the execution id, so a watching client sees
    them on iopub without mistaking them for its own. Only this connection's executions
    get the stdin ``input_request`` (another client answers its own prompts).
    """

    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    origins: dict[str, Origin] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    execution_count: int = 0
    begun: set[str] = field(default_factory=set)  # running once: later runnings are resumes

    def sent(self, execution_id: str, origin: Origin, code: str) -> None:
        self.origins[execution_id] = origin
        self.codes[execution_id] = code

    def parent_of(self, execution_id: str) -> dict[str, Any]:
        origin = self.origins.get(execution_id)
        if origin is not None:
            return origin.parent
        return header("execute_request", "kernelhub", msg_id=execution_id)

    def translate(self, event: dict[str, Any], code: str | None = None) -> list[Message]:
        """The messages for one event; ``code`` is the cell's source for ``execute_input``
        of an execution this connection did not send (``None``: not known)."""
        eid = event.get("execution_id", "")
        origin = self.origins.get(eid)
        if origin is not None and origin.silent and event.get("type") != "final":
            return []
        parent = self.parent_of(eid)
        kind = event.get("type")
        s = self.session
        if kind == "status" and event.get("status") == "running" and eid not in self.begun:
            self.begun.add(eid)
            source = self.codes.get(eid, code or "")
            return [
                status("busy", parent, s),
                message(
                    "iopub",
                    "execute_input",
                    {"code": source, "execution_count": self.execution_count + 1},
                    parent,
                    s,
                ),
            ]
        if kind == "stream":
            return [
                message(
                    "iopub", "stream", {"name": event["name"], "text": event["text"]}, parent, s
                )
            ]
        if kind in ("display", "result"):
            content: dict[str, Any] = {
                "data": event.get("data", {}),
                "metadata": event.get("metadata", {}),
            }
            if kind == "result":
                count = event.get("execution_count") or self.execution_count + 1
                content["execution_count"] = count
                return [message("iopub", "execute_result", content, parent, s)]
            transient = {"display_id": event["display_id"]} if event.get("display_id") else {}
            content["transient"] = transient
            msg_type = "update_display_data" if event.get("update") else "display_data"
            return [message("iopub", msg_type, content, parent, s)]
        if kind == "error":
            err = event["error"]
            content = {
                "ename": err["name"],
                "evalue": err["value"],
                "traceback": err.get("traceback", []),
            }
            return [message("iopub", "error", content, parent, s)]
        if kind == "clear_output":
            return [message("iopub", "clear_output", {"wait": bool(event.get("wait"))}, parent, s)]
        if kind == "notice" or kind == "truncated":
            text = (
                event.get("message")
                or f"[kernelhub: output truncated at {event.get('limit_bytes')} bytes]"
            )
            return [message("iopub", "stream", {"name": "stderr", "text": f"{text}\n"}, parent, s)]
        if kind == "input_request":
            if origin is None or not origin.allow_stdin:
                return []
            content = {"prompt": event.get("prompt", ""), "password": bool(event.get("password"))}
            return [message("stdin", "input_request", content, parent, s)]
        if kind == "final":
            return self._final(eid, event["record"], parent, origin)
        return []

    def _final(
        self, eid: str, record: dict[str, Any], parent: dict[str, Any], origin: Origin | None
    ) -> list[Message]:
        started = record.get("started_at") is not None
        if record.get("execution_count"):
            self.execution_count = int(record["execution_count"])
        elif started:
            self.execution_count += 1
        self.origins.pop(eid, None)
        self.codes.pop(eid, None)
        self.begun.discard(eid)
        state = _REPLY_STATUS.get(record.get("status", ""), "error")
        content: dict[str, Any] = {"status": state, "execution_count": self.execution_count}
        if state == "ok":
            content.update(user_expressions={}, payload=[])
        elif state == "error":
            err = record.get("error") or {
                "name": _ERROR_NAMES.get(record.get("status", ""), "KernelhubError"),
                "value": record.get("reason") or record.get("status", "failed"),
                "traceback": [],
            }
            content.update(
                ename=err["name"], evalue=err["value"], traceback=err.get("traceback", [])
            )
        out = []
        if origin is not None:
            out.append(message("shell", "execute_reply", content, parent, self.session))
        if started or origin is not None:
            out.append(status("idle", parent, self.session))
        return out


_ERROR_NAMES = {
    "interrupted": "KeyboardInterrupt",
    "timed_out": "TimeoutError",
    "kernel_died": "DeadKernelError",
}
