"""The turn-buffered transport on a real socket: one write per loop turn, bytes in order,
and nothing lost when the connection closes; and ``send_text_now`` on a real server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest
from websockets.asyncio.client import connect

from kernelhub.gateway.ws_protocol import (
    FEED_BYTES,
    FLUSH_NOW,
    RECEIVE_TEXT_NOW,
    SEND_TEXT_NOW,
    TurnBufferedWebSocketProtocol,
    _TurnBufferedTransport,
)
from tests.conftest import eventually
from tests.unit.gateway.uvicorn_rig import serving


class _CountingTransport:
    """The real transport, with its writes counted."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def _pair() -> tuple[_CountingTransport, socket.socket]:
    ours, peer = socket.socketpair()
    peer.settimeout(5)
    loop = asyncio.get_running_loop()
    real, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    return _CountingTransport(real), peer


async def _buffered() -> tuple[_TurnBufferedTransport, _CountingTransport, socket.socket]:
    """A turn-buffered transport over a counting one, and the socket at the other end."""
    counting, peer = await _pair()
    buffered = _TurnBufferedTransport(counting, asyncio.get_running_loop())  # type: ignore[arg-type]
    return buffered, counting, peer


def _read_all(peer: socket.socket) -> bytes:
    chunks = []
    while chunk := peer.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_writes_of_one_turn_leave_in_one_write_in_order() -> None:
    buffered, counting, peer = await _buffered()
    buffered.write(b"accepted;")
    buffered.write(b"running;")
    assert counting.writes == []  # nothing before the turn ends
    await asyncio.sleep(0)
    assert counting.writes == [b"accepted;running;"]
    buffered.write(b"result;")
    await asyncio.sleep(0)
    buffered.write(b"final;")
    buffered.close()  # sends what is buffered first
    await asyncio.sleep(0.05)
    assert counting.writes == [b"accepted;running;", b"result;", b"final;"]
    assert await asyncio.to_thread(_read_all, peer) == b"accepted;running;result;final;"
    peer.close()


async def test_flush_hands_this_turns_writes_over_at_once() -> None:
    buffered, counting, peer = await _buffered()
    buffered.write(b"result;")
    buffered.write(b"final;")
    buffered.flush()  # the batch is complete: no wait for the end of the turn
    assert counting.writes == [b"result;final;"]
    await asyncio.sleep(0)  # the end of the turn finds nothing left
    assert counting.writes == [b"result;final;"]
    buffered.close()
    assert await asyncio.to_thread(_read_all, peer) == b"result;final;"
    peer.close()


async def test_a_hold_keeps_what_is_buffered_until_the_next_write() -> None:
    buffered, counting, peer = await _buffered()
    buffered.write(b"result;")
    buffered.flush(hold=5.0)
    await asyncio.sleep(0.02)  # the end of the turn came and went: still held
    assert counting.writes == []
    buffered.write(b"final;")  # the next write ends the hold with its own turn
    await asyncio.sleep(0)
    assert counting.writes == [b"result;final;"]
    buffered.close()
    assert await asyncio.to_thread(_read_all, peer) == b"result;final;"
    peer.close()


async def test_a_hold_ends_by_itself_and_a_flush_ends_it_early() -> None:
    buffered, counting, peer = await _buffered()
    buffered.write(b"result;")
    buffered.flush(hold=0.05)
    buffered.flush(hold=5.0)  # a second hold does not push the first one's time back
    await asyncio.sleep(0.2)
    assert counting.writes == [b"result;"]
    buffered.write(b"error;")
    buffered.flush(hold=5.0)
    buffered.write(b"final;")
    buffered.flush()  # a plain flush sends what is held, now
    assert counting.writes == [b"result;", b"error;final;"]
    buffered.write(b"late;")
    buffered.flush(hold=5.0)
    buffered.close()  # closing sends what is held
    assert counting.writes == [b"result;", b"error;final;", b"late;"]
    assert await asyncio.to_thread(_read_all, peer) == b"result;error;final;late;"
    peer.close()


async def test_buffered_bytes_count_toward_the_write_buffer() -> None:
    buffered, _, peer = await _buffered()
    buffered.write(b"x" * 100)
    assert buffered.get_write_buffer_size() >= 100
    assert not buffered.is_closing()  # everything else is the real transport's
    buffered.close()
    peer.close()


