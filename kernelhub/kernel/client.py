"""jupyter_client's async kernel client, connected the safe way.

The only changes from stock ``AsyncKernelClient``: sockets connect through descriptors we
opened and checked (:meth:`SessionDir.open_sockets`), never reconnect by path on their own,
and refuse oversized messages so a hostile kernel cannot make the host buffer 300 MB.
Messages keep their header dates as the ISO strings the kernel sent (see
:class:`SandboxSession`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from hmac import compare_digest
from typing import Any

import zmq
from jupyter_client.adapter import adapt
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.session import Session
from zmq.utils.monitor import parse_monitor_message

from kernelhub.execution.collector import OVERSIZED_KEY, WIRE_BYTES_KEY
from kernelhub.kernel.connection import PORTS, SIGNATURE_SCHEME, SessionDir

# The in-kernel helper splits stream output into messages of at most 1 MiB and cuts any
# other message over 8 MiB (``kernelhub_kernel.patches.MAX_MESSAGE_BYTES``) with a marker.
# A frame past this is refused by libzmq before allocation (it drops the connection,
# which ``Receiver`` re-establishes and names); a message past the total is drained and
# named without being kept. A hostile kernel can send either: its socket is its own.
MAX_FRAME_BYTES = 8 * 1024 * 1024 + 256 * 1024
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 256 * 1024
RECEIVE_QUEUE_MESSAGES = 8
# Messages larger than this are verified and decoded in a worker thread: hashlib
# releases the GIL while it checks the signature of a few MiB.
_DECODE_OFF_LOOP_BYTES = 1024 * 1024


class SandboxSession(Session):
    """``Session`` without the date parsing: stock ``deserialize`` turns every ISO-looking
    string of both headers into a ``datetime`` (a regex walk and dateutil parses per
    message, the largest single cost of a cell on the host), and nothing here reads them.
    Signature check, replay refusal and protocol adaptation are kept as they are."""

    def deserialize(
        self, msg_list: list[Any], content: bool = True, copy: bool = True
    ) -> dict[str, Any]:
        if not copy:
            msg_list = [bytes(m.bytes) for m in msg_list[:5]] + list(msg_list[5:])
        if len(msg_list) < 5:
            raise TypeError("malformed message, must have at least 5 elements")
        if self.auth is not None:
            signature = msg_list[0]
            if not signature:
                raise ValueError("Unsigned Message")
            if signature in self.digest_history:
                raise ValueError(f"Duplicate Signature: {signature!r}")
            if content:
                self._add_digest(signature)
            if not compare_digest(signature, self.sign(msg_list[1:5])):
                raise ValueError(f"Invalid Signature: {signature!r}")
        header = self.unpack(msg_list[1])
        buffers = [memoryview(b if copy else bytes(b.bytes)) for b in msg_list[5:]]
        return adapt(
            {
                "header": header,
                "msg_id": header["msg_id"],
                "msg_type": header["msg_type"],
                "parent_header": self.unpack(msg_list[2]),
                "metadata": self.unpack(msg_list[3]),
                "content": self.unpack(msg_list[4]) if content else msg_list[4],
                "buffers": buffers,
            }
        )


class SandboxKernelClient(AsyncKernelClient):
    """An ``AsyncKernelClient`` whose sockets are connected to pre-checked descriptors."""

    _socket_fds: dict[str, int]

    def _make_url(self, channel: str) -> str:
        return f"ipc:///proc/self/fd/{self._socket_fds[channel]}"

    def _create_connected_socket(self, channel: str, identity: bytes | None = None) -> Any:
        url = self._make_url(channel)
        sock = self.context.socket(_SOCKET_TYPES[channel])
        sock.linger = 0
        # A dropped connection means the kernel went away or was restarted; we reconnect
        # explicitly after re-checking the socket files, never automatically by path.
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # libzmq's default (1000 messages) would let a flooding kernel park a gigabyte of
        # output in the gateway's receive pipe; past a few messages the backlog stays in
        # the sandbox (its iopub queues without limit, bounded by its memory) and the
        # unix socket applies back-pressure. Nothing is dropped.
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        if identity:
            sock.identity = identity
        sock.connect(url)
        return sock


_SOCKET_TYPES = {
    "shell": zmq.DEALER,
    "control": zmq.DEALER,
    "stdin": zmq.DEALER,
    "iopub": zmq.SUB,
    "hb": zmq.REQ,
}


class Receiver:
    """Reads one channel's messages, bounded: the calling contract of the engine's pumps.

    ``recv()`` returns the next message as jupyter_client's ``deserialize`` gives it, plus
    ``WIRE_BYTES_KEY`` (its size: content, metadata, buffers); a message over
    ``MAX_MESSAGE_BYTES`` in all is drained frame by frame without being kept and comes back
    as ``{OVERSIZED_KEY: size, "parent_header": ...}`` (the parent as the kernel claimed it,
    unverified). It raises what ``deserialize`` raises for a bad message, and ``zmq.ZMQError``
    once the socket is closed.

    ``reset()`` answers a dropped connection (``watch_disconnects`` reports them): libzmq
    drops the peer that sent a frame over ``MAX_FRAME_BYTES`` and never reconnects after a
    protocol error, so we reconnect to the same checked descriptor.
    """

    def __init__(self, channel: Any, session: Session, url: str) -> None:
        self.channel = channel
        self.socket = channel.socket
        self.session = session
        self.url = url
        # Frames are read through a plain socket on the same handle: zmq.asyncio's recv
        # costs ~100 us per frame in futures and flag enums, most of a small message's
        # cost on the host. The asyncio socket only waits for the next message.
        self._frames: zmq.Socket[bytes] = zmq.Socket.shadow(self.socket.underlying)

    async def recv(self) -> dict[str, Any]:
        while True:
            try:
                frame = self._frames.recv(zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self.socket.poll(flags=zmq.POLLIN)
        frames: list[zmq.Frame] = [frame]
        total = len(frame)
        # The parts of a message arrive together (libzmq delivers them atomically).
        while frame.more:
            frame = self._frames.recv(copy=False)
            total += len(frame)
            if total <= MAX_MESSAGE_BYTES:
                frames.append(frame)
        if total > MAX_MESSAGE_BYTES:
            return {OVERSIZED_KEY: total, "parent_header": self._claimed_parent(frames)}
        _, parts = self.session.feed_identities(frames, copy=False)
        wire = sum(len(f) for f in parts[3:])
        if total > _DECODE_OFF_LOOP_BYTES:
            msg = await asyncio.to_thread(self.session.deserialize, parts, True, False)
        else:
            msg = self.session.deserialize(parts, copy=False)
        msg[WIRE_BYTES_KEY] = wire
        return msg

    def reset(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disconnect(self.url)
        self.socket.connect(self.url)

    def _claimed_parent(self, frames: list[zmq.Frame]) -> dict[str, Any]:
        try:
            _, parts = self.session.feed_identities(frames, copy=False)
            frame = parts[2]
            parent = self.session.unpack(frame if isinstance(frame, bytes) else frame.bytes)
        except Exception:  # whatever the kernel sent: the answer is only a hint
            return {}
        return parent if isinstance(parent, dict) else {}


async def watch_disconnects(socket: Any, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` each time ``socket`` loses its connection, until cancelled."""
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                on_disconnect()
    finally:
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(linger=0)


def receiver_for(client: SandboxKernelClient, channel: str) -> Receiver:
    return Receiver(
        getattr(client, f"{channel}_channel"), client.session, client._make_url(channel)
    )


def connect_client(session_dir: SessionDir) -> SandboxKernelClient:
    """Check the kernel's sockets and start a client on them (no heartbeat channel: the
    sandbox backend reports the kernel's death faster and more precisely)."""
    fds = session_dir.open_sockets()
    client = SandboxKernelClient(
        session=SandboxSession(
            key=session_dir.key.get_secret_value().encode(),
            signature_scheme=SIGNATURE_SCHEME,
        ),
        transport="ipc",
        ip=session_dir.host_ipc_prefix,
        **{f"{name}_port": port for name, port in PORTS.items()},
    )
    client._socket_fds = fds
    client.start_channels(hb=False)
    return client


def disconnect_client(client: SandboxKernelClient) -> None:
    client.stop_channels()
    # Each client owns its context (jupyter_client's default); close it with the sockets.
    client.context.destroy(linger=0)
    for fd in client._socket_fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    client._socket_fds = {}
