"""The local stand-in kernel (kernelhub/jupyter/bridge.py) relaying real ZeroMQ clients
to a real WebSocket server on loopback that plays the gateway's channels endpoint:
requests go out signed-checked as JSON with their channel, replies come back to the
client that asked, iopub carries kernel topics, a forged message is dropped, heartbeats
echo, and a shutdown_reply ends the relay."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from kernelhub.jupyter.bridge import Bridge, main, ws_url
from tests.conftest import UNIT

KEY = "a-test-key"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8765", "ws://127.0.0.1:8765/api/kernels/k1/channels"),
        ("https://hub.example/", "wss://hub.example/api/kernels/k1/channels"),
        ("ws://h:1/", "ws://h:1/api/kernels/k1/channels"),
    ],
)
def test_ws_url(url: str, expected: str) -> None:
    assert ws_url(url, "k1") == expected


def test_addresses_follow_the_connection_files_transport() -> None:
    tcp = Bridge({"ip": "127.0.0.1", "shell_port": 5}, "http://h", "t", "k")
    ipc = Bridge({"transport": "ipc", "ip": "/tmp/kh", "shell_port": 5}, "http://h", "t", "k")
    try:
        assert tcp._address("shell_port") == "tcp://127.0.0.1:5"
        assert ipc._address("shell_port") == "ipc:///tmp/kh-5"
    finally:
        tcp.ctx.destroy()
        ipc.ctx.destroy()


def test_main_without_its_environment_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("KERNELHUB_URL", "KERNELHUB_TOKEN", "KERNELHUB_KERNEL_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KERNELHUB_URL", "http://127.0.0.1:1")
    assert main(["-f", str(tmp_path / "none.json"), "--HistoryManager.hist_file=:memory:"]) == 2
    err = capsys.readouterr().err
    assert "KERNELHUB_TOKEN, KERNELHUB_KERNEL_ID" in err and "KERNELHUB_URL" not in err


class Gateway:
    """The channels endpoint: records frames, answers execute and shutdown requests."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.server: Any = None

    async def handler(self, ws: Any) -> None:
        self.auth.append(ws.request.headers.get("Authorization"))
        async for raw in ws:
            msg = json.loads(raw)
            self.frames.append(msg)
            parent = msg["header"]
            kind = parent["msg_type"]

            def reply(
                channel: str, msg_type: str, content: dict[str, Any], parent: Any = parent
            ) -> str:
                header = {**parent, "msg_id": f"r-{len(self.frames)}-{msg_type}"}
                header["msg_type"] = msg_type
                frame = {"channel": channel, "header": header, "parent_header": parent}
                return json.dumps({**frame, "metadata": {}, "content": content, "buffers": []})

            if kind == "execute_request":
                await ws.send(reply("iopub", "status", {"execution_state": "busy"}))
                await ws.send(reply("shell", "execute_reply", {"status": "ok"}))
                await ws.send(reply("shell", "execute_reply", {"status": "duplicate"}))
            elif kind == "shutdown_request":
                await ws.send(reply("control", "shutdown_reply", {"restart": False}))


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[tuple[Gateway, Bridge, asyncio.Task[int], dict]]:
    gateway = Gateway()
    server = await websockets.serve(gateway.handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ports = ("shell_port", "control_port", "stdin_port", "iopub_port", "hb_port")
    connection = {
        "transport": "ipc", "ip": str(tmp_path / "k"), "key": KEY,
        "signature_scheme": "hmac-sha256", **{p: i + 1 for i, p in enumerate(ports)},
    }  # fmt: skip
    bridge = Bridge(connection, f"http://127.0.0.1:{port}", "tok", "k1")
    task = asyncio.create_task(bridge.run())
    try:
        yield gateway, bridge, task, connection
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        bridge.ctx.destroy(linger=0)  # a cancelled run leaves it to the process's exit
        server.close()
        await server.wait_closed()


@pytest.fixture
def connect(relay: Any) -> Iterator[Callable[[int, str], zmq.asyncio.Socket]]:
    """Client sockets to the bridge's ports (an iopub SUB subscribes to everything)."""
    connection = relay[3]
    ctx = zmq.asyncio.Context()
    made: list[zmq.asyncio.Socket] = []

    def socket_to(kind: int, port: str) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        made.append(sock)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"ipc://{connection['ip']}-{connection[port]}")
        return sock

    yield socket_to
    for sock in made:
        sock.close(linger=0)
    ctx.term()


async def test_a_request_goes_out_and_its_reply_comes_back_to_its_sender(
    relay: Any, connect: Any
) -> None:
    gateway, bridge, _task, _ = relay
    session = Session(key=KEY.encode())
    sub = connect(zmq.SUB, "iopub_port")
    shell = connect(zmq.DEALER, "shell_port")
    async with asyncio.timeout(10 * UNIT):
        # The bridge greets each subscriber (JEP 65) before anything else.
        welcome = session.deserialize(session.feed_identities(await sub.recv_multipart())[1])
        assert welcome["header"]["msg_type"] == "iopub_welcome"

        forged = Session(key=b"not-the-key").msg("execute_request", {"code": "evil"})
        Session(key=b"not-the-key").send(shell, forged)
        request = session.msg("execute_request", {"code": "1 + 1"})
        session.send(shell, request)

        _, frames = session.feed_identities(await shell.recv_multipart())
        got = session.deserialize(frames)
        status_parts = await sub.recv_multipart()
    assert got["header"]["msg_type"] == "execute_reply" and got["content"]["status"] == "ok"
    assert got["parent_header"]["msg_id"] == request["header"]["msg_id"]
    assert status_parts[0] == b"kernel.k1.status"
    assert session.deserialize(session.feed_identities(status_parts)[1])["content"] == {
        "execution_state": "busy"
    }
    # Only the signed request reached the gateway, with its channel; the token went
    # in a header. The second reply to the same parent had no one left to go to.
    assert [f["content"] for f in gateway.frames] == [{"code": "1 + 1"}]
    assert gateway.frames[0]["channel"] == "shell" and gateway.auth == ["token tok"]
    assert bridge.senders == {}
    assert await _nothing_within(shell, 0.2)


async def test_heartbeats_echo_and_a_shutdown_reply_ends_the_relay(
    relay: Any, connect: Any
) -> None:
    gateway, _bridge, task, _ = relay
    session = Session(key=KEY.encode())
    hb = connect(zmq.REQ, "hb_port")
    sub = connect(zmq.SUB, "iopub_port")
    control = connect(zmq.DEALER, "control_port")
    async with asyncio.timeout(10 * UNIT):
        await hb.send(b"ping")
        assert await hb.recv() == b"ping"
        await sub.recv_multipart()  # the welcome: requests now pass
        session.send(control, session.msg("shutdown_request", {"restart": False}))
        reply = session.deserialize(session.feed_identities(await control.recv_multipart())[1])
        assert reply["header"]["msg_type"] == "shutdown_reply"
        assert await task == 0  # a clean end: the relay was told to stop
    assert [f["channel"] for f in gateway.frames] == ["control"]


async def _nothing_within(sock: zmq.asyncio.Socket, seconds: float) -> bool:
    return await sock.poll(int(seconds * 1000)) == 0
