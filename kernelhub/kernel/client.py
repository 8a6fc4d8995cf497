"""Our side of one kernel's sockets: plain pyzmq, our codec, connected the safe way.

Sockets connect through descriptors we opened and checked (:meth:`SessionDir.open_sockets`),
never reconnect by path on their own, and refuse oversized messages so a hostile kernel
cannot make the host buffer 300 MB. Messages are encoded and verified by
:mod:`kernelhub.kernel.codec`.

Why not jupyter_client's ``AsyncKernelClient``: its asyncio channels cost ~100 us per
frame in futures (most of a small message's cost on the host), and it parsed every
header date and adapted every message. Here a socket is read only when its descriptor
says so (``loop.add_reader``), with plain non-blocking ``recv``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kernelhub import gcpause, jsonslices
from kernelhub.errors import KernelError, KernelMessageError
from kernelhub.execution.collector import OVERSIZED_KEY, WIRE_BYTES_KEY
from kernelhub.kernel.codec import (
    JSON_FRAMES,
    Codec,
    Frame,
    claimed_parent,
    must_be_object,
    unpack,
)
from kernelhub.kernel.connection import SessionDir

# The in-kernel helper splits stream output into messages of at most 1 MiB and cuts any
# other message over 8 MiB (``kernelhub_kernel.bounds.MAX_MESSAGE_BYTES``) with a marker.
# A frame past this is refused by libzmq before allocation (it drops the connection,
# which ``Receiver`` re-establishes and names); a message past the total is drained and
# named without being kept. A hostile kernel can send either: its socket is its own.
MAX_FRAME_BYTES = 8 * 1024 * 1024 + 256 * 1024
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 256 * 1024
# Two messages of up to 1 MiB: with the fan-out's back-pressure (``KernelSession.add_gate``)
# what the gateway holds of a flood is these, the one being relayed and the store's backlog
# (8 here left 50 MB of stdout relayed at ~20 MiB of RSS growth; 2: ~12 MiB).
RECEIVE_QUEUE_MESSAGES = 2
# Messages larger than this are verified in a worker thread (hashlib releases the GIL
# while it checks the signature of a few MiB) and parsed a slice at a time (jsonslices).
_DECODE_OFF_LOOP_BYTES = 1024 * 1024

# No heartbeat channel: the sandbox backend reports the kernel's death faster and more
# precisely than a missed ping.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_SOCKET_TYPES = {"shell": zmq.DEALER, "control": zmq.DEALER, "stdin": zmq.DEALER, "iopub": zmq.SUB}


_context: tuple[int, zmq.Context[zmq.Socket[bytes]]] | None = None


def _shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's one zmq context for kernel sockets, made on first use (and anew in
    a forked child: a context does not survive fork).

    One context, so one libzmq I/O thread for every kernel, not one each (as
    jupyter_client's clients had): with 50 busy sessions, 50 I/O threads each woke per
    message on 2 cores, and the scheduler's switches between them cost the gateway CPU
    on every cell. One thread moves each turn's messages of many kernels in one wake-up.
    Its queues stay per socket (RCVHWM), so one flooding kernel cannot hold back another's
    messages beyond its own two."""
    global _context
    pid = os.getpid()
    if _context is None or _context[0] != pid:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq's default is 1023 sockets a context, and a kernel takes ten (four
        # channels, three disconnect monitors of two each): 100 sessions would hit it.
        context.set(zmq.MAX_SOCKETS, int(context.get(zmq.SOCKET_LIMIT)))
        _context = (pid, context)
    return _context[1]


