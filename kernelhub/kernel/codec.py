"""Jupyter messages to ZeroMQ frames and back, with no I/O (the messaging spec, v5).

A message on the wire is ``[identities..., b"<IDS|MSG>", signature, header,
parent_header, metadata, content, buffers...]``; the signature is the hex HMAC-SHA256
of the four JSON frames under the kernel's key. :class:`Codec` turns frames into the
message dict the collector reads (``header``, ``msg_id``, ``msg_type``,
``parent_header``, ``metadata``, ``content``, ``buffers``) and back, and nothing else:
the caller owns the sockets (``kernel.client``).

Why not jupyter_client's ``Session``: on the host it was the largest cost of a cell
(its ``deserialize`` parses every ISO-looking header string into a ``datetime`` and runs
the protocol ``adapt`` on every message). Here the HMAC runs over the frames as they
arrived, headers keep their date strings, and a kernel that does not speak protocol 5
is refused instead of adapted: the kernel image is ours, and a kernel claiming another
version is broken or hostile.

Every frame is hostile input (the kernel holds its own key, so a valid signature only
proves the message came from inside the sandbox): sizes are bounded before anything is
parsed, each JSON frame must be an object, and a signature seen before is refused as a
replay (jupyter_client's rule, bounded the same way). Failures raise
:class:`~kernelhub.errors.KernelMessageError`; nothing else escapes ``decode``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic_core import from_json

from kernelhub.errors import KernelMessageError

DELIMITER = b"<IDS|MSG>"
PROTOCOL_VERSION = "5.3"
# A DEALER receives no identities, a SUB one topic; a ROUTER peer adds one per hop.
MAX_IDENTITIES = 16
MAX_BUFFERS = 64
# jupyter_client remembers 2**16 signatures; so do we, oldest forgotten first.
DIGEST_HISTORY = 1 << 16
# The four JSON frames come after the signature.
_PARTS = 5
JSON_FRAMES = ((1, "header"), (2, "parent_header"), (3, "metadata"), (4, "content"))

Frame = bytes | memoryview
_EMPTY = b"{}"  # _pack({})


def _pack(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode(
        "utf-8", errors="surrogateescape"
    )


def split_identities(frames: Sequence[Frame]) -> tuple[list[bytes], list[Frame]]:
    """``(identities, parts)``: the routing prefix and everything after the delimiter."""
    for i, frame in enumerate(frames[: MAX_IDENTITIES + 1]):
        if len(frame) == len(DELIMITER) and bytes(frame) == DELIMITER:
            return [bytes(f) for f in frames[:i]], list(frames[i + 1 :])
    raise KernelMessageError(
        f"kernel message without its <IDS|MSG> delimiter in the first {MAX_IDENTITIES + 1}"
        f" of {len(frames)} frames"
    )


class Codec:
    """Encodes our requests and decodes the kernel's messages for one kernel's key.

    ``decode`` may run in a worker thread (the host verifies large messages off the event
    loop) while another channel decodes on the loop: the replay history is locked.
    """

    def __init__(
        self,
        key: bytes,
        *,
        max_message_bytes: int,
        session: str | None = None,
        username: str = "kernelhub",
        history: int = DIGEST_HISTORY,
    ) -> None:
        if not key:
            # An empty key means unsigned messages in Jupyter; we never run a kernel so.
            raise ValueError("a kernel's HMAC key must not be empty")
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self.max_message_bytes = max_message_bytes
        self.session = session or uuid.uuid4().hex
        self.username = username
        self._history = history
        self._seen: dict[bytes, None] = {}  # insertion-ordered: the oldest goes first
        # The header's constant fields rendered once per msg_type (json.dumps of the whole
        # header was a third of encoding an execute_request): see _header_frame.
        self._header_parts: dict[str, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def sign(self, parts: Sequence[Frame]) -> bytes:
        """The hex HMAC-SHA256 of ``parts`` (header, parent, metadata, content)."""
        mac = self._mac.copy()
        for part in parts:
            mac.update(part)
        return mac.hexdigest().encode()

    # -- out --------------------------------------------------------------------------

    def header(self, msg_type: str) -> dict[str, str]:
        return {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "username": self.username,
            "session": self.session,
            "date": datetime.now(UTC).isoformat(),
            "version": PROTOCOL_VERSION,
        }

    def _header_frame(self, msg_type: str) -> tuple[str, bytes]:
        """``(msg_id, header frame)``: the bytes ``_pack(self.header(msg_type))`` gives,
        keys in the same order, with only the msg_id and date filled in per message (both
        plain ASCII, nothing to escape)."""
        parts = self._header_parts.get(msg_type)
        if parts is None:
            names = {"msg_type": msg_type, "username": self.username, "session": self.session}
            parts = (_pack(names)[1:-1], _pack({"version": PROTOCOL_VERSION})[1:-1])
            self._header_parts[msg_type] = parts
        # 128 random bits as hex, like uuid4().hex without building a UUID (a third of
        # uuid4's cost per request was UUID.__init__).
        msg_id = os.urandom(16).hex()
        date = datetime.now(UTC).isoformat()
        return msg_id, b'{"msg_id": "%s", %s, "date": "%s", %s}' % (
            msg_id.encode(),
            parts[0],
            date.encode(),
            parts[1],
        )

    def encode(
        self,
        msg_type: str,
        content: Mapping[str, Any],
        *,
        parent: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        identities: Sequence[bytes] = (),
    ) -> tuple[str, list[bytes]]:
        """``(msg_id, frames)`` of a new message, ready for ``send_multipart``."""
        msg_id, header = self._header_frame(msg_type)
        parts = [
            header,
            _pack(parent) if parent else _EMPTY,
            _pack(metadata) if metadata else _EMPTY,
            _pack(content),
        ]
        return msg_id, [*identities, DELIMITER, self.sign(parts), *parts]

    # -- in ---------------------------------------------------------------------------

    def decode(self, frames: Sequence[Frame]) -> dict[str, Any]:
        """The message in ``frames`` (as received: identities first), verified.

        Raises ``KernelMessageError`` for a message that is too large, truncated,
        unsigned, signed with another key, replayed, not JSON objects, or of another
        protocol version. Buffers come back as memoryviews of the frames given.
        """
        parts = self.verified(frames)
        return self.assemble(parts, [unpack(parts[i], name) for i, name in JSON_FRAMES])

    def verified(self, frames: Sequence[Frame]) -> list[Frame]:
        """The parts after the delimiter of a message whose size, frame count and
        signature are checked (and remembered against replays); its JSON frames are not
        parsed yet. The first half of :meth:`decode`, for a caller that parses them
        itself (``kernel.client`` parses a large one a slice at a time)."""
        total = sum(len(f) for f in frames)
        if total > self.max_message_bytes:
            raise KernelMessageError(
                f"kernel message of {total} bytes is over the {self.max_message_bytes}-byte limit"
            )
        _, parts = split_identities(frames)
        if len(parts) < _PARTS:
            raise KernelMessageError(
                f"truncated kernel message: {len(parts)} frames after the delimiter, not {_PARTS}"
            )
        if len(parts) > _PARTS + MAX_BUFFERS:
            raise KernelMessageError(
                f"kernel message with {len(parts) - _PARTS} buffers; at most {MAX_BUFFERS}"
            )
        signature = bytes(parts[0])
        if not signature:
            raise KernelMessageError("unsigned kernel message")
        if not hmac.compare_digest(signature, self.sign(parts[1:_PARTS])):
            raise KernelMessageError("kernel message with an invalid signature")
        self._remember(signature)
        return parts

    def assemble(self, parts: Sequence[Frame], values: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The message of :meth:`verified` ``parts`` whose JSON frames parsed to
        ``values`` (header, parent_header, metadata, content: see :func:`unpack`)."""
        header, parent, metadata, content = values
        msg_type = header.get("msg_type")
        msg_id = header.get("msg_id")
        if not isinstance(msg_type, str) or not isinstance(msg_id, str):
            raise KernelMessageError("kernel message header without a msg_type and msg_id")
        version = header.get("version")
        if not (isinstance(version, str) and version.startswith("5.")):
            raise KernelMessageError(
                f"kernel message of protocol version {version!r}; kernelhub speaks 5.x"
            )
        return {
            "header": header,
            "msg_id": msg_id,
            "msg_type": msg_type,
            "parent_header": parent,
            "metadata": metadata,
            "content": content,
            "buffers": [memoryview(b) for b in parts[_PARTS:]],
        }

    def _remember(self, signature: bytes) -> None:
        with self._lock:
            if signature in self._seen:
                raise KernelMessageError("replayed kernel message (its signature was seen before)")
            self._seen[signature] = None
            if len(self._seen) > self._history:
                del self._seen[next(iter(self._seen))]


