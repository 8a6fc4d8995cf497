"""uvicorn's WebSocket protocol, with the frames of one loop turn sent in one write, and a
way to send a text frame without the ASGI round trip.

A cell's events often leave together (its ``accepted`` and ``running``, a burst of
output), and on loopback each write is a send system call that wakes the reader: the
cost of a frame is mostly that, not its bytes. Here every write a connection makes during
one turn of the event loop is buffered and handed to the socket at the end of the turn,
in order. Frames stay separate WebSocket frames: clients see no difference.

The stream endpoint sends most of its frames from a store commit's callback (a cell's
events). Going through ASGI's ``send`` for each one costs a task wake-up, a lock, a timer
and three layers of dispatch (Starlette, uvicorn) before the same few lines of framing;
with many busy sessions that is a large share of the gateway's time per cell. So the
protocol offers, under :data:`SEND_TEXT_NOW` in the scope's ``extensions``, a synchronous
``send_text_now(text) -> bool`` that frames and writes at once when ASGI's send would not
have to wait, and says False otherwise: the caller then uses ASGI's send, which waits for
the socket and can time out; ``send_frame_now(payload)`` under :data:`SEND_FRAME_NOW` does
the same for text already encoded, keeping ``payload`` by reference. Under :data:`FLUSH_NOW`, ``flush_now()`` hands what this turn
has buffered to the socket at once: a caller that knows its batch is complete (the frames
of one store commit) need not wait for the end of the turn, which on a busy loop runs
every other ready callback first (a cell's last frame waited ~0.2 ms for it here).
``flush_now(hold)`` instead keeps them up to ``hold`` seconds, until a write that is not
held itself: the stream uses it for a cell's state changes (``accepted``, ``running``,
its ``result``), which its output or ``final`` soon follows (see ``stream.py``).

Receiving has the same detour in the other direction (the frame is queued, reading is
paused, a task wakes up, reading resumes: two system calls and a loop turn per frame).
Under :data:`RECEIVE_TEXT_NOW`, ``receive_text_now(handler)`` has text frames offered to
``handler(text) -> bool`` as they arrive; the stream takes an ``execute`` there and hands
its cell to the kernel in the same callback. An app served by another server simply
finds no extensions.

Every connection also has a watchdog (:class:`_TurnBufferedTransport`): a client that takes
nothing for ``stall_timeout`` seconds while more than ``buffer_bytes`` wait for it, or for
:data:`LINGER` seconds more with anything waiting, is cut (the connection is aborted, which
frees its buffer). The
stream's own deadline covers only frames sent through ASGI; a frame written directly (or
the last frame of a cell) waits in the socket's buffer with nobody waiting on it, and 20
non-reading clients of one 40 MB frame kept ~1 GB for as long as they stayed (issue 16).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.http11 import Request
from websockets.protocol import State

SEND_TEXT_NOW = "kernelhub.websocket.send_text_now"
SEND_FRAME_NOW = "kernelhub.websocket.send_frame_now"
FLUSH_NOW = "kernelhub.websocket.flush_now"
RECEIVE_TEXT_NOW = "kernelhub.websocket.receive_text_now"
WAIT_WRITABLE = "kernelhub.websocket.wait_writable"
# Beyond this many bytes unsent, send_text_now declines. uvicorn's flow control pauses
# only once the socket's own buffer is full, at the end of a turn; within a turn a burst
# of events would otherwise pile up here without bound.
NOW_LIMIT_BYTES = 256 * 1024
# The most a connection keeps in its socket transport's own buffer (a copy); the rest
# waits as references. Above uvicorn's high-water mark (64 KiB), so a connection with a
# backlog is always paused for ASGI's send.
FEED_BYTES = 256 * 1024
# How much longer than the stall timeout a connection that takes nothing, but holds less
# than its buffer, is kept. The stream sends such a client 4408 after the stall timeout
# and waits up to 15 s for the close frame to leave: one that reads again by then learns
# why, and where to resume (`since`); after that it costs a descriptor, so it goes.
LINGER = 20.0

log = logging.getLogger(__name__)


class _TurnBufferedTransport:
    """Writes are joined and sent at the end of the loop turn, or held a little longer on
    request (:meth:`flush` with ``hold``); everything else is the real transport's
    (closing sends what is buffered first).

    The real transport's buffer is kept to about :data:`FEED_BYTES`: a larger turn's bytes
    wait in a backlog, as references (a frame shared by all of a session's clients stays
    one copy, see :meth:`TurnBufferedWebSocketProtocol.send_frame_now`), and are fed in as
    the socket drains (:meth:`feed`, on the protocol's ``resume_writing``).

    While anything is unsent, a check every ``stall_timeout / 4`` seconds (1 s at most)
    measures what the client took since the last one; ``on_stall`` is called once when it
    took nothing for ``stall_timeout`` seconds with more than ``buffer_bytes`` unsent, or
    for ``linger`` seconds more with anything unsent (:data:`LINGER`)."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        *,
        stall_timeout: float | None = None,
        buffer_bytes: int | None = None,
        on_stall: Callable[[str], None] | None = None,
        linger: float = LINGER,
    ) -> None:
        self._transport = transport
        self._linger = linger
        self._loop = loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._backlog: deque[memoryview] = deque()
        self._backlog_bytes = 0
        self._close_when_fed = False
        self._end_of_turn: asyncio.Handle | None = None
        self._held: asyncio.TimerHandle | None = None
        self._stall_timeout = stall_timeout
        self._buffer_bytes = buffer_bytes
        self._on_stall = on_stall
        self._handed = 0  # bytes given to the real transport, ever
        self._taken = 0  # of those, what had left its buffer at the last check
        self._last_progress = 0.0
        self._watch: asyncio.TimerHandle | None = None
        self._feeding: asyncio.Handle | None = None  # a feed() to come, for a new backlog

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        # Any write ends a hold at the end of this turn: only what was buffered when the
        # hold was asked for may wait longer.
        if self._end_of_turn is None:
            self._end_of_turn = self._loop.call_soon(self._send)
        self._pending.append(bytes(data))
        self._pending_bytes += len(data)

    def flush(self, hold: float = 0.0) -> None:
        """Hand what is buffered to the socket now (the end of the turn finds nothing);
        with ``hold`` > 0, keep it until the next write's turn ends or ``hold`` seconds
        pass, whichever comes first."""
        if hold <= 0 or not self._pending:
            self._send()
            return
        if self._end_of_turn is not None:
            self._end_of_turn.cancel()
            self._end_of_turn = None
        if self._held is None:
            self._held = self._loop.call_later(hold, self._send)

    def _send(self) -> None:
        if self._end_of_turn is not None:
            self._end_of_turn.cancel()
            self._end_of_turn = None
        if self._held is not None:
            self._held.cancel()
            self._held = None
        if not self._pending:
            return
        pending, total = self._pending, self._pending_bytes
        self._pending = []
        self._pending_bytes = 0
        if self._transport.is_closing():
            return
        if not self._backlog and total <= FEED_BYTES:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            self._transport.write(data)
            self._handed += len(data)
        else:  # not joined: that would copy a shared frame
            self._backlog.extend(memoryview(p) for p in pending)
            self._backlog_bytes += total
            # Fed in a callback of its own, not now: a store commit flushes every client
            # of a session in one callback, and each feed is a send() of up to FEED_BYTES
            # on loopback (the receiving side's TCP work too): 30 clients of a print took
            # one callback 60-97 ms of CPU (bench/neighbours.py, py-spy).
            if self._feeding is None:
                self._feeding = self._loop.call_soon(self.feed)
        if self._watch is None and self._stall_timeout is not None:
            self._taken = self._handed - self._transport.get_write_buffer_size()
            self._last_progress = self._loop.time()
            self._arm()

    def feed(self) -> None:
        """Move backlog into the real transport until its buffer holds ``FEED_BYTES``."""
        if self._feeding is not None:
            self._feeding.cancel()
            self._feeding = None
        real = self._transport
        while self._backlog and not real.is_closing():
            room = FEED_BYTES - real.get_write_buffer_size()
            if room <= 0:
                return
            chunk = self._backlog[0]
            if len(chunk) <= room:
                self._backlog.popleft()
            else:
                self._backlog[0] = chunk[room:]
                chunk = chunk[:room]
            self._backlog_bytes -= len(chunk)
            real.write(chunk)
            self._handed += len(chunk)
        if not self._backlog and self._close_when_fed:
            real.close()

    def _arm(self) -> None:
        assert self._stall_timeout is not None
        self._watch = self._loop.call_later(min(1.0, self._stall_timeout / 4), self._check)

    def _check(self) -> None:
        self._watch = None
        if self._stall_timeout is None:
            return
        # A closed transport still holds what it has not sent, until the client reads it:
        # closing is not the end of the watch (a stream that gave up on its client closes
        # it, and the close frame waits behind the rest).
        if not self._transport.is_closing():
            self.feed()  # in case no resume_writing came (a transport without flow control)
        unsent = self.get_write_buffer_size()
        if unsent == 0:
            return  # all taken: the next write re-arms
        taken = self._handed - self._transport.get_write_buffer_size()
        now = self._loop.time()
        if taken > self._taken:
            self._taken = taken
            self._last_progress = now
        else:
            idle = now - self._last_progress
            over = self._buffer_bytes is not None and unsent > self._buffer_bytes
            if idle >= self._stall_timeout and over:
                self._stalled(
                    f"nothing read for {idle:.1f} s with {unsent} bytes unsent, "
                    f"over the buffer of {self._buffer_bytes}"
                )
                return
            if idle >= self._stall_timeout + self._linger:
                self._stalled(f"nothing read for {idle:.1f} s")
                return
        self._arm()

    def _stalled(self, why: str) -> None:
        if self._on_stall is not None:
            self._on_stall(why)

    def is_closing(self) -> bool:
        return self._close_when_fed or self._transport.is_closing()

    def close(self) -> None:
        self._send()
        if self._backlog:
            self._close_when_fed = True  # closing now would drop the backlog
        else:
            self._transport.close()

    def drop(self) -> None:
        """Forget everything unsent (the connection is gone, or being aborted)."""
        self._pending = []
        self._pending_bytes = 0
        self._backlog.clear()
        self._backlog_bytes = 0
        for timer in (self._watch, self._end_of_turn, self._held, self._feeding):
            if timer is not None:
                timer.cancel()
        self._watch = self._end_of_turn = self._held = self._feeding = None

    def abort(self) -> None:
        self.drop()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._pending_bytes + self._backlog_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TurnBufferedWebSocketProtocol(WebSocketsSansIOProtocol):
    """Pass as ``uvicorn.run(..., ws=websocket_protocol(...))`` (or this class, for the
    default watchdog limits below)."""

    stall_timeout: float | None = 30.0
    buffer_bytes: int | None = 8 * 1024 * 1024

    _on_text: Callable[[str], bool] | None = None
    _socket_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # reads addresses from the real transport
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance check)
        real = cast(asyncio.Transport, transport)
        self.transport = _TurnBufferedTransport(  # type: ignore[assignment]
            real,
            asyncio.get_running_loop(),
            stall_timeout=self.stall_timeout,
            buffer_bytes=self.buffer_bytes,
            on_stall=self._cut,
        )

    def _cut(self, why: str) -> None:
        # A close frame would wait behind what the client does not read: abort, which
        # drops the buffer at once. The client sees the connection drop (1006) and
        # reconnects with `since`, losing nothing.
        log.warning("cutting WebSocket client %s, which stopped reading: %s", self.client, why)
        self.transport.abort()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # absent when the handshake was refused
        if scope is not None:
            scope["extensions"][SEND_TEXT_NOW] = self.send_text_now
            scope["extensions"][SEND_FRAME_NOW] = self.send_frame_now
            scope["extensions"][FLUSH_NOW] = self.flush_now
            scope["extensions"][RECEIVE_TEXT_NOW] = self.receive_text_now
            scope["extensions"][WAIT_WRITABLE] = self.wait_writable

    async def wait_writable(self) -> None:
        """Return once the client has taken what was sent (the socket drained, the
        backlog fed): what ASGI's send waits for, without a frame in hand. A sender that
        would read more from elsewhere (the store) first waits here, so a client that
        reads nothing makes the gateway hold nothing more for it."""
        transport = self.transport
        if (
            isinstance(transport, _TurnBufferedTransport)
            and transport.get_write_buffer_size() > NOW_LIMIT_BYTES
        ):
            # Written this turn, not yet handed to the socket: its flow control has not
            # seen it, so writable would still say yes. Hand it over now.
            transport.flush()
            transport.feed()
        await self.writable.wait()

    def send_text_now(self, text: str) -> bool:
        """Send ``text`` as one text frame now, exactly as ASGI's ``websocket.send`` would,
        if that would not wait: accepted, not closing, the socket keeping up (uvicorn's
        flow control has not paused writing, less than ``NOW_LIMIT_BYTES`` unsent). False,
        with nothing sent, otherwise."""
        if not self._can_send_now():
            return False
        try:
            self.conn.send_text(text.encode())
        except InvalidState:
            return False
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def send_frame_now(self, payload: bytes | Sequence[bytes]) -> bool:
        """:meth:`send_text_now` for text already encoded as UTF-8, and without copying it:
        the frame's header is written, then ``payload`` itself (or its pieces, in order:
        one frame), which the connection keeps by reference until the socket takes it.
        One encoded event serves every client of a session; 20 clients that do not read a
        40 MB event then hold one copy, not 20. Pieces spare the sender one big block: an
        8 MiB one is a fresh mmap (``kernelhub.malloc``), ~5 ms of page faults to fill."""
        parts = [payload] if isinstance(payload, bytes) else payload
        if self.conn.extensions:  # permessage-deflate: websockets must frame it
            return self.send_text_now(b"".join(parts).decode())
        if not self._can_send_now() or self.conn.state is not State.OPEN:
            return False
        self.transport.write(_text_frame_header(sum(len(p) for p in parts)))
        for part in parts:
            self.transport.write(part)
        return True

    def _can_send_now(self) -> bool:
        return not (
            not self.handshake_complete
            or self.initial_response is not None
            or self.close_sent
            or self.disconnected
            or not self.writable.is_set()
            or self.transport.get_write_buffer_size() > NOW_LIMIT_BYTES
        )

    def pause_writing(self) -> None:
        self._socket_paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        # The socket drained: feed it the backlog, and let ASGI's send go on only if that
        # did not fill it again (feeding calls pause_writing then).
        self._socket_paused = False
        transport = self.transport
        if isinstance(transport, _TurnBufferedTransport):
            transport.feed()
        if not self._socket_paused:
            super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        transport = self.transport
        if isinstance(transport, _TurnBufferedTransport):
            transport.drop()  # frees what the client never took
        super().connection_lost(exc)

    def flush_now(self, hold: float = 0.0) -> None:
        """Write the frames buffered in this turn now, in order; with ``hold`` > 0, at the
        latest ``hold`` seconds from now, sooner if anything else is written meanwhile
        (see the module doc)."""
        transport = self.transport
        if isinstance(transport, _TurnBufferedTransport):
            transport.flush(hold)

    def receive_text_now(self, handler: Callable[[str], bool] | None) -> None:
        """Offer each text frame to ``handler`` as it arrives, while no earlier frame waits
        for ASGI's ``receive``: True means it took the frame, False leaves the frame to
        ``receive`` as usual (so does an exception, which is logged). None stops it."""
        self._on_text = handler

    def send_receive_event_to_app(self) -> None:
        handler = self._on_text
        if (
            handler is not None
            and self.curr_msg_data_type == "text"
            and not self.close_sent
            and not self.read_paused  # reading is paused while a frame waits in the queue
            and self.queue.empty()
        ):
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            try:
                taken = handler(data.decode())
            except UnicodeDecodeError:
                taken = False  # ASGI's path closes the connection with 1007
            except Exception:
                log.exception("a WebSocket text handler failed; the frame goes through ASGI")
                taken = False
            if taken:
                self.frames = []
                return
        super().send_receive_event_to_app()


def _text_frame_header(length: int) -> bytes:
    """The header of a final, unmasked (server) text frame of ``length`` bytes (RFC 6455)."""
    if length < 126:
        return struct.pack("!BB", 0x81, length)
    if length < 1 << 16:
        return struct.pack("!BBH", 0x81, 126, length)
    return struct.pack("!BBQ", 0x81, 127, length)


def websocket_protocol(
    stall_timeout: float | None, buffer_bytes: int | None
) -> type[TurnBufferedWebSocketProtocol]:
    """A :class:`TurnBufferedWebSocketProtocol` whose watchdog has these limits (the
    gateway's ``stream_stall_timeout`` and ``stream_buffer_bytes``)."""
    return type(
        "ConfiguredWebSocketProtocol",
        (TurnBufferedWebSocketProtocol,),
        {"stall_timeout": stall_timeout, "buffer_bytes": buffer_bytes},
    )
