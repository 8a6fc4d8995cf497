"""The engine's live connection to its kernel: connect, handshake, pumps, reconnects.

``KernelLink`` waits for the kernel's sockets, connects a :class:`KernelClient`, proves
the connection with ``kernel_info`` (on shell *and* iopub, so no output of the first
cell is lost), then runs one pump per channel that reads messages and hands them to
``on_message``, and one watch per channel that reconnects a socket libzmq dropped.
After a kernel restart it waits for the new kernel's socket files before connecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq

from kernelhub.config import EngineSettings
from kernelhub.errors import KernelDiedError, KernelError, SandboxStartError
from kernelhub.kernel.client import KernelClient, Receiver, connect_client, watch_disconnects
from kernelhub.kernel.connection import PORTS, SOCKET_PREFIX
from kernelhub.sandbox.base import Sandbox

log = logging.getLogger(__name__)

_POLL_INTERVAL = 0.005
# Longest a pump keeps the loop while messages keep arriving.
_PUMP_SLICE = 0.002
_PUMPED = ("iopub", "shell", "stdin")


class KernelLink:
    """Owns the client and its pumps. ``alive()`` says whether a dropped connection is
    still worth re-establishing; ``on_reset(channel)`` is told after it was."""

    def __init__(
        self,
        sandbox: Sandbox,
        engine: EngineSettings,
        *,
        on_message: Callable[[dict[str, Any]], None],
        on_reset: Callable[[str], None],
        alive: Callable[[], bool],
        room: Callable[[], Awaitable[None] | None] = lambda: None,
    ) -> None:
        self.sandbox = sandbox
        self.engine = engine
        self._on_message = on_message
        self._room = room
        self._on_reset = on_reset
        self._alive = alive
        self.client: KernelClient | None = None
        self.kernel_info: dict[str, Any] = {}
        self._pumps: list[asyncio.Task[None]] = []

    async def connect(self, *, timeout: float, starting: bool) -> None:
        """Wait for the kernel's sockets, check them, connect, and handshake.

        Our sockets never reconnect on their own (see ``kernel.client``), so a connection
        made to a socket file the kernel has not started listening on yet is dropped and
        retried here, re-checking the files each time.
        """
        deadline = time.monotonic() + timeout
        sdir = self.sandbox.session_dir
        while True:
            while not sdir.sockets_present():
                await self.check_not_dead(starting)
                if time.monotonic() > deadline:
                    raise SandboxStartError(
                        f"kernel did not open its sockets within {timeout:g} s; "
                        "raise KERNELHUB_ENGINE__START_TIMEOUT if the machine is slow",
                        log_tail=await self.sandbox.log_tail(),
                    )
                await asyncio.sleep(_POLL_INTERVAL)
            client = connect_client(sdir)
            try:
                ready = await self._handshake(
                    client, min(deadline, time.monotonic() + 2.0), starting
                )
            except BaseException:
                client.close()
                raise
            if ready:
                break
            client.close()
            if time.monotonic() > deadline:
                raise SandboxStartError(
                    f"kernel did not answer kernel_info within {timeout:g} s",
                    log_tail=await self.sandbox.log_tail(),
                )
        self.client = client
        self._pumps = []
        for name in _PUMPED:
            receiver = client.receivers[name]
            self._pumps.append(asyncio.create_task(self._pump(receiver), name=f"kernelhub-{name}"))
            reset = functools.partial(self._connection_reset, receiver, name)
            self._pumps.append(
                asyncio.create_task(
                    watch_disconnects(receiver.socket, reset), name=f"kernelhub-{name}-watch"
                )
            )

    async def check_not_dead(self, starting: bool) -> None:
        """Raise if the kernel has exited: ``SandboxStartError`` while ``starting``,
        ``KernelDiedError`` after."""
        wait = asyncio.ensure_future(self.sandbox.wait_exit())
        await asyncio.sleep(0)
        if not wait.done():
            wait.cancel()
            return
        info = wait.result()
        if starting:
            raise SandboxStartError(
                f"kernel exited while starting: {info.reason}",
                log_tail=await self.sandbox.log_tail(),
            )
        raise KernelDiedError(info.reason)

    async def _handshake(self, client: KernelClient, until: float, starting: bool) -> bool:
        """kernel_info until both shell answers and iopub carries the request's status
        (so the iopub subscription is live before the first cell: no lost output).
        False if the kernel did not answer by ``until``."""
        # Re-adopting, the kernel may be in the middle of a cell, and its shell answers
        # nothing until the cell ends; the control channel answers kernel_info at once.
        channel = "shell" if starting else "control"
        while time.monotonic() < until:
            await self.check_not_dead(starting)
            msg_id = client.send(channel, "kernel_info_request", {})
            left = min(1.0, until - time.monotonic())
            reply = await _read_reply(client.receivers[channel], msg_id, left)
            if reply is None:
                continue
            if await _read_reply(client.receivers["iopub"], msg_id, 0.5) is None:
                continue
            self.kernel_info = dict(reply.get("content") or {})
            return True
        return False

    async def _pump(self, receiver: Receiver) -> None:
        # A flood of ready messages never suspends ``recv`` (zmq answers at once), so the
        # pump gives the loop a turn every few ms: other sessions' cells and clients wait
        # no longer than that for it.
        turn = time.monotonic()
        while True:
            try:
                msg = await receiver.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # socket closed: we are reconnecting or shutting down
            except Exception as exc:
                # Bad signature, bad JSON, a replayed message: hostile or broken, never fatal.
                log.debug("dropped an invalid kernel message: %s", exc)
                continue
            self._on_message(msg)
            # Back-pressure: while what the kernel sent is still being serialized and
            # stored, read no more. The backlog stays in the sandbox (its own memory), not
            # in the gateway's, which relayed 50 MiB in ~50 MiB of RSS before.
            wait = self._room()
            if wait is not None:
                await wait
                turn = time.monotonic()
            elif time.monotonic() - turn > _PUMP_SLICE:
                await asyncio.sleep(0)
                turn = time.monotonic()

    def _connection_reset(self, receiver: Receiver, channel: str) -> None:
        """A kernel socket dropped its connection: most likely the kernel sent a frame over
        the size limit (libzmq then drops the peer for good). Reconnect to the same checked
        socket and tell the running cell, whose output and end may be partly lost."""
        if not self._alive():
            return
        try:
            receiver.reset()
        except zmq.ZMQError as exc:
            log.warning("cannot reconnect the kernel's %s socket: %s", channel, exc)
        log.warning(
            "session %s: the kernel's %s connection was reset",
            self.sandbox.spec.session_id,
            channel,
        )
        self._on_reset(channel)

    async def stop(self) -> None:
        """Cancel the pumps and close the client (idempotent)."""
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(BaseException):
                await task
        self._pumps = []
        if self.client is not None:
            self.client.close()
            self.client = None

    async def restart(self) -> None:
        """Restart the kernel process in its sandbox and connect to the new one."""
        before = self._socket_inodes()
        await self.stop()
        await self.sandbox.restart_kernel()
        deadline = time.monotonic() + self.engine.restart_grace
        # The new kernel re-binds every socket (new inodes); connecting earlier would
        # reach the dead kernel's files.
        while True:
            now = self._socket_inodes()
            if len(now) == len(PORTS) and not (set(now.values()) & set(before.values())):
                break
            if time.monotonic() > deadline:
                raise KernelError("restarted kernel did not bind its sockets")
            await self.check_not_dead(False)
            await asyncio.sleep(_POLL_INTERVAL)
        await self.connect(timeout=max(deadline - time.monotonic(), 1.0), starting=False)

    def _socket_inodes(self) -> dict[int, tuple[int, int]]:
        """Identity of each socket file; inode numbers alone are reused after unlink."""
        ipc = self.sandbox.session_dir.ipc_dir
        inodes = {}
        for port in PORTS.values():
            try:
                st = os.lstat(ipc / f"{SOCKET_PREFIX}-{port}")
                inodes[port] = (st.st_ino, st.st_ctime_ns)
            except OSError:
                pass
        return inodes


async def _read_reply(receiver: Receiver, msg_id: str, timeout: float) -> dict[str, Any] | None:
    """The first message on ``receiver`` answering ``msg_id`` within ``timeout``."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            msg = await asyncio.wait_for(receiver.recv(), left)
        except TimeoutError:
            return None
        except zmq.ZMQError:
            raise
        except Exception:  # a message that fails to verify
            continue
        if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
            return msg
    return None