def _server(app: Any) -> contextlib.AbstractAsyncContextManager[int]:
    """uvicorn with our protocol serving ``app`` on a loopback port."""
    return serving(app, ws=TurnBufferedWebSocketProtocol)


async def test_send_text_now_writes_frames_in_order_on_a_real_server() -> None:
    """uvicorn with our protocol, a real client: the scope offers ``send_text_now``; frames
    it sends arrive in order among ASGI's own; after close it declines instead of raising."""
    results: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        now = scope["extensions"][SEND_TEXT_NOW]
        flush_now = scope["extensions"][FLUSH_NOW]
        await receive()  # websocket.connect
        results.append(now("early"))  # not accepted yet: declines
        await send({"type": "websocket.accept"})
        results.append(now("one"))
        flush_now()
        await send({"type": "websocket.send", "text": "two"})
        results.append(now("three"))
        await send({"type": "websocket.close", "code": 1000})
        results.append(now("late"))  # closing: declines

    async with _server(app) as port, connect(f"ws://127.0.0.1:{port}/") as ws:
        got = [msg async for msg in ws]
    assert got == ["one", "two", "three"]
    assert results == [False, True, True, False]


async def test_receive_text_now_takes_frames_as_they_arrive_on_a_real_server() -> None:
    """Frames the handler takes never reach ASGI's receive; those it leaves (or fails on)
    do. The app keeps its own order as the stream does: its handler takes nothing while
    the app is busy with a frame from ``receive``."""
    taken: list[str] = []
    received: list[str] = []
    busy = False

    def handler(text: str) -> bool:
        if text == "boom":
            raise RuntimeError("a bug in the handler")
        if text.startswith("now") and not busy:
            taken.append(text)
            return True
        return False

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal busy
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        scope["extensions"][RECEIVE_TEXT_NOW](handler)
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            busy = True
            received.append(message["text"])
            if message["text"] == "slow":
                await asyncio.sleep(0.2)  # a frame that takes a while: the next ones wait
            await send({"type": "websocket.send", "text": "ack " + message["text"]})
            busy = False

    async with _server(app) as port, connect(f"ws://127.0.0.1:{port}/") as ws:
        await ws.send("now 1")
        await ws.send("later 2")
        assert await ws.recv() == "ack later 2"
        await ws.send("boom")
        assert await ws.recv() == "ack boom"
        await ws.send("slow")
        await asyncio.sleep(0.05)
        await ws.send("now 3")  # "slow" is still being handled: this one waits its turn
        assert await ws.recv() == "ack slow"
        assert await ws.recv() == "ack now 3"
        await ws.send("now 4")
        await asyncio.sleep(0.1)
    assert taken == ["now 1", "now 4"]
    assert received == ["later 2", "boom", "slow", "now 3"]


async def _watched(
    stall_timeout: float, buffer_bytes: int
) -> tuple[_TurnBufferedTransport, socket.socket, list[str]]:
    """A watched transport whose peer reads only when the test says so."""
    counting, peer = await _pair()
    stalls: list[str] = []
    watched = _TurnBufferedTransport(
        counting,  # type: ignore[arg-type]
        asyncio.get_running_loop(),
        stall_timeout=stall_timeout,
        buffer_bytes=buffer_bytes,
        on_stall=stalls.append,
        linger=0.4,
    )
    return watched, peer, stalls


async def test_a_peer_that_takes_nothing_of_a_large_backlog_is_reported_at_the_stall_timeout() -> (
    None
):
    watched, peer, stalls = await _watched(stall_timeout=0.4, buffer_bytes=256 * 1024)
    t0 = asyncio.get_running_loop().time()
    watched.write(b"x" * 4 * 2**20)
    await eventually(lambda: bool(stalls), 3)
    took = asyncio.get_running_loop().time() - t0
    assert "over the buffer" in stalls[0] and 0.4 <= took < 0.8, (stalls, took)
    watched.abort()
    assert watched.get_write_buffer_size() == 0
    peer.close()


