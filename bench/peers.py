"""The peers: Jupyter Kernel Gateway and Jupyter Server on the same workloads.

Both are optional (``pip install jupyter_kernel_gateway``, which brings Jupyter Server;
the ``bench`` extra has them) and never kernelhub dependencies. Each runs stock ipykernels
as host processes, without any sandbox, behind tornado on a loopback port; a kernel is
created over REST and driven over its ``/api/kernels/{id}/channels`` WebSocket (the
legacy JSON framing: no subprotocol asked for). Each is measured as shipped and with
TCP_NODELAY set on its sockets (``tornado_nodelay.py``): :data:`PEERS` names the four.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from floor import FIRST_PRINT_FLUSH
from gateway import free_port
from report import Unavailable
from websockets.asyncio.client import ClientConnection, connect

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PeerKind:
    key: str  # short, for runner names
    label: str  # for the table
    module: str  # run with ``python -m``
    nodelay: bool


PEERS = {
    p.key: p
    for p in (
        PeerKind("jkg", "Jupyter Kernel Gateway, as shipped", "kernel_gateway", False),
        PeerKind("jkg+nd", "Jupyter Kernel Gateway + TCP_NODELAY", "kernel_gateway", True),
        PeerKind("js", "Jupyter Server, as shipped", "jupyter_server", False),
        PeerKind("js+nd", "Jupyter Server + TCP_NODELAY", "jupyter_server", True),
    )
}


def check_installed(kind: PeerKind) -> None:
    """:class:`Unavailable` unless ``kind``'s module imports."""
    try:
        importlib.import_module(kind.module)
    except ImportError as exc:
        raise Unavailable("not installed (`pip install jupyter_kernel_gateway`)") from exc


class PeerKernel:
    """One kernel of a peer, on its own WebSocket; cells one at a time."""

    def __init__(self, conn: ClientConnection) -> None:
        self.conn = conn
        self.session = uuid.uuid4().hex

    def _message(self, msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "bench",
                  "session": self.session, "date": "", "version": "5.3"}  # fmt: skip
        return {"header": header, "parent_header": {}, "metadata": {}, "content": content,
                "channel": "shell", "buffers": []}  # fmt: skip

    async def request(
        self, msg_type: str, content: dict[str, Any], *, timeout: float = 60
    ) -> tuple[dict[str, Any], float | None]:
        """Send one request; its reply's content once iopub has said ``idle`` for it too
        (kernel_info and execute both end so), and seconds to its first stream message."""
        msg = self._message(msg_type, content)
        msg_id = msg["header"]["msg_id"]
        t0 = time.perf_counter()
        await self.conn.send(json.dumps(msg))
        reply: dict[str, Any] | None = None
        idle = False
        first = None
        async with asyncio.timeout(timeout):
            while reply is None or not idle:
                frame = json.loads(await self.conn.recv())
                if frame.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = frame["msg_type"]
                if frame["channel"] == "shell" and kind.endswith("_reply"):
                    reply = frame["content"]
                elif kind == "stream" and first is None:
                    first = time.perf_counter() - t0
                elif kind == "status":
                    idle = frame["content"]["execution_state"] == "idle"
        return reply, first

    async def roundtrip(self, code: str = "1+1") -> float:
        t0 = time.perf_counter()
        reply, _ = await self.request("execute_request", {"code": code, "silent": False})
        elapsed = time.perf_counter() - t0
        assert reply["status"] == "ok", reply
        return elapsed

    async def first_print(self) -> float:
        """Seconds to the first stream message of :data:`floor.FIRST_PRINT_FLUSH`."""
        _, first = await self.request("execute_request", {"code": FIRST_PRINT_FLUSH})
        assert first is not None
        return first


class Peer:
    """A peer server in a child process; :meth:`launch`, :meth:`kernel`, :meth:`stop`."""

    def __init__(self, kind: PeerKind, root: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root / f"peer-{kind.key.replace('+', '-')}-{uuid.uuid4().hex[:4]}"
        self.root.mkdir()
        self.log = self.root / "server.log"
        self.token = secrets.token_hex(16)
        self.headers = {"Authorization": f"token {self.token}"}
        self.proc: asyncio.subprocess.Process | None = None
        self.kernels: list[PeerKernel] = []

    @classmethod
    async def launch(cls, kind: PeerKind, root: Path, timeout: float = 120) -> Peer:
        check_installed(kind)
        peer = cls(kind, root)
        try:
            await peer._start(timeout)
        except BaseException:
            await peer.stop()
            raise
        return peer

    def _argv(self) -> list[str]:
        if self.kind.module == "kernel_gateway":
            app = "KernelGatewayApp"
            extra = []  # no auth token, as before: loopback only (it 403s a token header)
        else:
            app = "ServerApp"
            extra = [f"--IdentityProvider.token={self.token}", "--ServerApp.open_browser=False", "--ServerApp.allow_root=True",
                     f"--ServerApp.root_dir={self.root}"]  # fmt: skip
        args = [f"--{app}.ip=127.0.0.1", f"--{app}.port={self.port}",
                f"--{app}.port_retries=0", *extra]  # fmt: skip
        if self.kind.nodelay:
            return [sys.executable, str(HERE / "tornado_nodelay.py"), self.kind.module, *args]
        return [sys.executable, "-m", self.kind.module, *args]

    async def _start(self, timeout: float) -> None:
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
               "JUPYTER_CONFIG_DIR": str(self.root / "config"),
               "IPYTHONDIR": str(self.root / "ipython")}  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self._argv(), env=env, stdout=log, stderr=log, cwd=self.root
            )
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers) as http:
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"{self.kind.label} exited; see {self.log}")
                try:
                    if (await http.get("/api")).status_code == 200:  # JKG 403s listing kernels
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.kind.label} not up after {timeout} s; see {self.log}"
                    )
                await asyncio.sleep(0.05)

    async def kernel(self, timeout: float = 120) -> PeerKernel:
        """A new kernel on this server, connected and answering ``kernel_info``."""
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=timeout
        ) as http:
            r = await http.post("/api/kernels", json={"name": "python3"})
            r.raise_for_status()
            kernel_id = r.json()["id"]
        conn = await connect(
            f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels",
            additional_headers=self.headers, max_size=2**26, open_timeout=timeout,
        )  # fmt: skip
        kernel = PeerKernel(conn)
        self.kernels.append(kernel)
        await kernel.request("kernel_info_request", {}, timeout=timeout)
        return kernel

    async def stop(self) -> None:
        for kernel in self.kernels:
            await kernel.conn.close()
        self.kernels.clear()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()  # it shuts its kernels down on the way out
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
