"""uvicorn's WebSocket protocol, with the frames of one loop turn sent in one write.

A cell's events often leave together (its ``accepted`` and ``running``, a burst of
output), and on loopback each write is a send system call that wakes the reader: the
cost of a frame is mostly that, not its bytes. Here every write a connection makes during
one turn of the event loop is buffered and handed to the socket at the end of the turn,
in order. Frames stay separate WebSocket frames: clients see no difference.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class _TurnBufferedTransport:
    """Writes are joined and sent at the end of the loop turn; everything else is the
    real transport's (closing sends what is buffered first)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TurnBufferedWebSocketProtocol(WebSocketsSansIOProtocol):
    """Pass as ``uvicorn.run(..., ws=TurnBufferedWebSocketProtocol)``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # reads addresses from the real transport
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance check)
        real = cast(asyncio.Transport, transport)
        self.transport = _TurnBufferedTransport(real, asyncio.get_running_loop())  # type: ignore[assignment]
