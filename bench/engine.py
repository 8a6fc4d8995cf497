"""Engine benchmark: kernelhub vs the floor, measured in one run on the same machine.

    python bench/engine.py [--rounds 200] [--starts 5] [--backend docker|local] [--out docs/bench-engine.md]

- exec round trip of ``1+1``: kernelhub's engine vs jupyter_client talking straight to a
  stock local ipykernel over ipc (the floor);
- first stream event after ``print('x')``: kernelhub vs the stock kernel;
- cold start (create → kernel ready): kernelhub vs a bare hardened container running the
  same image's kernel, driven by plain jupyter_client (docker backend only).

Machines here are shared and noisy, so every comparison is a ratio of runs interleaved in
the same process, and medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
from jupyter_client.manager import AsyncKernelManager

from kernelhub.config import load_settings
from kernelhub.execution.engine import KernelSession
from kernelhub.image import CONNECTION_FILE, IPC_DIR, KERNEL_PYTHON
from kernelhub.kernel.connection import SOCKET_PREFIX, SessionDir
from kernelhub.models import StreamEvent
from kernelhub.sandbox.backends import make_backend
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker_config import container_config
from kernelhub.sandbox.seccomp import profile_json

# The cell keeps running after the print, as real cells do: the print must not wait for
# the end of the cell (stock ipykernel flushes every 0.2 s).
FIRST_PRINT = "print('x'); import time; time.sleep(0.3)"
INSTANCE = f"bench{uuid.uuid4().hex[:6]}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def floor_kernel(tmp: Path) -> tuple[AsyncKernelManager, Any]:
    km = AsyncKernelManager(transport="ipc", kernel_name="python3")
    km.ip = str(tmp / "floor")
    await km.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return km, kc


async def floor_roundtrip(kc: Any, code: str = "1+1") -> float:
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    idle = reply = False
    while not (idle and reply):
        if not reply:
            msg = await kc.get_shell_msg(timeout=10)
            reply = msg["parent_header"].get("msg_id") == msg_id
        if not idle:
            msg = await kc.get_iopub_msg(timeout=10)
            idle = (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            )
    return time.perf_counter() - t0


async def floor_first_print(kc: Any) -> float:
    t0 = time.perf_counter()
    msg_id = kc.execute(FIRST_PRINT)
    first = None
    while True:
        msg = await kc.get_iopub_msg(timeout=10)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and first is None:
            first = time.perf_counter() - t0
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    await kc.get_shell_msg(timeout=10)
    assert first is not None
    return first


async def engine_first_print(session: KernelSession) -> float:
    t0 = time.perf_counter()
    first = None
    async for event in session.stream(FIRST_PRINT):
        if isinstance(event, StreamEvent) and first is None:
            first = time.perf_counter() - t0
    assert first is not None
    return first


async def engine_roundtrip(session: KernelSession) -> float:
    t0 = time.perf_counter()
    result = await session.execute("1+1")
    elapsed = time.perf_counter() - t0
    assert result.text == "2"
    return elapsed


async def bare_container_start(client: docker.DockerClient, image: str, run_dir: Path) -> float:
    """A hardened container (kernelhub's exact config) running stock ipykernel directly,
    driven by plain jupyter_client: the floor for a cold start."""
    from jupyter_client.asynchronous.client import AsyncKernelClient

    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="bench")
    sdir = SessionDir.create(
        run_dir / INSTANCE / spec.session_id,
        sandbox_uid=10001,
        sandbox_gid=10001,
        labels=spec.labels(INSTANCE),
        kernel_ipc_prefix=f"{IPC_DIR}/{SOCKET_PREFIX}",
    )
    config = container_config(
        spec, image=image, runtime="runc", session_dir=sdir, instance=INSTANCE,
        seccomp_profile=profile_json(),
    )  # fmt: skip
    config["command"] = [KERNEL_PYTHON, "-m", "ipykernel_launcher", "-f", CONNECTION_FILE,
                         "--HistoryManager.enabled=False"]  # fmt: skip
    t0 = time.perf_counter()
    container = client.containers.run(**config)
    kc = AsyncKernelClient()
    kc.load_connection_info(sdir.host_connection_info())
    while not sdir.sockets_present():
        await asyncio.sleep(0.005)
    kc.start_channels()
    # The same fast handshake the engine does (jupyter_client's wait_for_ready polls slower).
    while True:
        msg_id = kc.kernel_info()
        try:
            reply = await kc.get_shell_msg(timeout=0.5)
        except Exception:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    elapsed = time.perf_counter() - t0
    kc.stop_channels()
    container.remove(force=True)
    sdir.remove()
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--backend", default="docker", choices=["docker", "local"])
    parser.add_argument("--out", type=Path, default=Path("docs/bench-engine.md"))
    args = parser.parse_args()
    settings = load_settings(backend=args.backend)
    backend = make_backend(settings, instance=INSTANCE)
    tmp = Path(tempfile.mkdtemp(prefix="khb"))
    km, kc = await floor_kernel(tmp)
    session = await KernelSession.start(backend, SandboxSpec(session_id=uuid.uuid4().hex[:12]))
    rows: list[tuple[str, str, str, str, str]] = []
    try:
        for _ in range(20):  # warm both
            await floor_roundtrip(kc)
            await engine_roundtrip(session)
        floor_rt, engine_rt = [], []
        for _ in range(args.rounds):  # interleaved, so noise hits both alike
            floor_rt.append(await floor_roundtrip(kc))
            engine_rt.append(await engine_roundtrip(session))
        f, e = statistics.median(floor_rt), statistics.median(engine_rt)
        rows.append(("exec round trip `1+1` (median)", ms(e), ms(f), f"{e / f:.2f}×", "≤ 1.15×"))
        fq = sorted(floor_rt)[int(0.95 * len(floor_rt))]
        eq = sorted(engine_rt)[int(0.95 * len(engine_rt))]
        rows.append(("exec round trip `1+1` (p95)", ms(eq), ms(fq), f"{eq / fq:.2f}×", ""))

        floor_fp, engine_fp = [], []
        for _ in range(15):
            floor_fp.append(await floor_first_print(kc))
            engine_fp.append(await engine_first_print(session))
        f, e = statistics.median(floor_fp), statistics.median(engine_fp)
        rows.append(
            (
                "`print('x')` → first stream event (median)",
                ms(e),
                f"{ms(f)} (stock kernel)",
                f"{e / f:.2f}×",
                "≤ 20 ms",
            )
        )

        if args.backend == "docker":
            client = docker.from_env()
            image = settings.docker.image
            bare, ours = [], []
            for _ in range(args.starts):
                bare.append(await bare_container_start(client, image, settings.run_dir))
                t0 = time.perf_counter()
                s = await KernelSession.start(
                    backend, SandboxSpec(session_id=uuid.uuid4().hex[:12])
                )
                ours.append(time.perf_counter() - t0)
                await s.close()
            client.close()
            b, o = statistics.median(bare), statistics.median(ours)
            rows.append(
                (
                    "cold start: create → kernel ready (median)",
                    ms(o),
                    f"{ms(b)} (bare hardened container)",
                    f"{o / b:.2f}×",
                    "≤ 1.1×",
                )
            )
    finally:
        await session.close()
        await backend.reap_orphans()
        await backend.close()
        kc.stop_channels()
        await km.shutdown_kernel(now=True)

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"
    lines = [
        "# Engine benchmark",
        "",
        f"Machine: {machine}; backend: {args.backend}; {args.rounds} round trips, interleaved with the floor.",
        f"Generated by `python bench/engine.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| measurement | kernelhub | floor | ratio | target |",
        "|---|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} | {t} |" for a, b, c, d, t in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