def claimed_parent(frames: Sequence[Frame]) -> dict[str, Any]:
    """The parent header ``frames`` claim, unverified: a hint for a message too large to
    keep (its signature cannot be checked without all of it); ``{}`` if unreadable."""
    try:
        _, parts = split_identities(frames)
        return unpack(parts[2], "parent_header")
    except (KernelMessageError, IndexError):
        return {}


def unpack(frame: Frame, name: str) -> dict[str, Any]:
    """JSON frame ``name`` of a message: an object, or ``KernelMessageError``.

    pydantic_core's parser first: one C call, 3-10x faster than ``json.loads`` on the
    small frames of a cell (four a message, ~20 us of a cell's gateway CPU). What it
    refuses, ``json.loads`` decides, so what parses is exactly what parsed before: a lone
    surrogate escape (``"\\ud800"``, which a kernel may send for undecodable output) is
    refused by the first and read by the second."""
    data = bytes(frame)
    try:
        value = from_json(data)
    except ValueError:
        try:
            value = json.loads(data)
        except ValueError as exc:  # bad JSON or bad UTF-8
            raise KernelMessageError(f"kernel message {name} is not JSON: {exc}") from exc
    return must_be_object(value, name)


def must_be_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise KernelMessageError(
            f"kernel message {name} is a {type(value).__name__}, not an object"
        )
    return value
