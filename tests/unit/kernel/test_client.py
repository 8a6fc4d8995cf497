"""The host's side of a kernel's sockets against a fake kernel made of real ZeroMQ
sockets: what reaches the kernel, what comes back, and what a hostile kernel cannot do."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
from jupyter_client.session import Session

from kernelhub.errors import KernelMessageError
from kernelhub.execution.collector import OVERSIZED_KEY, WIRE_BYTES_KEY
from kernelhub.kernel.client import (
    MAX_FRAME_BYTES,
    MAX_MESSAGE_BYTES,
    KernelClient,
    watch_disconnects,
)
from tests.conftest import UNIT

KEY = b"k" * 32
MiB = 2**20


class FakeKernel:
    """ROUTERs for shell, control, stdin and a PUB for iopub, bound where a kernel binds."""

    def __init__(self, root: Path) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.session = Session(key=KEY)
        self.paths = {name: root / name for name in ("shell", "control", "stdin", "iopub")}
        self.sockets = {
            name: self.context.socket(zmq.PUB if name == "iopub" else zmq.ROUTER)
            for name in self.paths
        }
        for name, path in self.paths.items():
            self.sockets[name].bind(f"ipc://{path}")

    def fds(self) -> dict[str, int]:
        return {name: os.open(path, os.O_PATH) for name, path in self.paths.items()}

    def request(self, channel: str) -> tuple[bytes, dict[str, object]]:
        """The next request on ``channel``: the peer's identity and the message."""
        frames = self.sockets[channel].recv_multipart()
        return frames[0], self.session.deserialize(frames[2:])

    def send(self, channel: str, to: bytes, frames: list[bytes]) -> None:
        self.sockets[channel].send_multipart([to, *frames])

    def reply_frames(self, parent: dict[str, object], **content: object) -> list[bytes]:
        msg = self.session.msg("execute_reply", content, parent=parent["header"])
        return self.session.serialize(msg)

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[FakeKernel, KernelClient]]:
    kernel = FakeKernel(tmp_path)
    client = KernelClient(kernel.fds(), KEY)
    yield kernel, client
    client.close()
    kernel.close()


async def test_requests_arrive_signed_and_answers_come_back(
    pair: tuple[FakeKernel, KernelClient],
) -> None:
    kernel, client = pair
    msg_id = client.execute("1+1", silent=True, user_expressions={"a": "1"})
    peer, request = await asyncio.to_thread(kernel.request, "shell")
    assert request["header"]["msg_id"] == msg_id
    assert request["content"] == {
        "code": "1+1", "silent": True, "store_history": True, "user_expressions": {"a": "1"},
        "allow_stdin": True, "stop_on_error": True,
    }  # fmt: skip
    # stdin answers are routed to the peer that sent the cell: the same identity.
    client.input("ada")
    stdin_peer, answer = await asyncio.to_thread(kernel.request, "stdin")
    assert stdin_peer == peer and answer["content"] == {"value": "ada"}
    kernel.send("shell", peer, kernel.reply_frames(request, status="ok"))
    got = await asyncio.wait_for(client.receivers["shell"].recv(), 10 * UNIT)
    assert got["parent_header"]["msg_id"] == msg_id and got["content"] == {"status": "ok"}
    assert got[WIRE_BYTES_KEY] > 0


async def test_forged_large_and_oversized_messages(pair: tuple[FakeKernel, KernelClient]) -> None:
    kernel, client = pair
    client.execute("x")
    peer, request = await asyncio.to_thread(kernel.request, "shell")
    shell = client.receivers["shell"]
    forged = kernel.reply_frames(request, status="ok")
    forged[-1] = b'{"status": "error"}'
    kernel.send("shell", peer, forged)
    with pytest.raises(KernelMessageError, match="invalid signature"):
        await asyncio.wait_for(shell.recv(), 10 * UNIT)
    # Over a MiB: verified in a worker thread, same answer.
    kernel.send("shell", peer, kernel.reply_frames(request, text="y" * (2 * MiB)))
    big = await asyncio.wait_for(shell.recv(), 10 * UNIT)
    assert len(big["content"]["text"]) == 2 * MiB
    # Over the message limit in frames each under the frame limit: drained and named.
    frames = kernel.reply_frames(request, status="ok") + [b"z" * (4 * MiB)] * 3
    kernel.send("shell", peer, frames)
    named = await asyncio.wait_for(shell.recv(), 10 * UNIT)
    assert named[OVERSIZED_KEY] > MAX_MESSAGE_BYTES
    assert named["parent_header"]["msg_id"] == request["header"]["msg_id"]


async def subscribed(kernel: FakeKernel, client: KernelClient) -> dict[str, object]:
    """Publish a status until one arrives (a subscription takes a moment to reach the
    publisher), and return it."""
    status = kernel.session.msg("status", {"execution_state": "idle"})
    while True:
        kernel.sockets["iopub"].send_multipart(kernel.session.serialize(status, ident=b"status"))
        try:
            return await asyncio.wait_for(client.receivers["iopub"].recv(), 0.05 * UNIT)
        except TimeoutError:
            continue


async def test_iopub_receives_everything_published(pair: tuple[FakeKernel, KernelClient]) -> None:
    kernel, client = pair
    got = await subscribed(kernel, client)
    assert got["msg_type"] == "status" and got["content"] == {"execution_state": "idle"}


async def test_a_frame_over_the_limit_drops_the_connection_and_reset_restores_it(
    pair: tuple[FakeKernel, KernelClient],
) -> None:
    kernel, client = pair
    iopub = client.receivers["iopub"]
    await subscribed(kernel, client)
    dropped = asyncio.Event()
    watch = asyncio.create_task(watch_disconnects(iopub.socket, dropped.set))
    await asyncio.sleep(0)  # the watch is listening from here on
    try:
        kernel.sockets["iopub"].send_multipart([b"t", b"z" * (MAX_FRAME_BYTES + 1)])
        await asyncio.wait_for(dropped.wait(), 10 * UNIT)
        iopub.reset()
        got = await subscribed(kernel, client)
        assert got["msg_type"] == "status"
    finally:
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch


async def test_close_releases_the_descriptors(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    fds = kernel.fds()
    client = KernelClient(fds, KEY)
    client.close()
    kernel.close()
    for fd in fds.values():
        with pytest.raises(OSError):
            os.fstat(fd)


async def test_clients_share_one_context_past_the_default_socket_limit(tmp_path: Path) -> None:
    """Every client uses the process's one zmq context (one I/O thread for all kernels),
    which holds more than libzmq's default 1023 sockets, and closing a client closes its
    sockets only: the others keep working."""
    kernel = FakeKernel(tmp_path)
    clients: list[KernelClient] = []
    try:
        # 4 sockets a client: 260 clients are 1040 sockets in one context.
        for _ in range(260):
            clients.append(KernelClient(kernel.fds(), KEY))
        assert len({id(c.context) for c in clients}) == 1
        for c in clients[:-1]:
            c.close()
        last = clients[-1]
        msg_id = last.execute("1+1")
        peer, request = await asyncio.to_thread(kernel.request, "shell")
        assert request["header"]["msg_id"] == msg_id
        kernel.send("shell", peer, kernel.reply_frames(request, status="ok"))
        got = await asyncio.wait_for(last.receivers["shell"].recv(), 10 * UNIT)
        assert got["parent_header"]["msg_id"] == msg_id
        # A client made after others closed still gets the same, working context.
        again = KernelClient(kernel.fds(), KEY)
        clients.append(again)
        assert again.context is last.context
    finally:
        for c in clients:
            c.close()
        kernel.close()
