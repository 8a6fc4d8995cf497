"""Jupyter Kernel Gateway on the same workload, where it is installed (it is optional:
``pip install jupyter_kernel_gateway``; never a kernelhub dependency).

It runs stock ipykernels as host processes, without any sandbox: the number to beat for
a gateway in front of Jupyter kernels. Started on a loopback port; one kernel created over
REST and driven over its ``/api/kernels/{id}/channels`` WebSocket (the legacy JSON
framing: no subprotocol asked for).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from gateway import free_port
from report import Unavailable
from websockets.asyncio.client import ClientConnection, connect


def check_installed() -> None:
    """:class:`Unavailable` unless ``import kernel_gateway`` works."""
    try:
        importlib.import_module("kernel_gateway")
    except ImportError as exc:
        raise Unavailable("not installed (`pip install jupyter_kernel_gateway`)") from exc


class KernelGateway:
    """``jupyter kernelgateway`` in a child process; :meth:`launch`, then :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.log = root / "kernel-gateway.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.session = uuid.uuid4().hex
        self.kernel_id: str | None = None
        self.conn: ClientConnection | None = None

    @classmethod
    async def launch(cls, root: Path, timeout: float = 60) -> KernelGateway:
        check_installed()
        kg = cls(root)
        try:
            await kg._start(timeout)
        except BaseException:
            await kg.stop()
            raise
        return kg

    async def _start(self, timeout: float) -> None:
        env = {
            **os.environ,
            "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
            "IPYTHONDIR": str(self.root / "ipython"),
        }
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kernel_gateway",
                "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={self.port}",
                "--KernelGatewayApp.port_retries=0",
                env=env, stdout=log, stderr=log, cwd=self.root,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(
                        f"kernel gateway exited with {self.proc.returncode}; see {self.log}"
                    )
                try:
                    if (await http.get("/api")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kernel gateway not up after {timeout} s; see {self.log}")
                await asyncio.sleep(0.05)
            r = await http.post("/api/kernels", json={"name": "python3"})
            r.raise_for_status()
            self.kernel_id = r.json()["id"]
        self.conn = await connect(
            f"ws://127.0.0.1:{self.port}/api/kernels/{self.kernel_id}/channels", max_size=2**26
        )
        await self._request("kernel_info_request", {}, "shell", timeout=timeout)

    def _message(self, msg_type: str, content: dict[str, Any], channel: str) -> dict[str, Any]:
        return {
            "header": {
                "msg_id": uuid.uuid4().hex,
                "msg_type": msg_type,
                "username": "bench",
                "session": self.session,
                "date": "",
                "version": "5.3",
            },
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": channel,
            "buffers": [],
        }

    async def _request(
        self, msg_type: str, content: dict[str, Any], channel: str, timeout: float = 10
    ) -> dict[str, Any]:
        """Send one request; return its reply's content once iopub has said ``idle`` for
        it too (kernel_info and execute both end so)."""
        assert self.conn is not None
        msg = self._message(msg_type, content, channel)
        msg_id = msg["header"]["msg_id"]
        await self.conn.send(json.dumps(msg))
        reply: dict[str, Any] | None = None
        idle = False
        async with asyncio.timeout(timeout):
            while reply is None or not idle:
                frame = json.loads(await self.conn.recv())
                if frame.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                if frame["channel"] == "shell" and frame["msg_type"].endswith("_reply"):
                    reply = frame["content"]
                elif frame["msg_type"] == "status":
                    idle = frame["content"]["execution_state"] == "idle"
        return reply

    async def roundtrip(self, code: str = "1+1") -> float:
        t0 = time.perf_counter()
        reply = await self._request("execute_request", {"code": code, "silent": False}, "shell")
        elapsed = time.perf_counter() - t0
        assert reply["status"] == "ok", reply
        return elapsed

    async def stop(self) -> None:
        if self.conn is not None:
            await self.conn.close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()  # it shuts its kernels down on the way out
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