async def test_a_peer_that_takes_nothing_of_a_little_is_reported_a_linger_later() -> None:
    watched, peer, stalls = await _watched(stall_timeout=0.4, buffer_bytes=256 * 2**20)
    t0 = asyncio.get_running_loop().time()
    watched.write(b"x" * 4 * 2**20)  # more than the socket takes, less than the buffer
    await asyncio.sleep(0)
    assert watched.get_write_buffer_size() > 0
    await eventually(lambda: bool(stalls), 3)
    took = asyncio.get_running_loop().time() - t0
    assert stalls[0].startswith("nothing read for") and 0.8 <= took < 1.3, (stalls, took)
    assert len(stalls) == 1
    watched.abort()
    peer.close()


async def test_a_closed_transport_whose_peer_takes_nothing_is_still_reported() -> None:
    # The stream closes a client it gave up on; the close waits behind what the client
    # did not take, and the watch must go on, or the connection stays open forever.
    watched, peer, stalls = await _watched(stall_timeout=0.4, buffer_bytes=256 * 2**20)
    watched.write(b"x" * 256 * 1024)  # all of it fits the socket transport: no backlog
    await asyncio.sleep(0)
    watched.close()
    assert watched.get_write_buffer_size() > 0
    await eventually(lambda: bool(stalls), 3)
    assert stalls[0].startswith("nothing read for"), stalls
    watched.abort()
    peer.close()


class _Feeding(asyncio.Protocol):
    """Feeds a watched transport when the socket drains, as the WebSocket protocol does."""

    watched: _TurnBufferedTransport | None = None

    def resume_writing(self) -> None:
        if self.watched is not None:
            self.watched.feed()


async def test_a_large_write_waits_as_a_reference_and_leaves_whole_and_in_order() -> None:
    ours, peer = socket.socketpair()
    peer.settimeout(5)
    real, protocol = await asyncio.get_running_loop().create_connection(_Feeding, sock=ours)
    watched = _TurnBufferedTransport(
        real,  # type: ignore[arg-type]
        asyncio.get_running_loop(),
        stall_timeout=30.0,
        buffer_bytes=256 * 2**20,
    )
    protocol.watched = watched
    shared = bytes(range(256)) * (8 * 4096)  # 8 MiB, as if shared by many connections
    watched.write(b"head;")
    watched.write(shared)
    watched.write(b";tail")
    await asyncio.sleep(0)
    # Only about FEED_BYTES were handed to the socket's transport; the rest waits as it is.
    assert real.get_write_buffer_size() <= FEED_BYTES
    assert watched.get_write_buffer_size() > len(shared) // 2
    watched.close()  # closing waits for the backlog
    assert watched.is_closing()
    received = await asyncio.to_thread(_read_all, peer)
    assert received == b"head;" + shared + b";tail"
    peer.close()


async def test_a_peer_that_keeps_reading_is_never_reported() -> None:
    watched, peer, stalls = await _watched(stall_timeout=0.2, buffer_bytes=256 * 1024)
    total = 16 * 2**20
    for _ in range(16):
        watched.write(b"x" * 2**20)
    got = 0

    def read_slowly() -> None:
        nonlocal got
        while got < total:
            got += len(peer.recv(256 * 1024))

    await asyncio.to_thread(read_slowly)
    assert got == total and stalls == []
    watched.close()
    peer.close()


async def test_a_flushed_backlog_is_fed_to_the_socket_in_a_callback_of_its_own() -> None:
    """A store commit flushes every client of a session in one callback; a big backlog
    must not be written to each socket there (30 clients: 97 ms of CPU in one callback)."""
    ours, peer = socket.socketpair()
    real, protocol = await asyncio.get_running_loop().create_connection(_Feeding, sock=ours)
    watched = _TurnBufferedTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    protocol.watched = watched
    big = bytes(range(256)) * (4 * 4096)  # 4 MiB
    watched.write(big)
    watched.flush()
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)  # nothing written to the socket in this callback
    await asyncio.sleep(0)
    first = peer.recv(FEED_BYTES)
    assert first == big[: len(first)] and first  # the next callback fed it
    peer.settimeout(5)
    watched.close()
    rest = await asyncio.to_thread(_read_all, peer)
    assert first + rest == big
    peer.close()