class _Readiness:
    """Wakes a waiter when a zmq socket has a message, through its descriptor.

    libzmq's descriptor is edge-triggered: it signals that *something* changed, and only
    reading ``EVENTS`` says what (and re-arms it). So the callback always reads
    ``EVENTS``, and a waiter checks it before sleeping. The callback wakes a waiter only
    once ``EVENTS`` says POLLIN (or the socket is gone): the waiter need not check again.
    """

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self._loop = asyncio.get_running_loop()
        self._fd = int(socket.getsockopt(zmq.FD))
        self._waiter: asyncio.Future[None] | None = None
        self._loop.add_reader(self._fd, self._wake)

    def _wake(self) -> None:
        # Always read EVENTS, waiter or not: it processes libzmq's pending commands and
        # clears the descriptor, which the loop would otherwise report again and again.
        try:
            ready = self.readable()
        except zmq.ZMQError:  # closed under us: let the waiter find out
            ready = True
        waiter = self._waiter
        if ready and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def readable(self) -> bool:
        # Plain ints: the enum members cost ~3 us a call in their __and__ and conversion.
        return bool(int(self._socket.getsockopt(_EVENTS)) & _POLLIN)

    async def wait(self) -> None:
        """Return once the socket has a message (or is closed)."""
        if self.readable():
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self._loop.remove_reader(self._fd)


