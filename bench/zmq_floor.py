"""The raw floor: a stock ipykernel driven over ipc by a minimal client on plain pyzmq.

jupyter_client's asyncio channels cost a future per message and decode every message with
``adapt`` and dates; this client does only what the protocol needs: JSON, HMAC-SHA256 over
the frames, one DEALER for shell and one SUB for iopub. What is left of a round trip is
the kernel and ZeroMQ: the lowest a gateway in front of ipykernel could go.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

DELIM = b"<IDS|MSG>"


class ZmqFloor:
    """Its own stock ipykernel, started by jupyter_client, then spoken to directly."""

    def __init__(self, km: AsyncKernelManager) -> None:
        self.km = km
        info = km.get_connection_info()
        key = info["key"]
        self.key = key.encode() if isinstance(key, str) else key
        self.ctx = zmq.asyncio.Context()
        self.shell = self.ctx.socket(zmq.DEALER)
        self.shell.connect(f"ipc://{info['ip']}-{info['shell_port']}")
        self.iopub = self.ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"ipc://{info['ip']}-{info['iopub_port']}")
        self.session = uuid.uuid4().hex
        self.poller = zmq.asyncio.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)

    @classmethod
    async def start(cls, root: Path) -> ZmqFloor:
        km = AsyncKernelManager(transport="ipc", kernel_name="python3")
        km.ip = str(root / f"zfloor-{uuid.uuid4().hex[:6]}")
        await km.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
        floor = cls(km)
        # iopub is a SUB socket: it misses what was sent before it joined, so ask until a
        # reply and its idle both arrive.
        for _ in range(600):
            try:
                await floor.request("kernel_info_request", {}, timeout=0.5)
                break
            except TimeoutError:
                continue
        return floor

    def _sign(self, frames: list[bytes]) -> bytes:
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(frame)
        return mac.hexdigest().encode()

    def _decode(self, frames: list[bytes]) -> tuple[str, str, dict[str, Any]]:
        """(msg_type, parent msg_id, content) of a signed message; ValueError if forged."""
        parts = frames[frames.index(DELIM) + 1 :]
        signature, body = parts[0], parts[1:5]
        if not hmac.compare_digest(signature, self._sign(body)):
            raise ValueError("bad signature")
        header, parent = json.loads(body[0]), json.loads(body[1])
        return header["msg_type"], parent.get("msg_id", ""), json.loads(body[3])

    async def request(
        self, msg_type: str, content: dict[str, Any], *, timeout: float = 10
    ) -> dict[str, Any]:
        """Send one shell request; its reply's content once iopub has also said ``idle``."""
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "bench",
                  "session": self.session, "date": "", "version": "5.3"}  # fmt: skip
        body = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        await self.shell.send_multipart([DELIM, self._sign(body), *body])
        reply: dict[str, Any] | None = None
        idle = False
        deadline = time.monotonic() + timeout
        while reply is None or not idle:
            remaining = deadline - time.monotonic()
            ready = dict(await self.poller.poll(max(0.0, remaining) * 1000))
            if not ready:
                raise TimeoutError(f"no {msg_type} reply within {timeout} s")
            if self.shell in ready:
                kind, parent, got = self._decode(await self.shell.recv_multipart())
                if parent == msg_id:
                    reply = got
            if self.iopub in ready:
                kind, parent, got = self._decode(await self.iopub.recv_multipart())
                if parent == msg_id and kind == "status":
                    idle = got["execution_state"] == "idle"
        return reply

    async def roundtrip(self, code: str = "1+1") -> float:
        t0 = time.perf_counter()
        reply = await self.request("execute_request", {"code": code, "silent": False})
        elapsed = time.perf_counter() - t0
        assert reply["status"] == "ok", reply
        return elapsed

    async def stop(self) -> None:
        self.shell.close(linger=0)
        self.iopub.close(linger=0)
        self.ctx.term()
        await self.km.shutdown_kernel(now=True)
