"""The floors kernelhub is measured against, each run beside it in the same process.

- :class:`FloorKernel`: a stock ipykernel on the host, driven by plain jupyter_client over
  ipc (``execute``, then wait for the reply and for ``idle``): the floor for exec round
  trips, first output (the cell prints with ``flush=True``), concurrency and output (as
  many of them as sessions) and memory per idle kernel.
- :func:`bare_container_exit`: ``docker run`` of the kernel image with kernelhub's exact
  hardening (``container_config``), running ``python -c pass`` to its exit: the floor
  for a cold start.
- :func:`bare_container_kernel`: the same container running stock ipykernel, until it
  answers ``kernel_info``: what a cold start costs without kernelhub on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

import docker
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

from kernelhub.image import CONNECTION_FILE, IPC_DIR, KERNEL_PYTHON, SANDBOX_GID, SANDBOX_UID
from kernelhub.kernel.connection import SOCKET_PREFIX, SessionDir
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker_config import container_config
from kernelhub.sandbox.seccomp import profile_json

# The cell keeps running after the print, as real cells do: the print must not wait for
# the end of the cell (stock ipykernel flushes every 0.2 s).
FIRST_PRINT = "print('x'); import time; time.sleep(0.3)"
# The floor's cell: a stock ipykernel sends stdout every 0.2 s unless the cell flushes;
# that timer is ipykernel's choice, not a cost of getting a print to a client.
FIRST_PRINT_FLUSH = "print('x', flush=True); import time; time.sleep(0.3)"
START_TIMEOUT = 120.0  # seconds for a bare container's stock ipykernel to answer


async def await_reply(kc: Any, msg_id: str, timeout: float = 60) -> dict[str, Any]:
    """The content of the ``execute_reply`` to ``msg_id``, returned once iopub has also
    said ``idle`` for it (a cell is done only then)."""
    reply: dict[str, Any] | None = None
    idle = False
    while reply is None or not idle:
        if reply is None:
            msg = await kc.get_shell_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg["content"]
        if not idle:
            msg = await kc.get_iopub_msg(timeout=timeout)
            idle = (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            )
    return reply


class FloorKernel:
    """A stock ipykernel on the host over ipc, driven by plain jupyter_client."""

    def __init__(self, km: AsyncKernelManager, kc: Any) -> None:
        self.km, self.kc = km, kc

    @classmethod
    async def start(cls, root: Path) -> FloorKernel:
        """``root``: a short directory for the ipc sockets."""
        km = AsyncKernelManager(transport="ipc", kernel_name="python3")
        km.ip = str(root / f"floor-{uuid.uuid4().hex[:6]}")
        await km.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=60)
        return cls(km, kc)

    @property
    def pid(self) -> int:
        provisioner: Any = self.km.provisioner
        return int(provisioner.pid)

    async def roundtrip(self, code: str = "1+1") -> float:
        t0 = time.perf_counter()
        reply = await await_reply(self.kc, self.kc.execute(code), timeout=10)
        elapsed = time.perf_counter() - t0
        assert reply["status"] == "ok", reply
        return elapsed

    async def first_print(self) -> float:
        """Seconds from ``execute`` of :data:`FIRST_PRINT_FLUSH` to its first stream message."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(FIRST_PRINT_FLUSH)
        first = None
        while True:
            msg = await self.kc.get_iopub_msg(timeout=10)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream" and first is None:
                first = time.perf_counter() - t0
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        await self.kc.get_shell_msg(timeout=10)
        assert first is not None
        return first

    async def stop(self) -> None:
        self.kc.stop_channels()
        await self.km.shutdown_kernel(now=True)


class BareContainers:
    """Makes hardened containers exactly as the docker backend would, minus kernelhub."""

    def __init__(
        self, client: docker.DockerClient, *, image: str, runtime: str, run_dir: Path, instance: str
    ) -> None:
        self.client, self.image, self.runtime = client, image, runtime
        self.run_dir, self.instance = run_dir / instance, instance
        self._seccomp = profile_json()

    def _config(self, command: list[str]) -> tuple[dict[str, Any], SessionDir]:
        spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="bench")
        sdir = SessionDir.create(
            self.run_dir / spec.session_id,
            sandbox_uid=SANDBOX_UID,
            sandbox_gid=SANDBOX_GID,
            labels=spec.labels(self.instance),
            kernel_ipc_prefix=f"{IPC_DIR}/{SOCKET_PREFIX}",
        )
        config = container_config(
            spec, image=self.image, runtime=self.runtime, session_dir=sdir,
            instance=self.instance, seccomp_profile=self._seccomp,
        )  # fmt: skip
        config["command"] = command
        return config, sdir

    def exit_time(self) -> float:
        """Seconds from create to exit of ``python -c pass`` (blocking: run it in a thread)."""
        config, sdir = self._config([KERNEL_PYTHON, "-c", "pass"])
        try:
            t0 = time.perf_counter()
            container = self.client.containers.run(**config)
            status = container.wait()
            elapsed = time.perf_counter() - t0
            container.remove(force=True)
        finally:
            sdir.remove()
        assert status["StatusCode"] == 0, status
        return elapsed

    def stock_kernel_config(self) -> tuple[dict[str, Any], SessionDir]:
        """A container running stock ipykernel (no kernelhub in it), and its session
        directory (connection info for jupyter_client): kernelhub's hardening, minus
        kernelhub."""
        return self._config(
            [KERNEL_PYTHON, "-m", "ipykernel_launcher", "-f", CONNECTION_FILE,
             "--HistoryManager.enabled=False"]
        )  # fmt: skip

    async def kernel_time(self) -> float:
        """Seconds from create to stock ipykernel answering ``kernel_info``, driven by plain
        jupyter_client with the same fast handshake the engine uses."""
        config, sdir = self.stock_kernel_config()
        container = None
        kc = AsyncKernelClient()
        try:
            t0 = time.perf_counter()
            container = await asyncio.to_thread(self.client.containers.run, **config)
            kc.load_connection_info(sdir.host_connection_info())  # type: ignore[arg-type]
            while not sdir.sockets_present():
                await asyncio.sleep(0.005)
            kc.start_channels()
            # jupyter_client's wait_for_ready polls slower than the engine. A reply to any
            # request counts: under load the first answer comes after the next request is
            # sent, and waiting for the latest one's reply then kept the loop one reply
            # behind for ever (the suite hung here at load 20).
            sent: set[str] = set()
            deadline = t0 + START_TIMEOUT
            while time.perf_counter() < deadline:
                sent.add(kc.kernel_info())
                with contextlib.suppress(Exception):
                    reply = await kc.get_shell_msg(timeout=0.5)
                    if reply["parent_header"].get("msg_id") in sent:
                        return time.perf_counter() - t0
            raise RuntimeError(
                f"stock ipykernel in a bare container did not answer kernel_info in"
                f" {START_TIMEOUT:g} s"
            )
        finally:
            kc.stop_channels()
            if container is not None:
                await asyncio.to_thread(container.remove, force=True)
            sdir.remove()