class Receiver:
    """Reads one channel's messages, bounded: the calling contract of the engine's pumps.

    ``recv()`` returns the next message as :meth:`Codec.decode` gives it, plus
    ``WIRE_BYTES_KEY`` (its size: content, metadata, buffers); a message over
    ``MAX_MESSAGE_BYTES`` in all is drained frame by frame without being kept and comes back
    as ``{OVERSIZED_KEY: size, "parent_header": ...}`` (the parent as the kernel claimed it,
    unverified). It raises ``KernelMessageError`` for a bad message, and ``zmq.ZMQError``
    once the socket is closed. One reader at a time.

    ``reset()`` answers a dropped connection (``watch_disconnects`` reports them): libzmq
    drops the peer that sent a frame over ``MAX_FRAME_BYTES`` and never reconnects after a
    protocol error, so we reconnect to the same checked descriptor.
    """

    def __init__(self, socket: zmq.Socket[bytes], codec: Codec, url: str) -> None:
        self.socket = socket
        self.codec = codec
        self.url = url
        self._ready = _Readiness(socket)

    async def recv(self) -> dict[str, Any]:
        # EVENTS before recv: a NOBLOCK recv on an empty socket raises zmq.Again, and
        # building that exception cost more than the check (most reads find it empty).
        socket = self.socket
        while True:
            await self._ready.wait()
            try:
                frame = socket.recv(_NOBLOCK, copy=False)
                break
            except zmq.Again:  # drained meanwhile (a reconnect): wait again
                continue
        frames: list[zmq.Frame] = [frame]
        total = len(frame)
        # The parts of a message arrive together (libzmq delivers them atomically).
        while frame.more:
            frame = socket.recv(copy=False)
            total += len(frame)
            if total <= MAX_MESSAGE_BYTES:
                frames.append(frame)
        views = [f.buffer for f in frames]
        if total > MAX_MESSAGE_BYTES:
            return {OVERSIZED_KEY: total, "parent_header": claimed_parent(views)}
        if total > _DECODE_OFF_LOOP_BYTES:
            parts = await asyncio.to_thread(self.codec.verified, views)
            msg = await self._parse_large(parts)
        else:
            parts = self.codec.verified(views)
            msg = self.codec.assemble(parts, [unpack(parts[i], name) for i, name in JSON_FRAMES])
        msg[WIRE_BYTES_KEY] = sum(len(p) for p in parts[3:])
        return msg

    async def _parse_large(self, parts: list[Frame]) -> dict[str, Any]:
        """The message of ``parts`` verified in a worker thread (hashlib lets the loop run
        meanwhile), parsed on the loop a slice at a time (json would hold the GIL for the
        whole frame). The garbage collector is held off while it is parsed and for the
        rest of the step that hands it on: the fan-out holds it from there (``gcpause``)."""
        values = []
        with gcpause.held():
            for index, name in JSON_FRAMES:
                try:
                    value = await jsonslices.drive(jsonslices.loads(parts[index]))
                except ValueError as exc:  # bad JSON or bad UTF-8
                    raise KernelMessageError(f"kernel message {name} is not JSON: {exc}") from exc
                values.append(must_be_object(value, name))
            gcpause.hold_this_turn()
        return self.codec.assemble(parts, values)

    def reset(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disconnect(self.url)
        self.socket.connect(self.url)

    def close(self) -> None:
        self._ready.close()


async def watch_disconnects(socket: zmq.Socket[bytes], on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` each time ``socket`` loses its connection, until cancelled."""
    monitor: zmq.Socket[bytes] = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    ready = _Readiness(monitor)
    try:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await ready.wait()
                continue
            if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                on_disconnect()
    finally:
        ready.close()
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(linger=0)


class KernelClient:
    """One kernel's shell, control, stdin and iopub sockets, and the codec for its key.

    Built by :func:`connect_client` inside the event loop; :meth:`close` when done. The
    engine sends through :meth:`send` (and the ``execute``/``input`` shorthands) and reads
    through :attr:`receivers`.
    """

    def __init__(self, fds: Mapping[str, int], key: bytes) -> None:
        self._fds = dict(fds)  # ours from here on: close() closes them
        self.codec = Codec(key, max_message_bytes=MAX_MESSAGE_BYTES)
        self.sockets: dict[str, zmq.Socket[bytes]] = {}
        self.receivers: dict[str, Receiver] = {}
        self.context = _shared_context()
        try:
            for channel in _SOCKET_TYPES:
                self.sockets[channel] = self._socket(channel)
                self.receivers[channel] = Receiver(
                    self.sockets[channel], self.codec, self.url(channel)
                )
        except BaseException:
            self.close()
            raise

    def url(self, channel: str) -> str:
        return f"ipc:///proc/self/fd/{self._fds[channel]}"

    def _socket(self, channel: str) -> zmq.Socket[bytes]:
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
        if channel == "iopub":
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        else:
            # ipykernel sends a cell's input_request to the stdin peer whose identity is
            # that of the shell peer that sent the cell: all of ours share one.
            sock.setsockopt(zmq.IDENTITY, self.codec.session.encode())
        sock.connect(self.url(channel))
        return sock

    def send(self, channel: str, msg_type: str, content: Mapping[str, Any]) -> str:
        """Send a request; returns its msg_id. Never blocks: a kernel that stopped reading
        its own queue of 1000 requests is broken (``KernelError``)."""
        msg_id, frames = self.codec.encode(msg_type, content)
        # Frame by frame rather than send_multipart, whose per-frame checks cost more than
        # the sends of a small request. A DEALER queues a message whole or not at all
        # (libzmq checks the high-water mark on the first part only), so Again can only
        # come on the first frame: never half a message.
        send = self.sockets[channel].send
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                send(frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK)
        except zmq.Again as exc:
            raise KernelError(f"the kernel stopped reading its {channel} channel") from exc
        return msg_id

    def execute(
        self,
        code: str,
        *,
        silent: bool = False,
        store_history: bool = True,
        user_expressions: Mapping[str, str] | None = None,
        allow_stdin: bool = True,
        stop_on_error: bool = True,
    ) -> str:
        return self.send(
            "shell",
            "execute_request",
            {
                "code": code,
                "silent": silent,
                "store_history": store_history,
                "user_expressions": dict(user_expressions or {}),
                "allow_stdin": allow_stdin,
                "stop_on_error": stop_on_error,
            },
        )

    def input(self, value: str) -> str:
        return self.send("stdin", "input_reply", {"value": value})

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.receivers = {}
        self.sockets = {}
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}


def connect_client(session_dir: SessionDir) -> KernelClient:
    """Check the kernel's sockets and connect a client to them."""
    return KernelClient(session_dir.open_sockets(), session_dir.key.get_secret_value().encode())
