"""A local stand-in kernel that relays to a gateway's channels WebSocket.

jupyter_client only speaks ZeroMQ to a kernel it can reach; a kernelhub session's kernel
lives in a sandbox behind the gateway. This process is what a kernel manager launches in
its place (``python -m kernelhub.jupyter.bridge -f CONNECTION_FILE``): it binds the five
sockets of the connection file on this host, checks and signs messages with its key, and
passes each one to ``/api/kernels/{id}/channels`` and back, so jupyter_client, nbclient
and ``jupyter console`` work unchanged. The kernel to relay to, the gateway and the token
come from the environment (``KERNELHUB_URL``, ``KERNELHUB_TOKEN``, ``KERNELHUB_KERNEL_ID``),
which :mod:`kernelhub.jupyter.provisioner` sets; the token never appears on a command line.

The bridge owns nothing: a ``shutdown_request`` is passed on (the gateway restarts the
kernel, or does nothing) and then the bridge exits; deleting the session is the kernel
manager's decision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

import websockets
import zmq
import zmq.asyncio
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session

log = logging.getLogger("kernelhub.jupyter.bridge")
_ROUTED = ("shell", "control", "stdin")
# A client's iopub SUB and its shell DEALER connect to us independently (each retries
# every 100 ms until we are bound), so a request can arrive before its sender listens on
# iopub: its busy/idle would be published to nobody, and jupyter console waits for that
# idle forever (#21). Requests wait for the first subscriber, at most this long (a client
# that never subscribes is served after it, once).
IOPUB_WAIT = 10.0


def ws_url(gateway_url: str, kernel_id: str) -> str:
    base = gateway_url.rstrip("/")
    base = "ws" + base[4:] if base.startswith("http") else base
    return f"{base}/api/kernels/{kernel_id}/channels"


class Bridge:
    def __init__(self, connection: dict[str, Any], url: str, token: str, kernel_id: str) -> None:
        self.connection = connection
        self.url = ws_url(url, kernel_id)
        self.token = token
        self.kernel_id = kernel_id
        self.session = Session(
            key=str(connection.get("key", "")).encode(),
            signature_scheme=connection.get("signature_scheme", "hmac-sha256"),
        )
        self.ctx = zmq.asyncio.Context()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        # msg_id of a request -> the ZeroMQ identities of the client that sent it
        self.senders: dict[str, list[bytes]] = {}
        self.done = asyncio.Event()
        self.listened = asyncio.Event()  # iopub has had a subscriber (or we stopped waiting)

    def _address(self, port_name: str) -> str:
        c = self.connection
        if c.get("transport", "tcp") == "ipc":
            return f"ipc://{c['ip']}-{c[port_name]}"
        return f"tcp://{c['ip']}:{c[port_name]}"

    def bind(self) -> None:
        kinds = {
            "shell": zmq.ROUTER,
            "control": zmq.ROUTER,
            "stdin": zmq.ROUTER,
            "iopub": zmq.XPUB,
            "hb": zmq.REP,
        }
        for name, kind in kinds.items():
            sock = self.ctx.socket(kind)
            sock.linger = 0
            if kind == zmq.XPUB:
                sock.setsockopt(
                    zmq.XPUB_VERBOSE, 1
                )  # every subscriber's subscription, not new topics
            sock.bind(self._address(f"{name}_port"))
            self.sockets[name] = sock

    async def run(self) -> int:
        self.bind()
        headers = {"Authorization": f"token {self.token}"}
        async with websockets.connect(
            self.url, additional_headers=headers, max_size=None, compression=None
        ) as ws:
            tasks = [asyncio.create_task(self._from_clients(ws, name)) for name in _ROUTED]
            tasks.append(asyncio.create_task(self._heartbeat()))
            tasks.append(asyncio.create_task(self._subscriptions()))
            tasks.append(asyncio.create_task(self._from_gateway(ws)))
            waiter = asyncio.create_task(self.done.wait())
            await asyncio.wait([waiter, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
            for task in [*tasks, waiter]:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self.ctx.destroy(linger=100)
        return 0 if self.done.is_set() else 1

    async def _heartbeat(self) -> None:
        sock = self.sockets["hb"]
        while True:
            await sock.send_multipart(await sock.recv_multipart())

    async def _subscriptions(self) -> None:
        """Greets each iopub subscriber as ipykernel does (an ``iopub_welcome``, JEP 65:
        a client that sees it knows it will see what follows) and opens the gate for
        requests at the first."""
        sock = self.sockets["iopub"]
        while True:
            (event, *_) = await sock.recv_multipart()
            if not event or event[0] != 1:
                continue  # an unsubscription
            topic = event[1:]
            welcome = self.session.msg(
                "iopub_welcome", {"subscription": topic.decode(errors="replace")}
            )
            self.session.send(sock, welcome, ident=topic or None)
            self.listened.set()

    async def _until_listened(self, channel: str) -> None:
        if self.listened.is_set():
            return
        try:
            await asyncio.wait_for(self.listened.wait(), IOPUB_WAIT)
        except TimeoutError:
            log.warning(
                "no iopub subscriber after %.0f s; passing %s requests on", IOPUB_WAIT, channel
            )
            self.listened.set()

    async def _from_clients(self, ws: Any, channel: str) -> None:
        sock = self.sockets[channel]
        while True:
            parts = await sock.recv_multipart(copy=True)
            try:
                idents, frames = self.session.feed_identities(parts)
                msg = self.session.deserialize(frames, content=True)
            except Exception as exc:  # a bad signature or a malformed message: drop it
                log.warning("dropped a message on %s: %s", channel, exc)
                continue
            await self._until_listened(channel)
            self.senders[msg["header"]["msg_id"]] = list(idents)
            out = {
                "channel": channel,
                "header": msg["header"],
                "parent_header": msg["parent_header"],
                "metadata": msg["metadata"],
                "content": msg["content"],
                "buffers": [],
            }
            await ws.send(json.dumps(out, default=json_default))

    async def _from_gateway(self, ws: Any) -> None:
        async for frame in ws:
            msg = json.loads(frame)
            channel = msg.pop("channel", "iopub")
            msg.pop("buffers", None)
            parent_id = (msg.get("parent_header") or {}).get("msg_id", "")
            kind = msg["header"]["msg_type"]
            if channel == "iopub":
                topic = f"kernel.{self.kernel_id}.{kind}".encode()
                self.session.send(self.sockets["iopub"], msg, ident=topic)
                continue
            idents = self.senders.get(parent_id)
            if idents is None:
                log.info("no client waits for %s (parent %s)", kind, parent_id)
                continue
            self.session.send(self.sockets[channel], msg, ident=idents)
            if channel != "stdin":
                self.senders.pop(parent_id, None)
            if kind == "shutdown_reply":
                self.done.set()
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelhub.jupyter.bridge")
    parser.add_argument("-f", "--connection-file", required=True)
    # Kernel options (nbclient passes --HistoryManager.hist_file=...) are the sandboxed
    # kernel's business, not the relay's: ignored.
    args, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="kernelhub bridge: %(message)s")
    missing = [
        v
        for v in ("KERNELHUB_URL", "KERNELHUB_TOKEN", "KERNELHUB_KERNEL_ID")
        if not os.environ.get(v)
    ]
    if missing:
        print(
            f"kernelhub bridge: set {', '.join(missing)} (the kernel manager or provisioner does)",
            file=sys.stderr,
        )
        return 2
    with open(args.connection_file) as f:
        connection = json.load(f)
    # Interrupts arrive as interrupt_request messages (interrupt_mode "message"); a
    # terminal's Ctrl-C must not end the relay.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bridge = Bridge(
        connection,
        os.environ["KERNELHUB_URL"],
        os.environ["KERNELHUB_TOKEN"],
        os.environ["KERNELHUB_KERNEL_ID"],
    )
    return asyncio.run(bridge.run())


if __name__ == "__main__":
    sys.exit(main())
