"""The guarded HTTP protocols against real loopback sockets, for each parser (httptools,
h11) on each event loop (uvloop, asyncio): the connection limit, the head and body
deadlines (and that neither cuts a kept-alive connection idle between requests, nor a
WebSocket), the head size limit. The gateway-level twins, with Docker, are in
tests/gateway/test_connections.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from websockets.asyncio.client import connect

from kernelhub.cli.serve import loop_factory, server_line
from kernelhub.config import load_settings
from kernelhub.errors import ConfigError
from kernelhub.gateway.connections import (
    GuardedH11Protocol,
    GuardedHttpToolsProtocol,
    http_protocol,
)
from tests.unit.gateway.uvicorn_rig import serving

HEADER_TIMEOUT = 0.3
BODY_TIMEOUT = 0.3
MAX_CONNECTIONS = 8
# Generous: how long a client waits for an answer that a deadline above makes due.
ANSWER_WITHIN = 10.0

COMBOS = [
    pytest.param(parser, loop, id=f"{parser}-{loop}")
    for parser in ("httptools", "h11")
    for loop in ("uvloop", "asyncio")
]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers its length; echoes WebSocket text."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message["text"]})
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = str(len(body)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(answer)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": answer})


def served(parser: str) -> contextlib.AbstractAsyncContextManager[int]:
    protocol = http_protocol(MAX_CONNECTIONS, HEADER_TIMEOUT, BODY_TIMEOUT, parser)
    return serving(app, http=protocol)


def on_loop(loop: str, body: Callable[[], Awaitable[None]]) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(body())


async def answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes."""
    with contextlib.suppress(ConnectionResetError):
        return await asyncio.wait_for(reader.read(), ANSWER_WITHIN)
    return b""


async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bytes:
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def test_the_protocol_classes_are_the_guarded_ones() -> None:
    assert issubclass(http_protocol(8, 1, 1), GuardedHttpToolsProtocol)  # the default
    assert issubclass(http_protocol(8, 1, 1, "h11"), GuardedH11Protocol)
    assert http_protocol(9, 2, 3).max_connections == 9


@pytest.mark.parametrize(("parser", "loop"), COMBOS)
def test_stalled_heads_and_bodies_get_408_and_others_are_served(parser: str, loop: str) -> None:
    async def body() -> None:
        async with served(parser) as port:
            half_head = await asyncio.open_connection("127.0.0.1", port)
            half_head[1].write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow_body = await asyncio.open_connection("127.0.0.1", port)
            slow_body[1].write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            silent = await asyncio.open_connection("127.0.0.1", port)  # not one byte
            fine = await asyncio.open_connection("127.0.0.1", port)
            assert await request(*fine, b"12345") == b"5"
            for reader in (half_head[0], silent[0]):
                got = await answer(reader)
                assert got.startswith(b"HTTP/1.1 408"), got
                assert b"KERNELHUB_GATEWAY__HEADER_TIMEOUT" in got
            got = await answer(slow_body[0])
            assert got.startswith(b"HTTP/1.1 408") and b"BODY_TIMEOUT" in got, got
            for _, writer in (half_head, slow_body, silent, fine):
                writer.close()

    on_loop(loop, body)


@pytest.mark.parametrize(("parser", "loop"), COMBOS)
def test_a_kept_alive_connection_idles_between_requests_but_its_next_head_is_timed(
    parser: str, loop: str
) -> None:
    async def body() -> None:
        async with served(parser) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await request(reader, writer, b"ab") == b"2"
            # Idle for several header timeouts: uvicorn's keep-alive (5 s) rules, not ours.
            await asyncio.sleep(4 * HEADER_TIMEOUT)
            # A body that trickles in, each byte within the body timeout, is fine.
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n")
            for byte in (b"x", b"y"):
                await asyncio.sleep(BODY_TIMEOUT / 3)
                writer.write(byte)
            writer.write(b"z")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN)
            assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(1) == b"3"
            writer.write(b"GET / HTTP/1.1\r\nHo")  # the next head stalls
            got = await answer(reader)
            assert got.startswith(b"HTTP/1.1 408") and b"HEADER_TIMEOUT" in got, got
            writer.close()

    on_loop(loop, body)


@pytest.mark.parametrize(("parser", "loop"), COMBOS)
def test_connections_past_the_limit_get_503_at_once(parser: str, loop: str) -> None:
    async def body() -> None:
        async with served(parser) as port:
            held = [
                await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)
            ]
            extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            for reader, _ in extra:
                got = await answer(reader)
                assert got.startswith(b"HTTP/1.1 503"), got
                assert b"KERNELHUB_GATEWAY__MAX_CONNECTIONS" in got and b"retry-after" in got
            for _, writer in held + extra:
                writer.close()
            await asyncio.sleep(0.05)  # the server sees them go
            again = await asyncio.open_connection("127.0.0.1", port)
            assert await request(*again, b"") == b"0"
            again[1].close()

    on_loop(loop, body)


@pytest.mark.parametrize(("parser", "loop"), COMBOS)
def test_a_head_over_16_kib_is_refused_with_400(parser: str, loop: str) -> None:
    async def body() -> None:
        async with served(parser) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # Unfinished past 16 KiB (h11 counts what it holds unparsed, httptools what it
            # parsed): refused as it arrives, not at the header timeout.
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
            got = await answer(reader)
            assert got.startswith(b"HTTP/1.1 400"), got[:200]
            writer.close()
            ok = await asyncio.open_connection("127.0.0.1", port)
            assert await request(*ok, b"x" * 20_000) == b"20000"  # a big body is no big head
            ok[1].close()

    on_loop(loop, body)


@pytest.mark.parametrize(("parser", "loop"), COMBOS)
def test_a_websocket_outlives_the_head_and_body_deadlines(parser: str, loop: str) -> None:
    async def body() -> None:
        async with served(parser) as port, connect(f"ws://127.0.0.1:{port}/") as ws:
            await asyncio.sleep(4 * max(HEADER_TIMEOUT, BODY_TIMEOUT))
            await ws.send("still here")
            assert await asyncio.wait_for(ws.recv(), ANSWER_WITHIN) == "still here"

    on_loop(loop, body)


def test_event_loop_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loop_factory("asyncio") is None
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    settings = load_settings()
    assert settings.gateway.event_loop == "auto" and settings.gateway.http_parser == "httptools"
    assert server_line(settings) == "event loop: uvloop; HTTP parser: httptools"
    monkeypatch.setenv("KERNELHUB_GATEWAY__EVENT_LOOP", "asyncio")
    monkeypatch.setenv("KERNELHUB_GATEWAY__HTTP_PARSER", "h11")
    assert server_line(load_settings()) == "event loop: asyncio; HTTP parser: h11"
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)  # not installed
    assert loop_factory("auto") is None
    with pytest.raises(ConfigError, match="KERNELHUB_GATEWAY__EVENT_LOOP"):
        loop_factory("uvloop")
